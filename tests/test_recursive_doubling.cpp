// topology::RecursiveDoubling and topology::Auto: schedules that pair up, every rank the same bits
// as a reference written out by hand, at every group size from 1 to 17 (powers of two and the
// folded sizes between) with every codec family; Auto's choice, and the link it is measured over
// agreed by every rank.

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/random_k.hpp"
#include "gradsync/compression/terngrad.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/engine/cost_model.hpp"
#include "gradsync/engine/dependencies.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/topology/auto.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

// The butterfly written out (recursive_doubling.hpp): the first 2r ranks fold pairwise (even into
// odd, through the codec), participants exchange with the partner at distance 2^k, each pair
// computing decode(encode(lower)) + decode(encode(higher)), the sum is divided by n, and folded
// ranks copy their partner's result. Every encode has its codec state per (rank, site) for as long
// as the reference lives, as the exchange's encode steps keep theirs across iterations.
template <class C>
class Butterfly {
 public:
  Butterfly(const C& codec, int n) : codec_(codec), n_(n) {}

  std::vector<std::vector<float>> allreduce(std::vector<std::vector<float>> values) {
    if (n_ == 1) return values;
    const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n_))), folded = n_ - p;
    const std::size_t elements = values[0].size();
    const auto rank_of = [&](int v) { return v < folded ? 2 * v + 1 : v + folded; };
    for (int i = 0; i < folded; ++i) round_trip(2 * i, 0, values[static_cast<std::size_t>(2 * i)], values[static_cast<std::size_t>(2 * i + 1)], DecodeMode::add);
    for (int k = 0; (1 << k) < p; ++k)
      for (int v = 0; v < p; ++v) {
        const int w = v ^ (1 << k);
        if (w < v) continue;
        const int low = rank_of(v), high = rank_of(w);
        std::vector<float> sum(elements);
        round_trip(low, 1 + k, values[static_cast<std::size_t>(low)], sum, DecodeMode::overwrite);
        round_trip(high, 1 + k, values[static_cast<std::size_t>(high)], sum, DecodeMode::add);
        values[static_cast<std::size_t>(low)] = values[static_cast<std::size_t>(high)] = sum;
      }
    for (int v = 0; v < p; ++v)
      for (float& x : values[static_cast<std::size_t>(rank_of(v))]) x /= static_cast<float>(n_);
    for (int i = 0; i < folded; ++i) values[static_cast<std::size_t>(2 * i)] = values[static_cast<std::size_t>(2 * i + 1)];
    return values;
  }

 private:
  // decode(encode(from)) into `to`, with the state of encode site `site` of `rank`.
  void round_trip(int rank, int site, const std::vector<float>& from, std::vector<float>& to, DecodeMode mode) {
    auto [it, fresh] = states_.try_emplace({rank, site});
    if (fresh) it->second = codec_.make_state(from.size(), DType::f32);
    std::vector<std::byte> bytes(codec_.max_encoded_bytes(from.size(), DType::f32));
    const std::size_t used = codec_.encode(std::span<const float>(from), it->second, bytes);
    codec_.decode(std::span<const std::byte>(bytes.data(), used), std::span<float>(to), mode);
  }

  C codec_;
  int n_;
  std::map<std::pair<int, int>, typename C::State> states_;
};

// Runs `topology` on in-process ranks, `iterations` times, serially; every rank's values after
// each iteration.
template <class C, class Topology>
std::vector<std::vector<std::vector<float>>> run(const C& codec, const Topology& topology,
                                                 const std::vector<std::vector<std::vector<float>>>& inputs) {
  const int n = static_cast<int>(inputs[0].size());
  auto outputs = inputs;
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const Group group = Group::world(t.rank(), n);
    const auto r = static_cast<std::size_t>(t.rank());
    engine::BucketExchange<C, transport::InProcess> exchange(
        topology.schedule(group, inputs[0][0].size(), codec_traits<C>()), codec, DType::f32);
    for (std::size_t it = 0; it < inputs.size(); ++it)
      exchange.run(std::span<float>(outputs[it][r]), codec, t, {group, it, 0, 10s});
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  return outputs;
}

template <class C>
void check_against_reference(const C& codec) {
  for (int n = 1; n <= 17; ++n)
    for (std::size_t elements : {1u, 7u, 1000u}) {
      CAPTURE(n);
      CAPTURE(elements);
      std::vector<std::vector<std::vector<float>>> inputs(3);
      for (std::size_t it = 0; it < inputs.size(); ++it)
        for (int r = 0; r < n; ++r)
          inputs[it].push_back(test::random_values(elements, 977u * it + 31u * static_cast<unsigned>(r) + elements));
      const auto outputs = run(codec, topology::RecursiveDoubling{}, inputs);
      Butterfly<C> reference(codec, n);
      for (std::size_t it = 0; it < inputs.size(); ++it) {
        CAPTURE(it);
        const auto expected = reference.allreduce(inputs[it]);
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          REQUIRE(std::memcmp(outputs[it][static_cast<std::size_t>(r)].data(), expected[static_cast<std::size_t>(r)].data(),
                              elements * sizeof(float)) == 0);
          REQUIRE(std::memcmp(outputs[it][static_cast<std::size_t>(r)].data(), outputs[it][0].data(),
                              elements * sizeof(float)) == 0);
        }
        if constexpr (C::identity)
          for (std::size_t e = 0; e < elements; ++e) {
            double exact = 0, scale = 0;
            for (const auto& in : inputs[it]) exact += in[e], scale += std::fabs(in[e]);
            REQUIRE(std::fabs(outputs[it][0][e] - exact / n) <= 1e-6 * scale / n);
          }
      }
    }
}

}  // namespace

TEST_SUITE("recursive doubling") {
  TEST_CASE_TEMPLATE("every rank ends with the reference's bits, at 1 to 17 ranks, with every codec family", C,
                     compression::None, compression::Fp16, compression::Bf16, compression::TwoBit, compression::OneBit,
                     compression::TernGrad<2>, compression::TopK, compression::RandomK,
                     compression::ErrorFeedback<compression::TwoBit>, compression::ErrorFeedback<compression::TopK>) {
    check_against_reference(C{});
  }

  TEST_CASE("log2(n) rounds, two more where n is not a power of two; sends pair with receives of the same size") {
    CHECK(topology::RecursiveDoubling::dependent_steps(1) == 0);
    CHECK(topology::RecursiveDoubling::dependent_steps(2) == 1);
    CHECK(topology::RecursiveDoubling::dependent_steps(3) == 3);
    CHECK(topology::RecursiveDoubling::dependent_steps(64) == 6);
    CHECK(topology::RecursiveDoubling::dependent_steps(100) == 8);
    for (int n = 1; n <= 17; ++n)
      for (std::size_t elements : {0u, 1u, 300u})
        for (bool identity : {true, false})
          for (bool receives_at_use : {false, true}) {
            CAPTURE(n);
            CAPTURE(elements);
            CAPTURE(identity);
            std::map<std::tuple<int, int, std::uint32_t>, std::size_t> sends, recvs;
            std::set<int> peers_of_zero;
            for (int r = 0; r < n; ++r) {
              const Schedule s = topology::RecursiveDoubling{}.schedule(Group::world(r, n), elements,
                                                                        {.identity = identity, .receives_at_use = receives_at_use});
              CHECK(s.contributors == n);
              for (const Step& step : s.steps) {
                if (step.op == Step::Op::send) CHECK(sends.emplace(std::tuple{r, step.peer, step.message}, step.range.size()).second);
                if (step.op == Step::Op::recv) CHECK(recvs.emplace(std::tuple{step.peer, r, step.message}, step.range.size()).second);
                if (r == 0 && engine::is_transfer(step.op)) peers_of_zero.insert(step.peer);
                if (step.slot != no_slot) CHECK(s.slot_elements[step.slot] == step.range.size());
              }
            }
            CHECK(sends == recvs);
            CHECK(sends.empty() == (n == 1 || elements == 0));
            // A rank talks to at most log2(n) + 1 peers: what it needs connections to.
            if (elements > 0) CHECK(peers_of_zero.size() <= static_cast<std::size_t>(std::bit_width(static_cast<unsigned>(n))));
          }
  }

  TEST_CASE("the task graph's dependencies order what list order relies on") {
    for (int n : {2, 3, 5, 6, 8})
      for (bool identity : {true, false})
        for (int rank = 0; rank < n; ++rank) {
          CAPTURE(n);
          CAPTURE(rank);
          const Schedule schedule = topology::RecursiveDoubling{}.schedule(Group::world(rank, n), 17, {.identity = identity});
          const auto graph = engine::dependencies_of(schedule);
          // Closure of the graph; every `after` and every write over memory another step touches
          // earlier must be reachable.
          const std::size_t m = schedule.steps.size();
          std::vector<std::vector<bool>> reaches(m, std::vector<bool>(m));
          for (std::size_t i = m; i-- > 0;)
            for (std::uint32_t e = graph.first[i]; e < graph.first[i + 1]; ++e) {
              const std::uint32_t next = graph.successors[e];
              reaches[i][next] = true;
              for (std::size_t k = 0; k < m; ++k)
                if (reaches[next][k]) reaches[i][k] = true;
            }
          for (std::size_t j = 0; j < m; ++j)
            for (std::size_t i = 0; i < j; ++i) {
              const Step &a = schedule.steps[i], &b = schedule.steps[j];
              const auto x = engine::access_of(a), y = engine::access_of(b);
              const bool values = (x.reads_values || x.writes_values) && (y.reads_values || y.writes_values) &&
                                  (x.writes_values || y.writes_values);
              const bool slot = a.slot != no_slot && a.slot == b.slot && (x.writes_slot || y.writes_slot);
              if (b.after == i || values || slot) {
                CAPTURE(i);
                CAPTURE(j);
                CHECK(reaches[i][j]);
              }
            }
        }
  }

  TEST_CASE("Auto takes the butterfly for small buckets and the ring for large ones, by the link") {
    const topology::Auto<> chooser{.link = {.latency = 50e-6, .seconds_per_byte = 1.0 / 1.25e9}, .measure_link = false};
    for (int n : {4, 16, 64, 256}) {
      CAPTURE(n);
      const Group group = Group::world(0, n);
      CHECK(chooser.takes_small(group, 1024));         // 4 KiB
      CHECK_FALSE(chooser.takes_small(group, 16u << 20));  // 64 MiB
      // One crossing: once the ring wins, it wins at every larger size.
      bool ring = false;
      for (std::size_t e = 1; e <= (std::size_t{1} << 26); e *= 2) {
        if (ring) CHECK_FALSE(chooser.takes_small(group, e));
        ring = ring || !chooser.takes_small(group, e);
      }
      const Schedule small = chooser.schedule(group, 1024, {});
      CHECK(small.steps.size() == topology::RecursiveDoubling{}.schedule(group, 1024, {}).steps.size());
    }
    // The latency decides: on a link with no latency the ring's bandwidth wins at every size.
    const topology::Auto<> no_latency{.link = {.latency = 0, .seconds_per_byte = 1e-9}, .measure_link = false};
    CHECK_FALSE(no_latency.takes_small(Group::world(0, 8), 1024));
    CHECK(chooser.describe().find("link 50.0 us + 1.250 GB/s") != std::string::npos);
  }

  TEST_CASE("the link is measured on every rank and every rank gets the same figures") {
    for (int n : {2, 3, 5}) {
      CAPTURE(n);
      std::vector<LinkModel> links(static_cast<std::size_t>(n));
      const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
        const Group group = Group::world(t.rank(), n);  // the channel holds a reference
        engine::ControlChannel<transport::InProcess> control(t, group, 10s);
        links[static_cast<std::size_t>(t.rank())] = engine::calibrate_link(control);
      });
      for (const auto& e : errors)
        if (e) FAIL(std::string(e->what()));
      for (const LinkModel& link : links) {
        CHECK(link.latency == links[0].latency);
        CHECK(link.seconds_per_byte == links[0].seconds_per_byte);
        CHECK(link.latency >= 0);
      }
    }
  }
}
