#pragma once
// compression::ReducedFloat<Format> — values travel as a 16-bit float format and are summed in the
// accumulation dtype after decoding. Fp16 and Bf16 (their own headers) are its two instances.
// Rounding is to nearest even, through gradsync/numeric.hpp, the same functions the CUDA kernels use.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "gradsync/compression/checks.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/numeric.hpp"

namespace gradsync::compression {

// Format: `static constexpr const char* name`, `static std::uint16_t encode(float)`,
// `static float decode(std::uint16_t)`.
template <class Format>
struct ReducedFloat {
  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  std::string describe() const { return Format::name; }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return n * sizeof(std::uint16_t); }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    const std::size_t bytes = values.size() * sizeof(std::uint16_t);
    check_capacity(Format::name, bytes, out.size());
    auto* bits = reinterpret_cast<std::uint16_t*>(out.data());
    for (std::size_t i = 0; i < values.size(); ++i) bits[i] = Format::encode(static_cast<float>(values[i]));
    return bytes;
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    check_encoded_size(Format::name, in.size(), out.size(), out.size() * sizeof(std::uint16_t));
    const auto* bits = reinterpret_cast<const std::uint16_t*>(in.data());
    if (mode == DecodeMode::overwrite) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(Format::decode(bits[i]));
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] += static_cast<T>(Format::decode(bits[i]));
    }
  }
};

}  // namespace gradsync::compression
