#pragma once
// The hybrid trainer's loop (the third source document), and plain data parallelism of the same
// model to compare it with, on any transport.
//
// Hybrid: the first half of the ranks train the convolutional layers (the conv ranks, ring 1),
// the second half the fully connected layers (the fc ranks, ring 2); conv rank i and fc rank i
// are a pair. Each step, every pair takes its shard of the global batch: the conv rank computes
// the features and sends them to its fc rank, which runs the fc layers forward and backward,
// sends back the features' gradient as soon as its first layer has it, then the batch's loss;
// the conv rank runs backward through the conv layers. Each ring averages its layers' gradients
// as backward marks them ready, so both halves end with the gradient of the whole global batch.
//
// Data parallel: every rank holds the whole model and trains on its shard; one ring over every
// rank averages all the layers.
//
// Updates: after wait() (the usual place), or in the background (Synchronizer::on_averaged): each
// layer's SGD step runs as soon as its average is in, while backward still runs on the layers
// below. Both give the same parameters, bit for bit.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "conv.hpp"
#include "gradsync/gradsync.hpp"
#include "idx.hpp"
#include "mlp.hpp"

namespace hybrid {

enum class Mode { hybrid, data_parallel };
enum class Updates { after_wait, background };

// The whole CNN: every rank builds all of it from the seed, and uses its part.
struct Model {
  ConvStack conv;
  fmnist::Mlp fc;

  // Square images of side `side` (one channel); per block two convolutions of `channels[k]`
  // outputs, then 2x2 pooling; then fully connected layers of `hidden` sizes and 10 classes.
  Model(std::size_t side, const std::vector<std::size_t>& channels, const std::vector<std::size_t>& hidden,
        std::uint64_t seed);

  std::size_t parameters() const noexcept { return conv.parameters() + fc.parameters(); }
  // How many of `data`'s samples the model classifies correctly.
  std::size_t correct(const fmnist::Dataset& data);
};

struct Config {
  Mode mode = Mode::hybrid;
  Updates updates = Updates::background;
  int epochs = 1;
  std::size_t batch = 64;  // global: samples per step over the whole job
  float learning_rate = 0.05f;
  float momentum = 0.5f;
  std::uint64_t seed = 1;
  std::size_t max_steps = 0;  // per epoch; 0: the whole training set
  bool evaluate = false;      // test accuracy on rank 0 after each epoch (same on every rank)
  std::chrono::milliseconds timeout{std::chrono::minutes(2)};
};

struct EpochReport {
  int epoch = 0;
  std::size_t steps = 0;
  double seconds = 0;
  double samples_per_second = 0;  // the whole job's
  double loss = 0;                // mean of the batch losses this rank computed or received
  double test_accuracy = -1;      // rank 0, where evaluated
  double exposed_seconds = 0;     // time wait() blocked
  double update_seconds = 0;      // time the trainer spent in SGD after wait() (0 in the background)
  std::uint64_t bytes_sent = 0;   // by this rank: gradients and the pair's tensors
  std::uint64_t pair_bytes = 0;   // of which to its pair
  // Every rank's bytes_sent and update_seconds, by rank, gathered at the end of training.
  std::vector<double> rank_bytes_sent, rank_update_seconds;
  double job_bytes_per_step = 0;  // rank_bytes_sent added up, per step
};

// progress(epoch, step, steps, samples_per_second, loss) after every step, on every rank.
using Progress = std::function<void(int, std::size_t, std::size_t, double, double)>;

// What this rank does: which layers it trains, with whom it averages them, and its shard.
struct Role {
  bool conv = false, fc = false;
  int pair = -1;  // hybrid: the partner's transport rank
  gradsync::Group group;
  std::size_t shard = 0, shards = 1;  // this rank's (or pair's) part of each global batch

  // Throws std::invalid_argument where the mode cannot run on `size` ranks.
  static Role of(Mode mode, int rank, int size);
};

// The PeerChannel streams of a pair (ids must agree on both sides). Named constants rather than an
// unscoped enum, whose `features` and `loss` would stand in the namespace beside train()'s locals.
struct Stream {
  static constexpr std::uint32_t features = 0, feature_gradients = 1, loss = 2, fc_parameters = 3;
};

// Trains `model` on `data` with every other rank of `world` (all calling this with the same
// arguments but `test`, which only rank 0 needs). Returns this rank's reports.
template <gradsync::TransportPolicy X>
std::vector<EpochReport> train(X& world, Model& model, const fmnist::Dataset& data, const fmnist::Dataset* test,
                               const Config& cfg, const Progress& progress = {}) {
  namespace gs = gradsync;
  using Link = gs::transport::Borrowed<X>;
  using Sync = gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::None, gs::topology::Ring, Link>;
  const Role role = Role::of(cfg.mode, world.rank(), world.size());
  const bool hybrid = cfg.mode == Mode::hybrid;
  if (cfg.batch % role.shards)
    throw std::invalid_argument("the global batch (" + std::to_string(cfg.batch) + ") must be a multiple of " +
                                std::to_string(role.shards) + " shards");
  const std::size_t local = cfg.batch / role.shards;
  const std::size_t features = model.conv.features();
  if (model.conv.inputs() != data.pixels || model.fc.layers().front().in != features)
    throw std::invalid_argument("the model's input does not match the data's images");

  Sync sync(Link(world), role.group, {.timeout = cfg.timeout});
  std::optional<gs::PeerChannel<Link>> pair;
  if (hybrid) pair.emplace(Link(world), role.pair, cfg.timeout, "conv-fc pair");

  // Every gradient this rank averages, by id, with its parameters and momentum.
  struct Tensor {
    std::span<float> parameters, velocity;
    std::span<const float> gradient;
  };
  std::vector<Tensor> tensors;
  const auto add = [&](const std::string& name, std::vector<float>& p, std::vector<float>& v, std::vector<float>& g) {
    tensors.push_back({p, v, g});
    return sync.add(name, gs::view(g));
  };
  std::vector<std::pair<gs::GradId, gs::GradId>> conv_ids, fc_ids;  // per layer: weights, bias
  if (role.conv)
    for (std::size_t l = 0; l < model.conv.layers().size(); ++l) {
      ConvLayer& L = model.conv.layers()[l];
      const std::string name = "conv" + std::to_string(l + 1);
      conv_ids.emplace_back(add(name + ".weight", L.w, L.vw, L.gw), add(name + ".bias", L.b, L.vb, L.gb));
    }
  if (role.fc)
    for (std::size_t l = 0; l < model.fc.layers().size(); ++l) {
      fmnist::Layer& L = model.fc.layers()[l];
      const std::string name = "fc" + std::to_string(l + 1);
      fc_ids.emplace_back(add(name + ".weight", L.w, L.vw, L.gw), add(name + ".bias", L.b, L.vb, L.gb));
    }
  if (cfg.updates == Updates::background)
    sync.on_averaged([&](gs::GradId id) {
      fmnist::sgd(tensors[id].parameters, tensors[id].velocity, tensors[id].gradient, cfg.learning_rate, cfg.momentum);
    });
  const auto ready = [&](const std::vector<std::pair<gs::GradId, gs::GradId>>& ids) {
    return [&sync, &ids](std::size_t l) {
      sync.ready(ids[l].first);
      sync.ready(ids[l].second);
    };
  };

  std::size_t steps = data.count / cfg.batch;
  if (cfg.max_steps) steps = std::min(steps, cfg.max_steps);
  std::vector<std::size_t> order(data.count);
  std::vector<float> x(role.conv ? local * data.pixels : 0);
  std::vector<std::uint8_t> y(local);
  std::vector<float> received(hybrid && role.fc ? local * features : 0);  // an fc rank's features
  std::vector<float> d_features(local * features);
  float loss = 0;
  std::vector<EpochReport> reports;
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    fmnist::epoch_order(order, cfg.seed, epoch);
    EpochReport report{.epoch = epoch, .steps = steps};
    double loss_sum = 0;
    const std::uint64_t pair_bytes_before = pair ? pair->bytes_sent() : 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t step = 0; step < steps; ++step) {
      for (std::size_t s = 0; s < local; ++s) {
        const std::size_t sample = order[step * cfg.batch + role.shard * local + s];
        if (role.conv)
          std::copy_n(data.images.begin() + static_cast<std::ptrdiff_t>(sample * data.pixels), data.pixels,
                      x.begin() + static_cast<std::ptrdiff_t>(s * data.pixels));
        y[s] = data.labels[sample];
      }
      if (role.conv) {
        const float* f = model.conv.forward(x.data(), local);
        if (hybrid) {
          pair->send(std::span(f, local * features), Stream::features);
          pair->recv(std::span(d_features), Stream::feature_gradients);
        } else {
          loss = model.fc.train_step(f, y.data(), local, ready(fc_ids), d_features.data());
        }
        model.conv.backward(d_features.data(), local, ready(conv_ids));
        if (hybrid) pair->recv(std::span(&loss, 1), Stream::loss);
      } else {
        pair->recv(std::span(received), Stream::features);
        loss = model.fc.train_step(received.data(), y.data(), local, [&](std::size_t l) {
          if (l == 0) pair->send(std::span<const float>(d_features), Stream::feature_gradients);
          ready(fc_ids)(l);
        }, d_features.data());
        pair->send(std::span<const float>(&loss, 1), Stream::loss);
      }
      sync.wait();
      if (cfg.updates == Updates::after_wait) {
        const auto updating = std::chrono::steady_clock::now();
        if (role.conv) model.conv.sgd_step(cfg.learning_rate, cfg.momentum);
        if (role.fc) model.fc.sgd_step(cfg.learning_rate, cfg.momentum);
        report.update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - updating).count();
      }
      loss_sum += loss;
      report.exposed_seconds += std::chrono::duration<double>(sync.last_iteration().exposed).count();
      report.bytes_sent += sync.last_iteration().bytes_sent;
      if (progress) {
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        progress(epoch, step + 1, steps, static_cast<double>((step + 1) * cfg.batch) / elapsed,
                 loss_sum / static_cast<double>(step + 1));
      }
    }
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.samples_per_second = static_cast<double>(steps * cfg.batch) / report.seconds;
    report.loss = steps ? loss_sum / static_cast<double>(steps) : 0;
    if (pair) report.pair_bytes = pair->bytes_sent() - pair_bytes_before;
    report.bytes_sent += report.pair_bytes;
    if (cfg.evaluate) {
      // Rank 0 (a conv rank in hybrid mode) takes its partner's fc layers to test the whole model.
      if (hybrid && world.rank() == 0)
        for (fmnist::Layer& L : model.fc.layers()) {
          pair->recv(std::span(L.w), Stream::fc_parameters);
          pair->recv(std::span(L.b), Stream::fc_parameters);
        }
      if (hybrid && role.pair == 0)
        for (const fmnist::Layer& L : model.fc.layers()) {
          pair->send(std::span<const float>(L.w), Stream::fc_parameters);
          pair->send(std::span<const float>(L.b), Stream::fc_parameters);
        }
      if (world.rank() == 0 && test)
        report.test_accuracy = static_cast<double>(model.correct(*test)) / static_cast<double>(test->count);
    }
    reports.push_back(report);
  }

  // Every rank's figures, gathered: each rank fills its own entries, the others stay 0, so the
  // world's average times its size is the table (exact in f64: one nonzero term per entry).
  // `sync` is idle by now: no message of its is in flight that the world's tags could be taken for.
  const auto size = static_cast<std::size_t>(world.size()), me = static_cast<std::size_t>(world.rank());
  std::vector<double> table(2 * reports.size() * size);
  for (std::size_t e = 0; e < reports.size(); ++e) {
    table[(2 * e) * size + me] = static_cast<double>(reports[e].bytes_sent);
    table[(2 * e + 1) * size + me] = reports[e].update_seconds;
  }
  gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::None, gs::topology::Ring, Link> gather(
      Link(world), {.timeout = cfg.timeout});
  gather.add("per-rank figures", gs::view(table));
  gather.ready(0);
  gather.wait();
  for (std::size_t e = 0; e < reports.size(); ++e) {
    EpochReport& r = reports[e];
    for (std::size_t k = 0; k < size; ++k) {
      r.rank_bytes_sent.push_back(std::round(table[(2 * e) * size + k] * static_cast<double>(size)));
      r.rank_update_seconds.push_back(table[(2 * e + 1) * size + k] * static_cast<double>(size));
    }
    r.job_bytes_per_step = r.steps ? std::accumulate(r.rank_bytes_sent.begin(), r.rank_bytes_sent.end(), 0.0) /
                                         static_cast<double>(r.steps)
                                   : 0;
  }
  return reports;
}

}  // namespace hybrid
