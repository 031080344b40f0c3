// Two in-process ranks average gradients through the installed headers and library, built the
// way the README shows: Options, policies and a configured codec given as designated initializers.
// Compiled with -Wall -Wextra -Wpedantic -Werror, as a subproject and with only pkg-config's flags.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <span>
#include <thread>
#include <vector>

#include <gradsync/gradsync.hpp>

namespace gs = gradsync;

// Each rank's gradients after one synchronization with a Synchronizer of type Sync.
template <class Sync>
std::vector<std::vector<float>> averaged(std::vector<std::vector<float>> grads, typename Sync::Compression codec) {
  auto world = gs::transport::InProcess::create_world(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      Sync sync(std::move(world[static_cast<std::size_t>(r)]), {.timeout = std::chrono::seconds(60)},
                gs::bucketing::FixedSize{.cap_bytes = 25 << 20, .first_cap_bytes = 1 << 20}, codec,
                gs::topology::Ring{.chunk_elements = 2});
      sync.add("w", gs::view(grads[static_cast<std::size_t>(r)]));
      sync.ready(0);
      sync.wait();
    });
  for (auto& t : ranks) t.join();
  return grads;
}

// Never called: compiling it instantiates the other policies, so warnings in their templates
// show here too.
void every_other_policy() {
  using Sync = gs::Synchronizer<gs::bucketing::TimeClustered, gs::compression::ErrorFeedback<gs::compression::TopK>,
                                gs::topology::ParameterServer, gs::transport::Tcp>;
  std::vector<double> grad(10);
  Sync sync(gs::transport::Tcp::from_env(), {.selective_compression = true, .coordination = {.enabled = true}},
            {.profile_iterations = 3}, {.codec = {.keep = {.fraction = 0.1}}}, {.servers = 1, .dedicated = true});
  sync.add("w", gs::view(std::span<double>(grad)));
  sync.ready(0);
  sync.wait();
  using Others = gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::TernGrad<2>, gs::topology::Ring,
                                  gs::transport::InProcess>;
  using RandomK = gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::ErrorFeedback<gs::compression::RandomK>,
                                   gs::topology::Ring, gs::transport::InProcess>;
  auto world = gs::transport::InProcess::create_world(3);
  Others others(std::move(world[0]), {.executor = gs::Executor::serial});
  RandomK random_k(std::move(world[1]));
  gs::Synchronizer<gs::bucketing::PerTensor, gs::compression::OneBit, gs::topology::Ring, gs::transport::InProcess>
      one_bit(std::move(world[2]));
  std::vector<std::uint16_t> half(4);
  others.add("h", gs::view(std::span<std::uint16_t>(half), gs::DType::f16));
  others.wait();
  random_k.wait();
  one_bit.wait();
  std::vector<std::uint16_t> bf(4);
  gs::Synchronizer<gs::bucketing::FixedSize, gs::compression::Bf16, gs::topology::Ring, gs::transport::InProcess> b(
      gs::transport::InProcess::create_world(1)[0]);
  b.add("b", gs::view(std::span<std::uint16_t>(bf), gs::DType::bf16));
  b.wait();
}

int main() {
  using Plain = gs::Synchronizer<gs::bucketing::FixedSize, gs::compression::None, gs::topology::Ring,
                                 gs::transport::InProcess>;
  using TwoBit = gs::compression::ErrorFeedback<gs::compression::TwoBit>;
  using Compressed = gs::Synchronizer<gs::bucketing::FixedSize, TwoBit, gs::topology::Ring, gs::transport::InProcess>;
  const auto plain = averaged<Plain>({{1, 2, 3}, {3, 4, 5}}, {});
  // Values on the codec's grid (+-threshold, 0) and averages that are too: exact.
  const auto compressed = averaged<Compressed>({{1, -1, 1}, {1, 1, -1}}, TwoBit{.codec = {.threshold = 1.0f}});
  std::printf("gradsync %s: %g %g %g, two-bit %g %g %g\n", GRADSYNC_VERSION, plain[0][0], plain[0][1], plain[0][2],
              compressed[0][0], compressed[0][1], compressed[0][2]);
  const bool same = plain[1] == plain[0] && compressed[1] == compressed[0];
  return same && plain[0] == std::vector<float>{2, 3, 4} && compressed[0] == std::vector<float>{1, 0, 0} ? 0 : 1;
}
