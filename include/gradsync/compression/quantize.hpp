#pragma once
// The per-element arithmetic of the quantizing and sparsifying codecs, shared by the CPU path and
// the CUDA kernels (src/cuda/codecs.cu), so both give the same encoding bit for bit.

#include <cstddef>
#include <cstdint>

#include "gradsync/numeric.hpp"

namespace gradsync::compression::quantize {

// Two bits a value: 01 for >= +threshold, 10 for <= -threshold, 00 otherwise; no branches.
GRADSYNC_HD std::uint32_t two_bit_code(float v, float threshold) {
  return static_cast<std::uint32_t>(v >= threshold) | (static_cast<std::uint32_t>(v <= -threshold) << 1);
}
GRADSYNC_HD float two_bit_value(std::uint32_t code, float threshold) {
  return numeric::mul_rn(static_cast<float>(static_cast<int>(code & 1u) - static_cast<int>(code >> 1)), threshold);
}

// One bit a value: its sign (zero counts as positive).
GRADSYNC_HD std::uint32_t sign_bit(float v) { return static_cast<std::uint32_t>(v >= 0.0f); }
GRADSYNC_HD float sign_value(std::uint32_t bit, float scale) {
  return numeric::mul_rn(static_cast<float>(2 * static_cast<int>(bit) - 1), scale);
}

// OneBit's scale is the mean magnitude; the sum runs in double in a fixed tree (leaves of 256
// consecutive values, then each level summing 256 consecutive results of the level below, each
// group in order), so a kernel that sums level by level gets the same bits as this loop.
inline constexpr std::size_t sum_fan_in = 256;

// One leaf: at most sum_fan_in values, value i into accumulator i % 8, the eight then added
// pairwise. Eight independent chains instead of one keep the adder busy (4x faster on x86).
template <class T>
GRADSYNC_HD double leaf_magnitude_sum(const T* values, std::size_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (sizeof(T) == sizeof(float))  // clear the sign bit: no branch on the sign
      lane[i % 8] += static_cast<double>(numeric::float_of(numeric::bits_of(static_cast<float>(values[i])) & 0x7fffffffu));
    else
      lane[i % 8] += values[i] < 0 ? -static_cast<double>(values[i]) : static_cast<double>(values[i]);
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <class T>
double magnitude_sum(const T* values, std::size_t n) {
  if (n <= sum_fan_in) return leaf_magnitude_sum(values, n);
  double sum = 0;
  std::size_t span = sum_fan_in;  // values under each child: the largest power of 256 below n
  while (span * sum_fan_in < n) span *= sum_fan_in;
  for (std::size_t b = 0; b < n; b += span) sum += magnitude_sum(values + b, n - b < span ? n - b : span);
  return sum;
}

// A counter-based random stream: mix(key, i) is the i-th 64-bit draw of stream `key` (SplitMix64's
// output function over key + (i + 1) * golden ratio). Any draw can be computed alone, on any
// thread or device, which is what lets a kernel and a loop give the same numbers.
GRADSYNC_HD std::uint64_t mix(std::uint64_t key, std::uint64_t i) {
  std::uint64_t z = key + (i + 1u) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Draw i of stream `key` as a float in [0, 1), 24 random bits: a 32-bit hash (Wellons'
// "lowbias32") of i and the key, cheap enough to run once per value (32-bit multiplies vectorize
// where 64-bit ones do not). A run holds at most 2^32 values, so i fits.
GRADSYNC_HD float uniform(std::uint64_t key, std::uint64_t i) {
  std::uint32_t x = static_cast<std::uint32_t>(i) * 0x9e3779b9u + static_cast<std::uint32_t>(key ^ (key >> 32));
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return static_cast<float>(x >> 8) * 5.9604644775390625e-8f;  // 2^-24
}

// The stream key for the `step`-th encode of a codec seeded with `seed`.
GRADSYNC_HD std::uint64_t stream_key(std::uint64_t seed, std::uint64_t step) { return mix(seed, step); }

// TernGrad's stochastic rounding: |v| / scale * levels lies between two whole levels q and q+1
// and is rounded up with probability equal to the fraction (u uniform in [0, 1)), so the
// expected decoded value is v. The code is q with v's sign bit in bit `sign_shift`. `inv_step` is
// levels / scale, or 0 when the scale is 0 (all values zero).
GRADSYNC_HD std::uint32_t ternary_code(float v, float inv_step, float u, std::uint32_t levels, unsigned sign_shift) {
  // No branches: rounding up or down is a coin toss, which a branch predictor cannot learn.
  const std::uint32_t bits = numeric::bits_of(v);
  float x = numeric::add_rn(numeric::mul_rn(numeric::float_of(bits & 0x7fffffffu), inv_step), u);
  x = x > 0.0f ? x : 0.0f;  // also maps NaN to level 0
  x = x < static_cast<float>(levels) ? x : static_cast<float>(levels);
  return static_cast<std::uint32_t>(x) | ((bits >> 31) << sign_shift);
}
GRADSYNC_HD float ternary_step(float scale, std::uint32_t levels) { return scale / static_cast<float>(levels); }
GRADSYNC_HD float ternary_inverse_step(float scale, std::uint32_t levels) {
  return scale > 0.0f ? static_cast<float>(levels) / scale : 0.0f;
}
GRADSYNC_HD float ternary_value(std::uint32_t code, float step, unsigned sign_shift) {
  const float magnitude = numeric::mul_rn(static_cast<float>(code & ((1u << sign_shift) - 1u)), step);
  return (code >> sign_shift) ? -magnitude : magnitude;
}

// RandomK's j-th index among n for k kept: one uniform pick inside the j-th of k near-equal
// strata [j*n/k, (j+1)*n/k), so indices come out distinct and ascending with no set to keep.
GRADSYNC_HD std::uint64_t stratum_index(std::uint64_t key, std::uint64_t j, std::uint64_t n, std::uint64_t k) {
  const std::uint64_t begin = j * n / k;
  const std::uint64_t length = (j + 1u) * n / k - begin;  // >= 1 since k <= n
  return begin + (((mix(key, j) >> 32) * length) >> 32);
}

// The order TopK ranks values by: magnitude as the bits of |v| (monotonic for floats; NaN ranks
// above infinity).
GRADSYNC_HD std::uint32_t magnitude_key(float v) { return numeric::bits_of(v) & 0x7fffffffu; }

// TopK's radix select over those 31-bit keys, from the top digit down: bits 30..20, 19..10 and
// 9..0. Each pass counts, among the keys that match the digits chosen so far, how many have each
// value of the next digit; top_k_holds() then finds that digit and top_k_take() fixes it. The CPU
// runs the passes in a loop, the device as kernels, so both find the same cut.
inline constexpr unsigned top_k_passes = 3;
inline constexpr std::uint32_t top_k_max_digits = 2048;
GRADSYNC_HD unsigned top_k_shift(unsigned pass) { return pass == 0 ? 20u : pass == 1 ? 10u : 0u; }
GRADSYNC_HD std::uint32_t top_k_digits(unsigned pass) { return pass == 0 ? 2048u : 1024u; }

// Where the selection stands: the digits chosen (`prefix`, under `mask`) and how many of the keys
// that match them are still to be kept. After the last pass, `prefix` is the k-th largest key and
// `wanted` the number of keys equal to it that are kept (the lowest-indexed).
struct TopKCut {
  std::uint32_t prefix = 0;
  std::uint32_t mask = 0;
  std::uint64_t wanted = 0;
};

GRADSYNC_HD bool top_k_matches(std::uint32_t key, const TopKCut& cut) { return (key & cut.mask) == cut.prefix; }
GRADSYNC_HD std::uint32_t top_k_digit(std::uint32_t key, unsigned pass) {
  return (key >> top_k_shift(pass)) & (top_k_digits(pass) - 1u);
}

// After a pass, the digits from the largest down hold the matching keys in turn; the digit that
// holds the last wanted key is the one whose count, with the `above` keys of larger digits,
// reaches `wanted` (exactly one does, as 1 <= wanted <= the matching keys). The CPU walks the
// digits down to it; the device asks every digit at once.
GRADSYNC_HD bool top_k_holds(std::uint64_t above, std::uint64_t count, std::uint64_t wanted) {
  return above < wanted && wanted <= above + count;
}
// That digit joins the prefix, and the keys above it are no longer wanted from the matching ones.
GRADSYNC_HD void top_k_take(TopKCut& cut, unsigned pass, std::uint32_t digit, std::uint64_t above) {
  cut.prefix |= digit << top_k_shift(pass);
  cut.mask |= (top_k_digits(pass) - 1u) << top_k_shift(pass);
  cut.wanted -= above;
}

}  // namespace gradsync::compression::quantize
