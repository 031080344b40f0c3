// The Synchronizer on gradients in CUDA device memory: several processes sharing one GPU, over
// Tcp (loopback) and SharedMemory, end every iteration with the bits the same gradients in host
// memory give, for f32, f64, f16 and bf16 gradients, several codecs and every topology, and the
// same bits on every rank; and so does the exchange on the device (transport::CudaStaged: buckets
// on the GPU, the codecs as kernels) for f32, f16 and bf16 gradients, through host mirrors or,
// between processes on the one GPU over SharedMemory, through CUDA IPC. Skipped, with the reason printed, where no
// CUDA device is present.
//
// The test process itself never touches CUDA, since a forked child cannot use a context its
// parent made: children probe for the device and do all the CUDA work.

#include <doctest/doctest.h>

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <random>

#include "gradsync/cuda/codecs.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/cuda_staged.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "gradsync/transport/tcp.hpp"
#include "cuda_probe.hpp"
#include "processes.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

const bool no_device = test::no_cuda_device("the device Synchronizer tests are");

constexpr const char* token = "cuda-sync-test-token";

struct Gradient {
  std::size_t count;
  DType dtype;
};

// The gradients every case registers: packed into buckets of several (FixedSize, small caps),
// of every dtype the codec takes, at sizes that are not multiples of anything.
std::vector<Gradient> gradients(bool with_f64) {
  std::vector<Gradient> g{{1000, DType::f32}, {301, DType::f16}, {257, DType::bf16}, {4099, DType::f32},
                          {17, DType::f16}};
  if (with_f64) g.push_back({515, DType::f64});
  return g;
}

// Rank r's value e of gradient g in iteration i, as bytes of its dtype: gradient-like, different
// on every rank and iteration.
std::vector<std::byte> input(const Gradient& g, int rank, int iteration, std::size_t which) {
  std::mt19937_64 random(static_cast<std::uint64_t>(rank) * 1000003u + static_cast<std::uint64_t>(iteration) * 7919u + which);
  std::normal_distribution<double> normal(0.0, 0.05);
  std::vector<std::byte> bytes(g.count * size_of(g.dtype));
  for (std::size_t e = 0; e < g.count; ++e) {
    const double v = normal(random);
    switch (g.dtype) {
      case DType::f32: {
        const float f = static_cast<float>(v);
        std::memcpy(&bytes[e * 4], &f, 4);
        break;
      }
      case DType::f64: std::memcpy(&bytes[e * 8], &v, 8); break;
      case DType::f16: {
        const std::uint16_t h = numeric::f16_bits(static_cast<float>(v));
        std::memcpy(&bytes[e * 2], &h, 2);
        break;
      }
      case DType::bf16: {
        const std::uint16_t h = numeric::bf16_bits(static_cast<float>(v));
        std::memcpy(&bytes[e * 2], &h, 2);
        break;
      }
    }
  }
  return bytes;
}

// Runs three iterations with the gradients in host memory (on_device false) or in device memory,
// and returns every iteration's averages, as bytes.
template <class C, class T, class X>
std::vector<std::byte> run(X transport, int rank, bool on_device, const C& codec, const T& topology,
                           const std::vector<Gradient>& layout, Executor executor = Executor::task_graph) {
  Synchronizer<bucketing::FixedSize, C, T, X> sync(std::move(transport), {.timeout = 30s, .executor = executor},
                                                   {.cap_bytes = 8192, .first_cap_bytes = 2048}, codec, topology);
  std::vector<std::vector<std::byte>> host(layout.size());
  std::vector<void*> device(layout.size(), nullptr);
  for (std::size_t g = 0; g < layout.size(); ++g) {
    host[g].resize(layout[g].count * size_of(layout[g].dtype));
    if (on_device && cudaMalloc(&device[g], host[g].size()) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    sync.add("g" + std::to_string(g), {on_device ? device[g] : host[g].data(), layout[g].count, layout[g].dtype,
                                       on_device ? Device::cuda(0) : Device::cpu()});
  }
  std::vector<std::byte> results;
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (std::size_t g = layout.size(); g-- > 0;) {  // backward order
      const std::vector<std::byte> values = input(layout[g], rank, iteration, g);
      std::memcpy(host[g].data(), values.data(), values.size());  // in place: the Synchronizer holds its address
      if (on_device && cudaMemcpy(device[g], host[g].data(), host[g].size(), cudaMemcpyHostToDevice) != cudaSuccess)
        throw std::runtime_error("cudaMemcpy");
      sync.ready(static_cast<GradId>(g));
    }
    sync.wait();
    for (std::size_t g = 0; g < layout.size(); ++g) {
      if (on_device && cudaMemcpy(host[g].data(), device[g], host[g].size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        throw std::runtime_error("cudaMemcpy");
      results.insert(results.end(), host[g].begin(), host[g].end());
    }
  }
  for (void* p : device) cudaFree(p);
  return results;
}

std::string digest(const std::vector<std::byte>& bytes) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (std::byte b : bytes) h = (h ^ static_cast<std::uint8_t>(b)) * 1099511628211ull;
  return fmt::format("{:016x}", h);
}

// f32 gradients at sizes that are not multiples of anything.
std::vector<Gradient> f32_gradients() { return {{1000, DType::f32}, {4099, DType::f32}, {17, DType::f32}, {3001, DType::f32}}; }

// How the device path runs in device_matches_host.
enum class DevicePath {
  host_buckets,  // device gradients staged through host buckets, every dtype the codec takes
  staged,        // the exchange on the device (CudaStaged: buckets on the GPU, codecs as kernels)
  ipc,           // the same, device to device between the processes (CudaStaged with ipc)
};

// Each rank runs the device path, then the host path, over a fresh transport each time; it
// reports "digest <hex>" if they agree bit for bit, and the ranks' digests must all be equal.
// The exchange on the device takes f32, f16 and bf16 gradients and runs on `executor`.
template <class C, class T>
void device_matches_host(const std::string& what, const C& codec, const T& topology,
                         DevicePath path = DevicePath::host_buckets, Executor executor = Executor::task_graph) {
  const bool staged = path != DevicePath::host_buckets;
  const std::vector<Gradient> layout = gradients(!staged && CodecFor<C, double>);  // the device path reduces in f32
  for (const bool shared_memory : {false, true})
    for (const int n : {2, 4}) {
      CAPTURE(what);
      CAPTURE(shared_memory);
      CAPTURE(n);
      const std::uint16_t ports[2] = {test::free_port(), test::free_port()};
      const std::string job = fmt::format("cuda-sync-{}-{}", ::getpid(), std::random_device{}());
      const auto results = test::run_processes(n, [&](int rank) -> std::string {
        if (cudaSetDevice(0) != cudaSuccess) return "cudaSetDevice failed";
        std::vector<std::byte> outcome[2];
        for (int pass = 0; pass < 2; ++pass) {
          const bool on_device = pass == 0;
          const auto over = [&](auto transport) {
            if (staged && on_device) {
              transport::CudaStaged<decltype(transport)> device(std::move(transport), 0,
                                                                {.ipc = path == DevicePath::ipc});
              // Tcp holds a message behind an unmatched one, so it stages even with ipc on.
              if (device.ipc_peers() != (path == DevicePath::ipc && shared_memory ? n - 1 : 0))
                throw std::runtime_error(fmt::format("{} peers through CUDA IPC ({})", device.ipc_peers(),
                                                     device.ipc_fallback()));
              return run(std::move(device), rank, true, codec, topology, layout, executor);
            }
            return run(std::move(transport), rank, on_device, codec, topology, layout);
          };
          if (shared_memory)
            outcome[pass] = over(transport::SharedMemory({.local_rank = rank, .local_size = n,
                                                          .job = job + std::to_string(pass), .token = token,
                                                          .setup_timeout = 30s}));
          else
            outcome[pass] = over(transport::Tcp({.rank = rank, .world_size = n, .master_port = ports[pass],
                                                 .token = token, .setup_timeout = 30s}));
        }
        if (outcome[0] != outcome[1]) {
          std::size_t at = 0;
          while (outcome[0][at] == outcome[1][at]) ++at;
          return fmt::format("device and host results differ from byte {} of {}", at, outcome[0].size());
        }
        return "digest " + digest(outcome[0]);
      });
      for (const auto& r : results) {
        CAPTURE(r.report);
        CHECK(r.report.starts_with("digest "));
        CHECK(r.report == results[0].report);
      }
    }
}

// The exchange on the device (CudaStaged, through host mirrors or CUDA IPC) on `executor`, for
// several codecs and every topology.
void staged_matches_host(DevicePath path, Executor executor) {
  device_matches_host("none", compression::None{}, topology::Ring{.chunk_elements = 512}, path, executor);
  device_matches_host("fp16", compression::Fp16{}, topology::Ring{.chunk_elements = 512}, path, executor);
  device_matches_host("ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{}, topology::Ring{}, path, executor);
  device_matches_host("ef-one-bit", compression::ErrorFeedback<compression::OneBit>{},
                      topology::ParameterServer{.chunk_elements = 512}, path, executor);
  device_matches_host("two-bit", compression::TwoBit{}, topology::ParameterServer{}, path, executor);
  device_matches_host("random-k", compression::RandomK{},
                      topology::Hierarchical{.ranks_per_machine = 2, .chunk_elements = 512}, path, executor);
  device_matches_host("ef-top-k", compression::ErrorFeedback<compression::TopK>{.codec = {.keep = {.fraction = 0.05}}},
                      topology::Ring{.chunk_elements = 512}, path, executor);
}

// Rank `rank` of three synchronizes ef-two-bit device gradients over CudaStaged<X>; rank 2 dies
// (exit status 3) at its third iteration. Returns "finished" if the others somehow get through.
template <class X>
std::string die_at_iteration_two(X transport, int rank, Executor executor, bool ipc) {
  using Staged = transport::CudaStaged<X>;
  Staged staged(std::move(transport), 0, {.ipc = ipc});
  if (ipc && staged.ipc_peers() != 2)
    return fmt::format("{} peers through CUDA IPC ({})", staged.ipc_peers(), staged.ipc_fallback());
  Synchronizer<bucketing::FixedSize, compression::ErrorFeedback<compression::TwoBit>, topology::Ring, Staged> sync(
      std::move(staged), {.timeout = 20s, .executor = executor}, {.cap_bytes = 8192, .first_cap_bytes = 2048}, {},
      topology::Ring{.chunk_elements = 256});
  const std::vector<Gradient> layout = f32_gradients();
  std::vector<void*> device(layout.size(), nullptr);
  for (std::size_t g = 0; g < layout.size(); ++g) {
    if (cudaMalloc(&device[g], layout[g].count * sizeof(float)) != cudaSuccess) return "cudaMalloc failed";
    sync.add("g" + std::to_string(g), view(std::span(static_cast<float*>(device[g]), layout[g].count), Device::cuda(0)));
  }
  for (int iteration = 0; iteration < 5; ++iteration) {
    if (rank == 2 && iteration == 2) ::_exit(3);
    for (std::size_t g = 0; g < layout.size(); ++g) {
      const std::vector<std::byte> values = input(layout[g], rank, iteration, g);
      if (cudaMemcpy(device[g], values.data(), values.size(), cudaMemcpyHostToDevice) != cudaSuccess)
        return "cudaMemcpy failed";
      sync.ready(static_cast<GradId>(g));
    }
    sync.wait();
  }
  return "finished";
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("device gradients give the host path's bits on every rank: ring" * doctest::skip(no_device)) {
    device_matches_host("none", compression::None{}, topology::Ring{.chunk_elements = 512});
    device_matches_host("fp16", compression::Fp16{}, topology::Ring{.chunk_elements = 512});
    device_matches_host("ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{}, topology::Ring{});
    device_matches_host("top-k", compression::TopK{}, topology::Ring{});
  }

  TEST_CASE("device gradients give the host path's bits on every rank: parameter server" * doctest::skip(no_device)) {
    device_matches_host("none", compression::None{}, topology::ParameterServer{.chunk_elements = 512});
    device_matches_host("ef-one-bit", compression::ErrorFeedback<compression::OneBit>{}, topology::ParameterServer{});
  }

  TEST_CASE("device gradients give the host path's bits on every rank: hierarchical" * doctest::skip(no_device)) {
    device_matches_host("bf16", compression::Bf16{}, topology::Hierarchical{.ranks_per_machine = 2, .chunk_elements = 512});
  }

  TEST_CASE("the exchange on the device (CudaStaged over Tcp and SharedMemory), serial: the host path's bits" *
            doctest::skip(no_device)) {
    staged_matches_host(DevicePath::staged, Executor::serial);
  }

  TEST_CASE("the exchange on the device (CudaStaged over Tcp and SharedMemory), task graph: the host path's bits" *
            doctest::skip(no_device)) {
    staged_matches_host(DevicePath::staged, Executor::task_graph);
  }

  TEST_CASE("processes on one GPU exchange through CUDA IPC (CudaStaged with ipc), serial: the host path's bits" *
            doctest::skip(no_device)) {
    staged_matches_host(DevicePath::ipc, Executor::serial);
  }

  TEST_CASE("processes on one GPU exchange through CUDA IPC (CudaStaged with ipc), task graph: the host path's bits" *
            doctest::skip(no_device)) {
    staged_matches_host(DevicePath::ipc, Executor::task_graph);
  }

  TEST_CASE("a rank without CudaStaged's ipc option is named at setup" * doctest::skip(no_device)) {
    // Rank 0 asks for CUDA IPC, rank 1 does not: rank 0 must fail within its setup timeout with an
    // Error that says the option must be alike; rank 1 goes on and fails once rank 0 is gone.
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      if (cudaSetDevice(0) != cudaSuccess) return "cudaSetDevice failed";
      using Staged = transport::CudaStaged<transport::Tcp>;
      Staged staged(transport::Tcp({.rank = rank, .world_size = 2, .master_port = port, .token = token,
                                    .setup_timeout = 30s}),
                    0, {.ipc = rank == 0, .setup_timeout = 3s});
      run(std::move(staged), rank, true, compression::None{}, topology::Ring{}, f32_gradients());
      return "finished";
    });
    CAPTURE(results[0].report);
    CHECK(results[0].report.starts_with("error timeout"));
    CHECK(results[0].report.find("ipc option must be on for every rank") != std::string::npos);
    CHECK_FALSE(results[1].ok());
  }

  TEST_CASE("a rank that dies fails the others fast on the device path (CudaStaged)" * doctest::skip(no_device)) {
    // Three processes, buckets on the GPU, ef-two-bit in small pieces; rank 2 dies after its
    // second synchronization. The others must fail with peer_failed naming it (a timeout would
    // mean they waited out the 20 s instead, a send held back for its copy or its acknowledgement
    // included): through host mirrors over Tcp, and through CUDA IPC over SharedMemory.
    for (const Executor executor : {Executor::serial, Executor::task_graph})
      for (const bool ipc : {false, true}) {
        CAPTURE(executor == Executor::serial ? "serial" : "task graph");
        CAPTURE(ipc);
        const std::uint16_t port = test::free_port();
        const std::string job = fmt::format("cuda-sync-dies-{}-{}", ::getpid(), std::random_device{}());
        const auto results = test::run_processes(3, [&](int rank) -> std::string {
          if (cudaSetDevice(0) != cudaSuccess) return "cudaSetDevice failed";
          if (ipc)
            return die_at_iteration_two(transport::SharedMemory({.local_rank = rank, .local_size = 3, .job = job,
                                                                 .token = token, .setup_timeout = 30s}),
                                        rank, executor, true);
          return die_at_iteration_two(transport::Tcp({.rank = rank, .world_size = 3, .master_port = port,
                                                      .token = token, .setup_timeout = 30s}),
                                      rank, executor, false);
        });
        CHECK(WIFEXITED(results[2].status));
        CHECK(WEXITSTATUS(results[2].status) == 3);
        for (int r : {0, 1}) {
          const std::string& report = results[static_cast<std::size_t>(r)].report;
          CAPTURE(r);
          CAPTURE(report);
          CHECK(report.starts_with("error peer failed"));
          CHECK(report.find("peer 2") != std::string::npos);
        }
      }
  }

  TEST_CASE("a gradient the device does not hold is refused at add()" * doctest::skip(no_device)) {
    const auto results = test::run_processes(1, [&](int) -> std::string {
      std::vector<float> host(10);
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> sync(
          std::move(transport::InProcess::create_world(1)[0]));
      try {
        sync.add("host memory called device memory", view(host, Device::cuda(0)));
      } catch (const Error& e) {
        return e.kind() == ErrorKind::invalid_argument ? "ok" : e.what();
      }
      return "accepted";
    });
    CHECK_MESSAGE(results[0].ok(), results[0].report);
  }
}
