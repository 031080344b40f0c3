#pragma once
// compression::Fp16 — IEEE half precision on the wire (2 bytes a value), summed in f32/f64.
// Values beyond +-65504 become infinities; scale gradients first if they can be that large.

#include "gradsync/compression/reduced_float.hpp"

namespace gradsync::compression {

struct Fp16Format {
  static constexpr const char* name = "fp16";
  static std::uint16_t encode(float v) { return numeric::f16_bits(v); }
  static float decode(std::uint16_t b) { return numeric::from_f16_bits(b); }
};

using Fp16 = ReducedFloat<Fp16Format>;
static_assert(CompressionPolicy<Fp16>);

}  // namespace gradsync::compression
