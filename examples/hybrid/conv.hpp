#pragma once
// The convolutional half of the hybrid trainer's VGG-style CNN: blocks of 3x3 convolutions
// (padding 1, stride 1), each followed by ReLU, and optionally by 2x2 max pooling. A convolution
// is an im2col and one Eigen matrix product per sample, forward and backward; SGD with momentum
// is fmnist's. Images are channels x height x width, row-major, one after another.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mlp.hpp"

namespace hybrid {

struct ConvLayer {
  std::size_t in_channels = 0, out_channels = 0;
  std::size_t height = 0, width = 0;  // of its input (and of its convolution's output)
  bool pool = false;                  // 2x2 max pooling after the ReLU
  std::vector<float> w, b;            // w is out_channels x (in_channels x 3 x 3)
  std::vector<float> gw, gb;          // gradients of the mean loss, same shapes
  std::vector<float> vw, vb;          // momentum

  std::size_t outputs() const noexcept {  // per sample, after pooling
    return out_channels * (pool ? height / 2 * (width / 2) : height * width);
  }
};

class ConvStack {
 public:
  struct LayerSpec {
    std::size_t channels = 0;
    bool pool = false;
  };

  // Inputs of channels x height x width; He-normal weights from `seed`, zero biases. Throws
  // std::invalid_argument where a pooled layer's input has an odd side.
  ConvStack(std::size_t channels, std::size_t height, std::size_t width, const std::vector<LayerSpec>& layers,
            std::uint64_t seed);

  std::vector<ConvLayer>& layers() noexcept { return layers_; }
  const std::vector<ConvLayer>& layers() const noexcept { return layers_; }
  std::size_t inputs() const noexcept;    // per sample
  std::size_t features() const noexcept;  // per sample: the last layer's outputs
  std::size_t parameters() const noexcept;

  // The features of `batch` samples, batch x features(); valid until the next forward.
  const float* forward(const float* x, std::size_t batch);

  // Backward from d(mean loss)/d(features) of the last forward's batch; calls layer_ready(l) as
  // soon as layer l's gradients are complete, last layer first. Layer l's weights are read for
  // the last time before layer_ready(l), so that callback may start layer l's update at once.
  template <class OnLayerReady>
  void backward(const float* d_features, std::size_t batch, OnLayerReady&& layer_ready) {
    for (std::size_t l = layers_.size(); l-- > 0;) {
      backward_layer(l, l + 1 == layers_.size() ? d_features : d_outputs_[l].data(), batch);
      layer_ready(l);
    }
  }

  void sgd_step(float learning_rate, float momentum);

 private:
  const float* output(std::size_t l) const noexcept;
  void backward_layer(std::size_t l, const float* d_output, std::size_t batch);
  void reserve(std::size_t batch);

  std::vector<ConvLayer> layers_;
  const float* input_ = nullptr;              // the last forward's x
  std::vector<std::vector<float>> relu_;       // per layer: batch x out_channels x height x width
  std::vector<std::vector<float>> pooled_;     // per pooled layer: batch x outputs()
  std::vector<std::vector<std::uint32_t>> argmax_;  // per pooled output: its maximum's index in relu_
  std::vector<std::vector<float>> d_outputs_;  // per layer but the last: d loss / d its output
  std::vector<float> d_relu_;                  // one sample's d loss / d pre-activation
  std::vector<float> columns_, d_columns_;     // one sample's im2col matrix and its gradient
  std::size_t reserved_batch_ = 0;
};

}  // namespace hybrid
