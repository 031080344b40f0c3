#pragma once
// topology::Hierarchical — a ring within each machine, a ring across machines, a ring within
// again: for several ranks per machine, where the links inside a machine are fast and the links
// between machines are slow.
//
// The group is M machines of L = `ranks_per_machine` ranks, numbered machine-major: group indices
// m*L .. m*L+L-1 are machine m's ranks, local ranks 0..L-1 (the numbering every launcher uses,
// node_rank * L + local_rank). A group whose size L does not divide is an Error.
//
//   1. Within each machine, a ring reduce-scatter over the whole bucket (ring.hpp's algorithm)
//      among the L local ranks, uncompressed whatever the codec: values travel in the accumulation
//      dtype, sent in place and received into raw slots (Schedule::slot_raw). Afterwards local
//      rank i holds its machine's sum of shard i+1 (mod L), where shard s is Ring::segment(bucket
//      elements, L, s).
//   2. Across machines, the M ranks with the same local rank allreduce that shard as a ring
//      (reduce-scatter, average, allgather), through the codec as topology::Ring does: each hop
//      decodes, adds and re-encodes; the finished segment is encoded once by its owner, which
//      decodes its own encoding, and allgather forwards those bytes. The average divides by the
//      whole group, n = M*L (Schedule::contributors).
//   3. Within each machine, a ring allgather of the shards, uncompressed, in place.
//
// With M = 1 phase 2 has no hops (the shard is averaged, and with a lossy codec passed once through
// it, as a ring of one does); with L = 1 phases 1 and 3 have none and the schedule is exactly
// Ring's. Each ring cuts its segments into pieces of at most `chunk_elements`, pipelined as in
// Ring. Message ids: the rings within a machine take 0 .. 2(L-1)p-1 (p: pieces of their largest
// segment), the rings across machines follow.
//
// Summation order. Element e of shard s lies in segment t of phase 2's split of the shard into M.
// Machine m's sum is S_m = (..((x[m,s] + x[m,s+1]) + x[m,s+2]) + .. + x[m,s-1]) over local ranks
// (indices mod L), summed by local rank s-1 alone. Across machines, starting at machine t and going
// round: P_t = S_t, then P = S_m + decode(encode(P)) for m = t+1, .., t-1 (mod M; with the
// identity codec decode(encode(P)) = P), summed by machine t-1's local rank s-1 alone, which
// divides by n and, with a codec, replaces the result by decode(encode(result)). Everyone else
// copies those bits, so every rank ends bit-identical.
//
// Not a PipelineTopology: selective compression's cost model (engine/cost_model.hpp) knows one
// kind of link, one transfer cost per byte, and this schedule's hops cross two very different ones
// (2(L-1) fast uncompressed hops within a machine, 2(M-1) slow compressed ones across), so no
// PipelineShape would describe it honestly.

#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/error.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/topology/ring_phases.hpp"

namespace gradsync::topology {

struct Hierarchical {
  int ranks_per_machine = 0;                          // L, required: at least 1, dividing the group size
  std::size_t chunk_elements = std::size_t{1} << 18;  // 1 MiB of f32

  std::string describe() const {
    return fmt::format("hierarchical(ranks-per-machine={}, chunk={})", ranks_per_machine, chunk_elements);
  }

  // M, the number of machines; throws if L does not divide the group.
  int machines(const Group& group) const {
    if (ranks_per_machine < 1)
      throw Error(ErrorKind::invalid_argument, {.operation = "hierarchical topology"},
                  fmt::format("ranks_per_machine is {}: set it to the ranks on each machine (at least 1)",
                              ranks_per_machine));
    if (group.size() % ranks_per_machine != 0)
      throw Error(ErrorKind::invalid_argument, {.operation = "hierarchical topology"},
                  fmt::format("a group of {} ranks is not whole machines of {} ranks each: the group size must be "
                              "a multiple of ranks_per_machine",
                              group.size(), ranks_per_machine));
    return group.size() / ranks_per_machine;
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    const int machine_count = machines(group);
    const int local_count = ranks_per_machine;
    const int machine = group.rank / local_count;
    const int local = group.rank % local_count;
    Schedule out;
    out.contributors = group.size();

    std::vector<int> same_machine, same_local_rank;
    for (int i = 0; i < local_count; ++i) same_machine.push_back(machine * local_count + i);
    for (int m = 0; m < machine_count; ++m) same_local_rank.push_back(m * local_count + local);

    const ElemRange bucket{0, elements};
    detail::RingPhases within(out, {.members = std::move(same_machine),
                                    .position = local,
                                    .range = bucket,
                                    .chunk_elements = chunk_elements,
                                    .form = detail::RingForm::raw});
    within.reduce_scatter();
    // With the identity codec phase 2's allgather would receive in place, and phase 3's in-place
    // sends of the shard would have to wait for those receives (an `after` names only one); into
    // slots, a copy ordered by the list suffices. With one rank per machine there is no phase 3,
    // and the schedule stays Ring's.
    detail::RingPhases(out, {.members = std::move(same_local_rank),
                             .position = machine,
                             .range = within.owned_range(),
                             .chunk_elements = chunk_elements,
                             .first_message = detail::RingPhases::message_count(local_count, bucket, chunk_elements),
                             .form = codec.identity ? detail::RingForm::identity : detail::RingForm::encoded,
                             .gather_into_slots = local_count > 1})
        .allreduce();
    within.allgather();
    return out;
  }
};

static_assert(TopologyPolicy<Hierarchical>);

}  // namespace gradsync::topology
