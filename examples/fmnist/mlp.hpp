#pragma once
// A multi-layer perceptron with ReLU hidden layers and a softmax cross-entropy loss, written out
// by hand: forward, backward layer by layer (last layer first, as autograd would produce them),
// and SGD with momentum. Small enough to read in one sitting; fast enough for a few epochs of
// Fashion-MNIST on two cores.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

  // One forward and backward pass over `batch` samples; calls layer_ready(l) as soon as layer l's
  // gradients are complete, from the last layer to the first. Returns the mean loss.
  template <class OnLayerReady>
  float train_step(const float* x, const std::uint8_t* labels, std::size_t batch, OnLayerReady&& layer_ready) {
    const float loss = forward_loss(x, labels, batch);
    for (std::size_t l = layers_.size(); l-- > 0;) {
      backward(l, x, batch);
      layer_ready(l);
    }
    return loss;
  }

  // d(mean loss)/d(input) of the last train_step's batch, batch x inputs values into `dx`: for a
  // model whose inputs are themselves learned (ctr's pooled embeddings). Call it before sgd_step.
  void input_gradient(std::size_t batch, float* dx) const;

  void sgd_step(float learning_rate, float momentum);

  // How many of the `n` samples the model classifies correctly.
  std::size_t correct(const float* x, const std::uint8_t* labels, std::size_t n);

 private:
  float forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch);
  void forward(const float* x, std::size_t batch);
  void backward(std::size_t l, const float* x, std::size_t batch);
  void reserve(std::size_t batch);

  std::vector<Layer> layers_;
  std::vector<std::vector<float>> activations_;  // per layer output, batch x out (logits for the last)
  std::vector<std::vector<float>> deltas_;       // d loss / d pre-activation, per layer
  std::size_t reserved_batch_ = 0;
};

}  // namespace fmnist
