#pragma once
// Launchers of the codec kernels (kernels.cu), callable from plain C++: codecs.cpp checks
// arguments and formats errors with the library's headers, which nvcc does not see. Every
// launcher enqueues on `stream` (a cudaStream_t) and returns the cudaError_t of the launch.

#include <cstddef>
#include <cstdint>

namespace gradsync::cuda::kernels {

// Where a decode kernel reports an encoding whose header is not the one expected, so that the
// host need not copy the header back and wait before decoding: page-locked host memory the
// kernels write through (cudaHostAllocMapped), read after the stream's next synchronization.
// The kernel that finds a mismatch writes nothing else; `failed` is set last.
struct HeaderCheck {
  std::uint64_t found;
  std::uint64_t expected;
  unsigned failed;
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
// mismatch to `check` (the device's view of it) instead of decoding.
int decode_two_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, HeaderCheck* check,
                   void* stream);
int decode_one_bit(const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header, HeaderCheck* check,
                   void* stream);
int decode_terngrad(unsigned bits, const std::byte* in, std::size_t n, float* out, bool add, std::uint64_t header,
                    HeaderCheck* check, void* stream);

int encode_random_k(const float* in, std::size_t n, std::size_t k, std::uint64_t key, std::byte* out,
                    std::uint64_t header, void* stream);
// Error feedback: residual += in, then the kept values sent and zeroed in residual.
int encode_random_k_keeping_error(const float* in, float* residual, std::size_t n, std::size_t k, std::uint64_t key,
                                  std::byte* out, std::uint64_t header, void* stream);
int decode_random_k(const std::byte* in, std::size_t n, std::size_t k, float* out, bool add, void* stream);

int accumulate(float* residual, const float* in, std::size_t n, void* stream);
int negate(float* values, std::size_t n, void* stream);
int divide(float* values, std::size_t n, float divisor, void* stream);

// Doubles of scratch OneBit's sum tree needs for n values: every level's partial sums.
std::size_t sum_tree_size(std::size_t n);

}  // namespace gradsync::cuda::kernels
