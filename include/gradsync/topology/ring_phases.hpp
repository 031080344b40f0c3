#pragma once
// topology::detail::RingPhases — the ring algorithm written once, for the topologies built from it.
//
// It appends one ring's steps to a Schedule. The ring is a list of group indices (each member
// sends to the next, the last to the first); it reduces a sub-range of the bucket; its message ids
// start at a base, so several rings can share one schedule; and its values travel through the
// codec, as they are for an identity codec, or raw (Schedule::slot_raw) whatever the codec.
//
//   allreduce()       reduce-scatter, average, allgather: topology::Ring is this over the whole
//                     group and bucket (ring.hpp explains the arithmetic and the summation order).
//   reduce_scatter()  leaves this rank's owned segment (owned_range()) summed over the ring, not
//                     averaged;
//   allgather()       then passes every member's owned segment, final by then, round the ring.
//                     Call it on the object that ran reduce_scatter(): receives in place wait for
//                     the reduce-scatter send of the same piece.
//
// topology::Hierarchical runs reduce_scatter() and allgather() of a ring round one machine's ranks
// with allreduce() of a ring across machines in between.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gradsync/schedule.hpp"

namespace gradsync::topology::detail {

// Segment `index` of `parts` over `elements`: the first elements % parts segments get one more.
inline ElemRange segment(std::size_t elements, int parts, int index) {
  const auto p = static_cast<std::size_t>(parts);
  const auto i = static_cast<std::size_t>(index);
  const std::size_t base = elements / p;
  const std::size_t extra = elements % p;
  const std::size_t begin = i * base + std::min(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

// How the values of one ring travel.
enum class RingForm : std::uint8_t {
  encoded,   // through a codec that is not the identity: each reduce-scatter hop encodes its partial
             // sum; the owner encodes the result once, decodes its own encoding, and allgather
             // forwards those bytes unchanged
  identity,  // an identity codec: sends go from the bucket in place, reduce-scatter receives land
             // in slots the codec decodes, allgather receives land in place
  raw,       // as identity, but the slots are raw: plain values in the accumulation dtype, whatever
             // the codec (Schedule::slot_raw)
};

struct RingSpec {
  std::vector<int> members;         // group indices round the ring; this rank is members[position]
  int position = 0;
  ElemRange range;                  // the part of the bucket the ring reduces
  std::size_t chunk_elements = 1;   // pieces of at most this many elements (0 counts as 1)
  std::uint32_t first_message = 0;  // ids taken: first_message + [0, message_count(...))
  RingForm form = RingForm::identity;
  // Not encoded: allgather receives land in fresh slots and are copied out (decode_copy) instead of
  // landing in place. A later step that sends the owned segment in place then needs no `after` on
  // those receives (list order covers a copy, not a transfer).
  bool gather_into_slots = false;
};

class RingPhases {
 public:
  RingPhases(Schedule& out, RingSpec spec)
      : out_(out),
        spec_(std::move(spec)),
        n_(static_cast<int>(spec_.members.size())),
        r_(spec_.position),
        chunk_(std::max<std::size_t>(1, spec_.chunk_elements)),
        encoded_(spec_.form == RingForm::encoded),
        raw_slots_(spec_.form == RingForm::raw),
        gather_in_place_(!encoded_ && !spec_.gather_into_slots),
        max_pieces_(pieces(segment_of(0))),
        rs_recv_(static_cast<std::size_t>(n_ - 1)),
        rs_send_(static_cast<std::size_t>(n_ - 1)),
        ag_recv_(static_cast<std::size_t>(n_ - 1)) {}

  // Message ids a ring of `members` ranks over `range` in pieces of `chunk_elements` takes.
  static std::uint32_t message_count(int members, ElemRange range, std::size_t chunk_elements) {
    const std::size_t chunk = std::max<std::size_t>(1, chunk_elements);
    const std::size_t largest = segment(range.size(), members, 0).size();
    return static_cast<std::uint32_t>(2 * static_cast<std::size_t>(members - 1) * ((largest + chunk - 1) / chunk));
  }

  // The segment this rank ends reduce-scatter with: the one after its own position.
  ElemRange owned_range() const { return segment_of(wrap(r_ + 1)); }

  void allreduce() {
    post_reduce_receives();
    post_gather_receives();
    reduce_sends();
    owned_pieces(/*sum=*/true, /*average=*/true, /*gather=*/true);
    gather_receives_in_place();
    gather_forward();
  }

  void reduce_scatter() {
    post_reduce_receives();
    reduce_sends();
    owned_pieces(/*sum=*/true, /*average=*/false, /*gather=*/false);
  }

  void allgather() {
    post_gather_receives();
    owned_pieces(/*sum=*/false, /*average=*/false, /*gather=*/true);
    gather_receives_in_place();
    gather_forward();
  }

 private:
  int wrap(int i) const { return ((i % n_) + n_) % n_; }
  int left() const { return spec_.members[static_cast<std::size_t>(wrap(r_ - 1))]; }
  int right() const { return spec_.members[static_cast<std::size_t>(wrap(r_ + 1))]; }
  int steps() const { return n_ - 1; }

  ElemRange segment_of(int index) const {
    const ElemRange s = segment(spec_.range.size(), n_, index);
    return {spec_.range.begin + s.begin, spec_.range.begin + s.end};
  }

  std::size_t pieces(ElemRange seg) const { return (seg.size() + chunk_ - 1) / chunk_; }

  template <class F>
  void for_pieces(int seg_index, F&& f) const {
    const ElemRange seg = segment_of(seg_index);
    for (std::size_t j = 0, count = pieces(seg); j < count; ++j) {
      const std::size_t begin = seg.begin + j * chunk_;
      f(j, ElemRange{begin, std::min(seg.end, begin + chunk_)});
    }
  }

  // Message ids: (phase 0 = reduce-scatter, 1 = allgather; step; piece) numbered densely from the
  // base; both ends compute the same one.
  std::uint32_t message(int phase, int step, std::size_t piece) const {
    return spec_.first_message +
           static_cast<std::uint32_t>(static_cast<std::size_t>(phase * (n_ - 1) + step) * max_pieces_ + piece);
  }

  std::uint32_t add(Step step) {
    out_.steps.push_back(step);
    return static_cast<std::uint32_t>(out_.steps.size() - 1);
  }

  std::uint32_t new_slot(ElemRange piece) {
    out_.slot_elements.push_back(piece.size());
    if (raw_slots_ || !out_.slot_raw.empty()) {  // slot_raw stays empty until a raw slot appears
      out_.slot_raw.resize(out_.slot_elements.size());
      out_.slot_raw.back() = raw_slots_;
    }
    return static_cast<std::uint32_t>(out_.slot_elements.size() - 1);
  }

  // Reduce-scatter receives go to fresh slots and are posted first: nothing else uses them.
  void post_reduce_receives() {
    for (int k = 0; k < steps(); ++k)
      for_pieces(wrap(r_ - k - 1), [&](std::size_t j, ElemRange piece) {
        rs_recv_[k].push_back(
            add({.op = Step::Op::recv, .peer = left(), .message = message(0, k, j), .range = piece, .slot = new_slot(piece)}));
      });
  }

  // Allgather receives into slots can be posted up front too. In place they overwrite values this
  // rank still sends, so they wait for that send (gather_receives_in_place).
  void post_gather_receives() {
    if (gather_in_place_) return;
    for (int k = 0; k < steps(); ++k)
      for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
        ag_recv_[k].push_back(
            add({.op = Step::Op::recv, .peer = left(), .message = message(1, k, j), .range = piece, .slot = new_slot(piece)}));
      });
  }

  // Reduce-scatter: add what arrived for this segment at step k-1, then pass it on.
  void reduce_sends() {
    for (int k = 0; k < steps(); ++k)
      for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
        if (k > 0) add_received(rs_recv_[k - 1][j], piece);
        std::uint32_t slot = no_slot;
        if (encoded_) {
          slot = new_slot(piece);
          add({.op = Step::Op::encode, .range = piece, .slot = slot});
        }
        rs_send_[k].push_back(
            add({.op = Step::Op::send, .peer = right(), .message = message(0, k, j), .range = piece, .slot = slot}));
      });
  }

  // The owned segment: the last contribution, the average, and (encoded once) the first allgather
  // hop, as asked.
  void owned_pieces(bool sum, bool average, bool gather) {
    for_pieces(wrap(r_ + 1), [&](std::size_t j, ElemRange piece) {
      if (sum && steps() > 0) add_received(rs_recv_[steps() - 1][j], piece);
      if (average) add({.op = Step::Op::average, .range = piece});
      if (!gather) return;
      std::uint32_t slot = no_slot;
      if (encoded_) {
        slot = new_slot(piece);
        add({.op = Step::Op::encode, .range = piece, .slot = slot});
        add({.op = Step::Op::decode_copy, .range = piece, .slot = slot});
      }
      if (steps() > 0)
        add({.op = Step::Op::send, .peer = right(), .message = message(1, 0, j), .range = piece, .slot = slot});
    });
  }

  void gather_receives_in_place() {
    if (!gather_in_place_) return;
    for (int k = 0; k < steps(); ++k)
      for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
        ag_recv_[k].push_back(add(
            {.op = Step::Op::recv, .peer = left(), .message = message(1, k, j), .range = piece, .after = rs_send_[k][j]}));
      });
  }

  // Allgather: take each finished piece and forward it, unless the right neighbour owns it.
  void gather_forward() {
    for (int k = 0; k < steps(); ++k)
      for_pieces(wrap(r_ - k), [&](std::size_t j, ElemRange piece) {
        const std::uint32_t slot = out_.steps[ag_recv_[k][j]].slot;
        if (slot != no_slot) add({.op = Step::Op::decode_copy, .range = piece, .slot = slot, .after = ag_recv_[k][j]});
        if (k + 1 < steps())
          add({.op = Step::Op::send, .peer = right(), .message = message(1, k + 1, j), .range = piece, .slot = slot,
               .after = ag_recv_[k][j]});
      });
  }

  void add_received(std::uint32_t recv, ElemRange piece) {
    add({.op = Step::Op::decode_add, .range = piece, .slot = out_.steps[recv].slot, .after = recv});
  }

  Schedule& out_;
  RingSpec spec_;
  int n_;
  int r_;
  std::size_t chunk_;
  bool encoded_;
  bool raw_slots_;
  bool gather_in_place_;
  std::size_t max_pieces_;
  // Per step k, per piece: the steps later phases refer to.
  std::vector<std::vector<std::uint32_t>> rs_recv_, rs_send_, ag_recv_;
};

}  // namespace gradsync::topology::detail
