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
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"

namespace gradsync::topology {

struct Ring {
  std::size_t chunk_elements = std::size_t{1} << 18;  // 1 MiB of f32

  std::string describe() const { return fmt::format("ring(chunk={})", chunk_elements); }

  // Segment `index` of `parts` over `elements`: the first elements % parts segments get one more.
  static ElemRange segment(std::size_t elements, int parts, int index) {
    const auto p = static_cast<std::size_t>(parts);
    const auto i = static_cast<std::size_t>(index);
    const std::size_t base = elements / p;
    const std::size_t extra = elements % p;
    const std::size_t begin = i * base + std::min(i, extra);
    return {begin, begin + base + (i < extra ? 1 : 0)};
  }

  PipelineShape shape(const Group& group, std::size_t elements) const {
    return {.hops = 2 * (group.size() - 1), .fan_in = 1, .segment_elements = segment(elements, group.size(), 0).size()};
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    return Builder(*this, group, elements, codec).build();
  }

 private:
  class Builder {
   public:
    Builder(const Ring& ring, const Group& group, std::size_t elements, CodecTraits codec)
        : n_(group.size()),
          r_(group.rank),
          elements_(elements),
          chunk_(std::max<std::size_t>(1, ring.chunk_elements)),
          identity_(codec.identity) {
      const ElemRange largest = segment(elements_, n_, 0);
      max_pieces_ = pieces(largest);
    }

    Schedule build() {
      const int left = wrap(r_ - 1);
      const int right = wrap(r_ + 1);
      const int owned = wrap(r_ + 1);
      const int steps = n_ - 1;
      schedule_.contributors = n_;

      // Reduce-scatter receives go to fresh slots and are posted first: nothing else uses them.
      std::vector<std::vector<std::uint32_t>> rs_recv(static_cast<std::size_t>(steps));
      for (int k = 0; k < steps; ++k)
        for_pieces(wrap(r_ - k - 1), [&](std::size_t j, ElemRange piece) {
          rs_recv[k].push_back(add({.op = Step::Op::recv, .peer = left, .message = message(0, k, j), .range = piece,
                                    .slot = new_slot(piece)}));
        });
      // Encoded allgather receives also get fresh slots and can be posted up front. In place
      // (identity codecs) they overwrite values this rank still sends, so they wait for that send.
      std::vector<std::vector<std::uint32_t>> ag_recv(static_cast<std::size_t>(steps));
      if (!identity_)
        for (int k = 0; k < steps; ++k)
          for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
            ag_recv[k].push_back(add({.op = Step::Op::recv, .peer = left, .message = message(1, k, j), .range = piece,
                                      .slot = new_slot(piece)}));
          });

      // Reduce-scatter: add what arrived for this segment at step k-1, then pass it on.
      std::vector<std::vector<std::uint32_t>> rs_send(static_cast<std::size_t>(steps));
      for (int k = 0; k < steps; ++k)
        for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
          if (k > 0) add_received(rs_recv[k - 1][j], piece);
          rs_send[k].push_back(send_values(piece, right, message(0, k, j), no_step));
        });

      // The owned segment: last contribution, average, and (encoded) first allgather hop.
      for_pieces(owned, [&](std::size_t j, ElemRange piece) {
        if (steps > 0) add_received(rs_recv[steps - 1][j], piece);
        add({.op = Step::Op::average, .range = piece});
        std::uint32_t slot = no_slot;
        if (!identity_) {
          slot = new_slot(piece);
          add({.op = Step::Op::encode, .range = piece, .slot = slot});
          add({.op = Step::Op::decode_copy, .range = piece, .slot = slot});
        }
        if (steps > 0) add({.op = Step::Op::send, .peer = right, .message = message(1, 0, j), .range = piece, .slot = slot});
      });

      if (identity_)
        for (int k = 0; k < steps; ++k)
          for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
            ag_recv[k].push_back(add({.op = Step::Op::recv, .peer = left, .message = message(1, k, j), .range = piece,
                                      .after = rs_send[k][j]}));
          });

      // Allgather: take each finished piece and forward it, unless the right neighbour owns it.
      for (int k = 0; k < steps; ++k)
        for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
          const std::uint32_t slot = schedule_.steps[ag_recv[k][j]].slot;
          if (!identity_) add({.op = Step::Op::decode_copy, .range = piece, .slot = slot, .after = ag_recv[k][j]});
          if (k + 1 < steps)
            add({.op = Step::Op::send, .peer = right, .message = message(1, k + 1, j), .range = piece, .slot = slot,
                 .after = ag_recv[k][j]});
        });
      return std::move(schedule_);
    }

   private:
    int wrap(int i) const { return ((i % n_) + n_) % n_; }

    std::size_t pieces(ElemRange seg) const { return (seg.size() + chunk_ - 1) / chunk_; }

    template <class F>
    void for_pieces(int seg_index, F&& f) const {
      const ElemRange seg = segment(elements_, n_, seg_index);
      for (std::size_t j = 0, count = pieces(seg); j < count; ++j) {
        const std::size_t begin = seg.begin + j * chunk_;
        f(j, ElemRange{begin, std::min(seg.end, begin + chunk_)});
      }
    }

    // Message ids: (phase, step, piece) numbered densely; both ends compute the same one.
    std::uint32_t message(int phase, int step, std::size_t piece) const {
      return static_cast<std::uint32_t>((static_cast<std::size_t>(phase * (n_ - 1) + step)) * max_pieces_ + piece);
    }

    std::uint32_t add(Step step) {
      schedule_.steps.push_back(step);
      return static_cast<std::uint32_t>(schedule_.steps.size() - 1);
    }

    std::uint32_t new_slot(ElemRange piece) {
      schedule_.slot_elements.push_back(piece.size());
      return static_cast<std::uint32_t>(schedule_.slot_elements.size() - 1);
    }

    void add_received(std::uint32_t recv, ElemRange piece) {
      add({.op = Step::Op::decode_add, .range = piece, .slot = schedule_.steps[recv].slot, .after = recv});
    }

    std::uint32_t send_values(ElemRange piece, int peer, std::uint32_t msg, std::uint32_t after) {
      std::uint32_t slot = no_slot;
      if (!identity_) {
        slot = new_slot(piece);
        add({.op = Step::Op::encode, .range = piece, .slot = slot});
      }
      return add({.op = Step::Op::send, .peer = peer, .message = msg, .range = piece, .slot = slot, .after = after});
    }

    int n_;
    int r_;
    std::size_t elements_;
    std::size_t chunk_;
    bool identity_;
    std::size_t max_pieces_ = 0;
    Schedule schedule_;
  };
};

static_assert(PipelineTopology<Ring>);

}  // namespace gradsync::topology
