#pragma once
// Size checks every codec makes before touching a buffer, so a short or oversized message is a
// gradsync::Error that says what was expected rather than a read past the end; and the header
// that every non-raw encoding starts with.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::compression {

[[noreturn]] inline void capacity_error(std::string_view codec, std::size_t needed, std::size_t capacity) {
  throw Error(ErrorKind::invalid_argument, {.operation = "encode"},
              fmt::format("{} codec needs {} bytes but the output buffer holds {}", codec, needed, capacity));
}

inline void check_capacity(std::string_view codec, std::size_t needed, std::size_t capacity) {
  if (needed > capacity) capacity_error(codec, needed, capacity);
}

inline void check_encoded_size(std::string_view codec, std::size_t got, std::size_t elements, std::size_t expected) {
  if (got != expected)
    throw Error(ErrorKind::protocol, {.operation = "decode"},
                fmt::format("{} codec: {} encoded bytes cannot hold exactly {} values ({} bytes expected)", codec,
                            got, elements, expected));
}

}  // namespace gradsync::compression

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

// Checks the header against the codec and the destination; `payload` is the size the rest must have.
inline void check_header(std::span<const std::byte> in, CodecId id, std::string_view codec, std::size_t count,
                         std::size_t payload) {
  const auto fail = [&](std::string why) {
    throw Error(ErrorKind::protocol, {.operation = "decode"}, fmt::format("{} codec: {}", codec, why));
  };
  if (in.size() < header_bytes) fail(fmt::format("{} bytes cannot hold the {}-byte header", in.size(), header_bytes));
  if (in[0] != static_cast<std::byte>(id))
    fail(fmt::format("the data was encoded by codec {}, not this one ({})", int(in[0]), int(id)));
  if (in[1] != static_cast<std::byte>(format_version))
    fail(fmt::format("format version {}, this build reads version {}", int(in[1]), format_version));
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(in[4 + static_cast<std::size_t>(i)]) << (8 * i);
  if (n != count) fail(fmt::format("the data holds {} values, the destination {}", n, count));
  if (in.size() != header_bytes + payload)
    fail(fmt::format("{} bytes for {} values, expected {}", in.size(), count, header_bytes + payload));
}

}  // namespace gradsync::compression
