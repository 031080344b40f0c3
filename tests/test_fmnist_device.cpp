// fmnist's model on a GPU (examples/fmnist/device_mlp.hpp): alone it takes the CPU model's steps,
// and two ranks whose gradients go to the Synchronizer from the backward pass on the device
// (CudaStaged) take the steps of one CPU rank with their batches together. Skipped where there
// is no CUDA device; tools/device-check runs it on GPU machines.

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "cuda_probe.hpp"
#include "device_mlp.hpp"
#include "fmnist_data.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/cuda_staged.hpp"
#include "gradsync/transport/in_process.hpp"
#include "support.hpp"
#include "trainer.hpp"

using namespace gradsync;

namespace {

const bool no_device = test::no_cuda_device("the GPU model's tests are");

using HostSync = Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, transport::InProcess>;
using Staged = transport::CudaStaged<transport::InProcess>;
using DeviceSync = Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, Staged>;

const std::vector<std::size_t> sizes{64, 32, 10};
constexpr std::uint64_t model_seed = 11;

fmnist::TrainConfig config(std::size_t batch) {
  return {.epochs = 1, .batch = batch, .learning_rate = 0.05f, .seed = 3, .max_steps = 6};
}

// One CPU rank trained with batch 32.
fmnist::Mlp trained_on_the_cpu(const fmnist::Dataset& data) {
  fmnist::Mlp model(sizes, model_seed);
  auto world = transport::InProcess::create_world(1);
  HostSync sync(std::move(world[0]));
  fmnist::train(sync, model, data, nullptr, config(32));
  return model;
}

// The GPU's products sum in another order than Eigen's: |a - b| <= 1e-5 + 1e-4 |a| after 6 steps,
// the bound test_fmnist allows between N ranks and one.
void require_close(const fmnist::Mlp& cpu, const fmnist::Mlp& gpu) {
  const fmnist::Mlp untrained(sizes, model_seed);
  for (std::size_t l = 0; l < cpu.layers().size(); ++l) {
    const auto& a = cpu.layers()[l];
    const auto& b = gpu.layers()[l];
    for (std::size_t k = 0; k < a.w.size(); ++k) REQUIRE(std::fabs(a.w[k] - b.w[k]) <= 1e-5f + 1e-4f * std::fabs(a.w[k]));
    for (std::size_t k = 0; k < a.b.size(); ++k) REQUIRE(std::fabs(a.b[k] - b.b[k]) <= 1e-5f + 1e-4f * std::fabs(a.b[k]));
    CHECK(b.w != untrained.layers()[l].w);  // the steps really moved the weights
  }
}

}  // namespace

TEST_SUITE("fmnist") {
  TEST_CASE("the model on the GPU takes the CPU model's steps" * doctest::skip(no_device)) {
    const fmnist::Dataset data = test::synthetic(640, 5);
    const fmnist::Mlp cpu = trained_on_the_cpu(data);
    fmnist::Mlp gpu(sizes, model_seed);
    {
      fmnist::DeviceMlp on_device(gpu, 0);
      auto world = transport::InProcess::create_world(1);
      DeviceSync sync(Staged(std::move(world[0]), 0));
      fmnist::train(sync, on_device, data, nullptr, config(32));
      on_device.copy_parameters_to(gpu);
      fmnist::Mlp evaluated = cpu;
      const auto right_on_device = on_device.correct(data.images.data(), data.labels.data(), data.count);
      const auto right_on_cpu = evaluated.correct(data.images.data(), data.labels.data(), data.count);
      CHECK(right_on_device + 2 >= right_on_cpu);
      CHECK(right_on_cpu + 2 >= right_on_device);
    }
    require_close(cpu, gpu);
  }

  TEST_CASE("2 ranks on the GPU, their gradients averaged from the backward pass, take one CPU rank's steps" *
            doctest::skip(no_device)) {
    const fmnist::Dataset data = test::synthetic(640, 5);
    const fmnist::Mlp cpu = trained_on_the_cpu(data);
    std::vector<fmnist::Mlp> gpu(2, fmnist::Mlp(sizes, model_seed));
    const auto errors = test::run_ranks(2, [&](transport::InProcess& t) {
      const int r = t.rank();
      fmnist::DeviceMlp on_device(gpu[static_cast<std::size_t>(r)], 0);
      DeviceSync sync(Staged(std::move(t), 0), {.executor = Executor::task_graph});
      fmnist::train(sync, on_device, data, nullptr, config(16));
      on_device.copy_parameters_to(gpu[static_cast<std::size_t>(r)]);
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    for (std::size_t l = 0; l < cpu.layers().size(); ++l) CHECK(gpu[0].layers()[l].w == gpu[1].layers()[l].w);
    require_close(cpu, gpu[0]);
  }
}
