// Sparse embeddings: the machine's shared table and the sparse exchange, between real processes
// (emulated machines of several processes: shared memory within, TCP across).

#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <thread>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>

#include "detail/hmac.hpp"  // to reseal a crafted checkpoint
#include "gradsync/async/synchronizer.hpp"
#include "gradsync/gradsync.hpp"
#include "processes.hpp"
#include "routed_world.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using test::RoutedWorld;

namespace {

constexpr int dim = 4;

std::string unique_job(const char* what) { return fmt::format("sparse-{}-{}-{}", what, ::getpid(), std::random_device{}()); }

sparse::EmbeddingOptions table_options(sparse::Optimizer optimizer = sparse::Optimizer::sgd) {
  return {.rows = 1000, .dim = dim, .init_scale = 0.5f, .seed = 7, .optimizer = optimizer, .learning_rate = 1.0f,
          .timeout = 20s};
}

// A machine's table as text, key by key in key order: equal texts, equal bits.
std::string contents(const sparse::EmbeddingTable& table, const std::vector<std::uint64_t>& keys) {
  std::string out;
  for (const std::uint64_t key : keys) {
    const float* row = table.find(key);
    if (row == nullptr) {
      out += fmt::format("{}:-;", key);
      continue;
    }
    std::uint32_t bits[dim];
    std::memcpy(bits, row, sizeof bits);
    out += fmt::format("{}:{:08x}{:08x}{:08x}{:08x};", key, bits[0], bits[1], bits[2], bits[3]);
  }
  return out;
}

// Runs body(rank, world, table, exchange) on `machines` x `local` processes.
template <class Body>
std::vector<test::ChildResult> run_job(int machines, int local, sparse::SparseOptions options, Body body,
                                       sparse::Optimizer optimizer = sparse::Optimizer::sgd) {
  const int n = machines * local;
  const std::uint16_t port = test::free_port();
  const std::string job = unique_job("job");
  return test::run_processes(n, [&](int rank) -> std::string {
    RoutedWorld world = test::routed_world(rank, local, n, port, job);
    sparse::EmbeddingTable table(world.local(), table_options(optimizer));
    sparse::SparseExchange<RoutedWorld> exchange(world, Group::world(rank, n), local, table, options);
    return body(rank, world, table, exchange);
  });
}

}  // namespace

TEST_SUITE("sparse") {
  TEST_CASE("a row is averaged over the trainers whose batch held it; duplicates count once; the divisor is a policy") {
    // 2 machines x 2 trainers. Key 10 is held by trainers 0, 1 (twice) and 2: its step gradient is
    // their sum / 3. Key 20 only by trainer 3, key 30 only by trainer 0: their own gradients.
    // Whole numbers keep every sum exact; lr = 1, so row = initial - gradient.
    const std::map<int, std::vector<std::pair<std::uint64_t, float>>> batches = {
        {0, {{10, 1}, {30, 5}}}, {1, {{10, 2}, {10, 4}}}, {2, {{10, 8}}}, {3, {{20, 16}}}};
    const auto gradient = [](float base, int j) { return base * static_cast<float>(j + 1); };
    for (const auto& [averaging, name] : {std::pair{sparse::Averaging::occurrence, "occurrence"},
                                         std::pair{sparse::Averaging::world_size, "world-size"},
                                         std::pair{sparse::Averaging::none, "none"}}) {
      CAPTURE(name);
      const auto divisor = [&](float held_by) {
        return averaging == sparse::Averaging::occurrence ? held_by
               : averaging == sparse::Averaging::world_size ? 4.0f
                                                             : 1.0f;
      };
      const std::map<std::uint64_t, std::pair<float, float>> expected = {  // key: sum of bases, trainers
          {10, {1 + 2 + 4 + 8, 3}}, {20, {16, 1}}, {30, {5, 1}}};
      const auto results = run_job(2, 2, {.averaging = averaging, .timeout = 20s}, [&](int rank, RoutedWorld&,
                                                                                      sparse::EmbeddingTable& table,
                                                                                      auto& exchange) -> std::string {
        std::vector<std::uint64_t> keys;
        std::vector<float> grads;
        for (const auto& [key, base] : batches.at(rank)) {
          keys.push_back(key);
          for (int j = 0; j < dim; ++j) grads.push_back(gradient(base, j));
        }
        const sparse::SparseStepReport report = exchange.step(keys, grads);
        if (report.keys != (rank == 1 ? 1u : keys.size())) return fmt::format("{} distinct keys counted", report.keys);
        if (rank % 2 == 0 && report.step_keys != 3) return fmt::format("{} keys in the step", report.step_keys);
        for (const auto& [key, sum_and_count] : expected) {
          const float* row = table.find(key);
          if (row == nullptr) return fmt::format("key {} has no row", key);
          float initial[dim];
          table.initial_values(key, initial);
          for (int j = 0; j < dim; ++j) {
            const float want = initial[j] - gradient(sum_and_count.first, j) / divisor(sum_and_count.second);
            if (row[j] != want) return fmt::format("key {} value {} is {}, want {}", key, j, row[j], want);
          }
        }
        if (table.size() != 3) return fmt::format("the table holds {} keys", table.size());
        return "ok";
      });
      for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    }
  }

  TEST_CASE("after many steps of random batches every machine's table is bit-identical; empty batches take part") {
    for (const auto optimizer : {sparse::Optimizer::sgd, sparse::Optimizer::adagrad}) {
      for (const auto& [machines, local] : {std::pair{2, 2}, std::pair{3, 1}, std::pair{1, 3}}) {
        CAPTURE(machines);
        CAPTURE(local);
        const int n = machines * local;
        const auto results = run_job(
            machines, local, {.timeout = 20s},
            [&](int rank, RoutedWorld&, sparse::EmbeddingTable& table, auto& exchange) -> std::string {
              std::mt19937 random(static_cast<unsigned>(rank) * 7919u + 1);
              std::uniform_int_distribution<std::uint64_t> key(1, 200);
              std::normal_distribution<float> value(0, 1);
              std::vector<std::uint64_t> all_keys;
              for (std::uint64_t k = 1; k <= 200; ++k) all_keys.push_back(k);
              for (int step = 0; step < 8; ++step) {
                // Trainer n-1 sends nothing every other step; keys repeat within a batch.
                const std::size_t count = rank == n - 1 && step % 2 == 0 ? 0 : 20;
                std::vector<std::uint64_t> keys(count);
                std::vector<float> grads(count * dim);
                for (auto& k : keys) k = key(random);
                for (auto& g : grads) g = value(random);
                // A lookup before the update: rows of keys the table holds, initial values for new ones.
                std::vector<const float*> rows(count);
                table.lookup(keys, rows);
                for (std::size_t i = 0; i < count; ++i) {
                  float initial[dim];
                  table.initial_values(keys[i], initial);
                  const float* held = table.find(keys[i]);
                  if (std::memcmp(rows[i], held ? held : initial, sizeof initial) != 0)
                    return fmt::format("lookup of key {} gave other values", keys[i]);
                }
                exchange.step(keys, grads);
              }
              return "ok " + contents(table, all_keys);
            },
            optimizer);
        REQUIRE(results.size() == static_cast<std::size_t>(n));
        for (const auto& r : results) CHECK_MESSAGE(r.report.starts_with("ok "), r.report);
        for (const auto& r : results) CHECK(r.report == results[0].report);
        CHECK(results[0].report.find(":-;") != std::string::npos);  // some keys never drawn: no row
      }
    }
  }

  TEST_CASE("dense gradients through a Synchronizer on the same transport, in the same step, while the sparse exchange runs") {
    const int machines = 2, local = 2, n = machines * local;
    const auto results = run_job(machines, local, {.timeout = 20s}, [&](int rank, RoutedWorld& world,
                                                                      sparse::EmbeddingTable& table,
                                                                      auto& exchange) -> std::string {
      using Borrowed = transport::Borrowed<RoutedWorld>;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Hierarchical, Borrowed> dense(
          Borrowed(world), {.timeout = 20s}, {}, {}, {.ranks_per_machine = local, .chunk_elements = 1024});
      std::vector<float> weights(5000);
      for (int step = 0; step < 3; ++step) {
        for (std::size_t e = 0; e < weights.size(); ++e) weights[e] = static_cast<float>((rank * 31 + step + e) % 17);
        if (step == 0) dense.add("w", view(weights));
        dense.ready(0);
        const std::vector<std::uint64_t> keys{static_cast<std::uint64_t>(100 + step), static_cast<std::uint64_t>(rank)};
        const std::vector<float> grads(2 * dim, static_cast<float>(rank + 1));
        exchange.step(keys, grads);
        dense.wait();
        for (std::size_t e = 0; e < weights.size(); ++e) {
          float sum = 0;
          for (int r = 0; r < n; ++r) sum += static_cast<float>((r * 31 + step + e) % 17);
          if (weights[e] != sum / static_cast<float>(n)) return fmt::format("step {}: dense element {} is wrong", step, e);
        }
        // Key 100+step was held by every trainer: (1 + 2 + 3 + 4) / 4 = 2.5; key r by trainer r alone.
        float initial[dim];
        table.initial_values(static_cast<std::uint64_t>(100 + step), initial);
        if (table.find(static_cast<std::uint64_t>(100 + step))[0] != initial[0] - 2.5f) return "the shared key's row is wrong";
      }
      return "ok";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
  }

  TEST_CASE("the methods composed: sparse tables beside a dense Synchronizer<TimeClustered, ErrorFeedback<TwoBit>, Hierarchical>") {
    // The fifth document's tables, the first's time-clustered buckets (re-planned from measured
    // ready times), a compressed codec with error feedback and the hierarchical allreduce in one
    // job on 2 machines of 2: every rank ends each step with the same dense bits (finite, not all
    // zero), and every machine with the same table.
    const int machines = 2, local = 2, n = machines * local;
    constexpr int steps = 12;
    constexpr std::size_t sizes[] = {3000, 40, 700};
    const auto results = run_job(machines, local, {.timeout = 20s}, [&](int rank, RoutedWorld& world,
                                                                      sparse::EmbeddingTable& table,
                                                                      auto& exchange) -> std::string {
      using Borrowed = transport::Borrowed<RoutedWorld>;
      using Codec = compression::ErrorFeedback<compression::TwoBit>;
      Synchronizer<bucketing::TimeClustered, Codec, topology::Hierarchical, Borrowed> dense(
          Borrowed(world), {.timeout = 20s}, {.profile_iterations = 2, .check_every = 4},
          Codec{{.threshold = 0.05f}}, {.ranks_per_machine = local});
      std::vector<std::vector<float>> gradients;
      for (const std::size_t size : sizes) gradients.emplace_back(size);
      for (std::size_t g = 0; g < gradients.size(); ++g) dense.add(fmt::format("layer{}", g), view(gradients[g]));
      std::mt19937 random(static_cast<unsigned>(rank) + 11u);
      std::normal_distribution<float> normal(0.0f, 0.01f);
      std::string digests;
      for (int step = 0; step < steps; ++step) {
        for (auto& gradient : gradients)
          for (float& v : gradient) v = normal(random);
        for (std::size_t g = gradients.size(); g-- > 0;) {  // backward's order, with a gap before the first layer
          if (g == 0) std::this_thread::sleep_for(2ms);
          dense.ready(static_cast<GradId>(g));
        }
        const std::vector<std::uint64_t> keys{static_cast<std::uint64_t>(1 + step % 5), static_cast<std::uint64_t>(50 + rank)};
        std::vector<float> rows(keys.size() * dim);
        for (float& v : rows) v = normal(random);
        exchange.step(keys, rows);
        dense.wait();
        std::size_t nonzero = 0;
        for (const auto& gradient : gradients)
          for (float v : gradient) {
            if (!std::isfinite(v)) return fmt::format("step {}: a dense average is {}", step, v);
            nonzero += v != 0.0f;
          }
        if (nonzero == 0) return fmt::format("step {}: every dense average is 0", step);
        std::uint64_t h = 1469598103934665603ull;
        for (const auto& gradient : gradients)
          for (float v : gradient) h = (h ^ std::bit_cast<std::uint32_t>(v)) * 1099511628211ull;
        digests += fmt::format("{:x};", h);
      }
      std::vector<std::uint64_t> all_keys;
      for (std::uint64_t k = 1; k <= 60; ++k) all_keys.push_back(k);
      return "ok " + digests + contents(table, all_keys);
    });
    REQUIRE(results.size() == static_cast<std::size_t>(n));
    for (const auto& r : results) {
      CHECK_MESSAGE(r.report.starts_with("ok "), r.report);
      CHECK(r.report == results[0].report);
    }
  }

  TEST_CASE("sparse tables beside the asynchronous parameter server on the same transport") {
    // At staleness 0 and quorum N every worker applies exactly each iteration's global gradient,
    // so every rank ends each step with the same dense bits; the tables agree across machines.
    const int machines = 2, local = 2, n = machines * local;
    const auto results = run_job(machines, local, {.timeout = 20s}, [&](int rank, RoutedWorld& world,
                                                                      sparse::EmbeddingTable& table,
                                                                      auto& exchange) -> std::string {
      using Borrowed = transport::Borrowed<RoutedWorld>;
      async::Synchronizer<bucketing::TimeClustered, compression::None, Borrowed> dense(Borrowed(world), {.staleness = 0, .period = 2, .timeout = 20s});
      std::vector<float> gradient(1500), parameters(1500, 1.0f);
      dense.add("w", view(gradient));
      dense.add_parameters(parameters);
      std::mt19937 random(static_cast<unsigned>(rank) + 5u);
      std::normal_distribution<float> normal(0.0f, 0.01f);
      std::string digests;
      for (int step = 0; step < 6; ++step) {
        for (float& v : gradient) v = normal(random);
        std::vector<float> expected(gradient.size(), 0.0f);  // group order, as the servers sum
        for (int r = 0; r < n; ++r) {
          std::mt19937 theirs(static_cast<unsigned>(r) + 5u);
          std::normal_distribution<float> their_normal(0.0f, 0.01f);
          std::vector<float> values(gradient.size());
          for (int s = 0; s <= step; ++s) {
            for (float& v : values) v = their_normal(theirs);
            if (s < step)
              for (int k = 0; k < 2 * dim; ++k) (void)their_normal(theirs);  // that step's rows
          }
          for (std::size_t e = 0; e < values.size(); ++e) expected[e] += values[e];
        }
        dense.ready(0);
        const std::vector<std::uint64_t> keys{static_cast<std::uint64_t>(1 + step % 3), static_cast<std::uint64_t>(40 + rank)};
        std::vector<float> rows(keys.size() * dim);
        for (float& v : rows) v = normal(random);
        exchange.step(keys, rows);
        dense.wait();
        for (std::size_t e = 0; e < gradient.size(); ++e)
          if (gradient[e] != expected[e] / static_cast<float>(n))
            return fmt::format("step {}: element {} is {}, the average is {}", step, e, gradient[e], expected[e] / n);
        for (std::size_t e = 0; e < parameters.size(); ++e) parameters[e] -= gradient[e];
        dense.parameters_updated();
      }
      dense.finish();
      std::vector<std::uint64_t> all_keys;
      for (std::uint64_t k = 1; k <= 50; ++k) all_keys.push_back(k);
      return "ok " + contents(table, all_keys);
    });
    REQUIRE(results.size() == static_cast<std::size_t>(n));
    for (const auto& r : results) {
      CHECK_MESSAGE(r.report.starts_with("ok "), r.report);
      CHECK(r.report == results[0].report);
    }
  }

  TEST_CASE("the dense path gives the sparse path's tables; the cost model goes dense when the rows are not sparse") {
    // Whole-number gradients keep every sum exact, so the ring's summation order (dense) and the
    // machine order (sparse) give the same bits.
    const int machines = 3, local = 2, n = machines * local;
    const std::uint64_t key_space = 64;
    const auto train = [&](sparse::Density density) {
      std::vector<std::string> lines;
      const auto results = run_job(
          machines, local,
          {.key_space = key_space, .density = density, .timeout = 20s, .log = {}},
          [&](int rank, RoutedWorld&, sparse::EmbeddingTable& table, auto& exchange) -> std::string {
            std::mt19937 random(static_cast<unsigned>(rank) + 11u);
            std::string choices;
            for (int step = 0; step < 6; ++step) {
              // Few keys for three steps, then nearly every key: the density changes.
              const std::size_t count = step < 3 ? 3 : 60;
              std::vector<std::uint64_t> keys(count);
              std::vector<float> grads(count * dim);
              for (auto& k : keys) k = random() % key_space;
              for (auto& g : grads) g = static_cast<float>(static_cast<int>(random() % 9) - 4);
              choices += exchange.step(keys, grads).dense ? 'D' : 'S';
            }
            std::vector<std::uint64_t> all(key_space);
            for (std::uint64_t k = 0; k < key_space; ++k) all[k] = k;
            return fmt::format("ok {} {}", rank % local == 0 ? choices : "-", contents(table, all));
          });
      for (const auto& r : results) CHECK_MESSAGE(r.report.starts_with("ok "), r.report);
      return results;
    };
    const auto sparse_run = train(sparse::Density::sparse);
    const auto dense_run = train(sparse::Density::dense);
    const auto automatic = train(sparse::Density::automatic);
    const auto table_of = [](const test::ChildResult& r) { return r.report.substr(r.report.rfind(' ') + 1); };
    for (int rank = 0; rank < n; ++rank) {
      CAPTURE(rank);
      const auto r = static_cast<std::size_t>(rank);
      CHECK(table_of(dense_run[r]) == table_of(sparse_run[r]));
      CHECK(table_of(automatic[r]) == table_of(sparse_run[r]));
      CHECK(table_of(sparse_run[r]) == table_of(sparse_run[0]));
    }
    CHECK(sparse_run[0].report.starts_with("ok SSSSSS "));
    CHECK(dense_run[0].report.starts_with("ok DDDDDD "));
    // 3 keys a trainer: 6 rows of 20 bytes per machine, against 2/3 x 64 x 5 x 4 bytes dense.
    // 60 keys a trainer: nearly all 64 keys on every machine, sparse costs more than dense.
    CHECK_MESSAGE(automatic[0].report.starts_with("ok SSSDDD "), automatic[0].report);
  }

  TEST_CASE("the local ranks must agree on the table: what differs is named") {
    const std::uint16_t port = test::free_port();
    const std::string job = unique_job("mismatch");
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      RoutedWorld world = test::routed_world(rank, 2, 2, port, job);
      sparse::EmbeddingOptions options = table_options();
      if (rank == 1) options.dim = 8;
      sparse::EmbeddingTable table(world.local(), options);
      return "ok";
    });
    CHECK(results[0].ok());
    CHECK_MESSAGE(results[1].report.find("error ranks disagree") == 0, results[1].report);
    CHECK_MESSAGE(results[1].report.find("dim 8 here, 4 on local rank 0") != std::string::npos, results[1].report);
  }

  TEST_CASE("one trainer alone: rows appear on first update, lookups of unknown keys give their initial values, a full table is an Error") {
    transport::SharedMemory shm({.local_rank = 0, .local_size = 1, .job = unique_job("alone"), .token = "t",
                                 .setup_timeout = 20s});
    sparse::EmbeddingOptions options = table_options(sparse::Optimizer::adagrad);
    options.rows = 3;
    options.learning_rate = 0.5f;
    sparse::EmbeddingTable table(shm, options);
    CHECK(table.writer());
    CHECK(table.bytes() > 3 * dim * sizeof(float));
    const std::vector<std::uint64_t> keys{5, 9, 5};
    std::vector<const float*> rows(keys.size());
    table.lookup(keys, rows);
    CHECK(std::memcmp(rows[0], rows[2], dim * sizeof(float)) == 0);  // one key, one initial row
    CHECK(std::memcmp(rows[0], rows[1], dim * sizeof(float)) != 0);
    CHECK(table.find(5) == nullptr);

    // Adagrad, per row: a = mean(g^2) = 4; row -= 0.5 * g / (sqrt(4) + eps).
    const std::vector<std::uint64_t> update{5, 9};
    const std::vector<float> grads(2 * dim, 2.0f);
    table.apply(update, grads);
    CHECK(table.size() == 2);
    float initial[dim];
    table.initial_values(5, initial);
    for (int j = 0; j < dim; ++j) CHECK(table.find(5)[j] == initial[j] - 0.5f / (2.0f + options.epsilon) * 2.0f);

    const std::vector<std::uint64_t> two_more{1, 2};
    CHECK_THROWS_WITH_AS(table.apply(two_more, grads), doctest::Contains("the embedding table is full: all 3 rows"),
                         Error);
    const std::vector<std::uint64_t> reserved{~std::uint64_t{0}};
    CHECK_THROWS_WITH_AS(table.apply(reserved, std::span(grads).first(dim)), doctest::Contains("reserved"), Error);
  }

  TEST_CASE("a checkpoint: save, load into a new table, the same rows and optimizer state; a damaged or mismatched file is refused") {
    const auto path = std::filesystem::temp_directory_path() / fmt::format("{}.gsemb", unique_job("checkpoint"));
    const std::vector<std::uint64_t> keys{3, 1001, 77, 5, 123456789};
    std::mt19937 random(3);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    const auto gradients = [&](std::size_t count) {
      std::vector<float> g(count * dim);
      for (float& v : g) v = normal(random);
      return g;
    };
    const sparse::EmbeddingOptions options = table_options(sparse::Optimizer::adagrad);
    transport::SharedMemory before_shm({.local_rank = 0, .local_size = 1, .job = unique_job("saved"), .token = "t",
                                        .setup_timeout = 20s});
    sparse::EmbeddingTable before(before_shm, options);
    for (int step = 0; step < 4; ++step) {
      const std::span<const std::uint64_t> some = std::span(keys).first(static_cast<std::size_t>(2 + step % 4));
      before.apply(some, gradients(some.size()));
    }
    before.save(path);

    transport::SharedMemory after_shm({.local_rank = 0, .local_size = 1, .job = unique_job("loaded"), .token = "t",
                                       .setup_timeout = 20s});
    sparse::EmbeddingTable after(after_shm, options);
    after.apply(std::span(keys).last(1), gradients(1));  // a row the load replaces
    after.load(path);
    CHECK(after.size() == before.size());
    CHECK(contents(after, keys) == contents(before, keys));
    // The Adagrad accumulators came too: the same update moves both tables alike.
    const std::vector<float> next = gradients(keys.size());
    before.apply(keys, next);
    after.apply(keys, next);
    CHECK(contents(after, keys) == contents(before, keys));

    std::vector<char> bytes;
    {
      std::ifstream file(path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    }
    const auto write = [&](const std::vector<char>& b) {
      std::ofstream file(path, std::ios::binary | std::ios::trunc);
      file.write(b.data(), static_cast<std::streamsize>(b.size()));
    };
    std::vector<char> damaged = bytes;
    damaged[damaged.size() / 2] ^= 1;
    write(damaged);
    CHECK_THROWS_WITH_AS(after.load(path), doctest::Contains("damaged"), Error);
    write(std::vector<char>(bytes.begin(), bytes.begin() + 20));
    CHECK_THROWS_WITH_AS(after.load(path), doctest::Contains("too short"), Error);
    // A file whose SHA-256 holds but which names a key twice (row 1 gets row 0's key) is refused
    // before the table changes.
    std::vector<char> repeated = bytes;
    const std::size_t record = 8 + 4 * dim + 4, digest = 32;
    const std::size_t rows_at = repeated.size() - digest - before.size() * record;
    std::memcpy(repeated.data() + rows_at + record, repeated.data() + rows_at, 8);
    const auto body = std::as_bytes(std::span(repeated).first(repeated.size() - digest));
    const gradsync::detail::Digest resealed = gradsync::detail::sha256(body);
    std::memcpy(repeated.data() + repeated.size() - digest, resealed.data(), digest);
    write(repeated);
    CHECK_THROWS_WITH_AS(after.load(path), doctest::Contains("rows 0 and 1 both have key"), Error);
    CHECK(after.size() == before.size());
    CHECK(contents(after, keys) == contents(before, keys));
    write(bytes);
    sparse::EmbeddingOptions wider = options;
    wider.dim = dim + 1;
    transport::SharedMemory wider_shm({.local_rank = 0, .local_size = 1, .job = unique_job("wider"), .token = "t",
                                       .setup_timeout = 20s});
    sparse::EmbeddingTable other(wider_shm, wider);
    CHECK_THROWS_WITH_AS(other.load(path), doctest::Contains("rows of dim 4; this table's are of dim 5"), Error);
    std::filesystem::remove(path);
  }

  TEST_CASE("a trainer killed mid-step makes the others fail fast, naming it, and leaves nothing in /dev/shm") {
    const int machines = 2, local = 2, n = machines * local;
    const std::uint16_t port = test::free_port();
    const std::string job = unique_job("killed");
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      RoutedWorld world = test::routed_world(rank, local, n, port, job);
      sparse::EmbeddingTable table(world.local(), table_options());
      sparse::SparseExchange<RoutedWorld> exchange(world, Group::world(rank, n), local, table, {.timeout = 30s});
      std::vector<std::uint64_t> keys{1, 2};
      std::vector<float> grads(2 * dim, 1.0f);
      exchange.step(keys, grads);
      if (rank == 3) ::_exit(3);  // dies before the second step
      exchange.step(keys, grads);
      return "finished";
    });
    // Noticed, not waited out: every survivor fails with "peer failed", none with a timeout.
    for (int rank = 0; rank < 3; ++rank) {
      CAPTURE(rank);
      CHECK_MESSAGE(results[static_cast<std::size_t>(rank)].report.find("error peer failed") == 0,
                    results[static_cast<std::size_t>(rank)].report);
    }
    // Rank 2 shares rank 3's machine and waits on it first.
    CHECK_MESSAGE(results[2].report.find("rank 3") != std::string::npos, results[2].report);
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      for (int first : {0, 2}) {
        transport::SharedMemoryOptions o{.local_rank = 0, .local_size = local, .first_rank = first, .job = job};
        CHECK(entry.path().filename().string() != transport::SharedMemory::segment_name(o));
      }
    }
  }
}
