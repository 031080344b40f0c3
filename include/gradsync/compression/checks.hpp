#pragma once
// Size checks every codec makes before touching a buffer, so a short or oversized message is a
// gradsync::Error that says what was expected rather than a read past the end.

#include <cstddef>
#include <string_view>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::compression {

inline void check_capacity(std::string_view codec, std::size_t needed, std::size_t capacity) {
  if (needed > capacity)
    throw Error(ErrorKind::invalid_argument, {.operation = "encode"},
                fmt::format("{} codec needs {} bytes but the output buffer holds {}", codec, needed, capacity));
}

inline void check_encoded_size(std::string_view codec, std::size_t got, std::size_t elements, std::size_t expected) {
  if (got != expected)
    throw Error(ErrorKind::protocol, {.operation = "decode"},
                fmt::format("{} codec: {} encoded bytes cannot hold exactly {} values ({} bytes expected)", codec,
                            got, elements, expected));
}

}  // namespace gradsync::compression
