#pragma once
// compression::OneBit — each value's sign, with one scale for the whole run: the mean magnitude,
// so that the decoded values keep the run's average size; 32 values to a word. Pair it with
// ErrorFeedback.
//
// Encoded: the 8-byte header (checks.hpp, codec 4), the f32 scale, then ceil(n/32) u32 words,
// value i's sign in bit i%32 of word i/32 (1: +scale, 0: -scale).

#include <cmath>
#include <span>
#include <string>

#include "gradsync/compression/packed.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

struct OneBit {
  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;
  static constexpr bool summable = false;

  std::string describe() const { return "one-bit"; }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return Packed<1>::bytes(n); }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    const double magnitude = quantize::magnitude_sum(values.data(), values.size());
    const float scale = values.empty() ? 0.0f : static_cast<float>(magnitude / static_cast<double>(values.size()));
    return Packed<1>::encode(CodecId::one_bit, "one-bit", values, {scale}, out,
                             [](float v, std::size_t) { return quantize::sign_bit(v); });
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    Packed<1>::decode(CodecId::one_bit, "one-bit", in, out, mode,
                      [](const auto& p) {
      return [scale = p[0]](std::uint32_t bit) { return quantize::sign_value(bit, scale); };
    });
  }
};

static_assert(CompressionPolicy<OneBit>);

}  // namespace gradsync::compression
