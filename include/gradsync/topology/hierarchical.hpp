#pragma once
// topology::Hierarchical — within each machine a ring (or a reduce to one rank), across machines
// whichever allreduce the bucket's size calls for, within again: for several ranks per machine,
// where the links inside a machine are fast and the links between machines are slow.
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
//   2. Across machines, the M ranks with the same local rank allreduce that shard, through the
//      codec, by one of three schedules (`across`, below): a ring (reduce-scatter, average,
//      allgather; each hop decodes, adds and re-encodes; the finished segment is encoded once by
//      its owner, which decodes its own encoding, and allgather forwards those bytes), recursive
//      doubling or halving-doubling (their own headers), over the M ranks and the shard's
//      elements. The average divides by the whole group, n = M*L (Schedule::contributors).
//   3. Within each machine, a ring allgather of the shards, uncompressed, in place.
//
// With M = 1 phase 2 has no hops (the shard is averaged, and with a lossy codec passed once through
// it, as a ring of one does); with L = 1 phases 1 and 3 have none and the schedule is phase 2's
// alone over the group (with the ring across, exactly Ring's). Message ids: the rings within a
// machine take 0 .. 2(L-1)p-1 (p: pieces of their largest segment), phase 2 follows.
//
// Through a leader (`within = Within::leader`). For a small bucket the rings within cost more than
// the bytes: 2(L-1) dependent hops, each a wake-up of a rank on a machine whose cores its L ranks
// share, and every one of the L ranks takes part in the exchange across, so M*L ranks put messages
// on the machines' links where M would do. Instead, as Open MPI's HAN and NCCL's trees within a
// node do, each machine's ranks hand their whole buckets to local rank 0 in one step (uncompressed,
// into raw slots), which adds them in local rank order (S_m = ((x[m,0] + x[m,1]) + ..) + x[m,L-1]),
// runs recursive doubling or halving-doubling with the other machines' leaders over the whole
// bucket through the codec (the log-depth schedule's own steps and order, dividing by n), and hands
// the average back to each local rank in one step, as it is. Two dependent steps within, M ranks
// across. The leader holds L-1 whole buckets of scratch, and the machine's link carries one rank's
// messages, so where the bytes dominate the rings within (which share out the work) win; the ring
// across is not offered through a leader (its pipeline needs the shards). Message ids: 0 the
// buckets to the leader, 1 the average back, the schedule across from 2.
//
// Which schedule across. A bucket that is latency-bound across machines wants the log-depth
// schedules (log2 M or 2 log2 M rounds where the ring takes 2(M-1) hops); a bandwidth-bound one
// wants the ring, which alone is pipelined with the phases within (below), so that the link
// carries bytes while the machine reduces the next column. `across` names one, or is `automatic`
// (the default): each bucket takes the one predicted fastest over two links, `link` between ranks
// of a machine and `link_across` between machines (LinkModel, schedule.hpp), the smaller kind on a
// tie; the prediction is predicted(). As topology::Auto's link, the Synchronizer measures both at
// the first synchronization (engine::calibrate_machine_links: the ring's hops within a machine,
// then the butterfly's rounds among the counterparts, timed as schedules run them and every rank
// at once, so a machine's link is timed shared by its L ranks), the slowest rank's figures, the
// same on every rank; the choice is made for the bucket as a whole (its largest shard), so every
// rank of every machine chooses alike. The same prediction chooses between the rings within and
// the leader (`within` automatic, the default): the leader's step within costs one latency and its
// L-1 buckets' bytes, and its exchange across runs alone on the machine's link, so at L times the
// per-rank bandwidth measured with every rank sending. That prediction is the prior: with `tune`
// (the default) the Synchronizer tries the five arrangements (candidate(): the rings within with
// each of the three schedules across, the leader with either log-depth one) early in training and
// keeps the one that ran fastest, as it does topology::Auto's candidates (engine::ScheduleTuner,
// TunedTopology); Auto offers the same five among its own on a group of several machines. A
// `within` or `across` that is set, not automatic, leaves only the arrangements it allows.
//
// Pipelining, with the ring across. The three phases run piece by piece, not one after the other:
// the ring across machines cuts each of its M segments of the shard into pieces of at most
// `chunk_elements`, and the rings within cut every shard the same way (RingSpec::parts = M), so
// that piece j of the ring across is exactly pieces j*M .. j*M+M-1 of the rings within. The
// schedule lists, column after column, the reduce-scatter within of column j+1, the allreduce
// across of column j and the allgather within of column j. So the first bytes cross the slow link
// once one column is reduced within the machine (not the whole bucket), and the last column's
// allgather within is all that remains after the link falls quiet. Both rings cut a part of four
// pieces or more tapered (RingSpec::taper): its first two pieces and its last two are a quarter
// and a half of chunk_elements, so the first column crosses sooner after the start, and the last
// column's allgather within is short. Column j's reduce-scatter within waits for the first piece
// of column j-2 from across (reduce_lead), and a piece finished on another machine goes round this
// one once the receive that brings it is done (in place, with the identity codec). The task graph,
// which prefers earlier steps of the list, follows that order; so does the serial executor.
// With a log-depth schedule across the phases follow one another: the reduce-scatter within (in
// pieces of chunk_elements), the log-depth schedule's own steps over the shard (its peers made
// this local rank's counterparts, its message ids after the rings'), the allgather within.
//
// Summation order. Machine m's sum of an element of shard s is S_m = (..((x[m,s] + x[m,s+1]) +
// x[m,s+2]) + .. + x[m,s-1]) over local ranks (indices mod L), summed by local rank s-1 alone.
// With the ring across, element e of shard s lies in segment t of phase 2's split of the shard
// into M; starting at machine t and going round: P_t = S_t, then P = S_m + decode(encode(P)) for
// m = t+1, .., t-1 (mod M; with the identity codec decode(encode(P)) = P), summed by machine t-1's
// local rank s-1 alone, which divides by n and, with a codec, replaces the result by
// decode(encode(result)). With a log-depth schedule across, the machines' sums S_m are its inputs
// and it sums them in its own order (recursive_doubling.hpp, halving_doubling.hpp), dividing by n.
// Through a leader, the leader's sums S_m (above) are the log-depth schedule's inputs. Everyone
// else copies those bits, so every rank ends bit-identical.
//
// Not a PipelineTopology: selective compression's cost model (engine/cost_model.hpp) knows one
// kind of link, one transfer cost per byte, and this schedule's hops cross two very different ones
// (2(L-1) fast uncompressed hops within a machine, slow compressed ones across), so no
// PipelineShape would describe it honestly.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/error.hpp"
#include "gradsync/topology/fold.hpp"
#include "gradsync/topology/halving_doubling.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/topology/ring_phases.hpp"

namespace gradsync::topology {

struct Hierarchical {
  // Phase 2's schedule (the header's "Which schedule across").
  enum class Across : std::uint8_t { automatic, ring, recursive_doubling, halving_doubling };
  // Phases 1 and 3: the rings among a machine's ranks, or through its leader (the header's
  // "Through a leader").
  enum class Within : std::uint8_t { automatic, ring, leader };
  // One of the schedules this topology can run: how within machines, how across.
  struct Arrangement {
    Within within = Within::ring;
    Across across = Across::ring;
    friend bool operator==(const Arrangement&, const Arrangement&) = default;
  };

  int ranks_per_machine = 0;                          // L, required: at least 1, dividing the group size
  // 256 KiB of f32: a quarter of Ring's, because here a piece is also the unit of pipelining
  // between the phases (the link waits for the first column, and the last column's allgather
  // within waits for the link): smaller pieces start and end the link sooner.
  std::size_t chunk_elements = std::size_t{1} << 16;
  Across across = Across::automatic;
  Within within = Within::automatic;
  LinkModel link{};         // one message between two ranks of a machine (LinkAwareTopology)
  LinkModel link_across{};  // one message between machines, while every rank of the machine sends one
  bool measure_link = true;  // the Synchronizer replaces both links by what it measures (above)
  bool tune = true;          // with a choice left, the Synchronizer keeps what ran fastest (above)

  // How many columns the reduce-scatter within a machine may run ahead of the link: column j
  // starts once the first piece of column j - reduce_lead has come from across.
  static constexpr std::size_t reduce_lead = 2;

  // The schedules within a machine and across machines join disjoint pairs of ranks (neighbours on
  // one machine; the same local rank on different machines), and each lists a pair's messages in
  // one order on both sides (the ring piece after piece, the log-depth schedules round after
  // round), so the schedule is a PairOrderedTopology.
  static constexpr bool posts_pairs_in_order = true;

  static const char* name(Within how) {
    switch (how) {
      case Within::automatic: return "auto";
      case Within::ring: return "ring";
      case Within::leader: break;
    }
    return "leader";
  }
  static const char* name(Across how) {
    switch (how) {
      case Across::automatic: return "auto";
      case Across::ring: return "ring";
      case Across::recursive_doubling: return "recursive-doubling";
      case Across::halving_doubling: break;
    }
    return "halving-doubling";
  }

  // Whether `within` and `across` allow more than one arrangement, which the links predict and
  // measured times choose between.
  bool chooses() const noexcept {
    std::size_t allowed = 0;
    for (std::size_t k = 0; k < candidates; ++k) allowed += allows(candidate(k)) ? 1 : 0;
    return allowed > 1;
  }
  // Whether the Synchronizer should measure the links (LinkAwareTopology): only a choice needs them.
  bool measures_link() const noexcept { return measure_link && chooses(); }
  // Whether the Synchronizer should choose by measured times (TunedTopology).
  bool tunes() const noexcept { return tune && chooses(); }

  // MachineLinkTopology: the ranks a machine has for the link measurement (throws where the group
  // is not whole machines), and the measured figures.
  int measured_ranks_per_machine(const Group& group) const {
    machines(group);
    return ranks_per_machine;
  }
  void take_links(const LinkModel& within, const LinkModel& across_machines) {
    link = within;
    link_across = across_machines;
  }

  // TunedTopology: candidate k is arrangement candidate(k), predicted by predicted(). Offered are
  // those `within` and `across` allow, less any that runs the same schedule on this group as an
  // earlier one offered (one machine: every arrangement is a ring of one across; one rank a
  // machine: a leader is the rings within); the rest are predicted at infinity.
  static constexpr std::size_t candidates = 5;
  static constexpr Arrangement candidate(std::size_t k) {
    constexpr Arrangement order[candidates] = {{Within::ring, Across::recursive_doubling},
                                               {Within::ring, Across::halving_doubling},
                                               {Within::ring, Across::ring},
                                               {Within::leader, Across::recursive_doubling},
                                               {Within::leader, Across::halving_doubling}};
    return order[k];
  }
  bool offers(std::size_t k, const Group& group) const {
    if (!allows(candidate(k))) return false;
    const bool one_machine = machines(group) == 1;
    for (std::size_t j = 0; j < k; ++j)
      if (allows(candidate(j)) &&
          (one_machine || (ranks_per_machine == 1 && candidate(j).across == candidate(k).across)))
        return false;
    return true;
  }
  Schedule candidate_schedule(std::size_t k, const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(candidate(k), group, elements, codec);
  }
  double candidate_seconds(std::size_t k, const Group& group, std::size_t elements, std::size_t /*value_bytes*/) const {
    if (!offers(k, group)) return std::numeric_limits<double>::infinity();
    return predicted(group, elements, candidate(k));
  }
  std::string candidate_name(std::size_t k) const { return describe(candidate(k)); }
  static std::string describe(Arrangement a) {
    return fmt::format("hierarchical{}, {} across", a.within == Within::leader ? " through a leader" : "", name(a.across));
  }

  std::string describe() const {
    std::string links = measure_link || !chooses()
                            ? std::string()
                            : fmt::format(", links {:.1f} us + {:.3f} GB/s within, {:.1f} us + {:.3f} GB/s across",
                                          link.latency * 1e6, gigabytes_per_second(link), link_across.latency * 1e6,
                                          gigabytes_per_second(link_across));
    return fmt::format("hierarchical(ranks-per-machine={}, chunk={}, within={}, across={}{})", ranks_per_machine,
                       chunk_elements, name(within), name(across), links);
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

  // Seconds predicted for a bucket of `elements` f32 values in arrangement `a` (neither half
  // automatic), over `link` and `link_across`, each phase's steps as the flat topologies predict
  // theirs (concepts.hpp, PredictedTopology), L and M given by the group:
  //   through a leader: one latency and L-1 whole buckets within, each way, and the log-depth
  //     schedule's prediction over M ranks and the whole bucket, on the link across at L times the
  //     bandwidth each rank measured while all L sent (the leader sends alone);
  //   a log-depth schedule across: the ring within's 2(L-1) hops over the largest shard's pieces,
  //     then the log-depth schedule's own prediction over M ranks and that shard;
  //   the ring across: C columns overlapping, a column costing w within (reduce-scatter, then
  //     allgather: (L-1) hops each, M pieces a hop) and a across (2(M-1) hops of one piece):
  //     2w + a for the first, max(2w, a) for each other.
  double predicted(const Group& group, std::size_t elements, Arrangement a) const {
    if (a.within != Within::leader || ranks_per_machine == 1 || machines(group) == 1)
      return predicted(group, elements, a.across);
    const double gather = link.latency + (ranks_per_machine - 1) * static_cast<double>(elements * sizeof(float)) *
                                             link.seconds_per_byte;
    const LinkModel alone{.latency = link_across.latency, .seconds_per_byte = link_across.seconds_per_byte / ranks_per_machine};
    const Group leaders = Group::world(0, machines(group));
    return 2 * gather + (a.across == Across::halving_doubling
                             ? HalvingDoubling{}.predicted_seconds(leaders, elements, sizeof(float), alone)
                             : RecursiveDoubling{}.predicted_seconds(leaders, elements, sizeof(float), alone));
  }

  // The rings within with phase 2 done `how`.
  double predicted(const Group& group, std::size_t elements, Across how) const {
    const int machine_count = machines(group), local_count = ranks_per_machine;
    const std::size_t shard = segment(elements, local_count, 0).size();
    const auto value = static_cast<double>(sizeof(float));
    const Group across_machines = Group::world(0, machine_count);
    switch (how) {
      case Across::recursive_doubling:
      case Across::halving_doubling: {
        const double within = Ring{.chunk_elements = chunk_elements}.predicted_seconds(
            Group::world(0, local_count), elements, sizeof(float), link);
        return within + (how == Across::recursive_doubling
                             ? RecursiveDoubling{}.predicted_seconds(across_machines, shard, sizeof(float), link_across)
                             : HalvingDoubling{}.predicted_seconds(across_machines, shard, sizeof(float), link_across));
      }
      case Across::automatic:
      case Across::ring: break;
    }
    const std::size_t segment_elements = segment(shard, machine_count, 0).size();
    if (segment_elements == 0) return 0;
    const std::size_t chunk = std::max<std::size_t>(1, chunk_elements);
    const double columns = static_cast<double>((segment_elements + chunk - 1) / chunk);
    const double column_within =
        (local_count - 1) * (machine_count * link.latency + static_cast<double>(shard) / columns * value * link.seconds_per_byte);
    const double column_across =
        2.0 * (machine_count - 1) *
        link_across.seconds(static_cast<double>(segment_elements) / columns * value);
    return 2 * column_within + column_across + (columns - 1) * std::max(2 * column_within, column_across);
  }

  // The arrangement a bucket of `elements` values takes without measured times: of those offered,
  // the one predicted fastest, the earlier candidate on a tie. One machine has no hops across,
  // whatever `within` and `across` say: the ring's (a ring of one averages). Throws Error where
  // nothing is allowed (a leader with the ring across).
  Arrangement choice_for(const Group& group, std::size_t elements) const {
    if (machines(group) == 1 || elements == 0) return {Within::ring, Across::ring};
    std::size_t best = candidates;
    for (std::size_t k = 0; k < candidates; ++k)
      if (offers(k, group) &&
          (best == candidates || predicted(group, elements, candidate(k)) < predicted(group, elements, candidate(best))))
        best = k;
    if (best == candidates) throw refused();
    return candidate(best);
  }

  // The choice for a bucket, for the Synchronizer's log.
  std::string choice(const Group& group, std::size_t elements) const {
    return fmt::format("{} over {} machines", describe(choice_for(group, elements)), machines(group));
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(choice_for(group, elements), group, elements, codec);
  }

  // The schedule of arrangement `a` (automatic halves as the ring); one machine takes the ring's,
  // and one rank a machine needs no leader.
  Schedule schedule(Arrangement a, const Group& group, std::size_t elements, CodecTraits codec) const {
    if (machines(group) == 1 || elements == 0) return ring_across(group, elements, codec);
    if (a.within == Within::leader && ranks_per_machine > 1) {
      switch (a.across) {
        case Across::recursive_doubling: return through_leader(RecursiveDoubling{}, group, elements, codec);
        case Across::halving_doubling: return through_leader(HalvingDoubling{}, group, elements, codec);
        case Across::automatic:
        case Across::ring: break;
      }
      throw refused();
    }
    switch (a.across) {
      case Across::recursive_doubling: return log_depth_across(RecursiveDoubling{}, group, elements, codec);
      case Across::halving_doubling: return log_depth_across(HalvingDoubling{}, group, elements, codec);
      case Across::automatic:
      case Across::ring: break;
    }
    return ring_across(group, elements, codec);
  }

 private:
  bool allows(Arrangement a) const noexcept {
    return (within == Within::automatic || within == a.within) && (across == Across::automatic || across == a.across);
  }
  static Error refused() {
    return Error(ErrorKind::invalid_argument, {.operation = "hierarchical topology"},
                 "within = leader takes recursive doubling or halving-doubling across machines, not the ring "
                 "(its pipeline needs every rank's shard)");
  }

  static ElemRange segment(std::size_t elements, int parts, int index) { return detail::segment(elements, parts, index); }
  static double gigabytes_per_second(const LinkModel& l) { return l.seconds_per_byte > 0 ? 1e-9 / l.seconds_per_byte : 0.0; }

  // Group indices of machine m's ranks, and of this rank's counterparts (its local rank) on every machine.
  std::vector<int> machine_ranks(int machine) const {
    std::vector<int> ranks(static_cast<std::size_t>(ranks_per_machine));
    std::iota(ranks.begin(), ranks.end(), machine * ranks_per_machine);
    return ranks;
  }
  std::vector<int> counterparts(const Group& group) const {
    std::vector<int> ranks;
    for (int m = 0; m < machines(group); ++m) ranks.push_back(m * ranks_per_machine + group.rank % ranks_per_machine);
    return ranks;
  }

  // Phase 2 by a log-depth schedule (the header's "Which schedule across"): the reduce-scatter
  // within, `log_depth`'s schedule for this rank's counterparts over its shard, the allgather within.
  template <class LogDepth>
  Schedule log_depth_across(const LogDepth& log_depth, const Group& group, std::size_t elements, CodecTraits codec) const {
    const int machine = group.rank / ranks_per_machine, local = group.rank % ranks_per_machine;
    Schedule out;
    out.contributors = group.size();
    const ElemRange bucket{0, elements};
    detail::RingPhases within(out, {.members = machine_ranks(machine),
                                    .position = local,
                                    .range = bucket,
                                    .chunk_elements = chunk_elements,
                                    .form = detail::RingForm::raw,
                                    .receives_at_use = codec.receives_at_use});
    for (std::size_t p = 0; p < within.piece_count(); ++p) within.reduce_scatter_piece(p);
    const ElemRange shard = within.owned_range();
    const Schedule across_schedule = log_depth.schedule(Group::world(machine, machines(group)), shard.size(), codec);
    const std::uint32_t last_in_place = append_across(
        out, across_schedule, counterparts(group), shard.begin,
        detail::RingPhases::message_count(ranks_per_machine, bucket, chunk_elements));
    for (std::size_t p = 0; p < within.piece_count(); ++p) within.allgather_piece(p, last_in_place);
    return out;
  }

  // The header's "Through a leader": local rank 0 of each machine takes its machine's buckets
  // (raw), adds them in local rank order, runs `log_depth`'s schedule with the other leaders over
  // the whole bucket, and sends the average back; every other rank sends its bucket and receives
  // the average in place, once its send has stopped reading.
  template <class LogDepth>
  Schedule through_leader(const LogDepth& log_depth, const Group& group, std::size_t elements, CodecTraits codec) const {
    const int machine = group.rank / ranks_per_machine, leader = machine * ranks_per_machine;
    Schedule out;
    out.contributors = group.size();
    detail::ScheduleBuilder b{out};
    const ElemRange bucket{0, elements};
    if (group.rank != leader) {
      const std::uint32_t sent = b.add({.op = Step::Op::send, .peer = leader, .message = 0, .range = bucket});
      b.add({.op = Step::Op::recv, .peer = leader, .message = 1, .range = bucket, .after = sent});
      return out;
    }
    const auto local_ranks = static_cast<std::size_t>(ranks_per_machine);
    std::vector<std::uint32_t> arrivals(local_ranks, no_step), slots(local_ranks, no_slot);
    const auto post_arrival = [&](std::size_t q) {
      slots[q] = b.slot(elements);
      out.slot_raw.resize(out.slot_elements.size());
      out.slot_raw.back() = true;
      arrivals[q] = b.add({.op = Step::Op::recv, .peer = leader + static_cast<int>(q), .message = 0, .range = bucket,
                           .slot = slots[q]});
    };
    if (!codec.receives_at_use)
      for (std::size_t q = 1; q < local_ranks; ++q) post_arrival(q);
    for (std::size_t q = 1; q < local_ranks; ++q) {
      if (codec.receives_at_use) post_arrival(q);
      b.add({.op = Step::Op::decode_add, .range = bucket, .slot = slots[q], .after = arrivals[q]});
    }
    const std::uint32_t last_in_place = append_across(
        out, log_depth.schedule(Group::world(machine, machines(group)), elements, codec), counterparts(group), 0, 2);
    for (std::size_t q = 1; q < local_ranks; ++q)
      b.add({.op = Step::Op::send, .peer = leader + static_cast<int>(q), .message = 1, .range = bucket,
             .after = last_in_place});
    return out;
  }

  // Appends `across_schedule`, written for the group of machines over a shard's elements, to
  // `out`: its peers become `ranks` (group indices), its ranges start at `offset`, its message ids
  // at `first_message`, its slots and its steps' `after` are renumbered past out's. Returns its
  // last receive in place (no_step if none): the shard's values are final once it is done, and the
  // serial executor completes a receive only when a later step names it. Both log-depth schedules
  // leave at most that one receive in place unnamed by a later step of their own (the last round
  // of halving-doubling's allgather, or the fold's average coming back).
  static std::uint32_t append_across(Schedule& out, const Schedule& across_schedule, std::span<const int> ranks,
                                     std::size_t offset, std::uint32_t first_message) {
    const auto first_slot = static_cast<std::uint32_t>(out.slot_elements.size());
    const auto first_step = static_cast<std::uint32_t>(out.steps.size());
    out.slot_elements.insert(out.slot_elements.end(), across_schedule.slot_elements.begin(),
                             across_schedule.slot_elements.end());
    if (!out.slot_raw.empty()) out.slot_raw.resize(out.slot_elements.size(), false);  // the codec's slots, not raw
    std::uint32_t last_in_place = no_step;
    for (Step step : across_schedule.steps) {
      const bool transfer = step.op == Step::Op::send || step.op == Step::Op::recv;
      if (transfer) {
        step.peer = ranks[static_cast<std::size_t>(step.peer)];
        step.message += first_message;
      }
      step.range = {step.range.begin + offset, step.range.end + offset};
      if (step.slot != no_slot) step.slot += first_slot;
      if (step.after != no_step) step.after += first_step;
      if (step.op == Step::Op::recv && step.slot == no_slot) last_in_place = static_cast<std::uint32_t>(out.steps.size());
      out.steps.push_back(step);
    }
    return last_in_place;
  }

  // Phase 2 by the ring, pipelined with the phases within (the header's "Pipelining").
  Schedule ring_across(const Group& group, std::size_t elements, CodecTraits codec) const {
    const int machine_count = machines(group);
    const int local_count = ranks_per_machine;
    const int machine = group.rank / local_count;
    const int local = group.rank % local_count;
    Schedule out;
    out.contributors = group.size();

    std::vector<int> same_machine = machine_ranks(machine), same_local_rank = counterparts(group);

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

static_assert(MachineLinkTopology<Hierarchical> && TunedTopology<Hierarchical>);

}  // namespace gradsync::topology
