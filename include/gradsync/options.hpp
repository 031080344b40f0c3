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
  // What the same sends would have been in the accumulation dtype: bytes_uncompressed / bytes_sent
  // is the compression the codec achieved on the wire.
  std::uint64_t bytes_uncompressed = 0;
  // Time wait() spent blocked: the communication that backward did not hide.
  std::chrono::nanoseconds exposed{0};
  // From the last ready() to the last bucket's average: the synchronization left after backward.
  std::chrono::nanoseconds after_last_ready{0};
  // On the communication thread: packing buckets and encode/decode/average steps, and time blocked
  // on the transport.
  std::chrono::nanoseconds compute{0};
  std::chrono::nanoseconds waiting{0};

  double compression_ratio() const {
    return bytes_sent ? static_cast<double>(bytes_uncompressed) / static_cast<double>(bytes_sent) : 1.0;
  }
};

}  // namespace gradsync
