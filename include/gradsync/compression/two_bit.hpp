#pragma once
// compression::TwoBit — threshold quantization (MXNet's 2-bit compression): values at or beyond
// +threshold travel as +threshold, at or beyond -threshold as -threshold, everything else as 0;
// 16 values to a 32-bit word, 1/16 of f32's bytes. Lossy and biased on its own: pair it with
// ErrorFeedback, which carries what was cut off into the next step.
//
// Encoded: the 8-byte header (checks.hpp, codec 3), the f32 threshold, then ceil(n/16) u32 words,
// value i in bits 2(i%16)..2(i%16)+1 of word i/16. The receiver uses the sender's threshold.

#include <cstring>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/compression/checks.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

struct TwoBit {
  float threshold = 0.5f;

  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;
  static constexpr bool summable = false;
  static constexpr std::size_t per_word = 16;

  std::string describe() const { return fmt::format("two-bit(threshold={})", threshold); }
  State make_state(std::size_t, DType) const { return {}; }
  static std::size_t words(std::size_t n) { return (n + per_word - 1) / per_word; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return header_bytes + 4 + words(n) * 4; }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    const std::size_t n = values.size();
    const std::size_t bytes = max_encoded_bytes(n, DType::f32);
    check_capacity("two-bit", bytes, out.size());
    write_header(out, CodecId::two_bit, n);
    std::memcpy(out.data() + header_bytes, &threshold, 4);
    auto* word = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4);
    const std::size_t full = n / per_word;
    for (std::size_t w = 0; w < full; ++w) {
      std::uint32_t bits = 0;
      for (std::size_t i = 0; i < per_word; ++i)
        bits |= quantize::two_bit_code(static_cast<float>(values[w * per_word + i]), threshold) << (2 * i);
      word[w] = bits;
    }
    if (full * per_word < n) {
      std::uint32_t bits = 0;
      for (std::size_t i = 0; full * per_word + i < n; ++i)
        bits |= quantize::two_bit_code(static_cast<float>(values[full * per_word + i]), threshold) << (2 * i);
      word[full] = bits;
    }
    return bytes;
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    const std::size_t n = out.size();
    check_header(in, CodecId::two_bit, "two-bit", n, 4 + words(n) * 4);
    float sent_threshold;
    std::memcpy(&sent_threshold, in.data() + header_bytes, 4);
    const auto* word = reinterpret_cast<const std::uint32_t*>(in.data() + header_bytes + 4);
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = static_cast<T>(quantize::two_bit_value((word[i / per_word] >> (2 * (i % per_word))) & 3u, sent_threshold));
      out[i] = mode == DecodeMode::add ? out[i] + v : v;
    }
  }
};

static_assert(CompressionPolicy<TwoBit>);

}  // namespace gradsync::compression
