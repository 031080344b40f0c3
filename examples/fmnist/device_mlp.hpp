#pragma once
// The MLP of mlp.hpp on a CUDA device, for `fmnist --device cuda`: parameters, activations,
// gradients and momentum in device memory; the matrix products by cuBLAS (f32, no tensor-core
// rounding), the rest as small kernels over elementwise.hpp's math, which the CPU model shares.
// Every kernel and product is queued on the device's legacy default stream, where the
// Synchronizer's device path expects a gradient still being computed when ready() is called
// for it (synchronizer.hpp: add): train_step() calls layer_ready(l) as soon as layer l's
// gradient kernels are queued, without waiting for them, so the exchange of the last layers
// starts while the GPU still computes the first. Built where gradsync has CUDA and cuBLAS is
// found (examples/meson.build); errors are std::runtime_error naming the CUDA or cuBLAS call.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/types.hpp"
#include "mlp.hpp"

namespace fmnist {

class DeviceMlp {
 public:
  // `initial`'s weights and biases on CUDA device `device` (zero momentum): the same starting
  // point as the CPU model built from the same seed.
  DeviceMlp(const Mlp& initial, int device);
  ~DeviceMlp();
  DeviceMlp(const DeviceMlp&) = delete;
  DeviceMlp& operator=(const DeviceMlp&) = delete;

  std::size_t depth() const noexcept { return layers_.size(); }
  std::size_t parameters() const noexcept;
  // Layer l's gradients of the mean loss, in device memory: what the Synchronizer averages.
  gradsync::TensorView weight_gradient(std::size_t l) const;
  gradsync::TensorView bias_gradient(std::size_t l) const;

  // Mlp::train_step's contract, on the device: `x` and `labels` are host memory (a data loader's
  // batch), copied in first; layer_ready(l) follows the queueing of layer l's gradient kernels.
  // Returns the batch's mean loss, which waits for the backward pass to finish.
  template <class OnLayerReady>
  float train_step(const float* x, const std::uint8_t* labels, std::size_t batch, OnLayerReady&& layer_ready) {
    forward_loss(x, labels, batch);
    for (std::size_t l = layers_.size(); l-- > 0;) {
      gradients(l, batch);
      layer_ready(l);  // the mark the exchange follows: the products for the layer below come after it
      propagate(l, batch);
    }
    return mean_loss(batch);
  }

  void sgd_step(float learning_rate, float momentum);
  std::size_t correct(const float* x, const std::uint8_t* labels, std::size_t n);

  // The parameters back in a host model of the same shape (for comparing with the CPU's).
  void copy_parameters_to(Mlp& host) const;

 private:
  struct Layer {
    std::size_t in = 0, out = 0;
    float *w = nullptr, *b = nullptr, *gw = nullptr, *gb = nullptr, *vw = nullptr, *vb = nullptr;
  };

  float* allocate(std::size_t values);
  void reserve(std::size_t batch);
  void forward(std::size_t batch);  // from input_
  void forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch);
  void gradients(std::size_t l, std::size_t batch);  // layer l's weight and bias gradients
  void propagate(std::size_t l, std::size_t batch);  // its deltas into the layer below's
  float mean_loss(std::size_t batch);

  int device_;
  void* blas_ = nullptr;  // cublasHandle_t
  std::vector<void*> allocations_;
  std::vector<Layer> layers_;
  std::size_t reserved_batch_ = 0;
  float* input_ = nullptr;                // batch x inputs
  std::uint8_t* labels_ = nullptr;        // batch
  float* losses_ = nullptr;               // batch: each sample's loss
  std::vector<float*> activations_;       // per layer, batch x out (logits for the last)
  std::vector<float*> deltas_;            // d loss / d pre-activation, per layer
  std::vector<float> host_losses_;        // batch
  std::vector<float> host_logits_;        // batch x classes, for correct()
};

}  // namespace fmnist
