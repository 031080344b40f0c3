#include "model.hpp"

#include <algorithm>

namespace ctr {

namespace {

std::vector<std::size_t> layer_sizes(std::size_t dim, const std::vector<std::size_t>& hidden, std::size_t classes) {
  std::vector<std::size_t> sizes{dim};
  sizes.insert(sizes.end(), hidden.begin(), hidden.end());
  sizes.push_back(classes);
  return sizes;
}

}  // namespace

Model::Model(std::size_t dim, const std::vector<std::size_t>& hidden, std::size_t classes, std::uint64_t seed)
    : dim_(dim), dense_(layer_sizes(dim, hidden, classes), seed) {}

void Model::pool(std::span<const float* const> rows, std::span<const std::size_t> offsets) {
  const std::size_t batch = offsets.size() - 1;
  if (pooled_.size() < batch * dim_) {
    pooled_.resize(batch * dim_);
    pooled_gradient_.resize(batch * dim_);
  }
  for (std::size_t s = 0; s < batch; ++s) {
    float* out = pooled_.data() + s * dim_;
    std::fill_n(out, dim_, 0.0f);
    const std::size_t count = offsets[s + 1] - offsets[s];
    if (count == 0) continue;  // no features: the zero vector
    for (std::size_t k = offsets[s]; k < offsets[s + 1]; ++k)
      for (std::size_t j = 0; j < dim_; ++j) out[j] += rows[k][j];
    const float scale = 1.0f / static_cast<float>(count);
    for (std::size_t j = 0; j < dim_; ++j) out[j] *= scale;
  }
}

void Model::spread(std::span<const std::size_t> offsets, std::span<float> row_gradients) const {
  const std::size_t batch = offsets.size() - 1;
  for (std::size_t s = 0; s < batch; ++s) {
    const std::size_t count = offsets[s + 1] - offsets[s];
    if (count == 0) continue;
    const float scale = 1.0f / static_cast<float>(count);
    const float* g = pooled_gradient_.data() + s * dim_;
    for (std::size_t k = offsets[s]; k < offsets[s + 1]; ++k)
      for (std::size_t j = 0; j < dim_; ++j) row_gradients[k * dim_ + j] = g[j] * scale;
  }
}

std::size_t Model::correct(std::span<const float* const> rows, std::span<const std::size_t> offsets,
                           const std::uint8_t* labels) {
  pool(rows, offsets);
  return dense_.correct(pooled_.data(), labels, offsets.size() - 1);
}

}  // namespace ctr
