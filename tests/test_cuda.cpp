// One math for CPU and GPU: the number-format conversions give the same bits in a CUDA kernel as
// on the host. Skipped, with the reason printed, where no CUDA device is present.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "cuda/numeric_kernels.hpp"
#include "gradsync/numeric.hpp"
#include "support.hpp"

using namespace gradsync;

namespace {
const bool no_device = [] {
  if (cuda_device_count() > 0) return false;
  std::puts("no CUDA device: the device conversion test is skipped (it runs on GPU machines)");
  return true;
}();

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("f16 and bf16 conversions give the host's bits on the device" * doctest::skip(no_device)) {
    // Every 16-bit pattern as a float, plus random values, ties, extremes and specials.
    std::vector<float> in = test::random_values(1 << 18, 11);
    for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
      in.push_back(numeric::from_f16_bits(static_cast<std::uint16_t>(bits)));
      in.push_back(numeric::float_of((bits << 16) | 0x8000u));  // bf16 ties
    }
    for (float v : {65504.0f, 65520.0f, 1e-8f, -0.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
      in.push_back(v);
    DeviceConversions device;
    const std::string error = convert_on_device(in, device);
    REQUIRE_MESSAGE(error.empty(), error);
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(device.f16[i] == numeric::f16_bits(in[i]));
      REQUIRE(device.bf16[i] == numeric::bf16_bits(in[i]));
      const auto pattern = static_cast<std::uint16_t>(i & 0xffffu);
      REQUIRE(same_bits(device.f16_back[i], numeric::from_f16_bits(pattern)));
      REQUIRE(same_bits(device.bf16_back[i], numeric::from_bf16_bits(pattern)));
    }
  }
}
