// bench/setup — how long transport::Tcp takes to connect a job, round after round:
//
//   netcluster run 4 setup [--rounds R] [--json PATH]
//
// Each rank builds a Tcp from the launcher's variables R times in a row (each one connected,
// authenticated and closed before the next) and times its constructor; after each round the
// ranks gather their times on the round's own connections. Rank 0 prints, per round, its own time
// and the slowest rank's, then their medians. bench/flood.py, run beside it against rank 0's port,
// is the stranger who connects a great deal and says nothing useful (bench/README.md, "setup").

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace {

using namespace gradsync;
namespace tk = gradsync::toolkit;
using Clock = std::chrono::steady_clock;

struct Config {
  int rounds = 10;
  std::string json;
};

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("how long transport::Tcp takes to connect a job, round after round", "setup");
  tk::add_number(app, "--rounds", cfg.rounds, "setups timed, one after the other", {.low = 1});
  app.add_option("--json", cfg.json, "also write the rounds as JSON to this file");
  if (!tk::parse_options(app, argc, argv)) return 0;
  // Without a launcher, a world of one (nothing to connect): the program still runs end to end.
  const transport::TcpOptions options =
      tk::launched() ? transport::Tcp::options_from_env() : transport::TcpOptions{.token = "alone"};
  const auto n = static_cast<std::size_t>(options.world_size);
  std::vector<double> own_ms, slowest_ms;
  for (int round = 0; round < cfg.rounds; ++round) {
    const auto started = Clock::now();
    transport::Tcp tcp(options);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    // Every rank's time, by rank: each fills its own entry, so the average times n is the table.
    std::vector<double> times(n);
    times[static_cast<std::size_t>(tcp.rank())] = ms;
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::Borrowed<transport::Tcp>> gather(
        transport::Borrowed<transport::Tcp>(tcp), {.log = {}});
    gather.add("setup times", view(times));
    gather.ready(0);
    gather.wait();
    double slowest = 0;
    for (double& t : times) slowest = std::max(slowest, t *= static_cast<double>(n));
    own_ms.push_back(ms);
    slowest_ms.push_back(slowest);
    if (tcp.rank() == 0) fmt::print("round {:>3}: rank 0 {:8.1f} ms, slowest rank {:8.1f} ms\n", round + 1, ms, slowest);
  }
  if (options.rank != 0) return 0;
  fmt::print("median over {} rounds: rank 0 {:.1f} ms, slowest rank {:.1f} ms\n", cfg.rounds, tk::median(own_ms),
             tk::median(slowest_ms));
  if (!cfg.json.empty())
    tk::write_json(cfg.json, {{"ranks", n},
                              {"ranks_per_machine", std::max(options.local_size, 1)},
                              {"rounds", cfg.rounds},
                              {"rank0_ms", own_ms},
                              {"slowest_ms", slowest_ms},
                              {"median_rank0_ms", tk::rounded(tk::median(own_ms), 2)},
                              {"median_slowest_ms", tk::rounded(tk::median(slowest_ms), 2)}});
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "setup: %s\n", e.what());
  return 1;
}
