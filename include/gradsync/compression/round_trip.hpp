#pragma once
// compression::round_trip — what one value looks like after a trip through a codec,
// decode(encode(v)) with a fresh state. References that replay a topology's arithmetic by hand
// (the tests, bench/allreduce's check) push each hop's value through it.

#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/concepts.hpp"

namespace gradsync::compression {

template <CompressionPolicy C>
float round_trip(const C& codec, float v) {
  auto state = codec.make_state(1, DType::f32);
  std::vector<std::byte> buffer(codec.max_encoded_bytes(1, DType::f32));
  const std::size_t used = codec.encode(std::span<const float>(&v, 1), state, buffer);
  float out = 0;
  codec.decode(std::span<const std::byte>(buffer).first(used), std::span<float>(&out, 1), DecodeMode::overwrite);
  return out;
}

}  // namespace gradsync::compression
