#pragma once
// topology::Auto — per bucket, whichever of three topologies is predicted fastest on this job's
// link: by default RecursiveDoubling for buckets whose time is latency (log2(p) steps, whole
// buckets), HalvingDoubling between (2 log2(p) steps, 2(p-1)/p of the bucket), the Ring for those
// whose time is bandwidth (pipelined pieces). A user who picks no topology should get this one.
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

#include <algorithm>
#include <cstdint>
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
  Small small{};
  Middle middle{};
  Large large{};
  LinkModel link{};
  bool measure_link = true;  // the Synchronizer replaces `link` by what it measures (above)

  static constexpr bool posts_pairs_in_order =
      PairOrderedTopology<Small> && PairOrderedTopology<Middle> && PairOrderedTopology<Large>;
  static constexpr bool flat_allreduce =
      FlatAllreduceTopology<Small> && FlatAllreduceTopology<Middle> && FlatAllreduceTopology<Large>;

  enum class Choice : std::uint8_t { small, middle, large };

  std::string describe() const {
    return fmt::format("auto({} | {} | {}, link {})", small.describe(), middle.describe(), large.describe(),
                       measure_link ? std::string("measured")
                                    : fmt::format("{:.1f} us + {:.3f} GB/s", link.latency * 1e6,
                                                  link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0.0));
  }

  // Which candidate a bucket of `elements` values takes.
  Choice choose(const Group& group, std::size_t elements) const {
    const double s = small.predicted_seconds(group, elements, sizeof(float), link);
    const double m = middle.predicted_seconds(group, elements, sizeof(float), link);
    const double l = large.predicted_seconds(group, elements, sizeof(float), link);
    if (s <= m && s <= l) return Choice::small;
    return m <= l ? Choice::middle : Choice::large;
  }

  double predicted_seconds(const Group& group, std::size_t elements, std::size_t value_bytes, const LinkModel& over) const {
    return std::min({small.predicted_seconds(group, elements, value_bytes, over),
                     middle.predicted_seconds(group, elements, value_bytes, over),
                     large.predicted_seconds(group, elements, value_bytes, over)});
  }

  // The chosen candidate's name, for the Synchronizer's log.
  std::string choice(const Group& group, std::size_t elements) const {
    switch (choose(group, elements)) {
      case Choice::small: return small.describe();
      case Choice::middle: return middle.describe();
      case Choice::large: break;
    }
    return large.describe();
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    switch (choose(group, elements)) {
      case Choice::small: return small.schedule(group, elements, codec);
      case Choice::middle: return middle.schedule(group, elements, codec);
      case Choice::large: break;
    }
    return large.schedule(group, elements, codec);
  }
};

static_assert(PredictedTopology<Auto<>>);

}  // namespace gradsync::topology
