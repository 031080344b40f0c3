// gradsync::libtorch::AutogradHooks on the LibTorch trainer's CNN (examples/libtorch): two ranks'
// data-parallel steps, each on half the batch, equal one process's steps on the whole batch; the
// same hooks driving the asynchronous parameter server; a parameter autograd never reaches is
// named by wait(); tied weights, a parameter hooked twice, a replaced .grad; parameters the hooks
// cannot serve are refused by name.

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "gradsync/async/synchronizer.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/libtorch.hpp"
#include "model.hpp"
#include "support.hpp"

using namespace gradsync;
using libtorch_fmnist::Net;

namespace {

constexpr double learning_rate = 0.05, momentum = 0.5;

Net seeded_net() {
  torch::manual_seed(3);  // torch's generator is global: build the nets one after another
  return Net();
}

// The largest difference between two models' parameters, relative to the parameter's size.
double largest_difference(Net& a, Net& b) {
  double worst = 0;
  const auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const double scale = pa[i].abs().max().item<double>() + 1e-6;
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

bool bit_identical(Net& a, Net& b) {
  const auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (!torch::equal(pa[i], pb[i])) return false;
  return true;
}

}  // namespace

TEST_SUITE("libtorch") {
  TEST_CASE("two ranks on half a batch each take the steps of one process on the whole batch") {
    torch::set_num_threads(1);
    constexpr int ranks = 2, steps = 4;
    constexpr std::int64_t batch = 16, half = batch / ranks;
    std::vector<torch::Tensor> images, labels;
    torch::manual_seed(11);
    for (int s = 0; s < steps; ++s) {
      images.push_back(torch::rand({batch, 1, 28, 28}));
      labels.push_back(torch::randint(0, 10, {batch}, torch::kLong));
    }

    Net whole = seeded_net();
    torch::optim::SGD whole_optimizer(whole->parameters(), torch::optim::SGDOptions(learning_rate).momentum(momentum));
    for (int s = 0; s < steps; ++s) {
      whole_optimizer.zero_grad();
      torch::nn::functional::cross_entropy(whole->forward(images[s]), labels[s]).backward();
      whole_optimizer.step();
    }

    std::vector<Net> nets;
    for (int r = 0; r < ranks; ++r) nets.push_back(seeded_net());
    const auto errors = test::run_ranks(ranks, [&](transport::InProcess& t) {
      const int rank = t.rank();
      Net& net = nets[static_cast<std::size_t>(rank)];
      Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, transport::InProcess> sync(
          std::move(t), {.timeout = std::chrono::seconds(20)}, bucketing::FixedSize{.cap_bytes = 256 << 10, .first_cap_bytes = 64 << 10});
      libtorch::AutogradHooks hooks(sync, net->named_parameters());
      CHECK(hooks.size() == net->parameters().size());
      torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(learning_rate).momentum(momentum));
      for (int s = 0; s < steps; ++s) {
        hooks.zero();
        const auto mine = torch::indexing::Slice(rank * half, (rank + 1) * half);
        torch::nn::functional::cross_entropy(net->forward(images[s].index({mine})), labels[s].index({mine})).backward();
        sync.wait();
        optimizer.step();
      }
    });
    for (const auto& e : errors) REQUIRE_MESSAGE(!e, (e ? e->what() : ""));
    CHECK(bit_identical(nets[0], nets[1]));  // the same average on every rank
    const double difference = largest_difference(nets[0], whole);
    MESSAGE("largest relative difference from one process on the whole batch: " << difference);
    CHECK(difference < 1e-5);  // float sums in another order, no more
    Net initial = seeded_net();
    CHECK(largest_difference(nets[0], initial) > 1e-3);  // and the steps did move the model
  }

  TEST_CASE("the hooks drive the asynchronous parameter server: at staleness 0 it takes the synchronous "
            "server's steps, bit for bit") {
    torch::set_num_threads(1);
    constexpr int ranks = 2, steps = 3;
    constexpr std::int64_t half = 8;
    std::vector<torch::Tensor> images, labels;
    torch::manual_seed(12);
    for (int s = 0; s < steps; ++s) {
      images.push_back(torch::rand({ranks * half, 1, 28, 28}));
      labels.push_back(torch::randint(0, 10, {ranks * half}, torch::kLong));
    }
    const auto train = [&](auto make_synchronizer, std::vector<Net>& nets) {
      for (int r = 0; r < ranks; ++r) nets.push_back(seeded_net());
      const auto errors = test::run_ranks(ranks, [&](transport::InProcess& t) {
        const int rank = t.rank();
        Net& net = nets[static_cast<std::size_t>(rank)];
        auto sync = make_synchronizer(std::move(t));
        libtorch::AutogradHooks hooks(*sync, net->named_parameters());
        torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(learning_rate).momentum(momentum));
        for (int s = 0; s < steps; ++s) {
          hooks.zero();
          const auto mine = torch::indexing::Slice(rank * half, (rank + 1) * half);
          torch::nn::functional::cross_entropy(net->forward(images[s].index({mine})), labels[s].index({mine})).backward();
          sync->wait();
          optimizer.step();
        }
      });
      for (const auto& e : errors) REQUIRE_MESSAGE(!e, (e ? e->what() : ""));
    };
    const std::chrono::seconds timeout(20);
    std::vector<Net> synchronous, asynchronous;
    train([&](transport::InProcess t) {
      return std::make_unique<Synchronizer<bucketing::PerTensor, compression::None, topology::ParameterServer, transport::InProcess>>(
          std::move(t), Options{.timeout = timeout});
    }, synchronous);
    train([&](transport::InProcess t) {
      return std::make_unique<async::Synchronizer<bucketing::FixedSize, compression::None, transport::InProcess>>(
          std::move(t), async::Options{.staleness = 0, .timeout = timeout});
    }, asynchronous);
    for (int r = 0; r < ranks; ++r) CHECK(bit_identical(asynchronous[static_cast<std::size_t>(r)], synchronous[0]));
  }

  TEST_CASE("a parameter autograd never reaches is named by wait()") {
    torch::set_num_threads(1);
    auto world = transport::InProcess::create_world(1);
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> sync(
        std::move(world[0]), {.timeout = std::chrono::seconds(5)});
    torch::nn::Linear used(4, 2), unused(4, 2);
    torch::OrderedDict<std::string, torch::Tensor> parameters;
    for (const auto& p : used->named_parameters()) parameters.insert("used." + p.key(), p.value());
    for (const auto& p : unused->named_parameters()) parameters.insert("unused." + p.key(), p.value());
    libtorch::AutogradHooks hooks(sync, parameters);
    hooks.zero();
    used->forward(torch::ones({3, 4})).sum().backward();
    CHECK_THROWS_WITH_AS(sync.wait(), doctest::Contains("\"unused.weight\""), Error);
  }

  TEST_CASE("tied weights are registered once, a parameter hooked twice is refused, and the hooks go with "
            "their object") {
    auto world = transport::InProcess::create_world(1);
    auto other = transport::InProcess::create_world(1);
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> sync(
        std::move(world[0]), {.timeout = std::chrono::seconds(5)});
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> second(
        std::move(other[0]), {.timeout = std::chrono::seconds(5)});
    torch::nn::Linear layer(4, 2);
    torch::OrderedDict<std::string, torch::Tensor> tied;
    tied.insert("encoder.weight", layer->weight);
    tied.insert("decoder.weight", layer->weight);  // the same tensor under another name
    tied.insert("bias", layer->bias);
    {
      libtorch::AutogradHooks hooks(sync, tied);
      CHECK(hooks.size() == 2);
      CHECK(sync.layout().size() == 2);
      CHECK_THROWS_WITH_AS(libtorch::AutogradHooks(second, tied), doctest::Contains("already registered"), Error);
      hooks.zero();
      layer->forward(torch::ones({3, 4})).sum().backward();
      sync.wait();  // both marked ready by autograd, once each
    }
    libtorch::AutogradHooks again(second, tied);  // the first object's hooks are gone
    again.zero();
    layer->forward(torch::ones({3, 4})).sum().backward();
    second.wait();
  }

  TEST_CASE("a .grad replaced behind the hooks' back is named, not synchronized") {
    auto world = transport::InProcess::create_world(1);
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> sync(
        std::move(world[0]), {.timeout = std::chrono::seconds(5)});
    torch::nn::Linear layer(4, 2);
    libtorch::AutogradHooks hooks(sync, layer->named_parameters());
    layer->weight.mutable_grad() = torch::zeros_like(layer->weight);  // what zero_grad(set_to_none) leads to
    CHECK_THROWS_WITH(layer->forward(torch::ones({3, 4})).sum().backward(), doctest::Contains("\"weight\""));
  }

  TEST_CASE("parameters the hooks cannot serve are refused by name") {
    auto world = transport::InProcess::create_world(1);
    Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, transport::InProcess> sync(
        std::move(world[0]));
    torch::OrderedDict<std::string, torch::Tensor> frozen;
    frozen.insert("frozen", torch::zeros({3}));
    CHECK_THROWS_WITH_AS(libtorch::AutogradHooks(sync, frozen), doctest::Contains("\"frozen\""), Error);
    torch::OrderedDict<std::string, torch::Tensor> transposed;
    transposed.insert("transposed", torch::zeros({3, 4}).t().requires_grad_());
    CHECK_THROWS_WITH_AS(libtorch::AutogradHooks(sync, transposed), doctest::Contains("not contiguous"), Error);
  }
}
