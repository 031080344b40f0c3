#pragma once
// topology::HalvingDoubling — a reduce-scatter by recursive halving, then an allgather by
// recursive doubling (Rabenseifner's allreduce): 2 log2(p) exchanges moving 2(p-1)/p of the bucket,
// for buckets too large for RecursiveDoubling (which moves log2(p) whole buckets) and too small for
// the ring's 2(n-1) latencies. Thakur, Rabenseifner and Gropp 2005; Open MPI and MPICH use it for
// long messages where the count allows.
//
// The bucket is cut into p segments (Ring::segment). Each participant plays the position u whose
// log2(p) bits are its own reversed. Reduce-scatter: in round k (positions at distance p/2, p/4,
// .., 1, which are participants at distance 1, 2, .., p/2) a participant splits the segments it
// still reduces in two halves, sends the half that holds its partner's final segment (through the
// codec) and adds what the partner sends of the other half; after log2(p) rounds position u holds
// the sum of segment u, which it averages. Allgather: in round j (positions at distance 1, 2, ..,
// p/2: participants at p/2, .., 1) partners swap the blocks of finished segments they hold, so the
// blocks double.
//
// Why reversed: the launchers number ranks machine-major (machine m holds m*L .. m*L+L-1), so the
// near partners share a machine. The rounds that move the large halves (the first of the
// reduce-scatter, the last of the allgather) stay within machines, and only pieces of 1/L of the
// bucket or less cross them: at 16 machines of 8 ranks, 1/8 of the bytes on each machine's link
// that partners far-first would put there (8 ranks sending half the bucket each at once).
//
// The same bits on every rank: each segment is summed by one participant per round (the one that
// keeps it) and finished by its owner alone, as in the ring; everyone else copies the owner's bits.
// With a lossy codec the owner encodes the average once and decodes its own encoding, and the
// allgather forwards each segment's encoding unchanged, one message per segment, so each is
// decoded to the same values everywhere. With the identity codec the blocks travel in place, one
// message per round.
//
// Any n: the first 2r ranks fold pairwise onto the participants and get the average back
// uncompressed (fold.hpp).
//
// Message ids: 0 the fold-in, 1 + k reduce-scatter round k, then with the identity codec 1 + L + j
// allgather round j, with a codec 1 + L + s segment s's encoding (a segment crosses a pair at most
// once), and the fold-out last.

#include <bit>
#include <string>
#include <vector>

#include "gradsync/concepts.hpp"
#include "gradsync/topology/fold.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring_phases.hpp"

namespace gradsync::topology {

struct HalvingDoubling {
  // Each pair exchanges in one reduce-scatter round and one allgather round, the segments of a
  // round in index order on both sides (PairOrderedTopology).
  static constexpr bool posts_pairs_in_order = true;
  static constexpr bool flat_allreduce = true;

  std::string describe() const { return "halving-doubling"; }

  // `v`'s lowest `bits` bits in reverse order: the position participant v plays, and back.
  static int reversed(int v, int bits) {
    int r = 0;
    for (int b = 0; b < bits; ++b) r |= ((v >> b) & 1) << (bits - 1 - b);
    return r;
  }

  // Seconds to allreduce `elements` values of `value_bytes` each over `link` (topology::Auto):
  // 2 log2(p) latencies and 2(p-1)/p of the bucket, plus the fold's two whole-bucket steps.
  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& link) const {
    const int n = group.size();
    if (n == 1 || elements == 0) return 0;
    const int levels = RecursiveDoubling::rounds(n);
    const double p = static_cast<double>(1 << levels), bytes = static_cast<double>(elements * value_bytes);
    const double fold = std::has_single_bit(static_cast<unsigned>(n)) ? 0 : 2 * link.seconds(bytes);
    return 2 * levels * link.latency + 2 * (p - 1) / p * bytes * link.seconds_per_byte + fold;
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    Schedule out;
    const int n = group.size();
    out.contributors = n;
    if (n == 1 || elements == 0) return out;
    const detail::Fold fold(group);
    const int levels = fold.levels(), p = fold.participants();
    const ElemRange all{0, elements};
    const bool encoded = !codec.identity;
    detail::ScheduleBuilder b{out};
    const auto gather_id = [&](int index) { return static_cast<std::uint32_t>(1 + levels + index); };
    const auto fold_out = static_cast<std::uint32_t>(1 + levels + (encoded ? p : levels));
    if (fold.handed_on()) {
      fold.hand_on(b, all, encoded, fold_out);
      return out;
    }
    const int u = reversed(fold.participant(), levels);  // this participant's position
    const auto at = [&](int position) { return fold.group_index(reversed(position, levels)); };
    const auto block = [&](int first, int count) {
      return ElemRange{detail::segment(elements, p, first).begin, detail::segment(elements, p, first + count - 1).end};
    };
    fold.take_in(b, all);

    // Reduce-scatter. Round k's halves, and its receive (up front unless receives are at use).
    struct Round {
      int partner = 0;
      ElemRange keep, give;
      std::uint32_t arrival = no_step, arrival_slot = no_slot, send = no_step;
    };
    std::vector<Round> rounds(static_cast<std::size_t>(levels));
    for (int k = 0, first = 0, count = p; k < levels; ++k) {
      const int distance = p >> (k + 1), half = count / 2;
      const bool upper = (u & distance) != 0;
      Round& round = rounds[static_cast<std::size_t>(k)];
      round.partner = at(u ^ distance);
      round.keep = block(upper ? first + half : first, half);
      round.give = block(upper ? first : first + half, half);
      first = upper ? first + half : first;
      count = half;
    }
    const auto post_arrival = [&](int k) {
      Round& round = rounds[static_cast<std::size_t>(k)];
      if (round.keep.empty()) return;
      round.arrival_slot = b.slot(round.keep.size());
      round.arrival = b.add({.op = Step::Op::recv, .peer = round.partner, .message = static_cast<std::uint32_t>(1 + k),
                           .range = round.keep, .slot = round.arrival_slot});
    };
    if (!codec.receives_at_use)
      for (int k = 0; k < levels; ++k) post_arrival(k);
    for (int k = 0; k < levels; ++k) {
      Round& round = rounds[static_cast<std::size_t>(k)];
      const auto message = static_cast<std::uint32_t>(1 + k);
      if (!round.give.empty()) {
        if (encoded) {
          const std::uint32_t s = b.slot(round.give.size());
          b.add({.op = Step::Op::encode, .range = round.give, .slot = s});
          round.send = b.add({.op = Step::Op::send, .peer = round.partner, .message = message, .range = round.give, .slot = s});
        } else {
          round.send = b.add({.op = Step::Op::send, .peer = round.partner, .message = message, .range = round.give});
        }
      }
      if (codec.receives_at_use) post_arrival(k);
      if (round.arrival != no_step)
        b.add({.op = Step::Op::decode_add, .range = round.keep, .slot = round.arrival_slot, .after = round.arrival});
    }

    // This position's segment: averaged, and with a codec passed once through it.
    const ElemRange own = detail::segment(elements, p, u);
    std::vector<std::uint32_t> finished(static_cast<std::size_t>(p), no_slot);  // per segment, its encoding
    std::vector<std::uint32_t> landed(static_cast<std::size_t>(p), no_step);    // ... and the receive that brought it
    if (!own.empty()) {
      b.add({.op = Step::Op::average, .range = own});
      if (encoded) {
        finished[static_cast<std::size_t>(u)] = b.slot(own.size());
        b.add({.op = Step::Op::encode, .range = own, .slot = finished[static_cast<std::size_t>(u)]});
        b.add({.op = Step::Op::decode_copy, .range = own, .slot = finished[static_cast<std::size_t>(u)]});
      }
    }

    // Allgather: at distance d this position holds the d segments from u & ~(d - 1).
    std::uint32_t gathered = no_step;  // identity: the previous round's receive, which the next send forwards
    for (int j = 0; j < levels; ++j) {
      const int distance = 1 << j, partner = at(u ^ distance);
      const int mine = u & ~(distance - 1), theirs = (u ^ distance) & ~(distance - 1);
      if (!encoded) {
        const auto message = gather_id(j);
        const ElemRange out_block = block(mine, distance), in_block = block(theirs, distance);
        if (!out_block.empty())
          b.add({.op = Step::Op::send, .peer = partner, .message = message, .range = out_block, .after = gathered});
        // In place, over the half this participant gave away in the reduce-scatter round of the
        // same distance, whose send may still be reading it.
        if (!in_block.empty())
          gathered = b.add({.op = Step::Op::recv, .peer = partner, .message = message, .range = in_block,
                          .after = rounds[static_cast<std::size_t>(levels - 1 - j)].send});
        continue;
      }
      for (int s = mine; s < mine + distance; ++s) {
        const ElemRange range = detail::segment(elements, p, s);
        if (range.empty()) continue;
        b.add({.op = Step::Op::send, .peer = partner, .message = gather_id(s), .range = range,
             .slot = finished[static_cast<std::size_t>(s)], .after = landed[static_cast<std::size_t>(s)]});
      }
      // Every receive of the round before the first decode waits for one: over NCCL's
      // all-or-nothing groups the partner's round needs all of them posted.
      for (int s = theirs; s < theirs + distance; ++s) {
        const ElemRange range = detail::segment(elements, p, s);
        if (range.empty()) continue;
        const auto i = static_cast<std::size_t>(s);
        finished[i] = b.slot(range.size());
        landed[i] = b.add({.op = Step::Op::recv, .peer = partner, .message = gather_id(s), .range = range, .slot = finished[i]});
      }
      for (int s = theirs; s < theirs + distance; ++s) {
        const ElemRange range = detail::segment(elements, p, s);
        const auto i = static_cast<std::size_t>(s);
        if (!range.empty())
          b.add({.op = Step::Op::decode_copy, .range = range, .slot = finished[i], .after = landed[i]});
      }
    }
    // With the identity codec the last block arrived in place: the average goes back once it is
    // there (with a codec the decodes after each receive waited).
    fold.give_back(b, all, fold_out, gathered);
    return out;
  }
};

static_assert(PredictedTopology<HalvingDoubling>);

}  // namespace gradsync::topology
