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
// Ring's. Message ids: the rings within a machine take 0 .. 2(L-1)p-1 (p: pieces of their largest
// segment), the rings across machines follow.
//
// Pipelining. The three phases run piece by piece, not one after the other: the ring across
// machines cuts each of its M segments of the shard into pieces of at most `chunk_elements`, and
// the rings within cut every shard the same way (RingSpec::parts = M), so that piece j of the ring
// across is exactly pieces j*M .. j*M+M-1 of the rings within. The schedule lists, column after
// column, the reduce-scatter within of column j+1, the allreduce across of column j and the
// allgather within of column j. So the first bytes cross the slow link once one column is reduced
// within the machine (not the whole bucket), and the last column's allgather within is all that
// remains after the link falls quiet. Both rings cut a part of four pieces or more tapered
// (RingSpec::taper): its first two pieces and its last two are a quarter and a half of
// chunk_elements, so the first column crosses sooner after the start, and the last column's
// allgather within is short. Column j's reduce-scatter within waits for the first piece of
// column j-2 from across (reduce_lead), and a piece finished on another machine goes round this one
// once the receive that brings it is done (in place, with the identity codec). The task graph,
// which prefers earlier steps of the list, follows that order; so does the serial executor.
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
  // 256 KiB of f32: a quarter of Ring's, because here a piece is also the unit of pipelining
  // between the phases (the link waits for the first column, and the last column's allgather
  // within waits for the link): smaller pieces start and end the link sooner.
  std::size_t chunk_elements = std::size_t{1} << 16;

  // How many columns the reduce-scatter within a machine may run ahead of the link: column j
  // starts once the first piece of column j - reduce_lead has come from across.
  static constexpr std::size_t reduce_lead = 2;

  // The rings within a machine and across machines join disjoint pairs of ranks (neighbours on one
  // machine; the same local rank on neighbouring machines), and each ring lists a pair's messages
  // in one order on both sides, piece after piece, so the schedule is a PairOrderedTopology.
  static constexpr bool posts_pairs_in_order = true;

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
    if (local_count == 1) {  // no hops within a machine: exactly Ring's schedule
      detail::RingPhases(out, {.members = std::move(same_local_rank),
                               .position = machine,
                               .range = bucket,
                               .chunk_elements = chunk_elements,
                               .form = codec.identity ? detail::RingForm::identity : detail::RingForm::encoded,
                               .receives_at_use = codec.receives_at_use})
          .allreduce();
      return out;
    }
    detail::RingPhases within(out, {.members = std::move(same_machine),
                                    .position = local,
                                    .range = bucket,
                                    .chunk_elements = chunk_elements,
                                    .form = detail::RingForm::raw,
                                    .parts = machine_count,
                                    .taper = true,
                                    .receives_at_use = codec.receives_at_use});
    detail::RingPhases across(out, {.members = std::move(same_local_rank),
                                    .position = machine,
                                    .range = within.owned_range(),
                                    .chunk_elements = chunk_elements,
                                    .first_message = detail::RingPhases::message_count(local_count, bucket, chunk_elements,
                                                                                       machine_count, /*taper=*/true),
                                    .form = codec.identity ? detail::RingForm::identity : detail::RingForm::encoded,
                                    .taper = true,
                                    .receives_at_use = codec.receives_at_use});
    // Piece by piece, in the order the data flows (ring_phases.hpp): piece j of the ring across
    // machines is pieces j*M .. j*M+M-1 of the rings within, piece j*M+t lying in segment t across.
    // The next column's reduce-scatter within the machine is listed before this column's exchange
    // across, so that the link always has the next piece coming and the first leaves after one
    // column, not the whole bucket.
    const auto column = [&](std::size_t j, auto&& phase) {
      for (int t = 0; t < machine_count; ++t) phase(j * static_cast<std::size_t>(machine_count) + static_cast<std::size_t>(t), t);
    };
    const auto reduce_within = [&](std::size_t j) {
      const std::uint32_t paced_by = j >= reduce_lead ? across.reduce_receive_step(0, j - reduce_lead) : no_step;
      column(j, [&](std::size_t p, int) { within.reduce_scatter_piece(p, paced_by); });
    };
    // A piece of the shard that arrives from across (in place, with the identity codec) goes on
    // round the machine once it has arrived.
    const auto gather_within = [&](std::size_t j) {
      column(j, [&](std::size_t p, int t) { within.allgather_piece(p, across.gather_receive_step(t, j)); });
    };
    const std::size_t columns = within.piece_count() / static_cast<std::size_t>(machine_count);
    if (columns > 0) reduce_within(0);
    for (std::size_t j = 0; j < columns; ++j) {
      if (j + 1 < columns) reduce_within(j + 1);
      across.allreduce_piece(j);
      gather_within(j);
    }
    return out;
  }
};

static_assert(TopologyPolicy<Hierarchical>);

}  // namespace gradsync::topology
