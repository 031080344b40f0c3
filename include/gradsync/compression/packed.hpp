#pragma once
// The layout shared by the quantizing codecs: the common header (checks.hpp), one f32 parameter
// (a threshold, a scale), then one Bits-wide code per value, packed 32/Bits to a u32 word, value
// i in bits Bits*(i % per_word) upward of word i / per_word.

#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "gradsync/compression/checks.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

template <unsigned Bits>
struct Packed {
  static constexpr std::size_t per_word = 32 / Bits;
  static constexpr std::uint32_t mask = (1u << Bits) - 1u;

  static std::size_t words(std::size_t n) { return (n + per_word - 1) / per_word; }
  static std::size_t bytes(std::size_t n) { return header_bytes + 4 + words(n) * 4; }

  // code(value) -> the value's Bits-wide code.
  template <class T, class Code>
  static std::size_t encode(CodecId id, std::string_view codec, std::span<const T> values, float parameter,
                            std::span<std::byte> out, Code code) {
    const std::size_t n = values.size();
    check_capacity(codec, bytes(n), out.size());
    write_header(out, id, n);
    std::memcpy(out.data() + header_bytes, &parameter, 4);
    auto* word = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4);
    const std::size_t full = n / per_word;
    for (std::size_t w = 0; w < full; ++w) {  // whole words: no bounds test in the inner loop
      std::uint32_t packed = 0;
      for (std::size_t i = 0; i < per_word; ++i)
        packed |= code(static_cast<float>(values[w * per_word + i])) << (Bits * i);
      word[w] = packed;
    }
    if (full * per_word < n) {
      std::uint32_t packed = 0;
      for (std::size_t i = 0; full * per_word + i < n; ++i)
        packed |= code(static_cast<float>(values[full * per_word + i])) << (Bits * i);
      word[full] = packed;
    }
    return bytes(n);
  }

  // value(code, parameter) -> the decoded value.
  template <class T, class Value>
  static void decode(CodecId id, std::string_view codec, std::span<const std::byte> in, std::span<T> out,
                     DecodeMode mode, Value value) {
    const std::size_t n = out.size();
    check_header(in, id, codec, n, words(n) * 4 + 4);
    float parameter;
    std::memcpy(&parameter, in.data() + header_bytes, 4);
    const auto* word = reinterpret_cast<const std::uint32_t*>(in.data() + header_bytes + 4);
    if (mode == DecodeMode::add)
      unpack(word, n, [&](std::size_t i, std::uint32_t code) { out[i] += static_cast<T>(value(code, parameter)); });
    else
      unpack(word, n, [&](std::size_t i, std::uint32_t code) { out[i] = static_cast<T>(value(code, parameter)); });
  }

 private:
  // Calls f(i, code) for every value, a word at a time, so the inner loop has no division,
  // no bounds test and no mode test.
  template <class F>
  static void unpack(const std::uint32_t* word, std::size_t n, F f) {
    const std::size_t full = n / per_word;
    for (std::size_t w = 0; w < full; ++w) {
      const std::uint32_t packed = word[w];
      for (std::size_t i = 0; i < per_word; ++i) f(w * per_word + i, (packed >> (Bits * i)) & mask);
    }
    for (std::size_t i = full * per_word; i < n; ++i) f(i, (word[full] >> (Bits * (i - full * per_word))) & mask);
  }
};

}  // namespace gradsync::compression
