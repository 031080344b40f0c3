#pragma once
// compression::TopK — keeps the k values of largest magnitude as (index, value) pairs and drops
// the rest (Aji & Heafield 2017; Deep Gradient Compression). Biased on its own: pair it with
// ErrorFeedback, which holds what was dropped until it grows large enough to be sent.
//
// Which k: magnitudes compare as the bits of |v| in f32 (quantize::magnitude_key); among equal
// magnitudes the lower index wins, so the choice is a pure function of the input. It is found
// by a radix select over those 31-bit keys (three histogram passes, no sort and no scratch the
// size of the input; its steps are in quantize.hpp, shared with the device's kernels), then one
// pass emits the indices in ascending order.
//
// Encoded: the 8-byte header (checks.hpp, codec 6), u32 k, k u32 indices strictly ascending,
// k f32 values. Decoding checks k against the codec's own Keep and every index against the
// destination, so a forged index cannot write out of bounds.

#include <array>
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

struct TopK {
  Keep keep{};

  void validate() const { keep.validate("top-k"); }

  struct State {};
  static constexpr bool identity = false;
  static constexpr bool lossless = false;

  std::string describe() const { return fmt::format("top-k({})", keep.describe()); }
  State make_state(std::size_t, DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, DType) const { return header_bytes + 4 + 8 * keep.of(n); }

  // The k-th largest key, and how many values with exactly that key are kept (the lowest-indexed).
  struct Cut {
    std::uint32_t key = 0;
    std::size_t ties_kept = 0;
  };

  template <class T>
  static Cut select(std::span<const T> values, std::size_t k) {
    std::array<std::uint32_t, quantize::top_k_max_digits> histogram;
    quantize::TopKCut cut{.wanted = k};
    for (unsigned pass = 0; pass < quantize::top_k_passes; ++pass) {
      histogram.fill(0);
      for (T v : values) {
        const std::uint32_t key = quantize::magnitude_key(static_cast<float>(v));
        histogram[quantize::top_k_digit(key, pass)] += quantize::top_k_matches(key, cut);
      }
      std::uint32_t digit = quantize::top_k_digits(pass) - 1;
      std::uint64_t above = 0;
      while (!quantize::top_k_holds(above, histogram[digit], cut.wanted)) above += histogram[digit--];
      quantize::top_k_take(cut, pass, digit, above);
    }
    return {cut.prefix, static_cast<std::size_t>(cut.wanted)};
  }

  template <class T>
  std::size_t encode(std::span<const T> values, State&, std::span<std::byte> out) const {
    return encode_picks(values, out, [](std::size_t, float) {});
  }

  // For ErrorFeedback: encodes values + residual and leaves what it cut off in residual: the add,
  // the selection, then only the k kept positions instead of two negating passes and a decode.
  template <class T>
  std::size_t encode_keeping_error(std::span<const T> values, std::span<T> residual, State&,
                                   std::span<std::byte> out) const {
    return compression::encode_keeping_error(
        values, residual, [&](std::span<const T> p, auto picked) { return encode_picks(p, out, picked); });
  }

  template <class T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    const std::size_t n = out.size(), k = keep.of(n);
    check_header(in, CodecId::top_k, "top-k", n, 4 + 8 * k);
    std::uint32_t count;
    std::memcpy(&count, in.data() + header_bytes, 4);
    if (count != k)
      throw Error(ErrorKind::protocol, {.operation = "decode"},
                  fmt::format("top-k codec: the data keeps {} of {} values, this codec keeps {}", count, n, k));
    const auto* index = reinterpret_cast<const std::uint32_t*>(in.data() + header_bytes + 4);
    const auto* value = reinterpret_cast<const float*>(index + k);
    for (std::size_t j = 0; j < k; ++j)  // checked before anything is written
      if (index[j] >= n || (j > 0 && index[j] <= index[j - 1]))
        throw Error(ErrorKind::protocol, {.operation = "decode"},
                    fmt::format("top-k codec: index {} at position {} is out of range or order (of {} values)",
                                index[j], j, n));
    if (mode == DecodeMode::overwrite) std::fill(out.begin(), out.end(), T(0));
    for (std::size_t j = 0; j < k; ++j) out[index[j]] += static_cast<T>(value[j]);
  }

 private:
  // Writes the encoding of values and calls picked(i, value sent) for each kept position i.
  template <class T, class Picked>
  std::size_t encode_picks(std::span<const T> values, std::span<std::byte> out, Picked picked) const {
    const std::size_t n = values.size(), k = keep.of(n);
    const std::size_t bytes = header_bytes + 4 + 8 * k;
    check_capacity("top-k", bytes, out.size());
    write_header(out, CodecId::top_k, n);
    const auto count = static_cast<std::uint32_t>(k);
    std::memcpy(out.data() + header_bytes, &count, 4);
    if (k == 0) return bytes;
    auto* index = reinterpret_cast<std::uint32_t*>(out.data() + header_bytes + 4);
    auto* value = reinterpret_cast<float*>(index + k);
    auto [cut, ties] = select(values, k);
    std::size_t taken = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(values[i]);
      const std::uint32_t key = quantize::magnitude_key(v);
      if (key > cut || (key == cut && ties > 0)) {
        ties -= key == cut;
        index[taken] = static_cast<std::uint32_t>(i);
        value[taken++] = v;
        picked(i, v);
      }
    }
    return bytes;
  }
};

static_assert(CompressionPolicy<TopK>);

}  // namespace gradsync::compression
