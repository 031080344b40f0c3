#pragma once
// What the sparsifying codecs (TopK, RandomK) share: how many values they keep of a run.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include <fmt/format.h>

namespace gradsync::compression {

// Keep `count` values of every run encoded, or where count is 0, `fraction` of them (rounded up);
// at least one of a non-empty run, at most all. A ring encodes each chunk of a bucket as its own
// run, so a count applies per chunk; a fraction reads the same at any granularity.
struct Keep {
  std::size_t count = 0;
  double fraction = 0.01;

  std::size_t of(std::size_t n) const {
    if (n == 0) return 0;
    const std::size_t k = count ? count : static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(n)));
    return std::clamp<std::size_t>(k, 1, n);
  }
  std::string describe() const { return count ? fmt::format("k={}", count) : fmt::format("fraction={}", fraction); }
};

}  // namespace gradsync::compression
