// The control channel's compiled half: the layout text and its comparison, the plan's wire form.
#include "gradsync/engine/control.hpp"

#include <cstring>
#include <vector>

#include <fmt/format.h>

namespace gradsync::engine {

namespace {

constexpr std::string_view header = "gradsync layout v1";
constexpr std::size_t max_reported = 3;

std::vector<std::string_view> lines(std::string_view text) {
  std::vector<std::string_view> out;
  while (!text.empty()) {
    const auto end = text.find('\n');
    out.push_back(text.substr(0, end));
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  return out;
}

}  // namespace

std::string describe_layout(const Layout& layout, std::string_view policies) {
  std::string text = fmt::format("{}\n{}\n", header, policies);
  for (std::size_t id = 0; id < layout.size(); ++id) {
    const GradientInfo& g = layout[id];
    // Where a gradient lives is compared by kind only: local ranks use GPUs of their own.
    text += fmt::format("{:?} {}[{}] {}\n", g.name, to_string(g.dtype), g.count,
                        g.device.kind == Device::Kind::cpu ? "cpu" : "cuda");
  }
  return text;
}

std::string layout_differences(std::string_view rank0, std::string_view other, int other_rank) {
  if (rank0 == other) return {};
  const auto a = lines(rank0);
  const auto b = lines(other);
  std::vector<std::string> found;
  if (b.empty() || b[0] != header) {
    found.push_back(fmt::format("it speaks another layout format ({:?})", b.empty() ? std::string_view{} : b[0]));
  } else {
    if (a.size() < 2 || b.size() < 2 || a[1] != b[1])
      found.push_back(fmt::format("policies: rank 0 has {:?}, rank {} has {:?}", a.size() > 1 ? a[1] : "",
                                  other_rank, b.size() > 1 ? b[1] : ""));
    const std::size_t count_a = a.size() - std::min<std::size_t>(a.size(), 2);
    const std::size_t count_b = b.size() - std::min<std::size_t>(b.size(), 2);
    if (count_a != count_b)
      found.push_back(fmt::format("rank 0 registered {} gradients, rank {} registered {}", count_a, other_rank, count_b));
    std::size_t reported = 0;
    for (std::size_t i = 0; i < std::min(count_a, count_b) && reported < max_reported; ++i) {
      if (a[i + 2] == b[i + 2]) continue;
      found.push_back(fmt::format("gradient {}: rank 0 has {}, rank {} has {}", i, a[i + 2], other_rank, b[i + 2]));
      ++reported;
    }
  }
  return fmt::format("rank {} differs from rank 0: {}", other_rank, fmt::join(found, "; "));
}

std::string encode_plan(const BucketPlan& plan) {
  std::vector<std::uint32_t> words{static_cast<std::uint32_t>(plan.buckets.size())};
  for (const auto& ids : plan.buckets) {
    words.push_back(static_cast<std::uint32_t>(ids.size()));
    words.insert(words.end(), ids.begin(), ids.end());
  }
  return std::string(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(std::uint32_t));
}

BucketPlan decode_plan(std::string_view bytes, const ErrorContext& where) {
  const auto malformed = [&] {
    return Error(ErrorKind::protocol, where, fmt::format("malformed plan message of {} bytes", bytes.size()));
  };
  if (bytes.size() % sizeof(std::uint32_t) != 0) throw malformed();
  std::vector<std::uint32_t> words(bytes.size() / sizeof(std::uint32_t));
  if (!words.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  std::size_t at = 0;
  const auto next = [&] {
    if (at >= words.size()) throw malformed();
    return words[at++];
  };
  // Every count is checked against the words left before anything is sized by it.
  const auto count = [&] {
    const std::uint32_t n = next();
    if (n > words.size() - at) throw malformed();
    return n;
  };
  BucketPlan plan;
  plan.buckets.resize(count());
  for (auto& ids : plan.buckets) {
    ids.resize(count());
    for (GradId& id : ids) id = next();
  }
  if (at != words.size()) throw malformed();
  return plan;
}

}  // namespace gradsync::engine
