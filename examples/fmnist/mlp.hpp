#pragma once
// A multi-layer perceptron with ReLU hidden layers and a softmax cross-entropy loss: forward,
// backward layer by layer (last layer first, as autograd would produce them), and SGD with
// momentum. The matrix products are Eigen's (one thread, so results do not depend on the
// machine's core count); the rest is written out, small enough to read in one sitting, its
// per-element math in elementwise.hpp, which the GPU model (device_mlp.hpp) shares.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gradsync/types.hpp"

namespace fmnist {

struct Layer {
  std::size_t in = 0, out = 0;
  std::vector<float> w, b;    // w is in x out: row i holds input i's weights to every output
  std::vector<float> gw, gb;  // gradients of the mean loss, same shapes
  std::vector<float> vw, vb;  // momentum
};

class Mlp {
 public:
  // sizes = {inputs, hidden..., classes}; He-normal weights from `seed`, zero biases.
  Mlp(const std::vector<std::size_t>& sizes, std::uint64_t seed);

  std::vector<Layer>& layers() noexcept { return layers_; }
  const std::vector<Layer>& layers() const noexcept { return layers_; }
  std::size_t parameters() const noexcept;
  std::size_t depth() const noexcept { return layers_.size(); }
  // Layer l's gradients of the mean loss: what the Synchronizer averages.
  gradsync::TensorView weight_gradient(std::size_t l) { return gradsync::view(layers_.at(l).gw); }
  gradsync::TensorView bias_gradient(std::size_t l) { return gradsync::view(layers_.at(l).gb); }

  // One forward and backward pass over `batch` samples; calls layer_ready(l) as soon as layer l's
  // gradients are complete, from the last layer to the first. Returns the mean loss. With `dx`,
  // also writes d(mean loss)/d(input), batch x inputs values, for a model whose inputs are
  // themselves learned (ctr's pooled embeddings, hybrid's conv features). Layer l's weights are
  // read for the last time before layer_ready(l) (dx included), so that callback may start
  // layer l's update at once.
  template <class OnLayerReady>
  float train_step(const float* x, const std::uint8_t* labels, std::size_t batch, OnLayerReady&& layer_ready,
                   float* dx = nullptr) {
    const float loss = forward_loss(x, labels, batch);
    for (std::size_t l = layers_.size(); l-- > 0;) {
      backward(l, x, batch, l == 0 ? dx : deltas_[l - 1].data());
      layer_ready(l);
    }
    return loss;
  }

  // Every layer's SGD step (sgd() below on each weight and bias).
  void sgd_step(float learning_rate, float momentum);

  // How many of the `n` samples the model classifies correctly.
  std::size_t correct(const float* x, const std::uint8_t* labels, std::size_t n);

 private:
  float forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch);
  void forward(const float* x, std::size_t batch);
  // Layer l's gradients, then d(loss)/d(its input) into `below` (if not null), through the
  // ReLU of the layer below (none for the model's input).
  void backward(std::size_t l, const float* x, std::size_t batch, float* below);
  void reserve(std::size_t batch);

  std::vector<Layer> layers_;
  std::vector<std::vector<float>> activations_;  // per layer output, batch x out (logits for the last)
  std::vector<std::vector<float>> deltas_;       // d loss / d pre-activation, per layer
  std::size_t reserved_batch_ = 0;
};

// SGD with momentum on one tensor: velocity = momentum * velocity + gradient, then
// parameters -= learning_rate * velocity.
void sgd(std::span<float> parameters, std::span<float> velocity, std::span<const float> gradient, float learning_rate,
         float momentum);

}  // namespace fmnist
