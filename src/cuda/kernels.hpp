#pragma once
// Launchers of the codec kernels (kernels.cu), callable from plain C++: codecs.cpp checks
// arguments and formats errors with the library's headers, which nvcc does not see. Every
// launcher enqueues on `stream` (a cudaStream_t) and returns the cudaError_t of the launch.

#include <cstddef>
#include <cstdint>

#include "gradsync/compression/quantize.hpp"

namespace gradsync::cuda::kernels {

// Where a decode kernel reports an encoding it refuses, so that the host need not copy the
// encoding's header back and wait before decoding: page-locked host memory the kernels write
// through (cudaHostAllocMapped), read after the stream's next synchronization. The decode that
// finds a fault writes nothing else; `failed` is set last, to the fault's kind. Only the first
// fault since the host last cleared it is kept, with the `site` its decode was launched for (the
// caller's number: a bucket), since several buckets' decodes may be queued before the host looks.
struct DecodeCheck {
  enum Fault : unsigned { none = 0, header = 1, count = 2, index = 3 };
  std::uint64_t found;     // header: the header word found; count: the count; index: the index
  std::uint64_t expected;  // header: the word expected; count: the codec's k; index: the values
  std::uint64_t position;  // index: where in the encoding's list of indices
  std::uint64_t site;      // the faulting decode's
  unsigned failed;         // a Fault
};

int encode_f16(const float* in, std::size_t n, std::uint16_t* out, void* stream);
int encode_bf16(const float* in, std::size_t n, std::uint16_t* out, void* stream);
int decode_f16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream);
int decode_bf16(const std::uint16_t* in, std::size_t n, float* out, bool add, void* stream);

// Packed encodings: `header` is the 8 header bytes as a little-endian word; the kernel writes it,
// the f32 parameter and the code words.
int encode_two_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, float threshold, void* stream);
// `sums` holds the sum tree (sum_tree_size(n) doubles); `scale` one float of scratch.
int encode_one_bit(const float* in, std::size_t n, std::byte* out, std::uint64_t header, double* sums, float* scale,
                   void* stream);
// `scale` one float of scratch, zeroed by the launcher.
int encode_terngrad(unsigned bits, const float* in, std::size_t n, std::byte* out, std::uint64_t header,
                    std::uint64_t key, float* scale, void* stream);
// Error feedback fused in (Packed::encode_keeping_error's steps): codes p = residual + in and
// leaves what the code cut off in residual; one-bit's scale is over every p, so it adds first.
int encode_two_bit_keeping_error(const float* in, float* residual, std::size_t n, std::byte* out, std::uint64_t header,
                                 float threshold, void* stream);
int encode_one_bit_keeping_error(const float* in, float* residual, std::size_t n, std::byte* out, std::uint64_t header,
                                 double* sums, float* scale, void* stream);
// Packed decodes compare the encoding's first 8 bytes with `header` on the device, reporting a
// mismatch to `check` (the device's view of it), as `site`'s, instead of decoding.
int decode_two_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, DecodeCheck* check,
                   std::uint64_t site, void* stream);
int decode_one_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, DecodeCheck* check,
                   std::uint64_t site, void* stream);
int decode_terngrad(unsigned bits, const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header,
                    DecodeCheck* check, std::uint64_t site, void* stream);

int encode_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                    std::uint64_t header, void* stream);
// Error feedback: residual += in, then the kept values sent and zeroed in residual.
int encode_random_k_keeping_error(const float* in, float* residual, std::size_t n, std::size_t k, std::uint64_t key,
                                  std::byte* out, std::uint64_t header, void* stream);
int decode_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, void* stream);

// TopK (layout: header, u32 k, k u32 indices ascending, k f32 values), selecting as the CPU does
// (quantize::top_k_holds and top_k_take) with the device's scratch below, the host waiting for
// nothing.
// Per stream: the selection's state and histogram, and where a decode notes its first fault.
struct TopKScratch {
  compression::quantize::TopKCut cut;
  std::uint32_t histogram[compression::quantize::top_k_max_digits];
  std::uint64_t first_fault;  // the first fault a decode found (kernels.cu says in what order); ~0: none
};
// The tiles an encode of n values counts its picks in: one u64 of scratch each (`tile_counts`).
std::size_t top_k_tiles(std::size_t n);
// `residual`: error feedback, with `in` the residual already holding p = residual + in; a kept
// value leaves -(-p + p) there, a dropped one p (sparse.hpp's encode_keeping_error).
int encode_top_k(const float* in, float* residual, std::size_t n, std::size_t k, std::byte* out, std::uint64_t header,
                 TopKScratch* scratch, std::uint64_t* tile_counts, void* stream);
// Checks the header, the count and every index (in range, strictly ascending) on the device
// before anything is written, reporting the first fault to `check` as `site`'s.
int decode_top_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, std::uint64_t header,
                 TopKScratch* scratch, DecodeCheck* check, std::uint64_t site, void* stream);

int accumulate(float* residual, const float* in, std::size_t n, void* stream);
int negate(float* values, std::size_t n, void* stream);
int divide(float* values, std::size_t n, float divisor, void* stream);

// Doubles of scratch OneBit's sum tree needs for n values: every level's partial sums.
std::size_t sum_tree_size(std::size_t n);

}  // namespace gradsync::cuda::kernels
