// bench/sparse — one step of sparse embedding gradients, three ways, side by side in one run:
//
//   sparse   sparse::SparseExchange with Density::sparse: sets of (key, count, row)
//   dense    the same with Density::dense: a ring allreduce of key_space x (dim + 1) among machines
//   table    no shared table: every trainer's gradient of the whole table (key_space x dim, the
//            rows it touched, zeros elsewhere) allreduced by a Synchronizer (topology::Hierarchical),
//            what a replicated table costs under Horovod or DDP
//
//   RANKS_PER_HOST=2 netcluster run 2 sparse [--keys K] [--key-space S] [--dim D] [--iters I]
//                                           [--warmup W] [--modes sparse,dense,table] [--json PATH]
//
// Each trainer's step holds --keys key occurrences drawn from a Zipf-like law over the key space
// (popular features shared by many trainers, a long tail seen once), scattered over the space by a
// hash, with N(0, 0.01) gradient rows. Time: rank 0's wall time of a step (every step ends at a
// machine barrier), median over --iters steps after --warmup. Bytes: what rank 0 sent per step.
// The table mode's gradient is built outside the timed region.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
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

struct Config {
  std::size_t keys = 4096;
  std::size_t key_space = std::size_t{1} << 20;
  int dim = 16;
  int iters = 10;
  int warmup = 2;
  std::vector<std::string> modes{"sparse", "dense", "table"};
  std::string json;
};

struct Row {
  std::string mode;
  double time_ms = 0;
  double bytes_sent = 0;
  double step_keys = 0;  // distinct keys of the whole step (sparse and dense modes)
};

// One trainer's batches: --keys occurrences each, Zipf-like (P(k) ~ 1/k over ranks 1..S, by
// inverting the log-uniform law), each rank mapped to a key by a fixed permutation-like hash.
struct Batches {
  std::vector<std::vector<std::uint64_t>> keys;
  std::vector<std::vector<float>> gradients;
};

Batches make_batches(const Config& cfg, int rank, int count) {
  std::mt19937_64 random(0x5eed + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<double> unit(0, 1);
  std::normal_distribution<float> value(0, 0.01f);
  Batches out;
  for (int b = 0; b < count; ++b) {
    std::vector<std::uint64_t> keys(cfg.keys);
    for (auto& k : keys) {
      const auto popularity = static_cast<std::uint64_t>(std::pow(static_cast<double>(cfg.key_space), unit(random)));
      k = (popularity * 0x9e3779b97f4a7c15ull) % cfg.key_space;
    }
    std::vector<float> grads(cfg.keys * static_cast<std::size_t>(cfg.dim));
    for (auto& g : grads) g = value(random);
    out.keys.push_back(std::move(keys));
    out.gradients.push_back(std::move(grads));
  }
  return out;
}

Row run_exchange(World& world, sparse::EmbeddingTable& table, const Config& cfg, const Batches& batches,
                 sparse::Density density, int ranks_per_machine) {
  sparse::SparseExchange<World> exchange(world, Group::world(world.rank(), world.size()), ranks_per_machine, table,
                                         {.key_space = cfg.key_space, .density = density, .log = {}});
  std::vector<double> times, bytes, keys;
  for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
    const auto b = static_cast<std::size_t>(i);
    const auto started = Clock::now();
    const sparse::SparseStepReport report = exchange.step(batches.keys[b], batches.gradients[b]);
    if (i < cfg.warmup) continue;
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - started).count());
    bytes.push_back(static_cast<double>(report.bytes_sent));
    keys.push_back(static_cast<double>(report.step_keys));
  }
  return {.mode = density == sparse::Density::sparse ? "sparse" : "dense",
          .time_ms = tk::median(times),
          .bytes_sent = tk::median(bytes),
          .step_keys = tk::median(keys)};
}

Row run_table(World& world, const Config& cfg, const Batches& batches, int ranks_per_machine) {
  using Sync = Synchronizer<bucketing::FixedSize, compression::None, topology::Hierarchical, transport::Borrowed<World>>;
  Sync sync(transport::Borrowed<World>(world), {.log = {}}, {}, {}, {.ranks_per_machine = ranks_per_machine});
  const auto dim = static_cast<std::size_t>(cfg.dim);
  std::vector<float> gradient(cfg.key_space * dim);
  const GradId id = sync.add("embedding", view(gradient));
  std::vector<double> times, bytes;
  for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
    const auto b = static_cast<std::size_t>(i);
    std::fill(gradient.begin(), gradient.end(), 0.0f);
    for (std::size_t k = 0; k < batches.keys[b].size(); ++k)
      for (std::size_t j = 0; j < dim; ++j) gradient[batches.keys[b][k] * dim + j] += batches.gradients[b][k * dim + j];
    const auto started = Clock::now();
    sync.ready(id);
    sync.wait();
    if (i < cfg.warmup) continue;
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - started).count());
    bytes.push_back(static_cast<double>(sync.last_iteration().bytes_sent));
  }
  return {.mode = "table", .time_ms = tk::median(times), .bytes_sent = tk::median(bytes)};
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("one step of sparse embedding gradients: sparse sets, a dense allreduce among machines, and a "
               "replicated table's dense allreduce",
               "sparse");
  tk::add_number(app, "--keys", cfg.keys, "key occurrences in each trainer's step", {.low = 1});
  tk::add_number(app, "--key-space", cfg.key_space, "keys lie below this (the table's rows)", {.low = 1});
  tk::add_number(app, "--dim", cfg.dim, "values per row", {.low = 1});
  tk::add_number(app, "--iters", cfg.iters, "timed steps of each mode", {.low = 1});
  tk::add_number(app, "--warmup", cfg.warmup, "steps before them, not timed", {.low = 1});
  app.add_option("--modes", cfg.modes, "which to run, comma-separated: sparse, dense, table")
      ->delimiter(',')
      ->check(CLI::IsMember({"sparse", "dense", "table"}))
      ->capture_default_str();
  app.add_option("--json", cfg.json, "also write the rows as JSON to this file");
  if (!tk::parse_options(app, argc, argv)) return 0;

  World world = tk::connect_or_alone();
  const int ranks_per_machine = world.local_size();
  const Batches batches = make_batches(cfg, world.rank(), cfg.warmup + cfg.iters);
  sparse::EmbeddingTable table(world.local(), {.rows = cfg.key_space, .dim = cfg.dim, .learning_rate = 1e-3f});
  std::vector<Row> rows;
  for (const std::string& mode : cfg.modes) {
    if (mode == "table")
      rows.push_back(run_table(world, cfg, batches, ranks_per_machine));
    else
      rows.push_back(run_exchange(world, table, cfg, batches,
                                  mode == "sparse" ? sparse::Density::sparse : sparse::Density::dense,
                                  ranks_per_machine));
  }
  if (world.rank() != 0) return 0;

  fmt::print("# gradsync sparse: {} ranks, {} per machine; {} key occurrences per trainer and step, key space {}, "
             "dim {}\n",
             world.size(), ranks_per_machine, cfg.keys, cfg.key_space, cfg.dim);
  fmt::print("# rank 0: median of {} steps after {} warm-up\n#\n", cfg.iters, cfg.warmup);
  fmt::print("# {:>8} {:>12} {:>14} {:>12} {:>10}\n", "mode", "time (ms)", "sent (B)", "step keys", "vs table");
  const auto table_row = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.mode == "table"; });
  for (const Row& r : rows)
    fmt::print("  {:>8} {:>12.2f} {:>14.0f} {:>12} {:>10}\n", r.mode, r.time_ms, r.bytes_sent,
               r.mode == "table" ? "-" : fmt::format("{:.0f}", r.step_keys),
               table_row == rows.end() ? "-" : fmt::format("{:.1f}x", table_row->time_ms / r.time_ms));
  if (!cfg.json.empty()) {
    tk::Json json = tk::Json::array();
    for (const Row& r : rows)
      json.push_back({{"mode", r.mode},
                      {"ranks", world.size()},
                      {"ranks_per_machine", ranks_per_machine},
                      {"keys_per_trainer", cfg.keys},
                      {"key_space", cfg.key_space},
                      {"dim", cfg.dim},
                      {"time_ms", tk::rounded(r.time_ms, 3)},
                      {"bytes_sent", r.bytes_sent},
                      {"step_keys", r.mode == "table" ? tk::Json() : tk::Json(r.step_keys)}});
    tk::write_json(cfg.json, json);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "sparse: %s\n", e.what());
  return 2;
}
