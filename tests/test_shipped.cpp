// make_synchronizer(): the shipped combinations, picked at run time, are the Synchronizers their
// types name, over a job of 2 machines x 2 ranks (shared memory within a machine, TCP across).

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/shipped.hpp"
#include "processes.hpp"
#include "routed_world.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

constexpr int ranks = 4, per_machine = 2, iterations = 3;

// Rank r's gradients at iteration i: N(0, 0.01) values, different on every rank and iteration.
std::vector<std::vector<float>> gradients_of(int rank, int iteration) {
  std::mt19937 gen(static_cast<unsigned>(1000 * rank + iteration + 1));
  std::normal_distribution<float> value(0.0f, 0.01f);
  std::vector<std::vector<float>> grads{std::vector<float>(3001), std::vector<float>(40000), std::vector<float>(17)};
  for (auto& g : grads)
    for (float& v : g) v = value(gen);
  return grads;
}

// Trains `iterations` steps on `sync` (a Synchronizer or AnySynchronizer) and returns the bytes of
// every average it gave, concatenated.
template <class Sync>
std::string averages(Sync& sync, int rank) {
  std::vector<std::vector<float>> grads = gradients_of(rank, 0);
  for (std::size_t g = 0; g < grads.size(); ++g) sync.add(fmt::format("g{}", g), view(grads[g]));
  std::string bytes;
  for (int it = 0; it < iterations; ++it) {
    const auto values = gradients_of(rank, it);
    for (std::size_t g = 0; g < grads.size(); ++g) std::copy(values[g].begin(), values[g].end(), grads[g].begin());
    for (std::size_t g = grads.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));  // backward's order
    sync.wait();
    for (const auto& g : grads) bytes.append(reinterpret_cast<const char*>(g.data()), g.size() * sizeof(float));
  }
  return bytes;
}

// Runs body(rank, world) on 4 processes and returns each rank's report.
template <class Body>
std::vector<std::string> on_job(const char* name, Body body) {
  const std::uint16_t port = test::free_port();
  const std::string job = fmt::format("shipped-{}-{}-{}", name, ::getpid(), std::random_device{}());
  const auto results = test::run_processes(ranks, [&](int rank) {
    return body(rank, test::routed_world(rank, per_machine, ranks, port, job));
  });
  std::vector<std::string> reports;
  for (const auto& r : results) reports.push_back(r.report);
  return reports;
}

// Each rank's averages from make_synchronizer(values) and from the Synchronizer type S (with
// `as_typed`, the topology `topology` stands for), in two jobs, and whether every rank ended with
// the same bits in both.
template <class S>
void check_picks(const shipped::Bucketing& bucketing, const shipped::Codec& codec, const shipped::Topology& topology,
                 const typename S::Topology& as_typed) {
  const Options options{.timeout = 20s};
  const auto picked = on_job("picked", [&](int rank, JobTransport world) {
    const auto sync = make_synchronizer(std::move(world), options, bucketing, codec, topology);
    if (sync->size() != ranks) return fmt::format("size {} where the job has {} ranks", sync->size(), ranks);
    return averages(*sync, rank);
  });
  const auto typed = on_job("typed", [&](int rank, JobTransport world) {
    S sync(std::move(world), options, std::get<typename S::Bucketing>(bucketing), std::get<typename S::Compression>(codec),
           as_typed);
    return averages(sync, rank);
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    REQUIRE(picked[static_cast<std::size_t>(r)].size() == 4 * (3001 + 40000 + 17) * iterations);
    CHECK(picked[static_cast<std::size_t>(r)] == typed[static_cast<std::size_t>(r)]);
    CHECK(picked[static_cast<std::size_t>(r)] == picked[0]);
  }
}

}  // namespace

TEST_SUITE("shipped") {
  TEST_CASE("make_synchronizer gives, bit for bit, the Synchronizer its values name") {
    SUBCASE("time-clustered, ef-two-bit, hierarchical") {
      using S = Synchronizer<bucketing::TimeClustered, compression::ErrorFeedback<compression::TwoBit>,
                             topology::Hierarchical, JobTransport>;
      // The ring across, not the automatic choice, which rests on links measured anew in each job.
      const topology::Hierarchical hierarchical{
          .ranks_per_machine = per_machine, .chunk_elements = 4096, .across = topology::Hierarchical::Across::ring};
      check_picks<S>(bucketing::TimeClustered{}, compression::ErrorFeedback<compression::TwoBit>{{.threshold = 0.01f}},
                     hierarchical, hierarchical);
    }
    SUBCASE("per-tensor, top-k, parameter server") {
      using S = Synchronizer<bucketing::PerTensor, compression::TopK, topology::ParameterServer, JobTransport>;
      const topology::ParameterServer server{.chunk_elements = 8192};
      check_picks<S>(bucketing::PerTensor{}, compression::TopK{.keep = {.fraction = 0.1}}, server, server);
    }
    SUBCASE("fixed-size, bf16, halving-doubling (Auto pinned to it)") {
      using S = Synchronizer<bucketing::FixedSize, compression::Bf16, topology::HalvingDoubling, JobTransport>;
      check_picks<S>(bucketing::FixedSize{.cap_bytes = 64 << 10, .first_cap_bytes = 16 << 10}, compression::Bf16{},
                     topology::Auto<>{.pinned = topology::Auto<>::Choice::middle}, topology::HalvingDoubling{});
    }
  }

  TEST_CASE("a program that picks no topology gets Auto's choice per bucket") {
    const shipped::Topology picked{};
    REQUIRE(std::holds_alternative<topology::Auto<>>(picked));
    CHECK_FALSE(std::get<topology::Auto<>>(picked).pinned.has_value());
    CHECK(std::get<topology::Auto<>>(picked).measures_link());
  }

  TEST_CASE("ranks whose options pick different codecs are each told what differs") {
    const auto reports = on_job("mismatch", [&](int rank, JobTransport world) -> std::string {
      const shipped::Codec codec = rank == 2 ? shipped::Codec{compression::Fp16{}} : shipped::Codec{compression::None{}};
      const auto sync = make_synchronizer(std::move(world), {.timeout = 20s}, {}, codec);
      averages(*sync, rank);
      return "no error";
    });
    for (const auto& report : reports) {
      CAPTURE(report);
      CHECK(report.find("error ranks disagree") == 0);
      CHECK(report.find("codec=fp16") != std::string::npos);
    }
  }
}
