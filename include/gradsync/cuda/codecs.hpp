#pragma once
// The codecs on a CUDA device: device buffers are encoded and decoded by kernels on a stream,
// with the same per-element functions as the CPU path (compression/quantize.hpp, numeric.hpp),
// so the bytes a kernel writes are the bytes the CPU codec writes for the same input and state,
// and either side decodes the other's data. Nothing is copied to the host but the few bytes of an
// encoding's header, which decode checks like the CPU path does (count, codec, version).
//
// Available where gradsync was built with CUDA (GRADSYNC_HAS_CUDA); every call throws a
// gradsync::Error naming the CUDA error when the runtime fails. Calls are asynchronous on the
// stream; encode returns the size the encoding will have, known from n alone. Decoding checks the
// encoding's size against the destination on the host at once, and its header (codec, format,
// count) on the device: the kernel that meets a wrong header writes nothing and the stream's next
// synchronize() throws Error(protocol) saying what it found. So a decode never waits for the host
// to read the header, except RandomK's and the packed codecs' of no values, which still do. TopK's
// decode checks every index on the device too before it writes. Inputs produced on another stream must be
// ordered before these calls by the caller (an event). Encodings must start at 8-byte-aligned
// device addresses (cudaMalloc gives 256). Results are bit-identical to the CPU codecs' except
// for the payload and sign of NaNs, which the device canonicalizes (so TopK, which ranks NaNs by
// their bits, may pick others among more NaNs than it keeps where they were computed on the
// device: error feedback's sums, a decode-add before the next encode).
//
// f32 values only. Covered: every codec (Fp16, Bf16, TwoBit, OneBit, TernGrad<Bits>, TopK,
// RandomK), and ErrorFeedback over any of them (the residual is a device buffer of n floats,
// zeroed by the caller).

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/random_k.hpp"
#include "gradsync/compression/terngrad.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::cuda {

int device_count();  // 0 where there is no device or no driver

// A CUDA stream on one device and the device scratch space its reductions use; one per
// Synchronizer (or per thread that encodes). Scratch grows to the largest n seen, so a plan that
// reserves its largest bucket up front allocates nothing afterwards.
class Stream {
 public:
  explicit Stream(int device = 0);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const noexcept;
  void* native() const noexcept;  // the cudaStream_t
  // Makes the stream's device current on the calling thread for good. Each call of this file's
  // makes it current for itself and puts the caller's device back (a trainer's thread may drive
  // several GPUs); gradsync's own threads call this first, so their calls find it current. Where
  // CUDA refuses, the thread's next call says why.
  void make_current() const noexcept;
  void reserve(std::size_t values);  // scratch for runs of up to `values` values
  // Waits for the stream; throws what a decode found wrong since the last one: Error(protocol)
  // naming the bucket that decode was queued for (set_bucket), whichever bucket's work is waited for.
  void synchronize();
  // The bucket the decodes queued from now on belong to (none at first): several buckets' decodes
  // share a stream, and a fault one of them finds is seen only at the next synchronize().
  void set_bucket(std::uint32_t bucket) noexcept;

  struct Impl;
  Impl& impl() noexcept { return *impl_; }  // for the library's own kernels

 private:
  std::unique_ptr<Impl> impl_;
};

// A CUDA event without timing: marks the work queued on a stream so far, so that another stream
// can wait for it and the host can see when it is done. Made at its first record(), on that
// stream's device; errors are gradsync::Error naming the operation.
class Event {
 public:
  Event() = default;
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream& stream);   // the work queued on `stream` so far
  void record_default_stream(int device);  // ... on `device`'s legacy default stream so far
  void order_before(Stream& stream);  // work queued on `stream` from now on waits for the last record
  bool done();                   // the last record's work has finished (true if never recorded)
  void synchronize();            // waits on the host until it has

 private:
  void record_on(void* stream);  // a cudaStream_t, the device current
  void* event_ = nullptr;  // cudaEvent_t
};

// Writes codec.max_encoded_bytes(n) bytes at `out` (device memory) and returns that size. Stateless
// codecs take their empty State too, so that every codec is called alike.
std::size_t encode(const compression::Fp16&, compression::Fp16::State&, const float* in, std::size_t n, std::byte* out,
                   Stream&);
std::size_t encode(const compression::Bf16&, compression::Bf16::State&, const float* in, std::size_t n, std::byte* out,
                   Stream&);
std::size_t encode(const compression::TwoBit&, compression::TwoBit::State&, const float* in, std::size_t n,
                   std::byte* out, Stream&);
std::size_t encode(const compression::OneBit&, compression::OneBit::State&, const float* in, std::size_t n,
                   std::byte* out, Stream&);
template <unsigned Bits>
std::size_t encode(const compression::TernGrad<Bits>&, typename compression::TernGrad<Bits>::State&, const float* in,
                   std::size_t n, std::byte* out, Stream&);
std::size_t encode(const compression::RandomK&, compression::RandomK::State&, const float* in, std::size_t n,
                   std::byte* out, Stream&);
// TopK selects as the CPU does (its radix select's passes as kernels, the cut kept on the device)
// and writes the picks in index order.
std::size_t encode(const compression::TopK&, compression::TopK::State&, const float* in, std::size_t n, std::byte* out,
                   Stream&);

// Decodes `bytes` bytes at `in` (device memory) into n values at `out`, adding or overwriting.
void decode(const compression::Fp16&, const std::byte* in, std::size_t bytes, float* out, std::size_t n, DecodeMode,
            Stream&);
void decode(const compression::Bf16&, const std::byte* in, std::size_t bytes, float* out, std::size_t n, DecodeMode,
            Stream&);
void decode(const compression::TwoBit&, const std::byte* in, std::size_t bytes, float* out, std::size_t n, DecodeMode,
            Stream&);
void decode(const compression::OneBit&, const std::byte* in, std::size_t bytes, float* out, std::size_t n, DecodeMode,
            Stream&);
template <unsigned Bits>
void decode(const compression::TernGrad<Bits>&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode, Stream&);
void decode(const compression::RandomK&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode, Stream&);
void decode(const compression::TopK&, const std::byte* in, std::size_t bytes, float* out, std::size_t n, DecodeMode,
            Stream&);

// residual[i] += in[i] (the first step of error feedback), on the stream.
void accumulate(float* residual, const float* in, std::size_t n, Stream&);
// values[i] = -values[i], on the stream.
void negate(float* values, std::size_t n, Stream&);
// values[i] /= divisor, rounded as the host's division (an average's last step), on the stream.
void divide(float* values, std::size_t n, float divisor, Stream&);
// A 16-bit gradient (`dtype` f16 or bf16: n values at `in`) widened into f32 values at `out`, and
// f32 values narrowed into one, on the stream, rounding as the host's detail::load and
// detail::store do (numeric.hpp), so that a bucket packed on the device holds the host path's bits.
void widen(const void* in, DType dtype, float* out, std::size_t n, Stream&);
void narrow(const float* in, DType dtype, void* out, std::size_t n, Stream&);
// `bytes` zero bytes at `device`, on the stream.
void fill_zero(void* device, std::size_t bytes, Stream&);
// `bytes` bytes from `from` to `to`, either in device or page-locked host memory, on the stream.
void copy(void* to, const void* from, std::size_t bytes, Stream&);

// ErrorFeedback on the device: encodes in + residual into `out` and leaves in residual what the
// encoding cut off, bit for bit as ErrorFeedback<C> on the CPU. TwoBit, OneBit, RandomK and TopK
// in fused kernels, as their CPU encode_keeping_error (non-templates: chosen over the generic steps).
std::size_t encode_with_feedback(const compression::TwoBit&, compression::TwoBit::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream&);
std::size_t encode_with_feedback(const compression::OneBit&, compression::OneBit::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream&);
std::size_t encode_with_feedback(const compression::RandomK&, compression::RandomK::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream&);
std::size_t encode_with_feedback(const compression::TopK&, compression::TopK::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream&);

// The other codecs (TernGrad): the CPU decorator's generic steps: residual += in; encode the
// residual; residual -= decode(encoding), as -(-residual + decode) so the rounding matches.
template <class C>
std::size_t encode_with_feedback(const C& codec, typename C::State& state, const float* in, float* residual,
                                 std::size_t n, std::byte* out, Stream& stream) {
  accumulate(residual, in, n, stream);
  const std::size_t bytes = encode(codec, state, residual, n, out, stream);
  negate(residual, n, stream);
  decode(codec, out, bytes, residual, n, DecodeMode::add, stream);
  negate(residual, n, stream);
  return bytes;
}

}  // namespace gradsync::cuda
