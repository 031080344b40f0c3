#pragma once
// bucketing::FixedSize — gradients packed in ready order into buckets of at most `cap_bytes`
// (the first bucket at most `first_cap_bytes`, so communication starts early in backward), the
// caps PyTorch DDP defaults to. A gradient is never split: one larger than the cap travels alone.
// Gradients of different accumulation dtypes (f32 vs f64) fill separate buckets, which launch in
// the order their last gradient is expected.
//
// The first iteration assumes reverse registration order; after it, the plan is rebuilt once from
// rank 0's observed ready order and agreed by every rank. Sizes are counted in the gradients' own
// bytes.

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/settings.hpp"

namespace gradsync::bucketing {

struct FixedSize {
  std::size_t cap_bytes = std::size_t{25} << 20;
  std::size_t first_cap_bytes = std::size_t{1} << 20;

  void validate() const {
    detail::check_setting(cap_bytes >= 1, "fixed-size bucketing", "cap_bytes", cap_bytes, "at least 1");
    detail::check_setting(first_cap_bytes >= 1, "fixed-size bucketing", "first_cap_bytes", first_cap_bytes, "at least 1");
  }

  std::string describe() const { return fmt::format("fixed-size(cap={}, first={})", cap_bytes, first_cap_bytes); }

  BucketPlan initial_plan(const Layout& layout) const {
    std::vector<GradId> order(layout.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<GradId>(order.size() - 1 - i);
    return pack(layout, order);
  }

  bool agreement_due(std::uint64_t iteration) const { return iteration == 0; }

  std::optional<BucketPlan> end_iteration(const ReadyProfile& profile) const {
    if (profile.iteration != 0) return std::nullopt;
    return pack(profile.layout, profile.order);
  }

  std::optional<Duration> expected_ready(std::size_t) const { return std::nullopt; }
  void on_late(std::size_t, Duration) const {}

  // Greedy packing of `order`; public so that tests and other policies can reuse the rule.
  BucketPlan pack(std::span<const GradientInfo> layout, std::span<const GradId> order) const {
    struct Open {
      std::vector<GradId> ids;
      std::size_t bytes = 0;
      std::size_t last_position = 0;
    };
    std::vector<std::pair<std::size_t, std::vector<GradId>>> closed;  // (last position, members)
    Open open[2];  // by accumulation dtype: f32, f64
    const auto close = [&](Open& o) {
      if (o.ids.empty()) return;
      closed.emplace_back(o.last_position, std::move(o.ids));
      o = Open{};
    };
    for (std::size_t position = 0; position < order.size(); ++position) {
      const GradId id = order[position];
      Open& o = open[accumulation_dtype(layout[id].dtype) == DType::f64 ? 1 : 0];
      const std::size_t cap = closed.empty() ? first_cap_bytes : cap_bytes;
      if (!o.ids.empty() && o.bytes + layout[id].bytes() > cap) close(o);
      o.ids.push_back(id);
      o.bytes += layout[id].bytes();
      o.last_position = position;
      if (o.bytes >= (closed.empty() ? first_cap_bytes : cap_bytes)) close(o);
    }
    close(open[0]);
    close(open[1]);
    std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    BucketPlan plan;
    for (auto& [position, ids] : closed) plan.buckets.push_back(std::move(ids));
    return plan;
  }
};

static_assert(BucketingPolicy<FixedSize>);

}  // namespace gradsync::bucketing
