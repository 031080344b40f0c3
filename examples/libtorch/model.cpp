#include "model.hpp"

#include <algorithm>

namespace libtorch_fmnist {

namespace nn = torch::nn;

ResidualBlockImpl::ResidualBlockImpl(std::int64_t channels)
    : first(register_module("first", nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1)))),
      second(register_module("second", nn::Conv2d(nn::Conv2dOptions(channels, channels, 3).padding(1)))) {}

torch::Tensor ResidualBlockImpl::forward(const torch::Tensor& x) {
  return torch::relu(x + second(torch::relu(first(x))));
}

NetImpl::NetImpl()
    : stem(register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)))),
      down(register_module("down", nn::Conv2d(nn::Conv2dOptions(16, 32, 3).stride(2).padding(1)))),
      block1(register_module("block1", ResidualBlock(16))),
      block2(register_module("block2", ResidualBlock(32))),
      hidden(register_module("hidden", nn::Linear(32 * 7 * 7, 128))),
      out(register_module("out", nn::Linear(128, 10))) {}

torch::Tensor NetImpl::forward(const torch::Tensor& x) {
  auto h = block1(torch::relu(stem(x)));
  h = block2(torch::relu(down(torch::max_pool2d(h, 2))));
  return out(torch::relu(hidden(h.flatten(1))));
}

torch::Tensor images_tensor(std::span<float> pixels, std::int64_t count) {
  return torch::from_blob(pixels.data(), {count, 1, 28, 28});
}

std::size_t correct(Net& net, std::span<const float> pixels, std::span<const std::uint8_t> labels, std::size_t count) {
  torch::NoGradGuard no_gradients;
  constexpr std::size_t chunk = 1000;
  std::size_t right = 0;
  for (std::size_t at = 0; at < count; at += chunk) {
    const auto n = static_cast<std::int64_t>(std::min(chunk, count - at));
    // from_blob wants a mutable pointer; nothing writes through it here.
    const auto x = images_tensor({const_cast<float*>(pixels.data()) + at * 784, static_cast<std::size_t>(n) * 784}, n);
    const auto predicted = net->forward(x).argmax(1);
    const auto expected =
        torch::from_blob(const_cast<std::uint8_t*>(labels.data()) + at, {n}, torch::kUInt8).to(torch::kLong);
    right += static_cast<std::size_t>(predicted.eq(expected).sum().item<std::int64_t>());
  }
  return right;
}

}  // namespace libtorch_fmnist
