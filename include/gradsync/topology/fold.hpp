#pragma once
// topology::detail::Fold — the log-depth topologies' way to any group size, written once
// (recursive_doubling.hpp, halving_doubling.hpp; Rabenseifner's folding).
//
// Their rounds pair participant v with v ^ 2^k, which needs a power of two of them. With p the
// largest power of two not above n and r = n - p, the first 2r group ranks pair up first: even
// rank 2i hands its bucket (through the codec) to odd rank 2i+1, which adds it and takes part as
// participant i; ranks 2r.. take part as participants r... At the end each odd rank sends the
// average back as it is, uncompressed, so that its partner ends with the same bits. It costs two
// whole-bucket steps, only where n is not a power of two. Message 0 is the fold-in; the topology
// names the fold-out's id.

#include <bit>
#include <cstdint>

#include "gradsync/schedule.hpp"

namespace gradsync::topology::detail {

// Appends steps and slots to a schedule, returning their indices.
struct ScheduleBuilder {
  Schedule& out;

  std::uint32_t slot(std::size_t elements) {
    out.slot_elements.push_back(elements);
    return static_cast<std::uint32_t>(out.slot_elements.size() - 1);
  }
  std::uint32_t add(Step step) {
    out.steps.push_back(step);
    return static_cast<std::uint32_t>(out.steps.size() - 1);
  }
};

class Fold {
 public:
  explicit Fold(const Group& group)
      : g_(group.rank),
        levels_(group.size() > 1 ? std::bit_width(static_cast<unsigned>(group.size())) - 1 : 0),
        folded_(group.size() - (1 << levels_)) {}

  // Rounds of a butterfly over the participants: log2(p).
  int levels() const noexcept { return levels_; }
  int participants() const noexcept { return 1 << levels_; }

  // Whether this rank only hands its bucket on and takes the average back (an even rank of the
  // first 2r); otherwise it is participant participant().
  bool handed_on() const noexcept { return g_ < 2 * folded_ && g_ % 2 == 0; }
  int participant() const noexcept { return g_ < 2 * folded_ ? g_ / 2 : g_ - folded_; }
  int group_index(int participant) const noexcept {
    return participant < folded_ ? 2 * participant + 1 : participant + folded_;
  }

  // A handed-on rank's whole schedule: its bucket to its partner (encoded with a codec), then the
  // average back in place, once the send has stopped reading the values.
  void hand_on(ScheduleBuilder& b, ElemRange all, bool encoded, std::uint32_t fold_out) const {
    std::uint32_t send;
    if (encoded) {
      const std::uint32_t s = b.slot(all.size());
      b.add({.op = Step::Op::encode, .range = all, .slot = s});
      send = b.add({.op = Step::Op::send, .peer = g_ + 1, .message = 0, .range = all, .slot = s});
    } else {
      send = b.add({.op = Step::Op::send, .peer = g_ + 1, .message = 0, .range = all});
    }
    b.add({.op = Step::Op::recv, .peer = g_ + 1, .message = fold_out, .range = all, .after = send});
  }

  // A participant's first steps: its partner's bucket, if it has one, added to its own.
  void take_in(ScheduleBuilder& b, ElemRange all) const {
    if (!paired()) return;
    const std::uint32_t s = b.slot(all.size());
    const std::uint32_t arrived = b.add({.op = Step::Op::recv, .peer = g_ - 1, .message = 0, .range = all, .slot = s});
    b.add({.op = Step::Op::decode_add, .range = all, .slot = s, .after = arrived});
  }

  // A participant's last step: the average, as it is, back to its partner once `after` is done.
  void give_back(ScheduleBuilder& b, ElemRange all, std::uint32_t fold_out, std::uint32_t after) const {
    if (paired()) b.add({.op = Step::Op::send, .peer = g_ - 1, .message = fold_out, .range = all, .after = after});
  }

 private:
  bool paired() const noexcept { return g_ < 2 * folded_ && g_ % 2 == 1; }

  int g_, levels_, folded_;
};

}  // namespace gradsync::topology::detail
