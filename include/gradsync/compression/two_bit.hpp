#pragma once
// compression::TwoBit — threshold quantization (MXNet's 2-bit compression): values at or beyond
// +threshold travel as +threshold, at or beyond -threshold as -threshold, everything else as 0;
// 16 values to a 32-bit word, 1/16 of f32's bytes. Lossy and biased on its own: pair it with
// ErrorFeedback, which carries what was cut off into the next step.
//
// Encoded: the 8-byte header (checks.hpp, codec 3), the f32 threshold, then ceil(n/16) u32 words,
// value i in bits 2(i%16)..2(i%16)+1 of word i/16. The receiver uses the sender's threshold.

#include <cmath>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/compression/packed.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/settings.hpp"

namespace gradsync::compression {

struct TwoBit {
  float threshold = 0.5f;

  void validate() const {
    detail::check_setting(std::isfinite(threshold) && threshold > 0, "two-bit", "threshold", threshold,
                          "finite and above 0");
  }

 private:
  // Defined before the members that call it: a function with a deduced return type cannot be
  // used before its definition (clang holds to that even inside the class).
  auto code() const {
    return [t = threshold](float v, std::size_t) { return quantize::two_bit_code(v, t); };
  }
  static constexpr auto decoder = [](const Packed<2>::Parameters& p) {
    return [t = p[0]](std::uint32_t code) { return quantize::two_bit_value(code, t); };
  };

 public:
  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  std::string describe() const { return fmt::format("two-bit(threshold={})", threshold); }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return Packed<2>::bytes(n); }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    return Packed<2>::encode(CodecId::two_bit, "two-bit", values, {threshold}, out, code());
  }

  // For ErrorFeedback: encodes values + residual and leaves what it cut off in residual, in one pass.
  template <class T>
  std::size_t encode_keeping_error(std::span<const T> values, std::span<T> residual, State&,
                                   std::span<std::byte> out) const {
    return Packed<2>::encode_keeping_error(
        CodecId::two_bit, "two-bit", residual, [&](std::size_t i) { return residual[i] + values[i]; }, {threshold}, out,
        code(), decoder);
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    Packed<2>::decode(CodecId::two_bit, "two-bit", in, out, mode, decoder);
  }
};

static_assert(CompressionPolicy<TwoBit>);

}  // namespace gradsync::compression
