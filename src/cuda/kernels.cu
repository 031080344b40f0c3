// The codecs' CUDA kernels. Every per-element step calls the same host/device function as the
// CPU codec (compression/quantize.hpp, numeric.hpp, format.hpp), and every reduction (OneBit's
// mean magnitude, TernGrad's largest magnitude) is defined so that its result does not depend on
// the order the device runs in: the encodings match the CPU's byte for byte (tests/test_cuda.cpp).
// Only headers free of fmt and the rest of the host library are included here.

#include <cuda_runtime.h>

#include <cstdint>

#include "gradsync/compression/format.hpp"
#include "gradsync/compression/quantize.hpp"
#include "gradsync/numeric.hpp"
#include "kernels.hpp"

// Equality with the CPU needs IEEE division and denormals (nvcc's defaults).
#if defined(__USE_FAST_MATH__) || (defined(__CUDA_FTZ) && __CUDA_FTZ) || (defined(__CUDA_PREC_DIV) && !__CUDA_PREC_DIV)
#error "gradsync's kernels must match the CPU bit for bit: build them without --use_fast_math, -ftz=true or -prec-div=false"
#endif

namespace gradsync::cuda::kernels {

namespace {

namespace q = compression::quantize;

constexpr unsigned threads = 256;
unsigned blocks_for(std::size_t n) { return static_cast<unsigned>(n == 0 ? 1 : (n + threads - 1) / threads); }
cudaStream_t native(void* stream) { return static_cast<cudaStream_t>(stream); }
int launched() { return static_cast<int>(cudaGetLastError()); }
__device__ std::size_t thread_index() { return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; }

__device__ void write_header(std::byte* out, std::uint64_t header) {
  for (int b = 0; b < 8; ++b) out[b] = static_cast<std::byte>(header >> (8 * b));
}

// --- 16-bit floats ---

struct F16 {
  __device__ static std::uint16_t encode(float v) { return numeric::f16_bits(v); }
  __device__ static float decode(std::uint16_t b) { return numeric::from_f16_bits(b); }
};
struct BF16 {
  __device__ static std::uint16_t encode(float v) { return numeric::bf16_bits(v); }
  __device__ static float decode(std::uint16_t b) { return numeric::from_bf16_bits(b); }
};

template <class Format>
__global__ void encode_16(const float* in, std::size_t n, std::uint16_t* out) {
  const std::size_t i = thread_index();
  if (i < n) out[i] = Format::encode(in[i]);
}

template <class Format>
__global__ void decode_16(const std::uint16_t* in, std::size_t n, float* out, bool add) {
  const std::size_t i = thread_index();
  if (i < n) out[i] = add ? numeric::add_rn(out[i], Format::decode(in[i])) : Format::decode(in[i]);
}

// --- packed codes: the code of a value, built from the run's parameter once it is known ---

struct TwoBitCode {
  float threshold;
  __device__ std::uint32_t operator()(float v, std::size_t) const { return q::two_bit_code(v, threshold); }
};
struct MakeTwoBitCode {
  __device__ TwoBitCode operator()(float threshold) const { return {threshold}; }
};
struct SignCode {
  __device__ std::uint32_t operator()(float v, std::size_t) const { return q::sign_bit(v); }
};
struct MakeSignCode {
  __device__ SignCode operator()(float) const { return {}; }
};
template <unsigned Bits>
struct TernaryCode {
  float inv_step;
  std::uint64_t key;
  __device__ std::uint32_t operator()(float v, std::size_t i) const {
    return q::ternary_code(v, inv_step, q::uniform(key, i), (1u << (Bits - 1)) - 1u, Bits - 1);
  }
};
template <unsigned Bits>
struct MakeTernaryCode {
  std::uint64_t key;
  __device__ TernaryCode<Bits> operator()(float scale) const {
    return {q::ternary_inverse_step(scale, (1u << (Bits - 1)) - 1u), key};
  }
};

// The decoded value of a code, given the run's parameter.
struct TwoBitValue {
  __device__ float operator()(std::uint32_t code, float threshold) const { return q::two_bit_value(code, threshold); }
};
struct SignValue {
  __device__ float operator()(std::uint32_t bit, float scale) const { return q::sign_value(bit, scale); }
};
template <unsigned Bits>
struct TernaryValue {
  __device__ float operator()(std::uint32_t code, float scale) const {
    return q::ternary_value(code, q::ternary_step(scale, (1u << (Bits - 1)) - 1u), Bits - 1);
  }
};

// Layout (packed.hpp): header, one f32 parameter, code words. One word a thread; the parameter is
// *device_parameter where the run computed it on the device, else host_parameter.
template <unsigned Bits, class MakeCode>
__global__ void pack(const float* in, std::size_t n, std::byte* out, std::uint64_t header,
                     const float* device_parameter, float host_parameter, MakeCode make_code) {
  using Codes = compression::PackedCodes<Bits>;
  const float parameter = device_parameter ? *device_parameter : host_parameter;
  const std::size_t w = thread_index();
  if (w == 0) {
    write_header(out, header);
    *reinterpret_cast<float*>(out + compression::header_bytes) = parameter;
  }
  if (w < Codes::words(n))
    reinterpret_cast<std::uint32_t*>(out + compression::header_bytes + 4)[w] =
        Codes::pack_word(in, n, w, make_code(parameter));
}

template <unsigned Bits, class Value>
__global__ void unpack(const std::byte* in, std::size_t n, float* out, bool add, Value value) {
  using Codes = compression::PackedCodes<Bits>;
  const std::size_t i = thread_index();
  if (i >= n) return;
  const float parameter = *reinterpret_cast<const float*>(in + compression::header_bytes);
  const auto* words = reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes + 4);
  const float v = value(Codes::code_at(words, i), parameter);
  out[i] = add ? numeric::add_rn(out[i], v) : v;
}

template <unsigned Bits, class MakeCode>
int pack_on(const float* in, std::size_t n, std::byte* out, std::uint64_t header, const float* device_parameter,
            float host_parameter, MakeCode make_code, void* stream) {
  pack<Bits><<<blocks_for(compression::PackedCodes<Bits>::words(n)), threads, 0, native(stream)>>>(
      in, n, out, header, device_parameter, host_parameter, make_code);
  return launched();
}

template <unsigned Bits, class Value>
int unpack_on(const std::byte* in, std::size_t n, float* out, bool add, Value value, void* stream) {
  if (n == 0) return 0;
  unpack<Bits><<<blocks_for(n), threads, 0, native(stream)>>>(in, n, out, add, value);
  return launched();
}

// --- reductions ---

// OneBit's mean magnitude in quantize::magnitude_sum's tree: leaves of 256 values, then levels of
// 256 partial sums, each group summed in order by one thread.
__global__ void leaf_sums(const float* in, std::size_t n, double* sums, std::size_t leaves) {
  const std::size_t j = thread_index();
  if (j >= leaves) return;
  const std::size_t begin = j * q::sum_fan_in;
  sums[j] = q::leaf_magnitude_sum(in + begin, n - begin < q::sum_fan_in ? n - begin : q::sum_fan_in);
}

__global__ void group_sums(const double* in, std::size_t count, double* out, std::size_t groups) {
  const std::size_t g = thread_index();
  if (g >= groups) return;
  const std::size_t begin = g * q::sum_fan_in;
  const std::size_t end = count - begin < q::sum_fan_in ? count : begin + q::sum_fan_in;
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) sum += in[i];
  out[g] = sum;
}

__global__ void mean_of(const double* sum, std::size_t n, float* mean) {
  *mean = static_cast<float>(*sum / static_cast<double>(n));
}

// TernGrad's largest magnitude: the bits of a non-negative float order like the float, so an
// integer maximum over them is the float maximum in any order. NaN is skipped, as std::max skips
// it on the CPU.
__global__ void largest_magnitude(const float* in, std::size_t n, unsigned* result) {
  __shared__ unsigned block_max[threads];
  const std::size_t i = thread_index();
  unsigned bits = 0;
  if (i < n) {
    const float m = fabsf(in[i]);
    bits = m == m ? numeric::bits_of(m) : 0u;
  }
  block_max[threadIdx.x] = bits;
  __syncthreads();
  for (unsigned stride = threads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) block_max[threadIdx.x] = max(block_max[threadIdx.x], block_max[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicMax(result, block_max[0]);
}

// --- RandomK (layout: header, u64 stream key, k f32 values) ---

__global__ void gather_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                                std::uint64_t header) {
  const std::size_t j = thread_index();
  if (j == 0) {
    write_header(out, header);
    *reinterpret_cast<std::uint64_t*>(out + compression::header_bytes) = key;
  }
  if (j < k) reinterpret_cast<float*>(out + compression::header_bytes + 8)[j] = in[q::stratum_index(key, j, n, k)];
}

__global__ void scatter_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out) {
  const std::size_t j = thread_index();
  if (j >= k) return;
  const std::uint64_t key = *reinterpret_cast<const std::uint64_t*>(in + compression::header_bytes);
  const std::size_t i = q::stratum_index(key, j, n, k);  // strata: no two j share an i
  out[i] = numeric::add_rn(out[i], reinterpret_cast<const float*>(in + compression::header_bytes + 8)[j]);
}

// --- element-wise ---

__global__ void accumulate_kernel(float* residual, const float* in, std::size_t n) {
  const std::size_t i = thread_index();
  if (i < n) residual[i] = numeric::add_rn(residual[i], in[i]);
}

__global__ void negate_kernel(float* values, std::size_t n) {
  const std::size_t i = thread_index();
  if (i < n) values[i] = -values[i];
}

}  // namespace

int encode_f16(const float* in, std::size_t n, std::uint16_t* out, void* stream) {
  if (n == 0) return 0;
  encode_16<F16><<<blocks_for(n), threads, 0, native(stream)>>>(in, n, out);
  return launched();
}
int encode_bf16(const float* in, std::size_t n, std::uint16_t* out, void* stream) {
  if (n == 0) return 0;
  encode_16<BF16><<<blocks_for(n), threads, 0, native(stream)>>>(in, n, out);
  return launched();
}
int decode_f16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream) {
  if (n == 0) return 0;
  decode_16<F16><<<blocks_for(n), threads, 0, native(stream)>>>(in, n, out, add);
  return launched();
}
int decode_bf16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream) {
  if (n == 0) return 0;
  decode_16<BF16><<<blocks_for(n), threads, 0, native(stream)>>>(in, n, out, add);
  return launched();
}

int encode_two_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, float threshold, void* stream) {
  return pack_on<2>(in, n, out, header, nullptr, threshold, MakeTwoBitCode{}, stream);
}

std::size_t sum_tree_size(std::size_t n) {
  std::size_t total = 0;
  for (std::size_t count = n; count > 1;) {
    count = (count + q::sum_fan_in - 1) / q::sum_fan_in;
    total += count;
  }
  return total + 1;
}

int encode_one_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, double* sums, float* scale,
                   void* stream) {
  if (n == 0) return pack_on<1>(in, n, out, header, nullptr, 0.0f, MakeSignCode{}, stream);
  // Level by level: leaves, then groups of 256 of the level before, until one sum is left.
  double* level = sums;
  std::size_t count = (n + q::sum_fan_in - 1) / q::sum_fan_in;
  leaf_sums<<<blocks_for(count), threads, 0, native(stream)>>>(in, n, level, count);
  while (count > 1) {
    const std::size_t groups = (count + q::sum_fan_in - 1) / q::sum_fan_in;
    group_sums<<<blocks_for(groups), threads, 0, native(stream)>>>(level, count, level + count, groups);
    level += count;
    count = groups;
  }
  mean_of<<<1, 1, 0, native(stream)>>>(level, n, scale);
  if (const int status = launched()) return status;
  return pack_on<1>(in, n, out, header, scale, 0.0f, MakeSignCode{}, stream);
}

int encode_terngrad(unsigned bits, const float* in, std::size_t n, std::byte* out, std::uint64_t header,
                    std::uint64_t key, float* scale, void* stream) {
  if (const auto status = cudaMemsetAsync(scale, 0, sizeof(float), native(stream))) return static_cast<int>(status);
  if (n > 0) largest_magnitude<<<blocks_for(n), threads, 0, native(stream)>>>(in, n, reinterpret_cast<unsigned*>(scale));
  if (const int status = launched()) return status;
  switch (bits) {
    case 2: return pack_on<2>(in, n, out, header, scale, 0.0f, MakeTernaryCode<2>{key}, stream);
    case 4: return pack_on<4>(in, n, out, header, scale, 0.0f, MakeTernaryCode<4>{key}, stream);
    default: return pack_on<8>(in, n, out, header, scale, 0.0f, MakeTernaryCode<8>{key}, stream);
  }
}

int decode_two_bit(const std::byte* in, std::size_t n, float* out, bool add, void* stream) {
  return unpack_on<2>(in, n, out, add, TwoBitValue{}, stream);
}
int decode_one_bit(const std::byte* in, std::size_t n, float* out, bool add, void* stream) {
  return unpack_on<1>(in, n, out, add, SignValue{}, stream);
}
int decode_terngrad(unsigned bits, const std::byte* in, std::size_t n, float* out, bool add, void* stream) {
  switch (bits) {
    case 2: return unpack_on<2>(in, n, out, add, TernaryValue<2>{}, stream);
    case 4: return unpack_on<4>(in, n, out, add, TernaryValue<4>{}, stream);
    default: return unpack_on<8>(in, n, out, add, TernaryValue<8>{}, stream);
  }
}

int encode_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                    std::uint64_t header, void* stream) {
  gather_random_k<<<blocks_for(k), threads, 0, native(stream)>>>(in, n, k, key, out, header);
  return launched();
}

int decode_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, void* stream) {
  if (!add && n > 0)
    if (const auto status = cudaMemsetAsync(out, 0, n * sizeof(float), native(stream))) return static_cast<int>(status);
  if (k == 0) return 0;
  scatter_random_k<<<blocks_for(k), threads, 0, native(stream)>>>(in, n, k, out);
  return launched();
}

int accumulate(float* residual, const float* in, std::size_t n, void* stream) {
  if (n == 0) return 0;
  accumulate_kernel<<<blocks_for(n), threads, 0, native(stream)>>>(residual, in, n);
  return launched();
}

int negate(float* values, std::size_t n, void* stream) {
  if (n == 0) return 0;
  negate_kernel<<<blocks_for(n), threads, 0, native(stream)>>>(values, n);
  return launched();
}

}  // namespace gradsync::cuda::kernels
