#pragma once
// bucketing::TimeClustered — gradients grouped by when they become ready (the first source
// document): profile ready times over a few iterations, cluster them, send each cluster as one
// bucket, and profile again when the timings drift. No byte cap to tune per model.
//
// Profile. For `profile_iterations` iterations each gradient's ready time (since the first
// ready() of the iteration) is recorded; its time is the median over them, which ignores the
// odd slow iteration.
//
// Cluster (one dimension, by gaps). Gradients sorted by time are cut wherever the gap to the next
// is both at least `min_gap` and at least `gap_factor` times the median gap between neighbours:
// layers whose backward takes real time separate, the weight and bias of one layer do not. Then,
// in time order, a cluster under `min_bucket_bytes` merges with the one after it (below that size
// a bucket's fixed cost outweighs starting early: a 4-rank ring allreduce over TCP costs ~1.3 ms
// however small, ~160 KB of a 1 Gbit/s link's time; the default of 256 KiB is about twice that.
// 1 MiB was tried first and made BERT-base 7% slower than FixedSize at 1 MiB in bench/replay.
// The last cluster stays alone, as it is the one everything waits for), and a cluster over
// `max_bucket_bytes` is split in ready order, never splitting a gradient, so that its first part
// can leave before its last gradient is ready. Each resulting bucket's time point is the time of
// its last gradient. Gradients of different accumulation dtypes cluster separately.
//
// Agree. The plan is proposed after the profile and installed on every rank at an iteration
// boundary by the Synchronizer's agreement round (rank 0's proposal wins, so membership is the
// same everywhere; only timing is local). Rounds happen after iteration profile_iterations - 1 and
// then every `check_every` iterations.
//
// Watch and re-profile. After a plan, each iteration's times are kept for the last `window`
// iterations. When, for some bucket, the median over the window of its first or last gradient's
// time moves from the planned one by more than `drift_tolerance` of the backward span (and by at
// least min_gap), the timings have drifted — a cluster gap opened or closed, or gradients moved to
// another cluster — and a new profile starts; its plan is installed at the next round. Noise of a
// few percent per iteration does not move the medians that far.
//
// Until the first plan it behaves like FixedSize (reverse registration order, DDP's caps). With
// `log` set, each proposal is printed to the Synchronizer's log (Options::log): buckets, their
// sizes and time points.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/settings.hpp"

namespace gradsync::bucketing {

struct TimeClustered {
  std::uint32_t profile_iterations = 5;
  std::uint32_t check_every = 20;
  Duration min_gap = std::chrono::microseconds(200);
  double gap_factor = 4.0;
  std::size_t min_bucket_bytes = std::size_t{256} << 10;
  std::size_t max_bucket_bytes = std::size_t{32} << 20;
  double drift_tolerance = 0.15;
  std::uint32_t window = 5;
  bool log = true;

  void validate() const {
    const std::string_view p = "time-clustered bucketing";
    detail::check_setting(profile_iterations >= 1, p, "profile_iterations", profile_iterations, "at least 1");
    detail::check_setting(check_every >= 1, p, "check_every", check_every, "at least 1");
    detail::check_setting(window >= 1, p, "window", window, "at least 1");
    detail::check_setting(min_gap.count() >= 0, p, "min_gap (ns)", min_gap.count(), "at least 0");
    detail::check_setting(std::isfinite(gap_factor) && gap_factor > 0, p, "gap_factor", gap_factor, "finite and above 0");
    detail::check_setting(std::isfinite(drift_tolerance) && drift_tolerance >= 0, p, "drift_tolerance", drift_tolerance,
                          "finite and at least 0");
    detail::check_setting(max_bucket_bytes >= 1, p, "max_bucket_bytes", max_bucket_bytes, "at least 1");
    detail::check_setting(min_bucket_bytes <= max_bucket_bytes, p, "min_bucket_bytes", min_bucket_bytes,
                          fmt::format("at most max_bucket_bytes ({})", max_bucket_bytes));
  }

  // A plan with each bucket's time point and the span of its members' times.
  struct Timed {
    BucketPlan plan;
    std::vector<Duration> first, last;  // per bucket: earliest and latest member time

    std::string summary(std::span<const GradientInfo> layout) const {
      std::string s = fmt::format("gradsync time-clustered: {} buckets:", plan.buckets.size());
      for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
        std::size_t bytes = 0;
        for (GradId id : plan.buckets[b]) bytes += layout[id].bytes();
        s += fmt::format(" [{} grads, {:.2f} MB, at {:.2f} ms]", plan.buckets[b].size(), bytes / 1e6,
                         std::chrono::duration<double, std::milli>(last[b]).count());
      }
      return s;
    }
  };

  // What the policy has observed: its own business, public only so that the settings above can
  // be given as designated initializers. Sized in initial_plan, so watching allocates nothing.
  struct Learned {
    std::vector<std::vector<Duration>> samples;  // per gradient, the latest iterations' times
    std::optional<Timed> pending;                // proposed, not yet installed
    std::optional<Timed> planned;                // installed; watched for drift
    std::vector<Duration> median, scratch;
  };
  Learned learned{};

  std::string describe() const {
    return fmt::format("time-clustered(profile={}, check_every={}, min_gap={}us, gap_factor={}, min={}, max={}, "
                       "drift={}, window={})",
                       profile_iterations, check_every, min_gap.count() / 1000, gap_factor, min_bucket_bytes,
                       max_bucket_bytes, drift_tolerance, window);
  }

  BucketPlan initial_plan(const Layout& layout) {
    learned = {};
    learned.samples.assign(layout.size(), {});
    for (auto& s : learned.samples) s.reserve(std::max(profile_iterations, window));
    learned.median.assign(layout.size(), Duration::zero());
    learned.scratch.reserve(std::max(profile_iterations, window));
    return FixedSize{}.initial_plan(layout);
  }

  bool agreement_due(std::uint64_t iteration) const {
    const std::uint64_t done = iteration + 1;
    return done == profile_iterations || (done > profile_iterations && (done - profile_iterations) % check_every == 0);
  }

  std::optional<BucketPlan> end_iteration(const ReadyProfile& profile) {
    Learned& l = learned;
    record(profile);
    if (l.planned && drifted()) {
      if (log && profile.log) log_line(*profile.log, "gradsync time-clustered: ready times drifted; profiling again");
      l.planned.reset();
      restart();
    }
    if (!l.planned && !l.pending && profiled() >= profile_iterations) {
      l.pending = cluster(profile.layout, medians(profile_iterations));
      if (log && profile.log) log_line(*profile.log, l.pending->summary(profile.layout));
      restart();  // the drift window starts afresh
    }
    if (!l.pending || !agreement_due(profile.iteration)) return std::nullopt;  // only a round reads it
    std::optional<BucketPlan> proposal = l.pending->plan;
    l.planned = std::move(l.pending);  // installed now; watched from here on
    l.pending.reset();
    return proposal;
  }

  std::optional<Duration> expected_ready(std::size_t) const { return std::nullopt; }  // judged per iteration
  void on_late(std::size_t, Duration) const {}

  // The clustering rule, on given times (indexed by GradId); public for tests and tools.
  Timed cluster(std::span<const GradientInfo> layout, std::span<const Duration> times) const {
    struct Cluster {
      std::vector<GradId> ids;
      std::size_t bytes = 0;
    };
    std::vector<Cluster> clusters;  // both dtypes, each in time order; merged by time below
    for (const bool wide : {false, true}) {
      std::vector<GradId> order;
      for (GradId id = 0; id < layout.size(); ++id)
        if ((accumulation_dtype(layout[id].dtype) == DType::f64) == wide) order.push_back(id);
      if (order.empty()) continue;
      std::stable_sort(order.begin(), order.end(), [&](GradId a, GradId b) { return times[a] < times[b]; });
      std::vector<Duration> gaps;
      for (std::size_t i = 1; i < order.size(); ++i) gaps.push_back(times[order[i]] - times[order[i - 1]]);
      Duration cut = min_gap;
      if (!gaps.empty()) {
        std::vector<Duration> sorted = gaps;
        const std::size_t middle = (sorted.size() - 1) / 2;  // the lower median: with two gaps, the smaller
        std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(middle), sorted.end());
        cut = std::max(cut, Duration(static_cast<Duration::rep>(gap_factor * static_cast<double>(sorted[middle].count()))));
      }
      // Gap clusters, then merge the small ones forward and split the large ones.
      std::vector<Cluster> by_gap(1);
      for (std::size_t i = 0; i < order.size(); ++i) {
        if (i > 0 && gaps[i - 1] >= cut) by_gap.emplace_back();
        by_gap.back().ids.push_back(order[i]);
        by_gap.back().bytes += layout[order[i]].bytes();
      }
      Cluster open;
      for (Cluster& c : by_gap) {
        for (GradId id : c.ids) {
          if (!open.ids.empty() && open.bytes + layout[id].bytes() > max_bucket_bytes && open.bytes >= min_bucket_bytes) {
            clusters.push_back(std::move(open));
            open = {};
          }
          open.ids.push_back(id);
          open.bytes += layout[id].bytes();
        }
        if (open.bytes >= min_bucket_bytes) {
          clusters.push_back(std::move(open));
          open = {};
        }
      }
      if (!open.ids.empty()) clusters.push_back(std::move(open));  // a small last cluster stays last and small
    }
    Timed timed;
    std::vector<std::size_t> by_time(clusters.size());
    std::iota(by_time.begin(), by_time.end(), 0);
    const auto last_time = [&](const Cluster& c) { return times[c.ids.back()]; };
    std::stable_sort(by_time.begin(), by_time.end(),
                     [&](std::size_t a, std::size_t b) { return last_time(clusters[a]) < last_time(clusters[b]); });
    for (std::size_t i : by_time) {
      timed.first.push_back(times[clusters[i].ids.front()]);
      timed.last.push_back(last_time(clusters[i]));
      timed.plan.buckets.push_back(std::move(clusters[i].ids));
    }
    return timed;
  }

  // Iterations recorded since the samples were last cleared (every gradient has one per iteration).
  std::size_t profiled() const { return learned.samples.empty() ? 0 : learned.samples.front().size(); }

  void restart() {
    for (auto& s : learned.samples) s.clear();
  }

  void record(const ReadyProfile& profile) {
    const std::size_t keep = learned.planned ? window : profile_iterations;
    for (std::size_t id = 0; id < learned.samples.size(); ++id) {
      auto& s = learned.samples[id];
      while (s.size() >= keep) s.erase(s.begin());  // a handful of values: a shift, not an allocation
      s.push_back(profile.ready_time[id]);
    }
  }

  // Each gradient's median over its latest `count` times.
  const std::vector<Duration>& medians(std::size_t count) {
    for (std::size_t id = 0; id < learned.samples.size(); ++id) {
      const auto& s = learned.samples[id];
      learned.scratch.assign(s.end() - static_cast<std::ptrdiff_t>(count), s.end());
      std::nth_element(learned.scratch.begin(), learned.scratch.begin() + static_cast<std::ptrdiff_t>(count / 2),
                       learned.scratch.end());
      learned.median[id] = learned.scratch[count / 2];
    }
    return learned.median;
  }

  // Whether the median times over the window moved a bucket's first or last gradient by more than
  // the tolerance.
  bool drifted() {
    if (profiled() < window) return false;
    const Timed& planned = *learned.planned;
    const std::vector<Duration>& now = medians(window);
    const Duration span = planned.last.back() - planned.first.front();
    const Duration tolerance =
        std::max(min_gap, Duration(static_cast<Duration::rep>(drift_tolerance * static_cast<double>(span.count()))));
    const auto moved = [&](Duration a, Duration b) { return (a > b ? a - b : b - a) > tolerance; };
    for (std::size_t b = 0; b < planned.plan.buckets.size(); ++b) {
      Duration first = Duration::max(), last = Duration::min();
      for (GradId id : planned.plan.buckets[b]) {
        first = std::min(first, now[id]);
        last = std::max(last, now[id]);
      }
      if (moved(first, planned.first[b]) || moved(last, planned.last[b])) return true;
    }
    return false;
  }
};

static_assert(BucketingPolicy<TimeClustered>);

}  // namespace gradsync::bucketing
