#pragma once
// Host-side entry points of numeric_kernels.cu (compiled by nvcc; called from plain C++).

#include <cstdint>
#include <string>
#include <vector>

struct DeviceConversions {
  std::vector<std::uint16_t> f16, bf16;     // of each input
  std::vector<float> f16_back, bf16_back;  // of each 16-bit pattern i & 0xffff
};

int cuda_device_count();
// Empty on success, else what failed.
std::string convert_on_device(const std::vector<float>& in, DeviceConversions& out);
