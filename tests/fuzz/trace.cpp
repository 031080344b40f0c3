// Fuzz target: bench/replay's trace reader (bench/trace.hpp). A malformed trace must be a
// std::runtime_error naming the line.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  try {
    (void)gradsync_bench::read_trace(in, "fuzz");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
