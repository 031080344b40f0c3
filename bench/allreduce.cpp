// bench/allreduce — time one Synchronizer iteration (pack, ring allreduce, unpack) of a single
// gradient of each size, nccl-tests style, beside a plain memcpy of the same bytes.
//
//   allreduce [--ranks N] [--min-bytes B] [--max-bytes B] [--step-factor F] [--iters I]
//             [--warmup W] [--codec none|fp16|bf16] [--json PATH]
//
// Ranks are threads over transport::InProcess. Every rank starts each iteration at a barrier; an
// iteration's time is the slowest rank's, and the table reports the median over iterations.
// algbw = bytes / time; busbw = algbw * 2(n-1)/n, the bytes each rank must move through its link
// in a ring allreduce, so busbw is comparable across world sizes (the nccl-tests definition).

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/os.h>

#include "gradsync/gradsync.hpp"

namespace {

using namespace gradsync;
using Clock = std::chrono::steady_clock;

struct Config {
  int ranks = 4;
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t step_factor = 4;
  int iters = 20;
  int warmup = 3;
  std::string codec = "none";
  std::string json;
};

struct Row {
  std::size_t bytes = 0;
  double time_us = 0;
  double memcpy_us = 0;
  std::size_t wrong = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

double bus_factor(int n) { return n > 1 ? 2.0 * (n - 1) / n : 1.0; }

// Median time of copying `bytes` between two buffers on one thread.
double memcpy_us(std::size_t bytes, int iters) {
  std::vector<std::byte> from(bytes, std::byte{1}), to(bytes);
  std::vector<double> times;
  for (int i = 0; i < iters + 1; ++i) {
    const auto start = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (i > 0) times.push_back(us);  // the first touches fresh pages
  }
  return median(times);
}

template <class Codec>
Row measure(const Config& cfg, std::size_t bytes) {
  const std::size_t count = bytes / sizeof(float);
  const int n = cfg.ranks;
  auto world = transport::InProcess::create_world(n);
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(n));
  std::vector<std::size_t> wrong(static_cast<std::size_t>(n));
  std::barrier start(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> grad(count);
      Synchronizer<bucketing::FixedSize, Codec, topology::Ring, transport::InProcess> sync(
          std::move(world[static_cast<std::size_t>(r)]), {}, {.cap_bytes = bytes, .first_cap_bytes = bytes});
      sync.add("gradient", view(grad));
      auto& times = per_rank[static_cast<std::size_t>(r)];
      for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
        std::fill(grad.begin(), grad.end(), static_cast<float>(r + 1));
        start.arrive_and_wait();
        const auto t0 = Clock::now();
        sync.ready(0);
        sync.wait();
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= cfg.warmup) times.push_back(us);
        if (i == 0) {  // the average of 1..n is exact in every codec here
          const float expected = static_cast<float>(n + 1) / 2.0f;
          wrong[static_cast<std::size_t>(r)] = static_cast<std::size_t>(
              std::count_if(grad.begin(), grad.end(), [&](float v) { return v != expected; }));
        }
      }
    });
  for (auto& t : threads) t.join();
  std::vector<double> slowest(static_cast<std::size_t>(cfg.iters));
  for (int i = 0; i < cfg.iters; ++i)
    for (const auto& times : per_rank) slowest[static_cast<std::size_t>(i)] = std::max(slowest[static_cast<std::size_t>(i)], times[static_cast<std::size_t>(i)]);
  Row row{.bytes = bytes, .time_us = median(slowest), .memcpy_us = memcpy_us(bytes, cfg.iters)};
  for (std::size_t w : wrong) row.wrong += w;
  return row;
}

Row measure(const Config& cfg, std::size_t bytes) {
  if (cfg.codec == "fp16") return measure<compression::Fp16>(cfg, bytes);
  if (cfg.codec == "bf16") return measure<compression::Bf16>(cfg, bytes);
  return measure<compression::None>(cfg, bytes);
}

std::size_t parse_size(const std::string& s) {
  std::size_t pos = 0;
  std::size_t v = std::stoull(s, &pos);
  const std::string unit = s.substr(pos);
  if (unit == "K" || unit == "KiB") v <<= 10;
  else if (unit == "M" || unit == "MiB") v <<= 20;
  else if (unit == "G" || unit == "GiB") v <<= 30;
  else if (!unit.empty()) throw std::invalid_argument("unknown size unit '" + unit + "'");
  return v;
}

Config parse(int argc, char** argv) {
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ranks") cfg.ranks = std::stoi(value());
    else if (arg == "--min-bytes") cfg.min_bytes = parse_size(value());
    else if (arg == "--max-bytes") cfg.max_bytes = parse_size(value());
    else if (arg == "--step-factor") cfg.step_factor = std::stoull(value());
    else if (arg == "--iters") cfg.iters = std::stoi(value());
    else if (arg == "--warmup") cfg.warmup = std::stoi(value());
    else if (arg == "--codec") cfg.codec = value();
    else if (arg == "--json") cfg.json = value();
    else if (arg == "--help" || arg == "-h") {
      fmt::print("usage: allreduce [--ranks N] [--min-bytes B] [--max-bytes B] [--step-factor F] [--iters I]\n"
                 "                 [--warmup W] [--codec none|fp16|bf16] [--json PATH]\n"
                 "sizes take K, M or G suffixes (binary)\n");
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown option " + arg);
    }
  }
  if (cfg.ranks < 1 || cfg.iters < 1 || cfg.warmup < 1 || cfg.step_factor < 2 || cfg.min_bytes < sizeof(float) ||
      cfg.min_bytes > cfg.max_bytes)
    throw std::invalid_argument("need ranks >= 1, iters >= 1, warmup >= 1, step-factor >= 2, 4 <= min-bytes <= max-bytes");
  if (cfg.codec != "none" && cfg.codec != "fp16" && cfg.codec != "bf16")
    throw std::invalid_argument("codec must be none, fp16 or bf16");
  return cfg;
}

}  // namespace

int main(int argc, char** argv) try {
  const Config cfg = parse(argc, argv);
  fmt::print("# gradsync allreduce: {} ranks, transport in-process, topology ring, bucketing fixed-size, codec {}\n",
             cfg.ranks, cfg.codec);
  fmt::print("# {} hardware threads; median of {} iterations after {} warm-up; memcpy: one thread, same bytes\n",
             std::thread::hardware_concurrency(), cfg.iters, cfg.warmup);
  fmt::print("#\n# {:>12} {:>11} {:>5} {:>11} {:>8} {:>8} {:>11} {:>9} {:>6}\n", "size", "count", "type", "time",
             "algbw", "busbw", "memcpy", "time/cpy", "#wrong");
  fmt::print("# {:>12} {:>11} {:>5} {:>11} {:>8} {:>8} {:>11} {:>9} {:>6}\n", "(B)", "(elements)", "", "(us)",
             "(GB/s)", "(GB/s)", "(us)", "", "");
  std::vector<Row> rows;
  std::size_t wrong = 0;
  for (std::size_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= cfg.step_factor) {
    const Row row = measure(cfg, bytes / sizeof(float) * sizeof(float));
    const double algbw = static_cast<double>(row.bytes) / row.time_us / 1e3;
    fmt::print("  {:>12} {:>11} {:>5} {:>11.1f} {:>8.3f} {:>8.3f} {:>11.1f} {:>9.2f} {:>6}\n", row.bytes,
               row.bytes / sizeof(float), "float", row.time_us, algbw, algbw * bus_factor(cfg.ranks), row.memcpy_us,
               row.time_us / row.memcpy_us, row.wrong);
    std::fflush(stdout);
    rows.push_back(row);
    wrong += row.wrong;
  }
  fmt::print("# out of bounds values: {} {}\n", wrong, wrong ? "ERROR" : "OK");
  if (!cfg.json.empty()) {
    auto out = fmt::output_file(cfg.json);
    out.print("[\n");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double algbw = static_cast<double>(r.bytes) / r.time_us / 1e3;
      out.print(R"(  {{"bytes": {}, "ranks": {}, "topology": "ring", "codec": "{}", "transport": "in-process", )"
                R"("time_us": {:.3f}, "algbw_GBps": {:.4f}, "busbw_GBps": {:.4f}, "memcpy_us": {:.3f}, "wrong": {}}}{})"
                "\n",
                r.bytes, cfg.ranks, cfg.codec, r.time_us, algbw, algbw * bus_factor(cfg.ranks), r.memcpy_us, r.wrong,
                i + 1 < rows.size() ? "," : "");
    }
    out.print("]\n");
  }
  return wrong ? 1 : 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "allreduce: {}\n", e.what());
  return 2;
}
