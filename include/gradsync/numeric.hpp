#pragma once
// Per-element arithmetic shared by the CPU path and the CUDA kernels: written once as
// host/device functions so that both run exactly the same rounding, and the CPU tests that CI
// runs vouch for the GPU as well.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GRADSYNC_HD __host__ __device__ __forceinline__
#else
#define GRADSYNC_HD inline
#endif

namespace gradsync::numeric {

GRADSYNC_HD std::uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

GRADSYNC_HD float float_of(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Single float operations, each rounded on its own: nvcc would otherwise fuse a multiply and an
// add into one FMA on the device (one rounding instead of two) and a kernel's results would no
// longer match the host's bit for bit. On the host, g++ fuses too where the target has FMA, even
// in ISO mode, so the build passes -ffp-contract=off (meson.build, and gradsync's dependency for
// code that includes these headers).
GRADSYNC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

GRADSYNC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// IEEE binary16, round to nearest even; overflow goes to infinity, NaN stays NaN (quiet, sign
// kept). All three cases are computed and one is selected, so a loop over this has no branches
// and vectorizes. Subnormal results come from the FPU's own round-to-nearest-even: adding 0.5
// (as a float) to |value| leaves the rounded value / 2^-24 in the low mantissa bits.
GRADSYNC_HD std::uint16_t f16_bits(float value) {
  const std::uint32_t x = bits_of(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t magnitude = x & 0x7fffffffu;
  // Normal results: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  const std::uint32_t normal = (magnitude - 0x38000000u + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
  // Subnormal results (|value| < 2^-14): 0.5 + |value| in f32 has a ulp of 2^-24, the f16 step.
  const std::uint32_t subnormal = bits_of(add_rn(float_of(magnitude), 0.5f)) - 0x3f000000u;
  const std::uint32_t special = 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u);  // inf, or quiet NaN
  const std::uint32_t half = magnitude >= 0x47800000u ? special : magnitude < 0x38800000u ? subnormal : normal;
  return static_cast<std::uint16_t>(sign | half);
}

GRADSYNC_HD float from_f16_bits(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return float_of(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // exact: 2^-24 steps
    return sign ? -magnitude : magnitude;
  }
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// bfloat16 (the top half of an f32), round to nearest even; NaN is kept quiet.
GRADSYNC_HD std::uint16_t bf16_bits(float value) {
  const std::uint32_t x = bits_of(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

GRADSYNC_HD float from_bf16_bits(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }

}  // namespace gradsync::numeric
