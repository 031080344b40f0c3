#include "mlp.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "elementwise.hpp"
#include "matrix.hpp"

namespace fmnist {

using namespace matrix;

Mlp::Mlp(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    Layer layer;
    layer.in = sizes[l];
    layer.out = sizes[l + 1];
    std::normal_distribution<float> normal(0.0f, std::sqrt(2.0f / static_cast<float>(layer.in)));
    layer.w.resize(layer.in * layer.out);
    for (float& v : layer.w) v = normal(gen);
    layer.b.assign(layer.out, 0.0f);
    layer.gw.assign(layer.w.size(), 0.0f);
    layer.gb.assign(layer.out, 0.0f);
    layer.vw.assign(layer.w.size(), 0.0f);
    layer.vb.assign(layer.out, 0.0f);
    layers_.push_back(std::move(layer));
  }
  activations_.resize(layers_.size());
  deltas_.resize(layers_.size());
}

std::size_t Mlp::parameters() const noexcept {
  std::size_t n = 0;
  for (const Layer& l : layers_) n += l.w.size() + l.b.size();
  return n;
}

void Mlp::reserve(std::size_t batch) {
  if (batch <= reserved_batch_) return;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    activations_[l].resize(batch * layers_[l].out);
    deltas_[l].resize(batch * layers_[l].out);
  }
  reserved_batch_ = batch;
}

// Y = X W + b, then ReLU on every layer but the last.
void Mlp::forward(const float* x, std::size_t batch) {
  reserve(batch);
  const auto rows = static_cast<Eigen::Index>(batch);
  const float* input = x;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const auto in = static_cast<Eigen::Index>(L.in), out = static_cast<Eigen::Index>(L.out);
    Map y(activations_[l].data(), rows, out);
    y.noalias() = ConstMap(input, rows, in) * ConstMap(L.w.data(), in, out);
    y.rowwise() += ConstRowMap(L.b.data(), out);
    if (l + 1 < layers_.size()) y = y.unaryExpr([](float v) { return elementwise::relu(v); });
    input = activations_[l].data();
  }
}

float Mlp::forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch) {
  forward(x, batch);
  const Layer& last = layers_.back();
  const float* logits = activations_.back().data();
  float* delta = deltas_.back().data();
  double loss = 0;
  for (std::size_t s = 0; s < batch; ++s)
    loss += elementwise::softmax_cross_entropy(logits + s * last.out, delta + s * last.out, last.out, labels[s], batch);
  return static_cast<float>(loss / static_cast<double>(batch));
}

// dW = X^T D, db = the column sums of D; below = D W^T, zeroed where the ReLU below was flat.
void Mlp::backward(std::size_t l, const float* x, std::size_t batch, float* below) {
  Layer& L = layers_[l];
  const auto rows = static_cast<Eigen::Index>(batch);
  const auto in = static_cast<Eigen::Index>(L.in), out = static_cast<Eigen::Index>(L.out);
  const ConstMap input(l == 0 ? x : activations_[l - 1].data(), rows, in);
  const ConstMap delta(deltas_[l].data(), rows, out);
  Map(L.gw.data(), in, out).noalias() = input.transpose() * delta;
  RowMap(L.gb.data(), out) = delta.colwise().sum();
  if (!below) return;
  Map d(below, rows, in);
  d.noalias() = delta * ConstMap(L.w.data(), in, out).transpose();
  if (l > 0) d = d.binaryExpr(input, [](float g, float out) { return elementwise::relu_backward(g, out); });
}

void Mlp::sgd_step(float learning_rate, float momentum) {
  for (Layer& L : layers_) {
    sgd(L.w, L.vw, L.gw, learning_rate, momentum);
    sgd(L.b, L.vb, L.gb, learning_rate, momentum);
  }
}

void sgd(std::span<float> parameters, std::span<float> velocity, std::span<const float> gradient, float learning_rate,
         float momentum) {
  for (std::size_t k = 0; k < parameters.size(); ++k)
    elementwise::sgd(parameters[k], velocity[k], gradient[k], learning_rate, momentum);
}

std::size_t Mlp::correct(const float* x, const std::uint8_t* labels, std::size_t n) {
  constexpr std::size_t chunk = 256;
  std::size_t right = 0;
  const std::size_t inputs = layers_.front().in;
  const std::size_t classes = layers_.back().out;
  for (std::size_t start = 0; start < n; start += chunk) {
    const std::size_t count = std::min(chunk, n - start);
    forward(x + start * inputs, count);
    const float* logits = activations_.back().data();
    for (std::size_t s = 0; s < count; ++s) {
      const float* z = logits + s * classes;
      right += static_cast<std::size_t>(std::max_element(z, z + classes) - z) == labels[start + s];
    }
  }
  return right;
}

}  // namespace fmnist
