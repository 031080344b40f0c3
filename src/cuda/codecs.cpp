// The host side of the codecs on a CUDA device (include/gradsync/cuda/codecs.hpp): argument and
// header checks with the CPU codecs' own functions, errors as gradsync::Error, and the stream's
// scratch; the kernels are in kernels.cu.

#include "gradsync/cuda/codecs.hpp"

#include <cuda_runtime.h>

#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "check.hpp"
#include "kernels.hpp"
#include "on_device.hpp"

namespace gradsync::cuda {

namespace {

using detail::check;

// The 8 header bytes as the little-endian word the kernels write.
std::uint64_t header_word(compression::CodecId id, std::size_t n) {
  std::array<std::byte, compression::header_bytes> bytes;
  compression::write_header(bytes, id, n);
  std::uint64_t word;
  std::memcpy(&word, bytes.data(), sizeof word);
  return word;
}

// Copies the first bytes of an encoding from the device and checks them as the CPU codec does.
void check_device_header(const std::byte* in, std::size_t bytes, compression::CodecId id, const char* codec,
                         std::size_t n, std::size_t payload, Stream& stream) {
  std::array<std::byte, compression::header_bytes> header{};
  const std::size_t copied = bytes < header.size() ? bytes : header.size();
  auto s = static_cast<cudaStream_t>(stream.native());
  check(cudaMemcpyAsync(header.data(), in, copied, cudaMemcpyDeviceToHost, s), "decode");
  check(cudaStreamSynchronize(s), "decode");
  compression::check_header(std::span<const std::byte>(header).first(copied), bytes, id, codec, n, payload);
}

// Checks what the host knows of an encoding (its size, against the codec and the destination)
// and returns the header the decode kernel must find on the device (kernels::DecodeCheck).
std::uint64_t expected_header(std::size_t bytes, compression::CodecId id, const char* codec, std::size_t n,
                              std::size_t payload) {
  if (bytes != compression::header_bytes + payload)
    throw Error(ErrorKind::protocol, {.operation = "decode"},
                fmt::format("{} codec: {} bytes for {} values, expected {}", codec, bytes, n,
                            compression::header_bytes + payload));
  return header_word(id, n);
}

// What a header word says, for the message of a mismatch found on the device.
std::string describe_header(std::uint64_t word) {
  return fmt::format("codec {}, format version {}, {} values", word & 0xff, (word >> 8) & 0xff, word >> 32);
}

// Makes the stream's device current on the calling thread (which may not be the one that made
// the stream: a Synchronizer's communication thread, say) while kernels are launched there, and
// the caller's again afterwards (on_device.hpp). It also clears an error an earlier runtime call
// on this thread left behind for its caller, who has had it: a query's cudaErrorNotReady, the
// caller's own (a trainer's event query) included. Otherwise the launch check that follows
// (kernels.cu reads the last error) would report it as the launch's. Errors that corrupt the
// context are sticky and come back at once.
detail::OnDevice use(int device) { return detail::OnDevice(device, "set device"); }
detail::OnDevice use(const Stream& stream) { return use(stream.device()); }

// A packed codec's decode (two-bit, one-bit, terngrad): the host checks the size, and the kernel
// `launch(header)` starts compares the header on the device; with n = 0 there is no kernel to look
// at it, so the host does.
template <class Launch>
void decode_packed(const std::byte* in, std::size_t bytes, std::size_t n, compression::CodecId id, const char* codec,
                   std::size_t words, Stream& stream, Launch launch) {
  const auto on = use(stream);
  if (n == 0) return check_device_header(in, bytes, id, codec, n, 4, stream);
  check(launch(expected_header(bytes, id, codec, n, 4 + words * 4)), "decode");
}

}  // namespace

struct Stream::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  double* sums = nullptr;  // OneBit's sum tree
  std::size_t sums_capacity = 0;
  std::uint64_t* tile_counts = nullptr;  // TopK's counts per tile
  std::size_t tiles_capacity = 0;
  kernels::TopKScratch* top_k = nullptr;
  float* parameter = nullptr;  // a run's parameter computed on the device (a scale)
  kernels::DecodeCheck* check = nullptr;         // mapped host memory: what decode kernels found
  kernels::DecodeCheck* check_device = nullptr;  // ... as the device addresses it
  std::uint64_t site = no_bucket;  // the bucket decodes queued now belong to (set_bucket)
  static constexpr std::uint64_t no_bucket = ~std::uint64_t{0};
};

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

Stream::Stream(int device) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  const detail::OnDevice on(device, "stream");
  try {
    check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "stream");
    check(cudaMalloc(&impl_->parameter, sizeof(float)), "stream");
    check(cudaMalloc(&impl_->top_k, sizeof(kernels::TopKScratch)), "stream");
    check(cudaHostAlloc(&impl_->check, sizeof(kernels::DecodeCheck), cudaHostAllocMapped), "stream");
    *impl_->check = {};
    check(cudaHostGetDevicePointer(&impl_->check_device, impl_->check, 0), "stream");
  } catch (...) {
    cudaFree(impl_->parameter);
    cudaFree(impl_->top_k);
    cudaFreeHost(impl_->check);
    if (impl_->stream) cudaStreamDestroy(impl_->stream);
    throw;
  }
}

Stream::~Stream() {
  std::optional<detail::OnDevice> on;  // not a device this thread never used (on_device.hpp)
  try {
    on.emplace(impl_->device, "stream");
  } catch (const Error&) {
  }
  cudaStreamSynchronize(impl_->stream);
  cudaFree(impl_->sums);
  cudaFree(impl_->tile_counts);
  cudaFree(impl_->top_k);
  cudaFree(impl_->parameter);
  cudaFreeHost(impl_->check);
  cudaStreamDestroy(impl_->stream);
}

int Stream::device() const noexcept { return impl_->device; }
void Stream::make_current() const noexcept {
  if (cudaSetDevice(impl_->device) != cudaSuccess) cudaGetLastError();
}
void* Stream::native() const noexcept { return impl_->stream; }
void Stream::synchronize() {
  check(cudaStreamSynchronize(impl_->stream), "synchronize");
  if (!impl_->check->failed) return;
  const kernels::DecodeCheck found = *impl_->check;
  *impl_->check = {};
  const std::string what = [&] {
    switch (found.failed) {
      case kernels::DecodeCheck::count:
        return fmt::format("a top-k decode on cuda:{} met an encoding that keeps {} values, where the codec keeps {}",
                           impl_->device, found.found, found.expected);
      case kernels::DecodeCheck::index:
        return fmt::format("a top-k decode on cuda:{} met index {} at position {}, out of range or order for {} values",
                           impl_->device, found.found, found.position, found.expected);
      default:
        return fmt::format("a decode on cuda:{} met an encoding whose header says {}, where {} was expected",
                           impl_->device, describe_header(found.found), describe_header(found.expected));
    }
  }();
  ErrorContext context{.operation = "decode"};
  if (found.site != Impl::no_bucket) context.bucket = static_cast<std::uint32_t>(found.site);
  throw Error(ErrorKind::protocol, std::move(context), what + "; that decode wrote nothing");
}

void Stream::set_bucket(std::uint32_t bucket) noexcept { impl_->site = bucket; }

Event::~Event() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));  // from any device: the caller's stays current
}

void Event::record(Stream& stream) {
  const auto on = use(stream);
  record_on(stream.native());
}

void Event::record_default_stream(int device) {
  const auto on = use(device);
  record_on(cudaStreamLegacy);
}

void Event::record_on(void* stream) {
  if (!event_) {
    cudaEvent_t event;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "record event");
    event_ = event;
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)), "record event");
}

void Event::order_before(Stream& stream) {
  if (!event_) return;
  const auto on = use(stream);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native()), static_cast<cudaEvent_t>(event_), 0),
        "wait for event");
}

bool Event::done() {
  if (!event_) return true;
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();  // "not yet" is left as the thread's last error too (check() says why that matters)
    return false;
  }
  check(status, "query event");
  return true;
}

void Event::synchronize() {
  if (event_) check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "wait for event");
}

namespace {
// Device scratch of `needed` T at least; the old is freed, so the stream must not be using it.
template <class T>
void grow(T*& buffer, std::size_t& capacity, std::size_t needed) {
  if (needed <= capacity) return;
  check(cudaFree(buffer), "reserve");
  buffer = nullptr;
  capacity = 0;
  check(cudaMalloc(&buffer, needed * sizeof(T)), "reserve");
  capacity = needed;
}
}  // namespace

void Stream::reserve(std::size_t values) {
  const std::size_t sums = kernels::sum_tree_size(values), tiles = kernels::top_k_tiles(values);
  if (sums <= impl_->sums_capacity && tiles <= impl_->tiles_capacity) return;
  const auto on = use(*this);  // the scratch is the stream's device's, whichever thread grows it
  check(cudaStreamSynchronize(impl_->stream), "reserve");  // the old scratch may still be in use
  grow(impl_->sums, impl_->sums_capacity, sums);
  grow(impl_->tile_counts, impl_->tiles_capacity, tiles);
}

std::size_t encode(const compression::Fp16&, compression::Fp16::State&, const float* in, std::size_t n, std::byte* out,
                   Stream& stream) {
  const auto on = use(stream);
  check(kernels::encode_f16(in, n, reinterpret_cast<std::uint16_t*>(out), stream.native()), "encode");
  return n * 2;
}
std::size_t encode(const compression::Bf16&, compression::Bf16::State&, const float* in, std::size_t n, std::byte* out,
                   Stream& stream) {
  const auto on = use(stream);
  check(kernels::encode_bf16(in, n, reinterpret_cast<std::uint16_t*>(out), stream.native()), "encode");
  return n * 2;
}
void decode(const compression::Fp16&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  const auto on = use(stream);
  compression::check_encoded_size("fp16", bytes, n, n * 2);
  check(kernels::decode_f16(reinterpret_cast<const std::uint16_t*>(in), n, out, mode == DecodeMode::add,
                            stream.native()),
        "decode");
}
void decode(const compression::Bf16&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  const auto on = use(stream);
  compression::check_encoded_size("bf16", bytes, n, n * 2);
  check(kernels::decode_bf16(reinterpret_cast<const std::uint16_t*>(in), n, out, mode == DecodeMode::add,
                             stream.native()),
        "decode");
}

std::size_t encode(const compression::TwoBit& codec, compression::TwoBit::State&, const float* in, std::size_t n,
                   std::byte* out, Stream& stream) {
  const auto on = use(stream);
  check(kernels::encode_two_bit(in, n, out, header_word(compression::CodecId::two_bit, n), codec.threshold,
                                stream.native()),
        "encode");
  return compression::Packed<2>::bytes(n);
}
std::size_t encode_with_feedback(const compression::TwoBit& codec, compression::TwoBit::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream& stream) {
  const auto on = use(stream);
  check(kernels::encode_two_bit_keeping_error(in, residual, n, out, header_word(compression::CodecId::two_bit, n),
                                              codec.threshold, stream.native()),
        "encode");
  return compression::Packed<2>::bytes(n);
}
void decode(const compression::TwoBit&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  decode_packed(in, bytes, n, compression::CodecId::two_bit, "two-bit", compression::Packed<2>::words(n), stream,
                [&](std::uint64_t header) {
                  return kernels::decode_two_bit(in, n, out, mode == DecodeMode::add, header,
                                                 stream.impl().check_device, stream.impl().site, stream.native());
                });
}

std::size_t encode(const compression::OneBit&, compression::OneBit::State&, const float* in, std::size_t n,
                   std::byte* out, Stream& stream) {
  const auto on = use(stream);
  stream.reserve(n);
  check(kernels::encode_one_bit(in, n, out, header_word(compression::CodecId::one_bit, n), stream.impl().sums,
                                stream.impl().parameter, stream.native()),
        "encode");
  return compression::Packed<1>::bytes(n);
}
std::size_t encode_with_feedback(const compression::OneBit&, compression::OneBit::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream& stream) {
  const auto on = use(stream);
  stream.reserve(n);
  check(kernels::encode_one_bit_keeping_error(in, residual, n, out, header_word(compression::CodecId::one_bit, n),
                                              stream.impl().sums, stream.impl().parameter, stream.native()),
        "encode");
  return compression::Packed<1>::bytes(n);
}
void decode(const compression::OneBit&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  decode_packed(in, bytes, n, compression::CodecId::one_bit, "one-bit", compression::Packed<1>::words(n), stream,
                [&](std::uint64_t header) {
                  return kernels::decode_one_bit(in, n, out, mode == DecodeMode::add, header,
                                                 stream.impl().check_device, stream.impl().site, stream.native());
                });
}

template <unsigned Bits>
std::size_t encode(const compression::TernGrad<Bits>& codec, typename compression::TernGrad<Bits>::State& state,
                   const float* in, std::size_t n, std::byte* out, Stream& stream) {
  const auto on = use(stream);
  const std::uint64_t key = compression::quantize::stream_key(codec.seed, state.encodes++);
  check(kernels::encode_terngrad(Bits, in, n, out, header_word(compression::CodecId::terngrad, n), key,
                                 stream.impl().parameter, stream.native()),
        "encode");
  return compression::TernGrad<Bits>::Layout::bytes(n);
}
template <unsigned Bits>
void decode(const compression::TernGrad<Bits>&, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  decode_packed(in, bytes, n, compression::CodecId::terngrad, "terngrad",
                compression::TernGrad<Bits>::Layout::words(n), stream, [&](std::uint64_t header) {
                  return kernels::decode_terngrad(Bits, in, n, out, mode == DecodeMode::add, header,
                                                  stream.impl().check_device, stream.impl().site, stream.native());
                });
}

template std::size_t encode(const compression::TernGrad<2>&, compression::TernGrad<2>::State&, const float*,
                            std::size_t, std::byte*, Stream&);
template std::size_t encode(const compression::TernGrad<4>&, compression::TernGrad<4>::State&, const float*,
                            std::size_t, std::byte*, Stream&);
template std::size_t encode(const compression::TernGrad<8>&, compression::TernGrad<8>::State&, const float*,
                            std::size_t, std::byte*, Stream&);
template void decode(const compression::TernGrad<2>&, const std::byte*, std::size_t, float*, std::size_t, DecodeMode,
                     Stream&);
template void decode(const compression::TernGrad<4>&, const std::byte*, std::size_t, float*, std::size_t, DecodeMode,
                     Stream&);
template void decode(const compression::TernGrad<8>&, const std::byte*, std::size_t, float*, std::size_t, DecodeMode,
                     Stream&);

std::size_t encode(const compression::RandomK& codec, compression::RandomK::State& state, const float* in,
                   std::size_t n, std::byte* out, Stream& stream) {
  const auto on = use(stream);
  const std::size_t k = codec.keep.of(n);
  const std::uint64_t key = compression::quantize::stream_key(codec.seed, state.encodes++);
  check(kernels::encode_random_k(in, n, k, key, out, header_word(compression::CodecId::random_k, n), stream.native()),
        "encode");
  return codec.max_encoded_bytes(n, DType::f32);
}
std::size_t encode_with_feedback(const compression::RandomK& codec, compression::RandomK::State& state,
                                 const float* in, float* residual, std::size_t n, std::byte* out, Stream& stream) {
  const auto on = use(stream);
  const std::size_t k = codec.keep.of(n);
  const std::uint64_t key = compression::quantize::stream_key(codec.seed, state.encodes++);
  check(kernels::encode_random_k_keeping_error(in, residual, n, k, key, out,
                                               header_word(compression::CodecId::random_k, n), stream.native()),
        "encode");
  return codec.max_encoded_bytes(n, DType::f32);
}
void decode(const compression::RandomK& codec, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  const auto on = use(stream);
  const std::size_t k = codec.keep.of(n);
  check_device_header(in, bytes, compression::CodecId::random_k, "random-k", n, 8 + 4 * k, stream);
  check(kernels::decode_random_k(in, n, k, out, mode == DecodeMode::add, stream.native()), "decode");
}

namespace {
// `residual`: error feedback, `in` being the residual that already holds p (kernels.hpp).
// Its indices are u32, and so are the kernels' counts.
void check_top_k_run(std::size_t n, const char* operation) {
  if (n > std::numeric_limits<std::uint32_t>::max())
    throw Error(ErrorKind::invalid_argument, {.operation = operation},
                fmt::format("top-k codec: a run of {} values; its indices are 32-bit", n));
}

std::size_t encode_top_k(const compression::TopK& codec, const float* in, float* residual, std::size_t n,
                         std::byte* out, Stream& stream) {
  check_top_k_run(n, "encode");
  const auto on = use(stream);
  stream.reserve(n);
  check(kernels::encode_top_k(in, residual, n, codec.keep.of(n), out, header_word(compression::CodecId::top_k, n),
                              stream.impl().top_k, stream.impl().tile_counts, stream.native()),
        "encode");
  return codec.max_encoded_bytes(n, DType::f32);
}
}  // namespace

std::size_t encode(const compression::TopK& codec, compression::TopK::State&, const float* in, std::size_t n,
                   std::byte* out, Stream& stream) {
  return encode_top_k(codec, in, nullptr, n, out, stream);
}
std::size_t encode_with_feedback(const compression::TopK& codec, compression::TopK::State&, const float* in,
                                 float* residual, std::size_t n, std::byte* out, Stream& stream) {
  accumulate(residual, in, n, stream);
  return encode_top_k(codec, residual, residual, n, out, stream);
}
void decode(const compression::TopK& codec, const std::byte* in, std::size_t bytes, float* out, std::size_t n,
            DecodeMode mode, Stream& stream) {
  check_top_k_run(n, "decode");
  const auto on = use(stream);
  const std::size_t k = codec.keep.of(n);
  check(kernels::decode_top_k(in, n, k, out, mode == DecodeMode::add,
                              expected_header(bytes, compression::CodecId::top_k, "top-k", n, 4 + 8 * k),
                              stream.impl().top_k, stream.impl().check_device, stream.impl().site, stream.native()),
        "decode");
}

void accumulate(float* residual, const float* in, std::size_t n, Stream& stream) {
  const auto on = use(stream);
  check(kernels::accumulate(residual, in, n, stream.native()), "accumulate");
}

void negate(float* values, std::size_t n, Stream& stream) {
  const auto on = use(stream);
  check(kernels::negate(values, n, stream.native()), "negate");
}

void divide(float* values, std::size_t n, float divisor, Stream& stream) {
  const auto on = use(stream);
  check(kernels::divide(values, n, divisor, stream.native()), "average");
}

void widen(const void* in, DType dtype, float* out, std::size_t n, Stream& stream) {
  const auto on = use(stream);
  const auto* bits = static_cast<const std::uint16_t*>(in);
  if (dtype == DType::f16) return check(kernels::decode_f16(bits, n, out, false, stream.native()), "widen");
  if (dtype == DType::bf16) return check(kernels::decode_bf16(bits, n, out, false, stream.native()), "widen");
  throw Error(ErrorKind::invalid_argument, {.operation = "widen"},
              fmt::format("{} values: only f16 and bf16 widen to f32", to_string(dtype)));
}

void narrow(const float* in, DType dtype, void* out, std::size_t n, Stream& stream) {
  const auto on = use(stream);
  auto* bits = static_cast<std::uint16_t*>(out);
  if (dtype == DType::f16) return check(kernels::encode_f16(in, n, bits, stream.native()), "narrow");
  if (dtype == DType::bf16) return check(kernels::encode_bf16(in, n, bits, stream.native()), "narrow");
  throw Error(ErrorKind::invalid_argument, {.operation = "narrow"},
              fmt::format("{} values: f32 narrows to f16 and bf16 only", to_string(dtype)));
}

void fill_zero(void* device, std::size_t bytes, Stream& stream) {
  if (bytes == 0) return;
  const auto on = use(stream);
  check(cudaMemsetAsync(device, 0, bytes, static_cast<cudaStream_t>(stream.native())), "fill zero");
}

void copy(void* to, const void* from, std::size_t bytes, Stream& stream) {
  if (bytes == 0) return;
  const auto on = use(stream);
  check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.native())), "copy");
}

}  // namespace gradsync::cuda
