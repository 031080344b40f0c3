#pragma once
// example::ReverseGroups — a bucketing policy written from outside the library, the one
// docs/writing-policies.md walks through. Gradients are taken in reverse registration order (the
// order backward usually produces them) and every `per_bucket` consecutive ones form a bucket; a
// gradient of another accumulation dtype than the open bucket's starts a new one, because a
// bucket is one buffer of one dtype. The plan depends on the layout alone, so every rank computes
// the same one, and it never changes.

#include <cstdint>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"

namespace example {

struct ReverseGroups {
  std::size_t per_bucket = 4;

  std::string describe() const { return fmt::format("reverse-groups(per-bucket={})", per_bucket); }

  gradsync::BucketPlan initial_plan(const gradsync::Layout& layout) const {
    using gradsync::accumulation_dtype;
    gradsync::BucketPlan plan;
    for (std::size_t id = layout.size(); id-- > 0;) {
      const bool opens_bucket = plan.buckets.empty() || plan.buckets.back().size() >= per_bucket ||
                                accumulation_dtype(layout[plan.buckets.back().front()].dtype) !=
                                    accumulation_dtype(layout[id].dtype);
      if (opens_bucket) plan.buckets.emplace_back();
      plan.buckets.back().push_back(static_cast<gradsync::GradId>(id));
    }
    return plan;
  }

  // No plan is ever proposed, so no agreement round is needed.
  bool agreement_due(std::uint64_t) const { return false; }
  std::optional<gradsync::BucketPlan> end_iteration(const gradsync::ReadyProfile&) const { return std::nullopt; }

  // No deadlines: the Synchronizer simply waits for each bucket.
  std::optional<gradsync::Duration> expected_ready(std::size_t) const { return std::nullopt; }
  void on_late(std::size_t, gradsync::Duration) const {}
};

static_assert(gradsync::BucketingPolicy<ReverseGroups>);

}  // namespace example
