#pragma once
// A bucket summed by the transport's own allreduce (Options::native_allreduce, a DeviceAllreduce
// transport such as transport::Nccl) and divided by the group on its stream; the division is the
// ring's average step, the same kernel, so every rank ends with the same bits.

#include <chrono>
#include <cstdint>
#include <span>

#include "gradsync/concepts.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/error.hpp"
#include "gradsync/options.hpp"
#include "gradsync/timeline.hpp"

namespace gradsync::engine {

// Averages `values` (device memory) over the transport's `ranks`, which must be all of them. NCCL
// does not say what it sent: the bucket counts as a ring allreduce's bytes, 2(n-1)/n of it,
// uncompressed. `where` names the bucket in errors; `timeline`, if any, gets the allreduce.
template <DeviceAllreduce X>
ExchangeStats allreduce_natively(X& transport, std::span<float> values, int ranks, std::chrono::milliseconds timeout,
                                 Timeline* timeline, ErrorContext where) {
  const auto started = std::chrono::steady_clock::now();
  const std::int64_t traced = timeline ? Timeline::now() : 0;
  try {
    transport.allreduce(values, started + timeout);
  } catch (const Error& e) {
    where.operation = "allreduce";
    throw e.filled(where);
  }
  const auto summed = std::chrono::steady_clock::now();
  if (timeline) timeline->record(Timeline::Kind::allreduce, traced, where.bucket.value_or(0), values.size_bytes());
  try {
    cuda::divide(values.data(), values.size(), static_cast<float>(ranks), transport.cuda_stream());
  } catch (const Error& e) {
    where.operation = "average";
    throw e.filled(where);
  }
  const auto n = static_cast<std::uint64_t>(ranks);
  const std::uint64_t bytes = 2 * (n - 1) * values.size_bytes() / n;
  return {.bytes_sent = bytes,
          .bytes_uncompressed = bytes,
          .compute = std::chrono::steady_clock::now() - summed,
          .waiting = summed - started};
}

}  // namespace gradsync::engine
