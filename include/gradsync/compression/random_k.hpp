#pragma once
// compression::RandomK — keeps k values at random positions (Stich et al. 2018, with
// ErrorFeedback as its memory). The positions come from a seeded stream, so only the 8-byte
// stream key travels, not the indices: one position is drawn inside each of k near-equal strata
// of the run (quantize::stratum_index), which keeps them distinct and ascending without a set.
// The values are sent unscaled; pair it with ErrorFeedback.
//
// All ranks with the same seed draw the same positions for the same encode, so partial sums on a
// ring stay sparse on one set of positions. The u-th encode at a site uses stream
// quantize::stream_key(seed, u).
//
// Encoded: the 8-byte header (checks.hpp, codec 7), u64 stream key, k f32 values.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/compression/checks.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/compression/sparse.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::compression {

struct RandomK {
  Keep keep{};

  void validate() const { keep.validate("random-k"); }
  std::uint64_t seed = 0;

  struct State {
    std::uint64_t encodes = 0;  // how many runs this site has encoded: picks the stream
  };
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  std::string describe() const { return fmt::format("random-k({}, seed={})", keep.describe(), seed); }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return header_bytes + 8 + 4 * keep.of(n); }

  template <class T>
  std::size_t encode(std::span<const T> values, State& state, std::span<std::byte> out) const {
    return encode_picks(values, state, out, [](std::size_t, float) {});
  }

  // For ErrorFeedback: encodes values + residual and leaves what it cut off in residual, one pass
  // (the add) plus the k kept positions.
  template <class T>
  std::size_t encode_keeping_error(std::span<const T> values, std::span<T> residual, State& state,
                                   std::span<std::byte> out) const {
    return compression::encode_keeping_error(
        values, residual, [&](std::span<const T> p, auto picked) { return encode_picks(p, state, out, picked); });
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    const std::size_t n = out.size(), k = keep.of(n);
    check_header(in, CodecId::random_k, "random-k", n, 8 + 4 * k);
    std::uint64_t key;
    std::memcpy(&key, in.data() + header_bytes, 8);
    const auto* value = reinterpret_cast<const float*>(in.data() + header_bytes + 8);
    if (mode == DecodeMode::overwrite) std::fill(out.begin(), out.end(), T(0));
    for (std::size_t j = 0; j < k; ++j) out[quantize::stratum_index(key, j, n, k)] += static_cast<T>(value[j]);
  }

 private:
  // Writes the encoding of values and calls picked(i, value sent) for each kept position i.
  template <class T, class Picked>
  std::size_t encode_picks(std::span<const T> values, State& state, std::span<std::byte> out, Picked picked) const {
    const std::size_t n = values.size(), k = keep.of(n);
    const std::size_t bytes = header_bytes + 8 + 4 * k;
    check_capacity("random-k", bytes, out.size());
    write_header(out, CodecId::random_k, n);
    const std::uint64_t key = quantize::stream_key(seed, state.encodes++);
    std::memcpy(out.data() + header_bytes, &key, 8);
    auto* value = reinterpret_cast<float*>(out.data() + header_bytes + 8);
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t i = quantize::stratum_index(key, j, n, k);
      value[j] = static_cast<float>(values[i]);
      picked(i, value[j]);
    }
    return bytes;
  }
};

static_assert(CompressionPolicy<RandomK>);

}  // namespace gradsync::compression
