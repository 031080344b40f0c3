// topology::Ring run by engine::BucketExchange over real in-process ranks: schedules pair up,
// every rank ends bit-identical, and the result equals a reference summed in the ring's order.

#include <doctest/doctest.h>

#include <map>
#include <tuple>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/engine/serial_executor.hpp"
#include "gradsync/topology/ring.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

template <class C>
void check_ring(int n, std::size_t elements, std::size_t chunk) {
  CAPTURE(n);
  CAPTURE(elements);
  CAPTURE(chunk);
  const C codec;
  const topology::Ring ring{.chunk_elements = chunk};
  std::vector<std::vector<float>> inputs, outputs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(elements, 1000u * static_cast<unsigned>(r) + elements));
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const Group group = Group::world(t.rank(), n);
    engine::BucketExchange<C, transport::InProcess> exchange(
        ring.schedule(group, elements, codec_traits<C>()), codec, DType::f32);
    auto& values = outputs[static_cast<std::size_t>(t.rank())];
    for (int iteration = 0; iteration < 2; ++iteration) {  // the same exchange runs again
      values = inputs[static_cast<std::size_t>(t.rank())];
      exchange.run(std::span<float>(values), codec, t, {group, static_cast<std::uint64_t>(iteration), 0, 10s});
    }
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  const auto reference = test::ring_reference(codec, inputs);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    if (elements > 0)
      REQUIRE(std::memcmp(outputs[static_cast<std::size_t>(r)].data(), reference.data(), elements * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_SUITE("topology") {
  TEST_CASE("every ring send meets exactly one receive of the same size") {
    for (int n : {1, 2, 3, 5, 8}) {
      for (std::size_t elements : {0u, 1u, 4u, 17u, 1000u}) {
        for (bool identity : {true, false}) {
          // (sender, receiver, message) -> elements
          std::map<std::tuple<int, int, std::uint32_t>, std::size_t> sends, recvs;
          for (int r = 0; r < n; ++r) {
            const Schedule s = topology::Ring{.chunk_elements = 3}.schedule(Group::world(r, n), elements, {identity, false});
            for (const Step& step : s.steps) {
              if (step.op == Step::Op::send) CHECK(sends.emplace(std::tuple{r, step.peer, step.message}, step.range.size()).second);
              if (step.op == Step::Op::recv) CHECK(recvs.emplace(std::tuple{step.peer, r, step.message}, step.range.size()).second);
              if (step.slot != no_slot) CHECK(s.slot_elements[step.slot] == step.range.size());
            }
          }
          CHECK(sends == recvs);
          CHECK(sends.empty() == (n == 1 || elements == 0));
        }
      }
    }
  }

  TEST_CASE("ring allreduce with None matches the reference bit for bit") {
    for (int n : {1, 2, 3, 4, 7, 8})
      for (std::size_t elements : {0u, 1u, 2u, 7u, 13u, 97u, 1009u})
        for (std::size_t chunk : {3u, 1u << 18}) check_ring<compression::None>(n, elements, chunk);
  }

  TEST_CASE_TEMPLATE("ring allreduce with a 16-bit codec: identical on all ranks, equal to the reference", C,
                     compression::Fp16, compression::Bf16) {
    for (int n : {1, 2, 3, 5, 8})
      for (std::size_t elements : {1u, 13u, 1009u}) check_ring<C>(n, elements, 5);
  }
}
