#pragma once
// The model's per-element and per-sample math, shared by the CPU model (mlp.cpp) and the GPU one
// (device_mlp.cu) so that both train the same network: the GPU's kernels call these functions on
// each element or sample, the CPU's loops call them on all. The matrix products are the only
// part each side does its own way (Eigen, cuBLAS).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "gradsync/numeric.hpp"  // GRADSYNC_HD: __host__ __device__ under nvcc

namespace fmnist::elementwise {

GRADSYNC_HD float relu(float x) { return x > 0.0f ? x : 0.0f; }

// d(loss)/d(pre-activation) of a hidden layer: the gradient from above where the ReLU passed
// its input (its output is positive), zero where it was flat.
GRADSYNC_HD float relu_backward(float gradient, float output) { return output > 0.0f ? gradient : 0.0f; }

// SGD with momentum on one value: velocity = momentum * velocity + gradient, then
// parameter -= learning_rate * velocity.
GRADSYNC_HD void sgd(float& parameter, float& velocity, float gradient, float learning_rate, float momentum) {
  velocity = momentum * velocity + gradient;
  parameter -= learning_rate * velocity;
}

// One sample's softmax cross-entropy: from its `classes` logits `z` writes d(mean loss)/d(z) into
// `d` (the softmax minus the label's one-hot, over the batch's `batch` samples) and returns the
// sample's loss, -log p(label).
GRADSYNC_HD float softmax_cross_entropy(const float* z, float* d, std::size_t classes, std::uint8_t label,
                                        std::size_t batch) {
  float top = z[0];
  for (std::size_t o = 1; o < classes; ++o) top = z[o] > top ? z[o] : top;
  float sum = 0;
  for (std::size_t o = 0; o < classes; ++o) sum += d[o] = expf(z[o] - top);
  for (std::size_t o = 0; o < classes; ++o) d[o] /= sum;
  const float p = d[label] > 1e-30f ? d[label] : 1e-30f;
  d[label] -= 1.0f;
  for (std::size_t o = 0; o < classes; ++o) d[o] /= static_cast<float>(batch);
  return -logf(p);
}

}  // namespace fmnist::elementwise
