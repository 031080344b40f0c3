// transport::Nccl and the device path of the exchange, on one GPU: NCCL at world size 1 (messages
// to itself, the allreduce, an operation NCCL refuses), gradsync refusing two ranks on one
// GPU before NCCL does, a schedule of every kind of step run on the device over NCCL giving the
// host's bits for every codec with a device path, and the Synchronizer over NCCL. Runs with more
// ranks need a GPU each and wait for a machine with several. Skipped, with the reason printed,
// where no CUDA device is present.
//
// The test process never touches CUDA (a forked child cannot use its parent's context): every
// case runs in children, which probe for the device themselves.

#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "gradsync/compression/none.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/nccl.hpp"
#include "gradsync/transport/tcp.hpp"
#include "cuda_probe.hpp"
#include "processes.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

const bool no_device = test::no_cuda_device("the NCCL tests are");

constexpr const char* token = "nccl-test-token";

transport::NcclOptions options(int rank, int size, std::uint16_t port, int device = 0) {
  transport::NcclOptions o;
  o.setup.rank = rank;
  o.setup.world_size = size;
  o.setup.master_port = port;
  o.setup.token = token;
  o.device = device;
  return o;
}

std::vector<float> gradient_like(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(random);
  return v;
}

// Device memory holding a copy of a host vector, and back.
struct DeviceFloats {
  float* data = nullptr;
  std::size_t size = 0;
  explicit DeviceFloats(const std::vector<float>& host) : size(host.size()) {
    if (cudaMalloc(&data, std::max<std::size_t>(size, 1) * sizeof(float)) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    cudaMemcpy(data, host.data(), size * sizeof(float), cudaMemcpyHostToDevice);
  }
  ~DeviceFloats() { cudaFree(data); }
  DeviceFloats(DeviceFloats&& o) noexcept : data(std::exchange(o.data, nullptr)), size(o.size) {}
  std::vector<float> host() const {
    std::vector<float> out(size);
    cudaMemcpy(out.data(), data, size * sizeof(float), cudaMemcpyDeviceToHost);
    return out;
  }
};

// One child's verdict: "ok", or what went wrong.
std::string one_child(const std::function<std::string()>& body) {
  const auto results = test::run_processes(1, [&](int) { return body(); }, 120s);
  return results[0].report;
}

// A schedule of every kind of step at world size 1, the rank its own peer: range [0, 3000)
// encoded, sent to itself, received and decoded onto itself; [3000, 3500) sent in place as plain
// values and added on receive through a raw slot; the whole averaged over 2 "contributors".
Schedule every_step_schedule() {
  Schedule s;
  s.slot_elements = {3000, 3000, 500};
  s.slot_raw = {false, false, true};
  s.contributors = 2;
  using Op = Step::Op;
  s.steps = {
      {.op = Op::encode, .range = {0, 3000}, .slot = 0},
      {.op = Op::send, .peer = 0, .message = 1, .range = {0, 3000}, .slot = 0},
      {.op = Op::recv, .peer = 0, .message = 1, .range = {0, 3000}, .slot = 1},
      {.op = Op::send, .peer = 0, .message = 2, .range = {3000, 3500}},
      {.op = Op::recv, .peer = 0, .message = 2, .range = {3000, 3500}, .slot = 2},
      {.op = Op::decode_add, .range = {0, 3000}, .slot = 1, .after = 2},
      {.op = Op::decode_add, .range = {3000, 3500}, .slot = 2, .after = 4},
      {.op = Op::average, .range = {0, 3500}},
  };
  return s;
}

// The schedule run twice (error feedback's residual carries over) on the host over Tcp and on
// the device over Nccl, compared bit for bit.
template <class C>
std::string device_matches_host(const C& codec) {
  const Schedule schedule = every_step_schedule();
  const std::size_t n = 3500;
  const Group group = Group::world(0, 1);
  const std::uint16_t port = test::free_port();
  transport::Nccl nccl(options(0, 1, port));
  transport::TcpOptions tcp_options = options(0, 1, test::free_port()).setup;
  transport::Tcp tcp(tcp_options);
  engine::BucketExchange<C, transport::Tcp> host(schedule, codec, DType::f32, false, &tcp);
  engine::BucketExchange<C, transport::Nccl> device(schedule, codec, DType::f32, false, &nccl);
  auto bucket = nccl.allocate(n * sizeof(float));
  for (std::uint64_t iteration = 0; iteration < 2; ++iteration) {
    auto values = gradient_like(n, 7 + iteration);
    cuda::copy(bucket.data(), values.data(), n * sizeof(float), nccl.cuda_stream());
    nccl.cuda_stream().synchronize();
    const auto device_values = std::span(reinterpret_cast<float*>(bucket.data()), n);
    host.run(std::span(values), codec, tcp, {group, iteration, 0, 10s});
    device.run(device_values, codec, nccl, {group, iteration, 0, 10s});
    std::vector<float> back(n);
    cuda::copy(back.data(), bucket.data(), n * sizeof(float), nccl.cuda_stream());
    nccl.cuda_stream().synchronize();
    for (std::size_t i = 0; i < n; ++i)
      if (std::memcmp(&back[i], &values[i], sizeof(float)) != 0) {
        nccl.deallocate(bucket);
        return fmt::format("{}: iteration {}, element {}: device {} host {}", codec.describe(), iteration, i, back[i],
                           values[i]);
      }
  }
  nccl.deallocate(bucket);
  return "ok";
}

}  // namespace

TEST_CASE("nccl: world size 1, messages to itself in order, control messages over TCP, and the allreduce" *
          doctest::skip(no_device)) {
  const std::string report = one_child([] {
    transport::Nccl nccl(options(0, 1, test::free_port()));
    if (nccl.size() != 1 || nccl.rank() != 0 || nccl.device() != 0) return std::string("wrong rank, size or device");
    if (nccl.describe().find("nccl 2.") != 0) return "describe: " + nccl.describe();
    std::vector<DeviceFloats> out, in;
    for (std::size_t k = 0; k < 3; ++k) {
      out.emplace_back(gradient_like(1000 * (k + 1), k));
      in.emplace_back(std::vector<float>(1000 * (k + 1)));
    }
    transport::Nccl::Request sends[3], receives[3];
    for (int k = 0; k < 3; ++k) {
      nccl.send(sends[k], 0, engine::make_tag(0, 0, k), std::as_bytes(std::span(out[k].data, out[k].size)));
      nccl.recv(receives[k], 0, engine::make_tag(0, 0, k), std::as_writable_bytes(std::span(in[k].data, in[k].size)));
    }
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    for (int k = 0; k < 3; ++k) {
      if (nccl.wait(receives[k], deadline) != in[k].size * sizeof(float)) return std::string("received size");
      nccl.wait(sends[k], deadline);
      if (in[k].host() != out[k].host()) return fmt::format("message {} arrived changed", k);
    }
    // A control message: host memory, over TCP.
    const std::string text = "plan";
    std::string got(4, ' ');
    transport::Nccl::Request a, b;
    nccl.recv(b, 0, engine::control_tag(0, engine::ControlMessage::plan), std::as_writable_bytes(std::span(got)));
    nccl.send(a, 0, engine::control_tag(0, engine::ControlMessage::plan), std::as_bytes(std::span(text)));
    nccl.wait(a, deadline);
    if (nccl.wait(b, deadline) != 4 || got != text) return "control message: " + got;
    // The allreduce of one rank leaves the values as they are.
    const auto values = gradient_like(4099, 9);
    DeviceFloats summed(values);
    nccl.allreduce(std::span(summed.data, summed.size), deadline);
    if (summed.host() != values) return std::string("allreduce changed the values");
    // Host memory where NCCL needs the device's is refused.
    std::vector<float> host(16);
    try {
      nccl.send(a, 0, engine::make_tag(1, 0, 0), std::as_bytes(std::span(host)));
      return std::string("a host buffer was accepted for NCCL");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::invalid_argument || std::string(e.what()).find("cuda:0") == std::string::npos)
        return std::string("host buffer: ") + e.what();
    }
    return std::string("ok");
  });
  CHECK_MESSAGE(report == "ok", report);
}

TEST_CASE("nccl: what NCCL refuses is an Error naming rank, peer and operation, and fails what follows" *
          doctest::skip(no_device)) {
  const std::string report = one_child([] {
    transport::Nccl nccl(options(0, 1, test::free_port()));
    DeviceFloats buffer(std::vector<float>(64));
    transport::Nccl::Request r;
    // NCCL refuses a receive from itself that no send matches (a peer would make it wait instead).
    nccl.recv(r, 0, engine::make_tag(0, 3, 1), std::as_writable_bytes(std::span(buffer.data, buffer.size)));
    try {
      nccl.wait(r, std::chrono::steady_clock::now() + 10s);
      return std::string("the receive completed");
    } catch (const Error& e) {
      const std::string what = e.what();
      if (e.kind() != ErrorKind::internal || what.find("rank 0, peer 0, recv") == std::string::npos ||
          what.find("NCCL") == std::string::npos)
        return "refusal: " + what;
    }
    transport::Nccl::Request next;
    try {
      nccl.send(next, 0, engine::make_tag(0, 3, 2), std::as_bytes(std::span(buffer.data, buffer.size)));
      return std::string("a send after the abort was accepted");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::internal) return std::string("after the abort: ") + e.what();
    }
    return std::string("ok");
  });
  CHECK_MESSAGE(report == "ok", report);
}

TEST_CASE("nccl: two ranks on one GPU are refused by gradsync, naming both, before NCCL is asked" *
          doctest::skip(no_device)) {
  const std::uint16_t port = test::free_port();
  const auto results = test::run_processes(2, [&](int rank) -> std::string {
    transport::Nccl nccl(options(rank, 2, port, 0));
    return "joined";
  }, 120s);
  for (const auto& r : results) {
    CHECK_MESSAGE(r.report.starts_with("error invalid argument"), r.report);
    CHECK_MESSAGE(r.report.find("ranks 0 and 1 are on the same GPU") != std::string::npos, r.report);
    CHECK_MESSAGE(r.report.find("Duplicate GPU detected") != std::string::npos, r.report);
  }
}

TEST_CASE("nccl: every kind of step on the device gives the host's bits, for every codec with a device path" *
          doctest::skip(no_device)) {
  const std::string report = one_child([] {
    for (const std::string& r :
         {device_matches_host(compression::None{}), device_matches_host(compression::Fp16{}),
          device_matches_host(compression::Bf16{}), device_matches_host(compression::TwoBit{}),
          device_matches_host(compression::OneBit{}), device_matches_host(compression::TernGrad<2>{}),
          device_matches_host(compression::RandomK{}), device_matches_host(compression::TopK{}),
          device_matches_host(compression::ErrorFeedback<compression::TwoBit>{}),
          device_matches_host(compression::ErrorFeedback<compression::OneBit>{}),
          device_matches_host(compression::ErrorFeedback<compression::RandomK>{}),
          device_matches_host(compression::ErrorFeedback<compression::TopK>{}),
          device_matches_host(compression::ErrorFeedback<compression::TernGrad<2>>{})})
      if (r != "ok") return r;
    return std::string("ok");
  });
  CHECK_MESSAGE(report == "ok", report);
}

// The Synchronizer over NCCL against the same gradients synchronized in host memory over Tcp,
// with `topology` and `Codec` on both: a bucket of two gradients and one of a single gradient,
// three iterations, the same bits (the lossy codec's average of one rank is its decoded encoding,
// with the residual carried over; NCCL's allreduce of one rank is the values). "ok" or what
// differs.
template <class Topology, class Codec = compression::ErrorFeedback<compression::TwoBit>>
std::string synchronizer_matches_host(const Topology& topology, Options settings = {}) {
  using Sync = Synchronizer<bucketing::FixedSize, Codec, Topology, transport::Nccl>;
  using HostSync = Synchronizer<bucketing::FixedSize, Codec, Topology, transport::Tcp>;
  const std::vector<std::size_t> sizes{1000, 1000, 70000};
  std::vector<DeviceFloats> gradients;
  std::vector<std::vector<float>> host(sizes.size());
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    gradients.emplace_back(std::vector<float>(sizes[g]));
    host[g].resize(sizes[g]);
  }
  Sync sync(transport::Nccl(options(0, 1, test::free_port())), settings, bucketing::FixedSize{16384, 16384}, {}, topology);
  transport::TcpOptions tcp = options(0, 1, test::free_port()).setup;
  HostSync host_sync(transport::Tcp(tcp), {}, bucketing::FixedSize{16384, 16384}, {}, topology);
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    sync.add(fmt::format("g{}", g), view(std::span(gradients[g].data, gradients[g].size), Device::cuda(0)));
    host_sync.add(fmt::format("g{}", g), view(std::span(host[g])));
  }
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      const auto values = gradient_like(sizes[g], 100 * iteration + g);
      std::copy(values.begin(), values.end(), host[g].begin());  // into the registered memory
      cudaMemcpy(gradients[g].data, host[g].data(), sizes[g] * sizeof(float), cudaMemcpyHostToDevice);
    }
    for (GradId id = 0; id < sizes.size(); ++id) sync.ready(id), host_sync.ready(id);
    sync.wait();
    host_sync.wait();
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      const auto device = gradients[g].host();
      if (std::memcmp(device.data(), host[g].data(), sizes[g] * sizeof(float)) != 0)
        return fmt::format("{}, iteration {}: gradient {} differs from the host path", topology.describe(), iteration, g);
    }
  }
  if (sync.last_iteration().buckets != 2)
    return fmt::format("{}: {} buckets, expected 2", topology.describe(), sync.last_iteration().buckets);
  return "ok";
}

TEST_CASE("nccl: the Synchronizer over NCCL, and what it refuses" * doctest::skip(no_device)) {
  const std::string report = one_child([] {
    using Codec = compression::ErrorFeedback<compression::TwoBit>;
    using Sync = Synchronizer<bucketing::FixedSize, Codec, topology::Ring, transport::Nccl>;
    for (const std::string& r : {synchronizer_matches_host(topology::Ring{}),
                                 synchronizer_matches_host(topology::ParameterServer{}),
                                 synchronizer_matches_host(topology::Hierarchical{.ranks_per_machine = 1})})
      if (r != "ok") return r;
    // Uncompressed Ring buckets go through ncclAllReduce (Options::native_allreduce), said once
    // a plan; with it off, through gradsync's ring.
    for (const bool native : {true, false}) {
      std::string logged;
      const std::string r = synchronizer_matches_host<topology::Ring, compression::None>(
          {}, {.native_allreduce = native, .log = [&](std::string_view line) { logged += line; }});
      if (r != "ok") return r;
      if ((logged.find("2 of 2 buckets are summed by") != std::string::npos) != native)
        return fmt::format("native_allreduce {}, yet the log says: {:?}", native, logged);
    }
    // Refused: coordinated sends (they need the task graph), a host gradient, an f64 gradient (the
    // device path reduces in f32).
    try {
      Options o;
      o.coordination.enabled = true;
      Sync sync(transport::Nccl(options(0, 1, test::free_port())), o);
      return std::string("coordinated sends were accepted");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::unsupported) return std::string("coordination: ") + e.what();
    }
    Sync sync(transport::Nccl(options(0, 1, test::free_port())));
    std::vector<float> in_host_memory(10);
    try {
      sync.add("host", view(std::span(in_host_memory)));
      return std::string("a host gradient was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find("cuda:0") == std::string::npos) return std::string("host gradient: ") + e.what();
    }
    double* wide = nullptr;
    cudaMalloc(&wide, 10 * sizeof(double));
    try {
      sync.add("wide", view(std::span(wide, 10), Device::cuda(0)));
      return std::string("an f64 gradient was accepted");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::unsupported) return std::string("f64 gradient: ") + e.what();
    }
    cudaFree(wide);
    return std::string("ok");
  });
  CHECK_MESSAGE(report == "ok", report);
}
