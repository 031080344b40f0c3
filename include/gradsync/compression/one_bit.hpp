#pragma once
// compression::OneBit — each value's sign, with one scale for the whole run: the mean magnitude,
// so that the decoded values keep the run's average size; 32 values to a word. Pair it with
// ErrorFeedback.
//
// Encoded: the 8-byte header (checks.hpp, codec 4), the f32 scale, then ceil(n/32) u32 words,
// value i's sign in bit i%32 of word i/32 (1: +scale, 0: -scale).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>

#include "gradsync/compression/checks.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

struct OneBit {
  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;
  static constexpr bool summable = false;
  static constexpr std::size_t per_word = 32;

  std::string describe() const { return "one-bit"; }
  State make_state(std::size_t, DType) const { return {}; }
  static std::size_t words(std::size_t n) { return (n + per_word - 1) / per_word; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return header_bytes + 4 + words(n) * 4; }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    const std::size_t n = values.size();
    const std::size_t bytes = max_encoded_bytes(n, DType::f32);
    check_capacity("one-bit", bytes, out.size());
    write_header(out, CodecId::one_bit, n);
    T magnitude = 0;
    for (T v : values) magnitude += std::abs(v);
    const float scale = n ? static_cast<float>(magnitude / static_cast<T>(n)) : 0.0f;
    std::memcpy(out.data() + header_bytes, &scale, 4);
    auto* word = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4);
    for (std::size_t w = 0; w < words(n); ++w) {
      std::uint32_t bits = 0;
      const std::size_t end = std::min(n, (w + 1) * per_word);
      for (std::size_t i = w * per_word; i < end; ++i)
        bits |= quantize::sign_bit(static_cast<float>(values[i])) << (i % per_word);
      word[w] = bits;
    }
    return bytes;
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    const std::size_t n = out.size();
    check_header(in, CodecId::one_bit, "one-bit", n, 4 + words(n) * 4);
    float scale;
    std::memcpy(&scale, in.data() + header_bytes, 4);
    const auto* word = reinterpret_cast<const std::uint32_t*>(in.data() + header_bytes + 4);
    for (std::size_t i = 0; i < n; ++i) {
      const auto v = static_cast<T>(quantize::sign_value((word[i / per_word] >> (i % per_word)) & 1u, scale));
      out[i] = mode == DecodeMode::add ? out[i] + v : v;
    }
  }
};

static_assert(CompressionPolicy<OneBit>);

}  // namespace gradsync::compression
