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

  std::string describe() const { return "one-bit"; }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return Packed<1>::bytes(n); }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    return Packed<1>::encode(CodecId::one_bit, "one-bit", values, {scale_of(values)}, out, code);
  }

  // For ErrorFeedback: encodes values + residual and leaves what it cut off in residual. The scale
  // needs every p first, so three passes (add, sum, code) instead of six.
  template <class T>
  std::size_t encode_keeping_error(std::span<const T> values, std::span<T> residual, State&,
                                   std::span<std::byte> out) const {
    for (std::size_t i = 0; i < residual.size(); ++i) residual[i] += values[i];
    return Packed<1>::encode_keeping_error(
        CodecId::one_bit, "one-bit", residual, [&](std::size_t i) { return residual[i]; },
        {scale_of(std::span<const T>(residual))}, out, code, decoder);
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    Packed<1>::decode(CodecId::one_bit, "one-bit", in, out, mode, decoder);
  }

 private:
  template <class T>
  static float scale_of(std::span<const T> values) {
    if (values.empty()) return 0.0f;
    return static_cast<float>(quantize::magnitude_sum(values.data(), values.size()) /
                              static_cast<double>(values.size()));
  }
  static constexpr auto code = [](float v, std::size_t) { return quantize::sign_bit(v); };
  static constexpr auto decoder = [](const Packed<1>::Parameters& p) {
    return [scale = p[0]](std::uint32_t bit) { return quantize::sign_value(bit, scale); };
  };
};

static_assert(CompressionPolicy<OneBit>);

}  // namespace gradsync::compression
