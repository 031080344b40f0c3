// One math for CPU and GPU: the number-format conversions give the same bits in a CUDA kernel as
// on the host, and every device codec writes the CPU codec's bytes and decodes to its values.
// Skipped, with the reason printed, where no CUDA device is present.

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <thread>
#include <vector>

#include "cuda/numeric_kernels.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/cuda/memory.hpp"
#include "gradsync/detail/convert.hpp"
#include "gradsync/numeric.hpp"
#include "support.hpp"

using namespace gradsync;

namespace {
const bool no_device = [] {
  if (cuda_device_count() > 0) return false;
  std::puts("no CUDA device: the device conversion test is skipped (it runs on GPU machines)");
  return true;
}();

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
// The same bits, or both NaN: where the device computes a NaN it writes the canonical one.
bool same_value(float a, float b) { return same_bits(a, b) || (std::isnan(a) && std::isnan(b)); }
// Where two runs of values first differ by same_value, or -1 (one check for millions of values).
std::ptrdiff_t first_difference(std::span<const float> a, std::span<const float> b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_value(a[i], b[i])) return static_cast<std::ptrdiff_t>(i);
  return a.size() == b.size() ? -1 : static_cast<std::ptrdiff_t>(a.size());
}

// Device memory holding a copy of a host vector, and back.
template <class T>
struct DeviceVector {
  T* data = nullptr;
  std::size_t size = 0;
  explicit DeviceVector(std::size_t n) : size(n) { REQUIRE(cudaMalloc(&data, std::max<std::size_t>(n, 1) * sizeof(T)) == cudaSuccess); }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) {
    REQUIRE(cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);  // the codecs' stream does not wait for the default one
  }
  ~DeviceVector() { cudaFree(data); }
  DeviceVector(const DeviceVector&) = delete;
  std::vector<T> host() const {
    std::vector<T> out(size);
    REQUIRE(cudaMemcpy(out.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

// Holds `stream` at a host function until release() (at the latest when destroyed, which then
// waits for the stream): work queued behind it is certainly not done meanwhile. Nothing may wait
// for the whole device while it is closed.
class Gate {
 public:
  explicit Gate(cudaStream_t stream) : stream_(stream) {
    REQUIRE(cudaLaunchHostFunc(stream, [](void* gate) {
              while (!static_cast<Gate*>(gate)->open_.load()) std::this_thread::yield();
            }, this) == cudaSuccess);
  }
  ~Gate() {
    release();
    cudaStreamSynchronize(stream_);
  }
  void release() { open_.store(true); }

 private:
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};

template <class C>
void check_codec_matches(const C& codec) {
  for (std::size_t n : {0u, 1u, 31u, 256u, 1000u, 65536u, 65537u, 300000u}) {  // sum-tree edges: 256, 65536
    CAPTURE(n);
    const auto in = test::random_values(n, n);
    const DeviceVector<float> device_in(in);
    auto host_state = codec.make_state(n, DType::f32);
    auto device_state = codec.make_state(n, DType::f32);
    std::vector<std::byte> host_bytes(codec.max_encoded_bytes(n, DType::f32));
    DeviceVector<std::byte> device_bytes(host_bytes.size());
    cuda::Stream stream;
    for (int step = 0; step < 2; ++step) {  // the second encode draws from the next random stream
      const std::size_t host_used = codec.encode(std::span<const float>(in), host_state, host_bytes);
      const std::size_t device_used = cuda::encode(codec, device_state, device_in.data, n, device_bytes.data, stream);
      stream.synchronize();
      REQUIRE(device_used == host_used);
      const auto encoded = device_bytes.host();
      REQUIRE(std::memcmp(encoded.data(), host_bytes.data(), host_used) == 0);

      // Decoding, adding onto values already there, gives the same bits on both sides.
      auto host_out = test::random_values(n, 3);
      const DeviceVector<float> device_out(host_out);
      codec.decode(std::span<const std::byte>(host_bytes).first(host_used), std::span<float>(host_out), DecodeMode::add);
      cuda::decode(codec, device_bytes.data, device_used, device_out.data, n, DecodeMode::add, stream);
      stream.synchronize();
      const auto back = device_out.host();
      for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(back[i], host_out[i]));

      // And overwriting.
      codec.decode(std::span<const std::byte>(host_bytes).first(host_used), std::span<float>(host_out),
                   DecodeMode::overwrite);
      cuda::decode(codec, device_bytes.data, device_used, device_out.data, n, DecodeMode::overwrite, stream);
      stream.synchronize();
      const auto overwritten = device_out.host();
      for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(overwritten[i], host_out[i]));
    }
    // Values that do not start on a 16-byte boundary (a gradient inside a flat buffer) take the
    // kernels' one-value-at-a-time path, with the same bits.
    if (n > 1) {
      const std::span<const float> tail = std::span<const float>(in).subspan(1);
      auto host_state = codec.make_state(n - 1, DType::f32);
      auto device_state = codec.make_state(n - 1, DType::f32);
      const std::size_t used = codec.encode(tail, host_state, host_bytes);
      REQUIRE(cuda::encode(codec, device_state, device_in.data + 1, n - 1, device_bytes.data, stream) == used);
      stream.synchronize();
      const auto encoded = device_bytes.host();
      REQUIRE(std::memcmp(encoded.data(), host_bytes.data(), used) == 0);
      auto host_out = test::random_values(n, 5);
      const DeviceVector<float> device_out(host_out);
      codec.decode(std::span<const std::byte>(host_bytes).first(used), std::span<float>(host_out).subspan(1),
                   DecodeMode::add);
      cuda::decode(codec, device_bytes.data, used, device_out.data + 1, n - 1, DecodeMode::add, stream);
      stream.synchronize();
      const auto back = device_out.host();
      for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(back[i], host_out[i]));
    }
    // A header that does not match the destination is refused and nothing is written: a size
    // that does not fit at once, on the host; the rest by the kernel, thrown by synchronize().
    const DeviceVector<float> other(test::random_values(n + 1, 9));
    const auto before = other.host();
    CHECK_THROWS_AS((cuda::decode(codec, device_bytes.data, codec.max_encoded_bytes(n, DType::f32), other.data, n + 1,
                                  DecodeMode::overwrite, stream),
                     stream.synchronize()),
                    Error);
    const auto after = other.host();
    CHECK(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0);
  }
}
}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("a wrong header is found on the device: nothing written, thrown by synchronize(), stream fine after" *
            doctest::skip(no_device)) {
    // 1000 and 1001 two-bit values take the same bytes, so only the header's count differs.
    const compression::TwoBit codec;
    const auto in = test::random_values(1000, 4);
    const DeviceVector<float> device_in(in);
    DeviceVector<std::byte> encoded(codec.max_encoded_bytes(1000, DType::f32));
    REQUIRE(encoded.size == codec.max_encoded_bytes(1001, DType::f32));
    cuda::Stream stream;
    compression::TwoBit::State state;
    cuda::encode(codec, state, device_in.data, 1000, encoded.data, stream);
    const DeviceVector<float> wrong(test::random_values(1001, 5));
    const auto before = wrong.host();
    cuda::decode(codec, encoded.data, encoded.size, wrong.data, 1001, DecodeMode::add, stream);  // queued, no wait
    try {
      stream.synchronize();
      FAIL("the wrong count was not reported");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::protocol);
      CHECK_MESSAGE(std::string(e.what()).find("1000 values, where codec 3, format version 1, 1001 values") !=
                        std::string::npos,
                    e.what());
      CHECK(!e.context().bucket);  // no set_bucket() on this stream
    }
    const auto after = wrong.host();
    CHECK(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0);
    // The report is taken: the same stream decodes the right destination and synchronizes cleanly.
    const DeviceVector<float> right(std::vector<float>(1000));
    cuda::decode(codec, encoded.data, encoded.size, right.data, 1000, DecodeMode::overwrite, stream);
    stream.synchronize();
    std::vector<float> expected(1000);
    std::vector<std::byte> host_encoded(encoded.size);
    compression::TwoBit::State host_state;
    codec.encode(std::span<const float>(in), host_state, host_encoded);
    codec.decode(host_encoded, std::span<float>(expected), DecodeMode::overwrite);
    const auto decoded = right.host();
    for (std::size_t i = 0; i < expected.size(); ++i) REQUIRE(same_bits(decoded[i], expected[i]));
  }

  // Buckets' decodes queue on one stream and a fault is seen at the next synchronize(), which may
  // be for another bucket's work: the error names the bucket of the decode that found it, the
  // first of several.
  TEST_CASE("a decode fault names the bucket its decode was queued for" * doctest::skip(no_device)) {
    const compression::TwoBit codec;
    const DeviceVector<float> in(test::random_values(1000, 4));
    DeviceVector<std::byte> encoded(codec.max_encoded_bytes(1000, DType::f32));
    cuda::Stream stream;
    compression::TwoBit::State state;
    cuda::encode(codec, state, in.data, 1000, encoded.data, stream);
    const DeviceVector<float> fits(std::vector<float>(1000)), wrong(std::vector<float>(1001));
    stream.set_bucket(3);
    cuda::decode(codec, encoded.data, encoded.size, fits.data, 1000, DecodeMode::add, stream);
    stream.set_bucket(4);
    cuda::decode(codec, encoded.data, encoded.size, wrong.data, 1001, DecodeMode::add, stream);  // the first fault
    stream.set_bucket(5);
    cuda::decode(codec, encoded.data, encoded.size, wrong.data, 1001, DecodeMode::overwrite, stream);  // a second
    stream.set_bucket(6);
    cuda::decode(codec, encoded.data, encoded.size, fits.data, 1000, DecodeMode::add, stream);
    try {
      stream.synchronize();
      FAIL("the wrong count was not reported");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::protocol);
      CHECK(e.context().bucket == std::optional<std::uint32_t>(4));
      CHECK_MESSAGE(std::string(e.what()).find("bucket 4") != std::string::npos, e.what());
    }
    stream.synchronize();  // the report was taken with the first fault's
  }

  // A trainer's thread may drive several GPUs: a call of the library's for device 1 leaves the
  // thread's own device (0, in use) current. Needs two devices (the lent machines have one).
  TEST_CASE("the library's calls leave the caller's current device" * doctest::skip(cuda_device_count() < 2)) {
    const auto current = [] {
      int device = -1;
      REQUIRE(cudaGetDevice(&device) == cudaSuccess);
      return device;
    };
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaFree(nullptr) == cudaSuccess);  // device 0 in use: its context made
    {
      cuda::Stream stream(1);
      CHECK(current() == 0);
      auto* block = static_cast<std::byte*>(cuda::allocate_on_device(1 << 16, 1));
      CHECK(current() == 0);
      cuda::fill_zero(block, 1 << 16, stream);
      const compression::TwoBit codec;
      compression::TwoBit::State state;
      const std::size_t bytes = cuda::encode(codec, state, reinterpret_cast<float*>(block), 1000, block + 8192, stream);
      cuda::decode(codec, block + 8192, bytes, reinterpret_cast<float*>(block), 1000, DecodeMode::add, stream);
      CHECK(current() == 0);
      cuda::Event event;
      event.record_default_stream(1);
      event.order_before(stream);
      stream.synchronize();
      CHECK(current() == 0);
      stream.make_current();  // as gradsync's own threads do
      CHECK(current() == 1);
      cuda::free_on_device(block, 1);
    }
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
  }

  TEST_CASE("f16 and bf16 conversions give the host's bits on the device" * doctest::skip(no_device)) {
    // Every 16-bit pattern as a float, plus random values, ties, extremes and specials.
    std::vector<float> in = test::random_values(1 << 18, 11);
    for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
      in.push_back(numeric::from_f16_bits(static_cast<std::uint16_t>(bits)));
      in.push_back(numeric::float_of((bits << 16) | 0x8000u));  // bf16 ties
    }
    for (float v : {65504.0f, 65520.0f, 1e-8f, -0.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
      in.push_back(v);
    DeviceConversions device;
    const std::string error = convert_on_device(in, device);
    REQUIRE_MESSAGE(error.empty(), error);
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(device.f16[i] == numeric::f16_bits(in[i]));
      REQUIRE(device.bf16[i] == numeric::bf16_bits(in[i]));
      const auto pattern = static_cast<std::uint16_t>(i & 0xffffu);
      REQUIRE(same_bits(device.f16_back[i], numeric::from_f16_bits(pattern)));
      REQUIRE(same_bits(device.bf16_back[i], numeric::from_bf16_bits(pattern)));
    }
  }

  TEST_CASE("cuda::widen and cuda::narrow pack 16-bit gradients as detail::load and detail::store do" *
            doctest::skip(no_device)) {
    std::vector<float> values = test::random_values(100003, 5);
    for (float v : {65504.0f, 65520.0f, 1e-8f, -0.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
      values.push_back(v);
    for (DType dtype : {DType::f16, DType::bf16}) {
      CAPTURE(to_string(dtype));
      // A gradient of that dtype, as the host stores the values into it.
      std::vector<std::uint16_t> gradient(values.size());
      detail::store<float>(values, {gradient.data(), gradient.size(), dtype, Device::cpu()});
      std::vector<float> host_bucket(values.size());
      detail::load<float>({gradient.data(), gradient.size(), dtype, Device::cpu()}, std::span(host_bucket));

      const DeviceVector<std::uint16_t> device_gradient(gradient);
      DeviceVector<float> device_bucket(values.size());
      DeviceVector<std::uint16_t> narrowed(values.size());
      const DeviceVector<float> device_values(values);
      cuda::Stream stream;
      cuda::widen(device_gradient.data, dtype, device_bucket.data, values.size(), stream);
      cuda::narrow(device_values.data, dtype, narrowed.data, values.size(), stream);
      stream.synchronize();
      const auto widened = device_bucket.host();
      for (std::size_t i = 0; i < values.size(); ++i) REQUIRE(same_bits(widened[i], host_bucket[i]));
      REQUIRE(narrowed.host() == gradient);
    }
    cuda::Stream stream;
    float f = 0;
    CHECK_THROWS_AS(cuda::widen(&f, DType::f64, &f, 1, stream), Error);
  }

  TEST_CASE_TEMPLATE("device codecs write the CPU codecs' bytes and decode to the same values" * doctest::skip(no_device),
                     C, compression::Fp16, compression::Bf16, compression::TwoBit, compression::OneBit,
                     compression::TernGrad<2>, compression::TernGrad<4>, compression::TernGrad<8>,
                     compression::RandomK, compression::TopK) {
    if constexpr (std::is_same_v<C, compression::TwoBit>) check_codec_matches(C{.threshold = 0.3f});
    else if constexpr (std::is_same_v<C, compression::RandomK>) check_codec_matches(C{.keep = {.fraction = 0.05}, .seed = 4});
    else if constexpr (std::is_same_v<C, compression::TopK>) check_codec_matches(C{.keep = {.fraction = 0.05}});
    else if constexpr (requires(C c) { c.seed; }) check_codec_matches(C{.seed = 9});
    else check_codec_matches(C{});
  }

  // TernGrad runs the generic steps, the others fused kernels.
  TEST_CASE_TEMPLATE("error feedback on the device follows the CPU decorator step for step" * doctest::skip(no_device),
                     C, compression::TwoBit, compression::OneBit, compression::TernGrad<4>, compression::RandomK,
                     compression::TopK) {
    C codec;
    if constexpr (std::is_same_v<C, compression::TwoBit>) codec.threshold = 0.5f;
    else if constexpr (std::is_same_v<C, compression::RandomK>) codec = {.keep = {.fraction = 0.05}, .seed = 4};
    else if constexpr (std::is_same_v<C, compression::TopK>) codec = {.keep = {.fraction = 0.05}};
    else if constexpr (requires { codec.seed; }) codec.seed = 9;
    const compression::ErrorFeedback<C> decorated{codec};
    for (std::size_t n : {1u, 4099u, 300000u}) {  // 300000: the sum tree's second level
      CAPTURE(n);
      auto host_state = decorated.make_state(n, DType::f32);
      auto device_state = codec.make_state(n, DType::f32);
      DeviceVector<float> residual(std::vector<float>(n, 0.0f));
      std::vector<std::byte> host_bytes(codec.max_encoded_bytes(n, DType::f32));
      DeviceVector<std::byte> device_bytes(host_bytes.size());
      cuda::Stream stream;
      for (int step = 0; step < 5; ++step) {
        const auto g = test::random_values(n, 100 + static_cast<std::uint64_t>(step));
        const DeviceVector<float> device_g(g);
        const std::size_t used = decorated.encode(std::span<const float>(g), host_state, host_bytes);
        REQUIRE(cuda::encode_with_feedback(codec, device_state, device_g.data, residual.data, n, device_bytes.data,
                                           stream) == used);
        stream.synchronize();
        const auto encoded = device_bytes.host();
        REQUIRE(std::memcmp(encoded.data(), host_bytes.data(), used) == 0);
        const auto r = residual.host();
        for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(r[i], host_state.residual_f32[i]));
      }
    }
  }

  // Values of few magnitudes, so that the k-th largest is shared by many spread over many tiles:
  // the device must keep the same lowest-indexed ones the CPU keeps, with and without error
  // feedback, and decode them to the same bits. The larger run takes more tiles than one block of
  // the tile scan covers and more values than one pass of the histogram's grid, among them
  // infinities, NaNs, zeros of both signs and denormals.
  TEST_CASE("TopK on the device keeps the CPU's picks among equal magnitudes" * doctest::skip(no_device)) {
    for (std::size_t n : {std::size_t{100003}, std::size_t{3000017}}) {
      std::vector<float> in(n);
      for (std::size_t i = 0; i < n; ++i)
        in[i] = static_cast<float>(static_cast<int>((i * 7919) % 9) - 4) * 0.25f;  // 0, ±0.25 .. ±1, n/9 each
      in[n / 2] = 3.0f;
      in[n - 1] = -3.0f;
      if (n > 1000000)
        for (std::size_t i = 0; i < n; i += 4099)
          in[i] = std::array{std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN(),
                             -0.0f, std::numeric_limits<float>::denorm_min(), 1.0f}[(i / 4099) % 5];
      const DeviceVector<float> device_in(in);
      cuda::Stream stream;
      // k: the largest alone, into the equals, and on to everything.
      for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5000}, 2 * (n / 9),
                            6 * (n / 10), n}) {
        CAPTURE(n);
        CAPTURE(k);
        const compression::TopK codec{.keep = {.count = k}};
        compression::TopK::State state;
        std::vector<std::byte> host_bytes(codec.max_encoded_bytes(n, DType::f32));
        const std::size_t used = codec.encode(std::span<const float>(in), state, host_bytes);
        DeviceVector<std::byte> device_bytes(host_bytes.size());
        REQUIRE(cuda::encode(codec, state, device_in.data, n, device_bytes.data, stream) == used);
        stream.synchronize();
        REQUIRE(std::memcmp(device_bytes.host().data(), host_bytes.data(), used) == 0);

        std::vector<float> host_out(n);
        codec.decode(host_bytes, std::span<float>(host_out), DecodeMode::overwrite);
        DeviceVector<float> device_out(n);
        cuda::decode(codec, device_bytes.data, used, device_out.data, n, DecodeMode::overwrite, stream);
        stream.synchronize();
        const auto decoded = device_out.host();
        REQUIRE(first_difference(decoded, host_out) == -1);

        // Twice with error feedback: the second selection runs over what the first left behind.
        // p = residual + g is computed, so a NaN among the values sent may differ in its bits.
        const compression::ErrorFeedback<compression::TopK> decorated{codec};
        auto host_state = decorated.make_state(n, DType::f32);
        DeviceVector<float> residual(std::vector<float>(n, 0.0f));
        for (int step = 0; step < 2; ++step) {
          REQUIRE(decorated.encode(std::span<const float>(in), host_state, host_bytes) == used);
          REQUIRE(cuda::encode_with_feedback(codec, state, device_in.data, residual.data, n, device_bytes.data,
                                             stream) == used);
          stream.synchronize();
          const auto encoded = device_bytes.host();
          const std::size_t values_at = compression::header_bytes + 4 + 4 * k;
          REQUIRE(std::memcmp(encoded.data(), host_bytes.data(), values_at) == 0);  // header, count, indices
          std::vector<float> device_values(k), host_values(k);
          std::memcpy(device_values.data(), encoded.data() + values_at, 4 * k);
          std::memcpy(host_values.data(), host_bytes.data() + values_at, 4 * k);
          REQUIRE(first_difference(device_values, host_values) == -1);
          REQUIRE(first_difference(residual.host(), host_state.residual_f32) == -1);
        }
      }
    }
  }

  // A forged encoding of the right size: the count, an index past the end, indices out of order.
  // The device finds each before writing anything, names it, and the stream goes on.
  TEST_CASE("TopK's decode on the device refuses forged counts and indices and writes nothing" *
            doctest::skip(no_device)) {
    const std::size_t n = 5000;
    const compression::TopK codec{.keep = {.count = 40}};
    const auto in = test::random_values(n, 21);
    std::vector<std::byte> good(codec.max_encoded_bytes(n, DType::f32));
    compression::TopK::State state;
    REQUIRE(codec.encode(std::span<const float>(in), state, good) == good.size());
    const auto forged = [&](std::size_t offset, std::uint32_t word) {
      std::vector<std::byte> bytes = good;
      std::memcpy(bytes.data() + offset, &word, 4);
      return bytes;
    };
    const std::size_t indices = compression::header_bytes + 4;
    std::uint32_t third;
    std::memcpy(&third, good.data() + indices + 8, 4);
    const std::pair<std::vector<std::byte>, std::string> cases[] = {
        {forged(compression::header_bytes, 41), "keeps 41 values, where the codec keeps 40"},
        {forged(indices + 4 * 39, static_cast<std::uint32_t>(n)), "index 5000 at position 39, out of range or order"},
        {forged(indices + 4 * 3, third), fmt::format("index {} at position 3, out of range or order", third)},
    };
    cuda::Stream stream;
    const DeviceVector<float> out(test::random_values(n, 22));
    const auto before = out.host();
    for (const auto& [bytes, message] : cases) {
      CAPTURE(message);
      const DeviceVector<std::byte> device_bytes(bytes);
      for (DecodeMode mode : {DecodeMode::add, DecodeMode::overwrite}) {
        cuda::decode(codec, device_bytes.data, bytes.size(), out.data, n, mode, stream);
        try {
          stream.synchronize();
          FAIL("the forged encoding was decoded");
        } catch (const Error& e) {
          CHECK(e.kind() == ErrorKind::protocol);
          CHECK_MESSAGE(std::string(e.what()).find(message) != std::string::npos, e.what());
        }
        const auto after = out.host();
        REQUIRE(std::memcmp(before.data(), after.data(), n * sizeof(float)) == 0);
      }
    }
    const DeviceVector<std::byte> device_good(good);
    cuda::decode(codec, device_good.data, good.size(), out.data, n, DecodeMode::overwrite, stream);
    stream.synchronize();
    std::vector<float> expected(n);
    codec.decode(good, std::span<float>(expected), DecodeMode::overwrite);
    const auto decoded = out.host();
    for (std::size_t i = 0; i < n; ++i) REQUIRE(same_bits(decoded[i], expected[i]));
  }

  // cudaErrorNotReady from a query stays as the thread's last error, which the kernels' launch
  // checks read: neither this library's own query (Event::done) nor a trainer's on the same thread
  // may make the next launch fail.
  TEST_CASE("a query of work not yet done leaves nothing for the next kernel launch to report" *
            doctest::skip(no_device)) {
    cuda::Stream busy, other;
    const compression::TwoBit codec{.threshold = 0.3f};
    compression::TwoBit::State state;
    const auto in = test::random_values(4096, 8);
    const DeviceVector<float> device_in(in);
    DeviceVector<std::byte> encoded(codec.max_encoded_bytes(in.size(), DType::f32));
    Gate gate(static_cast<cudaStream_t>(busy.native()));
    cuda::Event event;
    event.record(busy);
    REQUIRE_FALSE(event.done());
    CHECK(cudaPeekAtLastError() == cudaSuccess);
    CHECK_NOTHROW(cuda::encode(codec, state, device_in.data, in.size(), encoded.data, other));
    REQUIRE(cudaStreamQuery(static_cast<cudaStream_t>(busy.native())) == cudaErrorNotReady);  // the trainer's
    CHECK_NOTHROW(cuda::encode(codec, state, device_in.data, in.size(), encoded.data, other));
    other.synchronize();
    gate.release();
    busy.synchronize();
    CHECK(event.done());
  }

  // A backward pass on the default stream, still running when its gradient is marked ready: the
  // Synchronizer's packing on a device transport's stream follows the mark ready() records there.
  TEST_CASE("work ordered after a mark on the default stream sees what was queued there" *
            doctest::skip(no_device)) {
    const std::size_t n = 1 << 20;
    const DeviceVector<float> gradient(std::vector<float>(n, 0.0f));
    const DeviceVector<float> packed(n);
    cuda::Stream stream;
    cuda::Event mark;
    {
      Gate gate(cudaStreamLegacy);  // the backward pass is not done until the gate opens
      REQUIRE(cudaMemsetAsync(gradient.data, 0x3f, n * sizeof(float), cudaStreamLegacy) == cudaSuccess);
      mark.record_default_stream(stream.device());
      mark.order_before(stream);
      cuda::copy(packed.data, gradient.data, n * sizeof(float), stream);
    }
    stream.synchronize();
    const auto back = packed.host();
    float written;
    std::memset(&written, 0x3f, sizeof written);
    CHECK(std::count_if(back.begin(), back.end(), [&](float v) { return same_bits(v, written); }) ==
          static_cast<std::ptrdiff_t>(n));
  }
}
