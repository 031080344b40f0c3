// bench/timeline — what recording an event on a Timeline (timeline.hpp) costs: --threads threads
// record --events events each into one timeline big enough for all of them, as a Synchronizer's
// caller, communication and compute threads do; then the trace is formatted and written once.
// Each of --repeats runs has a fresh timeline; the table gives the medians.
//
//   timeline [--events N] [--threads T] [--repeats R] [--json PATH]
//
// ns/event is the wall time of the recording phase divided by each thread's events (what one
// thread pays per event while the others record too); write is the file's formatting and writing,
// per event kept.

#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/timeline.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace {

namespace tk = gradsync::toolkit;
using gradsync::Timeline;
using Clock = std::chrono::steady_clock;

struct Config {
  int events = 100000;
  int threads = 1;
  int repeats = 5;
  std::string json;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("the cost of recording timeline events, and of writing the trace", "timeline");
  tk::add_number(app, "--events", cfg.events, "events each thread records", {.low = 1});
  tk::add_number(app, "--threads", cfg.threads, "threads recording at once", {.low = 1, .high = 64});
  tk::add_number(app, "--repeats", cfg.repeats, "runs, each with a fresh timeline", {.low = 1});
  app.add_option("--json", cfg.json, "also write the medians as JSON to this file");
  if (!tk::parse_options(app, argc, argv)) return 0;
  const std::string path = fmt::format("/tmp/gradsync-timeline-bench-{}.json", ::getpid());
  std::vector<double> record_ns, write_ns;
  for (int run = 0; run < cfg.repeats; ++run) {
    Timeline timeline(path, 0, static_cast<std::size_t>(cfg.events) * static_cast<std::size_t>(cfg.threads));
    std::barrier start(cfg.threads + 1);
    std::vector<std::thread> threads;
    for (int t = 0; t < cfg.threads; ++t)
      threads.emplace_back([&, t] {
        start.arrive_and_wait();
        for (int i = 0; i < cfg.events; ++i)  // a transfer's span: the kind with the most fields
          timeline.record(Timeline::Kind::send, timeline.now(), static_cast<std::uint32_t>(t),
                          static_cast<std::uint64_t>(i), 1);
      });
    start.arrive_and_wait();
    const auto recording = Clock::now();
    for (auto& thread : threads) thread.join();
    record_ns.push_back(seconds_since(recording) * 1e9 / cfg.events);
    const auto writing = Clock::now();
    timeline.write();
    write_ns.push_back(seconds_since(writing) * 1e9 / static_cast<double>(timeline.recorded()));
  }
  std::remove(path.c_str());
  const double record = tk::median(record_ns), write = tk::median(write_ns);
  fmt::print("{:>8} {:>10} {:>10} {:>16}\n", "threads", "events", "ns/event", "write ns/event");
  fmt::print("{:>8} {:>10} {:>10.1f} {:>16.1f}\n", cfg.threads, cfg.events, record, write);
  if (!cfg.json.empty())
    tk::write_json(cfg.json, {{"threads", cfg.threads},
                              {"events_per_thread", cfg.events},
                              {"repeats", cfg.repeats},
                              {"record_ns_per_event", tk::rounded(record, 2)},
                              {"write_ns_per_event", tk::rounded(write, 2)}});
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "timeline: %s\n", e.what());
  return 1;
}
