// quickstart — data-parallel training of a linear model on synthetic data, with ranks as threads
// of this process. Each rank computes gradients on its own shard of every batch, hands them to its
// Synchronizer layer by layer as backward produces them, waits for the averages, and steps. At
// the end every rank must hold bit-identical parameters.
//
//   quickstart [--ranks N] [--steps S] [--codec NAME] [--bucketing fixed-size|per-tensor|time-clustered]

#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "toolkit/codec_by_name.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace {

namespace gs = gradsync;
using Clock = std::chrono::steady_clock;

constexpr int inputs = 256, outputs = 64, batch_per_rank = 32;

struct Config {
  int ranks = 4;
  int steps = 300;
  std::string codec = "none";
  std::string bucketing = "fixed-size";
};

// The task: recover W*, b* from noisy samples y = W* x + b* + noise.
struct Teacher {
  std::vector<float> w, b;
  explicit Teacher(std::mt19937& gen) : w(inputs * outputs), b(outputs) {
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float(inputs)));
    for (auto& v : w) v = normal(gen);
    for (auto& v : b) v = normal(gen);
  }
};

// y = W x + b for one sample.
void forward(const std::vector<float>& w, const std::vector<float>& b, const float* x, float* y) {
  for (int o = 0; o < outputs; ++o) {
    float acc = b[o];
    for (int i = 0; i < inputs; ++i) acc += w[o * inputs + i] * x[i];
    y[o] = acc;
  }
}

struct RankResult {
  std::vector<float> w, b;
  double exposed_ms = 0, step_ms = 0;
  std::uint64_t bytes_sent = 0;
  std::size_t buckets = 0;
};

template <class Sync>
void train_rank(Sync& sync, const Config& cfg, const Teacher& teacher, std::barrier<>& epoch_end,
                std::vector<double>& losses, RankResult& out) {
  std::vector<float> w(inputs * outputs, 0.0f), b(outputs, 0.0f), gw(w.size()), gb(b.size());
  // Both gradients belong to one layer: backward finishes the bias (a sum over the batch) before
  // the weights, and hands each over as soon as it is complete.
  const gs::GradId w_id = sync.add("linear.weight", gs::view(gw));
  const gs::GradId b_id = sync.add("linear.bias", gs::view(gb));
  std::mt19937 gen(1234u + static_cast<unsigned>(sync.rank()));  // each rank draws its own shard
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(batch_per_rank * inputs), y(outputs), target(outputs), err(batch_per_rank * outputs);
  const float lr = 0.1f;
  const auto start = Clock::now();
  for (int step = 0; step < cfg.steps; ++step) {
    // Forward on this rank's shard of the global batch.
    double loss = 0;
    for (int s = 0; s < batch_per_rank; ++s) {
      float* xs = &x[s * inputs];
      for (int i = 0; i < inputs; ++i) xs[i] = normal(gen);
      forward(teacher.w, teacher.b, xs, target.data());
      forward(w, b, xs, y.data());
      for (int o = 0; o < outputs; ++o) {
        const float e = y[o] - (target[o] + 0.01f * normal(gen));
        err[s * outputs + o] = e;
        loss += 0.5 * e * e;
      }
    }
    // Backward.
    for (int o = 0; o < outputs; ++o) {
      float acc = 0;
      for (int s = 0; s < batch_per_rank; ++s) acc += err[s * outputs + o];
      gb[o] = acc / batch_per_rank;
    }
    sync.ready(b_id);
    for (int o = 0; o < outputs; ++o)
      for (int i = 0; i < inputs; ++i) {
        float acc = 0;
        for (int s = 0; s < batch_per_rank; ++s) acc += err[s * outputs + o] * x[s * inputs + i];
        gw[o * inputs + i] = acc / batch_per_rank;
      }
    sync.ready(w_id);
    sync.wait();  // gw and gb now hold the average over all ranks
    out.exposed_ms += std::chrono::duration<double, std::milli>(sync.last_iteration().exposed).count();
    out.bytes_sent += sync.last_iteration().bytes_sent;
    for (std::size_t k = 0; k < w.size(); ++k) w[k] -= lr * gw[k];
    for (std::size_t k = 0; k < b.size(); ++k) b[k] -= lr * gb[k];
    losses[static_cast<std::size_t>(sync.rank())] = loss / batch_per_rank;
    epoch_end.arrive_and_wait();
    if (sync.rank() == 0 && (step % 50 == 0 || step + 1 == cfg.steps))
      fmt::print("step {:>4}  loss {:.5f}\n", step, gradsync::toolkit::mean(losses));
    epoch_end.arrive_and_wait();
  }
  out.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count() / cfg.steps;
  out.buckets = sync.plan().buckets.size();
  out.w = std::move(w);
  out.b = std::move(b);
}

template <class Bucketing, class Codec>
int run(const Config& cfg, const Codec& codec) {
  using Sync = gs::Synchronizer<Bucketing, Codec, gs::topology::Ring, gs::transport::InProcess>;
  std::mt19937 gen(42);
  const Teacher teacher(gen);
  auto world = gs::transport::InProcess::create_world(cfg.ranks);
  std::vector<RankResult> results(static_cast<std::size_t>(cfg.ranks));
  std::vector<double> losses(static_cast<std::size_t>(cfg.ranks));
  std::barrier<> step_end(cfg.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < cfg.ranks; ++r)
    threads.emplace_back([&, r] {
      Sync sync(std::move(world[static_cast<std::size_t>(r)]), {}, {}, codec);
      train_rank(sync, cfg, teacher, step_end, losses, results[static_cast<std::size_t>(r)]);
    });
  for (auto& t : threads) t.join();

  const RankResult& r0 = results[0];
  bool identical = true;
  for (const RankResult& r : results)
    identical = identical && std::memcmp(r.w.data(), r0.w.data(), r0.w.size() * sizeof(float)) == 0 &&
                std::memcmp(r.b.data(), r0.b.data(), r0.b.size() * sizeof(float)) == 0;
  double err = 0, norm = 0;
  for (std::size_t k = 0; k < r0.w.size(); ++k) {
    err += double(r0.w[k] - teacher.w[k]) * (r0.w[k] - teacher.w[k]);
    norm += double(teacher.w[k]) * teacher.w[k];
  }
  fmt::print("\n{} ranks x batch {} | bucketing {} ({} buckets) | codec {}\n", cfg.ranks, batch_per_rank,
             cfg.bucketing, r0.buckets, cfg.codec);
  fmt::print("step time {:.2f} ms, of which waiting on synchronization after backward {:.2f} ms ({:.0f}%)\n",
             r0.step_ms, r0.exposed_ms / cfg.steps, 100.0 * r0.exposed_ms / cfg.steps / r0.step_ms);
  fmt::print("bytes sent per step by rank 0: {} ({} parameters)\n", r0.bytes_sent / cfg.steps, r0.w.size() + r0.b.size());
  fmt::print("relative error of the learned weights: {:.4f}\n", std::sqrt(err / norm));
  fmt::print("parameters bit-identical on every rank: {}\n", identical ? "yes" : "NO");
  return identical ? 0 : 1;
}

template <class Bucketing>
int with_codec(const Config& cfg) {
  return gradsync::toolkit::with_codec(cfg.codec, {},
                                       [&](const auto& codec) { return run<Bucketing>(cfg, codec); });
}

}  // namespace

int main(int argc, char** argv) try {
  namespace tk = gradsync::toolkit;
  Config cfg;
  CLI::App app("Data-parallel training of a linear model on synthetic data, with ranks as threads of this process",
               "quickstart");
  tk::add_number(app, "--ranks", cfg.ranks, "ranks, one thread each", {.low = 1});
  tk::add_number(app, "--steps", cfg.steps, "training steps", {.low = 1});
  tk::add_codec_option(app, cfg.codec);
  tk::add_choice(app, "--bucketing", cfg.bucketing, "how gradients are grouped into buckets", tk::bucketing_names);
  if (!tk::parse_options(app, argc, argv)) return 0;
  if (cfg.bucketing == "per-tensor") return with_codec<gs::bucketing::PerTensor>(cfg);
  if (cfg.bucketing == "time-clustered") return with_codec<gs::bucketing::TimeClustered>(cfg);
  return with_codec<gs::bucketing::FixedSize>(cfg);
} catch (const std::exception& e) {
  fmt::print(stderr, "quickstart: {}\n", e.what());
  return 2;
}
