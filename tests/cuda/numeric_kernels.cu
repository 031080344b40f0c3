// Runs gradsync/numeric.hpp's conversions in a CUDA kernel, so the test beside this file can
// compare the device's bits with the host's for every input it tries.

#include <cuda_runtime.h>

#include <string>

#include "gradsync/numeric.hpp"
#include "numeric_kernels.hpp"

namespace {

__global__ void convert(const float* in, std::uint16_t* f16, std::uint16_t* bf16, float* f16_back, float* bf16_back,
                        std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  f16[i] = gradsync::numeric::f16_bits(in[i]);
  bf16[i] = gradsync::numeric::bf16_bits(in[i]);
  f16_back[i] = gradsync::numeric::from_f16_bits(static_cast<std::uint16_t>(i & 0xffffu));
  bf16_back[i] = gradsync::numeric::from_bf16_bits(static_cast<std::uint16_t>(i & 0xffffu));
}

std::string check(cudaError_t status, const char* what) {
  return status == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(status);
}

}  // namespace

int cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string convert_on_device(const std::vector<float>& in, DeviceConversions& out) {
  const std::size_t n = in.size();
  float *d_in = nullptr, *d_f16_back = nullptr, *d_bf16_back = nullptr;
  std::uint16_t *d_f16 = nullptr, *d_bf16 = nullptr;
  std::string error = check(cudaMalloc(&d_in, n * sizeof(float)), "cudaMalloc");
  if (error.empty()) error = check(cudaMalloc(&d_f16_back, n * sizeof(float)), "cudaMalloc");
  if (error.empty()) error = check(cudaMalloc(&d_bf16_back, n * sizeof(float)), "cudaMalloc");
  if (error.empty()) error = check(cudaMalloc(&d_f16, n * sizeof(std::uint16_t)), "cudaMalloc");
  if (error.empty()) error = check(cudaMalloc(&d_bf16, n * sizeof(std::uint16_t)), "cudaMalloc");
  if (error.empty()) error = check(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), "copy in");
  if (error.empty()) {
    convert<<<static_cast<unsigned>((n + 255) / 256), 256>>>(d_in, d_f16, d_bf16, d_f16_back, d_bf16_back, n);
    error = check(cudaDeviceSynchronize(), "kernel");
  }
  out.f16.resize(n);
  out.bf16.resize(n);
  out.f16_back.resize(n);
  out.bf16_back.resize(n);
  if (error.empty()) error = check(cudaMemcpy(out.f16.data(), d_f16, n * 2, cudaMemcpyDeviceToHost), "copy out");
  if (error.empty()) error = check(cudaMemcpy(out.bf16.data(), d_bf16, n * 2, cudaMemcpyDeviceToHost), "copy out");
  if (error.empty()) error = check(cudaMemcpy(out.f16_back.data(), d_f16_back, n * 4, cudaMemcpyDeviceToHost), "copy out");
  if (error.empty()) error = check(cudaMemcpy(out.bf16_back.data(), d_bf16_back, n * 4, cudaMemcpyDeviceToHost), "copy out");
  cudaFree(d_in);
  cudaFree(d_f16_back);
  cudaFree(d_bf16_back);
  cudaFree(d_f16);
  cudaFree(d_bf16);
  return error;
}
