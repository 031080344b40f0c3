#pragma once
// compression::None — the values travel as they are (f32 or f64, the accumulation dtype).

#include <cstring>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"
#include "gradsync/compression/checks.hpp"

namespace gradsync::compression {

struct None {
  struct State {};
  static constexpr bool identity = true;
  static constexpr bool lossless = true;

  std::string describe() const { return "none"; }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType dtype) const { return n * size_of(dtype); }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    const std::size_t bytes = values.size_bytes();
    check_capacity("none", bytes, out.size());
    if (bytes != 0) std::memcpy(out.data(), values.data(), bytes);
    return bytes;
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    check_encoded_size("none", in.size(), out.size(), out.size_bytes());
    if (mode == DecodeMode::overwrite) {
      if (!in.empty()) std::memcpy(out.data(), in.data(), in.size());
      return;
    }
    const auto* values = reinterpret_cast<const T*>(in.data());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += values[i];
  }
};

static_assert(CompressionPolicy<None>);

}  // namespace gradsync::compression
