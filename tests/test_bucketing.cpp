// Bucketing policies: the plans they make.

#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/bucketing/per_tensor.hpp"

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
}
