// bench/soak — many synchronizations in one process, several codecs and topologies one after the
// other, with the resident set size sampled: memory must stay flat once the first plans are made.
//
//   gradsync-run --machines 2 -n 2 soak [--iters N] [--sample-every K] [--json PATH]
//
// Each configuration (ring with f32, ring with error-feedback two-bit, parameter server with
// fp16, hierarchical with error-feedback top-k) builds its Synchronizer on the job's connections
// and runs --iters iterations of fmnist's MLP's layout (six tensors, 0.94 MB of f32; normal values
// of a scale per tensor, new every iteration, ready last layer first). Every --sample-every
// iterations rank 0 reads its RSS (/proc/self/statm); the JSON has every sample.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace {

using namespace gradsync;
namespace tk = gradsync::toolkit;
using Clock = std::chrono::steady_clock;
using World = tk::JobTransport;
using Link = transport::Borrowed<World>;

struct Config {
  int iters = 2500;
  int sample_every = 100;
  std::string json;
};

struct Sample {
  long iteration;  // counted over every configuration
  double rss_mb;
};

double rss_mb() {
  long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1e6;
}

struct Run {
  std::string name;
  double median_ms = 0;
  double rss_start_mb = 0, rss_end_mb = 0;
};

// The gradients of fmnist's 784-256-128-10 MLP: 235,146 values.
const std::vector<std::size_t> layer_sizes{784 * 256, 256, 256 * 128, 128, 128 * 10, 10};

template <class Codec, class Topology>
Run soak(World& world, const std::string& name, Codec codec, Topology topology, const Config& cfg, long& counted,
         std::vector<Sample>& samples) {
  Synchronizer<bucketing::FixedSize, Codec, Topology, Link> sync(Link(world), {.log = {}}, {}, codec, topology);
  std::vector<std::vector<float>> grads;
  for (std::size_t i = 0; i < layer_sizes.size(); ++i) {
    grads.emplace_back(layer_sizes[i]);
    sync.add(fmt::format("layer{}", i), view(grads.back()));
  }
  std::mt19937_64 random(static_cast<std::uint64_t>(world.rank()) * 7919 + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Run run{.name = name, .rss_start_mb = rss_mb()};
  std::vector<double> times;
  for (int it = 0; it < cfg.iters; ++it, ++counted) {
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const float scale = 1e-3f * static_cast<float>(i + 1);
      for (float& g : grads[i]) g = scale * normal(random);
    }
    const auto started = Clock::now();
    for (std::size_t i = grads.size(); i-- > 0;) sync.ready(static_cast<GradId>(i));
    sync.wait();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - started).count());
    if (counted % cfg.sample_every == 0) samples.push_back({counted, rss_mb()});
  }
  run.median_ms = tk::median(times);
  run.rss_end_mb = rss_mb();
  return run;
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("many synchronizations, several codecs and topologies, with the resident set size sampled", "soak");
  tk::add_number(app, "--iters", cfg.iters, "iterations of each configuration", {.low = 1});
  tk::add_number(app, "--sample-every", cfg.sample_every, "iterations between RSS samples", {.low = 1});
  app.add_option("--json", cfg.json, "also write the samples as JSON to this file");
  if (!tk::parse_options(app, argc, argv)) return 0;
  World world = tk::connect_or_alone();
  namespace c = compression;
  long counted = 0;
  std::vector<Sample> samples{{0, rss_mb()}};
  std::vector<Run> runs;
  runs.push_back(soak(world, "ring, none", c::None{}, topology::Ring{}, cfg, counted, samples));
  runs.push_back(soak(world, "ring, ef-two-bit", c::ErrorFeedback<c::TwoBit>{}, topology::Ring{}, cfg, counted, samples));
  runs.push_back(soak(world, "parameter-server, fp16", c::Fp16{}, topology::ParameterServer{}, cfg, counted, samples));
  runs.push_back(soak(world, "hierarchical, ef-top-k", c::ErrorFeedback<c::TopK>{},
                      topology::Hierarchical{.ranks_per_machine = world.local_size()}, cfg, counted, samples));
  if (world.rank() != 0) return 0;
  fmt::print("{:<24} {:>8} {:>10} {:>12} {:>10}\n", "configuration", "iters", "median ms", "RSS start MB", "RSS end MB");
  for (const Run& r : runs)
    fmt::print("{:<24} {:>8} {:>10.3f} {:>12.1f} {:>10.1f}\n", r.name, cfg.iters, r.median_ms, r.rss_start_mb, r.rss_end_mb);
  fmt::print("{} synchronizations on {} ranks; rank 0's RSS {:.1f} MB after the first configuration's first {} "
             "iterations, {:.1f} MB at the end\n",
             counted, world.size(), samples.size() > 1 ? samples[1].rss_mb : samples[0].rss_mb, cfg.sample_every,
             samples.back().rss_mb);
  if (!cfg.json.empty()) {
    tk::Json rows = tk::Json::array(), curve = tk::Json::array();
    for (const Run& r : runs)
      rows.push_back({{"configuration", r.name},
                      {"iterations", cfg.iters},
                      {"median_ms", tk::rounded(r.median_ms, 3)},
                      {"rss_start_mb", tk::rounded(r.rss_start_mb, 2)},
                      {"rss_end_mb", tk::rounded(r.rss_end_mb, 2)}});
    for (const Sample& s : samples) curve.push_back({s.iteration, tk::rounded(s.rss_mb, 2)});
    tk::write_json(cfg.json, {{"ranks", world.size()}, {"configurations", rows}, {"rank0_rss_mb", curve}});
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "soak: %s\n", e.what());
  return 1;
}
