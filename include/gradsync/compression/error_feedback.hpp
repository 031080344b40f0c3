#pragma once
// compression::ErrorFeedback<C> — keeps what codec C cut off and adds it to the next values
// encoded at the same site: p = g + e; send C(p); e = p - D(C(p)). Over steps, the sum of what
// was decoded tracks the sum of what was given, off by only the current residual, which is what
// lets 1- and 2-bit codecs train to the same accuracy as f32.
//
// The residual lives in the per-site State, sized when the plan is made. The encoded format is
// C's own. A codec that can code p and update e in fewer passes than these five (add, encode,
// negate, decode, negate) offers encode_keeping_error (see CompressionPolicy), which must leave
// the same bits.

#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "gradsync/compression/checks.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/settings.hpp"

namespace gradsync::compression {

template <CompressionPolicy C>
struct ErrorFeedback {
  C codec{};

  void validate() const { detail::validate_policy(codec); }

  struct State {
    typename C::State inner;
    std::vector<float> residual_f32;   // used for f32 sites
    std::vector<double> residual_f64;  // used for f64 sites
  };
  static constexpr bool identity = false;
  static constexpr bool lossless = C::lossless;

  std::string describe() const { return fmt::format("error-feedback({})", codec.describe()); }

  State make_state(std::size_t n, DType dtype) const {
    State s{codec.make_state(n, dtype), {}, {}};
    (dtype == DType::f64 ? s.residual_f64.resize(n) : s.residual_f32.resize(n));
    return s;
  }

  std::size_t max_encoded_bytes(std::size_t n, DType dtype) const { return codec.max_encoded_bytes(n, dtype); }

  // Only for the dtypes C codes: an f32-only C makes an f32-only ErrorFeedback<C>.
  template <class T>
    requires CodecFor<C, T>
  std::size_t encode(std::span<const T> values, State& state, std::span<std::byte> out) const {
    auto& residual = [&]() -> std::vector<T>& {
      if constexpr (std::is_same_v<T, double>) return state.residual_f64;
      else return state.residual_f32;
    }();
    if (residual.size() != values.size())
      throw Error(ErrorKind::invalid_argument, {.operation = "encode"},
                  fmt::format("error feedback state holds {} values, asked to encode {}", residual.size(), values.size()));
    if constexpr (requires { codec.encode_keeping_error(values, std::span<T>(residual), state.inner, out); })
      return codec.encode_keeping_error(values, std::span<T>(residual), state.inner, out);
    for (std::size_t i = 0; i < values.size(); ++i) residual[i] += values[i];  // p = g + e
    const std::size_t bytes = codec.encode(std::span<const T>(residual), state.inner, out);
    // e = p - D(C(p)), computed in place as -(-p + D(C(p))).
    for (T& r : residual) r = -r;
    codec.decode(std::span<const std::byte>(out.first(bytes)), std::span<T>(residual), DecodeMode::add);
    for (T& r : residual) r = -r;
    return bytes;
  }

  template <class T>
    requires CodecFor<C, T>
  void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
    codec.decode(in, out, mode);
  }
};

}  // namespace gradsync::compression
