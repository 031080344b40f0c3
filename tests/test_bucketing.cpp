// Bucketing policies: the plans they make.

#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <set>

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/bucketing/per_tensor.hpp"
#include "gradsync/bucketing/time_clustered.hpp"

using namespace gradsync;

template <>
struct doctest::StringMaker<BucketPlan> {
  static String convert(const BucketPlan& plan) {
    std::string s = "{";
    for (const auto& b : plan.buckets) {
      s += "{";
      for (GradId id : b) s += std::to_string(id) + ",";
      s += "}";
    }
    return (s + "}").c_str();
  }
};

namespace {

Layout floats(std::initializer_list<std::size_t> counts) {
  Layout l;
  for (std::size_t c : counts) l.push_back({"g" + std::to_string(l.size()), c, DType::f32});
  return l;
}

// Every gradient exactly once.
void check_partition(const BucketPlan& plan, std::size_t n) {
  std::multiset<GradId> seen;
  for (const auto& b : plan.buckets) {
    CHECK_FALSE(b.empty());
    seen.insert(b.begin(), b.end());
  }
  REQUIRE(seen.size() == n);
  for (GradId id = 0; id < n; ++id) CHECK(seen.count(id) == 1);
}

}  // namespace

TEST_SUITE("bucketing") {
  TEST_CASE("PerTensor starts from reverse registration order and adopts the observed order once") {
    bucketing::PerTensor policy;
    const Layout layout = floats({1, 2, 3});
    CHECK(policy.initial_plan(layout) == BucketPlan{{{2}, {1}, {0}}});
    const std::vector<GradId> order{1, 2, 0};
    const std::vector<Duration> times(3);
    CHECK(policy.end_iteration({0, layout, times, order}) == BucketPlan{{{1}, {2}, {0}}});
    CHECK_FALSE(policy.end_iteration({1, layout, times, order}));
    CHECK(policy.agreement_due(0));
    CHECK_FALSE(policy.agreement_due(1));
  }

  TEST_CASE("FixedSize packs in order under the caps, small first bucket, never splitting") {
    const bucketing::FixedSize policy{.cap_bytes = 100, .first_cap_bytes = 40};
    // f32 gradients of 24, 16, 8, 40, 400 (over the cap), 60, 40 bytes.
    const Layout layout = floats({6, 4, 2, 10, 100, 15, 10});
    const std::vector<GradId> order{0, 1, 2, 3, 4, 5, 6};
    const BucketPlan plan = policy.pack(layout, order);
    check_partition(plan, layout.size());
    // first bucket: 24+16 = 40 reaches the first cap; then 8+40 = 48, +400 would pass 100;
    // 400 alone; 60+40 = 100 reaches the cap.
    CHECK(plan == BucketPlan{{{0, 1}, {2, 3}, {4}, {5, 6}}});
    for (const auto& bucket : plan.buckets) {
      std::size_t bytes = 0;
      for (GradId id : bucket) bytes += layout[id].bytes();
      CHECK((bytes <= 100 || bucket.size() == 1));
    }
  }

  TEST_CASE("FixedSize keeps f64 gradients apart and orders buckets by their last gradient") {
    const bucketing::FixedSize policy{.cap_bytes = 1000, .first_cap_bytes = 1000};
    Layout layout = floats({10, 10, 10});
    layout.push_back({"d", 10, DType::f64});
    layout.push_back({"h", 10, DType::f16});  // accumulates in f32, like f32
    const std::vector<GradId> order{3, 0, 4, 1, 2};
    const BucketPlan plan = policy.pack(layout, order);
    check_partition(plan, layout.size());
    CHECK(plan == BucketPlan{{{3}, {0, 4, 1, 2}}});
  }

  TEST_CASE("FixedSize's initial plan is reverse registration order; it re-packs from observed order once") {
    bucketing::FixedSize policy{.cap_bytes = 16, .first_cap_bytes = 16};
    const Layout layout = floats({2, 2, 2, 2});
    CHECK(policy.initial_plan(layout) == BucketPlan{{{3, 2}, {1, 0}}});
    const std::vector<GradId> order{0, 2, 1, 3};
    const std::vector<Duration> times(4);
    CHECK(policy.end_iteration({0, layout, times, order}) == BucketPlan{{{0, 2}, {1, 3}}});
    CHECK_FALSE(policy.end_iteration({5, layout, times, order}));
  }

  TEST_CASE("TimeClustered cuts at the gaps in ready times, merges small clusters and splits large ones") {
    using namespace std::chrono_literals;
    const Layout layout = floats({65536, 65536, 65536, 65536, 65536, 65536, 65536, 65536, 65536});  // 256 KiB each
    // Three layers of three tensors, 5 ms apart; inside a layer 50 us apart.
    const std::vector<Duration> times{0us, 50us, 100us, 5000us, 5050us, 5100us, 10000us, 10050us, 10100us};
    bucketing::TimeClustered policy{.min_bucket_bytes = 512 << 10, .log = false};
    auto timed = policy.cluster(layout, times);
    CHECK(timed.plan == BucketPlan{{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}}});
    CHECK(timed.last == std::vector<Duration>{100us, 5100us, 10100us});
    CHECK(timed.first == std::vector<Duration>{0us, 5000us, 10000us});

    // Above the minimum only in pairs of clusters: a too-small cluster joins the next; the last
    // stays alone.
    policy.min_bucket_bytes = 1 << 20;
    CHECK(policy.cluster(layout, times).plan == BucketPlan{{{0, 1, 2, 3, 4, 5}, {6, 7, 8}}});

    // A cap below a cluster's size splits it in ready order.
    policy.min_bucket_bytes = 256 << 10;
    policy.max_bucket_bytes = 512 << 10;
    CHECK(policy.cluster(layout, times).plan == BucketPlan{{{0, 1}, {2}, {3, 4}, {5}, {6, 7}, {8}}});

    // Ready order, not registration order, decides membership; f64 gradients cluster apart.
    Layout mixed = floats({65536, 65536, 65536, 65536});
    mixed[1].dtype = DType::f64;
    const std::vector<Duration> shuffled{5000us, 0us, 5010us, 10us};
    bucketing::TimeClustered small{.min_bucket_bytes = 1, .log = false};
    CHECK(small.cluster(mixed, shuffled).plan == BucketPlan{{{1}, {3}, {0, 2}}});
  }

  TEST_CASE("TimeClustered re-profiles when the timings drift, and not on noise") {
    using namespace std::chrono_literals;
    const Layout layout = floats({1000, 1000, 1000, 1000, 1000, 1000});
    bucketing::TimeClustered policy{.profile_iterations = 3, .check_every = 4, .min_bucket_bytes = 1, .window = 3, .log = false};
    CHECK(policy.initial_plan(layout) == bucketing::FixedSize{}.initial_plan(layout));
    std::mt19937 gen(3);
    std::uniform_real_distribution<double> jitter(0.9, 1.1);  // +-10% per layer (pair) per iteration
    // Pairs of gradients 4 ms apart; later, the second pair moves up against the first.
    const std::vector<double> steady_ms{0, 0.01, 4, 4.01, 8, 8.01}, drifted_ms{0, 0.01, 0.05, 0.06, 8, 8.01};
    std::vector<Duration> times(layout.size());
    std::vector<GradId> order{0, 1, 2, 3, 4, 5};
    std::vector<std::optional<BucketPlan>> proposals;
    const auto step = [&](std::uint64_t iteration, const std::vector<double>& ms) {
      for (std::size_t pair = 0; pair < ms.size(); pair += 2) {
        const double factor = jitter(gen);
        for (std::size_t id = pair; id < pair + 2; ++id)
          times[id] = std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::milli>(ms[id] * factor));
      }
      const ReadyProfile profile{iteration, layout, times, order};
      proposals.push_back(policy.end_iteration(profile));
      CHECK((proposals.back().has_value() <= policy.agreement_due(iteration)));  // proposes only at rounds
    };
    std::uint64_t iteration = 0;
    for (; iteration < 40; ++iteration) step(iteration, steady_ms);
    const BucketPlan steady{{{0, 1}, {2, 3}, {4, 5}}};
    CHECK(proposals[2] == steady);  // after the profile of 3 iterations
    for (std::size_t i = 3; i < proposals.size(); ++i) CHECK_FALSE(proposals[i].has_value());  // noise: kept
    for (; iteration < 60; ++iteration) step(iteration, drifted_ms);
    std::vector<BucketPlan> later;
    for (std::size_t i = 40; i < proposals.size(); ++i)
      if (proposals[i]) later.push_back(*proposals[i]);
    REQUIRE(later.size() == 1);  // one new plan, then quiet again
    // The gaps of 40 us no longer reach the cut (max(200 us, 4 x the median gap)).
    CHECK(later[0] == BucketPlan{{{0, 1, 2, 3}, {4, 5}}});
  }
}
