#pragma once
// topology::Hierarchical — within each machine a ring, across machines whichever allreduce the
// bucket's size calls for, within again: for several ranks per machine, where the links inside a
// machine are fast and the links between machines are slow.
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
// rank of every machine chooses alike. That prediction is the prior: with `tune` (the default) the
// Synchronizer tries the three schedules across early in training and keeps the one that ran
// fastest, as it does topology::Auto's candidates (engine::ScheduleTuner, TunedTopology); Auto
// offers the same three among its own on a group of several machines.
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
// Everyone else copies those bits, so every rank ends bit-identical.
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
#include "gradsync/topology/halving_doubling.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/topology/ring_phases.hpp"

namespace gradsync::topology {

struct Hierarchical {
  // Phase 2's schedule (the header's "Which schedule across").
  enum class Across : std::uint8_t { automatic, ring, recursive_doubling, halving_doubling };

  int ranks_per_machine = 0;                          // L, required: at least 1, dividing the group size
  // 256 KiB of f32: a quarter of Ring's, because here a piece is also the unit of pipelining
  // between the phases (the link waits for the first column, and the last column's allgather
  // within waits for the link): smaller pieces start and end the link sooner.
  std::size_t chunk_elements = std::size_t{1} << 16;
  Across across = Across::automatic;
  LinkModel link{};         // one message between two ranks of a machine (LinkAwareTopology)
  LinkModel link_across{};  // one message between machines, while every rank of the machine sends one
  bool measure_link = true;  // the Synchronizer replaces both links by what it measures (above)
  bool tune = true;          // with `across` automatic, the Synchronizer keeps what ran fastest (above)

  // How many columns the reduce-scatter within a machine may run ahead of the link: column j
  // starts once the first piece of column j - reduce_lead has come from across.
  static constexpr std::size_t reduce_lead = 2;

  // The schedules within a machine and across machines join disjoint pairs of ranks (neighbours on
  // one machine; the same local rank on different machines), and each lists a pair's messages in
  // one order on both sides (the ring piece after piece, the log-depth schedules round after
  // round), so the schedule is a PairOrderedTopology.
  static constexpr bool posts_pairs_in_order = true;

  static const char* name(Across how) {
    switch (how) {
      case Across::automatic: return "auto";
      case Across::ring: return "ring";
      case Across::recursive_doubling: return "recursive-doubling";
      case Across::halving_doubling: break;
    }
    return "halving-doubling";
  }

  // Whether the Synchronizer should measure the links (LinkAwareTopology): only a choice across needs them.
  bool measures_link() const noexcept { return measure_link && across == Across::automatic; }
  // Whether the Synchronizer should choose across by measured times (TunedTopology).
  bool tunes() const noexcept { return tune && across == Across::automatic; }

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

  // TunedTopology: candidate k is the schedule with `across` made candidate_across(k), predicted
  // by predicted(); with one machine only the ring's is offered (the others would be the same
  // schedule), the rest predicted at infinity.
  static constexpr std::size_t candidates = 3;
  static constexpr Across candidate_across(std::size_t k) {
    constexpr Across order[candidates] = {Across::recursive_doubling, Across::halving_doubling, Across::ring};
    return order[k];
  }
  Schedule candidate_schedule(std::size_t k, const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(candidate_across(k), group, elements, codec);
  }
  double candidate_seconds(std::size_t k, const Group& group, std::size_t elements, std::size_t /*value_bytes*/) const {
    if (machines(group) == 1 && candidate_across(k) != Across::ring) return std::numeric_limits<double>::infinity();
    return predicted(group, elements, candidate_across(k));
  }
  std::string candidate_name(std::size_t k) const { return fmt::format("hierarchical, {} across", name(candidate_across(k))); }

  std::string describe() const {
    std::string links = measure_link || across != Across::automatic
                            ? std::string()
                            : fmt::format(", links {:.1f} us + {:.3f} GB/s within, {:.1f} us + {:.3f} GB/s across",
                                          link.latency * 1e6, gigabytes_per_second(link), link_across.latency * 1e6,
                                          gigabytes_per_second(link_across));
    return fmt::format("hierarchical(ranks-per-machine={}, chunk={}, across={}{})", ranks_per_machine, chunk_elements,
                       name(across), links);
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

  // Seconds predicted for a bucket of `elements` f32 values with phase 2 done `how` (not
  // automatic), over `link` and `link_across`, each phase's steps as the flat topologies predict
  // theirs (concepts.hpp, PredictedTopology), L and M given by the group:
  //   a log-depth schedule across: the ring within's 2(L-1) hops over the largest shard's pieces,
  //     then the log-depth schedule's own prediction over M ranks and that shard;
  //   the ring across: C columns overlapping, a column costing w within (reduce-scatter, then
  //     allgather: (L-1) hops each, M pieces a hop) and a across (2(M-1) hops of one piece):
  //     2w + a for the first, max(2w, a) for each other.
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

  // Phase 2's schedule for a bucket of `elements` values: `across`, or where that is automatic the
  // one predicted fastest, the smaller kind on a tie. One machine has no hops across, whatever
  // `across` says: the ring's (a ring of one averages).
  Across across_for(const Group& group, std::size_t elements) const {
    if (machines(group) == 1 || elements == 0) return Across::ring;
    if (across != Across::automatic) return across;
    Across best = Across::recursive_doubling;
    for (Across how : {Across::halving_doubling, Across::ring})
      if (predicted(group, elements, how) < predicted(group, elements, best)) best = how;
    return best;
  }

  // The choice for a bucket, for the Synchronizer's log.
  std::string choice(const Group& group, std::size_t elements) const {
    return fmt::format("{} across {} machines", name(across_for(group, elements)), machines(group));
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(across_for(group, elements), group, elements, codec);
  }

  // The schedule with phase 2 done `how` (automatic: the ring); one machine takes the ring's.
  Schedule schedule(Across how, const Group& group, std::size_t elements, CodecTraits codec) const {
    if (machines(group) == 1 || elements == 0) how = Across::ring;
    switch (how) {
      case Across::recursive_doubling: return log_depth_across(RecursiveDoubling{}, group, elements, codec);
      case Across::halving_doubling: return log_depth_across(HalvingDoubling{}, group, elements, codec);
      case Across::automatic:
      case Across::ring: break;
    }
    return ring_across(group, elements, codec);
  }

 private:
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
