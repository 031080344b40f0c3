#include "mlp.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace fmnist {

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

// y = x W + b for each sample, as axpys over W's rows (contiguous, vectorizable), skipping the
// zero inputs that ReLU and blank pixels leave; ReLU on every layer but the last.
void Mlp::forward(const float* x, std::size_t batch) {
  reserve(batch);
  const float* input = x;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    float* output = activations_[l].data();
    const bool relu = l + 1 < layers_.size();
    for (std::size_t s = 0; s < batch; ++s) {
      float* y = output + s * L.out;
      std::copy(L.b.begin(), L.b.end(), y);
      const float* xs = input + s * L.in;
      for (std::size_t i = 0; i < L.in; ++i) {
        const float a = xs[i];
        if (a == 0.0f) continue;
        const float* wi = L.w.data() + i * L.out;
        for (std::size_t o = 0; o < L.out; ++o) y[o] += a * wi[o];
      }
      if (relu)
        for (std::size_t o = 0; o < L.out; ++o) y[o] = std::max(y[o], 0.0f);
    }
    input = output;
  }
}

float Mlp::forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch) {
  forward(x, batch);
  const Layer& last = layers_.back();
  const float* logits = activations_.back().data();
  float* delta = deltas_.back().data();
  double loss = 0;
  for (std::size_t s = 0; s < batch; ++s) {
    const float* z = logits + s * last.out;
    float* d = delta + s * last.out;
    const float top = *std::max_element(z, z + last.out);
    float sum = 0;
    for (std::size_t o = 0; o < last.out; ++o) sum += d[o] = std::exp(z[o] - top);
    for (std::size_t o = 0; o < last.out; ++o) d[o] /= sum;
    loss -= std::log(std::max(d[labels[s]], 1e-30f));
    d[labels[s]] -= 1.0f;
    for (std::size_t o = 0; o < last.out; ++o) d[o] /= static_cast<float>(batch);
  }
  return static_cast<float>(loss / static_cast<double>(batch));
}

// Gradients of layer l from its delta, then the delta of the layer below (through its ReLU).
void Mlp::backward(std::size_t l, const float* x, std::size_t batch) {
  Layer& L = layers_[l];
  const float* input = l == 0 ? x : activations_[l - 1].data();
  const float* delta = deltas_[l].data();
  std::fill(L.gw.begin(), L.gw.end(), 0.0f);
  std::fill(L.gb.begin(), L.gb.end(), 0.0f);
  for (std::size_t s = 0; s < batch; ++s) {
    const float* d = delta + s * L.out;
    for (std::size_t o = 0; o < L.out; ++o) L.gb[o] += d[o];
    const float* xs = input + s * L.in;
    for (std::size_t i = 0; i < L.in; ++i) {
      const float a = xs[i];
      if (a == 0.0f) continue;
      float* g = L.gw.data() + i * L.out;
      for (std::size_t o = 0; o < L.out; ++o) g[o] += a * d[o];
    }
  }
  if (l == 0) return;
  float* below = deltas_[l - 1].data();
  for (std::size_t s = 0; s < batch; ++s) {
    const float* d = delta + s * L.out;
    const float* xs = input + s * L.in;
    float* out = below + s * L.in;
    for (std::size_t i = 0; i < L.in; ++i) {
      if (xs[i] <= 0.0f) {  // ReLU was flat here
        out[i] = 0.0f;
        continue;
      }
      const float* wi = L.w.data() + i * L.out;
      float acc = 0.0f;
      for (std::size_t o = 0; o < L.out; ++o) acc += wi[o] * d[o];
      out[i] = acc;
    }
  }
}

// Layer 0's delta, which its backward leaves in place, through its weights.
void Mlp::input_gradient(std::size_t batch, float* dx) const {
  const Layer& L = layers_.front();
  const float* delta = deltas_.front().data();
  for (std::size_t s = 0; s < batch; ++s) {
    const float* d = delta + s * L.out;
    for (std::size_t i = 0; i < L.in; ++i) {
      const float* wi = L.w.data() + i * L.out;
      float acc = 0.0f;
      for (std::size_t o = 0; o < L.out; ++o) acc += wi[o] * d[o];
      dx[s * L.in + i] = acc;
    }
  }
}

void Mlp::sgd_step(float learning_rate, float momentum) {
  for (Layer& L : layers_) {
    for (std::size_t k = 0; k < L.w.size(); ++k) {
      L.vw[k] = momentum * L.vw[k] + L.gw[k];
      L.w[k] -= learning_rate * L.vw[k];
    }
    for (std::size_t k = 0; k < L.b.size(); ++k) {
      L.vb[k] = momentum * L.vb[k] + L.gb[k];
      L.b[k] -= learning_rate * L.vb[k];
    }
  }
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
