#pragma once
// example::FixedPoint16 — a codec written from outside the library, the one docs/writing-policies.md
// walks through. Each value travels as a 16-bit count of `step`: q = nearbyint(v / step),
// saturated to ±32767 (a NaN, which has no count, as -32767), and arrives as q * step. For
// |v| <= 32767 * step a trip moves a value by at most step / 2; with `step` a power of two,
// v / step and q * step are exact, so rounding q is the only error.
//
// It has only the f32 path: a Synchronizer using it refuses f64 gradients in add().

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/compression/checks.hpp"
#include "gradsync/concepts.hpp"

namespace example {

struct FixedPoint16 {
  float step = 1.0f / 1024;

  struct State {};  // nothing carries over from one encode to the next
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  // Compared across ranks: they must agree on the step to read each other's counts.
  std::string describe() const { return fmt::format("fixed-point-16(step={})", step); }
  State make_state(std::size_t, gradsync::DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, gradsync::DType) const { return n * sizeof(std::int16_t); }

  std::size_t encode(std::span<const float> values, State&, std::span<std::byte> out) const {
    const std::size_t bytes = values.size() * sizeof(std::int16_t);
    gradsync::compression::check_capacity("fixed-point-16", bytes, out.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto q = static_cast<std::int16_t>(std::fmin(std::fmax(std::nearbyint(values[i] / step), -32767.0f), 32767.0f));
      std::memcpy(out.data() + i * sizeof q, &q, sizeof q);
    }
    return bytes;
  }

  void decode(std::span<const std::byte> in, std::span<float> out, gradsync::DecodeMode mode) const {
    gradsync::compression::check_encoded_size("fixed-point-16", in.size(), out.size(), out.size() * sizeof(std::int16_t));
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::int16_t q;
      std::memcpy(&q, in.data() + i * sizeof q, sizeof q);
      const float v = static_cast<float>(q) * step;
      out[i] = mode == gradsync::DecodeMode::add ? out[i] + v : v;
    }
  }
};

static_assert(gradsync::CompressionPolicy<FixedPoint16>);

}  // namespace example
