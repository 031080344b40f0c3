#include "toolkit/statistics.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

namespace gradsync::toolkit {

double median(std::vector<double> values) {
  const std::size_t n = values.size();
  if (n == 0) return std::numeric_limits<double>::quiet_NaN();
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(n / 2);
  std::nth_element(values.begin(), middle, values.end());
  if (n % 2) return *middle;
  return (*std::max_element(values.begin(), middle) + *middle) / 2;
}

double mean(const std::vector<double>& values) {
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

}  // namespace gradsync::toolkit
