// bench/scale_model — what 1,024 to 16,384 ranks would take, from the library's own cost model:
// transport::Tcp's setup, one allreduce by each schedule, and a traced model's iteration; and,
// with --validate, the model beside what bench/allreduce and bench/setup measured.
//
//   scale_model [--latency-us L] [--bandwidth 25Gbit/s|3.1GB/s] [--ranks-per-machine R]
//               [--intra-latency-us L] [--intra-bandwidth B] [--ranks N,N,...] [--sizes 4K,1M,64M]
//               [--codec NAME] [--codec-results FILE] [--trace FILE...] [--cap-mib C]
//               [--report-us U] [--listen-backlog B] [--json PATH]
//   scale_model --validate FILE... [--latency-us L --bandwidth B] [--json PATH]
//
// The link is one message's cost between two machines, latency + bytes / bandwidth (LinkModel, as
// topology::Auto predicts with it); --intra-* is the same between two ranks of one machine (shared
// memory). The model is in scale_model.hpp: the allreduce times are predicted_seconds of
// topology::Ring, RecursiveDoubling and HalvingDoubling, placed on machines of R ranks that share
// one network link; hierarchical, the codec's compute, the rendezvous and the overlap with
// backward are written there with their reasoning. Run it from the repository root: the default
// traces and codec throughputs are read from bench/.
//
// --validate reads bench/allreduce JSONs (rows of size, time and the schedule that ran) and
// bench/setup JSONs (gradsync-setup-N.json), and predicts each measurement twice. First with the
// link the run measured: its rows' link_latency_us and link_GBps, which --topology auto writes;
// for a run without them, the link an auto run of the same session measured at the same rank
// count (the same directory); else the link given here. Then with a link fitted to the same run's
// other schedules (the rows of the same directory, rank count, executor and transport whose
// schedule differs; least squares of the relative error), which tests the model's shape, its hop
// and byte counts, apart from how well one probe measured the link; "-" where fewer than two rows
// remain. A run's files are the JSONs of one directory.

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "scale_model.hpp"
#include "toolkit/codec_by_name.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "trace.hpp"

namespace {

using namespace gradsync_bench::scale;
namespace tk = gradsync::toolkit;

struct Config {
  double latency_us = 10;
  std::string bandwidth = "25Gbit/s";
  int ranks_per_machine = 8;
  // Shared memory between two processes: a message is a copy in and a copy out, at about half a
  // core's memory bandwidth, and a wake-up. An assumption, not a measurement of this machine.
  double intra_latency_us = 2;
  std::string intra_bandwidth = "10GB/s";
  std::vector<std::size_t> ranks{1024, 2048, 4096, 8192, 16384};
  std::vector<std::size_t> sizes{std::size_t{4} << 10, std::size_t{1} << 20, std::size_t{64} << 20};
  std::string codec = "ef-two-bit";
  std::string codec_results = "bench/results/codecs-cpu.json";
  std::vector<std::string> traces{"bench/traces/resnet50.trace", "bench/traces/vgg19.trace",
                                  "bench/traces/bert-base.trace"};
  double cap_mib = 25;
  double report_us = SetupCosts{}.report_cpu * 1e6;
  int listen_backlog = SetupCosts{}.listen_backlog;
  std::vector<std::string> validate;
  std::string json;
};

std::string show_link(const LinkModel& link) {
  const double gbps = link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0;
  return link.latency >= 1e-3 ? fmt::format("{:.2f} ms + {:.4g} GB/s", link.latency * 1e3, gbps)
                              : fmt::format("{:.1f} us + {:.4g} GB/s", link.latency * 1e6, gbps);
}

tk::Json link_json(const LinkModel& link) {
  return {{"latency_us", tk::rounded(link.latency * 1e6, 3)},
          {"GBps", tk::rounded(link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0.0, 6)}};
}

tk::Json read_json(const std::string& path, const char* option) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("{}: cannot open {}", option, path));
  try {
    return tk::Json::parse(in);
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {} is not JSON: {}", option, path, e.what()));
  }
}

// The codec's wire size from the codec itself, its throughput from bench/codecs' JSON (the row of
// that codec on the CPU).
CodecCost codec_cost(const Config& cfg) {
  CodecCost cost{.name = cfg.codec};
  cost.encoded_bytes = tk::with_codec(cfg.codec, {}, [](const auto& codec) {
    return std::function<std::size_t(std::size_t)>(
        [codec](std::size_t n) { return codec.max_encoded_bytes(n, gradsync::DType::f32); });
  });
  for (const auto& row : read_json(cfg.codec_results, "--codec-results"))
    if (row.value("codec", "") == cfg.codec && row.value("device", "cpu") == "cpu") {
      cost.encode_seconds_per_byte = 1e-9 / row.at("encode_GBps").get<double>();
      cost.decode_seconds_per_byte = 1e-9 / row.at("decode_GBps").get<double>();
      return cost;
    }
  throw std::invalid_argument(fmt::format("--codec-results: {} has no CPU row for {}", cfg.codec_results, cfg.codec));
}

SetupCosts setup_costs(const Config& cfg) {
  return {.report_cpu = cfg.report_us * 1e-6, .listen_backlog = cfg.listen_backlog};
}

std::string short_name(const std::string& schedule) {
  return schedule == "recursive-doubling" ? "rd" : schedule == "halving-doubling" ? "hd" : schedule;
}

// ---- projection ------------------------------------------------------------------------------

tk::Json project(const Config& cfg, const Cluster& cluster, const CodecCost& codec) {
  tk::Json out = {{"link", link_json(cluster.link)},
                  {"intra_link", link_json(cluster.intra)},
                  {"ranks_per_machine", cluster.ranks_per_machine},
                  {"codec", {{"name", codec.name},
                             {"throughput_from", cfg.codec_results},
                             {"encode_GBps", tk::rounded(1e-9 / codec.encode_seconds_per_byte, 3)},
                             {"decode_GBps", tk::rounded(1e-9 / codec.decode_seconds_per_byte, 3)}}},
                  {"setup", tk::Json::array()},
                  {"allreduce", tk::Json::array()},
                  {"replay", tk::Json::array()}};
  fmt::print("# gradsync scale model: {} between machines, {} ranks a machine over {}\n", show_link(cluster.link),
             cluster.ranks_per_machine, show_link(cluster.intra));
  fmt::print("# compressed: the ring carrying {} (wire size from the codec; encode {:.3f} GB/s, decode {:.3f} GB/s "
             "from {})\n",
             codec.name, 1e-9 / codec.encode_seconds_per_byte, 1e-9 / codec.decode_seconds_per_byte, cfg.codec_results);

  const SetupCosts costs = setup_costs(cfg);
  fmt::print("#\n# setup: transport::Tcp's rendezvous; each machine's ranks gather up a tree within it, rank 0 "
             "takes one report a machine at {:.0f} us of CPU each on one thread, then the table goes down a binomial "
             "tree\n",
             cfg.report_us);
  fmt::print("# {:>7} {:>12} {:>12} {:>14} {:>10} {:>7} {:>11} {:>11}\n", "ranks", "machine", "reports", "rank 0 CPU",
             "tree", "levels", "total", "table");
  fmt::print("# {:>7} {:>12} {:>12} {:>14} {:>10} {:>7} {:>11} {:>11}\n", "", "(ms)", "(ms)", "(ms)", "(ms)", "",
             "(ms)", "(KB)");
  for (const std::size_t n : cfg.ranks) {
    const SetupTime t = setup_seconds(static_cast<int>(n), cluster, costs);
    fmt::print("  {:>7} {:>12.3f} {:>12.2f} {:>14.2f} {:>10.2f} {:>7} {:>11.2f} {:>11.1f}\n", n, t.machine * 1e3,
               t.reports * 1e3, t.rank0_cpu * 1e3, t.tree * 1e3, t.levels, t.total() * 1e3,
               static_cast<double>(t.table_bytes) / 1e3);
    out["setup"].push_back({{"ranks", n},
                            {"machine_ms", tk::rounded(t.machine * 1e3, 4)},
                            {"reports_ms", tk::rounded(t.reports * 1e3, 3)},
                            {"rank0_cpu_ms", tk::rounded(t.rank0_cpu * 1e3, 3)},
                            {"tree_ms", tk::rounded(t.tree * 1e3, 3)},
                            {"tree_levels", t.levels},
                            {"total_ms", tk::rounded(t.total() * 1e3, 3)},
                            {"table_bytes", t.table_bytes}});
  }

  fmt::print("#\n# allreduce of f32, one bucket, predicted (ms); auto: the fastest of ring, rd, hd\n");
  fmt::print("# {:>7} {:>12}", "ranks", "size (B)");
  for (const std::string& s : schedule_names) fmt::print(" {:>12}", short_name(s));
  fmt::print("  {}\n", "auto takes");
  for (const std::size_t n : cfg.ranks)
    for (const std::size_t bytes : cfg.sizes) {
      const std::size_t elements = bytes / value_bytes;
      const int ranks = static_cast<int>(n);
      fmt::print("  {:>7} {:>12}", n, bytes);
      for (const std::string& s : schedule_names) {
        const double seconds = allreduce_seconds(s, cluster, ranks, elements, codec);
        fmt::print(" {:>12.3f}", seconds * 1e3);
        out["allreduce"].push_back({{"ranks", n}, {"bytes", bytes}, {"schedule", s}, {"predicted_ms", tk::rounded(seconds * 1e3, 4)}});
        if (s == "auto") out["allreduce"].back()["takes"] = auto_choice(cluster, ranks, elements);
      }
      fmt::print("  {}\n", short_name(auto_choice(cluster, ranks, elements)));
    }

  const auto cap = static_cast<std::size_t>(cfg.cap_mib * (1 << 20));
  fmt::print("#\n# a traced model's iteration: backward, then per schedule iteration/exposed (ms); buckets: "
             "fixed-size, {:g} MiB (the first 1 MiB) in backward order, one at a time on the network as each is "
             "ready\n",
             cfg.cap_mib);
  for (const std::string& path : cfg.traces) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument(fmt::format("--trace: cannot open {}", path));
    const std::vector<gradsync_bench::TraceEntry> trace = gradsync_bench::read_trace(in, path);
    const std::vector<TracedBucket> buckets = trace_buckets(trace, cap);
    double backward = 0, megabytes = 0;
    for (const auto& e : trace) backward += e.compute_us * 1e-6, megabytes += static_cast<double>(e.count * value_bytes) / 1e6;
    const std::string model = std::filesystem::path(path).stem().string();
    fmt::print("# {}: {:.1f} MB in {} buckets, backward {:.1f} ms\n", model, megabytes, buckets.size(), backward * 1e3);
    fmt::print("# {:>7}", "ranks");
    for (const std::string& s : schedule_names) fmt::print(" {:>17}", short_name(s));
    fmt::print("\n");
    for (const std::size_t n : cfg.ranks) {
      fmt::print("  {:>7}", n);
      for (const std::string& s : schedule_names) {
        const Iteration it = overlap(buckets, backward, [&](std::size_t elements) {
          return allreduce_seconds(s, cluster, static_cast<int>(n), elements, codec);
        });
        fmt::print(" {:>17}", fmt::format("{:.1f}/{:.1f}", it.total * 1e3, it.exposed() * 1e3));
        out["replay"].push_back({{"trace", model},
                                 {"ranks", n},
                                 {"schedule", s},
                                 {"buckets", buckets.size()},
                                 {"backward_ms", tk::rounded(backward * 1e3, 3)},
                                 {"iteration_ms", tk::rounded(it.total * 1e3, 3)},
                                 {"exposed_ms", tk::rounded(it.exposed() * 1e3, 3)}});
      }
      fmt::print("\n");
    }
  }
  return out;
}

// ---- validation ------------------------------------------------------------------------------

// One measurement: an allreduce of `bytes` by `schedule`, or a setup ("setup", bytes 0).
struct Measured {
  std::string run;  // the file's directory: one session's runs
  std::string file;
  int ranks = 0;
  std::string executor, transport, schedule;
  std::size_t bytes = 0;
  int ranks_per_machine = 1;
  double seconds = 0;
  std::optional<LinkModel> link;  // what the run measured, where it says
};

std::vector<Measured> read_measurements(const std::string& path) {
  const tk::Json json = read_json(path, "--validate");
  const std::filesystem::path p(path);
  const std::string run = p.parent_path().filename().string(), file = p.filename().string();
  std::vector<Measured> rows;
  if (json.is_object() && json.contains("median_slowest_ms")) {  // bench/setup
    rows.push_back({.run = run, .file = file, .ranks = json.at("ranks").get<int>(), .executor = "-", .transport = "tcp",
                    .schedule = "setup", .ranks_per_machine = json.value("ranks_per_machine", 1),
                    .seconds = json.at("median_slowest_ms").get<double>() * 1e-3});
    return rows;
  }
  if (!json.is_array()) throw std::invalid_argument(fmt::format("--validate: {} is neither bench/allreduce's nor bench/setup's JSON", path));
  for (const auto& r : json) {
    Measured m{.run = run,
               .file = file,
               .ranks = r.at("ranks").get<int>(),
               .executor = r.value("executor", "serial"),
               .transport = r.value("transport", "tcp"),
               .schedule = r.value("schedule", r.at("topology").get<std::string>()),
               .bytes = r.at("bytes").get<std::size_t>(),
               .ranks_per_machine = r.value("ranks_per_machine", 1),
               .seconds = r.at("time_us").get<double>() * 1e-6};
    if (r.value("codec", "none") != "none")
      throw std::invalid_argument(fmt::format("--validate: {} ran codec {}; the validation covers uncompressed runs",
                                              path, r.at("codec").get<std::string>()));
    if (r.contains("link_latency_us") && r.contains("link_GBps"))
      m.link = LinkModel{.latency = r["link_latency_us"].get<double>() * 1e-6,
                         .seconds_per_byte = 1e-9 / r["link_GBps"].get<double>()};
    rows.push_back(m);
  }
  return rows;
}

// The cluster a measured run had: one machine's CPUs carrying every message by TCP, unless its
// ranks of one machine talked over shared memory (transport shm, shm+tcp), at `intra`.
Cluster cluster_of(const Measured& m, const LinkModel& link, const LinkModel& intra) {
  const bool over_shared_memory = m.transport == "shm" || m.transport == "shm+tcp";
  return {.link = link, .intra = over_shared_memory ? intra : link, .ranks_per_machine = m.ranks_per_machine};
}

double predict(const Measured& m, const Cluster& c, const SetupCosts& costs) {
  if (m.schedule == "setup") return setup_seconds(m.ranks, c, costs).total();
  return allreduce_seconds(m.schedule, c, m.ranks, m.bytes / value_bytes, CodecCost{});
}

bool flat(const std::string& schedule) {
  return schedule == "ring" || schedule == "recursive-doubling" || schedule == "halving-doubling";
}

// What a flat schedule's row contributes to a fit: the library's formulas at unit links give the
// terms each of latency and seconds per byte multiplies.
LinkTerms link_terms(const Measured& m) {
  const LinkModel latency_only{.latency = 1, .seconds_per_byte = 0}, bytes_only{.latency = 0, .seconds_per_byte = 1};
  const std::size_t elements = m.bytes / value_bytes;
  return {.latency_terms = allreduce_seconds(m.schedule, cluster_of(m, latency_only, latency_only), m.ranks, elements, {}),
          .byte_terms = allreduce_seconds(m.schedule, cluster_of(m, bytes_only, bytes_only), m.ranks, elements, {}),
          .measured = m.seconds};
}

// The link a row is predicted with, and where it comes from: its own run's measurement; else one
// measured at the same rank count in the same session (a --topology auto run in the same
// directory, the same executor first); else the command line's.
std::optional<std::pair<LinkModel, std::string>> run_link(const Measured& m, const std::vector<Measured>& rows,
                                                          const std::optional<LinkModel>& given) {
  if (m.link) return std::pair(*m.link, std::string("the run"));
  for (const bool same_executor : {true, false})
    for (const Measured& o : rows)
      if (o.link && o.run == m.run && o.ranks == m.ranks && o.transport == m.transport &&
          (!same_executor || o.executor == m.executor))
        return std::pair(*o.link, fmt::format("the session's {}", o.file));
  if (given) return std::pair(*given, std::string("the command line"));
  return std::nullopt;
}

tk::Json validate(const Config& cfg, const std::optional<LinkModel>& given, const LinkModel& intra) {
  std::vector<Measured> rows;
  for (const std::string& path : cfg.validate)
    for (Measured& m : read_measurements(path)) rows.push_back(std::move(m));
  const SetupCosts costs = setup_costs(cfg);
  constexpr double tolerance = 0.25;
  const auto verdict = [&](double ratio) { return std::abs(ratio - 1) <= tolerance ? "yes" : "NO"; };
  fmt::print("# gradsync scale model, validation: predicted beside measured; ratio = predicted / measured; within: "
             "{:.0f}% of measured\n",
             tolerance * 100);
  fmt::print("# run's link: the link the run measured (its JSON), else {}; fitted: a link fitted to the same run's "
             "rows of other schedules\n",
             given ? show_link(*given) : "none given (-)");
  fmt::print("# setup rows: rank 0 at {:.0f} us a report (--report-us)\n", cfg.report_us);
  fmt::print("# {:<11} {:>5} {:<10} {:>9} {:<18} {:>10} | {:>10} {:>6} {:<6} | {:>24} {:>10} {:>6} {:<6}\n", "run",
             "ranks", "executor", "size (B)", "schedule", "measured", "run's link", "ratio", "within", "fitted link",
             "predicted", "ratio", "within");
  fmt::print("# {:<11} {:>5} {:<10} {:>9} {:<18} {:>10} | {:>10} {:>6} {:<6} | {:>24} {:>10} {:>6} {:<6}\n", "", "", "",
             "", "", "(ms)", "(ms)", "", "", "", "(ms)", "", "");
  tk::Json out = tk::Json::array();
  for (const Measured& m : rows) {
    tk::Json row = {{"run", m.run},          {"file", m.file},         {"ranks", m.ranks},
                    {"executor", m.executor}, {"transport", m.transport}, {"bytes", m.bytes},
                    {"schedule", m.schedule}, {"measured_ms", tk::rounded(m.seconds * 1e3, 3)}};
    std::string by_run = fmt::format("{:>10} {:>6} {:<6}", "-", "-", "-");
    if (const auto link = run_link(m, rows, given)) {
      const double predicted = predict(m, cluster_of(m, link->first, intra), costs), ratio = predicted / m.seconds;
      by_run = fmt::format("{:>10.1f} {:>6.2f} {:<6}", predicted * 1e3, ratio, verdict(ratio));
      row["link"] = link_json(link->first);
      row["link_from"] = link->second;
      row["predicted_ms"] = tk::rounded(predicted * 1e3, 3);
      row["ratio"] = tk::rounded(ratio, 3);
    }
    std::string by_fit = fmt::format("{:>24} {:>10} {:>6} {:<6}", "-", "-", "-", "-");
    if (m.schedule != "setup") {
      std::vector<LinkTerms> others;
      for (const Measured& o : rows)
        if (o.run == m.run && o.ranks == m.ranks && o.executor == m.executor && o.transport == m.transport &&
            o.schedule != m.schedule && flat(o.schedule))
          others.push_back(link_terms(o));
      if (const auto fitted = fit_link(others)) {
        const double predicted = predict(m, cluster_of(m, *fitted, intra), costs), ratio = predicted / m.seconds;
        by_fit = fmt::format("{:>24} {:>10.1f} {:>6.2f} {:<6}", show_link(*fitted), predicted * 1e3, ratio, verdict(ratio));
        row["fitted_link"] = link_json(*fitted);
        row["fitted_on_rows"] = others.size();
        row["fitted_predicted_ms"] = tk::rounded(predicted * 1e3, 3);
        row["fitted_ratio"] = tk::rounded(ratio, 3);
      }
    }
    fmt::print("  {:<11} {:>5} {:<10} {:>9} {:<18} {:>10.1f} | {} | {}\n", m.run, m.ranks, m.executor,
               m.schedule == "setup" ? "-" : fmt::to_string(m.bytes), m.schedule, m.seconds * 1e3, by_run, by_fit);
    out.push_back(std::move(row));
  }
  return out;
}

// ---- options ---------------------------------------------------------------------------------

CLI::Option* add_bandwidth(CLI::App& app, const std::string& name, std::string& value, const std::string& description) {
  return app.add_option(name, value, description)->capture_default_str()->check(CLI::Validator(
      [](const std::string& text) -> std::string {
        try {
          (void)seconds_per_byte(text);
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "BANDWIDTH"));
}

void declare_options(CLI::App& app, Config& cfg) {
  tk::add_number(app, "--latency-us", cfg.latency_us, "one message's latency between two machines, in us", {.low = 0});
  add_bandwidth(app, "--bandwidth", cfg.bandwidth, "a machine's network link: 25Gbit/s, 800Mbit/s, 3.1GB/s, 100MB/s");
  tk::add_number(app, "--ranks-per-machine", cfg.ranks_per_machine, "ranks on each machine, sharing its link", {.low = 1});
  tk::add_number(app, "--intra-latency-us", cfg.intra_latency_us, "one message's latency within a machine, in us", {.low = 0});
  add_bandwidth(app, "--intra-bandwidth", cfg.intra_bandwidth, "between two ranks of one machine (shared memory)");
  tk::add_sizes(app, "--ranks", cfg.ranks, "the rank counts to project to");
  app.add_option("--sizes", cfg.sizes, "the allreduce sizes, in bytes (K, M, G: binary), comma-separated")
      ->capture_default_str()
      ->delimiter(',')
      ->allow_extra_args(false)
      ->transform(tk::number<std::size_t>({.low = value_bytes}))
      ->transform(tk::byte_size());
  tk::add_codec_option(app, cfg.codec);
  app.add_option("--codec-results", cfg.codec_results, "bench/codecs' JSON, for the codec's encode and decode throughput")
      ->capture_default_str();
  app.add_option("--trace", cfg.traces, "traces to replay (bench/trace.hpp's format)")->capture_default_str();
  tk::add_number(app, "--cap-mib", cfg.cap_mib, "the buckets' cap for the traces, in MiB", {.low = 0, .low_open = true});
  tk::add_number(app, "--report-us", cfg.report_us, "rank 0's CPU for one rank's report at setup, in us", {.low = 0});
  tk::add_number(app, "--listen-backlog", cfg.listen_backlog, "rank 0's accept queue (the kernel's SOMAXCONN)", {.low = 1});
  app.add_option("--validate", cfg.validate, "bench/allreduce or bench/setup JSONs: predict each measurement beside it");
  app.add_option("--json", cfg.json, "also write everything as JSON to this file");
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("what 1k-16k ranks would take, from the library's cost model; --validate: beside measurements",
               "scale_model");
  declare_options(app, cfg);
  if (!tk::parse_options(app, argc, argv)) return 0;
  const LinkModel link{.latency = cfg.latency_us * 1e-6, .seconds_per_byte = seconds_per_byte(cfg.bandwidth)};
  const LinkModel intra{.latency = cfg.intra_latency_us * 1e-6, .seconds_per_byte = seconds_per_byte(cfg.intra_bandwidth)};
  tk::Json json;
  if (!cfg.validate.empty()) {
    const bool link_given = app.count("--latency-us") > 0 || app.count("--bandwidth") > 0;
    json = {{"validation", validate(cfg, link_given ? std::optional(link) : std::nullopt, intra)}};
  } else {
    for (const std::size_t n : cfg.ranks)
      if (n % static_cast<std::size_t>(cfg.ranks_per_machine) != 0)
        throw std::invalid_argument(fmt::format("--ranks: {} is not whole machines of --ranks-per-machine {}", n,
                                                cfg.ranks_per_machine));
    json = project(cfg, {.link = link, .intra = intra, .ranks_per_machine = cfg.ranks_per_machine}, codec_cost(cfg));
  }
  if (!cfg.json.empty()) tk::write_json(cfg.json, json);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "scale_model: %s\n", e.what());
  return 2;
}
