#pragma once
// Benchmark data that looks like gradients: values drawn from N(0, 0.01), different on every
// rank, so that codecs are timed on what they meet in training (a sparsifier's choice, a
// quantizer's scale) and not on one constant, which flatters some of them.

#include <cstdint>
#include <random>
#include <vector>

namespace gradsync::toolkit {

// `count` values of rank `rank`: the same on every run and machine for the same arguments.
inline std::vector<float> gradient_values(std::size_t count, int rank) {
  std::mt19937_64 random(0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(rank + 1));
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(random);
  return values;
}

}  // namespace gradsync::toolkit
