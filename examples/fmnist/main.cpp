// fmnist — data-parallel training of an MLP on Fashion-MNIST through gradsync.
//
//   gradsync-run -n 4 fmnist [--epochs E] [--batch B] [--lr R] [--momentum M]
//                            [--bucketing fixed-size|per-tensor|time-clustered] [--codec NAME] [--threshold T]
//                            [--keep F] [--hidden 256,128] [--steps S] [--data DIR] [--json PATH] [--seed N]
//                            [--topology ring|parameter-server] [--servers S] [--dedicated]
//
// One process per rank over TCP, placed by the launcher's variables; run without a launcher it
// trains alone. Rank 0 prints progress, the test accuracy and the communication figures. With
// --dedicated the last --servers ranks are parameter servers that only aggregate; the others train.

#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/os.h>

#include "toolkit/codec_by_name.hpp"
#include "toolkit/connect.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"
#include "trainer.hpp"
#include "toolkit/workers.hpp"

namespace {

namespace gs = gradsync;

struct Options {
  fmnist::TrainConfig train;
  std::string bucketing = "fixed-size";
  std::string codec = "none";
  // Two-bit's threshold for this model's gradients (the library's default, MXNet's 0.5, is for
  // larger ones); see results/README.md for how it was chosen.
  gradsync::toolkit::CodecSettings codec_settings{.threshold = 0.1f};
  std::vector<std::size_t> hidden{256, 128};
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string json;
  std::string topology = "ring";
  std::size_t servers = 0;
  bool dedicated = false;
};

constexpr const char* usage =
    "usage: fmnist [--epochs E] [--batch B] [--lr R] [--momentum M] [--bucketing fixed-size|per-tensor|time-clustered]\n"
    "              [--codec NAME] [--threshold T] [--keep F] [--hidden 256,128] [--steps S] [--data DIR]\n"
    "              [--json PATH] [--seed N] [--topology ring|parameter-server] [--servers S] [--dedicated]\n"
    "Start it with gradsync-run (or torchrun, mpirun, srun) for several ranks; --batch is per rank.\n"
    "--threshold: two-bit's (default 0.1); --keep: the fraction top-k and random-k keep (default 0.01).\n"
    "Codecs: ";

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--epochs") o.train.epochs = std::stoi(value());
    else if (arg == "--batch") o.train.batch = std::stoul(value());
    else if (arg == "--lr") o.train.learning_rate = std::stof(value());
    else if (arg == "--momentum") o.train.momentum = std::stof(value());
    else if (arg == "--steps") o.train.max_steps = std::stoul(value());
    else if (arg == "--seed") o.train.seed = std::stoull(value());
    else if (arg == "--bucketing") o.bucketing = value();
    else if (arg == "--codec") o.codec = value();
    else if (arg == "--threshold") o.codec_settings.threshold = std::stof(value());
    else if (arg == "--keep") o.codec_settings.keep = std::stod(value());
    else if (arg == "--data") o.data = value();
    else if (arg == "--json") o.json = value();
    else if (arg == "--topology") o.topology = value();
    else if (arg == "--servers") o.servers = std::stoul(value());
    else if (arg == "--dedicated") o.dedicated = true;
    else if (arg == "--hidden") {
      o.hidden.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) o.hidden.push_back(std::stoul(item));
    } else if (arg == "--help" || arg == "-h") {
      fmt::print("{}{}\n", usage, gradsync::toolkit::codec_names);
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown option " + arg + "\n" + usage + gradsync::toolkit::codec_names);
    }
  }
  if (o.train.epochs < 1 || o.train.batch < 1 || o.hidden.empty())
    throw std::invalid_argument("--epochs and --batch must be positive and --hidden must list at least one layer");
  if (o.bucketing != "fixed-size" && o.bucketing != "per-tensor" && o.bucketing != "time-clustered")
    throw std::invalid_argument("--bucketing must be fixed-size, per-tensor or time-clustered");
  if (o.topology != "ring" && o.topology != "parameter-server")
    throw std::invalid_argument("--topology must be ring or parameter-server");
  if ((o.servers > 0 || o.dedicated) && o.topology != "parameter-server")
    throw std::invalid_argument("--servers and --dedicated need --topology parameter-server");
  return o;
}

// A bar on a terminal; every tenth of the epoch as a line otherwise (gradsync-run, logs).
fmnist::Progress progress_printer() {
  const bool terminal = ::isatty(STDOUT_FILENO);
  return [terminal, last_tenth = std::size_t{0}](int epoch, std::size_t step, std::size_t steps, double rate,
                                                 double loss) mutable {
    const std::size_t tenth = step * 10 / steps;
    if (!terminal && tenth == last_tenth && step != steps) return;
    last_tenth = step == steps ? 0 : tenth;
    constexpr int width = 30;
    const int filled = static_cast<int>(width * step / steps);
    fmt::print("{}epoch {} [{}{}] {:>5}/{} steps  {:>7.0f} samples/s  loss {:.4f}{}", terminal ? "\r" : "", epoch,
               std::string(static_cast<std::size_t>(filled), '#'), std::string(static_cast<std::size_t>(width - filled), '.'),
               step, steps, rate, loss, terminal && step != steps ? "" : "\n");
    std::fflush(stdout);
  };
}

template <class Bucketing, class Codec, class Topology>
int run(const Options& o, gs::transport::Tcp transport, const Codec& codec, const Topology& topology) {
  using Sync = gs::Synchronizer<Bucketing, Codec, Topology, gs::transport::Tcp>;
  Sync sync(std::move(transport), {.timeout = std::chrono::minutes(2)}, {}, codec, topology);
  const bool leader = sync.rank() == 0;
  fmnist::TrainConfig train = o.train;
  train.workers = static_cast<std::size_t>(gradsync::toolkit::workers(topology, sync.size()));
  const fmnist::Dataset train_set = fmnist::load_split(o.data, true);
  const fmnist::Dataset test_set = fmnist::load_split(o.data, false);
  std::vector<std::size_t> sizes{train_set.pixels};
  sizes.insert(sizes.end(), o.hidden.begin(), o.hidden.end());
  sizes.push_back(10);
  fmnist::Mlp model(sizes, o.train.seed);
  const std::size_t gradient_bytes = model.parameters() * sizeof(float);
  if (leader)
    fmt::print("fmnist: {} workers x batch {}{} | MLP {} ({} parameters, {:.2f} MB of f32 gradients a step) | "
               "bucketing {} | codec {} | {} | lr {} momentum {}\n",
               train.workers, o.train.batch,
               train.workers < static_cast<std::size_t>(sync.size())
                   ? fmt::format(" + {} dedicated server(s)", static_cast<std::size_t>(sync.size()) - train.workers)
                   : "",
               fmt::join(sizes, "-"), model.parameters(), gradient_bytes / 1e6, o.bucketing, codec.describe(),
               topology.describe(), o.train.learning_rate, o.train.momentum);
  const auto reports = fmnist::train(sync, model, train_set, leader ? &test_set : nullptr, train,
                                     leader ? progress_printer() : fmnist::Progress{});
  if (!leader) return 0;
  double seconds = 0, exposed = 0;
  std::uint64_t bytes = 0;
  std::size_t steps = 0;
  for (const auto& r : reports) {
    fmt::print("epoch {}: test accuracy {:.4f} | {:.1f} s, {:.0f} samples/s | waiting on synchronization {:.1f} s "
               "({:.0f}% of the time) | {:.1f} MB sent by rank 0 ({:.2f} MB a step)\n",
               r.epoch, r.test_accuracy, r.seconds, r.samples_per_second, r.exposed_seconds,
               100 * r.exposed_seconds / r.seconds, r.bytes_sent / 1e6, r.steps ? r.bytes_sent / 1e6 / r.steps : 0.0);
    seconds += r.seconds;
    exposed += r.exposed_seconds;
    bytes += r.bytes_sent;
    steps += r.steps;
  }
  const auto& last = reports.back();
  fmt::print("done: {} ranks, {} epochs, test accuracy {:.4f}, {:.0f} samples/s, {:.0f}% of step time waiting on "
             "synchronization\n",
             sync.size(), reports.size(), last.test_accuracy, static_cast<double>(steps * o.train.batch * train.workers) / seconds,
             100 * exposed / seconds);
  if (!o.json.empty()) {
    auto out = fmt::output_file(o.json);
    out.print(R"({{"ranks": {}, "workers": {}, "batch_per_rank": {}, "layers": [{}], "parameters": {}, )"
              R"("bucketing": "{}", "codec": "{}", "topology": "{}", "learning_rate": {}, "momentum": {}, "epochs": [)",
              sync.size(), train.workers, o.train.batch, fmt::join(sizes, ", "), model.parameters(), o.bucketing,
              codec.describe(), topology.describe(), o.train.learning_rate, o.train.momentum);
    for (std::size_t i = 0; i < reports.size(); ++i) {
      const auto& r = reports[i];
      out.print(R"({}{{"epoch": {}, "steps": {}, "seconds": {:.3f}, "samples_per_second": {:.1f}, "loss": {:.5f}, )"
                R"("test_accuracy": {:.4f}, "exposed_seconds": {:.3f}, "bytes_sent": {}}})",
                i ? ", " : "", r.epoch, r.steps, r.seconds, r.samples_per_second, r.loss, r.test_accuracy,
                r.exposed_seconds, r.bytes_sent);
    }
    out.print("]}}\n");
  }
  return 0;
}

template <class Bucketing>
int with_codec(const Options& o) {
  gs::transport::Tcp transport = gradsync::toolkit::connect_or_alone();
  auto settings = o.codec_settings;
  settings.seed = o.train.seed;
  settings.rank = transport.rank();
  return gradsync::toolkit::with_codec(o.codec, settings, [&]<class Codec>(const Codec& codec) {
    if (o.topology == "parameter-server")
      return run<Bucketing>(o, std::move(transport), codec,
                            gs::topology::ParameterServer{.servers = o.servers, .dedicated = o.dedicated});
    return run<Bucketing>(o, std::move(transport), codec, gs::topology::Ring{});
  });
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  if (o.bucketing == "per-tensor") return with_codec<gs::bucketing::PerTensor>(o);
  if (o.bucketing == "time-clustered") return with_codec<gs::bucketing::TimeClustered>(o);
  return with_codec<gs::bucketing::FixedSize>(o);
} catch (const std::exception& e) {
  std::fprintf(stderr, "fmnist: %s\n", e.what());
  return 1;
}
