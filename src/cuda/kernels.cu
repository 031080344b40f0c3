// The codecs' CUDA kernels. Every per-element step calls the same host/device function as the
// CPU codec (compression/quantize.hpp, numeric.hpp, format.hpp), and every reduction (OneBit's
// mean magnitude, TernGrad's largest magnitude) is defined so that its result does not depend on
// the order the device runs in: the encodings match the CPU's byte for byte (tests/test_cuda.cpp).
// Only headers free of fmt and the rest of the host library are included here.

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
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

// The element-wise kernels take four values a thread, as one 16-byte access where the buffers'
// alignment allows it: one value a thread left H200 at 0.67-0.72 of a device copy's bandwidth.
constexpr unsigned per_thread = 4;
unsigned blocks_for_quads(std::size_t n) { return blocks_for((n + per_thread - 1) / per_thread); }
bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

__device__ void write_header(std::byte* out, std::uint64_t header) {
  for (int b = 0; b < 8; ++b) out[b] = static_cast<std::byte>(header >> (8 * b));
}

// Four decoded values into their place, added to what is there or over it.
__device__ void land_quad(float4& out, float4 v, bool add) {
  if (add) {
    const float4 old = out;
    v = make_float4(numeric::add_rn(old.x, v.x), numeric::add_rn(old.y, v.y), numeric::add_rn(old.z, v.z),
                    numeric::add_rn(old.w, v.w));
  }
  out = v;
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

// `vector`: in is 16-byte and out 8-byte aligned, so whole quads move as float4 and ushort4.
template <class Format>
__global__ void encode_16(const float* in, std::size_t n, std::uint16_t* out, bool vector) {
  const std::size_t q = thread_index(), first = q * per_thread;
  if (first >= n) return;
  if (vector && first + per_thread <= n) {
    const float4 v = reinterpret_cast<const float4*>(in)[q];
    reinterpret_cast<ushort4*>(out)[q] =
        make_ushort4(Format::encode(v.x), Format::encode(v.y), Format::encode(v.z), Format::encode(v.w));
    return;
  }
  for (std::size_t i = first; i < n && i < first + per_thread; ++i) out[i] = Format::encode(in[i]);
}

// `vector`: in is 8-byte and out 16-byte aligned.
template <class Format>
__global__ void decode_16(const std::uint16_t* in, std::size_t n, float* out, bool add, bool vector) {
  const std::size_t q = thread_index(), first = q * per_thread;
  if (first >= n) return;
  if (vector && first + per_thread <= n) {
    const ushort4 c = reinterpret_cast<const ushort4*>(in)[q];
    land_quad(reinterpret_cast<float4*>(out)[q],
              make_float4(Format::decode(c.x), Format::decode(c.y), Format::decode(c.z), Format::decode(c.w)), add);
    return;
  }
  for (std::size_t i = first; i < n && i < first + per_thread; ++i)
    out[i] = add ? numeric::add_rn(out[i], Format::decode(in[i])) : Format::decode(in[i]);
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

// What pack() codes, four values at a time (`whole`: all four exist and the buffers are 16-byte
// aligned, so they move as one float4): the input as it is...
struct PlainValues {
  const float* in;
  bool aligned() const { return cuda::kernels::aligned(in, 16); }
  __device__ void load(std::size_t first, std::size_t n, bool whole, float (&p)[per_thread]) const {
    if (whole) {
      const float4 v = reinterpret_cast<const float4*>(in)[first / per_thread];
      p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
    } else {
      for (unsigned j = 0; j < per_thread && first + j < n; ++j) p[j] = in[first + j];
    }
  }
  __device__ void keep(std::size_t, std::size_t, bool, const float (&)[per_thread], const std::uint32_t (&)[per_thread],
                       float) const {}
};

// ...or fused with error feedback, Packed::encode_keeping_error's steps: p = residual + in (the
// residual alone where in is null: the caller already added), and residual = -(-p + value(code)).
template <class Value>
struct WithFeedback {
  const float* in;
  float* residual;
  Value value;
  bool aligned() const { return cuda::kernels::aligned(residual, 16) && (!in || cuda::kernels::aligned(in, 16)); }
  __device__ void load(std::size_t first, std::size_t n, bool whole, float (&p)[per_thread]) const {
    PlainValues{residual}.load(first, n, whole, p);
    if (!in) return;
    float g[per_thread];
    PlainValues{in}.load(first, n, whole, g);
    for (unsigned j = 0; j < per_thread; ++j) p[j] = numeric::add_rn(p[j], g[j]);  // unused lanes: never stored
  }
  __device__ void keep(std::size_t first, std::size_t n, bool whole, const float (&p)[per_thread],
                       const std::uint32_t (&code)[per_thread], float parameter) const {
    float r[per_thread];
    for (unsigned j = 0; j < per_thread; ++j) r[j] = -numeric::add_rn(-p[j], value(code[j], parameter));
    if (whole) {
      reinterpret_cast<float4*>(residual)[first / per_thread] = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      for (unsigned j = 0; j < per_thread && first + j < n; ++j) residual[first + j] = r[j];
    }
  }
};

// Layout (packed.hpp): header, one f32 parameter, code words; the parameter is *device_parameter
// where the run computed it on the device, else host_parameter. Four values a thread, so loads
// and stores coalesce; the lanes of a word OR their codes together over shuffles (one word a
// thread, reading 64-128 bytes apart, ran a fused error feedback at 0.18 of a copy's bandwidth
// on H200; one value a thread cost two-bit's encode a third). Every word is the CPU's
// pack_word: the same codes at the same bits.
template <unsigned Bits, class MakeCode, class Values>
__global__ void pack(std::size_t n, std::byte* out, std::uint64_t header, const float* device_parameter,
                     float host_parameter, MakeCode make_code, Values values, bool vector) {
  using Codes = compression::PackedCodes<Bits>;
  constexpr unsigned lanes_per_word = Codes::per_word / per_thread;
  static_assert(Codes::per_word % per_thread == 0 && 32 % lanes_per_word == 0 && threads % 32 == 0);
  const float parameter = device_parameter ? *device_parameter : host_parameter;
  const std::size_t q = thread_index(), first = q * per_thread;
  if (q == 0) {
    write_header(out, header);
    *reinterpret_cast<float*>(out + compression::header_bytes) = parameter;
  }
  std::uint32_t packed = 0;
  if (first < n) {
    const bool whole = vector && first + per_thread <= n;
    float p[per_thread] = {};
    std::uint32_t code[per_thread] = {};
    values.load(first, n, whole, p);
    const auto code_of = make_code(parameter);
    for (unsigned j = 0; j < per_thread && first + j < n; ++j) {
      code[j] = code_of(p[j], first + j);
      packed |= code[j] << (Bits * j);
    }
    values.keep(first, n, whole, p, code, parameter);
    packed <<= Bits * static_cast<unsigned>(first % Codes::per_word);
  }
  for (unsigned offset = 1; offset < lanes_per_word; offset *= 2) packed |= __shfl_xor_sync(0xffffffffu, packed, offset);
  if (first % Codes::per_word == 0 && first < n)
    reinterpret_cast<std::uint32_t*>(out + compression::header_bytes + 4)[first / Codes::per_word] = packed;
}

// Four values a thread, all in one word (a word holds 32/Bits values, a multiple of four);
// `vector`: out is 16-byte aligned.
template <unsigned Bits, class Value>
__global__ void unpack(const std::byte* in, std::size_t n, float* out, bool add, bool vector, Value value,
                       std::uint64_t header, DecodeCheck* check, std::uint64_t site) {
  using Codes = compression::PackedCodes<Bits>;
  static_assert(Codes::per_word % per_thread == 0);
  const std::size_t q = thread_index(), first = q * per_thread;
  if (first >= n) return;
  // Every thread reads the same 8 bytes (one transaction a warp, then cached), so a wrong
  // encoding writes nothing and the host never waits for the header.
  const std::uint64_t found = *reinterpret_cast<const std::uint64_t*>(in);
  if (found != header) {
    if (q == 0 && check->failed == DecodeCheck::none) {  // an earlier decode's fault stays
      check->found = found;
      check->expected = header;
      check->site = site;
      __threadfence_system();
      check->failed = DecodeCheck::header;
    }
    return;
  }
  const float parameter = *reinterpret_cast<const float*>(in + compression::header_bytes);
  const std::uint32_t word =
      reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes + 4)[first / Codes::per_word];
  const unsigned shift = Bits * static_cast<unsigned>(first % Codes::per_word);
  const auto value_at = [&](unsigned j) { return value((word >> (shift + Bits * j)) & Codes::mask, parameter); };
  if (vector && first + per_thread <= n) {
    land_quad(reinterpret_cast<float4*>(out)[q], make_float4(value_at(0), value_at(1), value_at(2), value_at(3)), add);
    return;
  }
  for (unsigned j = 0; first + j < n && j < per_thread; ++j)
    out[first + j] = add ? numeric::add_rn(out[first + j], value_at(j)) : value_at(j);
}

template <unsigned Bits, class MakeCode, class Values = PlainValues>
int pack_on(std::size_t n, std::byte* out, std::uint64_t header, const float* device_parameter, float host_parameter,
            MakeCode make_code, Values values, void* stream) {
  pack<Bits><<<blocks_for_quads(n), threads, 0, native(stream)>>>(n, out, header, device_parameter, host_parameter,
                                                                   make_code, values, values.aligned());
  return launched();
}

template <unsigned Bits, class Value>
int unpack_on(const std::byte* in, std::size_t n, float* out, bool add, Value value, std::uint64_t header,
              DecodeCheck* check, std::uint64_t site, void* stream) {
  if (n == 0) return 0;
  unpack<Bits><<<blocks_for_quads(n), threads, 0, native(stream)>>>(in, n, out, add, aligned(out, 16), value, header,
                                                                     check, site);
  return launched();
}

// --- reductions ---

// OneBit's mean magnitude in quantize::magnitude_sum's tree: leaves of 256 values, then levels of
// 256 partial sums, each group summed in order by one thread.
//
// A leaf is leaf_magnitude_sum's eight accumulators, value i into accumulator i % 8, then added
// pairwise: here eight threads a leaf, thread k summing accumulator k in the same order, and the
// pairs added over shuffles. A warp's loads then cover 4 whole 32-byte sectors where one thread a
// leaf touched 32 lines a kilobyte apart (0.15 of a copy's bandwidth on H200).
constexpr unsigned leaf_lanes = 8;
static_assert(q::sum_fan_in % leaf_lanes == 0 && 32 % leaf_lanes == 0);

__global__ void leaf_sums(const float* in, std::size_t n, double* sums, std::size_t leaves) {
  const std::size_t t = thread_index(), leaf = t / leaf_lanes;
  const unsigned lane = static_cast<unsigned>(t % leaf_lanes);
  double sum = 0;
  if (leaf < leaves) {
    const std::size_t begin = leaf * q::sum_fan_in;
    const std::size_t count = n - begin < q::sum_fan_in ? n - begin : q::sum_fan_in;
    for (std::size_t i = lane; i < count; i += leaf_lanes)
      sum += static_cast<double>(numeric::float_of(numeric::bits_of(in[begin + i]) & 0x7fffffffu));
  }
  // ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), as leaf_magnitude_sum adds them; every lane of the
  // warp takes part, so each shuffle's source lane holds a value.
  for (unsigned offset = 1; offset < leaf_lanes; offset *= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (lane == 0 && leaf < leaves) sums[leaf] = sum;
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
// it on the CPU. A bounded grid striding over the values: one atomic per block of 256 values
// queued a million atomics on one word for 1 GiB.
constexpr unsigned max_blocks = 2048;

__global__ void largest_magnitude(const float* in, std::size_t n, unsigned* result) {
  __shared__ unsigned block_max[threads];
  unsigned bits = 0;
  for (std::size_t i = thread_index(); i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float m = fabsf(in[i]);
    bits = max(bits, m == m ? numeric::bits_of(m) : 0u);
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

// `residual`: error feedback (in is then the residual, p already added): a sent value leaves
// -(-p + p) behind, the CPU's encode_keeping_error step.
__global__ void gather_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                                std::uint64_t header, float* residual) {
  const std::size_t j = thread_index();
  if (j == 0) {
    write_header(out, header);
    *reinterpret_cast<std::uint64_t*>(out + compression::header_bytes) = key;
  }
  if (j >= k) return;
  const std::size_t i = q::stratum_index(key, j, n, k);
  const float p = in[i];
  reinterpret_cast<float*>(out + compression::header_bytes + 8)[j] = p;
  if (residual) residual[i] = -numeric::add_rn(-p, p);
}

__global__ void scatter_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out) {
  const std::size_t j = thread_index();
  if (j >= k) return;
  const std::uint64_t key = *reinterpret_cast<const std::uint64_t*>(in + compression::header_bytes);
  const std::size_t i = q::stratum_index(key, j, n, k);  // strata: no two j share an i
  out[i] = numeric::add_rn(out[i], reinterpret_cast<const float*>(in + compression::header_bytes + 8)[j]);
}

// --- TopK (layout: header, u32 k, k u32 indices ascending, k f32 values) ---

// The selection is top_k.hpp's, pass for pass: every pass counts the keys that match the digits
// chosen so far into a histogram (integer counts: the atomics' order cannot change them), then
// one block finds the digit that holds the last wanted key (quantize::top_k_holds, every digit at
// once over a scan of the counts from the largest digit down), takes it (quantize::top_k_take)
// and clears the histogram for the next pass. The cut never leaves the device.
__global__ void top_k_start(std::size_t k, std::byte* out, std::uint64_t header, TopKScratch* scratch) {
  if (threadIdx.x == 0) {
    write_header(out, header);
    *reinterpret_cast<std::uint32_t*>(out + compression::header_bytes) = static_cast<std::uint32_t>(k);
    scratch->cut = q::TopKCut{0, 0, k};
  }
  for (unsigned d = threadIdx.x; d < q::top_k_max_digits; d += blockDim.x) scratch->histogram[d] = 0;
}

// A bounded grid striding over the values, each block counting in shared memory first.
__global__ void top_k_histogram(const float* values, std::size_t n, unsigned pass, TopKScratch* scratch) {
  __shared__ std::uint32_t counts[q::top_k_max_digits];
  const std::uint32_t digits = q::top_k_digits(pass);
  for (unsigned d = threadIdx.x; d < digits; d += blockDim.x) counts[d] = 0;
  __syncthreads();
  const q::TopKCut cut = scratch->cut;
  for (std::size_t i = thread_index(); i < n; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t key = q::magnitude_key(values[i]);
    if (q::top_k_matches(key, cut)) atomicAdd(&counts[q::top_k_digit(key, pass)], 1u);
  }
  __syncthreads();
  for (unsigned d = threadIdx.x; d < digits; d += blockDim.x)
    if (counts[d] != 0) atomicAdd(&scratch->histogram[d], counts[d]);
}

// 256 threads, as the scan below: a 1024-thread scan of u64 asks more registers than sm_90 has
// for a block of that size, and the launch fails.
constexpr unsigned choose_threads = 256;
constexpr unsigned digits_per_thread = q::top_k_max_digits / choose_threads;

__global__ void choose_digit(unsigned pass, TopKScratch* scratch) {
  using Scan = cub::BlockScan<std::uint64_t, choose_threads>;
  __shared__ typename Scan::TempStorage storage;
  const std::uint32_t digits = q::top_k_digits(pass);
  const q::TopKCut cut = scratch->cut;
  std::uint64_t count[digits_per_thread], above[digits_per_thread];
  for (unsigned j = 0; j < digits_per_thread; ++j) {
    const std::uint32_t rank = threadIdx.x * digits_per_thread + j;  // 0: the largest digit
    count[j] = rank < digits ? scratch->histogram[digits - 1 - rank] : 0;
  }
  Scan(storage).ExclusiveSum(count, above);  // the keys in larger digits
  __syncthreads();  // every thread has read the cut and its counts
  for (unsigned j = 0; j < digits_per_thread; ++j) {
    const std::uint32_t rank = threadIdx.x * digits_per_thread + j;
    if (rank < digits && q::top_k_holds(above[j], count[j], cut.wanted)) {  // one digit in all
      q::TopKCut chosen = cut;
      q::top_k_take(chosen, pass, digits - 1 - rank, above[j]);
      scratch->cut = chosen;
    }
  }
  for (unsigned d = threadIdx.x; d < q::top_k_max_digits; d += blockDim.x) scratch->histogram[d] = 0;
}

// Then the picks, in index order. A value is kept if its key is above the cut, or equal to it
// with fewer than `wanted` equal keys before it (the CPU's single pass keeps the lowest-indexed);
// its place in the list is the number kept before it: the keys above the cut before it plus
// min(equal keys before it, wanted). So every tile of values counts both, packed in one u64
// (above << 32 | equal: n < 2^32, so the low half never carries), one block scans the tiles'
// counts, and every tile scans its threads' counts again and writes its picks.
constexpr unsigned top_k_items = 8;  // consecutive values a thread, when writing
constexpr std::size_t top_k_tile = threads * top_k_items;
constexpr unsigned scan_threads = 256;
constexpr std::uint64_t equal_mask = 0xffffffffu;

__device__ std::uint64_t above_or_equal(std::uint32_t key, std::uint32_t cut) {
  return key > cut ? std::uint64_t{1} << 32 : key == cut ? 1u : 0u;
}

// A tile's counts (any order of its values will do here: they are summed).
__global__ void top_k_count(const float* values, std::size_t n, const TopKScratch* scratch,
                            std::uint64_t* tile_counts) {
  using Reduce = cub::BlockReduce<std::uint64_t, threads>;
  __shared__ typename Reduce::TempStorage storage;
  const std::uint32_t cut = scratch->cut.prefix;
  std::uint64_t counts = 0;
  for (unsigned j = 0; j < top_k_items; ++j) {
    const std::size_t i = blockIdx.x * top_k_tile + j * threads + threadIdx.x;  // coalesced
    if (i < n) counts += above_or_equal(q::magnitude_key(values[i]), cut);
  }
  const std::uint64_t total = Reduce(storage).Sum(counts);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

// The tiles' counts into the counts before each tile (exclusive), in place, by one block.
__global__ void top_k_scan(std::uint64_t* tile_counts, std::size_t tiles) {
  using Scan = cub::BlockScan<std::uint64_t, scan_threads>;
  __shared__ typename Scan::TempStorage storage;
  std::uint64_t carry = 0;
  for (std::size_t base = 0; base < tiles; base += scan_threads) {
    const std::size_t t = base + threadIdx.x;
    std::uint64_t before = t < tiles ? tile_counts[t] : 0, total = 0;
    Scan(storage).ExclusiveSum(before, before, total);
    if (t < tiles) tile_counts[t] = carry + before;
    carry += total;
    __syncthreads();  // the scan's storage is used again
  }
}

// `residual`: error feedback (values is the residual, holding p): a kept value leaves -(-p + p)
// behind, the CPU's encode_keeping_error step; a dropped one stays p.
__global__ void top_k_emit(const float* values, std::size_t n, std::size_t k, const TopKScratch* scratch,
                           const std::uint64_t* tile_counts, std::byte* out, float* residual) {
  using Scan = cub::BlockScan<std::uint64_t, threads>;
  __shared__ typename Scan::TempStorage storage;
  const q::TopKCut cut = scratch->cut;
  const std::size_t first = blockIdx.x * top_k_tile + threadIdx.x * top_k_items;
  float p[top_k_items];
  std::uint64_t counts = 0;
  for (unsigned j = 0; j < top_k_items; ++j) {
    p[j] = first + j < n ? values[first + j] : 0.0f;
    if (first + j < n) counts += above_or_equal(q::magnitude_key(p[j]), cut.prefix);
  }
  Scan(storage).ExclusiveSum(counts, counts);
  counts += tile_counts[blockIdx.x];
  std::uint64_t above = counts >> 32, equal = counts & equal_mask;
  auto* index = reinterpret_cast<std::uint32_t*>(out + compression::header_bytes + 4);
  auto* value = reinterpret_cast<float*>(index + k);
  for (unsigned j = 0; j < top_k_items && first + j < n; ++j) {
    const std::uint32_t key = q::magnitude_key(p[j]);
    const std::uint64_t at = above + (equal < cut.wanted ? equal : cut.wanted);
    // `at < k` holds for every pick of a consistent cut; it keeps an inconsistent one (values
    // changed under the encode) inside the encoding.
    if ((key > cut.prefix || (key == cut.prefix && equal < cut.wanted)) && at < k) {
      index[at] = static_cast<std::uint32_t>(first + j);
      value[at] = p[j];
      if (residual) residual[first + j] = -numeric::add_rn(-p[j], p[j]);
    }
    above += key > cut.prefix;
    equal += key == cut.prefix;
  }
}

// A decode checks everything first, as the CPU does: the first fault (in this order: the header
// at 0, the count at 1, then index j at 2 + j) is kept, and the kernels that write do nothing
// once there is one. The last of them reports it.
constexpr std::uint64_t no_fault = ~std::uint64_t{0};

__device__ void note_fault(TopKScratch* scratch, std::uint64_t order) {
  atomicMin(reinterpret_cast<unsigned long long*>(&scratch->first_fault), static_cast<unsigned long long>(order));
}

__global__ void top_k_check(const std::byte* in, std::size_t n, std::size_t k, std::uint64_t header,
                            TopKScratch* scratch) {
  const std::size_t j = thread_index();
  if (j == 0) {
    if (*reinterpret_cast<const std::uint64_t*>(in) != header) note_fault(scratch, 0);
    if (*reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes) != k) note_fault(scratch, 1);
  }
  if (j >= k) return;
  const auto* index = reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes + 4);
  if (index[j] >= n || (j > 0 && index[j] <= index[j - 1])) note_fault(scratch, 2 + j);
}

__global__ void top_k_clear(float* out, std::size_t n, const TopKScratch* scratch) {
  const std::size_t i = thread_index();
  if (i < n && scratch->first_fault == no_fault) out[i] = 0.0f;
}

__global__ void top_k_scatter(const std::byte* in, std::size_t n, std::size_t k, float* out, std::uint64_t header,
                              const TopKScratch* scratch, DecodeCheck* check, std::uint64_t site) {
  const std::size_t j = thread_index();
  const std::uint64_t fault = scratch->first_fault;
  const auto* index = reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes + 4);
  if (fault == no_fault) {
    // Indices strictly ascending: no two j add to one value. 0 + v on overwrite, as the CPU's.
    if (j < k) out[index[j]] = numeric::add_rn(out[index[j]], reinterpret_cast<const float*>(index + k)[j]);
    return;
  }
  if (j != 0 || check->failed != DecodeCheck::none) return;  // an earlier decode's fault stays
  unsigned failed = DecodeCheck::header;
  if (fault == 0) {
    check->found = *reinterpret_cast<const std::uint64_t*>(in);
    check->expected = header;
  } else if (fault == 1) {
    check->found = *reinterpret_cast<const std::uint32_t*>(in + compression::header_bytes);
    check->expected = k;
    failed = DecodeCheck::count;
  } else {
    check->position = fault - 2;
    check->found = index[fault - 2];
    check->expected = n;
    failed = DecodeCheck::index;
  }
  check->site = site;
  __threadfence_system();
  check->failed = failed;
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

__global__ void divide_kernel(float* values, std::size_t n, float divisor) {
  const std::size_t i = thread_index();
  if (i < n) values[i] = __fdiv_rn(values[i], divisor);  // IEEE division, as the host's v /= n
}

}  // namespace

namespace {
template <class Format>
int encode_16_on(const float* in, std::size_t n, std::uint16_t* out, void* stream) {
  if (n == 0) return 0;
  encode_16<Format><<<blocks_for_quads(n), threads, 0, native(stream)>>>(in, n, out, aligned(in, 16) && aligned(out, 8));
  return launched();
}
template <class Format>
int decode_16_on(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream) {
  if (n == 0) return 0;
  decode_16<Format><<<blocks_for_quads(n), threads, 0, native(stream)>>>(in, n, out, add,
                                                                          aligned(in, 8) && aligned(out, 16));
  return launched();
}
}  // namespace

int encode_f16(const float* in, std::size_t n, std::uint16_t* out, void* stream) {
  return encode_16_on<F16>(in, n, out, stream);
}
int encode_bf16(const float* in, std::size_t n, std::uint16_t* out, void* stream) {
  return encode_16_on<BF16>(in, n, out, stream);
}
int decode_f16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream) {
  return decode_16_on<F16>(in, n, out, add, stream);
}
int decode_bf16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream) {
  return decode_16_on<BF16>(in, n, out, add, stream);
}

int encode_two_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, float threshold, void* stream) {
  return pack_on<2>(n, out, header, nullptr, threshold, MakeTwoBitCode{}, PlainValues{in}, stream);
}

int encode_two_bit_keeping_error(const float* in, float* residual, std::size_t n, std::byte* out, std::uint64_t header,
                                 float threshold, void* stream) {
  return pack_on<2>(n, out, header, nullptr, threshold, MakeTwoBitCode{},
                    WithFeedback<TwoBitValue>{in, residual, {}}, stream);
}

std::size_t sum_tree_size(std::size_t n) {
  std::size_t total = 0;
  for (std::size_t count = n; count > 1;) {
    count = (count + q::sum_fan_in - 1) / q::sum_fan_in;
    total += count;
  }
  return total + 1;
}

// Enqueues the mean magnitude of in[0, n) into *mean (n > 0): leaves, then groups of 256 of the
// level before, until one sum is left.
int mean_magnitude(const float* in, std::size_t n, double* sums, float* mean, void* stream) {
  double* level = sums;
  std::size_t count = (n + q::sum_fan_in - 1) / q::sum_fan_in;
  leaf_sums<<<blocks_for(count * leaf_lanes), threads, 0, native(stream)>>>(in, n, level, count);
  while (count > 1) {
    const std::size_t groups = (count + q::sum_fan_in - 1) / q::sum_fan_in;
    group_sums<<<blocks_for(groups), threads, 0, native(stream)>>>(level, count, level + count, groups);
    level += count;
    count = groups;
  }
  mean_of<<<1, 1, 0, native(stream)>>>(level, n, mean);
  return launched();
}

int encode_one_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, double* sums, float* scale,
                   void* stream) {
  if (n == 0) return pack_on<1>(n, out, header, nullptr, 0.0f, MakeSignCode{}, PlainValues{in}, stream);
  if (const int status = mean_magnitude(in, n, sums, scale, stream)) return status;
  return pack_on<1>(n, out, header, scale, 0.0f, MakeSignCode{}, PlainValues{in}, stream);
}

int encode_one_bit_keeping_error(const float* in, float* residual, std::size_t n, std::byte* out, std::uint64_t header,
                                 double* sums, float* scale, void* stream) {
  if (n == 0) return pack_on<1>(n, out, header, nullptr, 0.0f, MakeSignCode{}, PlainValues{in}, stream);
  // The scale is the mean magnitude of every p = residual + in, so p is formed first, in place.
  if (const int status = accumulate(residual, in, n, stream)) return status;
  if (const int status = mean_magnitude(residual, n, sums, scale, stream)) return status;
  return pack_on<1>(n, out, header, scale, 0.0f, MakeSignCode{}, WithFeedback<SignValue>{nullptr, residual, {}}, stream);
}

int encode_terngrad(unsigned bits, const float* in, std::size_t n, std::byte* out, std::uint64_t header,
                    std::uint64_t key, float* scale, void* stream) {
  if (const auto status = cudaMemsetAsync(scale, 0, sizeof(float), native(stream))) return static_cast<int>(status);
  if (n > 0)
    largest_magnitude<<<std::min(blocks_for(n), max_blocks), threads, 0, native(stream)>>>(
        in, n, reinterpret_cast<unsigned*>(scale));
  if (const int status = launched()) return status;
  switch (bits) {
    case 2: return pack_on<2>(n, out, header, scale, 0.0f, MakeTernaryCode<2>{key}, PlainValues{in}, stream);
    case 4: return pack_on<4>(n, out, header, scale, 0.0f, MakeTernaryCode<4>{key}, PlainValues{in}, stream);
    default: return pack_on<8>(n, out, header, scale, 0.0f, MakeTernaryCode<8>{key}, PlainValues{in}, stream);
  }
}

int decode_two_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, DecodeCheck* check,
                   std::uint64_t site, void* stream) {
  return unpack_on<2>(in, n, out, add, TwoBitValue{}, header, check, site, stream);
}
int decode_one_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, DecodeCheck* check,
                   std::uint64_t site, void* stream) {
  return unpack_on<1>(in, n, out, add, SignValue{}, header, check, site, stream);
}
int decode_terngrad(unsigned bits, const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header,
                    DecodeCheck* check, std::uint64_t site, void* stream) {
  switch (bits) {
    case 2: return unpack_on<2>(in, n, out, add, TernaryValue<2>{}, header, check, site, stream);
    case 4: return unpack_on<4>(in, n, out, add, TernaryValue<4>{}, header, check, site, stream);
    default: return unpack_on<8>(in, n, out, add, TernaryValue<8>{}, header, check, site, stream);
  }
}

int encode_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                    std::uint64_t header, void* stream) {
  gather_random_k<<<blocks_for(k), threads, 0, native(stream)>>>(in, n, k, key, out, header, nullptr);
  return launched();
}

int encode_random_k_keeping_error(const float* in, float* residual, std::size_t n, std::size_t k, std::uint64_t key,
                                  std::byte* out, std::uint64_t header, void* stream) {
  if (const int status = accumulate(residual, in, n, stream)) return status;
  gather_random_k<<<blocks_for(k), threads, 0, native(stream)>>>(residual, n, k, key, out, header, residual);
  return launched();
}

int decode_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, void* stream) {
  if (!add && n > 0)
    if (const auto status = cudaMemsetAsync(out, 0, n * sizeof(float), native(stream))) return static_cast<int>(status);
  if (k == 0) return 0;
  scatter_random_k<<<blocks_for(k), threads, 0, native(stream)>>>(in, n, k, out);
  return launched();
}

std::size_t top_k_tiles(std::size_t n) { return (n + top_k_tile - 1) / top_k_tile; }

int encode_top_k(const float* in, float* residual, std::size_t n, std::size_t k, std::byte* out, std::uint64_t header,
                 TopKScratch* scratch, std::uint64_t* tile_counts, void* stream) {
  // Each launch is checked before the next is queued: the emit must not run on a cut or counts
  // a failed launch left unfinished.
  const cudaStream_t s = native(stream);
  top_k_start<<<1, threads, 0, s>>>(k, out, header, scratch);
  if (const int status = launched(); status || k == 0) return status;
  for (unsigned pass = 0; pass < q::top_k_passes; ++pass) {
    top_k_histogram<<<std::min(blocks_for(n), max_blocks), threads, 0, s>>>(in, n, pass, scratch);
    if (const int status = launched()) return status;
    choose_digit<<<1, choose_threads, 0, s>>>(pass, scratch);
    if (const int status = launched()) return status;
  }
  const auto tiles = static_cast<unsigned>(top_k_tiles(n));
  top_k_count<<<tiles, threads, 0, s>>>(in, n, scratch, tile_counts);
  if (const int status = launched()) return status;
  top_k_scan<<<1, scan_threads, 0, s>>>(tile_counts, tiles);
  if (const int status = launched()) return status;
  top_k_emit<<<tiles, threads, 0, s>>>(in, n, k, scratch, tile_counts, out, residual);
  return launched();
}

int decode_top_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, std::uint64_t header,
                 TopKScratch* scratch, DecodeCheck* check, std::uint64_t site, void* stream) {
  const cudaStream_t s = native(stream);
  if (const auto status = cudaMemsetAsync(&scratch->first_fault, 0xff, sizeof scratch->first_fault, s))
    return static_cast<int>(status);
  top_k_check<<<blocks_for(k), threads, 0, s>>>(in, n, k, header, scratch);
  if (const int status = launched()) return status;  // nothing may write unchecked
  if (!add && n > 0) top_k_clear<<<blocks_for(n), threads, 0, s>>>(out, n, scratch);
  if (const int status = launched()) return status;
  top_k_scatter<<<blocks_for(k), threads, 0, s>>>(in, n, k, out, header, scratch, check, site);
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

int divide(float* values, std::size_t n, float divisor, void* stream) {
  if (n == 0) return 0;
  divide_kernel<<<blocks_for(n), threads, 0, native(stream)>>>(values, n, divisor);
  return launched();
}

}  // namespace gradsync::cuda::kernels
