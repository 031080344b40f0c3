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
// instead of the ring's 2(n-1)/n of one, so above some size the ring wins: topology::Auto makes
// that choice per bucket.
//
// Any n. With p the largest power of two not above n and r = n - p, the first 2r group ranks pair
// up before the butterfly: even rank 2i sends its bucket (through the codec) to odd rank 2i+1,
// which adds it and takes part in the butterfly as participant i; ranks 2r.. take part as
// participants r... (Rabenseifner's folding). After the butterfly each odd rank sends the final
// average to its even partner as it is, uncompressed, so that the partner ends with the same bits.
// n not a power of two costs two rounds more.
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
    const int levels = rounds(n);
    const int folded = n - (1 << levels);  // r: pairs folded before the butterfly
    const int g = group.rank;
    const ElemRange all{0, elements};
    const bool encoded = !codec.identity;
    auto& steps = out.steps;
    const auto slot = [&] {
      out.slot_elements.push_back(elements);
      return static_cast<std::uint32_t>(out.slot_elements.size() - 1);
    };
    const auto add = [&](Step step) {
      steps.push_back(step);
      return static_cast<std::uint32_t>(steps.size() - 1);
    };
    const std::uint32_t fold_out = static_cast<std::uint32_t>(1 + levels);

    if (g < 2 * folded && g % 2 == 0) {  // folded in: hand the bucket on, take the average back
      std::uint32_t send;
      if (encoded) {
        const std::uint32_t s = slot();
        add({.op = Step::Op::encode, .range = all, .slot = s});
        send = add({.op = Step::Op::send, .peer = g + 1, .message = 0, .range = all, .slot = s});
      } else {
        send = add({.op = Step::Op::send, .peer = g + 1, .message = 0, .range = all});
      }
      // In place, over the values the send may still be reading.
      add({.op = Step::Op::recv, .peer = g + 1, .message = fold_out, .range = all, .after = send});
      return out;
    }

    // A participant: v is its place in the butterfly.
    const int v = g < 2 * folded ? g / 2 : g - folded;
    const auto group_index = [&](int participant) { return participant < folded ? 2 * participant + 1 : participant + folded; };
    std::uint32_t fold_in = no_step, fold_slot = no_slot;
    if (g < 2 * folded) {
      fold_slot = slot();
      fold_in = add({.op = Step::Op::recv, .peer = g - 1, .message = 0, .range = all, .slot = fold_slot});
    }
    // Every round's receive into a slot of its own, all up front, so that a partner ahead of this
    // rank finds them posted; with receives at use (CodecTraits), each after its round's send.
    std::vector<std::uint32_t> arrivals(static_cast<std::size_t>(levels), no_step), arrival_slots(arrivals.size());
    const auto post_arrival = [&](int k) {
      const auto i = static_cast<std::size_t>(k);
      arrival_slots[i] = slot();
      arrivals[i] = add({.op = Step::Op::recv, .peer = group_index(v ^ (1 << k)),
                         .message = static_cast<std::uint32_t>(1 + k), .range = all, .slot = arrival_slots[i]});
    };
    if (!codec.receives_at_use)
      for (int k = 0; k < levels; ++k) post_arrival(k);
    if (fold_in != no_step) add({.op = Step::Op::decode_add, .range = all, .slot = fold_slot, .after = fold_in});
    for (int k = 0; k < levels; ++k) {
      const int partner = group_index(v ^ (1 << k));
      const std::uint32_t mine = slot();
      // The values go through the slot even with the identity codec: they are overwritten below
      // while the send may still be reading.
      add({.op = Step::Op::encode, .range = all, .slot = mine});
      add({.op = Step::Op::send, .peer = partner, .message = static_cast<std::uint32_t>(1 + k), .range = all, .slot = mine});
      if (codec.receives_at_use) post_arrival(k);
      const std::uint32_t theirs = arrival_slots[static_cast<std::size_t>(k)];
      const std::uint32_t arrived = arrivals[static_cast<std::size_t>(k)];
      if (g < partner) {
        if (encoded) add({.op = Step::Op::decode_copy, .range = all, .slot = mine});
        add({.op = Step::Op::decode_add, .range = all, .slot = theirs, .after = arrived});
      } else {
        add({.op = Step::Op::decode_copy, .range = all, .slot = theirs, .after = arrived});
        add({.op = Step::Op::decode_add, .range = all, .slot = mine});
      }
    }
    add({.op = Step::Op::average, .range = all});
    if (fold_in != no_step) add({.op = Step::Op::send, .peer = g - 1, .message = fold_out, .range = all});
    return out;
  }
};

static_assert(TopologyPolicy<RecursiveDoubling>);

}  // namespace gradsync::topology
