#pragma once
// What a bucketing policy produces (a BucketPlan) and what it learns from (a ReadyProfile).

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "gradsync/log.hpp"
#include "gradsync/types.hpp"

namespace gradsync {

using Duration = std::chrono::nanoseconds;

// Buckets in launch order; each lists its gradients in the order they are packed. The rules a plan
// must obey (every gradient in exactly one non-empty bucket, one accumulation dtype per bucket,
// the same plan on every rank) are listed with the BucketingPolicy concept, concepts.hpp.
struct BucketPlan {
  std::vector<std::vector<GradId>> buckets{};
  friend bool operator==(const BucketPlan&, const BucketPlan&) = default;
};

// What one rank saw during one iteration: when each gradient became ready, relative to the first
// ready() of the iteration, and the order in which they did.
struct ReadyProfile {
  std::uint64_t iteration = 0;             // 0-based, the iteration just completed
  std::span<const GradientInfo> layout{};    // indexed by GradId
  std::span<const Duration> ready_time{};    // indexed by GradId
  std::span<const GradId> order{};           // first ready first
  const LogSink* log = nullptr;            // where the policy may print (Options::log); null: nowhere
};

}  // namespace gradsync
