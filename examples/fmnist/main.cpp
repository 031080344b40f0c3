// fmnist — data-parallel training of an MLP on Fashion-MNIST through gradsync.
//
//   gradsync-run -n 4 fmnist [--epochs E] [--batch B] [--lr R] [--momentum M]
//                            [--bucketing fixed-size|per-tensor|time-clustered] [--codec NAME] [--threshold T]
//                            [--keep F] [--hidden 256,128] [--steps S] [--data DIR] [--json PATH] [--seed N]
//                            [--topology auto|ring|recursive-doubling|halving-doubling|parameter-server|hierarchical] [--servers S] [--dedicated]
//                            [--staleness S] [--quorum M] [--period K] [--slow-rank R] [--slow-factor F]
//                            [--executor task-graph|serial] [--device cpu|cuda [--ipc | --nccl]]
//
// One process per rank over TCP, placed by the launcher's variables; run without a launcher it
// trains alone. Rank 0 prints progress, the test accuracy and the communication figures. With
// --dedicated the last --servers ranks are parameter servers that only aggregate; the others train.
// With --topology parameter-server and any of --staleness, --quorum or --period the parameter
// server is asynchronous (gradsync::async::Synchronizer); --slow-rank makes one rank a straggler.
// With --device cuda the model trains on the GPU (device.cpp): gradients handed to the
// Synchronizer from the backward pass on the device, averaged over transport::CudaStaged (ranks
// sharing a GPU through host memory, or CUDA IPC with --ipc) or transport::Nccl (--nccl).

#include <algorithm>
#include <array>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/shipped.hpp"
#include "gradsync/transport/tcp.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/options.hpp"
#include "toolkit/workers.hpp"
#include "program.hpp"

namespace {

using namespace fmnist::program;

// Returns the asynchronous mode's options, whose presence main() looks at after parsing.
std::array<CLI::Option*, 3> declare_options(CLI::App& app, Options& o) {
  tk::add_number(app, "--epochs", o.train.epochs, "passes over the training set", {.low = 1});
  tk::add_number(app, "--batch", o.train.batch, "samples per step, per rank", {.low = 1});
  tk::add_number(app, "--lr", o.train.learning_rate, "learning rate", {.low = 0, .low_open = true});
  tk::add_number(app, "--momentum", o.train.momentum, "momentum", {.low = 0, .high = 1, .high_open = true});
  tk::add_choice(app, "--bucketing", o.bucketing, "how gradients are grouped into buckets", tk::bucketing_names);
  tk::add_codec_options(app, o.codec, o.codec_settings);
  tk::add_sizes(app, "--hidden", o.hidden, "the hidden layers' sizes");
  tk::add_number(app, "--steps", o.train.max_steps, "steps per epoch (0: the whole training set)");
  app.add_option("--data", o.data, "the directory of the Fashion-MNIST files")->capture_default_str();
  app.add_option("--json", o.json, "also write the results as JSON to this file");
  tk::add_number(app, "--seed", o.train.seed, "seeds the model, the shuffling and the codecs' random draws");
  tk::add_choice(app, "--topology", o.topology, "the schedule", tk::topology_names);
  tk::add_server_placement(app, o.servers, o.dedicated, o.topology);
  const std::array<CLI::Option*, 3> asynchronous{
      tk::add_number(app, "--staleness", o.asynchronous.staleness,
                     "asynchronous parameter server: iterations an applied global gradient may lag", {.low = 0}),
      tk::add_number(app, "--quorum", o.asynchronous.quorum,
                     "asynchronous parameter server: pushes that make a global gradient (0: every worker)", {.low = 0}),
      tk::add_number(app, "--period", o.asynchronous.period,
                     "asynchronous parameter server: parameters averaged every this many steps (0: never)", {.low = 0})};
  tk::add_number(app, "--slow-rank", o.train.slow_rank, "a straggler: this rank computes --slow-factor times slower");
  tk::add_number(app, "--slow-factor", o.train.slow_factor, "how much slower --slow-rank computes", {.low = 1});
  tk::add_choice(app, "--executor", o.executor, "how the Synchronizer runs compression and transfers",
                 {"task-graph", "serial"});
  tk::add_choice(app, "--device", o.device, "where the model trains: the CPU, or this rank's GPU", {"cpu", "cuda"});
  app.add_flag("--ipc", o.ipc, "--device cuda: ranks on one GPU exchange through CUDA IPC, not host memory");
  app.add_flag("--nccl", o.nccl, "--device cuda: transport::Nccl (one GPU a rank; --executor serial, --codec none)");
  app.footer("Start it with gradsync-run (or torchrun, mpirun, srun) for several ranks; --batch is per rank.");
  return asynchronous;
}

// The synchronous Synchronizer the options pick, from the library's shipped combinations.
int run(const Options& o, tk::JobTransport transport, const gs::shipped::Bucketing& bucketing,
        const gs::shipped::Codec& codec) {
  const gs::shipped::Topology topology = tk::topology_named(
      o.topology, {.ranks_per_machine = transport.local_size(), .servers = o.servers, .dedicated = o.dedicated});
  const auto sync = gs::make_synchronizer(std::move(transport), sync_options(o), bucketing, codec, topology);
  const auto describe = [](const auto& policy) { return std::visit([](const auto& p) { return p.describe(); }, policy); };
  const auto workers = static_cast<std::size_t>(
      std::visit([&](const auto& t) { return tk::workers(t, sync->size()); }, topology));
  return train_and_report(o, *sync, workers, describe(codec), describe(topology), [](auto&) {});
}

// The asynchronous parameter server. Its workers keep their own pace, so the samples per second
// of an epoch are each worker's own rate added up, gathered by an allreduce on the same
// connections once training is over.
template <class Bucketing, class Codec>
int run_asynchronous(const Options& o, tk::JobTransport transport, const Bucketing& bucketing, const Codec& codec) {
  using Borrowed = gs::transport::Borrowed<tk::JobTransport>;
  gs::async::Synchronizer<Bucketing, Codec, Borrowed> sync(Borrowed(transport), o.asynchronous, bucketing, codec);
  const auto workers = static_cast<std::size_t>(sync.size());
  const std::string topology =
      fmt::format("asynchronous parameter-server(staleness={}, quorum={}, period={})", o.asynchronous.staleness,
                  o.asynchronous.quorum ? o.asynchronous.quorum : sync.size(), o.asynchronous.period);
  return train_and_report(o, sync, workers, codec.describe(), topology, [&](std::vector<fmnist::EpochReport>& reports) {
    std::vector<float> rates;
    for (const auto& r : reports) rates.push_back(static_cast<float>(r.steps * o.train.batch / r.seconds));
    gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::None, gs::topology::Ring, Borrowed> gather(
        Borrowed(transport), {.timeout = std::chrono::minutes(2)});
    gather.add("samples per second", gs::view(rates));
    gather.ready(0);
    gather.wait();
    for (std::size_t e = 0; e < reports.size(); ++e)
      reports[e].samples_per_second = static_cast<double>(rates[e]) * static_cast<double>(workers);
  });
}

int run(const Options& o) {
  tk::JobTransport transport = tk::connect_or_alone();
  auto settings = o.codec_settings;
  settings.seed = o.train.seed;
  settings.rank = transport.rank();
  const gs::shipped::Codec codec = tk::codec_named(o.codec, settings);
  gs::shipped::Bucketing bucketing;
  if (o.bucketing == "per-tensor") bucketing = gs::bucketing::PerTensor{};
  if (o.bucketing == "time-clustered") bucketing = gs::bucketing::TimeClustered{};
  if (!o.is_asynchronous) return run(o, std::move(transport), bucketing, codec);
  return std::visit([&](const auto& b, const auto& c) { return run_asynchronous(o, std::move(transport), b, c); },
                    bucketing, codec);
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  CLI::App app("Data-parallel training of an MLP on Fashion-MNIST through gradsync", "fmnist");
  const auto asynchronous = declare_options(app, o);
  if (!tk::parse_options(app, argc, argv)) return 0;
  o.is_asynchronous = std::any_of(asynchronous.begin(), asynchronous.end(), [](auto* opt) { return opt->count() > 0; });
  if (o.is_asynchronous && (o.topology != "parameter-server" || o.servers != 0))
    throw std::invalid_argument("--staleness/--quorum/--period: the asynchronous mode is a parameter server with "
                                "co-located servers: --topology parameter-server, no --servers");
  if (o.device == "cuda") {
    // The ring alone: Auto's choice rests on a link probe, which a device transport does not run.
    if (o.is_asynchronous || (o.topology != "auto" && o.topology != "ring") || o.bucketing != "fixed-size")
      throw std::invalid_argument("--device cuda trains over the ring (--topology auto or ring), --bucketing fixed-size, "
                                  "synchronously");
#if FMNIST_HAS_DEVICE
    return train_on_device(o);
#else
    throw std::invalid_argument("--device cuda: this fmnist was built without CUDA and cuBLAS");
#endif
  }
  if (o.ipc || o.nccl) throw std::invalid_argument("--ipc and --nccl go with --device cuda");
  return run(o);
} catch (const std::exception& e) {
  std::fprintf(stderr, "fmnist: %s\n", e.what());
  return 1;
}
