#pragma once
// Data for the tests of fmnist's models (test_fmnist, test_fmnist_device).

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "idx.hpp"

namespace gradsync::test {

// Learnable synthetic data: each class is a fixed random pattern, each sample its class's
// pattern plus noise.
inline fmnist::Dataset synthetic(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<std::vector<float>> prototypes(10, std::vector<float>(64));
  std::mt19937_64 fixed(99);
  for (auto& p : prototypes)
    for (float& v : p) v = unit(fixed) < 0.3f ? 1.0f : 0.0f;
  fmnist::Dataset d;
  d.count = count;
  d.pixels = 64;
  for (std::size_t s = 0; s < count; ++s) {
    const auto label = static_cast<std::uint8_t>(s % 10);
    d.labels.push_back(label);
    for (float v : prototypes[label]) d.images.push_back(std::clamp(v + 0.3f * (unit(gen) - 0.5f), 0.0f, 1.0f));
  }
  return d;
}

}  // namespace gradsync::test
