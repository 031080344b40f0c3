#pragma once
// compression::Bf16 — bfloat16 on the wire (2 bytes a value, f32's range, 8 significant bits),
// summed in f32/f64.

#include "gradsync/compression/reduced_float.hpp"

namespace gradsync::compression {

struct Bf16Format {
  static constexpr const char* name = "bf16";
  static std::uint16_t encode(float v) { return numeric::bf16_bits(v); }
  static float decode(std::uint16_t b) { return numeric::from_bf16_bits(b); }
};

using Bf16 = ReducedFloat<Bf16Format>;
static_assert(CompressionPolicy<Bf16>);

}  // namespace gradsync::compression
