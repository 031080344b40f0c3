// Fuzz target: the control messages ranks decode from each other: an agreed bucket plan
// (engine::decode_plan), two layout texts compared (engine::layout_differences), and the
// coordinator's reports and grants (engine/coordinator/wire.hpp). Malformed input must end in a
// gradsync::Error, nothing else.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "gradsync/engine/control.hpp"
#include "gradsync/engine/coordinator/wire.hpp"
#include "gradsync/error.hpp"

using namespace gradsync;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const BucketPlan plan = engine::decode_plan(text, {.rank = 0, .operation = "fuzz"});
    if (engine::decode_plan(engine::encode_plan(plan), {.rank = 0, .operation = "fuzz"}) != plan) __builtin_trap();
  } catch (const Error&) {
  }
  const auto split = text.find('\0');
  if (split != std::string_view::npos) (void)engine::layout_differences(text.substr(0, split), text.substr(split + 1), 1);
  const auto bytes = std::as_bytes(std::span(data, size));
  namespace cw = engine::coordinator_wire;
  try {
    std::vector<cw::ReportEntry> reports;
    cw::read(bytes, cw::Kind::report, 1, reports);
  } catch (const Error&) {
  }
  try {
    std::vector<std::uint64_t> grants;  // task ids
    cw::read(bytes, cw::Kind::grant, 1, grants);
  } catch (const Error&) {
  }
  return 0;
}
