#pragma once
// The byte layouts the codecs share, free of anything the CUDA kernels cannot include: the header
// every non-raw encoding starts with, and codes of a few bits packed into 32-bit words.

#include <cstddef>
#include <cstdint>
#include <span>

#include "gradsync/numeric.hpp"

namespace gradsync::compression {

// Every encoding that is not the raw values begins with 8 bytes: u8 codec id, u8 format version,
// u16 zero, u32 value count (little-endian), so a decoder can tell a wrong codec, an old format or
// a count that does not match its destination before it reads a payload.
enum class CodecId : std::uint8_t { two_bit = 3, one_bit = 4, terngrad = 5, top_k = 6, random_k = 7 };
inline constexpr std::size_t header_bytes = 8;
inline constexpr std::uint8_t format_version = 1;

inline void write_header(std::span<std::byte> out, CodecId id, std::size_t count) {
  out[0] = static_cast<std::byte>(id);
  out[1] = static_cast<std::byte>(format_version);
  out[2] = out[3] = std::byte{0};
  const auto n = static_cast<std::uint32_t>(count);
  for (int i = 0; i < 4; ++i) out[4 + static_cast<std::size_t>(i)] = static_cast<std::byte>(n >> (8 * i));
}

// Bits-wide codes packed 32/Bits to a u32 word, value i in bits Bits*(i % per_word) upward of
// word i / per_word.
template <unsigned Bits>
struct PackedCodes {
  static constexpr std::size_t per_word = 32 / Bits;
  static constexpr std::uint32_t mask = (1u << Bits) - 1u;

  GRADSYNC_HD static std::size_t words(std::size_t n) { return (n + per_word - 1) / per_word; }

  // The word holding values [w * per_word, ...) of n; code(value, index) gives a value's code.
  // The CPU codecs build their words with it (the CUDA kernels set the same bits a value a thread).
  template <class T, class Code>
  GRADSYNC_HD static std::uint32_t pack_word(const T* values, std::size_t n, std::size_t w, Code code) {
    const std::size_t first = w * per_word;
    const std::size_t count = n - first < per_word ? n - first : per_word;
    std::uint32_t packed = 0;
    for (std::size_t i = 0; i < count; ++i) packed |= code(static_cast<float>(values[first + i]), first + i) << (Bits * i);
    return packed;
  }

  GRADSYNC_HD static std::uint32_t code_at(const std::uint32_t* words, std::size_t i) {
    return (words[i / per_word] >> (Bits * (i % per_word))) & mask;
  }
};

}  // namespace gradsync::compression
