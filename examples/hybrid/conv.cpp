#include "conv.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "matrix.hpp"

namespace hybrid {

namespace {

using namespace fmnist::matrix;

constexpr std::size_t taps = 9;  // a 3x3 kernel

// The im2col matrix of one image: row (c, ky, kx) holds, for every output pixel (y, x), the
// input pixel (c, y + ky - 1, x + kx - 1), or 0 in the padding.
void im2col(const float* image, std::size_t channels, std::size_t height, std::size_t width, float* columns) {
  for (std::size_t c = 0; c < channels; ++c)
    for (std::size_t ky = 0; ky < 3; ++ky)
      for (std::size_t kx = 0; kx < 3; ++kx) {
        float* row = columns + ((c * 3 + ky) * 3 + kx) * height * width;
        for (std::size_t y = 0; y < height; ++y) {
          const std::ptrdiff_t iy = static_cast<std::ptrdiff_t>(y + ky) - 1;
          float* out = row + y * width;
          if (iy < 0 || iy >= static_cast<std::ptrdiff_t>(height)) {
            std::fill(out, out + width, 0.0f);
            continue;
          }
          const float* in = image + (c * height + static_cast<std::size_t>(iy)) * width;
          for (std::size_t x = 0; x < width; ++x) {
            const std::ptrdiff_t ix = static_cast<std::ptrdiff_t>(x + kx) - 1;
            out[x] = ix < 0 || ix >= static_cast<std::ptrdiff_t>(width) ? 0.0f : in[ix];
          }
        }
      }
}

// The transpose of im2col: adds each column entry's gradient to the input pixel it came from.
void col2im_add(const float* columns, std::size_t channels, std::size_t height, std::size_t width, float* image) {
  for (std::size_t c = 0; c < channels; ++c)
    for (std::size_t ky = 0; ky < 3; ++ky)
      for (std::size_t kx = 0; kx < 3; ++kx) {
        const float* row = columns + ((c * 3 + ky) * 3 + kx) * height * width;
        for (std::size_t y = 0; y < height; ++y) {
          const std::ptrdiff_t iy = static_cast<std::ptrdiff_t>(y + ky) - 1;
          if (iy < 0 || iy >= static_cast<std::ptrdiff_t>(height)) continue;
          const float* in = row + y * width;
          float* out = image + (c * height + static_cast<std::size_t>(iy)) * width;
          for (std::size_t x = 0; x < width; ++x) {
            const std::ptrdiff_t ix = static_cast<std::ptrdiff_t>(x + kx) - 1;
            if (ix >= 0 && ix < static_cast<std::ptrdiff_t>(width)) out[ix] += in[x];
          }
        }
      }
}

}  // namespace

ConvStack::ConvStack(std::size_t channels, std::size_t height, std::size_t width, const std::vector<LayerSpec>& layers,
                     std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  for (const LayerSpec& spec : layers) {
    ConvLayer layer{.in_channels = channels, .out_channels = spec.channels, .height = height, .width = width,
                    .pool = spec.pool};
    if (spec.channels == 0) throw std::invalid_argument("a convolution needs at least one output channel");
    if (spec.pool && (height % 2 || width % 2))
      throw std::invalid_argument("2x2 pooling needs even sides; this layer's input is " + std::to_string(height) +
                                  "x" + std::to_string(width));
    std::normal_distribution<float> normal(0.0f, std::sqrt(2.0f / static_cast<float>(channels * taps)));
    layer.w.resize(spec.channels * channels * taps);
    for (float& v : layer.w) v = normal(gen);
    layer.b.assign(spec.channels, 0.0f);
    layer.gw.assign(layer.w.size(), 0.0f);
    layer.gb.assign(layer.b.size(), 0.0f);
    layer.vw.assign(layer.w.size(), 0.0f);
    layer.vb.assign(layer.b.size(), 0.0f);
    channels = spec.channels;
    if (spec.pool) height /= 2, width /= 2;
    layers_.push_back(std::move(layer));
  }
  if (layers_.empty()) throw std::invalid_argument("a convolution stack needs at least one layer");
  relu_.resize(layers_.size());
  pooled_.resize(layers_.size());
  argmax_.resize(layers_.size());
  d_outputs_.resize(layers_.size());
}

std::size_t ConvStack::inputs() const noexcept {
  const ConvLayer& first = layers_.front();
  return first.in_channels * first.height * first.width;
}

std::size_t ConvStack::features() const noexcept { return layers_.back().outputs(); }

std::size_t ConvStack::parameters() const noexcept {
  std::size_t n = 0;
  for (const ConvLayer& l : layers_) n += l.w.size() + l.b.size();
  return n;
}

void ConvStack::reserve(std::size_t batch) {
  if (batch <= reserved_batch_) return;
  std::size_t largest_columns = 0, largest_map = 0;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const ConvLayer& L = layers_[l];
    const std::size_t map = L.out_channels * L.height * L.width;
    relu_[l].resize(batch * map);
    if (L.pool) {
      pooled_[l].resize(batch * L.outputs());
      argmax_[l].resize(batch * L.outputs());
    }
    if (l + 1 < layers_.size()) d_outputs_[l].resize(batch * L.outputs());
    largest_columns = std::max(largest_columns, L.in_channels * taps * L.height * L.width);
    largest_map = std::max(largest_map, map);
  }
  columns_.resize(largest_columns);
  d_columns_.resize(largest_columns);
  d_relu_.resize(largest_map);
  reserved_batch_ = batch;
}

const float* ConvStack::output(std::size_t l) const noexcept {
  return layers_[l].pool ? pooled_[l].data() : relu_[l].data();
}

const float* ConvStack::forward(const float* x, std::size_t batch) {
  reserve(batch);
  input_ = x;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const ConvLayer& L = layers_[l];
    const std::size_t pixels = L.height * L.width, in_size = L.in_channels * pixels;
    const std::size_t map = L.out_channels * pixels;
    const auto rows = static_cast<Eigen::Index>(L.in_channels * taps), cols = static_cast<Eigen::Index>(pixels);
    const auto out = static_cast<Eigen::Index>(L.out_channels);
    const ConstMap weights(L.w.data(), out, rows);
    const float* input = l == 0 ? x : output(l - 1);
    for (std::size_t s = 0; s < batch; ++s) {
      im2col(input + s * in_size, L.in_channels, L.height, L.width, columns_.data());
      Map y(relu_[l].data() + s * map, out, cols);
      y.noalias() = weights * ConstMap(columns_.data(), rows, cols);
      y.colwise() += ConstColumnMap(L.b.data(), out);
      y = y.cwiseMax(0.0f);
    }
    if (!L.pool) continue;
    const std::size_t h = L.height / 2, w = L.width / 2;
    for (std::size_t s = 0; s < batch; ++s)
      for (std::size_t c = 0; c < L.out_channels; ++c) {
        const std::size_t plane = (s * L.out_channels + c) * pixels;
        for (std::size_t y = 0; y < h; ++y)
          for (std::size_t x = 0; x < w; ++x) {
            std::size_t best = plane + 2 * y * L.width + 2 * x;
            for (const std::size_t at : {best + 1, best + L.width, best + L.width + 1})
              if (relu_[l][at] > relu_[l][best]) best = at;
            const std::size_t o = (s * L.out_channels + c) * h * w + y * w + x;
            pooled_[l][o] = relu_[l][best];
            argmax_[l][o] = static_cast<std::uint32_t>(best);
          }
      }
  }
  return output(layers_.size() - 1);
}

// d(pre-activation) from d(output) (through the pooling's maxima and the ReLU), then per sample
// dW += d im2col^T and db += its row sums, and, below the first layer, d(input) = col2im(W^T d).
void ConvStack::backward_layer(std::size_t l, const float* d_output, std::size_t batch) {
  ConvLayer& L = layers_[l];
  const std::size_t pixels = L.height * L.width, in_size = L.in_channels * pixels;
  const std::size_t map = L.out_channels * pixels;
  const auto rows = static_cast<Eigen::Index>(L.in_channels * taps), cols = static_cast<Eigen::Index>(pixels);
  const auto out = static_cast<Eigen::Index>(L.out_channels);
  const ConstMap weights(L.w.data(), out, rows);
  Map gw(L.gw.data(), out, rows);
  ColumnMap gb(L.gb.data(), out);
  gw.setZero();
  gb.setZero();
  const float* input = l == 0 ? input_ : output(l - 1);
  float* d_input = l == 0 ? nullptr : d_outputs_[l - 1].data();
  if (d_input) std::fill_n(d_input, batch * in_size, 0.0f);
  for (std::size_t s = 0; s < batch; ++s) {
    const float* relu = relu_[l].data() + s * map;
    if (L.pool) {
      std::fill_n(d_relu_.data(), map, 0.0f);
      const std::size_t outputs = L.outputs();
      for (std::size_t o = 0; o < outputs; ++o)
        d_relu_[argmax_[l][s * outputs + o] - s * map] += d_output[s * outputs + o];
    } else {
      std::copy_n(d_output + s * map, map, d_relu_.data());
    }
    for (std::size_t k = 0; k < map; ++k)
      if (relu[k] <= 0.0f) d_relu_[k] = 0.0f;
    const ConstMap delta(d_relu_.data(), out, cols);
    im2col(input + s * in_size, L.in_channels, L.height, L.width, columns_.data());
    gw.noalias() += delta * ConstMap(columns_.data(), rows, cols).transpose();
    gb += delta.rowwise().sum();
    if (!d_input) continue;
    Map(d_columns_.data(), rows, cols).noalias() = weights.transpose() * delta;
    col2im_add(d_columns_.data(), L.in_channels, L.height, L.width, d_input + s * in_size);
  }
}

void ConvStack::sgd_step(float learning_rate, float momentum) {
  for (ConvLayer& L : layers_) {
    fmnist::sgd(L.w, L.vw, L.gw, learning_rate, momentum);
    fmnist::sgd(L.b, L.vb, L.gb, learning_rate, momentum);
  }
}

}  // namespace hybrid
