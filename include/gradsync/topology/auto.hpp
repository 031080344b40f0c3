#pragma once
// topology::Auto — per bucket, whichever of its candidate schedules is fastest on this job's
// links: RecursiveDoubling for buckets whose time is latency (log2(p) steps, whole buckets),
// HalvingDoubling between (2 log2(p) steps, 2(p-1)/p of the bucket), the Ring for those whose time
// is bandwidth (pipelined pieces), and on a group of several machines of several ranks each
// (`machines`, below) Hierarchical's five arrangements too. It is the default wherever gradsync
// picks a topology for the user (shipped::Topology, the Python module, the trainers and benchmarks).
//
// Each candidate predicts its time for a bucket (PredictedTopology, concepts.hpp) over `link`, one
// message's cost between two ranks (LinkModel, schedule.hpp); the bucket takes the fastest, the
// smaller kind on a tie. At 64 ranks, 50 us and 1.25 GB/s per message, a 4 KiB bucket takes 6
// butterfly rounds instead of the ring's 126 hops; from about 90 KB halving-doubling's 12 rounds
// of shrinking pieces cost less than 6 whole buckets; where n is not a power of two the fold's two
// whole buckets hand large ones to the ring. Buckets are measured in f32 values (schedule() is not
// told the dtype; an f64 bucket is predicted at half its bytes).
//
// Machines. With `machines.ranks_per_machine` L above 1 (the trainers and the Python module set it
// to the launcher's LOCAL_WORLD_SIZE) and a group of two or more whole machines of L ranks,
// numbered machine-major, Hierarchical's schedules are candidates too, one per arrangement
// (Hierarchical::candidate): a ring within each machine, the exchange across over a shard
// (recursive doubling, halving-doubling or the ring), the ring within again; or each machine's
// buckets to one rank, recursive doubling or halving-doubling among those leaders, the average
// back. Their predictions take
// `machines.link` (within a machine) and `machines.link_across`; the flat candidates are predicted
// over `link`, which is then the link across machines. On any other group they are not offered
// (predicted at infinity, which the tuner reads as "not a candidate here").
//
// The links. A Synchronizer measures them at the first synchronization (engine::measure_links: the
// butterfly's rounds at three sizes, fitted to latency + bytes / bandwidth; on machines, per level)
// and every rank takes the slowest rank's figures from rank 0, so all ranks choose alike: which
// schedule a bucket takes changes which messages its ranks exchange, so a rank choosing otherwise
// would wait for messages that never come. With `measure_link = false` the links given stand
// (`link`, and `machines`' two where machines apply), and describe() shows `link`, so ranks given
// different figures are told at the first synchronization.
//
// Measured. The link model orders the candidates, but what a Synchronizer keeps is what ran
// fastest: with `tune` (the default) it tries each candidate the model does not rule out for a few
// iterations early in training, per size class of buckets, and keeps the one whose slowest rank was
// fastest, exploring again when the kept one drifts (engine::ScheduleTuner, TunedTopology). The
// model's choice stands only where nothing is measured: with `tune = false`, over a device
// transport (no probe, and device timings wait on streams), over NCCL (messages match in order),
// and with a codec that carries state across iterations (error feedback's residual lives in the
// exchange a switch would rebuild).
//
// Pinned. `pinned` fixes the candidate every bucket takes, as NCCL_ALGO fixes NCCL's algorithm:
// for a user who has measured, and for the run-time combinations (shipped.hpp), which reach the
// ring, recursive doubling and halving-doubling by name through this one type. A pinned Auto
// schedules exactly as its candidate alone (the same messages, the same bits) and measures no link.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/topology/halving_doubling.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::topology {

template <PredictedTopology Small = RecursiveDoubling, PredictedTopology Middle = HalvingDoubling,
          PredictedTopology Large = Ring>
struct Auto {
  // The candidates, in TunedTopology's numbering: the three flat schedules, then Hierarchical's
  // five in its own candidate order (the rings within with recursive doubling, halving-doubling or
  // the ring across; a leader with recursive doubling or halving-doubling across).
  enum class Choice : std::uint8_t {
    small,
    middle,
    large,
    machines_recursive_doubling,
    machines_halving_doubling,
    machines_ring,
    machines_leader_recursive_doubling,
    machines_leader_halving_doubling
  };

  Small small{};
  Middle middle{};
  Large large{};
  LinkModel link{};
  bool measure_link = true;  // the Synchronizer replaces the links by what it measures (above)
  std::optional<Choice> pinned;  // every bucket takes this candidate (above)
  bool tune = true;              // the Synchronizer keeps what ran fastest (above)
  // Hierarchical's schedules as candidates (the header's "Machines"); its `tune` is not read (each
  // arrangement is a candidate of its own), and a `within` or `across` set there leaves only the
  // arrangements it allows.
  Hierarchical machines{.ranks_per_machine = 1};

  static constexpr std::size_t flat_candidates = 3;
  static constexpr std::size_t candidates = flat_candidates + Hierarchical::candidates;  // TunedTopology

  static constexpr bool posts_pairs_in_order = PairOrderedTopology<Small> && PairOrderedTopology<Middle> &&
                                               PairOrderedTopology<Large> && PairOrderedTopology<Hierarchical>;
  static constexpr bool flat_allreduce =
      FlatAllreduceTopology<Small> && FlatAllreduceTopology<Middle> && FlatAllreduceTopology<Large>;

  // Whether the Synchronizer should measure the link (LinkAwareTopology): only a choice needs it.
  bool measures_link() const noexcept { return measure_link && !pinned; }
  // Whether the Synchronizer should choose by measured times (TunedTopology).
  bool tunes() const noexcept { return tune && !pinned; }

  // Whether `group` is two or more whole machines of several ranks, so that the hierarchical
  // candidates are offered.
  bool spans_machines(const Group& group) const noexcept {
    const int per_machine = machines.ranks_per_machine;
    return per_machine > 1 && group.size() % per_machine == 0 && group.size() / per_machine > 1;
  }

  // MachineLinkTopology: the ranks a machine has for the link measurement, 0 where one link is
  // measured (no machines apply); and the measured figures, `link` becoming the link across.
  int measured_ranks_per_machine(const Group& group) const { return spans_machines(group) ? machines.ranks_per_machine : 0; }
  void take_links(const LinkModel& within, const LinkModel& across) {
    machines.link = within;
    machines.link_across = across;
    link = across;
  }

  std::string describe() const {
    if (pinned) return fmt::format("auto(pinned {})", describe(*pinned));
    return fmt::format("auto({} | {} | {}{}, link {}{})", small.describe(), middle.describe(), large.describe(),
                       machines.ranks_per_machine > 1
                           ? fmt::format(" | hierarchical over machines of {}", machines.ranks_per_machine)
                           : std::string(),
                       measure_link ? std::string("measured")
                                    : fmt::format("{:.1f} us + {:.3f} GB/s", link.latency * 1e6,
                                                  link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0.0),
                       tune ? ", kept by measured times" : "");
  }

  // Which candidate a bucket of `elements` values takes, by the prediction over the links.
  Choice choose(const Group& group, std::size_t elements) const {
    if (pinned) return *pinned;
    std::size_t best = 0;
    for (std::size_t k = 1; k < candidates; ++k)
      if (candidate_seconds(k, group, elements, sizeof(float)) < candidate_seconds(best, group, elements, sizeof(float)))
        best = k;
    return static_cast<Choice>(best);
  }

  // The time of the flat candidate this Auto would give the bucket over link `over`
  // (PredictedTopology: one link, so the hierarchical candidates, which need two, are not weighed).
  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& over) const {
    if (pinned && !is_machines(*pinned)) return predicted_seconds(*pinned, group, elements, value_bytes, over);
    return std::min({predicted_seconds(Choice::small, group, elements, value_bytes, over),
                     predicted_seconds(Choice::middle, group, elements, value_bytes, over),
                     predicted_seconds(Choice::large, group, elements, value_bytes, over)});
  }

  // A flat candidate's time over link `over`.
  double predicted_seconds(Choice c, const Group& group, std::size_t elements, std::size_t value_bytes,
                           const LinkModel& over) const {
    switch (c) {
      case Choice::small: return small.predicted_seconds(group, elements, value_bytes, over);
      case Choice::middle: return middle.predicted_seconds(group, elements, value_bytes, over);
      default: break;
    }
    return large.predicted_seconds(group, elements, value_bytes, over);
  }

  // The chosen candidate's name, for the Synchronizer's log.
  std::string choice(const Group& group, std::size_t elements) const { return describe(choose(group, elements)); }

  std::string describe(Choice c) const {
    switch (c) {
      case Choice::small: return small.describe();
      case Choice::middle: return middle.describe();
      case Choice::large: return large.describe();
      default: break;
    }
    return machines.candidate_name(machines_candidate(c));
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(choose(group, elements), group, elements, codec);
  }

  Schedule schedule(Choice c, const Group& group, std::size_t elements, CodecTraits codec) const {
    switch (c) {
      case Choice::small: return small.schedule(group, elements, codec);
      case Choice::middle: return middle.schedule(group, elements, codec);
      case Choice::large: return large.schedule(group, elements, codec);
      default: break;
    }
    return machines.candidate_schedule(machines_candidate(c), group, elements, codec);
  }

  // TunedTopology: the candidates by number, each predicted over the links measured for it;
  // a hierarchical one on a group that is not several machines is predicted at infinity.
  Schedule candidate_schedule(std::size_t k, const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(static_cast<Choice>(k), group, elements, codec);
  }
  double candidate_seconds(std::size_t k, const Group& group, std::size_t elements, std::size_t value_bytes) const {
    const auto c = static_cast<Choice>(k);
    if (!is_machines(c)) return predicted_seconds(c, group, elements, value_bytes, link);
    if (!spans_machines(group)) return std::numeric_limits<double>::infinity();
    return machines.candidate_seconds(machines_candidate(c), group, elements, value_bytes);
  }
  std::string candidate_name(std::size_t k) const { return describe(static_cast<Choice>(k)); }

 private:
  static bool is_machines(Choice c) noexcept { return static_cast<std::size_t>(c) >= flat_candidates; }
  static std::size_t machines_candidate(Choice c) noexcept { return static_cast<std::size_t>(c) - flat_candidates; }
};

static_assert(PredictedTopology<Auto<>> && TunedTopology<Auto<>> && MachineLinkTopology<Auto<>>);

}  // namespace gradsync::topology
