// bench/replay — a training step driven by a trace: backward "computes" each layer for the time
// the trace gives it, then marks that layer's gradients ready; real buffers of the traced sizes
// are averaged by a Synchronizer over TCP. Reports, per bucketing policy, the iteration time, the
// communication left exposed after backward, and the number of buckets.
//
//   replay --trace FILE [--bucketing per-tensor|fixed-size|time-clustered] [--cap-mib C] [--min-bucket-kib K]
//          [--codec NAME] [--threshold T] [--keep F] [--topology auto|ring|recursive-doubling|halving-doubling|parameter-server|hierarchical] [--partitions P]
//          [--servers S] [--dedicated] [--chunk-mib M]
//          [--executor task-graph|serial] [--compute-threads N] [--spin-before-sleep US] [--selective]
//          [--coordinate] [--window W] [--batch-kib K]
//          [--iters I] [--warmup W] [--size-scale S] [--time-scale T] [--jitter X]
//          [--drift-at N] [--drift-factor F] [--spin] [--device [--ipc]] [--data gradient|constant] [--json PATH]
//
// With --time-scale 0 every gradient is ready at once and the iteration time is the time one
// synchronization of the whole model takes (size, time, algbw and busbw are printed for it).
//
// Ranks come from the launcher's variables (netcluster run, gradsync-run, torchrun...), one
// policy per run; the transport's own settings (GRADSYNC_CONNECTIONS_PER_PEER,
// GRADSYNC_EXPRESS_LANE_BYTES) too, and the output names them. With --dedicated the last
// --servers ranks only aggregate (topology::ParameterServer); rank 0, which reports, is a worker. --size-scale multiplies every tensor's element count and --time-scale every
// compute time, so that a model can be replayed on slow links at the compute-to-communication
// ratio of a faster cluster: the defaults (1/8 of the bytes, 1.25x the time) put a 10 Gbit/s
// cluster of the traced GPUs onto 1 Gbit/s links with runs short enough to repeat. --jitter X
// stretches or shrinks each layer's time by a uniform random factor in [1-X, 1+X] per iteration;
// --drift-at N makes the first half of backward (in trace order) --drift-factor times slower from
// iteration N on, to show re-profiling. Compute waits by sleeping until each layer's deadline
// (absolute, so errors do not add up); --spin busy-waits instead, which on a machine with fewer
// cores than ranks measures CPU contention more than overlap.
//
// --device (builds with CUDA): the gradients live in GPU memory (device LOCAL_RANK modulo the
// machine's count) and the exchange runs on it, the codecs as kernels, over the same transport
// wrapped in transport::CudaStaged; fixed-size bucketing and the ring only, either executor.
// --ipc with it: ranks on the same GPU exchange device to device through CUDA IPC, not through
// host mirrors (CudaStaged's ipc option).
//
// --data gradient (the default): every rank's gradients are drawn from N(0, 0.01), differently on
// every rank (toolkit/gradient_data.hpp), and put back before each iteration, so every iteration
// synchronizes the same values and the codecs meet what training gives them; a lossless codec's
// first average is checked against the mean computed here. --data constant: rank r gives r + 1
// everywhere (the replays before 2026-11-28), checked exactly.
//
// An iteration's time runs from the start of backward to the return of wait(); exposed is the
// time wait() blocked; cpu is the CPU time rank 0's process (all its threads) used during the
// iteration, user and kernel apart, which tells a CPU-bound run (ranks sharing cores) from a
// link-bound one. Medians over --iters iterations after --warmup, rank 0's view (all ranks leave
// wait() together).

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/shipped.hpp"
#include "gradsync/transport/tcp.hpp"
#if GRADSYNC_HAS_CUDA
#include "gradsync/cuda/memory.hpp"
#include "gradsync/transport/cuda_staged.hpp"
#endif
#include "toolkit/codec_by_name.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/gradient_data.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"
#include "toolkit/workers.hpp"
#include "trace.hpp"

namespace {

namespace gs = gradsync;
namespace tk = gradsync::toolkit;
using Clock = std::chrono::steady_clock;

struct Config {
  std::string trace;
  std::string bucketing = "time-clustered";
  double cap_mib = 25;
  double min_bucket_kib = 0;  // time-clustered's min_bucket_bytes, 0: its default
  int iters = 20;
  int warmup = 8;
  double size_scale = 0.125;
  double time_scale = 1.25;
  double jitter = 0;
  int drift_at = -1;
  double drift_factor = 2;
  bool spin = false;
  std::string json;
  std::string codec = "none";
  tk::CodecSettings codec_settings;
  std::string topology = "auto";
  std::size_t partitions = 0;
  std::size_t servers = 0;
  bool dedicated = false;
  double chunk_mib = 1;  // the topology's pieces
  std::string executor = "task-graph";
  int compute_threads = 1;
  int spin_before_sleep_us = 0;  // Options::spin_before_sleep
  bool selective = false;
  gs::Coordination coordination;
  bool device = false;
  bool ipc = false;
  std::string data = "gradient";
};

// CPU time this process (every thread) has used so far, in the user and in the kernel.
struct CpuTime {
  double user_ms = 0, system_ms = 0;
};
CpuTime cpu_time() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto ms = [](const timeval& t) { return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_usec) / 1e3; };
  return {ms(usage.ru_utime), ms(usage.ru_stime)};
}

// The gradients' copies in GPU memory for --device (nothing without it), freed with it.
class DeviceGradients {
 public:
  explicit DeviceGradients(int device) : device_(device) {}
  DeviceGradients(const DeviceGradients&) = delete;
  ~DeviceGradients() {
#if GRADSYNC_HAS_CUDA
    for (float* p : copies_) gs::cuda::free_on_device(p, device_);
#endif
  }
  // A device copy of `values`, as the view to register.
  gs::TensorView add(const std::vector<float>& values) {
#if GRADSYNC_HAS_CUDA
    auto* p = static_cast<float*>(gs::cuda::allocate_on_device(values.size() * sizeof(float), device_));
    copies_.push_back(p);
    gs::cuda::copy_to_device(p, values.data(), values.size() * sizeof(float), device_);
    return gs::view(std::span<float>(p, values.size()), gs::Device::cuda(device_));
#else
    (void)values;
    throw std::runtime_error("--device needs a build with CUDA");
#endif
  }
  // `host`'s values into the device copies (nothing without --device).
  void restore(const std::vector<std::vector<float>>& host) const {
#if GRADSYNC_HAS_CUDA
    for (std::size_t g = 0; g < copies_.size(); ++g)
      gs::cuda::copy_to_device(copies_[g], host[g].data(), host[g].size() * sizeof(float), device_);
#else
    (void)host;
#endif
  }
  // The device copies' values into `host` (nothing without --device).
  void copy_back(std::vector<std::vector<float>>& host) const {
#if GRADSYNC_HAS_CUDA
    for (std::size_t g = 0; g < copies_.size(); ++g)
      gs::cuda::copy_to_host(host[g].data(), copies_[g], host[g].size() * sizeof(float), device_);
#else
    (void)host;
#endif
  }

 private:
  int device_;
  std::vector<float*> copies_;
};

// A lossless codec's first averages, `grads`, against the workers' mean: exactly (w + 1) / 2 for
// constant data (every partial sum is a whole number); for gradient data (`values_of(r)` gives
// rank r's values) within the rounding a float sum of them in any order may add, eps times the
// sum of their magnitudes.
template <class ValuesOf>
void check_average(const std::vector<std::vector<float>>& grads, int workers, bool gradient, const ValuesOf& values_of) {
  if (!gradient) {
    const float expected = static_cast<float>(workers + 1) / 2;
    for (const auto& g : grads)
      for (float v : g)
        if (v != expected) throw std::runtime_error(fmt::format("wrong average {} (expected {})", v, expected));
    return;
  }
  std::vector<std::vector<double>> sum(grads.size()), magnitude(grads.size());
  for (std::size_t g = 0; g < grads.size(); ++g) {
    sum[g].assign(grads[g].size(), 0.0);
    magnitude[g].assign(grads[g].size(), 0.0);
  }
  for (int r = 0; r < workers; ++r) {
    const auto values = values_of(r);
    for (std::size_t g = 0; g < grads.size(); ++g)
      for (std::size_t i = 0; i < grads[g].size(); ++i) {
        sum[g][i] += values[g][i];
        magnitude[g][i] += std::abs(values[g][i]);
      }
  }
  for (std::size_t g = 0; g < grads.size(); ++g)
    for (std::size_t i = 0; i < grads[g].size(); ++i) {
      const double mean = sum[g][i] / workers;
      const double tolerance = std::numeric_limits<float>::epsilon() * (magnitude[g][i] + std::abs(mean));
      if (std::abs(grads[g][i] - mean) > tolerance)
        throw std::runtime_error(
            fmt::format("wrong average {} of gradient {} at {} (expected {})", grads[g][i], g, i, mean));
    }
}

struct Sample {
  double iteration_ms = 0, exposed_ms = 0;
  CpuTime cpu;
  std::size_t buckets = 0;
  gs::IterationStats stats;
};

// What the report says of the policies and the transport a Synchronizer was built with.
struct Described {
  std::string codec, topology, transport;
  bool lossless = false;  // the averages can be checked exactly
  int workers = 0;        // the ranks that give gradients (tk::workers)
};

gs::Options options_for(const Config& cfg) {
  return {.timeout = std::chrono::minutes(5),
          .executor = cfg.executor == "serial" ? gs::Executor::serial : gs::Executor::task_graph,
          .compute_threads = cfg.compute_threads,
          .spin_before_sleep = std::chrono::microseconds(cfg.spin_before_sleep_us),
          .selective_compression = cfg.selective,
          .coordination = cfg.coordination};
}

// Replays the trace through `sync`, a Synchronizer or an AnySynchronizer. `device`: the CUDA
// device the gradients live on, or -1 for host memory.
template <class Sync>
int replay(const Config& cfg, const std::vector<gradsync_bench::TraceEntry>& trace, Sync& sync, const Described& described,
           int device = -1) {
  const int rank = sync.rank(), ranks = sync.size();
  const int workers = described.workers;
  // What this rank gives at every iteration (`inputs`), and the buffers averaged in place.
  const bool gradient = cfg.data == "gradient";
  std::vector<std::size_t> counts;
  for (const auto& e : trace)
    counts.push_back(std::max<std::size_t>(1, static_cast<std::size_t>(static_cast<double>(e.count) * cfg.size_scale)));
  const auto values_of = [&](int r) {
    std::vector<std::vector<float>> values;
    std::vector<float> all;
    if (gradient) all = tk::gradient_values(std::accumulate(counts.begin(), counts.end(), std::size_t{0}), r);
    std::size_t at = 0;
    for (std::size_t count : counts) {
      if (gradient)
        values.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(at),
                            all.begin() + static_cast<std::ptrdiff_t>(at + count));
      else
        values.emplace_back(count, static_cast<float>(r + 1));
      at += count;
    }
    return values;
  };
  const std::vector<std::vector<float>> inputs = values_of(rank);
  std::vector<std::vector<float>> grads = inputs;
  DeviceGradients on_device(device);
  std::size_t bytes = 0;
  for (std::size_t k = 0; k < trace.size(); ++k) {
    bytes += grads[k].size() * sizeof(float);
    sync.add(trace[k].name, device < 0 ? gs::view(grads[k]) : on_device.add(grads[k]));
  }
  std::mt19937_64 gen(1000003u * static_cast<unsigned>(rank) + 17u);
  std::uniform_real_distribution<double> stretch(1 - cfg.jitter, 1 + cfg.jitter);
  std::vector<Sample> samples;
  std::size_t plans = 0;
  gs::BucketPlan last_plan;
  std::vector<int> plan_changes;  // iterations whose plan differed from the one before
  for (int it = 0; it < cfg.warmup + cfg.iters; ++it) {
    if (gradient && it > 0) {  // the averages in place of this rank's values: put them back
      grads = inputs;
      on_device.restore(grads);
    }
    const auto start = Clock::now();
    const CpuTime cpu_start = cpu_time();
    auto deadline = start;
    for (std::size_t k = 0; k < trace.size(); ++k) {
      double us = trace[k].compute_us * cfg.time_scale;
      if (cfg.jitter > 0 && us > 0) us *= stretch(gen);
      if (cfg.drift_at >= 0 && it >= cfg.drift_at && k < trace.size() / 2) us *= cfg.drift_factor;
      deadline += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(us));
      if (cfg.spin) {
        while (Clock::now() < deadline) {
        }
      } else if (deadline > Clock::now()) {
        std::this_thread::sleep_until(deadline);
      }
      sync.ready(static_cast<gs::GradId>(k));
    }
    sync.wait();
    const auto end = Clock::now();
    const CpuTime cpu_end = cpu_time();
    // The workers are ranks 0 .. w-1 (dedicated servers come last and hold only the parts they
    // serve): each average is the workers' mean, (w + 1) / 2 for constant data, exactly.
    if (it == 0 && described.lossless && rank < workers) {
      on_device.copy_back(grads);
      check_average(grads, workers, gradient, values_of);
    }
    if (sync.plan() != last_plan) {
      last_plan = sync.plan();
      ++plans;
      plan_changes.push_back(it);
    }
    if (it >= cfg.warmup)
      samples.push_back({std::chrono::duration<double, std::milli>(end - start).count(),
                         std::chrono::duration<double, std::milli>(sync.last_iteration().exposed).count(),
                         {cpu_end.user_ms - cpu_start.user_ms, cpu_end.system_ms - cpu_start.system_ms},
                         sync.last_iteration().buckets, sync.last_iteration()});
  }
  if (rank != 0) return 0;
  std::vector<double> times, exposed, cpu_user, cpu_system, compute, in_flight, waiting, control_kb, awaiting_grant;
  const auto ms = [](std::chrono::nanoseconds t) { return std::chrono::duration<double, std::milli>(t).count(); };
  for (const auto& s : samples) {
    times.push_back(s.iteration_ms);
    exposed.push_back(s.exposed_ms);
    cpu_user.push_back(s.cpu.user_ms);
    cpu_system.push_back(s.cpu.system_ms);
    compute.push_back(ms(s.stats.compute));
    in_flight.push_back(ms(s.stats.in_flight));
    waiting.push_back(ms(s.stats.waiting));
    control_kb.push_back(static_cast<double>(s.stats.control_bytes) / 1e3);
    awaiting_grant.push_back(ms(s.stats.awaiting_grant));
  }
  const gs::IterationStats& last = samples.back().stats;
  const std::string policy_name =
      cfg.bucketing == "fixed-size" ? fmt::format("fixed-size {:g} MiB", cfg.cap_mib) : cfg.bucketing;
  fmt::print("# replay {}: {} tensors, {:.1f} MB of f32 gradients, {} ranks, size x{:g}, time x{:g}, jitter {:g}{}\n",
             cfg.trace, trace.size(), static_cast<double>(bytes) / 1e6, ranks, cfg.size_scale, cfg.time_scale,
             cfg.jitter, cfg.drift_at >= 0 ? fmt::format(", drift x{:g} from iteration {}", cfg.drift_factor, cfg.drift_at) : "");
  fmt::print("# codec {}{}, topology {}, executor {} ({} compute threads), transport {}\n", described.codec,
             cfg.selective ? " (selective)" : "", described.topology, cfg.executor, cfg.compute_threads,
             described.transport);
  fmt::print("# {:>22} {:>8} {:>14} {:>13} {:>6} {:>10} {:>8} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9}\n", "policy",
             "buckets", "iteration (ms)", "exposed (ms)", "plans", "wire (MB)", "algbw", "busbw", "compute", "in flight",
             "waiting", "cpu user", "cpu sys");
  // algbw and busbw as nccl-tests defines them, for the whole model per iteration: meaningful when
  // --time-scale 0 makes the iteration one synchronization. The allreduce is among the workers
  // (rank 0 is one): dedicated servers do not count in busbw's 2(n-1)/n.
  const double algbw = static_cast<double>(bytes) / (tk::median(times) * 1e6);
  fmt::print(
      "  {:>22} {:>8} {:>14.1f} {:>13.1f} {:>6} {:>10.2f} {:>8.3f} {:>8.3f} {:>10.1f} {:>10.1f} {:>10.1f} {:>9.1f} "
      "{:>9.1f}\n",
      policy_name, samples.back().buckets, tk::median(times), tk::median(exposed), plans,
      static_cast<double>(last.bytes_sent) / 1e6, algbw, algbw * tk::bus_factor(workers),
      tk::median(compute), tk::median(in_flight), tk::median(waiting), tk::median(cpu_user), tk::median(cpu_system));
  fmt::print("# plan changed after iterations: {}\n", fmt::join(plan_changes, ", "));
  if (cfg.coordination.enabled)
    fmt::print("# coordinated (window {}, batches of {} KiB): rank 0 sent {:.1f} KB of grants per iteration; its sends "
               "waited {:.1f} ms for grants (summed over sends)\n",
               cfg.coordination.window, cfg.coordination.batch_bytes >> 10, tk::median(control_kb), tk::median(awaiting_grant));
  if (!cfg.json.empty()) {
    tk::Json per_iteration = tk::Json::array();
    for (const Sample& sample : samples)
      per_iteration.push_back({{"iteration_ms", tk::rounded(sample.iteration_ms, 3)},
                               {"exposed_ms", tk::rounded(sample.exposed_ms, 3)},
                               {"cpu_user_ms", tk::rounded(sample.cpu.user_ms, 3)},
                               {"cpu_system_ms", tk::rounded(sample.cpu.system_ms, 3)},
                               {"buckets", sample.buckets}});
    tk::write_json(cfg.json, {{"trace", cfg.trace},
                              {"policy", policy_name},
                              {"ranks", ranks},
                              {"bytes", bytes},
                              {"size_scale", cfg.size_scale},
                              {"time_scale", cfg.time_scale},
                              {"jitter", cfg.jitter},
                              {"drift_at", cfg.drift_at},
                              {"drift_factor", cfg.drift_factor},
                              {"buckets", samples.back().buckets},
                              {"iteration_ms", tk::rounded(tk::median(times), 3)},
                              {"exposed_ms", tk::rounded(tk::median(exposed), 3)},
                              {"cpu_user_ms", tk::rounded(tk::median(cpu_user), 3)},
                              {"cpu_system_ms", tk::rounded(tk::median(cpu_system), 3)},
                              {"codec", cfg.codec},
                              {"selective", cfg.selective},
                              {"topology", described.topology},
                              {"schedules", tk::schedules_json(last)},
                              {"executor", cfg.executor},
                              {"data", cfg.data},
                              {"compute_threads", cfg.compute_threads},
                              {"spin_before_sleep_us", cfg.spin_before_sleep_us},
                              {"transport", described.transport},
                              {"wire_bytes", last.bytes_sent},
                              {"coordinated", cfg.coordination.enabled},
                              {"window", cfg.coordination.window},
                              {"batch_bytes", cfg.coordination.batch_bytes},
                              {"control_kb", tk::rounded(tk::median(control_kb), 3)},
                              {"awaiting_grant_ms", tk::rounded(tk::median(awaiting_grant), 3)},
                              {"plan_changes", plan_changes},
                              {"samples", per_iteration}});
  }
  return 0;
}

void declare_options(CLI::App& app, Config& cfg) {
  app.add_option("--trace", cfg.trace, "the trace to replay (bench/traces/*.trace)")->required()->check(CLI::ExistingFile);
  tk::add_choice(app, "--bucketing", cfg.bucketing, "the bucketing policy", tk::bucketing_names);
  tk::add_number(app, "--cap-mib", cfg.cap_mib, "fixed-size's bucket cap, in MiB", {.low = 0, .low_open = true});
  tk::add_number(app, "--min-bucket-kib", cfg.min_bucket_kib, "time-clustered's smallest bucket, in KiB (0: its default)",
                 {.low = 0});
  tk::add_codec_options(app, cfg.codec, cfg.codec_settings);
  tk::add_choice(app, "--topology", cfg.topology, "the schedule", tk::topology_names);
  tk::add_number(app, "--partitions", cfg.partitions, "the parameter server's parts (0: one per rank)");
  tk::add_server_placement(app, cfg.servers, cfg.dedicated, cfg.topology);
  tk::add_number(app, "--chunk-mib", cfg.chunk_mib, "the topology's piece size, in MiB", {.low = 0, .low_open = true});
  tk::add_choice(app, "--executor", cfg.executor, "what runs the synchronization's steps", {"task-graph", "serial"});
  tk::add_number(app, "--compute-threads", cfg.compute_threads, "threads of the task graph's compute queue", {.low = 1});
  tk::add_number(app, "--spin-before-sleep", cfg.spin_before_sleep_us,
                 "microseconds the task graph's threads poll for work before they sleep", {.low = 0, .high = 10000});
  app.add_flag("--selective", cfg.selective, "compress only the buckets where the ranks measured it to pay");
  app.add_flag("--coordinate", cfg.coordination.enabled, "grant sends in batches, a window of them per link");
  tk::add_number(app, "--window", cfg.coordination.window, "batches in flight per link (--coordinate)", {.low = 1});
  app.add_option_function<std::size_t>(
         "--batch-kib", [&cfg](std::size_t kib) { cfg.coordination.batch_bytes = kib << 10; },
         "a batch closes once it holds this many KiB (--coordinate)")
      ->default_str(std::to_string(cfg.coordination.batch_bytes >> 10))
      ->transform(tk::number<std::size_t>({.low = 1, .high = std::numeric_limits<std::size_t>::max() >> 10}));
  tk::add_number(app, "--iters", cfg.iters, "measured iterations", {.low = 1});
  tk::add_number(app, "--warmup", cfg.warmup, "iterations before them, not measured", {.low = 1});
  tk::add_number(app, "--size-scale", cfg.size_scale, "multiplies every tensor's element count", {.low = 0, .low_open = true});
  tk::add_number(app, "--time-scale", cfg.time_scale, "multiplies every compute time (0: every gradient ready at once)",
                 {.low = 0});
  tk::add_number(app, "--jitter", cfg.jitter, "stretches each layer's time by a random factor in [1-X, 1+X]",
                 {.low = 0, .high = 1, .high_open = true});
  tk::add_number(app, "--drift-at", cfg.drift_at, "from this iteration on, the first half of backward is slower (-1: never)",
                 {.low = -1});
  tk::add_number(app, "--drift-factor", cfg.drift_factor, "how much slower", {.low = 0, .low_open = true});
  app.add_flag("--spin", cfg.spin, "busy-wait through compute instead of sleeping");
  app.add_flag("--device", cfg.device, "gradients in GPU memory, the codecs as kernels (transport::CudaStaged)");
  app.add_flag("--ipc", cfg.ipc, "with --device: ranks on one GPU exchange through CUDA IPC, not host memory");
  tk::add_choice(app, "--data", cfg.data, "gradient: N(0, 0.01) values, different on every rank; constant: rank + 1",
                 {"gradient", "constant"});
  app.add_option("--json", cfg.json, "also write the results and every iteration as JSON to this file");
}

// The bucketing policy the options name.
gs::shipped::Bucketing bucketing_for(const Config& cfg) {
  if (cfg.bucketing == "per-tensor") return gs::bucketing::PerTensor{};
  if (cfg.bucketing == "fixed-size") {
    const auto cap = static_cast<std::size_t>(cfg.cap_mib * (1 << 20));
    return gs::bucketing::FixedSize{.cap_bytes = cap, .first_cap_bytes = std::min<std::size_t>(cap, 1 << 20)};
  }
  gs::bucketing::TimeClustered policy;
  if (cfg.min_bucket_kib > 0) policy.min_bucket_bytes = static_cast<std::size_t>(cfg.min_bucket_kib * 1024);
  return policy;
}

// The topology the options name, cut into pieces of `chunk` elements.
gs::shipped::Topology topology_for(const Config& cfg, int ranks_per_machine, std::size_t chunk) {
  return tk::topology_named(cfg.topology, {.ranks_per_machine = ranks_per_machine,
                                           .chunk_elements = chunk,
                                           .partitions = cfg.partitions,
                                           .servers = cfg.servers,
                                           .dedicated = cfg.dedicated});
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("A training step driven by a trace: its gradients averaged across the job as backward produces them", "replay");
  declare_options(app, cfg);
  if (!tk::parse_options(app, argc, argv)) return 0;
  std::ifstream file(cfg.trace);
  if (!file) throw std::runtime_error("cannot open " + cfg.trace);
  const auto trace = gradsync_bench::read_trace(file, cfg.trace);
  tk::JobTransport transport = tk::connect_or_alone();
  cfg.codec_settings.rank = transport.rank();
  const auto chunk = std::max<std::size_t>(1, static_cast<std::size_t>(cfg.chunk_mib * (1 << 20) / sizeof(float)));
  if (cfg.ipc && !cfg.device) throw std::invalid_argument("--ipc goes with --device");
  if (cfg.device) {
#if GRADSYNC_HAS_CUDA
    // The ring alone: Auto's choice rests on a link probe, which a device transport does not run.
    if (cfg.bucketing != "fixed-size" || (cfg.topology != "auto" && cfg.topology != "ring") || cfg.selective ||
        cfg.coordination.enabled)
      throw std::invalid_argument("--device runs the ring (--topology auto or ring) with --bucketing fixed-size, "
                                  "without --selective and --coordinate");
    const int devices = gs::cuda::device_count();
    if (devices == 0) throw std::runtime_error("--device: this process sees no CUDA device");
    const int device = gs::launch::from_environment().local_rank % devices;
    const auto cap = static_cast<std::size_t>(cfg.cap_mib * (1 << 20));
    return tk::with_codec(cfg.codec, cfg.codec_settings, [&]<class Codec>(const Codec& codec) {
      using Transport = gs::transport::CudaStaged<tk::JobTransport>;
      Transport staged(std::move(transport), device, {.ipc = cfg.ipc});
      if (!staged.ipc_fallback().empty()) fmt::print(stderr, "replay: rank {}: {}\n", staged.rank(), staged.ipc_fallback());
      const std::string transport_name = staged.describe();
      gs::Synchronizer<gs::bucketing::FixedSize, Codec, gs::topology::Ring, Transport> sync(
          std::move(staged), options_for(cfg),
          {.cap_bytes = cap, .first_cap_bytes = std::min<std::size_t>(cap, 1 << 20)}, codec,
          {.chunk_elements = chunk});
      const Described described{.codec = codec.describe(), .topology = gs::topology::Ring{}.describe(),
                                .transport = transport_name, .lossless = Codec::lossless, .workers = sync.size()};
      return replay(cfg, trace, sync, described, device);
    });
#else
    throw std::invalid_argument("--device needs a build of gradsync with CUDA");
#endif
  }
  const gs::shipped::Codec codec = tk::codec_named(cfg.codec, cfg.codec_settings);
  const gs::shipped::Topology topology = topology_for(cfg, transport.local_size(), chunk);
  const std::string transport_name = transport.describe();
  const auto sync = gs::make_synchronizer(std::move(transport), options_for(cfg), bucketing_for(cfg), codec, topology);
  const auto describe = [](const auto& policy) { return std::visit([](const auto& p) { return p.describe(); }, policy); };
  const Described described{
      .codec = describe(codec),
      .topology = describe(topology),
      .transport = transport_name,
      .lossless = std::visit([]<class C>(const C&) { return C::lossless; }, codec),
      .workers = std::visit([&](const auto& t) { return tk::workers(t, sync->size()); }, topology)};
  return replay(cfg, trace, *sync, described);
} catch (const std::exception& e) {
  std::fprintf(stderr, "replay: %s\n", e.what());
  return 2;
}
