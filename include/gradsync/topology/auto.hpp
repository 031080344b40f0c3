#pragma once
// topology::Auto — per bucket, whichever of three topologies is predicted fastest on this job's
// link: by default RecursiveDoubling for buckets whose time is latency (log2(p) steps, whole
// buckets), HalvingDoubling between (2 log2(p) steps, 2(p-1)/p of the bucket), the Ring for those
// whose time is bandwidth (pipelined pieces). It is the default wherever gradsync picks a
// topology for the user (shipped::Topology, the Python module, the trainers and benchmarks).
//
// Each candidate predicts its time for a bucket (PredictedTopology, concepts.hpp) over `link`, one
// message's cost between two ranks (LinkModel, schedule.hpp); the bucket takes the fastest, the
// smaller kind on a tie. At 64 ranks, 50 us and 1.25 GB/s per message, a 4 KiB bucket takes 6
// butterfly rounds instead of the ring's 126 hops; from about 90 KB halving-doubling's 12 rounds
// of shrinking pieces cost less than 6 whole buckets; where n is not a power of two the fold's two
// whole buckets hand large ones to the ring. Buckets are measured in f32 values (schedule() is not
// told the dtype; an f64 bucket is predicted at half its bytes).
//
// The link. A Synchronizer measures it at the first synchronization (engine::calibrate_link: the
// butterfly's rounds at three sizes, fitted to latency + bytes / bandwidth) and every
// rank takes the slowest rank's figures from rank 0, so all ranks choose alike: which topology a
// bucket takes changes which messages its ranks exchange, so a rank choosing otherwise would wait
// for messages that never come. With `measure_link = false` the `link` given stands, and describe()
// shows it, so ranks given different figures are told at the first synchronization.
//
// Measured. The link model orders the candidates, but what a Synchronizer keeps is what ran
// fastest: with `tune` (the default) it tries each candidate the model does not rule out for a few
// iterations early in training, per size class of buckets, and keeps the one whose slowest rank was
// fastest, exploring again when the kept one drifts (engine::ScheduleTuner, TunedTopology). The
// model's choice stands only where nothing is measured: with `tune = false`, over a device
// transport (no probe, and device timings wait on streams) and over NCCL (messages match in order).
//
// Pinned. `pinned` fixes the candidate every bucket takes, as NCCL_ALGO fixes NCCL's algorithm:
// for a user who has measured, and for the run-time combinations (shipped.hpp), which reach the
// ring, recursive doubling and halving-doubling by name through this one type. A pinned Auto
// schedules exactly as its candidate alone (the same messages, the same bits) and measures no link.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/topology/halving_doubling.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::topology {

template <PredictedTopology Small = RecursiveDoubling, PredictedTopology Middle = HalvingDoubling,
          PredictedTopology Large = Ring>
struct Auto {
  enum class Choice : std::uint8_t { small, middle, large };

  Small small{};
  Middle middle{};
  Large large{};
  LinkModel link{};
  bool measure_link = true;  // the Synchronizer replaces `link` by what it measures (above)
  std::optional<Choice> pinned;  // every bucket takes this candidate (above)
  bool tune = true;              // the Synchronizer keeps what ran fastest (above)

  static constexpr std::size_t candidates = 3;  // TunedTopology: Choice's values, in order

  static constexpr bool posts_pairs_in_order =
      PairOrderedTopology<Small> && PairOrderedTopology<Middle> && PairOrderedTopology<Large>;
  static constexpr bool flat_allreduce =
      FlatAllreduceTopology<Small> && FlatAllreduceTopology<Middle> && FlatAllreduceTopology<Large>;

  // Whether the Synchronizer should measure the link (LinkAwareTopology): only a choice needs it.
  bool measures_link() const noexcept { return measure_link && !pinned; }
  // Whether the Synchronizer should choose by measured times (TunedTopology).
  bool tunes() const noexcept { return tune && !pinned; }

  std::string describe() const {
    if (pinned) return fmt::format("auto(pinned {})", describe(*pinned));
    return fmt::format("auto({} | {} | {}, link {}{})", small.describe(), middle.describe(), large.describe(),
                       measure_link ? std::string("measured")
                                    : fmt::format("{:.1f} us + {:.3f} GB/s", link.latency * 1e6,
                                                  link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0.0),
                       tune ? ", kept by measured times" : "");
  }

  // Which candidate a bucket of `elements` values takes.
  Choice choose(const Group& group, std::size_t elements) const {
    if (pinned) return *pinned;
    const double s = predicted_seconds(Choice::small, group, elements, sizeof(float), link);
    const double m = predicted_seconds(Choice::middle, group, elements, sizeof(float), link);
    const double l = predicted_seconds(Choice::large, group, elements, sizeof(float), link);
    if (s <= m && s <= l) return Choice::small;
    return m <= l ? Choice::middle : Choice::large;
  }

  // The time of the candidate this Auto would give the bucket over link `over` (PredictedTopology).
  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& over) const {
    if (pinned) return predicted_seconds(*pinned, group, elements, value_bytes, over);
    return std::min({predicted_seconds(Choice::small, group, elements, value_bytes, over),
                     predicted_seconds(Choice::middle, group, elements, value_bytes, over),
                     predicted_seconds(Choice::large, group, elements, value_bytes, over)});
  }

  double predicted_seconds(Choice c, const Group& group, std::size_t elements, std::size_t value_bytes,
                           const LinkModel& over) const {
    switch (c) {
      case Choice::small: return small.predicted_seconds(group, elements, value_bytes, over);
      case Choice::middle: return middle.predicted_seconds(group, elements, value_bytes, over);
      case Choice::large: break;
    }
    return large.predicted_seconds(group, elements, value_bytes, over);
  }

  // The chosen candidate's name, for the Synchronizer's log.
  std::string choice(const Group& group, std::size_t elements) const { return describe(choose(group, elements)); }

  std::string describe(Choice c) const {
    switch (c) {
      case Choice::small: return small.describe();
      case Choice::middle: return middle.describe();
      case Choice::large: break;
    }
    return large.describe();
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(choose(group, elements), group, elements, codec);
  }

  Schedule schedule(Choice c, const Group& group, std::size_t elements, CodecTraits codec) const {
    switch (c) {
      case Choice::small: return small.schedule(group, elements, codec);
      case Choice::middle: return middle.schedule(group, elements, codec);
      case Choice::large: break;
    }
    return large.schedule(group, elements, codec);
  }

  // TunedTopology: the candidates by number.
  Schedule candidate_schedule(std::size_t k, const Group& group, std::size_t elements, CodecTraits codec) const {
    return schedule(static_cast<Choice>(k), group, elements, codec);
  }
  double candidate_seconds(std::size_t k, const Group& group, std::size_t elements, std::size_t value_bytes,
                           const LinkModel& over) const {
    return predicted_seconds(static_cast<Choice>(k), group, elements, value_bytes, over);
  }
  std::string candidate_name(std::size_t k) const { return describe(static_cast<Choice>(k)); }
};

static_assert(PredictedTopology<Auto<>> && TunedTopology<Auto<>>);

}  // namespace gradsync::topology
