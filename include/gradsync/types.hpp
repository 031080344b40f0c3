#pragma once
// The vocabulary every policy shares: element types, devices, a non-owning view of a gradient's
// memory and the registered layout that all ranks must agree on.

#if __cplusplus < 202002L
#error "gradsync needs C++20: compile with -std=c++20 (pkg-config --cflags gradsync gives it)"
#endif

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gradsync {

enum class DType : std::uint8_t { f32, f16, bf16, f64 };

constexpr std::size_t size_of(DType t) noexcept {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
  }
  return 0;
}

constexpr std::string_view to_string(DType t) noexcept {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
  }
  return "?";
}

// Reductions run in f32 for f32/f16/bf16 gradients and in f64 for f64 gradients: summing in a
// 16-bit type loses digits at every ring step, and demoting f64 would lose them once.
constexpr DType accumulation_dtype(DType t) noexcept { return t == DType::f64 ? DType::f64 : DType::f32; }

template <class T>
constexpr DType dtype_of() noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "dtype_of<T>: only float and double map to a DType by type; pass f16/bf16 explicitly");
  return std::is_same_v<T, float> ? DType::f32 : DType::f64;
}

struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static constexpr Device cpu() noexcept { return {}; }
  static constexpr Device cuda(int index) noexcept { return {Kind::cuda, index}; }
  friend constexpr bool operator==(Device, Device) noexcept = default;
};

std::string to_string(Device d);  // "cpu", "cuda:1"

// Non-owning view of one gradient's memory. f16 and bf16 are stored as their 16-bit patterns.
struct TensorView {
  void* data = nullptr;
  std::size_t count = 0;  // elements
  DType dtype = DType::f32;
  Device device = Device::cpu();

  std::size_t bytes() const noexcept { return count * size_of(dtype); }
};

inline TensorView view(std::span<float> s, Device d = Device::cpu()) { return {s.data(), s.size(), DType::f32, d}; }
inline TensorView view(std::span<double> s, Device d = Device::cpu()) { return {s.data(), s.size(), DType::f64, d}; }
// 16-bit storage is ambiguous, so its dtype is named: view(bits, DType::bf16).
TensorView view(std::span<std::uint16_t> s, DType dtype, Device d = Device::cpu());

using GradId = std::uint32_t;

// One registered gradient as every rank must see it.
struct GradientInfo {
  std::string name{};
  std::size_t count = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu();

  std::size_t bytes() const noexcept { return count * size_of(dtype); }
  friend bool operator==(const GradientInfo&, const GradientInfo&) = default;
};

using Layout = std::vector<GradientInfo>;

// A half-open range of elements [begin, end) inside a bucket.
struct ElemRange {
  std::size_t begin = 0;
  std::size_t end = 0;

  std::size_t size() const noexcept { return end - begin; }
  bool empty() const noexcept { return end == begin; }
  friend bool operator==(ElemRange, ElemRange) noexcept = default;
};

}  // namespace gradsync
