#pragma once
// The data-parallel training loop: every worker walks the same shuffled order of the training
// set; each global batch of workers x batch samples is cut into one shard per worker. Gradients go
// to the Synchronizer layer by layer as backward produces them, so the last layers' averaging
// overlaps with the first layers' backward; wait() returns the average and every worker takes the
// same step. Ranks past the workers are dedicated parameter servers: they train nothing and only
// take part in each synchronization.
//
// With an asynchronous parameter server (gradsync::async::Synchronizer) a worker's wait() returns
// the global gradients that came since the last one, and its own gradient standing in for this
// step's until that comes, instead of everyone's average of this step (the last step of an epoch
// waits for it: wait(0)); the parameters are registered too, for the period average
// after the update (parameters_updated()), and finish() ends training on each rank. A straggler is
// injected with slow_rank/slow_factor: that worker sleeps before each step for (factor - 1) times
// what its previous step's computation took, so it computes `factor` times slower.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "idx.hpp"
#include "mlp.hpp"

namespace fmnist {

struct TrainConfig {
  int epochs = 1;
  std::size_t batch = 16;  // per rank
  // Chosen with the codecs in mind: with momentum 0.9, error-feedback codecs lose 2-16 points
  // of one-epoch accuracy against f32; at 0.5 (and a larger rate) they stay within one, and f32
  // itself does as well as before (results/README.md).
  float learning_rate = 0.1f;
  float momentum = 0.5f;
  std::uint64_t seed = 1;
  std::size_t max_steps = 0;  // per epoch; 0: the whole training set
  std::size_t workers = 0;    // ranks that train, the first ones; 0: every rank
  int slow_rank = -1;         // a straggler: this rank computes slow_factor times slower
  double slow_factor = 1;
};

// An asynchronous synchronizer (gradsync::async::Synchronizer) rather than a synchronous one.
template <class Sync>
concept Asynchronous = requires(Sync& sync) { sync.parameters_updated(); };

struct EpochReport {
  int epoch = 0;
  std::size_t steps = 0;
  double seconds = 0;
  double samples_per_second = 0;  // global: every rank's samples
  double loss = 0;                // mean over the epoch of this rank's batch losses (0 on a server)
  double test_accuracy = -1;      // -1 where not evaluated
  double exposed_seconds = 0;     // time wait() blocked: communication backward did not hide
  std::uint64_t bytes_sent = 0;   // by this rank
  double max_age = 0;             // asynchronous: the oldest global gradient applied, in iterations
  double local_parts = 0;         // asynchronous: parts a step kept local, per step
};

// progress(epoch, step, steps, samples_per_second, loss) after every step.
using Progress = std::function<void(int, std::size_t, std::size_t, double, double)>;

// One epoch's clock, for this trainer and libtorch-fmnist's: progress after each step taken and,
// at the end, the report's seconds, samples per second (of the global batch) and mean loss.
class EpochMeter {
 public:
  EpochMeter(EpochReport& report, std::size_t global_batch, const Progress& progress)
      : report_(report), global_(global_batch), progress_(progress), start_(std::chrono::steady_clock::now()) {}

  // After step `step` (from 0), whose batch loss was `loss`.
  void stepped(std::size_t step, double loss) {
    loss_sum_ += loss;
    if (!progress_) return;
    progress_(report_.epoch, step + 1, report_.steps,
              static_cast<double>((step + 1) * global_) / seconds_since_start(),
              loss_sum_ / static_cast<double>(step + 1));
  }

  void finished() {
    report_.seconds = seconds_since_start();
    report_.samples_per_second = static_cast<double>(report_.steps * global_) / report_.seconds;
    report_.loss = report_.steps ? loss_sum_ / static_cast<double>(report_.steps) : 0;
  }

 private:
  double seconds_since_start() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  EpochReport& report_;
  std::size_t global_;
  const Progress& progress_;
  std::chrono::steady_clock::time_point start_;
  double loss_sum_ = 0;
};

// Registers the model's gradients with `sync` (weights then bias, layer by layer) and trains.
// `test` may be null (no evaluation). Every rank must call this with the same arguments. The
// model is an Mlp, or a DeviceMlp (device_mlp.hpp) with a synchronous `sync`.
template <class Sync, class Model>
std::vector<EpochReport> train(Sync& sync, Model& model, const Dataset& data, const Dataset* test,
                               const TrainConfig& cfg, const Progress& progress = {}) {
  std::vector<std::pair<gradsync::GradId, gradsync::GradId>> ids;  // per layer: weights, bias
  for (std::size_t l = 0; l < model.depth(); ++l) {
    const std::string name = "fc" + std::to_string(l + 1);
    ids.emplace_back(sync.add(name + ".weight", model.weight_gradient(l)),
                     sync.add(name + ".bias", model.bias_gradient(l)));
    if constexpr (Asynchronous<Sync>) {
      Layer& L = model.layers()[l];
      sync.add_parameters(L.w);
      sync.add_parameters(L.b);
    }
  }
  const std::size_t workers = cfg.workers ? cfg.workers : static_cast<std::size_t>(sync.size());
  const auto rank = static_cast<std::size_t>(sync.rank());
  const bool server = rank >= workers;
  const std::size_t global = cfg.batch * workers;
  std::size_t steps = data.count / global;
  if (cfg.max_steps) steps = std::min(steps, cfg.max_steps);
  std::vector<std::size_t> order(data.count);
  std::vector<float> x(cfg.batch * data.pixels);
  std::vector<std::uint8_t> y(cfg.batch);
  std::vector<EpochReport> reports;
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    epoch_order(order, cfg.seed, epoch);
    EpochReport report{.epoch = epoch, .steps = steps};
    EpochMeter meter(report, global, progress);
    double local_parts = 0;
    std::chrono::steady_clock::duration computed{};
    for (std::size_t step = 0; step < steps; ++step) {
      if constexpr (!Asynchronous<Sync>) {
        if (server) {  // its part of every synchronization, in backward's order
          for (std::size_t l = ids.size(); l-- > 0;) {
            sync.ready(ids[l].first);
            sync.ready(ids[l].second);
          }
          sync.wait();
          report.bytes_sent += sync.last_iteration().bytes_sent;
          continue;
        }
      }
      if (static_cast<int>(rank) == cfg.slow_rank)
        std::this_thread::sleep_for(std::chrono::duration_cast<std::chrono::nanoseconds>(computed * (cfg.slow_factor - 1)));
      const auto computing = std::chrono::steady_clock::now();
      for (std::size_t s = 0; s < cfg.batch; ++s) {
        const std::size_t sample = order[step * global + rank * cfg.batch + s];
        std::copy_n(data.images.begin() + static_cast<std::ptrdiff_t>(sample * data.pixels), data.pixels,
                    x.begin() + static_cast<std::ptrdiff_t>(s * data.pixels));
        y[s] = data.labels[sample];
      }
      const double loss = model.train_step(x.data(), y.data(), cfg.batch, [&](std::size_t l) {
        sync.ready(ids[l].first);
        sync.ready(ids[l].second);
      });
      computed = std::chrono::steady_clock::now() - computing;
      if constexpr (Asynchronous<Sync>) {
        // The epoch's last step catches up: the model tested holds every global gradient and no
        // worker's own gradient standing in for one.
        if (step + 1 == steps)
          sync.wait(0);
        else
          sync.wait();
      } else {
        sync.wait();
      }
      model.sgd_step(cfg.learning_rate, cfg.momentum);
      if constexpr (Asynchronous<Sync>) {
        sync.parameters_updated();
        const auto& applied = sync.last_step();
        report.exposed_seconds += std::chrono::duration<double>(applied.blocked).count();
        report.bytes_sent += applied.bytes_sent;
        report.max_age = std::max(report.max_age, static_cast<double>(applied.age));
        local_parts += applied.local_parts;
      } else {
        report.exposed_seconds += std::chrono::duration<double>(sync.last_iteration().exposed).count();
        report.bytes_sent += sync.last_iteration().bytes_sent;
      }
      meter.stepped(step, loss);
    }
    meter.finished();
    report.local_parts = steps ? local_parts / static_cast<double>(steps) : 0;
    if (test)
      report.test_accuracy =
          static_cast<double>(model.correct(test->images.data(), test->labels.data(), test->count)) /
          static_cast<double>(test->count);
    reports.push_back(report);
  }
  if constexpr (Asynchronous<Sync>) sync.finish();
  return reports;
}

}  // namespace fmnist
