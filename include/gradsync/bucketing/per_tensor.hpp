#pragma once
// bucketing::PerTensor — every gradient is its own bucket. The first iteration launches them in
// reverse registration order (the usual backward order); after it, rank 0's observed ready order
// is agreed and kept. The null policy of its family: the simplest plan that overlaps at all.

#include <optional>
#include <string>

#include "gradsync/concepts.hpp"

namespace gradsync::bucketing {

struct PerTensor {
  std::string describe() const { return "per-tensor"; }

  BucketPlan initial_plan(const Layout& layout) const {
    BucketPlan plan;
    for (std::size_t i = layout.size(); i-- > 0;) plan.buckets.push_back({static_cast<GradId>(i)});
    return plan;
  }

  bool agreement_due(std::uint64_t iteration) const { return iteration == 0; }

  std::optional<BucketPlan> end_iteration(const ReadyProfile& profile) const {
    if (profile.iteration != 0) return std::nullopt;
    BucketPlan plan;
    for (GradId id : profile.order) plan.buckets.push_back({id});
    return plan;
  }

  std::optional<Duration> expected_ready(std::size_t) const { return std::nullopt; }
  void on_late(std::size_t, Duration) const {}
};

static_assert(BucketingPolicy<PerTensor>);

}  // namespace gradsync::bucketing
