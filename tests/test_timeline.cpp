// The timeline (timeline.hpp): a 2-rank run writes one Chrome trace per rank, valid JSON with the
// events the header promises, read back with nlohmann-json.

#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"
#include "processes.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using transport::InProcess;

namespace {

std::filesystem::path fresh_directory() {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("gradsync-timeline-" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_SUITE("timeline") {
  TEST_CASE("file names: the rank, and a group's name, before .json") {
    CHECK(Timeline::rank_path("run/trace.json", "3") == "run/trace.3.json");
    CHECK(Timeline::rank_path("trace", "0") == "trace.0.json");
    CHECK(Timeline::rank_path("t.json", "1.machine-0") == "t.1.machine-0.json");
  }

  TEST_CASE_TEMPLATE("two ranks write a Chrome trace each: ready, wait, buckets, compute steps, transfers", Exec,
                     std::integral_constant<Executor, Executor::task_graph>,
                     std::integral_constant<Executor, Executor::serial>) {
    constexpr int iterations = 3;
    const auto dir = fresh_directory();
    const std::string path = (dir / "trace.json").string();
    const auto errors = test::run_ranks(2, [&](InProcess& t) {
      std::vector<float> weight = test::random_values(5000, 7u + static_cast<unsigned>(t.rank()));
      std::vector<float> bias(10, 1.0f);
      Synchronizer<bucketing::PerTensor, compression::TwoBit, topology::Ring, InProcess> sync(
          std::move(t), {.executor = Exec::value, .timeline = path});
      sync.add("fc \"1\".weight", view(weight));  // a name that needs escaping in JSON
      sync.add("fc1.bias", view(bias));
      for (int i = 0; i < iterations; ++i) {
        sync.ready(1);
        sync.ready(0);
        if (i + 1 < iterations) {
          sync.wait();
        } else {  // the last iteration polls: its try_wait() that succeeds is traced as a wait
          while (!sync.try_wait()) std::this_thread::yield();
        }
      }
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    for (int rank = 0; rank < 2; ++rank) {
      CAPTURE(rank);
      std::ifstream in(dir / ("trace." + std::to_string(rank) + ".json"));
      REQUIRE(in);
      const nlohmann::json trace = nlohmann::json::parse(in);  // throws if it is not JSON
      REQUIRE(trace.contains("traceEvents"));
      CHECK(trace["otherData"]["dropped"] == 0);
      std::map<std::string, int> count;
      std::multiset<std::string> ready_names;
      std::vector<int> waited;
      std::map<std::uint64_t, std::pair<double, double>> spans;  // async id: begin, end
      std::uint64_t bytes_sent = 0;
      std::map<int, std::string> thread_names;  // tid: the name its track is given
      for (const auto& e : trace["traceEvents"])
        if (e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
      for (const auto& e : trace["traceEvents"]) {
        REQUIRE(e["pid"] == rank);
        const std::string ph = e["ph"], name = e["name"];
        if (ph == "M") continue;
        CHECK(thread_names.count(e["tid"]) == 1);  // every track is named
        const std::string thread = thread_names[e["tid"]];
        if (name == "ready" || name == "wait") CHECK(thread.starts_with("trainer (thread "));
        // gradsync's threads, or the trainer's in wait(), which drives the task graph's last steps
        if (name == "encode" || name == "decode")
          CHECK((thread.starts_with("gradsync ") || thread.starts_with("trainer (thread ")));
        CHECK(e["ts"].get<double>() >= 0);
        ++count[ph == "e" ? name + " (end)" : name];
        if (name == "ready") ready_names.insert(e["args"]["gradient"].get<std::string>());
        if (name == "wait") {
          CHECK(ph == "X");
          waited.push_back(e["args"]["iteration"]);
        }
        if (ph == "b") spans[e["id"]].first = e["ts"];
        if (ph == "e") spans[e["id"]].second = e["ts"];
        if (ph == "b" && name.starts_with("send to")) {
          CHECK(name == "send to " + std::to_string(1 - rank));
          bytes_sent += e["args"]["bytes"].get<std::uint64_t>();
        }
      }
      CHECK(ready_names.count("fc \"1\".weight") == iterations);
      CHECK(ready_names.count("fc1.bias") == iterations);
      CHECK(waited == std::vector<int>{0, 1, 2});
      CHECK(count["bucket 0"] == iterations);  // one per bucket and iteration, begin and end
      CHECK(count["bucket 0 (end)"] == iterations);
      CHECK(count["bucket 1"] == iterations);
      CHECK(count["encode"] > 0);
      CHECK(count["decode"] > 0);
      // A 2-rank ring: one send and one receive per bucket in each of its two phases.
      CHECK(count["send to " + std::to_string(1 - rank)] == 2 * 2 * iterations);
      CHECK(count["recv from " + std::to_string(1 - rank)] == 2 * 2 * iterations);
      CHECK(bytes_sent > 0);
      for (const auto& [id, span] : spans) CHECK(span.second >= span.first);
    }
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("the asynchronous parameter server writes a trace per rank: ready, wait, pushes, pulls, replies") {
    constexpr int iterations = 4;
    const auto dir = fresh_directory();
    const std::string path = (dir / "trace.json").string();
    const auto errors = test::run_ranks(2, [&](InProcess& t) {
      std::vector<float> weight = test::random_values(3000, 5u + static_cast<unsigned>(t.rank()));
      async::Synchronizer<bucketing::PerTensor, compression::None, InProcess> sync(std::move(t), {.staleness = 1, .timeline = path});
      sync.add("w", view(weight));
      for (int i = 0; i < iterations; ++i) {
        sync.ready(0);
        sync.wait();
      }
      sync.finish();
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    for (int rank = 0; rank < 2; ++rank) {
      CAPTURE(rank);
      std::ifstream in(dir / ("trace." + std::to_string(rank) + ".async.json"));
      REQUIRE(in);
      const nlohmann::json trace = nlohmann::json::parse(in);
      CHECK(trace["otherData"]["dropped"] == 0);
      std::map<int, std::string> thread_names;
      for (const auto& e : trace["traceEvents"])
        if (e["name"] == "thread_name") thread_names[e["tid"]] = e["args"]["name"];
      std::map<std::string, int> count;
      std::vector<int> waited;
      for (const auto& e : trace["traceEvents"]) {
        const std::string ph = e["ph"], name = e["name"];
        if (ph == "M") continue;
        CHECK(thread_names.count(e["tid"]) == 1);
        if (name == "ready" || name == "wait") CHECK(thread_names[e["tid"]].starts_with("trainer (thread "));
        if (name == "wait") waited.push_back(e["args"]["iteration"]);
        if (ph != "e") ++count[name];
      }
      CHECK(count["ready"] == iterations);
      CHECK(waited == std::vector<int>{0, 1, 2, 3});
      const std::string peer = std::to_string(1 - rank);
      CHECK(count["send to " + peer] > 0);    // pushes, pulls, replies to the other rank
      CHECK(count["recv from " + peer] > 0);
      CHECK(count["encode"] >= iterations);  // at least this rank's pushes
      CHECK(count["decode"] > 0);
    }
    std::filesystem::remove_all(dir);
  }

  // The short path (engine/task_graph.hpp): a bucket of small pieces goes from start to end without
  // a compute thread, its frames read by the thread holding the communication role; a bucket of
  // large pieces still hands its encodes and adds to the compute threads. Fp16, because an
  // identity codec's last bucket is walked on the caller whatever its size. Counted from the
  // trace, as a user would read it: the trainer's ready() starts the bucket itself (no
  // Synchronizer thread), and its wait() walks the small one (the iteration's last bucket); what
  // else there is (a frame the io thread had begun, a completion the communication thread took
  // first) varies with how the threads raced, at most once per transfer (two per iteration here)
  // and once for the waiter.
  TEST_CASE("hand-offs per bucket, read from the trace: none to a compute thread for a small bucket") {
    constexpr int iterations = 4;
    for (const std::size_t values : {std::size_t{1024}, std::size_t{1} << 18}) {
      CAPTURE(values);
      const auto dir = fresh_directory();
      const std::string path = (dir / "trace.json").string();
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(2, [&](int rank) -> std::string {
        transport::TcpOptions o{.rank = rank, .world_size = 2, .master_port = port, .token = "handoffs"};
        Synchronizer<bucketing::PerTensor, compression::Fp16, topology::RecursiveDoubling, transport::Tcp> sync(
            transport::Tcp(o), {.timeout = 30s, .timeline = path});
        std::vector<float> gradient = test::random_values(values, 3u + static_cast<unsigned>(rank));
        sync.add("g", view(gradient));
        for (int i = 0; i < iterations; ++i) {
          sync.ready(0);
          sync.wait();
        }
        return "ok";
      });
      for (const auto& r : results) REQUIRE_MESSAGE(r.ok(), r.report);
      for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        std::ifstream in(dir / ("trace." + std::to_string(rank) + ".json"));
        const nlohmann::json trace = nlohmann::json::parse(in);
        std::map<std::string, int> handed;
        for (const auto& e : trace["traceEvents"])
          if (e["name"].get<std::string>().starts_with("hand-off: ")) {
            ++handed[e["args"]["queue"].get<std::string>()];
            CHECK(e["dur"].get<double>() >= 0);
          }
        std::string counts;
        for (const auto& [queue, n] : handed) counts += queue + "=" + std::to_string(n) + " ";
        CAPTURE(counts);
        CHECK(handed["synchronizer"] == 0);
        if (values * sizeof(float) <= engine::TaskGraph<compression::Fp16, transport::Tcp>::short_path_bytes) {
          CHECK(handed["compute"] == 0);
          CHECK(handed["completion"] + handed["communication"] + handed["waiter"] <= 3 * iterations);
        } else {
          CHECK(handed["compute"] >= iterations);  // each iteration's encode, at least
        }
      }
      std::filesystem::remove_all(dir);
    }
  }

  TEST_CASE("past its capacity a timeline counts what it drops") {
    const auto dir = fresh_directory();
    Timeline timeline((dir / "t.0.json").string(), 0, 4);
    for (int i = 0; i < 10; ++i) timeline.record(Timeline::Kind::wait, timeline.now(), 0, static_cast<std::uint64_t>(i));
    CHECK(timeline.recorded() == 4);
    CHECK(timeline.dropped() == 6);
    timeline.write();
    std::ifstream in(dir / "t.0.json");
    const nlohmann::json trace = nlohmann::json::parse(in);
    CHECK(trace["otherData"]["dropped"] == 6);
    CHECK(trace["traceEvents"].size() == 1 + 1 + 4);  // the process's name, its thread's, the events kept
    CHECK(trace["traceEvents"][1]["name"] == "thread_name");
    CHECK(trace["traceEvents"][1]["args"]["name"].get<std::string>().starts_with("trainer (thread "));
    std::filesystem::remove_all(dir);
  }
}
