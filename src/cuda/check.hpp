#pragma once
// cuda::detail::check — a failed CUDA runtime call as gradsync::Error, for the compiled CUDA
// sources (codecs.cpp, memory.cpp, transport/nccl.cpp). Private to the library.

#include <cuda_runtime.h>

#include <string_view>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::cuda::detail {

// Throws Error(internal) naming `operation`, `where` (a device and a size, say) and CUDA's words
// when `status` is not cudaSuccess. A failed call's error stays as the thread's last error
// (cudaGetLastError) until read; it is cleared first, so that a later launch's check (kernels.cu
// reads the last error) reports only its own.
inline void check(cudaError_t status, const char* operation, std::string_view where = "CUDA") {
  if (status == cudaSuccess) return;
  cudaGetLastError();
  throw Error(ErrorKind::internal, {.operation = operation}, fmt::format("{}: {}", where, cudaGetErrorString(status)));
}

// The kernels' launchers (kernels.hpp) return their cudaError_t as an int: kernels.cu's callers
// need no CUDA headers.
inline void check(int status, const char* operation) { check(static_cast<cudaError_t>(status), operation); }

}  // namespace gradsync::cuda::detail
