#pragma once
// compression::TernGrad<Bits> — stochastic ternary (Bits = 2) or low-bit quantization (TernGrad,
// Wen et al. 2017): the run's largest magnitude s travels as f32 and every value becomes one of
// the levels -s .. 0 .. +s, 2^(Bits-1) - 1 evenly spaced on each side of zero (Bits = 2: -s, 0,
// +s), rounded up or down at random with the probabilities that make the expected decoded value
// the value itself. Unbiased, so it trains without ErrorFeedback (the published method adds
// per-layer scales and gradient clipping, which this codec leaves to the caller). Do not wrap it
// in ErrorFeedback: the residual of a random rounding is as large as the scale and feeds the next
// scale, which then creeps up; our trainer diverged that way (0.14 accuracy after one epoch).
//
// Why zero is a level and the scale is the largest magnitude rather than a [min, max] range (the
// form HiPress uses): with min/max levels zero is rarely a level, so every small gradient turns
// into noise of the size of the whole range; in our Fashion-MNIST trainer that diverged within
// an epoch. The largest magnitude is also order-free, so CPU and GPU agree on it bit for bit.
//
// Randomness is reproducible: the u-th encode at a site draws from stream
// quantize::stream_key(seed, u), value i from draw i of it, so the same seed, inputs and history
// give the same bytes on any run, thread or device. Give each rank its own seed for independent
// rounding noise across ranks: decoding does not need the seed, so it is not part of describe()
// and ranks need not agree on it.
//
// Encoded: the 8-byte header (checks.hpp, codec 5), f32 scale s, then ceil(n*Bits/32) u32 words
// of Bits-wide codes (packed.hpp): the level number q in the low Bits-1 bits, the sign in the top
// bit; q decodes to +-q * s / (2^(Bits-1) - 1).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/compression/packed.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

template <unsigned Bits = 2>
struct TernGrad {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "TernGrad packs 2, 4 or 8 bits a value");
  using Layout = Packed<Bits, 1>;
  static constexpr unsigned sign_shift = Bits - 1;
  static constexpr std::uint32_t levels = (1u << sign_shift) - 1u;  // on each side of zero

  std::uint64_t seed = 0;

  struct State {
    std::uint64_t encodes = 0;  // how many runs this site has encoded: picks the random stream
  };
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  std::string describe() const { return fmt::format("terngrad(bits={})", Bits); }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return Layout::bytes(n); }

  template <class T>
  std::size_t encode(std::span<const T> values, State& state, std::span<std::byte> out) const {
    float scale = 0;
    for (T v : values) scale = std::max(scale, std::fabs(static_cast<float>(v)));
    const std::uint64_t key = quantize::stream_key(seed, state.encodes++);
    const float inv = quantize::ternary_inverse_step(scale, levels);
    return Layout::encode(CodecId::terngrad, "terngrad", values, {scale}, out, [=](float v, std::size_t i) {
      return quantize::ternary_code(v, inv, quantize::uniform(key, i), levels, sign_shift);
    });
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    Layout::decode(CodecId::terngrad, "terngrad", in, out, mode, [](const auto& p) {
      return [spacing = quantize::ternary_step(p[0], levels)](std::uint32_t code) { return quantize::ternary_value(code, spacing, sign_shift); };
    });
  }
};

static_assert(CompressionPolicy<TernGrad<>>);

}  // namespace gradsync::compression
