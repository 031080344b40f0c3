// bench/codecs — encode and decode throughput of every codec on this CPU (one thread) and, where
// gradsync was built with CUDA and a device is present, on the GPU (device buffers, one stream;
// beside a device-to-device copy of the same bytes), in GB/s of f32 input, with the compression
// ratio.
//
//   codecs [--min-mib M] [--max-mib M] [--step-factor F] [--iters I] [--codec NAME...] [--on cpu|gpu|both]
//          [--json PATH]
//
// Input is normally distributed (sigma 0.1, inside TwoBit's default threshold for most values,
// as gradients are); each figure is the median of --iters runs after one warm-up. Error-feedback
// variants include their residual update in the encode time.

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <chrono>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "toolkit/codec_by_name.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

#if GRADSYNC_HAS_CUDA
#include <cuda_runtime.h>

#include "gradsync/cuda/codecs.hpp"
#endif

namespace {

using namespace gradsync;
namespace tk = gradsync::toolkit;
using Clock = std::chrono::steady_clock;

struct Config {
  std::size_t min_mib = 1;
  std::size_t max_mib = 64;
  std::size_t step_factor = 8;
  int iters = 10;
  std::vector<std::string> codecs = tk::codec_names;
  std::string on = "both";  // which tables: a lent GPU machine's time is too dear for the CPU one
  std::string json;
};

struct Row {
  std::string codec;
  std::size_t bytes = 0;
  double encode_GBps = 0, decode_GBps = 0, ratio = 0;
  std::string device = "cpu";
  double copy_GBps = 0;  // GPU: a device-to-device copy of the same bytes
};

std::vector<float> normal_input(std::size_t n) {
  std::vector<float> input(n);
  std::mt19937_64 gen(1);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (float& v : input) v = normal(gen);
  return input;
}

template <class Codec>
Row measure(const std::string& name, std::size_t bytes, int iters, const Codec& codec) {
  const std::size_t n = bytes / sizeof(float);
  const std::vector<float> input = normal_input(n);
  std::vector<float> output(n);
  auto state = codec.make_state(n, DType::f32);
  std::vector<std::byte> encoded(codec.max_encoded_bytes(n, DType::f32));
  std::vector<double> encode_s, decode_s;
  std::size_t used = 0;
  for (int i = 0; i <= iters; ++i) {
    const auto t0 = Clock::now();
    used = codec.encode(std::span<const float>(input), state, encoded);
    const auto t1 = Clock::now();
    codec.decode(std::span<const std::byte>(encoded).first(used), std::span<float>(output), DecodeMode::overwrite);
    const auto t2 = Clock::now();
    if (i == 0) continue;  // warm-up: first touch of the buffers
    encode_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    decode_s.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  const double b = static_cast<double>(n * sizeof(float));
  return {name, n * sizeof(float), b / tk::median(encode_s) / 1e9, b / tk::median(decode_s) / 1e9, b / static_cast<double>(used)};
}

#if GRADSYNC_HAS_CUDA
// Which codecs have a device path (cuda/codecs.hpp); error feedback runs over its codec's.
template <class Codec>
constexpr bool on_device = requires(const Codec& c, typename Codec::State& s, const float* in, std::byte* out,
                                    cuda::Stream& stream) { cuda::encode(c, s, in, std::size_t{1}, out, stream); };
template <class C>
constexpr bool on_device<compression::ErrorFeedback<C>> = on_device<C>;

// Owns device memory for the benchmark.
template <class T>
struct DeviceBuffer {
  T* data = nullptr;
  explicit DeviceBuffer(std::size_t n) {
    if (cudaMalloc(&data, std::max<std::size_t>(n, 1) * sizeof(T)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
};

template <class Codec>
std::optional<Row> measure_device(const std::string& name, std::size_t bytes, int iters, const Codec& codec,
                                  cuda::Stream& stream) {
  if constexpr (!on_device<Codec>) {
    return std::nullopt;
  } else {
    const std::size_t n = bytes / sizeof(float);
    const std::vector<float> input = normal_input(n);
    DeviceBuffer<float> in(n), out(n), residual(n);
    DeviceBuffer<std::byte> encoded(codec.max_encoded_bytes(n, DType::f32));
    cudaMemcpy(in.data, input.data(), bytes, cudaMemcpyHostToDevice);
    cudaMemset(residual.data, 0, bytes);
    auto state = codec.make_state(n, DType::f32);
    const auto timed = [&](auto&& f) {
      const auto start = Clock::now();
      f();
      stream.synchronize();
      return std::chrono::duration<double>(Clock::now() - start).count();
    };
    std::vector<double> encode_s, decode_s, copy_s;
    std::size_t used = 0;
    for (int i = 0; i <= iters; ++i) {
      const double e = timed([&] {
        if constexpr (requires { codec.codec; })
          used = cuda::encode_with_feedback(codec.codec, state.inner, in.data, residual.data, n, encoded.data, stream);
        else
          used = cuda::encode(codec, state, in.data, n, encoded.data, stream);
      });
      const double d = timed([&] {
        if constexpr (requires { codec.codec; })
          cuda::decode(codec.codec, encoded.data, used, out.data, n, DecodeMode::overwrite, stream);
        else
          cuda::decode(codec, encoded.data, used, out.data, n, DecodeMode::overwrite, stream);
      });
      const double c = timed([&] {
        cudaMemcpyAsync(out.data, in.data, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream.native()));
      });
      if (i == 0) continue;  // warm-up
      encode_s.push_back(e);
      decode_s.push_back(d);
      copy_s.push_back(c);
    }
    const double b = static_cast<double>(bytes);
    return Row{name, bytes, b / tk::median(encode_s) / 1e9, b / tk::median(decode_s) / 1e9, b / static_cast<double>(used),
               "cuda", b / tk::median(copy_s) / 1e9};
  }
}
#endif

void declare_options(CLI::App& app, Config& cfg) {
  // Sizes in MiB must stay representable in bytes.
  const tk::Bounds<std::size_t> mib{.low = 1, .high = std::numeric_limits<std::size_t>::max() >> 20};
  tk::add_number(app, "--min-mib", cfg.min_mib, "the first input size, in MiB", mib);
  tk::add_number(app, "--max-mib", cfg.max_mib, "no input size beyond this, in MiB", mib);
  tk::add_number(app, "--step-factor", cfg.step_factor, "each size is the one before times this", {.low = 2});
  tk::add_number(app, "--iters", cfg.iters, "timed runs of each codec and size, after one warm-up", {.low = 1});
  app.add_option("--codec", cfg.codecs, "the codecs to measure (default: every one)")->check(CLI::IsMember(tk::codec_names));
  app.add_option("--on", cfg.on, "measure on the cpu, the gpu or both (default)")
      ->check(CLI::IsMember({"cpu", "gpu", "both"}));
  app.add_option("--json", cfg.json, "also write the rows as JSON to this file");
}

// The CPU table: one thread, every codec and size.
void cpu_table(const Config& cfg, std::vector<Row>& rows) {
  fmt::print("# gradsync codecs on the CPU, one thread, f32 input N(0, 0.1); median of {} runs\n#\n", cfg.iters);
  fmt::print("# {:>12} {:>12} {:>10} {:>10} {:>8}\n", "codec", "size (B)", "encode", "decode", "ratio");
  fmt::print("# {:>12} {:>12} {:>10} {:>10} {:>8}\n", "", "", "(GB/s)", "(GB/s)", "");
  for (const std::string& name : cfg.codecs)
    for (std::size_t bytes = cfg.min_mib << 20; bytes <= cfg.max_mib << 20; bytes *= cfg.step_factor) {
      const Row r = tk::with_codec(name, {}, [&](const auto& codec) { return measure(name, bytes, cfg.iters, codec); });
      fmt::print("  {:>12} {:>12} {:>10.2f} {:>10.2f} {:>8.1f}\n", r.codec, r.bytes, r.encode_GBps, r.decode_GBps, r.ratio);
      std::fflush(stdout);
      rows.push_back(r);
    }
}

// The GPU table: device 0, the codecs with a device path, beside a device-to-device copy.
void gpu_table(const Config& cfg, std::vector<Row>& rows) {
#if GRADSYNC_HAS_CUDA
  if (cuda::device_count() == 0) {
    fmt::print("# no CUDA device: GPU figures need a machine with one\n");
    return;
  }
  cudaDeviceProp properties{};
  cudaGetDeviceProperties(&properties, 0);
  cuda::Stream stream;
  fmt::print("#\n# on the GPU ({}), device buffers, one stream; copy: cudaMemcpy device to device of the input\n#\n",
             properties.name);
  fmt::print("# {:>12} {:>12} {:>10} {:>10} {:>8} {:>10} {:>9} {:>9}\n", "codec", "size (B)", "encode", "decode",
             "ratio", "copy", "enc/copy", "dec/copy");
  fmt::print("# {:>12} {:>12} {:>10} {:>10} {:>8} {:>10} {:>9} {:>9}\n", "", "", "(GB/s)", "(GB/s)", "", "(GB/s)", "",
             "");
  for (const std::string& name : cfg.codecs)
    for (std::size_t bytes = cfg.min_mib << 20; bytes <= cfg.max_mib << 20; bytes *= cfg.step_factor) {
      const auto r = tk::with_codec(
          name, {}, [&](const auto& codec) { return measure_device(name, bytes, cfg.iters, codec, stream); });
      if (!r) continue;  // no device path
      fmt::print("  {:>12} {:>12} {:>10.1f} {:>10.1f} {:>8.1f} {:>10.1f} {:>9.2f} {:>9.2f}\n", r->codec, r->bytes,
                 r->encode_GBps, r->decode_GBps, r->ratio, r->copy_GBps, r->encode_GBps / r->copy_GBps,
                 r->decode_GBps / r->copy_GBps);
      std::fflush(stdout);
      rows.push_back(*r);
    }
#else
  (void)cfg, (void)rows;
  fmt::print("# built without CUDA: no GPU table\n");
#endif
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("Encode and decode throughput of every codec, on this CPU (one thread) and on a CUDA device", "codecs");
  declare_options(app, cfg);
  if (!tk::parse_options(app, argc, argv)) return 0;
  if (cfg.min_mib > cfg.max_mib) throw std::invalid_argument("--min-mib must not exceed --max-mib");
  std::vector<Row> rows;
  if (cfg.on != "gpu") cpu_table(cfg, rows);
  if (cfg.on != "cpu") gpu_table(cfg, rows);
  if (!cfg.json.empty()) {
    tk::Json json = tk::Json::array();
    for (const Row& r : rows)
      json.push_back({{"codec", r.codec},
                      {"bytes", r.bytes},
                      {"device", r.device},
                      {"encode_GBps", tk::rounded(r.encode_GBps, 3)},
                      {"decode_GBps", tk::rounded(r.decode_GBps, 3)},
                      {"ratio", tk::rounded(r.ratio, 2)},
                      {"copy_GBps", tk::rounded(r.copy_GBps, 3)}});
    tk::write_json(cfg.json, json);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "codecs: %s\n", e.what());
  return 2;
}
