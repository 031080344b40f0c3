#pragma once
// A small residual CNN for 28x28 grey images (Fashion-MNIST), written with torch::nn:
//
//   conv 3x3 1->16, ReLU | residual block (two 3x3 convs, 16) | max-pool 2 -> 14x14
//   | conv 3x3 16->32 stride 2 -> 7x7, ReLU | residual block (32) | fully connected 1568->128, ReLU
//   | fully connected 128->10
//
// 230,058 parameters (0.92 MB of f32 gradients a step, about fmnist's MLP), no batch norm: a
// data-parallel step then equals one process's step on the whole batch (batch norm's statistics
// would be per rank).

#include <cstdint>
#include <span>
#include <vector>

#include <torch/torch.h>

namespace libtorch_fmnist {

struct ResidualBlockImpl : torch::nn::Module {
  explicit ResidualBlockImpl(std::int64_t channels);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d first{nullptr}, second{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct NetImpl : torch::nn::Module {
  NetImpl();
  torch::Tensor forward(const torch::Tensor& x);  // x: N x 1 x 28 x 28, returns N x 10 logits
  torch::nn::Conv2d stem{nullptr}, down{nullptr};
  ResidualBlock block1{nullptr}, block2{nullptr};
  torch::nn::Linear hidden{nullptr}, out{nullptr};
};
TORCH_MODULE(Net);

// A batch of `count` images (count x 784 floats in [0, 1]) as the network's input, without a copy.
torch::Tensor images_tensor(std::span<float> pixels, std::int64_t count);

// How many of `count` images `net` classifies as `labels` says, in chunks (no gradients).
std::size_t correct(Net& net, std::span<const float> pixels, std::span<const std::uint8_t> labels, std::size_t count);

}  // namespace libtorch_fmnist
