// The hybrid example (examples/hybrid): its convolutions' gradients, hybrid training against one
// process training the whole model on the whole batch, background updates against updates after
// wait(), and a pair partner that dies.

#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "processes.hpp"
#include "support.hpp"
#include "trainer.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t side = 8;

// Learnable 8x8 images: each class a fixed random pattern, each sample its class's pattern plus noise.
fmnist::Dataset patterns(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 gen(seed), fixed(7);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<std::vector<float>> classes(10, std::vector<float>(side * side));
  for (auto& c : classes)
    for (float& v : c) v = unit(fixed) < 0.3f ? 1.0f : 0.0f;
  fmnist::Dataset d{.count = count, .pixels = side * side};
  for (std::size_t s = 0; s < count; ++s) {
    d.labels.push_back(static_cast<std::uint8_t>(s % 10));
    for (float v : classes[s % 10]) d.images.push_back(std::clamp(v + 0.4f * (unit(gen) - 0.5f), 0.0f, 1.0f));
  }
  return d;
}

hybrid::Model small_model() { return hybrid::Model(side, {4}, {16}, 5); }

// Trains a copy of small_model() on each of `ranks` in-process ranks; returns every rank's model.
std::vector<hybrid::Model> trained(int ranks, const hybrid::Config& cfg, const fmnist::Dataset& data) {
  std::vector<hybrid::Model> models(static_cast<std::size_t>(ranks), small_model());
  const auto errors = test::run_ranks(ranks, [&](transport::InProcess& t) {
    hybrid::train(t, models[static_cast<std::size_t>(t.rank())], data, nullptr, cfg);
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  return models;
}

// Every parameter of a and b within float reassociation: |a - b| <= 1e-5 + 1e-4 |b|.
void check_close(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  REQUIRE(a.size() == b.size());
  std::size_t far = 0;
  for (std::size_t i = 0; i < a.size(); ++i) far += std::abs(a[i] - b[i]) > 1e-5f + 1e-4f * std::abs(b[i]);
  CHECK_MESSAGE(far == 0, what, ": ", far, " of ", a.size(), " values differ");
}

}  // namespace

TEST_SUITE("hybrid") {
  TEST_CASE("the convolutions' gradients match finite differences") {
    hybrid::ConvStack stack(2, 4, 4, {{.channels = 3, .pool = false}, {.channels = 2, .pool = true}}, 9);
    const std::size_t batch = 2;
    // Values of one scale, so that a step of h crosses few ReLU kinks or pooling ties.
    std::mt19937_64 gen(3);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<float> x(batch * stack.inputs()), r(batch * stack.features());
    for (float& v : x) v = unit(gen);
    // The loss is sum(features * r), so d(loss)/d(features) = r.
    for (float& v : r) v = unit(gen);
    const auto loss = [&] {
      const float* f = stack.forward(x.data(), batch);
      double sum = 0;
      for (std::size_t i = 0; i < r.size(); ++i) sum += static_cast<double>(f[i]) * r[i];
      return sum;
    };
    loss();
    std::vector<std::size_t> ready;
    stack.backward(r.data(), batch, [&](std::size_t l) { ready.push_back(l); });
    CHECK(ready == std::vector<std::size_t>{1, 0});
    for (hybrid::ConvLayer& L : stack.layers())
      for (auto [p, g] : {std::pair{&L.w, &L.gw}, std::pair{&L.b, &L.gb}})
        for (std::size_t k = 0; k < p->size(); ++k) {
          const float kept = (*p)[k], h = 1e-3f;
          (*p)[k] = kept + h;
          const double up = loss();
          (*p)[k] = kept - h;
          const double down = loss();
          (*p)[k] = kept;
          const double numeric = (up - down) / (2 * h);
          CHECK_MESSAGE(std::abs(numeric - (*g)[k]) <= 2e-2 * (1 + std::abs(numeric)), "parameter ", k, ": numeric ",
                        numeric, ", backward ", (*g)[k]);
        }
  }

  TEST_CASE("hybrid training equals one process training the whole model on the whole batch") {
    const fmnist::Dataset data = patterns(320, 11);
    hybrid::Config cfg{.mode = hybrid::Mode::data_parallel, .batch = 32, .learning_rate = 0.1f, .max_steps = 5};
    const hybrid::Model alone = trained(1, cfg, data)[0];
    const hybrid::Model untrained = small_model();
    REQUIRE(alone.fc.layers()[0].w != untrained.fc.layers()[0].w);  // the steps did something
    for (auto updates : {hybrid::Updates::background, hybrid::Updates::after_wait}) {
      CAPTURE(static_cast<int>(updates));
      cfg.updates = updates;
      for (auto [mode, ranks] : {std::pair{hybrid::Mode::hybrid, 4}, std::pair{hybrid::Mode::hybrid, 2},
                                 std::pair{hybrid::Mode::data_parallel, 4}}) {
        CAPTURE(static_cast<int>(mode));
        CAPTURE(ranks);
        cfg.mode = mode;
        const std::vector<hybrid::Model> models = trained(ranks, cfg, data);
        for (int r = 0; r < ranks; ++r) {
          const hybrid::Role role = hybrid::Role::of(mode, r, ranks);
          const hybrid::Model& m = models[static_cast<std::size_t>(r)];
          for (std::size_t l = 0; role.conv && l < m.conv.layers().size(); ++l) {
            check_close(m.conv.layers()[l].w, alone.conv.layers()[l].w, fmt::format("rank {} conv{}.weight", r, l + 1));
            check_close(m.conv.layers()[l].b, alone.conv.layers()[l].b, fmt::format("rank {} conv{}.bias", r, l + 1));
          }
          for (std::size_t l = 0; role.fc && l < m.fc.layers().size(); ++l) {
            check_close(m.fc.layers()[l].w, alone.fc.layers()[l].w, fmt::format("rank {} fc{}.weight", r, l + 1));
            check_close(m.fc.layers()[l].b, alone.fc.layers()[l].b, fmt::format("rank {} fc{}.bias", r, l + 1));
          }
          // The ranks of one ring hold the same bits.
          const hybrid::Model& first = models[static_cast<std::size_t>(role.group.members[0])];
          for (std::size_t l = 0; role.conv && l < m.conv.layers().size(); ++l)
            CHECK(m.conv.layers()[l].w == first.conv.layers()[l].w);
          for (std::size_t l = 0; role.fc && l < m.fc.layers().size(); ++l)
            CHECK(m.fc.layers()[l].w == first.fc.layers()[l].w);
        }
      }
    }
  }

  TEST_CASE("background updates give the parameters of updates after wait(), bit for bit") {
    const fmnist::Dataset data = patterns(320, 12);
    hybrid::Config cfg{.mode = hybrid::Mode::hybrid, .updates = hybrid::Updates::after_wait, .batch = 32,
                       .max_steps = 6};
    const auto after_wait = trained(4, cfg, data);
    cfg.updates = hybrid::Updates::background;
    const auto background = trained(4, cfg, data);
    for (std::size_t r = 0; r < 4; ++r) {
      for (std::size_t l = 0; l < after_wait[r].conv.layers().size(); ++l) {
        CHECK(background[r].conv.layers()[l].w == after_wait[r].conv.layers()[l].w);
        CHECK(background[r].conv.layers()[l].vb == after_wait[r].conv.layers()[l].vb);
      }
      for (std::size_t l = 0; l < after_wait[r].fc.layers().size(); ++l) {
        CHECK(background[r].fc.layers()[l].w == after_wait[r].fc.layers()[l].w);
        CHECK(background[r].fc.layers()[l].vb == after_wait[r].fc.layers()[l].vb);
      }
    }
  }

  TEST_CASE("a dead pair partner fails both rings fast, with an Error naming it") {
    // Four processes over TCP: conv ring {0, 1}, fc ring {2, 3}, pairs 0-2 and 1-3. Rank 2 dies
    // after its second step; the others must fail with peer_failed (a timeout would mean they
    // waited out the 60 s instead of failing fast) and a message that names rank 2.
    const fmnist::Dataset data = patterns(640, 13);
    const std::uint16_t port = test::free_port();
    const hybrid::Config cfg{.mode = hybrid::Mode::hybrid, .batch = 16, .timeout = 60s};
    const auto results = test::run_processes(4, [&](int rank) -> std::string {
      transport::Tcp world(transport::TcpOptions{.rank = rank, .world_size = 4, .master_port = port, .token = "t",
                                                 .setup_timeout = 20s});
      hybrid::Model model = small_model();
      hybrid::train(world, model, data, nullptr, cfg, [&](int, std::size_t step, std::size_t, double, double) {
        if (rank == 2 && step == 2) ::_exit(3);
      });
      return "finished training";
    });
    CHECK(WIFEXITED(results[2].status));
    CHECK(WEXITSTATUS(results[2].status) == 3);
    for (int r : {0, 1, 3}) {
      const std::string& report = results[static_cast<std::size_t>(r)].report;
      CAPTURE(r);
      CAPTURE(report);
      CHECK(report.starts_with("error peer failed"));
      // Told by rank 2's own connections, or by a rank that stopped because of it.
      CHECK((report.find("peer 2") != std::string::npos || report.find("rank 2 failed first") != std::string::npos));
    }
  }
}
