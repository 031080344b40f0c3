#pragma once
// The per-element arithmetic of the quantizing codecs, shared by the CPU path and CUDA kernels.

#include <cstdint>

#include "gradsync/numeric.hpp"

namespace gradsync::compression::quantize {

// Two bits a value: 01 for >= +threshold, 10 for <= -threshold, 00 otherwise; no branches.
GRADSYNC_HD std::uint32_t two_bit_code(float v, float threshold) {
  return static_cast<std::uint32_t>(v >= threshold) | (static_cast<std::uint32_t>(v <= -threshold) << 1);
}
GRADSYNC_HD float two_bit_value(std::uint32_t code, float threshold) {
  return static_cast<float>(static_cast<int>(code & 1u) - static_cast<int>(code >> 1)) * threshold;
}

// One bit a value: its sign (zero counts as positive).
GRADSYNC_HD std::uint32_t sign_bit(float v) { return static_cast<std::uint32_t>(v >= 0.0f); }
GRADSYNC_HD float sign_value(std::uint32_t bit, float scale) { return static_cast<float>(2 * static_cast<int>(bit) - 1) * scale; }

}  // namespace gradsync::compression::quantize
