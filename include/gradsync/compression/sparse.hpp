#pragma once
// What the sparsifying codecs (TopK, RandomK) share: how many values they keep of a run, and how
// they keep error feedback's residual.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "gradsync/detail/settings.hpp"

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
  void validate(std::string_view codec) const {
    if (count == 0)
      detail::check_setting(std::isfinite(fraction) && fraction > 0 && fraction <= 1, codec, "keep.fraction", fraction,
                            "in (0, 1] (or keep.count at least 1)");
  }
};

// The sparsifiers' encode_keeping_error (see ErrorFeedback): p = residual + values, formed in
// place, is encoded by encode(p, picked), which calls picked(i, value sent) for each kept
// position; there the residual becomes -(-p_i + sent) (ErrorFeedback's own operations), and
// everywhere else it stays p_i, which nothing was sent of.
template <class T, class EncodePicks>
std::size_t encode_keeping_error(std::span<const T> values, std::span<T> residual, EncodePicks encode) {
  for (std::size_t i = 0; i < residual.size(); ++i) residual[i] += values[i];
  return encode(std::span<const T>(residual),
                [&](std::size_t i, float sent) { residual[i] = -(-residual[i] + static_cast<T>(sent)); });
}

}  // namespace gradsync::compression
