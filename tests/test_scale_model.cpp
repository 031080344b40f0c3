// bench/scale_model's arithmetic (bench/scale_model.hpp): that it hands the library's own
// predictions through where the cluster adds nothing, and what it adds where it does.

#include <doctest/doctest.h>

#include <sstream>

#include "gradsync/topology/auto.hpp"
#include "scale_model.hpp"

namespace {

using namespace gradsync_bench::scale;

const LinkModel network{.latency = 10e-6, .seconds_per_byte = 1 / 3.125e9};
const LinkModel memory{.latency = 2e-6, .seconds_per_byte = 1e-10};

}  // namespace

TEST_CASE("scale model: bandwidths with their units") {
  CHECK(seconds_per_byte("25Gbit/s") == doctest::Approx(1 / 3.125e9));
  CHECK(seconds_per_byte("3.125GB/s") == doctest::Approx(1 / 3.125e9));
  CHECK(seconds_per_byte("800Mbit") == doctest::Approx(1 / 100e6));
  CHECK(seconds_per_byte("100MB/s") == doctest::Approx(1e-8));
  for (const char* wrong : {"25", "25 Gbit/s", "GB/s", "0GB/s", "-1GB/s", "25Gb/s", "nanGB/s"})
    CHECK_THROWS_AS(seconds_per_byte(wrong), std::invalid_argument);
}

TEST_CASE("scale model: with one rank a machine, or all on one, the library's predictions as they are") {
  const std::size_t elements = std::size_t{1} << 20;
  const gradsync::Group world = gradsync::Group::world(0, 64);
  const Cluster spread{.link = network, .intra = memory, .ranks_per_machine = 1};
  const Cluster together{.link = network, .intra = memory, .ranks_per_machine = 64};
  CHECK(allreduce_seconds("auto", spread, 64, elements, {}) ==
        doctest::Approx(topology::Auto<>{}.predicted_seconds(world, elements, 4, network)));
  CHECK(allreduce_seconds("auto", together, 64, elements, {}) ==
        doctest::Approx(topology::Auto<>{}.predicted_seconds(world, elements, 4, memory)));
  CHECK(allreduce_seconds("ring", spread, 64, elements, {}) ==
        doctest::Approx(topology::Ring{}.predicted_seconds(world, elements, 4, network)));
  // Hierarchical with one rank a machine has no phases within: the fastest of the ring (at its
  // own piece size) and the log-depth schedules across, the flat schedules' own predictions.
  const topology::Auto<> flat{.large = {.chunk_elements = topology::Hierarchical{}.chunk_elements}};
  CHECK(allreduce_seconds("hierarchical", spread, 64, elements, {}) ==
        doctest::Approx(flat.predicted_seconds(world, elements, 4, network)));
  CHECK(allreduce_seconds("hierarchical", spread, 64, 1024, {}) ==
        doctest::Approx(flat.predicted_seconds(world, 1024, 4, network)));
}

TEST_CASE("scale model: the machine's ranks share its link where they cross it at once") {
  const std::size_t elements = 4096;
  const Cluster c{.link = network, .intra = memory, .ranks_per_machine = 4};
  const LinkModel shared_by_four{.latency = network.latency, .seconds_per_byte = 4 * network.seconds_per_byte};
  // Recursive doubling over 2 machines of 4: two rounds within, one across with all four at once.
  CHECK(allreduce_seconds("recursive-doubling", c, 8, elements, {}) ==
        doctest::Approx(2 * memory.seconds(elements * 4.0) + shared_by_four.seconds(elements * 4.0)));
  // The ring's hops across are one rank per machine: the link alone.
  CHECK(allreduce_seconds("ring", c, 8, elements, {}) ==
        doctest::Approx(topology::Ring{}.predicted_seconds(gradsync::Group::world(0, 8), elements, 4, network)));
}

TEST_CASE("scale model: a codec that sends the values as they are, at no cost, is the ring") {
  const std::size_t chunk = topology::Ring{}.chunk_elements;
  const CodecCost plain{.name = "plain", .encoded_bytes = [](std::size_t n) { return 4 * n; }};
  const Cluster c{.link = network, .intra = memory, .ranks_per_machine = 1};
  const std::size_t elements = 16 * 2 * chunk;  // two pieces a segment over 16 ranks
  CHECK(compressed_ring_seconds(c, 16, elements, plain) == doctest::Approx(ring_seconds(c, 16, elements)));
  // Compute on the ring's path: with one piece a segment it adds to the transfers.
  const CodecCost slow{.name = "slow", .encoded_bytes = plain.encoded_bytes, .encode_seconds_per_byte = 1e-9,
                       .decode_seconds_per_byte = 1e-9};
  const std::size_t small = 16 * 1024;
  const double compute = 1024 * 4.0 * (16 + 31) * 1e-9;
  CHECK(compressed_ring_seconds(c, 16, small, slow) == doctest::Approx(ring_seconds(c, 16, small) + compute));
}

TEST_CASE("scale model: the rendezvous") {
  const SetupCosts costs{.report_cpu = 50e-6, .local_report_cpu = 10e-6, .listen_backlog = 100};
  const Cluster alone{.link = network, .intra = memory, .ranks_per_machine = 1};
  const double line = 28 * network.seconds_per_byte;  // one report line
  CHECK(setup_seconds(1, alone, costs).total() == 0);
  const SetupTime four = setup_seconds(4, alone, costs);
  CHECK(four.levels == 2);
  CHECK(four.machine_levels == 0);
  CHECK(four.table_bytes == 24 + 4 * 22);
  // 3 reports of 6 latencies, side by side; rank 0's CPU for them is the longer.
  CHECK(four.reports == doctest::Approx(6 * network.latency + line + 3 * 50e-6));
  // Beyond the accept queue the SYNs wait for their retransmission: 150 reporters, a queue of 100.
  const SetupTime crowded = setup_seconds(151, alone, costs);
  CHECK(crowded.reports == doctest::Approx(6 * network.latency + line + costs.syn_retry + 50 * 50e-6));
  // 4 machines of 4: two levels within each machine, then 3 reports of 4 lines.
  const SetupTime machines = setup_seconds(16, {.link = network, .intra = memory, .ranks_per_machine = 4}, costs);
  CHECK(machines.machine_levels == 2);
  CHECK(machines.machine == doctest::Approx(2 * (3 * memory.latency + 10e-6) + 4 * 28 * memory.seconds_per_byte));
  CHECK(machines.reports == doctest::Approx(machines.machine + 6 * network.latency + 4 * line + 3 * 50e-6));
  CHECK(machines.levels == 4);
  // One machine of 16: no report crosses a network; rank 0 holds every line once its tree is in.
  const SetupTime one = setup_seconds(16, {.link = network, .intra = memory, .ranks_per_machine = 16}, costs);
  CHECK(one.rank0_cpu == 0);
  CHECK(one.reports == doctest::Approx(one.machine));
}

TEST_CASE("scale model: a trace's buckets overlapped with backward") {
  std::istringstream text("c count=262144 compute_us=1000\nb count=262144 compute_us=1000\na count=10 compute_us=500\n");
  const auto trace = gradsync_bench::read_trace(text, "test");
  // A 1 MiB first bucket holds c alone; b and a share the next.
  const std::vector<TracedBucket> buckets = trace_buckets(trace, std::size_t{2} << 20);
  REQUIRE(buckets.size() == 2);
  CHECK(buckets[0].elements == 262144);
  CHECK(buckets[0].ready == doctest::Approx(1e-3));
  CHECK(buckets[1].elements == 262154);
  CHECK(buckets[1].ready == doctest::Approx(2.5e-3));
  // 1 ms a bucket: the first hides behind backward, the second is all exposed.
  const Iteration it = overlap(buckets, 2.5e-3, [](std::size_t) { return 1e-3; });
  CHECK(it.total == doctest::Approx(3.5e-3));
  CHECK(it.exposed() == doctest::Approx(1e-3));
  // 2 ms a bucket: the second waits for the first.
  CHECK(overlap(buckets, 2.5e-3, [](std::size_t) { return 2e-3; }).total == doctest::Approx(5e-3));
}

TEST_CASE("scale model: a link fitted to rows made with a known one is that link") {
  const LinkModel truth{.latency = 3e-3, .seconds_per_byte = 3e-8};
  std::vector<LinkTerms> rows;
  for (const auto& [x, y] : {std::pair{6.0, 4096.0 * 6}, std::pair{12.0, 2097152.0}, std::pair{126.0, 1048576.0}})
    rows.push_back({.latency_terms = x, .byte_terms = y, .measured = x * truth.latency + y * truth.seconds_per_byte});
  const auto fitted = fit_link(rows);
  REQUIRE(fitted);
  CHECK(fitted->latency == doctest::Approx(truth.latency));
  CHECK(fitted->seconds_per_byte == doctest::Approx(truth.seconds_per_byte));
  CHECK_FALSE(fit_link({rows[0]}));
}
