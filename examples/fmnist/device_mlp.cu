#include "device_mlp.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "elementwise.hpp"

namespace fmnist {

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("fmnist --device cuda: ") + what + ": " + cudaGetErrorString(status));
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("fmnist --device cuda: ") + what + ": cuBLAS status " +
                             std::to_string(static_cast<int>(status)));
}

// A kernel's launch error (a bad configuration) at once; faults inside it surface at the next
// synchronizing call, which checks too.
void check_launch(const char* what) { check(cudaGetLastError(), what); }

constexpr unsigned block = 256;
unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + block - 1) / block); }

// Y += b on every row, then the ReLU where `relu`.
__global__ void add_bias(float* y, const float* b, std::size_t rows, std::size_t columns, bool relu) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * columns) return;
  const float v = y[i] + b[i % columns];
  y[i] = relu ? elementwise::relu(v) : v;
}

__global__ void softmax_cross_entropy(const float* logits, float* delta, float* losses, const std::uint8_t* labels,
                                      std::size_t batch, std::size_t classes) {
  const std::size_t s = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (s >= batch) return;
  losses[s] = elementwise::softmax_cross_entropy(logits + s * classes, delta + s * classes, classes, labels[s], batch);
}

// db = D's column sums, each summed over the rows in order (one thread a column).
__global__ void column_sums(const float* d, float* sums, std::size_t rows, std::size_t columns) {
  const std::size_t c = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (c >= columns) return;
  float sum = 0;
  for (std::size_t r = 0; r < rows; ++r) sum += d[r * columns + c];
  sums[c] = sum;
}

__global__ void relu_backward(float* gradient, const float* output, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) gradient[i] = elementwise::relu_backward(gradient[i], output[i]);
}

__global__ void sgd(float* parameters, float* velocity, const float* gradient, std::size_t n, float learning_rate,
                    float momentum) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) elementwise::sgd(parameters[i], velocity[i], gradient[i], learning_rate, momentum);
}

cublasHandle_t blas(void* handle) { return static_cast<cublasHandle_t>(handle); }

}  // namespace

// cuBLAS is column-major; the model's matrices are row-major (a sample, or a weight row, is one
// row), which cuBLAS reads as their transposes. Each product below is written for those
// transposes: Y = X W is Y^T = W^T X^T, and so on.

DeviceMlp::DeviceMlp(const Mlp& initial, int device) : device_(device) {
  check(cudaSetDevice(device_), "cudaSetDevice");
  cublasHandle_t handle = nullptr;
  check(cublasCreate(&handle), "cublasCreate");
  blas_ = handle;
  // Plain f32 products: no TF32 on the tensor cores, so the GPU computes what the CPU does.
  check(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  for (const fmnist::Layer& h : initial.layers()) {
    Layer L{.in = h.in, .out = h.out};
    float** tensors[] = {&L.w, &L.gw, &L.vw};
    for (float** t : tensors) *t = allocate(h.w.size());
    float** vectors[] = {&L.b, &L.gb, &L.vb};
    for (float** t : vectors) *t = allocate(h.b.size());
    check(cudaMemcpy(L.w, h.w.data(), h.w.size() * sizeof(float), cudaMemcpyHostToDevice), "weights in");
    check(cudaMemcpy(L.b, h.b.data(), h.b.size() * sizeof(float), cudaMemcpyHostToDevice), "biases in");
    check(cudaMemset(L.vw, 0, h.w.size() * sizeof(float)), "momentum");
    check(cudaMemset(L.vb, 0, h.b.size() * sizeof(float)), "momentum");
    check(cudaMemset(L.gw, 0, h.w.size() * sizeof(float)), "gradients");
    check(cudaMemset(L.gb, 0, h.b.size() * sizeof(float)), "gradients");
    layers_.push_back(L);
  }
  activations_.resize(layers_.size());
  deltas_.resize(layers_.size());
}

DeviceMlp::~DeviceMlp() {
  cudaDeviceSynchronize();  // nothing queued may outlive its buffers
  for (void* p : allocations_) cudaFree(p);
  if (blas_) cublasDestroy(blas(blas_));
}

float* DeviceMlp::allocate(std::size_t values) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(values, 1) * sizeof(float)), "cudaMalloc");
  allocations_.push_back(p);
  return static_cast<float*>(p);
}

std::size_t DeviceMlp::parameters() const noexcept {
  std::size_t n = 0;
  for (const Layer& L : layers_) n += L.in * L.out + L.out;
  return n;
}

gradsync::TensorView DeviceMlp::weight_gradient(std::size_t l) const {
  const Layer& L = layers_.at(l);
  return gradsync::view(std::span<float>(L.gw, L.in * L.out), gradsync::Device::cuda(device_));
}

gradsync::TensorView DeviceMlp::bias_gradient(std::size_t l) const {
  const Layer& L = layers_.at(l);
  return gradsync::view(std::span<float>(L.gb, L.out), gradsync::Device::cuda(device_));
}

// The per-batch buffers, for up to `batch` samples: allocated for the largest batch seen (the
// training batch, then correct()'s chunks) and kept.
void DeviceMlp::reserve(std::size_t batch) {
  if (batch <= reserved_batch_) return;
  check(cudaDeviceSynchronize(), "before growing the batch buffers");
  input_ = allocate(batch * layers_.front().in);
  void* labels = nullptr;
  check(cudaMalloc(&labels, batch), "cudaMalloc");
  allocations_.push_back(labels);
  labels_ = static_cast<std::uint8_t*>(labels);
  losses_ = allocate(batch);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    activations_[l] = allocate(batch * layers_[l].out);
    deltas_[l] = allocate(batch * layers_[l].out);
  }
  reserved_batch_ = batch;
}

// Y = X W + b, then ReLU on every layer but the last.
void DeviceMlp::forward(std::size_t batch) {
  const float one = 1, zero = 0;
  const float* input = input_;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    check(cublasSgemm(blas(blas_), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(L.out), static_cast<int>(batch),
                      static_cast<int>(L.in), &one, L.w, static_cast<int>(L.out), input, static_cast<int>(L.in), &zero,
                      activations_[l], static_cast<int>(L.out)),
          "forward product");
    add_bias<<<blocks(batch * L.out), block>>>(activations_[l], L.b, batch, L.out, l + 1 < layers_.size());
    check_launch("add_bias");
    input = activations_[l];
  }
}

void DeviceMlp::forward_loss(const float* x, const std::uint8_t* labels, std::size_t batch) {
  reserve(batch);
  check(cudaMemcpy(input_, x, batch * layers_.front().in * sizeof(float), cudaMemcpyHostToDevice), "batch in");
  check(cudaMemcpy(labels_, labels, batch, cudaMemcpyHostToDevice), "labels in");
  forward(batch);
  const Layer& last = layers_.back();
  softmax_cross_entropy<<<blocks(batch), block>>>(activations_.back(), deltas_.back(), losses_, labels_, batch,
                                                  last.out);
  check_launch("softmax_cross_entropy");
}

// dW = X^T D, db = the column sums of D.
void DeviceMlp::gradients(std::size_t l, std::size_t batch) {
  const Layer& L = layers_[l];
  const float one = 1, zero = 0;
  const float* input = l == 0 ? input_ : activations_[l - 1];
  const auto in = static_cast<int>(L.in), out = static_cast<int>(L.out), rows = static_cast<int>(batch);
  check(cublasSgemm(blas(blas_), CUBLAS_OP_N, CUBLAS_OP_T, out, in, rows, &one, deltas_[l], out, input, in, &zero,
                    L.gw, out),
        "weight gradient product");
  column_sums<<<blocks(L.out), block>>>(deltas_[l], L.gb, batch, L.out);
  check_launch("column_sums");
}

// D W^T into the layer below's deltas, zeroed where its ReLU was flat (nothing below layer 0).
// Reads the weights and deltas only, not the gradients the exchange may be averaging in place.
void DeviceMlp::propagate(std::size_t l, std::size_t batch) {
  if (l == 0) return;
  const Layer& L = layers_[l];
  const float one = 1, zero = 0;
  const auto in = static_cast<int>(L.in), out = static_cast<int>(L.out), rows = static_cast<int>(batch);
  check(cublasSgemm(blas(blas_), CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, &one, L.w, out, deltas_[l], out, &zero,
                    deltas_[l - 1], in),
        "input gradient product");
  relu_backward<<<blocks(batch * L.in), block>>>(deltas_[l - 1], activations_[l - 1], batch * L.in);
  check_launch("relu_backward");
}

float DeviceMlp::mean_loss(std::size_t batch) {
  host_losses_.resize(batch);
  check(cudaMemcpy(host_losses_.data(), losses_, batch * sizeof(float), cudaMemcpyDeviceToHost), "losses out");
  double loss = 0;
  for (float v : host_losses_) loss += v;
  return static_cast<float>(loss / static_cast<double>(batch));
}

void DeviceMlp::sgd_step(float learning_rate, float momentum) {
  for (Layer& L : layers_) {
    sgd<<<blocks(L.in * L.out), block>>>(L.w, L.vw, L.gw, L.in * L.out, learning_rate, momentum);
    sgd<<<blocks(L.out), block>>>(L.b, L.vb, L.gb, L.out, learning_rate, momentum);
  }
  check_launch("sgd");
}

std::size_t DeviceMlp::correct(const float* x, const std::uint8_t* labels, std::size_t n) {
  constexpr std::size_t chunk = 256;
  const std::size_t inputs = layers_.front().in, classes = layers_.back().out;
  reserve(std::min(chunk, n));
  host_logits_.resize(chunk * classes);
  std::size_t right = 0;
  for (std::size_t start = 0; start < n; start += chunk) {
    const std::size_t count = std::min(chunk, n - start);
    check(cudaMemcpy(input_, x + start * inputs, count * inputs * sizeof(float), cudaMemcpyHostToDevice), "test in");
    forward(count);
    check(cudaMemcpy(host_logits_.data(), activations_.back(), count * classes * sizeof(float),
                     cudaMemcpyDeviceToHost),
          "logits out");
    for (std::size_t s = 0; s < count; ++s) {
      const float* z = host_logits_.data() + s * classes;
      right += static_cast<std::size_t>(std::max_element(z, z + classes) - z) == labels[start + s];
    }
  }
  return right;
}

void DeviceMlp::copy_parameters_to(Mlp& host) const {
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    Layer const& L = layers_[l];
    fmnist::Layer& h = host.layers().at(l);
    check(cudaMemcpy(h.w.data(), L.w, h.w.size() * sizeof(float), cudaMemcpyDeviceToHost), "weights out");
    check(cudaMemcpy(h.b.data(), L.b, h.b.size() * sizeof(float), cudaMemcpyDeviceToHost), "biases out");
  }
}

}  // namespace fmnist
