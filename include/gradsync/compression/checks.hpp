#pragma once
// Size checks every codec makes before touching a buffer, so a short or oversized message is a
// gradsync::Error that says what was expected rather than a read past the end, and the checks of
// the header every non-raw encoding starts with (format.hpp).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <fmt/format.h>

#include "gradsync/compression/format.hpp"
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

// Checks the header of an encoding of `total` bytes against the codec and the destination;
// `payload` is the size the rest must have. `header` holds the first min(total, 8) bytes (the
// CUDA path copies just those from the device).
inline void check_header(std::span<const std::byte> header, std::size_t total, CodecId id, std::string_view codec,
                         std::size_t count, std::size_t payload) {
  const auto fail = [&](std::string why) {
    throw Error(ErrorKind::protocol, {.operation = "decode"}, fmt::format("{} codec: {}", codec, why));
  };
  if (total < header_bytes) fail(fmt::format("{} bytes cannot hold the {}-byte header", total, header_bytes));
  if (header[0] != static_cast<std::byte>(id))
    fail(fmt::format("the data was encoded by codec {}, not this one ({})", int(header[0]), int(id)));
  if (header[1] != static_cast<std::byte>(format_version))
    fail(fmt::format("format version {}, this build reads version {}", int(header[1]), format_version));
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(header[4 + static_cast<std::size_t>(i)]) << (8 * i);
  if (n != count) fail(fmt::format("the data holds {} values, the destination {}", n, count));
  if (total != header_bytes + payload)
    fail(fmt::format("{} bytes for {} values, expected {}", total, count, header_bytes + payload));
}

inline void check_header(std::span<const std::byte> in, CodecId id, std::string_view codec, std::size_t count,
                         std::size_t payload) {
  check_header(in.first(std::min(in.size(), header_bytes)), in.size(), id, codec, count, payload);
}

}  // namespace gradsync::compression
