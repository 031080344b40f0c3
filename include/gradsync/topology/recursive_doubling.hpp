#pragma once
// topology::RecursiveDoubling — an allreduce in log2(n) exchanges, for buckets whose time is the
// network's latency, not its bandwidth.
//
// The ring takes 2(n-1) dependent steps whatever the bucket's size: 126 hops at 64 ranks, 510 at
// 256, each paying a message's latency (and, on a loaded machine, a thread's wake-up). Here each
// rank exchanges its whole bucket with one partner per round, the partner at distance 1, 2, 4, ...
// in a butterfly, and adds what arrives: after log2(p) rounds every rank holds the sum of all p
// (MPICH's and Open MPI's choice below about 10 KB; Thakur, Rabenseifner and Gropp, "Optimization
// of Collective Communication Operations in MPICH", 2005). Each rank sends log2(p) whole buckets
// instead of about 2 of one, so above some size halving-doubling or the ring wins: topology::Auto
// makes that choice per bucket.
//
// Any n: the first 2r ranks fold pairwise onto p = 2^floor(log2 n) participants before the
// butterfly and get the average back after it (fold.hpp): two whole-bucket steps more.
//
// The same bits on every rank. Entering round k, participants v and w = v ^ 2^k each hold the sum
// over their own half of the butterfly. Both compute decode(encode(lower's)) + decode(encode(
// higher's)), in that order: the lower one decodes its own encoding and adds the partner's, the
// higher one copies the partner's and adds its own. So both leave the round with the same bits,
// NaN payloads and signed zeros included, and by induction every participant ends with the same
// sum, which each divides by n alike. With the identity codec decode(encode(x)) is x. A lossy
// codec's error enters once per round from each side; error feedback keeps each round's residual
// as an encode site of its own.
//
// Message ids: 0 the fold-in, 1 + k round k, 1 + log2(p) the fold-out.

#include <bit>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/topology/fold.hpp"

namespace gradsync::topology {

struct RecursiveDoubling {
  // Each rank sends exactly to its round's partner and receives only from it, in round order, the
  // same on both sides (PairOrderedTopology).
  static constexpr bool posts_pairs_in_order = true;
  // A plain allreduce over the group (FlatAllreduceTopology).
  static constexpr bool flat_allreduce = true;

  std::string describe() const { return "recursive-doubling"; }

  // Rounds of the butterfly for n ranks, and whether the fold adds two more.
  static int rounds(int n) { return n > 1 ? std::bit_width(static_cast<unsigned>(n)) - 1 : 0; }
  static int dependent_steps(int n) { return rounds(n) + (std::has_single_bit(static_cast<unsigned>(n)) ? 0 : 2); }

  // Seconds to allreduce `elements` values of `value_bytes` each over `link` (topology::Auto):
  // every dependent step moves the whole bucket.
  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& link) const {
    if (group.size() == 1 || elements == 0) return 0;
    return dependent_steps(group.size()) * link.seconds(static_cast<double>(elements * value_bytes));
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    Schedule out;
    const int n = group.size();
    out.contributors = n;
    if (n == 1 || elements == 0) return out;
    const detail::Fold fold(group);
    const int levels = fold.levels(), g = group.rank;
    const ElemRange all{0, elements};
    const bool encoded = !codec.identity;
    detail::ScheduleBuilder b{out};
    const auto fold_out = static_cast<std::uint32_t>(1 + levels);
    if (fold.handed_on()) {
      fold.hand_on(b, all, encoded, fold_out);
      return out;
    }
    const int v = fold.participant();
    fold.take_in(b, all);
    // Every round's receive into a slot of its own, all up front, so that a partner ahead of this
    // rank finds them posted; with receives at use (CodecTraits), each after its round's send.
    std::vector<std::uint32_t> arrivals(static_cast<std::size_t>(levels), no_step), arrival_slots(arrivals.size());
    const auto post_arrival = [&](int k) {
      const auto i = static_cast<std::size_t>(k);
      arrival_slots[i] = b.slot(elements);
      arrivals[i] = b.add({.op = Step::Op::recv, .peer = fold.group_index(v ^ (1 << k)),
                           .message = static_cast<std::uint32_t>(1 + k), .range = all, .slot = arrival_slots[i]});
    };
    if (!codec.receives_at_use)
      for (int k = 0; k < levels; ++k) post_arrival(k);
    for (int k = 0; k < levels; ++k) {
      const int partner = fold.group_index(v ^ (1 << k));
      const std::uint32_t mine = b.slot(elements);
      // The values go through the slot even with the identity codec: they are overwritten below
      // while the send may still be reading.
      b.add({.op = Step::Op::encode, .range = all, .slot = mine});
      b.add({.op = Step::Op::send, .peer = partner, .message = static_cast<std::uint32_t>(1 + k), .range = all, .slot = mine});
      if (codec.receives_at_use) post_arrival(k);
      const std::uint32_t theirs = arrival_slots[static_cast<std::size_t>(k)];
      const std::uint32_t arrived = arrivals[static_cast<std::size_t>(k)];
      if (g < partner) {
        if (encoded) b.add({.op = Step::Op::decode_copy, .range = all, .slot = mine});
        b.add({.op = Step::Op::decode_add, .range = all, .slot = theirs, .after = arrived});
      } else {
        b.add({.op = Step::Op::decode_copy, .range = all, .slot = theirs, .after = arrived});
        b.add({.op = Step::Op::decode_add, .range = all, .slot = mine});
      }
    }
    b.add({.op = Step::Op::average, .range = all});
    fold.give_back(b, all, fold_out, no_step);
    return out;
  }
};

static_assert(TopologyPolicy<RecursiveDoubling>);

}  // namespace gradsync::topology
