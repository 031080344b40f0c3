#pragma once
// topology::Ring — reduce-scatter then allgather around a ring of n ranks.
//
// The bucket is cut into n segments (sizes differ by at most one element). In reduce-scatter step
// k (0..n-2) rank r sends segment r-k to its right neighbour and adds segment r-k-1, arriving from
// its left, into its own copy; after n-1 steps rank r holds the complete sum of segment r+1, which
// it divides by n. Allgather then passes each finished segment once around the ring.
//
// Each segment is further cut into pieces of at most `chunk_elements`, and every step is issued
// per piece: piece j of step k+1 leaves as soon as piece j of step k has arrived and been added,
// so successive steps overlap on the wire instead of waiting for whole segments.
//
// With a codec that is not the identity, each reduce-scatter hop decodes, adds and re-encodes the
// partial sum; the finished segment is encoded once by its owner, which also decodes its own
// encoding so that every rank, owner included, ends with the same bits; allgather forwards the
// encoded bytes unchanged. Sums are always taken in the accumulation dtype, after decoding.
//
// Every element of a segment is summed in the same order on every rank (starting at the
// segment's index and going round), and only the owner sums it, so the average is bit-identical
// everywhere.

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/topology/ring_phases.hpp"

namespace gradsync::topology {

struct Ring {
  std::size_t chunk_elements = std::size_t{1} << 18;  // 1 MiB of f32
  // Each rank sends only to its right and receives only from its left, step by step and piece by
  // piece, so both ends of a pair post its messages in one order (PairOrderedTopology).
  static constexpr bool posts_pairs_in_order = true;
  // A plain allreduce over the group (FlatAllreduceTopology): NCCL's allreduce may stand in for it.
  static constexpr bool flat_allreduce = true;

  std::string describe() const { return fmt::format("ring(chunk={})", chunk_elements); }

  // Segment `index` of `parts` over `elements`: the first elements % parts segments get one more.
  static ElemRange segment(std::size_t elements, int parts, int index) { return detail::segment(elements, parts, index); }

  PipelineShape shape(const Group& group, std::size_t elements) const {
    return {.hops = 2 * (group.size() - 1), .fan_in = 1, .segment_elements = segment(elements, group.size(), 0).size()};
  }

  // Seconds to allreduce `elements` values of `value_bytes` each over `link` (topology::Auto): each
  // of the 2(n-1) hops moves a segment, in pieces, over a link that every other segment's hop of
  // the same step also needs, so pipelining the pieces hides compute, not transfers: every hop
  // pays a latency per piece and the segment's bytes.
  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& link) const {
    const PipelineShape s = shape(group, elements);
    if (s.hops == 0 || s.segment_elements == 0) return 0;
    const std::size_t chunk = std::max<std::size_t>(1, chunk_elements);
    const auto pieces = static_cast<double>((s.segment_elements + chunk - 1) / chunk);
    return s.hops * (pieces * link.latency + static_cast<double>(s.segment_elements * value_bytes) * link.seconds_per_byte);
  }

  // The steps are written in topology/ring_phases.hpp, which topology::Hierarchical shares.
  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    Schedule out;
    out.contributors = group.size();
    std::vector<int> members(static_cast<std::size_t>(group.size()));
    std::iota(members.begin(), members.end(), 0);
    detail::RingPhases(out, {.members = std::move(members),
                             .position = group.rank,
                             .range = {0, elements},
                             .chunk_elements = chunk_elements,
                             .form = codec.identity ? detail::RingForm::identity : detail::RingForm::encoded,
                             .receives_at_use = codec.receives_at_use})
        .allreduce();
    return out;
  }
};

static_assert(PipelineTopology<Ring>);

}  // namespace gradsync::topology
