#pragma once
// The layout shared by the quantizing codecs: the common header (format.hpp), Params f32
// parameters (a threshold, a scale), then one Bits-wide code per value, packed 32/Bits to a u32
// word (PackedCodes in format.hpp).

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

#include "gradsync/compression/checks.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/numeric.hpp"

namespace gradsync::compression {

template <unsigned Bits, std::size_t Params = 1>
struct Packed : PackedCodes<Bits> {
  using Codes = PackedCodes<Bits>;
  using Codes::mask;
  using Codes::pack_word;
  using Codes::per_word;
  using Codes::words;
  using Parameters = std::array<float, Params>;

  GRADSYNC_HD static std::size_t bytes(std::size_t n) { return header_bytes + 4 * Params + words(n) * 4; }

  template <class T, class Code>
  static std::size_t encode(CodecId id, std::string_view codec, std::span<const T> values, const Parameters& parameters,
                            std::span<std::byte> out, Code code) {
    const std::size_t n = values.size();
    check_capacity(codec, bytes(n), out.size());
    write_header(out, id, n);
    std::memcpy(out.data() + header_bytes, parameters.data(), 4 * Params);
    auto* word = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4 * Params);
    const std::size_t full = n / per_word;
    for (std::size_t w = 0; w < full; ++w) {  // whole words: a fixed trip count the compiler unrolls
      std::uint32_t packed = 0;
      for (std::size_t i = 0; i < per_word; ++i)
        packed |= code(static_cast<float>(values[w * per_word + i]), w * per_word + i) << (Bits * i);
      word[w] = packed;
    }
    if (full * per_word < n) word[full] = pack_word(values.data(), n, full, code);
    return bytes(n);
  }

  // encode() fused with ErrorFeedback's bookkeeping (see error_feedback.hpp), one pass over the
  // values: codes p_i = load(i) and leaves -(-p_i + value(code)) in residual[i], the operations
  // of ErrorFeedback's decode into -p and negation (p - value would give +0 where they give -0).
  // value = decoder(parameters), as in decode().
  template <class T, class Load, class Code, class Decoder>
  static std::size_t encode_keeping_error(CodecId id, std::string_view codec, std::span<T> residual, Load load,
                                          const Parameters& parameters, std::span<std::byte> out, Code code,
                                          Decoder decoder) {
    const std::size_t n = residual.size();
    check_capacity(codec, bytes(n), out.size());
    write_header(out, id, n);
    std::memcpy(out.data() + header_bytes, parameters.data(), 4 * Params);
    auto* word = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4 * Params);
    const auto value = decoder(parameters);
    // A block at a time, in two loops: codes and residuals (which vectorize), then packing from
    // codes still in L1. One loop doing all of it per word stayed scalar: 4.1 GB/s against 6.1.
    static_assert(Bits <= 8, "codes are kept a byte each");
    constexpr std::size_t block = 16 * per_word;
    std::uint8_t codes[block];
    const auto code_block = [&](std::size_t first, auto count) {  // count: compile-time for whole blocks
      for (std::size_t i = 0; i < count; ++i) {
        const T p = load(first + i);
        codes[i] = static_cast<std::uint8_t>(code(static_cast<float>(p), first + i));
        residual[first + i] = -(-p + static_cast<T>(value(codes[i])));
      }
      for (std::size_t w = 0; w * per_word < count; ++w) {
        std::uint32_t packed = 0;
        for (std::size_t i = 0; i < per_word && w * per_word + i < count; ++i)
          packed |= std::uint32_t{codes[w * per_word + i]} << (Bits * i);
        word[first / per_word + w] = packed;
      }
    };
    const std::size_t whole = n / block * block;
    for (std::size_t first = 0; first < whole; first += block)
      code_block(first, std::integral_constant<std::size_t, block>{});
    if (whole < n) code_block(whole, n - whole);
    return bytes(n);
  }

  // decoder(parameters) -> a function from a code to its decoded value.
  template <class T, class Decoder>
  static void decode(CodecId id, std::string_view codec, std::span<const std::byte> in, std::span<T> out,
                     DecodeMode mode, Decoder decoder) {
    const std::size_t n = out.size();
    check_header(in, id, codec, n, 4 * Params + words(n) * 4);
    Parameters parameters;
    std::memcpy(parameters.data(), in.data() + header_bytes, 4 * Params);
    const auto* word = reinterpret_cast<const std::uint32_t*>(in.data() + header_bytes + 4 * Params);
    const auto value = decoder(parameters);
    if (mode == DecodeMode::add)
      unpack(word, n, [&](std::size_t i, std::uint32_t code) { out[i] += static_cast<T>(value(code)); });
    else
      unpack(word, n, [&](std::size_t i, std::uint32_t code) { out[i] = static_cast<T>(value(code)); });
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
