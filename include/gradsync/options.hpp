#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace gradsync {

// Settings of a Synchronizer that are not part of any policy.
struct Options {
  // How long any single wait may last: a transport operation, the layout exchange, or wait()
  // for an iteration whose gradients were not all marked ready. Training steps that take longer
  // than this between ready() calls need a larger value.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

// What the last completed iteration cost this rank.
struct IterationStats {
  std::uint64_t iteration = 0;
  std::size_t buckets = 0;
  std::uint64_t bytes_sent = 0;
  // Time wait() spent blocked: the communication that backward did not hide.
  std::chrono::nanoseconds exposed{0};
};

}  // namespace gradsync
