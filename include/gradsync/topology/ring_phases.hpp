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
// Those list the steps phase by phase, each phase step by step, receives first. A topology that
// interleaves rings lists them piece by piece instead: for each piece p < piece_count() whichever
// of reduce_scatter_piece(p), allreduce_piece(p) and allgather_piece(p) it needs, in the order its
// data flows, each with its own receives. Either order computes the same values
// (each element meets the same additions in the same order); the order only says what is urgent,
// to the serial executor, which walks the list, and to the task graph, which prefers earlier steps.
//
// topology::Hierarchical runs reduce_scatter and allgather of a ring round one machine's ranks with
// an allreduce of a ring across machines in between, piece by piece.

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
  // Each segment is cut into this many parts (segment()) and each part into pieces; piece p is
  // piece p / parts of part p % parts. With `parts` = the machine count, a machine ring's pieces of
  // a shard are exactly the pieces of the ring across machines that reduces that shard next.
  int parts = 1;
  // Cut a part's first two and last two pieces to a quarter and a half of chunk_elements (parts of
  // at least four chunks only; the rest in even pieces of at most chunk_elements). For a ring that
  // paces another: the other ring waits for the first small pieces, not a whole chunk, and the last
  // ones finish sooner after it. Rings whose pieces must line up have to agree on it.
  bool taper = false;
  // List each step's receives just before the step's first use of them instead of up front
  // (CodecTraits::receives_at_use: transport::Nccl): allreduce() a step's receives of every piece
  // at once, the piece-by-piece functions the piece's own.
  bool receives_at_use = false;
};

// How a part of a segment is cut into pieces (RingSpec::chunk_elements, RingSpec::taper).
struct PieceCut {
  std::size_t chunk = 1;
  bool taper = false;

  bool tapers(std::size_t part) const { return taper && chunk >= 4 && part >= 4 * chunk; }
  std::size_t quarter() const { return chunk / 4; }
  std::size_t half() const { return chunk / 2; }
  // The even pieces between the tapered ends.
  std::size_t middle_pieces(std::size_t middle) const { return (middle + chunk - 1) / chunk; }

  // Pieces of a part of `part` elements; more elements never give fewer pieces.
  std::size_t count(std::size_t part) const {
    if (!tapers(part)) return (part + chunk - 1) / chunk;
    return 4 + middle_pieces(part - 2 * (quarter() + half()));
  }

  // Piece q of a part of `part` elements, relative to the part; empty if q >= count(part).
  ElemRange piece(std::size_t part, std::size_t q) const {
    if (q >= count(part)) return {};
    if (!tapers(part)) return {q * chunk, std::min(part, (q + 1) * chunk)};
    const std::size_t head = quarter() + half();
    const std::size_t middle = part - 2 * head;
    const std::size_t n = middle_pieces(middle);
    if (q == 0) return {0, quarter()};
    if (q == 1) return {quarter(), head};
    if (q < 2 + n) {
      const ElemRange m = segment(middle, static_cast<int>(n), static_cast<int>(q - 2));
      return {head + m.begin, head + m.end};
    }
    const std::size_t tail = part - head;
    return q == 2 + n ? ElemRange{tail, tail + half()} : ElemRange{tail + half(), part};
  }
};

class RingPhases {
 public:
  RingPhases(Schedule& out, RingSpec spec)
      : out_(out),
        spec_(std::move(spec)),
        n_(static_cast<int>(spec_.members.size())),
        r_(spec_.position),
        cut_{.chunk = std::max<std::size_t>(1, spec_.chunk_elements), .taper = spec_.taper},
        parts_(std::max(1, spec_.parts)),
        encoded_(spec_.form == RingForm::encoded),
        raw_slots_(spec_.form == RingForm::raw),
        gather_in_place_(!encoded_),
        max_pieces_(most_pieces(spec_.range, n_, parts_, cut_)),
        rs_recv_(table()),
        rs_send_(table()),
        ag_recv_(table()) {}

  // Message ids a ring of `members` ranks over `range` in pieces of `chunk_elements` takes.
  static std::uint32_t message_count(int members, ElemRange range, std::size_t chunk_elements, int parts = 1,
                                     bool taper = false) {
    const std::size_t pieces =
        most_pieces(range, members, std::max(1, parts), {.chunk = std::max<std::size_t>(1, chunk_elements), .taper = taper});
    return static_cast<std::uint32_t>(2 * static_cast<std::size_t>(members - 1) * pieces);
  }

  // The segment this rank ends reduce-scatter with: the one after its own position.
  ElemRange owned_range() const { return segment_of(wrap(r_ + 1)); }

  // ---- phase by phase ----

  void allreduce() {
    if (spec_.receives_at_use) return allreduce_receiving_at_use();
    post_reduce_receives();
    post_gather_receives();
    for_steps([&](int k, std::size_t p) { reduce_send(k, p); });
    for_pieces([&](std::size_t p) { owned_piece(p, /*sum=*/true, /*average=*/true, /*gather=*/true); });
    for_steps([&](int k, std::size_t p) { gather_receive_in_place(k, p); });
    for_steps([&](int k, std::size_t p) { gather_forward(k, p); });
  }

  // The same steps, each step's receives listed just before the step that first uses them, so
  // that a step's sends and the receives pairing with the neighbours' sends of that step are
  // handed to an all-or-nothing group together.
  void allreduce_receiving_at_use() {
    for_steps([&](int k, std::size_t p) {
      if (k > 0 && p == 0) for_pieces([&](std::size_t q) { post_reduce_receive(k - 1, q); });
      reduce_send(k, p);
    });
    if (steps() > 0) for_pieces([&](std::size_t q) { post_reduce_receive(steps() - 1, q); });
    for_pieces([&](std::size_t p) { owned_piece(p, /*sum=*/true, /*average=*/true, /*gather=*/true); });
    for_steps([&](int k, std::size_t p) {
      if (p == 0)
        for_pieces([&](std::size_t q) {
          post_gather_receive(k, q);
          gather_receive_in_place(k, q);
        });
      gather_forward(k, p);
    });
  }

  void reduce_scatter() {
    post_reduce_receives();
    for_steps([&](int k, std::size_t p) { reduce_send(k, p); });
    for_pieces([&](std::size_t p) { owned_piece(p, /*sum=*/true, /*average=*/false, /*gather=*/false); });
  }

  void allgather() {
    post_gather_receives();
    for_pieces([&](std::size_t p) { owned_piece(p, /*sum=*/false, /*average=*/false, /*gather=*/true); });
    for_steps([&](int k, std::size_t p) { gather_receive_in_place(k, p); });
    for_steps([&](int k, std::size_t p) { gather_forward(k, p); });
  }

  // ---- piece by piece ----

  // Piece numbers run below this (some segments may lack the last ones; those steps are skipped).
  std::size_t piece_count() const noexcept { return max_pieces_; }

  // Each posts the piece's own receives first, then its steps (with RingSpec::receives_at_use,
  // each receive just before the step that first uses it). `after`, if given, holds back the
  // piece's first send until that step is done (a pace set by another ring).
  void reduce_scatter_piece(std::size_t p, std::uint32_t after = no_step) {
    if (!spec_.receives_at_use)
      for (int k = 0; k < steps(); ++k) post_reduce_receive(k, p);
    reduce_sends(p, after);
    owned_piece(p, /*sum=*/true, /*average=*/false, /*gather=*/false);
  }

  void allreduce_piece(std::size_t p) {
    if (!spec_.receives_at_use) {
      for (int k = 0; k < steps(); ++k) post_reduce_receive(k, p);
      for (int k = 0; k < steps(); ++k) post_gather_receive(k, p);
    }
    reduce_sends(p);
    owned_piece(p, /*sum=*/true, /*average=*/true, /*gather=*/true);
    gather_piece(p);
  }

  // The receive of reduce-scatter step k's piece p, once listed; no_step if the ring has no such
  // step or piece.
  std::uint32_t reduce_receive_step(int k, std::size_t p) const {
    return k < steps() && p < max_pieces_ ? rs_recv_[k][p] : no_step;
  }

  // `after`, if given, holds back the send of this rank's own piece until that step is done (the
  // receive that brings the piece's final values from another ring).
  void allgather_piece(std::size_t p, std::uint32_t after = no_step) {
    if (!spec_.receives_at_use)
      for (int k = 0; k < steps(); ++k) post_gather_receive(k, p);
    owned_piece(p, /*sum=*/false, /*average=*/false, /*gather=*/true, after);
    gather_piece(p);
  }

  // The allgather receive that brings piece p of segment `index` to this rank, once listed; no_step
  // for the segment this rank owns, which it does not receive, or a missing piece.
  std::uint32_t gather_receive_step(int index, std::size_t p) const {
    const int k = wrap(r_ - index);
    return k < steps() && p < max_pieces_ ? ag_recv_[k][p] : no_step;
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

  // The most pieces any segment has: segment 0 is the largest, its part 0 the largest part.
  static std::size_t most_pieces(ElemRange range, int members, int parts, PieceCut cut) {
    const std::size_t largest_part = segment(segment(range.size(), members, 0).size(), parts, 0).size();
    return static_cast<std::size_t>(parts) * cut.count(largest_part);
  }

  // Piece `p` of segment `seg_index`; empty if that segment has no such piece.
  ElemRange piece_of(int seg_index, std::size_t p) const {
    const ElemRange seg = segment_of(seg_index);
    const auto parts = static_cast<std::size_t>(parts_);
    const ElemRange part = segment(seg.size(), parts_, static_cast<int>(p % parts));
    const ElemRange piece = cut_.piece(part.size(), p / parts);
    if (piece.empty()) return {};
    return {seg.begin + part.begin + piece.begin, seg.begin + part.begin + piece.end};
  }

  std::vector<std::vector<std::uint32_t>> table() const {
    return std::vector<std::vector<std::uint32_t>>(static_cast<std::size_t>(std::max(0, n_ - 1)),
                                                   std::vector<std::uint32_t>(max_pieces_, no_step));
  }

  template <class F>
  void for_pieces(F&& f) const {
    for (std::size_t p = 0; p < max_pieces_; ++p) f(p);
  }
  // Step by step, each step piece by piece.
  template <class F>
  void for_steps(F&& f) const {
    for (int k = 0; k < steps(); ++k)
      for (std::size_t p = 0; p < max_pieces_; ++p) f(k, p);
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
    for_steps([&](int k, std::size_t p) { post_reduce_receive(k, p); });
  }

  // Allgather receives into slots can be posted up front too. In place they overwrite values this
  // rank still sends, so they wait for that send and come with their piece (gather_receive_in_place).
  void post_gather_receives() {
    for_steps([&](int k, std::size_t p) { post_gather_receive(k, p); });
  }

  void post_reduce_receive(int k, std::size_t p) {
    const ElemRange piece = piece_of(wrap(r_ - k - 1), p);
    if (!piece.empty())
      rs_recv_[k][p] =
          add({.op = Step::Op::recv, .peer = left(), .message = message(0, k, p), .range = piece, .slot = new_slot(piece)});
  }

  void post_gather_receive(int k, std::size_t p) {
    const ElemRange piece = piece_of(wrap(r_ - k), p);
    if (!gather_in_place_ && !piece.empty())
      ag_recv_[k][p] =
          add({.op = Step::Op::recv, .peer = left(), .message = message(1, k, p), .range = piece, .slot = new_slot(piece)});
  }

  // Reduce-scatter step k: add what arrived for this segment at step k-1, then pass it on.
  void reduce_send(int k, std::size_t p, std::uint32_t after = no_step) {
    const ElemRange piece = piece_of(wrap(r_ - k), p);
    if (piece.empty()) return;
    if (k > 0) add_received(rs_recv_[k - 1][p], piece);
    std::uint32_t slot = no_slot;
    if (encoded_) {
      slot = new_slot(piece);
      add({.op = Step::Op::encode, .range = piece, .slot = slot});
    }
    rs_send_[k][p] =
        add({.op = Step::Op::send, .peer = right(), .message = message(0, k, p), .range = piece, .slot = slot, .after = after});
  }

  // A piece of the owned segment: the last contribution, the average, and (encoded once) the
  // first allgather hop, as asked.
  void owned_piece(std::size_t p, bool sum, bool average, bool gather, std::uint32_t send_after = no_step) {
    const ElemRange piece = piece_of(wrap(r_ + 1), p);
    if (piece.empty()) return;
    if (sum && steps() > 0) add_received(rs_recv_[steps() - 1][p], piece);
    if (average) add({.op = Step::Op::average, .range = piece});
    if (!gather) return;
    std::uint32_t slot = no_slot;
    if (encoded_) {
      slot = new_slot(piece);
      add({.op = Step::Op::encode, .range = piece, .slot = slot});
      add({.op = Step::Op::decode_copy, .range = piece, .slot = slot});
    }
    if (steps() > 0)
      add({.op = Step::Op::send, .peer = right(), .message = message(1, 0, p), .range = piece, .slot = slot,
           .after = send_after});
  }

  void gather_receive_in_place(int k, std::size_t p) {
    if (!gather_in_place_) return;
    const ElemRange piece = piece_of(wrap(r_ - k), p);
    if (piece.empty()) return;
    ag_recv_[k][p] =
        add({.op = Step::Op::recv, .peer = left(), .message = message(1, k, p), .range = piece, .after = rs_send_[k][p]});
  }

  // Allgather step k: take the finished piece and forward it, unless the right neighbour owns it.
  void gather_forward(int k, std::size_t p) {
    const ElemRange piece = piece_of(wrap(r_ - k), p);
    if (piece.empty()) return;
    const std::uint32_t slot = out_.steps[ag_recv_[k][p]].slot;
    if (slot != no_slot) add({.op = Step::Op::decode_copy, .range = piece, .slot = slot, .after = ag_recv_[k][p]});
    if (k + 1 < steps())
      add({.op = Step::Op::send, .peer = right(), .message = message(1, k + 1, p), .range = piece, .slot = slot,
           .after = ag_recv_[k][p]});
  }

  // Reduce-scatter sends of piece p, step by step; with RingSpec::receives_at_use each step's
  // receive is listed just before the send that adds it (else the caller listed them all first).
  // `after` holds back the first send.
  void reduce_sends(std::size_t p, std::uint32_t after = no_step) {
    for (int k = 0; k < steps(); ++k) {
      if (spec_.receives_at_use && k > 0) post_reduce_receive(k - 1, p);
      reduce_send(k, p, k == 0 ? after : no_step);
    }
    if (spec_.receives_at_use && steps() > 0) post_reduce_receive(steps() - 1, p);
  }

  // The allgather of piece p after its owned part is sent: receives in place (or each receive
  // just before its forward, RingSpec::receives_at_use), then forwards.
  void gather_piece(std::size_t p) {
    if (spec_.receives_at_use) {
      for (int k = 0; k < steps(); ++k) {
        post_gather_receive(k, p);
        gather_receive_in_place(k, p);
        gather_forward(k, p);
      }
      return;
    }
    for (int k = 0; k < steps(); ++k) gather_receive_in_place(k, p);
    for (int k = 0; k < steps(); ++k) gather_forward(k, p);
  }

  void add_received(std::uint32_t recv, ElemRange piece) {
    add({.op = Step::Op::decode_add, .range = piece, .slot = out_.steps[recv].slot, .after = recv});
  }

  Schedule& out_;
  RingSpec spec_;
  int n_;
  int r_;
  PieceCut cut_;
  int parts_;
  bool encoded_;
  bool raw_slots_;
  bool gather_in_place_;
  std::size_t max_pieces_;
  // Per step k, per piece p: the steps later phases refer to (no_step where the piece is missing).
  std::vector<std::vector<std::uint32_t>> rs_recv_, rs_send_, ag_recv_;
};

}  // namespace gradsync::topology::detail
