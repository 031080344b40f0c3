#pragma once
// Moving a gradient between its own dtype and its bucket's accumulation dtype.

#include <cstdint>
#include <cstring>
#include <span>

#include "gradsync/numeric.hpp"
#include "gradsync/types.hpp"

namespace gradsync::detail {

template <class T>
void load(const TensorView& g, std::span<T> out) {
  switch (g.dtype) {
    case DType::f32: {
      const auto* in = static_cast<const float*>(g.data);
      if constexpr (std::is_same_v<T, float>) {
        if (!out.empty()) std::memcpy(out.data(), in, out.size_bytes());
      } else {
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = in[i];
      }
      return;
    }
    case DType::f64: {
      const auto* in = static_cast<const double*>(g.data);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(in[i]);
      return;
    }
    case DType::f16: {
      const auto* in = static_cast<const std::uint16_t*>(g.data);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = numeric::from_f16_bits(in[i]);
      return;
    }
    case DType::bf16: {
      const auto* in = static_cast<const std::uint16_t*>(g.data);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = numeric::from_bf16_bits(in[i]);
      return;
    }
  }
}

template <class T>
void store(std::span<const T> in, const TensorView& g) {
  switch (g.dtype) {
    case DType::f32: {
      auto* out = static_cast<float*>(g.data);
      if constexpr (std::is_same_v<T, float>) {
        if (!in.empty()) std::memcpy(out, in.data(), in.size_bytes());
      } else {
        for (std::size_t i = 0; i < in.size(); ++i) out[i] = static_cast<float>(in[i]);
      }
      return;
    }
    case DType::f64: {
      auto* out = static_cast<double*>(g.data);
      for (std::size_t i = 0; i < in.size(); ++i) out[i] = static_cast<double>(in[i]);
      return;
    }
    case DType::f16: {
      auto* out = static_cast<std::uint16_t*>(g.data);
      for (std::size_t i = 0; i < in.size(); ++i) out[i] = numeric::f16_bits(static_cast<float>(in[i]));
      return;
    }
    case DType::bf16: {
      auto* out = static_cast<std::uint16_t*>(g.data);
      for (std::size_t i = 0; i < in.size(); ++i) out[i] = numeric::bf16_bits(static_cast<float>(in[i]));
      return;
    }
  }
}

}  // namespace gradsync::detail
