#pragma once
// The ctr model: each example's embedding rows (one per feature key, `dim` values each) are
// averaged into one vector, and fmnist's MLP (ReLU hidden layers, softmax cross-entropy) maps it
// to the classes. The rows live in a table the model does not own (sparse::EmbeddingTable); the
// caller looks them up and hands the model a pointer per key, and gets back a gradient row per
// key, for the table's update.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "mlp.hpp"

namespace ctr {

class Model {
 public:
  // The MLP is {dim, hidden..., classes}, He-normal from `seed`.
  Model(std::size_t dim, const std::vector<std::size_t>& hidden, std::size_t classes, std::uint64_t seed);

  std::size_t dim() const noexcept { return dim_; }
  fmnist::Mlp& dense() noexcept { return dense_; }
  const fmnist::Mlp& dense() const noexcept { return dense_; }

  // One forward and backward pass over a batch of offsets.size() - 1 examples: example s's rows
  // are rows[offsets[s] .. offsets[s+1]) (offsets[0] == 0). Calls layer_ready(l) as each dense
  // layer's gradients are complete (last first, as fmnist::Mlp does), then writes
  // d(mean loss)/d(row) into row_gradients, `dim` values per entry of `rows` in rows' order: the
  // pooled vector's gradient divided by the example's key count. Returns the mean loss.
  template <class OnLayerReady>
  float train_step(std::span<const float* const> rows, std::span<const std::size_t> offsets,
                   const std::uint8_t* labels, std::span<float> row_gradients, OnLayerReady&& layer_ready) {
    const std::size_t batch = offsets.size() - 1;
    pool(rows, offsets);
    const float loss = dense_.train_step(pooled_.data(), labels, batch, layer_ready, pooled_gradient_.data());
    spread(offsets, row_gradients);
    return loss;
  }

  // How many of the examples (as for train_step) the model classifies correctly.
  std::size_t correct(std::span<const float* const> rows, std::span<const std::size_t> offsets,
                      const std::uint8_t* labels);

 private:
  void pool(std::span<const float* const> rows, std::span<const std::size_t> offsets);
  void spread(std::span<const std::size_t> offsets, std::span<float> row_gradients) const;

  std::size_t dim_;
  fmnist::Mlp dense_;
  std::vector<float> pooled_;           // batch x dim, grown to the largest batch seen
  std::vector<float> pooled_gradient_;  // the same shape
};

}  // namespace ctr
