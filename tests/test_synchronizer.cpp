// The Synchronizer end to end, over in-process ranks: averages, agreement between ranks, errors,
// and the no-allocation promise of the per-step path (over Tcp and SharedMemory too: test_tcp.cpp,
// test_shared_memory.cpp).

#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <numeric>
#include <set>
#include <string>
#include <string_view>
#include <thread>

#include "allocation_count.hpp"
#include "gradsync/gradsync.hpp"
#include "policies/fixed_point16.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using transport::InProcess;

namespace {

struct Spec {
  std::string name;
  std::size_t count;
  DType dtype;
};

// One rank's gradients, in whatever storage their dtype needs.
struct Model {
  std::vector<Spec> specs;
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<double>> f64;
  std::vector<std::vector<std::uint16_t>> half;

  explicit Model(std::vector<Spec> s) : specs(std::move(s)) {
    for (const Spec& g : specs) {
      f32.emplace_back(g.dtype == DType::f32 ? g.count : 0);
      f64.emplace_back(g.dtype == DType::f64 ? g.count : 0);
      half.emplace_back(g.dtype == DType::f16 || g.dtype == DType::bf16 ? g.count : 0);
    }
  }

  TensorView grad(std::size_t i) {
    switch (specs[i].dtype) {
      case DType::f32: return view(f32[i]);
      case DType::f64: return view(f64[i]);
      default: return view(half[i], specs[i].dtype);
    }
  }

  // Stores `v` rounded to the gradient's dtype.
  void set(std::size_t i, std::size_t e, double v) {
    switch (specs[i].dtype) {
      case DType::f32: f32[i][e] = static_cast<float>(v); break;
      case DType::f64: f64[i][e] = v; break;
      case DType::f16: half[i][e] = numeric::f16_bits(static_cast<float>(v)); break;
      case DType::bf16: half[i][e] = numeric::bf16_bits(static_cast<float>(v)); break;
    }
  }

  double get(std::size_t i, std::size_t e) const {
    switch (specs[i].dtype) {
      case DType::f32: return f32[i][e];
      case DType::f64: return f64[i][e];
      case DType::f16: return numeric::from_f16_bits(half[i][e]);
      case DType::bf16: return numeric::from_bf16_bits(half[i][e]);
    }
    return 0;
  }

  // A different value for every rank, iteration, gradient and element.
  void fill(int rank, int iteration) {
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto values = test::random_values(specs[i].count, 7919u * static_cast<unsigned>(rank) +
                                                                  104729u * static_cast<unsigned>(iteration) + i);
      for (std::size_t e = 0; e < specs[i].count; ++e) set(i, e, values[e]);
    }
  }
};

// Relative error a result in `dtype` may carry after summing in the accumulation dtype and, for
// 16-bit codecs or storage, rounding once or twice to 16 bits.
double tolerance(DType storage, double codec_unit) {
  const double storage_unit = storage == DType::f16 ? std::ldexp(1.0, -10)
                              : storage == DType::bf16 ? std::ldexp(1.0, -7)
                              : storage == DType::f32 ? std::ldexp(1.0, -20)
                                                      : std::ldexp(1.0, -45);
  return std::max(storage_unit, codec_unit);
}

// Every rank holds the same bits, and they are close to the exact mean of the inputs.
void check_averages(const std::vector<Model>& inputs, const std::vector<Model>& outputs, double codec_unit) {
  const std::size_t n = inputs.size();
  for (std::size_t i = 0; i < inputs[0].specs.size(); ++i) {
    CAPTURE(inputs[0].specs[i].name);
    for (std::size_t e = 0; e < inputs[0].specs[i].count; ++e) {
      double exact = 0, scale = 0;
      for (std::size_t r = 0; r < n; ++r) {
        exact += inputs[r].get(i, e);
        scale += std::fabs(inputs[r].get(i, e));
      }
      exact /= static_cast<double>(n);
      scale /= static_cast<double>(n);
      const double got = outputs[0].get(i, e);
      REQUIRE(std::fabs(got - exact) <= tolerance(inputs[0].specs[i].dtype, codec_unit) * scale * 4 + 1e-30);
      for (std::size_t r = 1; r < n; ++r) {
        const double other = outputs[r].get(i, e);
        REQUIRE(std::memcmp(&other, &got, sizeof got) == 0);
      }
    }
  }
}

// A different, reproducible ready order for each rank and iteration.
std::vector<GradId> shuffled_order(std::size_t n, int rank, int iteration) {
  std::vector<GradId> order(n);
  std::iota(order.begin(), order.end(), GradId{0});
  std::mt19937 gen(static_cast<unsigned>(31 * rank + iteration));
  std::shuffle(order.begin(), order.end(), gen);
  return order;
}

// Runs `iterations` steps on `n` ranks: fill, ready in a shuffled order, wait; checks each step.
template <class Sync>
void train(int n, const std::vector<Spec>& specs, int iterations, double codec_unit, Options options = {},
           typename Sync::Bucketing bucketing = {}, typename Sync::Compression codec = {}) {
  CAPTURE(n);
  std::vector<BucketPlan> plans(static_cast<std::size_t>(n));
  std::barrier step(n);
  std::vector<std::vector<Model>> inputs(static_cast<std::size_t>(iterations),
                                                       std::vector<Model>(static_cast<std::size_t>(n), Model(specs)));
  std::vector<std::vector<Model>> outputs = inputs;
  for (int iteration = 0; iteration < iterations; ++iteration)
    for (int r = 0; r < n; ++r)
      inputs[static_cast<std::size_t>(iteration)][static_cast<std::size_t>(r)].fill(r, iteration);

  const auto errors = test::run_ranks(n, [&](InProcess& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    Model model(specs);
    Sync sync(std::move(t), options, bucketing, codec);
    for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
    for (int iteration = 0; iteration < iterations; ++iteration) {
      const auto it = static_cast<std::size_t>(iteration);
      model = inputs[it][r];  // same storage: vectors keep their buffers on copy-assign
      for (GradId id : shuffled_order(specs.size(), sync.rank(), iteration)) sync.ready(id);
      sync.wait();
      outputs[it][r] = model;
      plans[r] = sync.plan();
      step.arrive_and_wait();
      if (sync.rank() == 0)
        for (int other = 1; other < n; ++other) CHECK(plans[static_cast<std::size_t>(other)] == plans[0]);
      step.arrive_and_wait();
    }
  });
  for (const auto& e : errors) {
    if (e) FAIL(std::string(e->what()));
  }
  for (int iteration = 0; iteration < iterations; ++iteration) {
    CAPTURE(iteration);
    check_averages(inputs[static_cast<std::size_t>(iteration)],
                   outputs[static_cast<std::size_t>(iteration)], codec_unit);
  }
}

// Every rank's gradients after each of `iterations` steps (inputs as in train()).
template <class Sync>
std::vector<std::vector<Model>> results_of(int n, const std::vector<Spec>& specs, int iterations, Options options,
                                           typename Sync::Compression codec, typename Sync::Topology topology) {
  std::vector<std::vector<Model>> outputs(static_cast<std::size_t>(iterations),
                                          std::vector<Model>(static_cast<std::size_t>(n), Model(specs)));
  const auto errors = test::run_ranks(n, [&](InProcess& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    Model model(specs);
    Sync sync(std::move(t), options, {}, codec, topology);
    for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
    for (int iteration = 0; iteration < iterations; ++iteration) {
      model.fill(static_cast<int>(r), iteration);
      for (GradId id : shuffled_order(specs.size(), sync.rank(), iteration)) sync.ready(id);
      sync.wait();
      outputs[static_cast<std::size_t>(iteration)][r] = model;
    }
  });
  for (const auto& e : errors)
    if (e) FAIL(std::string(e->what()));
  return outputs;
}

// The lines Synchronizers log (Options::log), from any rank's thread, in the order they came.
struct Logged {
  std::mutex mutex;
  std::vector<std::string> lines;
  // `options`, logging here.
  Options into(Options options) {
    options.log = [this](std::string_view line) {
      std::lock_guard lock(mutex);
      lines.emplace_back(line);
    };
    return options;
  }
};

// Every iteration's averages right, and every rank the same bits (inputs as in results_of()).
void check_every_iteration(int n, const std::vector<Spec>& specs, const std::vector<std::vector<Model>>& outputs) {
  for (std::size_t it = 0; it < outputs.size(); ++it) {
    CAPTURE(it);
    std::vector<Model> inputs(static_cast<std::size_t>(n), Model(specs));
    for (int r = 0; r < n; ++r) inputs[static_cast<std::size_t>(r)].fill(r, static_cast<int>(it));
    check_averages(inputs, outputs[it], 0);
  }
}

// A ring that does not describe its pipeline, as a user's own topology might not.
struct RingWithoutShape {
  topology::Ring ring;
  std::string describe() const { return "ring-without-shape"; }
  Schedule schedule(const Group& g, std::size_t n, CodecTraits c) const { return ring.schedule(g, n, c); }
};

bool same_bits(const Model& a, const Model& b) { return a.f32 == b.f32 && a.half == b.half && a.f64 == b.f64; }

using PerTensorSync = Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, InProcess>;
using FixedSizeSync = Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, InProcess>;

const std::vector<Spec> mixed = {
    {"embedding", 1000, DType::f32}, {"empty", 0, DType::f32},   {"norm.f16", 33, DType::f16},
    {"proj.bf16", 50, DType::bf16},  {"head.f64", 17, DType::f64}, {"bias", 5, DType::f32},
    {"one", 1, DType::f32},          {"prime", 97, DType::f32},  {"w.f16", 101, DType::f16},
};

}  // namespace

TEST_SUITE("synchronizer") {
  TEST_CASE("per-tensor averages equal the ring-order reference bit for bit, for every world size") {
    const std::vector<std::size_t> sizes{0, 1, 7, 13, 97, 1009};
    for (int n : {1, 2, 3, 4, 7, 8}) {
      CAPTURE(n);
      std::vector<std::vector<std::vector<float>>> inputs(sizes.size());  // [gradient][rank]
      for (std::size_t g = 0; g < sizes.size(); ++g)
        for (int r = 0; r < n; ++r) inputs[g].push_back(test::random_values(sizes[g], 50u * g + static_cast<unsigned>(r)));
      std::vector<std::vector<std::vector<float>>> outputs(sizes.size(), std::vector<std::vector<float>>(static_cast<std::size_t>(n)));
      const auto errors = test::run_ranks(n, [&](InProcess& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        std::vector<std::vector<float>> grads;
        for (std::size_t size : sizes) grads.emplace_back(size);  // registered memory: never reallocated
        PerTensorSync sync(std::move(t));
        for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
        for (int iteration = 0; iteration < 3; ++iteration) {
          for (std::size_t g = 0; g < sizes.size(); ++g) grads[g] = inputs[g][r];
          for (GradId id : shuffled_order(sizes.size(), static_cast<int>(r), iteration)) sync.ready(id);
          sync.wait();
          for (std::size_t g = 0; g < sizes.size(); ++g) outputs[g][r] = grads[g];
          // After the first iteration the plan follows rank 0's observed order.
          if (iteration > 0) CHECK(sync.plan().buckets.size() == sizes.size());
        }
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
      for (std::size_t g = 0; g < sizes.size(); ++g) {
        const auto reference = test::ring_reference(compression::None{}, inputs[g]);
        for (int r = 0; r < n; ++r) CHECK(outputs[g][static_cast<std::size_t>(r)] == reference);
      }
    }
  }

  TEST_CASE("fixed-size buckets with mixed dtypes, a gradient over the cap and a re-plan") {
    const bucketing::FixedSize small{.cap_bytes = 256, .first_cap_bytes = 64};
    for (int n : {2, 3, 4}) train<FixedSizeSync>(n, mixed, 4, 0, {}, small);
    for (int n : {1, 7, 8}) train<FixedSizeSync>(n, mixed, 2, 0, {}, small);
    for (int n : {2, 5}) train<PerTensorSync>(n, mixed, 3, 0);
  }

  TEST_CASE("the parameter-server topology under a Synchronizer: exact averages, same bits everywhere") {
    using Sync = Synchronizer<bucketing::FixedSize, compression::None, topology::ParameterServer, InProcess>;
    const bucketing::FixedSize small{.cap_bytes = 256, .first_cap_bytes = 64};
    for (int n : {1, 2, 3, 5}) train<Sync>(n, mixed, 3, 0, {}, small);
  }

  TEST_CASE("dedicated parameter servers under a Synchronizer: the workers' exact average, servers' values left out") {
    using Sync = Synchronizer<bucketing::FixedSize, compression::None, topology::ParameterServer, InProcess>;
    for (int n : {2, 3, 5})
      for (std::size_t servers : {std::size_t{1}, std::size_t{2}}) {
        if (servers >= static_cast<std::size_t>(n)) continue;
        CAPTURE(n);
        CAPTURE(servers);
        const int workers = n - static_cast<int>(servers);
        for (Executor executor : {Executor::serial, Executor::task_graph}) {
          const auto outputs = results_of<Sync>(n, mixed, 2, {.executor = executor}, {},
                                                {.partitions = 4, .servers = servers, .dedicated = true});
          for (std::size_t it = 0; it < outputs.size(); ++it) {
            std::vector<Model> inputs(static_cast<std::size_t>(workers), Model(mixed));
            for (int r = 0; r < workers; ++r) inputs[static_cast<std::size_t>(r)].fill(r, static_cast<int>(it));
            check_averages(inputs, {outputs[it].begin(), outputs[it].begin() + workers}, 0);
          }
        }
      }
  }

  TEST_CASE("the hierarchical topology under a Synchronizer: exact averages, same bits everywhere, both executors") {
    using Sync = Synchronizer<bucketing::FixedSize, compression::None, topology::Hierarchical, InProcess>;
    const std::vector<std::pair<int, int>> shapes{{2, 2}, {2, 3}, {3, 2}, {1, 3}, {3, 1}};  // machines x ranks each
    for (const auto& shape : shapes)
      for (Executor executor : {Executor::serial, Executor::task_graph}) {
        const int n = shape.first * shape.second;
        CAPTURE(n);
        CAPTURE(shape.second);
        check_every_iteration(n, mixed,
                              results_of<Sync>(n, mixed, 2, {.executor = executor}, {},
                                               {.ranks_per_machine = shape.second, .chunk_elements = 29}));
      }
  }

  TEST_CASE_TEMPLATE("the task graph gives every rank the serial executor's bits, for every topology and codec", C,
                     compression::None, compression::Fp16, compression::Bf16, compression::TwoBit, compression::OneBit,
                     compression::TernGrad<2>, compression::TopK, compression::RandomK,
                     compression::ErrorFeedback<compression::TwoBit>, compression::ErrorFeedback<compression::RandomK>) {
    // One bucket per gradient: 1 to 1000 values against 7 partitions gives parts that do not divide
    // evenly and buckets smaller than the partition count; small chunks give many pieces.
    const std::vector<Spec> specs{{"w", 1000, DType::f32}, {"one", 1, DType::f32}, {"five", 5, DType::f32},
                                  {"h.f64", 97, DType::f64}, {"b.bf16", 13, DType::bf16}};
    // Dedicated servers' buffers hold only the parts they serve: ranks compared are the workers.
    const auto compare = [&]<class T>(int n, T topology, int workers) {
      using Sync = Synchronizer<bucketing::PerTensor, C, T, InProcess>;
      CAPTURE(topology.describe());
      const auto serial = results_of<Sync>(n, specs, 3, {.executor = Executor::serial}, {}, topology);
      const auto graph = results_of<Sync>(n, specs, 3, {.executor = Executor::task_graph, .compute_threads = 3}, {}, topology);
      // Coordinated with one batch per link and batches of one piece: the most grants there can be.
      const auto coordinated = results_of<Sync>(
          n, specs, 3, {.executor = Executor::task_graph, .coordination = {.enabled = true, .window = 1, .batch_bytes = 0}},
          {}, topology);
      // Threads that poll for work before they sleep (Options::spin_before_sleep).
      const auto polling = results_of<Sync>(
          n, specs, 3, {.executor = Executor::task_graph, .spin_before_sleep = std::chrono::microseconds(20)}, {},
          topology);
      for (std::size_t it = 0; it < serial.size(); ++it)
        for (std::size_t r = 0; r < serial[it].size(); ++r) {
          CAPTURE(it);
          CAPTURE(r);
          CHECK(same_bits(graph[it][r], serial[it][r]));
          if (static_cast<int>(r) < workers) CHECK(same_bits(graph[it][r], graph[it][0]));
          CHECK(same_bits(coordinated[it][r], serial[it][r]));
          CHECK(same_bits(polling[it][r], serial[it][r]));
        }
    };
    for (int n : {2, 3, 4, 5}) {
      CAPTURE(n);
      compare(n, topology::Ring{.chunk_elements = 37}, n);
      compare(n, topology::ParameterServer{.partitions = 7, .chunk_elements = 23}, n);
      compare(n, topology::ParameterServer{.partitions = 3, .servers = 2}, n);
      compare(n, topology::ParameterServer{.partitions = 5, .servers = 1, .dedicated = true, .chunk_elements = 23}, n - 1);
      // A named arrangement (within, across): the automatic one follows the link each run measures,
      // and two runs on a loaded machine may measure differently and choose differently.
      using Within = topology::Hierarchical::Within;
      using Across = topology::Hierarchical::Across;
      for (auto [within, across] : {std::pair{Within::ring, Across::ring}, std::pair{Within::ring, Across::halving_doubling},
                                    std::pair{Within::leader, Across::halving_doubling}})
        compare(n,
                topology::Hierarchical{
                    .ranks_per_machine = n % 2 == 0 ? 2 : n, .chunk_elements = 37, .across = across, .within = within},
                n);
    }
  }

  TEST_CASE("selective compression: the ranks calibrate, agree, and end with the same bits") {
    // Which buckets get compressed depends on timings, but never differs between ranks.
    const std::vector<Spec> specs{{"big", 300000, DType::f32}, {"small", 10, DType::f32}, {"h.f64", 5000, DType::f64}};
    // Rank 0 logs the decisions (Options::log), one line per bucket under a heading.
    using C = compression::ErrorFeedback<compression::TwoBit>;
    for (Executor executor : {Executor::task_graph, Executor::serial})
      for (int n : {2, 3}) {
        CAPTURE(n);
        Logged logged;
        const Options options = logged.into({.executor = executor, .selective_compression = true});
        const std::vector<std::string>& logs = logged.lines;
        const auto ring = results_of<Synchronizer<bucketing::PerTensor, C, topology::Ring, InProcess>>(
            n, specs, 2, options, {}, {});
        const auto ps = results_of<Synchronizer<bucketing::PerTensor, C, topology::ParameterServer, InProcess>>(
            n, specs, 2, options, {}, {});
        for (const auto* results : {&ring, &ps})
          for (const auto& iteration : *results)
            for (const Model& m : iteration) CHECK(same_bits(m, iteration[0]));
        REQUIRE_FALSE(logs.empty());
        for (const std::string& line : logs) {
          CHECK(line.starts_with("gradsync selective compression (error-feedback(two-bit"));
          CHECK(line.find("bucket 2: ") != std::string::npos);
        }
      }
  }

  TEST_CASE_TEMPLATE("topology::Auto on the task graph: the serial executor's bits, every rank alike", C, compression::None,
                     compression::ErrorFeedback<compression::TwoBit>) {
    // A link on which the small buckets take recursive doubling and "w" halving-doubling at 4
    // ranks, the ring at 3 and 5 (where the fold costs halving-doubling two whole buckets).
    using Sync = Synchronizer<bucketing::PerTensor, C, topology::Auto<>, InProcess>;
    const std::vector<Spec> specs{{"w", 1000, DType::f32}, {"one", 1, DType::f32}, {"five", 5, DType::f32},
                                  {"h.f64", 97, DType::f64}, {"b.bf16", 13, DType::bf16}};
    const topology::Auto<> chooser{.link = {.latency = 1e-3, .seconds_per_byte = 1e-5}, .measure_link = false};
    for (int n : {2, 3, 4, 5}) {
      CAPTURE(n);
      const auto serial = results_of<Sync>(n, specs, 3, {.executor = Executor::serial}, {}, chooser);
      const auto graph = results_of<Sync>(n, specs, 3, {.executor = Executor::task_graph, .compute_threads = 3}, {}, chooser);
      for (std::size_t it = 0; it < serial.size(); ++it)
        for (std::size_t r = 0; r < serial[it].size(); ++r) {
          CAPTURE(it);
          CAPTURE(r);
          CHECK(same_bits(graph[it][r], serial[it][r]));
          CHECK(same_bits(graph[it][r], graph[it][0]));
        }
    }
  }

  TEST_CASE("topology::Auto: the link measured and agreed, each bucket's choice logged, the same bits everywhere") {
    using Sync = Synchronizer<bucketing::PerTensor, compression::None, topology::Auto<>, InProcess>;
    const std::vector<Spec> specs{{"big", 300000, DType::f32}, {"small", 10, DType::f32}, {"h.f64", 500, DType::f64}};
    for (Executor executor : {Executor::task_graph, Executor::serial})
      for (int n : {3, 4}) {
        CAPTURE(n);
        Logged logged;
        check_every_iteration(n, specs, results_of<Sync>(n, specs, 2, logged.into({.executor = executor}), {}, {}));
        const std::vector<std::string>& logs = logged.lines;
        // Rank 0 alone logs the measured link and every bucket's choice.
        REQUIRE(logs.size() == 1);
        CHECK(logs[0].starts_with("gradsync auto(recursive-doubling | halving-doubling | ring(chunk=262144), link measured, "
                                  "kept by measured times): link "));
        CHECK(logs[0].find(" (10 values): recursive-doubling") != std::string::npos);
      }
  }

  TEST_CASE("topology::Auto keeps what ran fastest: through the trials and after, every rank the same bits, each decision logged") {
    // 16 iterations: 2 of warm-up, then up to three candidates of three trials each for both size
    // classes, and their agreement; the averages stay right whichever schedule runs.
    using Sync = Synchronizer<bucketing::PerTensor, compression::None, topology::Auto<>, InProcess>;
    const std::vector<Spec> specs{{"w", 30000, DType::f32}, {"b", 10, DType::f32}, {"h.f64", 500, DType::f64}};
    for (Executor executor : {Executor::task_graph, Executor::serial}) {
      CAPTURE(executor == Executor::serial);
      constexpr int n = 4;
      Logged logged;
      check_every_iteration(n, specs, results_of<Sync>(n, specs, 16, logged.into({.executor = executor}), {}, {}));
      const std::vector<std::string>& logs = logged.lines;
      // The link's log, then rank 0's account of what the trials measured and what was kept.
      REQUIRE(logs.size() >= 2);
      CHECK(logs[1].find("chosen by measured times") != std::string::npos);
      CHECK(logs[1].find("values (measured): ") != std::string::npos);
    }
  }

  TEST_CASE_TEMPLATE("on machines of several ranks, Auto and Hierarchical try the hierarchical schedules and keep what "
                     "ran fastest: every rank the same bits, each decision logged",
                     Topology, topology::Auto<>, topology::Hierarchical) {
    // Three machines of two ranks. Auto: up to eight candidates of three trials for each size class;
    // Hierarchical: its five arrangements (the rings or a leader within, a schedule across).
    using Sync = Synchronizer<bucketing::PerTensor, compression::None, Topology, InProcess>;
    const std::vector<Spec> specs{{"w", 30000, DType::f32}, {"b", 10, DType::f32}, {"h.f64", 500, DType::f64}};
    Topology topology;
    if constexpr (std::same_as<Topology, topology::Auto<>>) topology.machines = {.ranks_per_machine = 2, .chunk_elements = 1000};
    else topology = {.ranks_per_machine = 2, .chunk_elements = 1000};
    constexpr int n = 6;
    Logged logged;
    check_every_iteration(n, specs, results_of<Sync>(n, specs, 30, logged.into({}), {}, topology));
    const std::vector<std::string>& logs = logged.lines;
    // The two links measured apart, then the decisions among the candidates, by name.
    REQUIRE(logs.size() >= 2);
    CHECK(logs[0].find(" within a machine, ") != std::string::npos);
    const auto decided = std::find_if(logs.begin(), logs.end(),
                                      [](const std::string& line) { return line.find("chosen by measured times") != std::string::npos; });
    REQUIRE(decided != logs.end());
    if constexpr (std::same_as<Topology, topology::Hierarchical>)
      CHECK(decided->find("-> hierarchical") != std::string::npos);
  }

  TEST_CASE("last_iteration() names each bucket's schedule with its predicted and measured time, the same names on "
            "every rank") {
    // Auto through its trials: the names are the candidates the tuner ran, iteration by iteration;
    // the ring alone names itself and predicts nothing.
    const std::vector<Spec> specs{{"w", 30000, DType::f32}, {"b", 10, DType::f32}};
    constexpr int n = 4, iterations = 14;
    const auto run = [&]<class Topology>(Topology topology) {
      std::vector<std::vector<std::vector<BucketSchedule>>> reports(n);  // rank, iteration, bucket
      const auto errors = test::run_ranks(n, [&](InProcess& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        Model model(specs);
        Synchronizer<bucketing::PerTensor, compression::None, Topology, InProcess> sync(std::move(t), {}, {}, {}, topology);
        for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
        for (int iteration = 0; iteration < iterations; ++iteration) {
          model.fill(static_cast<int>(r), iteration);
          for (GradId id = 0; id < specs.size(); ++id) sync.ready(id);
          sync.wait();
          reports[r].push_back(sync.last_iteration().schedules);
        }
      });
      for (const auto& e : errors)
        if (e) FAIL(std::string(e->what()));
      return reports;
    };
    const auto tuned = run(topology::Auto<>{});
    std::set<std::string> names;
    for (int it = 0; it < iterations; ++it) {
      CAPTURE(it);
      for (int r = 0; r < n; ++r) {
        const auto& buckets = tuned[static_cast<std::size_t>(r)][static_cast<std::size_t>(it)];
        REQUIRE(buckets.size() == 2);
        for (std::size_t b = 0; b < buckets.size(); ++b) {
          CHECK(buckets[b].schedule == tuned[0][static_cast<std::size_t>(it)][b].schedule);
          CHECK(buckets[b].seconds > 0);
          CHECK(buckets[b].predicted_seconds > 0);  // over the measured link
          names.insert(buckets[b].schedule);
        }
      }
    }
    CHECK(names.size() >= 2);  // the trials ran more than one candidate
    for (const std::string& name : names)
      CHECK((name == "recursive-doubling" || name == "halving-doubling" || name.starts_with("ring(")));
    const auto ring = run(topology::Ring{});
    for (const auto& bucket : ring[1].back()) {
      CHECK(bucket.schedule == topology::Ring{}.describe());
      CHECK(bucket.predicted_seconds == 0);
      CHECK(bucket.seconds > 0);
    }
  }

  TEST_CASE("a policy setting or option out of range is refused when the Synchronizer is built, naming it") {
    // What building a one-rank Synchronizer with these policies says.
    const auto refusal = []<class B, class C, class T>(B bucketing, C codec, T topology, Options options = {}) {
      try {
        Synchronizer<B, C, T, InProcess> sync(std::move(InProcess::create_world(1)[0]), options, bucketing, codec,
                                              topology);
      } catch (const Error& e) {
        return e.kind() == ErrorKind::invalid_argument ? std::string(e.what()) : "wrong kind: " + std::string(e.what());
      }
      return std::string("accepted");
    };
    const auto nan = std::numeric_limits<double>::quiet_NaN();
    const compression::None none;
    const topology::Ring ring;
    const bucketing::PerTensor per_tensor;
    const std::pair<std::string, std::string> cases[] = {
        {refusal(bucketing::TimeClustered{.check_every = 0}, none, ring), "check_every is 0"},
        {refusal(bucketing::TimeClustered{.profile_iterations = 0}, none, ring), "profile_iterations is 0"},
        {refusal(bucketing::TimeClustered{.window = 0}, none, ring), "window is 0"},
        {refusal(bucketing::TimeClustered{.gap_factor = nan}, none, ring), "gap_factor is nan"},
        {refusal(bucketing::TimeClustered{.drift_tolerance = -1}, none, ring), "drift_tolerance is -1"},
        {refusal(bucketing::TimeClustered{.min_bucket_bytes = 10, .max_bucket_bytes = 5}, none, ring),
         "min_bucket_bytes is 10; it must be at most max_bucket_bytes (5)"},
        {refusal(bucketing::FixedSize{.cap_bytes = 0}, none, ring), "cap_bytes is 0"},
        {refusal(per_tensor, compression::TwoBit{.threshold = -0.5f}, ring), "threshold is -0.5"},
        {refusal(per_tensor, compression::ErrorFeedback<compression::TwoBit>{{.threshold = 0}}, ring), "threshold is 0"},
        {refusal(per_tensor, compression::TopK{.keep = {.fraction = nan}}, ring), "keep.fraction is nan"},
        {refusal(per_tensor, compression::RandomK{.keep = {.fraction = 2}}, ring), "keep.fraction is 2"},
        {refusal(per_tensor, none, ring, {.timeout = std::chrono::milliseconds(0)}), "timeout is 0 ms"},
    };
    for (const auto& [said, expected] : cases) {
      CAPTURE(said);
      CHECK(said.find(expected) != std::string::npos);
    }
    // In range, including a count that overrides the fraction.
    CHECK(refusal(per_tensor, compression::TopK{.keep = {.count = 5, .fraction = nan}}, ring) == "accepted");
    CHECK(refusal(bucketing::TimeClustered{}, compression::ErrorFeedback<compression::TwoBit>{}, ring) == "accepted");
  }

  TEST_CASE("the default 25 MiB caps put a small model in one bucket") {
    auto world = InProcess::create_world(1);
    Model model(mixed);
    FixedSizeSync sync(std::move(world[0]));
    for (std::size_t i = 0; i < mixed.size(); ++i) sync.add(mixed[i].name, model.grad(i));
    for (GradId id = 0; id < mixed.size(); ++id) sync.ready(id);
    sync.wait();
    // f32, f16 and bf16 accumulate in f32; f64 travels in its own bucket.
    CHECK(sync.plan().buckets.size() == 2);
    CHECK(sync.last_iteration().buckets == 2);
  }

  TEST_CASE_TEMPLATE("16-bit codecs: every rank ends with the same bits, close to the mean", C, compression::Fp16,
                     compression::Bf16) {
    using Sync = Synchronizer<bucketing::FixedSize, C, topology::Ring, InProcess>;
    const double unit = std::is_same_v<C, compression::Fp16> ? std::ldexp(1.0, -9) : std::ldexp(1.0, -6);
    for (int n : {2, 3, 4}) train<Sync>(n, mixed, 3, unit, {}, {.cap_bytes = 512, .first_cap_bytes = 128});
  }

  TEST_CASE("gradients marked ready from several threads") {
    const std::vector<Spec> specs{{"a", 64, DType::f32}, {"b", 64, DType::f32}, {"c", 64, DType::f32}, {"d", 64, DType::f32}};
    std::vector<Model> in(3, Model(specs)), out = in;
    for (int r = 0; r < 3; ++r) in[static_cast<std::size_t>(r)].fill(r, 0);
    const auto errors = test::run_ranks(3, [&](InProcess& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      Model model = in[r];
      FixedSizeSync sync(std::move(t), {}, {.cap_bytes = 512, .first_cap_bytes = 256});
      for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
      std::thread other([&] { sync.ready(0), sync.ready(2); });
      sync.ready(3);
      sync.ready(1);
      other.join();
      sync.wait();
      out[r] = model;
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    check_averages(in, out, 0);
  }

  TEST_CASE("updates run as each gradient is averaged give the parameters of updating after wait(), bit for bit") {
    // Three steps of p -= 0.1 g on four tensors, buckets of one or two gradients, both executors.
    constexpr std::size_t tensors = 4, count = 300;
    const auto step = [&](bool on_averaged, Options options) {
      std::vector<std::vector<std::vector<float>>> params(3);
      const auto errors = test::run_ranks(3, [&](InProcess& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        std::vector<std::vector<float>> p(tensors, std::vector<float>(count, 1.0f)), g(tensors, std::vector<float>(count));
        FixedSizeSync sync(std::move(t), options, {.cap_bytes = 2 * count * sizeof(float), .first_cap_bytes = 4});
        for (std::size_t i = 0; i < tensors; ++i) sync.add(fmt::format("t{}", i), view(g[i]));
        const auto update = [&](GradId id) {
          for (std::size_t e = 0; e < count; ++e) p[id][e] -= 0.1f * g[id][e];
        };
        std::vector<int> updated(tensors);
        if (on_averaged)
          sync.on_averaged([&](GradId id) {
            ++updated[id];
            update(id);
          });
        for (std::uint64_t iteration = 0; iteration < 3; ++iteration) {
          for (std::size_t i = tensors; i-- > 0;) {
            const std::vector<float> local = test::random_values(count, 100 * iteration + 10 * r + i);
            std::copy(local.begin(), local.end(), g[i].begin());  // in place: the Synchronizer holds views
            sync.ready(static_cast<GradId>(i));
          }
          sync.wait();
          if (on_averaged) {
            CHECK(updated == std::vector<int>(tensors, static_cast<int>(iteration + 1)));  // all done by wait()
          } else {
            for (std::size_t i = 0; i < tensors; ++i) update(static_cast<GradId>(i));
          }
        }
        params[r] = p;
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
      CHECK(params[1] == params[0]);
      CHECK(params[2] == params[0]);
      return params[0];
    };
    for (Executor executor : {Executor::serial, Executor::task_graph}) {
      CAPTURE(static_cast<int>(executor));
      const Options options{.executor = executor};
      CHECK(step(true, options) == step(false, options));
    }
  }

  TEST_CASE("an update that throws stops every rank, naming the gradient") {
    const auto errors = test::run_ranks(3, [&](InProcess& t) {
      std::vector<float> a(8), b(8);
      PerTensorSync sync(std::move(t));
      sync.add("a", view(a));
      sync.add("layer.b", view(b));
      const int rank = sync.rank();
      sync.on_averaged([rank](GradId id) {
        if (rank == 1 && id == 1) throw std::runtime_error("optimizer state missing");
      });
      sync.ready(1);
      sync.ready(0);
      sync.wait();
      CHECK_THROWS_AS(sync.on_averaged({}), Error);
    });
    REQUIRE(errors[1]);
    CHECK(errors[1]->kind() == ErrorKind::internal);
    CHECK(std::string(errors[1]->what()).find(R"(the update of gradient "layer.b" (id 1) threw: optimizer state missing)") !=
          std::string::npos);
    for (int r : {0, 2})
      if (errors[static_cast<std::size_t>(r)]) CHECK(errors[static_cast<std::size_t>(r)]->kind() == ErrorKind::peer_failed);
  }

  // A codec whose decode throws on one rank: where a small piece's decode runs on the thread holding
  // the communication role, a large one's on a compute thread.
  struct DecodeRefused : example::FixedPoint16 {
    bool refuses = false;
    void decode(std::span<const std::byte> in, std::span<float> out, DecodeMode mode) const {
      if (refuses) throw std::runtime_error("decode refused");
      FixedPoint16::decode(in, out, mode);
    }
  };

  TEST_CASE("a failure on any engine thread reaches every rank's wait(), naming rank, bucket and operation") {
    // 64 values: pieces and copy back on the short path (the role's thread, here the waiter's);
    // 2^16: pieces of ~85 KiB and a 256 KiB copy back, on a compute thread. Packed bucket "ab"
    // too: over 64 KiB, its pack is a compute thread's task.
    for (const std::size_t values : {std::size_t{64}, std::size_t{1} << 16}) {
      for (const bool in_update : {false, true}) {
        CAPTURE(values);
        CAPTURE(in_update);
        const auto errors = test::run_ranks(3, [&](InProcess& t) {
          std::vector<float> a(values, 1.0f), b(values, 2.0f);
          const int rank = t.rank();
          Synchronizer<bucketing::FixedSize, DecodeRefused, topology::Ring, InProcess> sync(
              std::move(t), {.timeout = 60s}, {}, DecodeRefused{{}, !in_update && rank == 1});
          sync.add("a", view(a));
          sync.add("b", view(b));
          if (in_update)
            sync.on_averaged([rank](GradId id) {
              if (rank == 1 && id == 1) throw std::runtime_error("optimizer state missing");
            });
          sync.ready(1);
          sync.ready(0);
          sync.wait();
        });
        REQUIRE(errors[1]);
        const Error& origin = *errors[1];
        CHECK(origin.kind() == ErrorKind::internal);
        CHECK(origin.context().rank == 1);
        CHECK(origin.context().bucket == 0u);
        CHECK(origin.context().operation == (in_update ? "update" : "compute"));
        CHECK(std::string(origin.what()).find(in_update ? "optimizer state missing" : "decode refused") !=
              std::string::npos);
        // A refused decode stops rank 1's part of the ring, so the others cannot finish; an update
        // runs once the bucket is averaged, by when they may have.
        for (int r : {0, 2}) {
          if (!in_update) REQUIRE(errors[static_cast<std::size_t>(r)]);
          if (errors[static_cast<std::size_t>(r)])
            CHECK(errors[static_cast<std::size_t>(r)]->kind() == ErrorKind::peer_failed);
        }
      }
    }
  }

  TEST_CASE("every rank agrees on the plan rebuilt from rank 0's observed ready order") {
    const std::vector<Spec> specs{{"a", 16, DType::f32}, {"b", 16, DType::f32}, {"c", 16, DType::f32}, {"d", 16, DType::f32}};
    const bucketing::FixedSize policy{.cap_bytes = 128, .first_cap_bytes = 128};
    std::vector<BucketPlan> plans(3);
    const auto errors = test::run_ranks(3, [&](InProcess& t) {
      Model model(specs);
      FixedSizeSync sync(std::move(t), {}, policy);
      for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
      // Rank 0 produces a, c, b, d; the others a different order each.
      const std::vector<GradId> order = sync.rank() == 0 ? std::vector<GradId>{0, 2, 1, 3} : shuffled_order(4, sync.rank(), 9);
      for (GradId id : order) sync.ready(id);
      sync.wait();
      plans[static_cast<std::size_t>(sync.rank())] = sync.plan();
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    const Layout layout{{"a", 16}, {"b", 16}, {"c", 16}, {"d", 16}};
    const std::vector<GradId> rank0_order{0, 2, 1, 3};
    CHECK(plans[0] == policy.pack(layout, rank0_order));
    CHECK(plans[0] == BucketPlan{{{0, 2}, {1, 3}}});
    CHECK(plans[1] == plans[0]);
    CHECK(plans[2] == plans[0]);
  }

  TEST_CASE("time-clustered plans: ranks with different timings agree, and a re-plan keeps results exact") {
    // Three layers of two gradients. Rank 0 leaves 8 ms between layers, then, from iteration 12,
    // produces the second layer right after the first; rank 1 has no gaps, rank 2 gaps of 3 ms.
    // Rank 0's timings decide the plan; every rank must hold it and the same averages throughout.
    // Each rank's proposals and drift reach its own log sink (Options::log).
    const std::vector<Spec> specs{{"l0.w", 300, DType::f32}, {"l0.b", 3, DType::f32}, {"l1.w", 200, DType::f32},
                                  {"l1.b", 2, DType::f32},   {"l2.w", 100, DType::f32}, {"l2.b", 1, DType::f32}};
    constexpr int n = 3, iterations = 32;
    const bucketing::TimeClustered policy{.profile_iterations = 3, .check_every = 4, .min_bucket_bytes = 1,
                                          .window = 3};
    std::vector<std::vector<std::string>> logs(n);
    std::vector<std::vector<Model>> inputs(iterations, std::vector<Model>(n, Model(specs)));
    auto outputs = inputs;
    for (int it = 0; it < iterations; ++it)
      for (int r = 0; r < n; ++r) inputs[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)].fill(r, it);
    std::vector<BucketPlan> plans(n);
    std::vector<BucketPlan> rank0_history;
    std::barrier step(n);
    const auto errors = test::run_ranks(n, [&](InProcess& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      Model model(specs);
      Options options;
      options.log = [&logs, r](std::string_view line) { logs[r].emplace_back(line); };  // read after the join
      Synchronizer<bucketing::TimeClustered, compression::None, topology::Ring, InProcess> sync(std::move(t), options,
                                                                                               policy);
      for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
      for (int it = 0; it < iterations; ++it) {
        model = inputs[static_cast<std::size_t>(it)][r];
        for (GradId layer = 0; layer < 3; ++layer) {
          const auto gap = r == 1 ? 0ms : r == 2 ? 3ms : (it >= 12 && layer == 1) ? 0ms : 8ms;
          if (layer > 0) std::this_thread::sleep_for(gap);
          sync.ready(2 * layer);
          sync.ready(2 * layer + 1);
        }
        sync.wait();
        outputs[static_cast<std::size_t>(it)][r] = model;
        plans[r] = sync.plan();
        step.arrive_and_wait();
        if (r == 0) {
          CHECK(plans[1] == plans[0]);
          CHECK(plans[2] == plans[0]);
          if (rank0_history.empty() || rank0_history.back() != plans[0]) rank0_history.push_back(plans[0]);
        }
        step.arrive_and_wait();
      }
    });
    for (const auto& e : errors)
      if (e) FAIL(std::string(e->what()));
    for (int it = 0; it < iterations; ++it) {
      CAPTURE(it);
      check_averages(inputs[static_cast<std::size_t>(it)], outputs[static_cast<std::size_t>(it)], 0);
    }
    // The default plan first, then one bucket per layer, then the first two layers together.
    REQUIRE(rank0_history.size() == 3);
    CHECK(rank0_history[1] == BucketPlan{{{0, 1}, {2, 3}, {4, 5}}});
    CHECK(rank0_history[2] == BucketPlan{{{0, 1, 2, 3}, {4, 5}}});
    // Rank 0 proposed three buckets, saw the drift, and proposed two.
    const auto logged = [&](std::string_view text) {
      return std::count_if(logs[0].begin(), logs[0].end(),
                           [&](const std::string& line) { return line.find(text) != std::string::npos; });
    };
    CHECK(logged("gradsync time-clustered: 3 buckets:") >= 1);
    CHECK(logged("gradsync time-clustered: ready times drifted") >= 1);
    CHECK(logged("gradsync time-clustered: 2 buckets:") >= 1);
  }

  TEST_CASE("per-iteration counters: bytes, compression ratio, time after the last ready") {
    const std::vector<Spec> specs{{"w", 4000, DType::f32}, {"b", 40, DType::f32}};
    std::vector<IterationStats> none(2), two_bit(2);
    const auto run = [&]<class C>(std::vector<IterationStats>& out) {
      const auto errors = test::run_ranks(2, [&](InProcess& t) {
        Model model(specs);
        Synchronizer<bucketing::FixedSize, C, topology::Ring, InProcess> sync(std::move(t));
        for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
        model.fill(sync.rank(), 0);
        sync.ready(1);
        sync.ready(0);
        sync.wait();
        out[static_cast<std::size_t>(sync.rank())] = sync.last_iteration();
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
    };
    run.template operator()<compression::None>(none);
    run.template operator()<compression::TwoBit>(two_bit);
    for (int r = 0; r < 2; ++r) {
      const auto& n = none[static_cast<std::size_t>(r)];
      const auto& q = two_bit[static_cast<std::size_t>(r)];
      // A 2-rank ring sends one half of the 4040-value bucket in reduce-scatter, the other in
      // allgather: 4040 values of 4 bytes.
      CHECK(n.bytes_sent == 4040 * 4);
      CHECK(n.bytes_uncompressed == n.bytes_sent);
      CHECK(n.compression_ratio() == 1.0);
      CHECK(q.bytes_uncompressed == 4040 * 4);
      CHECK(q.bytes_sent == 2 * (8 + 4 + 4 * ((2020 + 15) / 16)));  // two 2020-value halves, 2 bits each
      CHECK(q.compression_ratio() > 14.0);
      CHECK(q.after_last_ready > std::chrono::nanoseconds{0});
      CHECK(q.compute > std::chrono::nanoseconds{0});
      CHECK(q.in_flight > std::chrono::nanoseconds{0});  // the task graph, the default executor
    }
  }

  TEST_CASE("a rank with a different layout gets a clear Error on every rank") {
    const auto errors = test::run_ranks(3, [&](InProcess& t) {
      std::vector<float> a(10), b(t.rank() == 2 ? 11 : 10);
      PerTensorSync sync(std::move(t), {.timeout = 10s});
      sync.add("a", view(a));
      sync.add("b", view(b));
      sync.ready(0);
      sync.ready(1);
      sync.wait();
    });
    for (int r = 0; r < 3; ++r) {
      REQUIRE(errors[static_cast<std::size_t>(r)]);
      const Error& e = *errors[static_cast<std::size_t>(r)];
      CHECK(e.kind() == ErrorKind::mismatch);
      CHECK(e.context().rank == r);
      CHECK(e.detail() == R"(rank 2 differs from rank 0: gradient 1: rank 0 has "b" f32[10] cpu, rank 2 has "b" f32[11] cpu)");
    }
  }

  TEST_CASE("ranks with different policy settings are told which") {
    const auto errors = test::run_ranks(2, [&](InProcess& t) {
      std::vector<float> a(10);
      FixedSizeSync sync(std::move(t), {.timeout = 10s}, {.cap_bytes = t.rank() == 0 ? 1024u : 2048u});
      sync.add("a", view(a));
      sync.ready(0);
      sync.wait();
    });
    for (const auto& e : errors) {
      REQUIRE(e);
      CHECK(e->kind() == ErrorKind::mismatch);
      CHECK(e->detail().find("fixed-size(cap=1024, first=1048576)") != std::string::npos);
      CHECK(e->detail().find("fixed-size(cap=2048, first=1048576)") != std::string::npos);
    }
  }

  TEST_CASE("wait() with a gradient never marked ready fails at once, and every rank learns why") {
    // With a 5-minute timeout: had anyone waited for it, the test would time out instead. Rank 1
    // forgets "layer.b"; everyone's Error must name rank 1 and that gradient.
    const Options graph{.timeout = 5min, .executor = Executor::task_graph};
    const Options serial{.timeout = 5min, .executor = Executor::serial};
    for (const Options& options : {graph, serial})
      for (int attempt = 0; attempt < 5; ++attempt) {
        CAPTURE(static_cast<int>(options.executor));
        CAPTURE(attempt);
        const auto errors = test::run_ranks(3, [&](InProcess& t) {
          std::vector<float> a(100000), b(8), c(1000);
          PerTensorSync sync(std::move(t), options);
          sync.add("layer.a", view(a));
          sync.add("layer.b", view(b));
          sync.add("layer.c", view(c));
          sync.ready(0);
          sync.ready(2);
          if (sync.rank() != 1) sync.ready(1);
          sync.wait();
        });
        REQUIRE(errors[1]);
        CHECK(errors[1]->kind() == ErrorKind::invalid_argument);
        CHECK(errors[1]->context().rank == 1);
        CHECK(errors[1]->context().operation == "wait");
        CHECK(errors[1]->detail().find(R"(1 of 3 gradients never marked ready on this rank: "layer.b" (id 1))") !=
              std::string::npos);
        for (int r : {0, 2}) {
          CAPTURE(r);
          REQUIRE(errors[static_cast<std::size_t>(r)]);
          const std::string what = errors[static_cast<std::size_t>(r)]->what();
          CAPTURE(what);
          CHECK(errors[static_cast<std::size_t>(r)]->kind() == ErrorKind::peer_failed);
          CHECK(errors[static_cast<std::size_t>(r)]->context().rank == r);
          CHECK(what.find("rank 1 failed: ") != std::string::npos);
          CHECK(what.find(R"(never marked ready on this rank: "layer.b")") != std::string::npos);
        }
      }
  }

  TEST_CASE("a rank that goes away mid-iteration makes the others fail fast, naming it") {
    const Options serial{.timeout = 60s, .executor = Executor::serial};
    const Options graph{.timeout = 60s, .executor = Executor::task_graph};
    Options coordinated = graph;
    coordinated.coordination.enabled = true;
    for (const Options& options : {graph, serial, coordinated}) {
      CAPTURE(static_cast<int>(options.executor));
      CAPTURE(options.coordination.enabled);
      const auto errors = test::run_ranks(3, [&](InProcess& t) {
        std::vector<float> a(8), b(8);
        PerTensorSync sync(std::move(t), options);
        sync.add("a", view(a));
        sync.add("b", view(b));
        sync.ready(1);
        if (sync.rank() == 2) return;  // leaves before finishing its backward pass
        sync.ready(0);
        sync.wait();
      });
      CHECK_FALSE(errors[2]);
      for (int r : {0, 1}) {
        REQUIRE(errors[static_cast<std::size_t>(r)]);
        // A timeout here would mean the 60 s wait ran out instead of failing fast.
        CHECK(errors[static_cast<std::size_t>(r)]->kind() == ErrorKind::peer_failed);
        CHECK(errors[static_cast<std::size_t>(r)]->context().peer == 2);
        CHECK(std::string(errors[static_cast<std::size_t>(r)]->what()).find("destroyed during iteration 0") != std::string::npos);
      }
    }
  }

  TEST_CASE("API misuse is an Error, not undefined behaviour") {
    auto world = InProcess::create_world(1);
    std::vector<float> a(4), gpu(4);
    PerTensorSync sync(std::move(world[0]));
    CHECK_THROWS_AS(sync.add("on-gpu", view(gpu, Device::cuda(0))), Error);
    sync.add("a", view(a));
    sync.ready(0);
    try {
      sync.ready(0);
      FAIL("second ready accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      CHECK(e.detail().find(R"("a" (id 0) was marked ready twice in iteration 0)") != std::string::npos);
    }
    CHECK_THROWS_AS(sync.ready(7), Error);
    CHECK_THROWS_AS(sync.add("late", view(a)), Error);
    sync.wait();
    sync.ready(0);  // the next iteration may begin after wait()
    sync.wait();
  }

  TEST_CASE("options a Synchronizer cannot honour are refused at construction") {
    auto world = InProcess::create_world(2);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(world[0]), {.compute_threads = 0}),
                         doctest::Contains("compute_threads is 0"), Error);
    auto polling = InProcess::create_world(2);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(polling[0]), {.spin_before_sleep = std::chrono::microseconds(-1)}),
                         doctest::Contains("spin_before_sleep is -1 us"), Error);
    CHECK_THROWS_WITH_AS(
        PerTensorSync(std::move(polling[1]), {.executor = Executor::serial, .spin_before_sleep = std::chrono::microseconds(5)}),
        doctest::Contains("the serial executor has none"), Error);
    using Plain = Synchronizer<bucketing::PerTensor, compression::TwoBit, RingWithoutShape, InProcess>;
    try {
      Plain sync(std::move(world[1]), {.selective_compression = true});
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::unsupported);
      CHECK(e.detail().find("selective compression needs a topology with shape()") != std::string::npos);
    }
    auto more = InProcess::create_world(2);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(more[0]), {.executor = Executor::serial, .coordination = {.enabled = true}}),
                         doctest::Contains("coordinated sends need the task-graph executor"), Error);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(more[1]), {.coordination = {.enabled = true, .window = 0}}),
                         doctest::Contains("coordination window is 0"), Error);
    auto third = InProcess::create_world(2);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(third[0]), {.timeline_events = 0}),
                         doctest::Contains("timeline_events is 0"), Error);
    CHECK_THROWS_WITH_AS(PerTensorSync(std::move(third[1]), {.timeline_events = Timeline::max_capacity + 1}),
                         doctest::Contains("timeline_events is"), Error);
  }

  TEST_CASE("try_wait polls without blocking, and an empty layout still completes") {
    const auto errors = test::run_ranks(2, [&](InProcess& t) {
      std::vector<float> a(1000, static_cast<float>(t.rank()));
      PerTensorSync sync(std::move(t));
      sync.add("a", view(a));
      sync.ready(0);
      const auto give_up = std::chrono::steady_clock::now() + 30s;
      while (!sync.try_wait()) REQUIRE(std::chrono::steady_clock::now() < give_up);
      CHECK(a[999] == 0.5f);
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    const auto empty = test::run_ranks(2, [&](InProcess& t) {
      PerTensorSync sync(std::move(t));
      sync.wait();
      sync.wait();
    });
    for (const auto& e : empty) REQUIRE_FALSE(e);
  }

  TEST_CASE("a bucketing policy's deadline reaches it while its bucket is late") {
    // PerTensor with a 1 ms expectation for every bucket, counting the late reports.
    struct Impatient : bucketing::PerTensor {
      int* late = nullptr;
      std::optional<Duration> expected_ready(std::size_t) const { return 1ms; }
      void on_late(std::size_t, Duration) const { ++*late; }
    };
    static_assert(BucketingPolicy<Impatient>);
    int late = 0;
    auto world = InProcess::create_world(1);
    std::vector<float> a(4), b(4);
    Synchronizer<Impatient, compression::None, topology::Ring, InProcess> sync(std::move(world[0]), {},
                                                                               Impatient{{}, &late});
    sync.add("a", view(a));
    sync.add("b", view(b));
    sync.ready(0);                          // starts the clock; bucket 0 is "b"
    std::this_thread::sleep_for(100ms);     // b arrives 100x later than expected
    sync.ready(1);
    sync.wait();
    CHECK(late >= 1);
  }

  TEST_CASE_TEMPLATE("the per-step path allocates nothing", Topology, topology::Ring, topology::ParameterServer,
                     topology::Hierarchical, topology::RecursiveDoubling, topology::HalvingDoubling, topology::Auto<>) {
    const std::vector<Spec> specs{{"w1", 3000, DType::f32}, {"b1", 30, DType::f32}, {"w2", 500, DType::f16},
                                  {"b2", 7, DType::bf16},   {"h", 40, DType::f64}};
    constexpr int n = 4;
    Topology pieces_of_100{};
    if constexpr (requires { pieces_of_100.chunk_elements; }) pieces_of_100.chunk_elements = 100;
    if constexpr (std::same_as<Topology, topology::Hierarchical>) pieces_of_100.ranks_per_machine = 2;  // 2 machines of 2
    if constexpr (std::same_as<Topology, topology::Auto<>>) pieces_of_100.large.chunk_elements = 100;
    // With a timeline too: recording an event must not allocate either (timeline.hpp).
    const auto trace = std::filesystem::temp_directory_path() / "gradsync-allocation-test.json";
    for (const auto& [coordinated, traced] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
      CAPTURE(coordinated);
      CAPTURE(traced);
      std::barrier sync_point(n);
      std::size_t counted = 1;
      const auto errors = test::run_ranks(n, [&](InProcess& t) {
        Model model(specs);
        model.fill(t.rank(), 0);
        Synchronizer<bucketing::FixedSize, compression::Fp16, Topology, InProcess> sync(
            std::move(t),
            {.coordination = {.enabled = coordinated, .batch_bytes = 300}, .timeline = traced ? trace.string() : ""},
            {.cap_bytes = 4096, .first_cap_bytes = 256}, {}, pieces_of_100);
        for (std::size_t i = 0; i < specs.size(); ++i) sync.add(specs[i].name, model.grad(i));
        const auto step = [&] {
          for (GradId id = static_cast<GradId>(specs.size()); id-- > 0;) sync.ready(id);
          sync.wait();
        };
        // Warm-up: the plan is agreed after the first; a tuned topology's trials end after two
        // untimed iterations and three a candidate at most (its exchanges are built anew as
        // candidates change, as when a plan is installed).
        const int warm_up = [] {
          if constexpr (TunedTopology<Topology>) return 3 + 3 * static_cast<int>(Topology::candidates);
          return 3;
        }();
        for (int i = 0; i < warm_up; ++i) step();
        sync_point.arrive_and_wait();
        if (sync.rank() == 0) test::allocation_count::start();
        sync_point.arrive_and_wait();
        for (int i = 0; i < 10; ++i) step();
        sync_point.arrive_and_wait();
        if (sync.rank() == 0) counted = test::allocation_count::stop();
        // Tearing down may allocate (withdrawn receives end in Errors): not while rank 0 counts.
        sync_point.arrive_and_wait();
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
      CHECK(counted == 0);
      if (traced)
        for (int r = 0; r < n; ++r) CHECK(std::filesystem::remove(Timeline::rank_path(trace.string(), std::to_string(r))));
    }
  }
}
