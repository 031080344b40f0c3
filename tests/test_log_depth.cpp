// The log-depth allreduces, topology::RecursiveDoubling and topology::HalvingDoubling, and
// topology::Auto's choice among them and the ring: schedules that pair up, every rank the same
// bits as a reference written out by hand, at every group size from 1 to 17 (powers of two and the
// folded sizes between) with every codec family; the link Auto chooses by, agreed by every rank.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
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
#include "gradsync/engine/exchange.hpp"
#include "gradsync/engine/schedule_tuner.hpp"
#include "gradsync/topology/auto.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

// What both references share: a codec state per (rank, encode site) for as long as the reference
// lives, as the exchange's encode steps keep theirs across iterations; the fold of the first 2r
// ranks (even into odd, through the codec) and its undoing.
template <class C>
class Reference {
 public:
  // `divisor`: what the sum is divided by, n unless the n ranks stand for more (topology::
  // Hierarchical's machines, each bringing its machine's sum).
  Reference(const C& codec, int n, int divisor = 0)
      : codec_(codec),
        n_(n),
        p_(static_cast<int>(std::bit_floor(static_cast<unsigned>(n)))),
        folded_(n - p_),
        divisor_(divisor > 0 ? divisor : n) {}

 protected:
  // decode(encode(from)) into `to`, with the state of encode site `site` of `rank`; the bytes.
  std::vector<std::byte> round_trip(int rank, int site, std::span<const float> from, std::span<float> to, DecodeMode mode) {
    auto [it, fresh] = states_.try_emplace({rank, site});
    if (fresh) it->second = codec_.make_state(from.size(), DType::f32);
    std::vector<std::byte> bytes(codec_.max_encoded_bytes(from.size(), DType::f32));
    bytes.resize(codec_.encode(from, it->second, bytes));
    codec_.decode(std::span<const std::byte>(bytes), to, mode);
    return bytes;
  }
  int rank_of(int participant) const { return participant < folded_ ? 2 * participant + 1 : participant + folded_; }
  std::vector<float>& of(std::vector<std::vector<float>>& values, int rank) { return values[static_cast<std::size_t>(rank)]; }
  void fold(std::vector<std::vector<float>>& values) {
    for (int i = 0; i < folded_; ++i) round_trip(2 * i, 0, of(values, 2 * i), of(values, 2 * i + 1), DecodeMode::add);
  }
  void unfold(std::vector<std::vector<float>>& values) {
    for (int i = 0; i < folded_; ++i) of(values, 2 * i) = of(values, 2 * i + 1);
  }

  C codec_;
  int n_, p_, folded_, divisor_;
  std::map<std::pair<int, int>, typename C::State> states_;
};

// recursive_doubling.hpp written out: participants exchange with the partner at distance 2^k, each
// pair computing decode(encode(lower)) + decode(encode(higher)); the sum is divided by n (the
// divisor).
template <class C>
class Butterfly : Reference<C> {
  using Base = Reference<C>;

 public:
  using Base::Base;

  std::vector<std::vector<float>> allreduce(std::vector<std::vector<float>> values) {
    if (this->n_ == 1) return values;
    this->fold(values);
    for (int k = 0; (1 << k) < this->p_; ++k)
      for (int v = 0; v < this->p_; ++v) {
        const int w = v ^ (1 << k);
        if (w < v) continue;
        auto &low = this->of(values, this->rank_of(v)), &high = this->of(values, this->rank_of(w));
        std::vector<float> sum(low.size());
        this->round_trip(this->rank_of(v), 1 + k, low, sum, DecodeMode::overwrite);
        this->round_trip(this->rank_of(w), 1 + k, high, sum, DecodeMode::add);
        low = high = sum;
      }
    for (int v = 0; v < this->p_; ++v)
      for (float& x : this->of(values, this->rank_of(v))) x /= static_cast<float>(this->divisor_);
    this->unfold(values);
    return values;
  }
};

// halving_doubling.hpp written out, over positions (v below): segment s of p is summed, round by
// round, by the positions whose kept half holds it (each adding the partner's encoding of it to its
// own partial sum), and finished by position s, which averages it and passes it once through the
// codec; everyone ends with those bits.
template <class C>
class HalvingDoublingReference : Reference<C> {
  using Base = Reference<C>;

 public:
  using Base::Base;

  std::vector<std::vector<float>> allreduce(std::vector<std::vector<float>> values) {
    const int n = this->n_, p = this->p_;
    if (n == 1) return values;
    const std::size_t elements = values[0].size();
    this->fold(values);
    const auto range = [&](int first, int count) {
      return ElemRange{topology::Ring::segment(elements, p, first).begin,
                       topology::Ring::segment(elements, p, first + count - 1).end};
    };
    const auto span_of = [&](std::vector<float>& v, ElemRange r) { return std::span<float>(v).subspan(r.begin, r.size()); };
    // Positions: participant v plays the one whose log2(p) bits are v's reversed.
    const int levels = std::countr_zero(static_cast<unsigned>(p));
    const auto reversed = [&](int position) { return topology::HalvingDoubling::reversed(position, levels); };
    std::vector<int> first(static_cast<std::size_t>(p), 0);
    for (int k = 0, count = p; (1 << k) < p; ++k, count /= 2) {
      const int distance = p >> (k + 1);
      // Every encoding of the round first: a participant's half it gives is not what it adds into.
      std::vector<std::vector<std::byte>> given(static_cast<std::size_t>(p));
      std::vector<ElemRange> kept(static_cast<std::size_t>(p));
      for (int v = 0; v < p; ++v) {
        const bool upper = (v & distance) != 0;
        const int start = first[static_cast<std::size_t>(v)];
        const ElemRange give = range(upper ? start : start + count / 2, count / 2);
        kept[static_cast<std::size_t>(v)] = range(upper ? start + count / 2 : start, count / 2);
        std::vector<float> scratch(give.size());
        if (!give.empty())
          given[static_cast<std::size_t>(v)] =
              this->round_trip(this->rank_of(reversed(v)), 1 + k, span_of(this->of(values, this->rank_of(reversed(v))), give), scratch,
                               DecodeMode::overwrite);
        first[static_cast<std::size_t>(v)] = upper ? start + count / 2 : start;
      }
      for (int v = 0; v < p; ++v) {
        const ElemRange keep = kept[static_cast<std::size_t>(v)];
        if (!keep.empty())
          this->codec_.decode(std::span<const std::byte>(given[static_cast<std::size_t>(v ^ distance)]),
                              span_of(this->of(values, this->rank_of(reversed(v))), keep), DecodeMode::add);
      }
    }
    std::vector<float> result(elements);
    for (int s = 0; s < p; ++s) {
      const ElemRange own = topology::Ring::segment(elements, p, s);
      auto& mine = this->of(values, this->rank_of(reversed(s)));
      for (std::size_t e = own.begin; e < own.end; ++e) result[e] = mine[e] / static_cast<float>(this->divisor_);
      if (!C::identity && !own.empty())
        this->round_trip(this->rank_of(reversed(s)), -1, span_of(result, own), span_of(result, own), DecodeMode::overwrite);
    }
    for (int v = 0; v < p; ++v) this->of(values, this->rank_of(reversed(v))) = result;
    this->unfold(values);
    return values;
  }
};

// topology::Hierarchical with a log-depth schedule across machines, written out: shard s of L is
// summed within each machine starting at local rank s and going round (as with the ring across),
// and the machines' sums of the shard are allreduced by `Written` over the M machines, divided by
// n = M*L. Through a leader the whole bucket is one shard, summed from local rank 0. Every rank's
// values.
template <template <class> class Written, class C>
std::vector<float> hierarchical_reference(const C& codec, int per_machine, const std::vector<std::vector<float>>& inputs,
                                          bool through_leader = false) {
  const int n = static_cast<int>(inputs.size()), machines = n / per_machine;
  const std::size_t elements = inputs[0].size();
  std::vector<float> out(elements);
  const int shards = through_leader ? 1 : per_machine;
  for (int s = 0; s < shards; ++s) {
    const ElemRange shard = topology::Ring::segment(elements, shards, s);
    std::vector<std::vector<float>> sums(static_cast<std::size_t>(machines), std::vector<float>(shard.size()));
    for (int m = 0; m < machines; ++m)
      for (std::size_t e = shard.begin; e < shard.end; ++e) {
        const auto x = [&](int local) { return inputs[static_cast<std::size_t>(m * per_machine + local)][e]; };
        float sum = x(s);
        for (int k = 1; k < per_machine; ++k) sum = x((s + k) % per_machine) + sum;
        sums[static_cast<std::size_t>(m)][e - shard.begin] = sum;
      }
    const auto averaged = Written<C>(codec, machines, n).allreduce(sums);
    std::copy(averaged[0].begin(), averaged[0].end(), out.begin() + static_cast<std::ptrdiff_t>(shard.begin));
  }
  return out;
}

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

template <class Topology, template <class> class Written, class C>
void check_against_reference(const C& codec) {
  for (int n = 1; n <= 17; ++n)
    for (std::size_t elements : {1u, 7u, 1000u}) {
      CAPTURE(n);
      CAPTURE(elements);
      std::vector<std::vector<std::vector<float>>> inputs(3);
      for (std::size_t it = 0; it < inputs.size(); ++it)
        for (int r = 0; r < n; ++r)
          inputs[it].push_back(test::random_values(elements, 977u * it + 31u * static_cast<unsigned>(r) + elements));
      const auto outputs = run(codec, Topology{}, inputs);
      Written<C> reference(codec, n);
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

TEST_SUITE("log-depth allreduce") {
  TEST_CASE_TEMPLATE("every rank ends with the reference's bits, at 1 to 17 ranks, with every codec family", C,
                     compression::None, compression::Fp16, compression::Bf16, compression::TwoBit, compression::OneBit,
                     compression::TernGrad<2>, compression::TopK, compression::RandomK,
                     compression::ErrorFeedback<compression::TwoBit>, compression::ErrorFeedback<compression::TopK>) {
    SUBCASE("recursive doubling") { check_against_reference<topology::RecursiveDoubling, Butterfly>(C{}); }
    SUBCASE("halving-doubling") { check_against_reference<topology::HalvingDoubling, HalvingDoublingReference>(C{}); }
  }

  TEST_CASE("log2(n) rounds, two more where n is not a power of two; sends pair with receives of the same size") {
    CHECK(topology::RecursiveDoubling::dependent_steps(1) == 0);
    CHECK(topology::RecursiveDoubling::dependent_steps(2) == 1);
    CHECK(topology::RecursiveDoubling::dependent_steps(3) == 3);
    CHECK(topology::RecursiveDoubling::dependent_steps(64) == 6);
    CHECK(topology::RecursiveDoubling::dependent_steps(100) == 8);
    const auto check = [](const auto& topology) {
      CAPTURE(topology.describe());
      for (int n = 1; n <= 17; ++n)
        for (std::size_t elements : {0u, 1u, 5u, 300u})
          for (bool identity : {true, false})
            for (bool receives_at_use : {false, true}) {
              CAPTURE(n);
              CAPTURE(elements);
              CAPTURE(identity);
              std::map<std::tuple<int, int, std::uint32_t>, std::size_t> sends, recvs;
              std::set<int> peers_of_zero;
              for (int r = 0; r < n; ++r) {
                const Schedule s =
                    topology.schedule(Group::world(r, n), elements, {.identity = identity, .receives_at_use = receives_at_use});
                CHECK(s.contributors == n);
                for (const Step& step : s.steps) {
                  if (step.op == Step::Op::send) CHECK(sends.emplace(std::tuple{r, step.peer, step.message}, step.range.size()).second);
                  if (step.op == Step::Op::recv) CHECK(recvs.emplace(std::tuple{step.peer, r, step.message}, step.range.size()).second);
                  if (r == 0 && engine::is_transfer(step.op)) peers_of_zero.insert(step.peer);
                  if (step.slot != no_slot) CHECK(s.slot_elements[step.slot] == step.range.size());
                  CHECK(step.message < (std::uint32_t{1} << 31));
                }
              }
              CHECK(sends == recvs);
              CHECK(sends.empty() == (n == 1 || elements == 0));
              // A rank talks to at most log2(n) + 1 peers: what it needs connections to.
              CHECK(peers_of_zero.size() <= static_cast<std::size_t>(std::bit_width(static_cast<unsigned>(n))));
            }
    };
    check(topology::RecursiveDoubling{});
    check(topology::HalvingDoubling{});
  }

  TEST_CASE("Auto: recursive doubling for small buckets, then halving-doubling or the ring, by the link") {
    using Choice = topology::Auto<>::Choice;
    const topology::Auto<> chooser{.link = {.latency = 50e-6, .seconds_per_byte = 1.0 / 1.25e9}, .measure_link = false};
    for (int n : {4, 6, 16, 64, 100, 256}) {
      CAPTURE(n);
      const Group group = Group::world(0, n);
      CHECK(chooser.choose(group, 1024) == Choice::small);             // 4 KiB
      CHECK(chooser.choose(group, 16u << 20) != Choice::small);        // 64 MiB
      // As buckets grow the choice moves only towards the bandwidth end.
      Choice last = Choice::small;
      for (std::size_t e = 1; e <= (std::size_t{1} << 26); e *= 2) {
        const Choice now = chooser.choose(group, e);
        CHECK(now >= last);
        last = now;
      }
      const Schedule small = chooser.schedule(group, 1024, {});
      CHECK(small.steps.size() == topology::RecursiveDoubling{}.schedule(group, 1024, {}).steps.size());
    }
    // Where n is not a power of two the fold costs halving-doubling two whole buckets: large ones
    // go round the ring.
    CHECK(chooser.choose(Group::world(0, 6), 16u << 20) == Choice::large);
    CHECK(chooser.choose(Group::world(0, 64), std::size_t{1} << 18) == Choice::middle);  // 1 MiB
    // The latency decides: on a link without any, the butterfly's whole buckets never pay.
    const topology::Auto<> no_latency{.link = {.latency = 0, .seconds_per_byte = 1e-9}, .measure_link = false};
    CHECK(no_latency.choose(Group::world(0, 8), 1024) != Choice::small);
    CHECK(chooser.describe() ==
          "auto(recursive-doubling | halving-doubling | ring(chunk=262144), link 50.0 us + 1.250 GB/s, kept by measured "
          "times)");
  }

  TEST_CASE("Auto pinned: every bucket takes its candidate's schedule, and no link is measured") {
    using Choice = topology::Auto<>::Choice;
    // Steps equal field by field: the same messages in the same order, so the same bits.
    const auto same = [](const Schedule& a, const Schedule& b) {
      return a.steps.size() == b.steps.size() &&
             std::equal(a.steps.begin(), a.steps.end(), b.steps.begin(), [](const Step& x, const Step& y) {
               return x.op == y.op && x.peer == y.peer && x.message == y.message && x.range.begin == y.range.begin &&
                      x.range.end == y.range.end && x.slot == y.slot && x.after == y.after;
             });
    };
    const topology::Ring ring{.chunk_elements = 1000};
    for (int n : {1, 3, 8, 12}) {
      CAPTURE(n);
      const Group group = Group::world(n - 1, n);
      for (std::size_t elements : {1u, 1024u, 300000u}) {
        CAPTURE(elements);
        const topology::Auto<> rd{.large = ring, .pinned = Choice::small}, hd{.large = ring, .pinned = Choice::middle},
            large{.large = ring, .pinned = Choice::large};
        CHECK(same(rd.schedule(group, elements, {}), topology::RecursiveDoubling{}.schedule(group, elements, {})));
        CHECK(same(hd.schedule(group, elements, {}), topology::HalvingDoubling{}.schedule(group, elements, {})));
        CHECK(same(large.schedule(group, elements, {}), ring.schedule(group, elements, {})));
        CHECK(large.predicted_seconds(group, elements, 4, {}) == ring.predicted_seconds(group, elements, 4, {}));
      }
    }
    const topology::Auto<> pinned{.pinned = Choice::small};
    CHECK_FALSE(pinned.measures_link());
    CHECK(topology::Auto<>{}.measures_link());
    CHECK(pinned.describe() == "auto(pinned recursive-doubling)");
    CHECK_FALSE(topology::Hierarchical{.across = topology::Hierarchical::Across::ring}.measures_link());
  }

  TEST_CASE("Auto on machines: Hierarchical's schedules are candidates on several machines of several ranks, each "
            "exactly Hierarchical's with that schedule across") {
    using Choice = topology::Auto<>::Choice;
    using Across = topology::Hierarchical::Across;
    const auto same = [](const Schedule& a, const Schedule& b) {
      return a.steps.size() == b.steps.size() && a.slot_elements == b.slot_elements &&
             std::equal(a.steps.begin(), a.steps.end(), b.steps.begin(), [](const Step& x, const Step& y) {
               return x.op == y.op && x.peer == y.peer && x.message == y.message && x.range.begin == y.range.begin &&
                      x.range.end == y.range.end && x.slot == y.slot && x.after == y.after;
             });
    };
    using Within = topology::Hierarchical::Within;
    const topology::Auto<> chooser{.machines = {.ranks_per_machine = 2, .chunk_elements = 500}};
    const std::tuple<Choice, Within, Across> machine_candidates[] = {
        {Choice::machines_recursive_doubling, Within::ring, Across::recursive_doubling},
        {Choice::machines_halving_doubling, Within::ring, Across::halving_doubling},
        {Choice::machines_ring, Within::ring, Across::ring},
        {Choice::machines_leader_recursive_doubling, Within::leader, Across::recursive_doubling},
        {Choice::machines_leader_halving_doubling, Within::leader, Across::halving_doubling}};
    for (int n : {4, 6, 8}) {
      CAPTURE(n);
      for (int rank = 0; rank < n; ++rank) {
        const Group group = Group::world(rank, n);
        CHECK(chooser.spans_machines(group));
        CHECK(chooser.measured_ranks_per_machine(group) == 2);
        for (const auto& [choice, within, across] : machine_candidates) {
          const topology::Hierarchical fixed{.ranks_per_machine = 2, .chunk_elements = 500, .across = across, .within = within};
          topology::Auto<> pinned = chooser;
          pinned.pinned = choice;
          for (std::size_t elements : {1u, 1000u, 7777u}) {
            CAPTURE(elements);
            CHECK(same(pinned.schedule(group, elements, {}), fixed.schedule(group, elements, {})));
          }
          CHECK(std::isfinite(chooser.candidate_seconds(static_cast<std::size_t>(choice), group, 1000, 4)));
        }
      }
    }
    // One machine, a group that is not whole machines, or one rank a machine: the flat three alone,
    // and one link measured.
    for (const auto& [per_machine, n] : {std::pair{2, 2}, std::pair{2, 5}, std::pair{1, 8}, std::pair{4, 4}}) {
      CAPTURE(n);
      topology::Auto<> flat = chooser;
      flat.machines.ranks_per_machine = per_machine;
      const Group group = Group::world(0, n);
      CHECK_FALSE(flat.spans_machines(group));
      CHECK(flat.measured_ranks_per_machine(group) == 0);
      for (std::size_t k = 0; k < topology::Auto<>::candidates; ++k)
        CHECK(std::isfinite(flat.candidate_seconds(k, group, 1000, 4)) == (k < topology::Auto<>::flat_candidates));
    }
    // The links within and across decide: with a machine's ranks 100x closer than the machines,
    // a bucket of 16 Ki values at 16 machines of 8 takes a hierarchical schedule, and the prior
    // the Synchronizer measures gives each level its own figures.
    topology::Auto<> measured{.machines = {.ranks_per_machine = 8}};
    measured.take_links({.latency = 1e-6, .seconds_per_byte = 1e-11}, {.latency = 100e-6, .seconds_per_byte = 8e-9});
    CHECK(measured.link.latency == 100e-6);
    CHECK(measured.machines.link.latency == 1e-6);
    CHECK(measured.machines.link_across.latency == 100e-6);
    CHECK(measured.choose(Group::world(0, 128), 16384) >= Choice::machines_recursive_doubling);
    CHECK(measured.choose(Group::world(0, 8), 16384) < Choice::machines_recursive_doubling);  // one machine
    CHECK(measured.candidate_name(static_cast<std::size_t>(Choice::machines_ring)) == "hierarchical, ring across");
    CHECK(measured.candidate_name(static_cast<std::size_t>(Choice::machines_leader_halving_doubling)) ==
          "hierarchical through a leader, halving-doubling across");
    // Hierarchical alone: its five arrangements are its candidates. On one machine they are all the
    // ring's schedule, so one is offered; with one rank a machine a leader is the rings within; a
    // `within` or `across` that is set leaves what it allows.
    const topology::Hierarchical hierarchical{.ranks_per_machine = 2};
    const auto offered = [](const topology::Hierarchical& h, const Group& group) {
      std::vector<std::size_t> ks;
      for (std::size_t k = 0; k < topology::Hierarchical::candidates; ++k)
        if (std::isfinite(h.candidate_seconds(k, group, 1000, 4))) ks.push_back(k);
      return ks;
    };
    CHECK(hierarchical.tunes());
    CHECK(offered(hierarchical, Group::world(0, 6)) == std::vector<std::size_t>{0, 1, 2, 3, 4});
    CHECK(offered(hierarchical, Group::world(0, 2)) == std::vector<std::size_t>{0});
    CHECK(offered(topology::Hierarchical{.ranks_per_machine = 1}, Group::world(0, 4)) == std::vector<std::size_t>{0, 1, 2});
    const topology::Hierarchical ring_across{.ranks_per_machine = 2, .across = Across::ring};
    CHECK_FALSE(ring_across.tunes());  // the ring across has no leader: one arrangement
    CHECK(offered(ring_across, Group::world(0, 6)) == std::vector<std::size_t>{2});
    const topology::Hierarchical doubling{.ranks_per_machine = 2, .across = Across::recursive_doubling};
    CHECK(doubling.tunes());
    CHECK(offered(doubling, Group::world(0, 6)) == std::vector<std::size_t>{0, 3});
    CHECK(offered(doubling, Group::world(0, 2)) == std::vector<std::size_t>{0});
    const topology::Hierarchical leader{.ranks_per_machine = 2, .within = Within::leader};
    CHECK(offered(leader, Group::world(0, 6)) == std::vector<std::size_t>{3, 4});
    CHECK(offered(leader, Group::world(0, 2)) == std::vector<std::size_t>{3});  // the ring's, whatever it is called
    // A leader with the ring across is nothing this topology runs: refused by name.
    const topology::Hierarchical nothing{.ranks_per_machine = 2, .across = Across::ring, .within = Within::leader};
    CHECK(offered(nothing, Group::world(0, 6)).empty());
    CHECK_THROWS_WITH_AS(nothing.schedule(Group::world(0, 6), 1000, {}), doctest::Contains("within = leader"), Error);
  }

  TEST_CASE_TEMPLATE("Hierarchical across machines by recursive doubling or halving-doubling, after the rings within or "
                     "through a leader: every rank the reference's bits",
                     C, compression::None, compression::Fp16, compression::Bf16) {
    using Across = topology::Hierarchical::Across;
    using Within = topology::Hierarchical::Within;
    const C codec;
    // (machines, ranks per machine); 3 and 5 machines fold.
    for (const auto& [machines, per_machine] : std::vector<std::pair<int, int>>{{2, 2}, {2, 3}, {3, 2}, {4, 2}, {5, 2}, {4, 1}})
      for (std::size_t elements : {1u, 7u, 1000u})
        for (std::size_t chunk : {std::size_t{16}, std::size_t{1} << 16})
          for (Across across : {Across::recursive_doubling, Across::halving_doubling})
          for (Within within : {Within::ring, Within::leader}) {
            const int n = machines * per_machine;
            CAPTURE(machines);
            CAPTURE(per_machine);
            CAPTURE(elements);
            CAPTURE(chunk);
            CAPTURE(std::string(topology::Hierarchical::name(across)));
            CAPTURE(std::string(topology::Hierarchical::name(within)));
            std::vector<std::vector<std::vector<float>>> inputs(1);
            for (int r = 0; r < n; ++r) inputs[0].push_back(test::random_values(elements, 53u * static_cast<unsigned>(r) + elements));
            const auto outputs =
                run(codec,
                    topology::Hierarchical{
                        .ranks_per_machine = per_machine, .chunk_elements = chunk, .across = across, .within = within},
                    inputs)[0];
            const bool leader = within == Within::leader;
            const auto expected = across == Across::recursive_doubling
                                      ? hierarchical_reference<Butterfly>(codec, per_machine, inputs[0], leader)
                                      : hierarchical_reference<HalvingDoublingReference>(codec, per_machine, inputs[0], leader);
            for (int r = 0; r < n; ++r) {
              CAPTURE(r);
              REQUIRE(std::memcmp(outputs[static_cast<std::size_t>(r)].data(), expected.data(), elements * sizeof(float)) == 0);
            }
          }
  }

  TEST_CASE("Hierarchical chooses its schedule across machines by its two links, the same for every rank of the group") {
    using Across = topology::Hierarchical::Across;
    // 16 machines of 8: fast links within, a machine's 1 Gbit/s shared by its 8 ranks across.
    using Within = topology::Hierarchical::Within;
    using Arrangement = topology::Hierarchical::Arrangement;
    topology::Hierarchical h{.ranks_per_machine = 8, .within = Within::ring, .measure_link = false};
    h.link = {.latency = 20e-6, .seconds_per_byte = 1.0 / 5e9};
    h.link_across = {.latency = 200e-6, .seconds_per_byte = 8.0 / 125e6};
    const Group group = Group::world(0, 128);
    const auto across_for = [&](const Group& g, std::size_t elements) { return h.choice_for(g, elements).across; };
    CHECK(across_for(group, 1024) == Across::recursive_doubling);       // 4 KiB: latency
    CHECK(across_for(group, std::size_t{1} << 16) == Across::halving_doubling);
    CHECK(across_for(group, std::size_t{1} << 24) == Across::ring);    // 64 MiB: the pipeline hides the phases within
    // As buckets grow the choice moves only towards the bandwidth end.
    const auto towards_bandwidth = [](Across a) { return a == Across::recursive_doubling ? 0 : a == Across::halving_doubling ? 1 : 2; };
    int last = 0;
    for (std::size_t e = 1; e <= (std::size_t{1} << 26); e *= 2) {
      const int now = towards_bandwidth(across_for(group, e));
      CHECK(now >= last);
      last = now;
    }
    // The choice is the bucket's, not the rank's: every rank's schedule takes the same one.
    for (int rank = 0; rank < 128; rank += 9) {
      const Schedule s = h.schedule(Group::world(rank, 128), 1024, {.identity = true});
      const std::size_t rounds_across = static_cast<std::size_t>(std::count_if(s.steps.begin(), s.steps.end(), [&](const Step& step) {
        return step.op == Step::Op::send && step.peer / 8 != rank / 8;
      }));
      CHECK(rounds_across == 4);  // log2(16) butterfly rounds, one whole shard each
    }
    // A named schedule across stands whatever the links say; one machine has no hops across.
    h.across = Across::halving_doubling;
    CHECK(across_for(group, 1024) == Across::halving_doubling);
    CHECK(across_for(Group::world(0, 8), 1024) == Across::ring);
    CHECK(h.describe() == "hierarchical(ranks-per-machine=8, chunk=65536, within=ring, across=halving-doubling)");
    h.across = Across::automatic;
    CHECK(h.describe() ==
          "hierarchical(ranks-per-machine=8, chunk=65536, within=ring, across=auto, links 20.0 us + 5.000 GB/s within, "
          "200.0 us + 0.016 GB/s across)");
    // Within left to the links too: a small bucket goes through each machine's leader (two steps
    // within, 16 ranks across, at the bandwidth one rank has alone), a large one round the rings,
    // which share the adding and the machine's link out among its ranks.
    h.within = Within::automatic;
    CHECK(h.choice_for(group, 1024) == Arrangement{Within::leader, Across::recursive_doubling});
    CHECK(h.choice_for(group, std::size_t{1} << 24) == Arrangement{Within::ring, Across::ring});
  }

  TEST_CASE("the links of a group of machines are measured level by level, and every rank gets the same figures") {
    for (const auto& [machines, per_machine] : std::vector<std::pair<int, int>>{{2, 2}, {3, 2}, {1, 3}, {3, 1}}) {
      const int n = machines * per_machine;
      CAPTURE(machines);
      CAPTURE(per_machine);
      std::vector<engine::MachineLinks> links(static_cast<std::size_t>(n));
      const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
        const Group group = Group::world(t.rank(), n);
        engine::ControlChannel<transport::InProcess> control(t, group, 10s);
        links[static_cast<std::size_t>(t.rank())] = engine::calibrate_machine_links(control, per_machine);
      });
      for (const auto& e : errors)
        if (e) FAIL(std::string(e->what()));
      for (const auto& l : links) {
        CHECK(l.within.latency == links[0].within.latency);
        CHECK(l.within.seconds_per_byte == links[0].within.seconds_per_byte);
        CHECK(l.across.latency == links[0].across.latency);
        CHECK(l.across.seconds_per_byte == links[0].across.seconds_per_byte);
        // A level the group lacks takes the other's figures.
        if (machines == 1 || per_machine == 1) CHECK(l.within.latency == l.across.latency);
      }
    }
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

  TEST_CASE("ScheduleTuner: the candidates the prior allows, each in turn, a hopeless one stopped after one trial; the "
            "slowest rank's fastest kept; drift explored again") {
    // Three ranks, three buckets in two size classes. Class A (1000 values, twice): the prior rules
    // out candidate 2; candidate 1 is the fastest on ranks 0 and 1, but the slowest rank's times
    // decide, and rank 2 takes 3 ms on it. Class B (100000 values): candidate 0 needs too much
    // scratch to be tried; candidate 2 is the fastest everywhere, until it drifts.
    constexpr int n = 3, iterations = 40;
    const engine::TunerSettings settings{.warmup = 2, .trials = 3, .explore_within = 4.0, .check_every = 4, .drift_margin = 1.3};
    const std::vector<std::size_t> elements{1000, 100000, 1000};
    const auto predicted = [&](std::size_t b, std::size_t k) {
      if (elements[b] == 1000) return std::array{1.0, 2.0, 100.0}[k];
      return std::array{1.0, 1.5, 2.0}[k];
    };
    std::vector<std::vector<std::vector<std::size_t>>> choices(n);  // rank, iteration, bucket
    std::vector<std::string> logs(n);
    const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
      const int rank = t.rank();
      const Group group = Group::world(rank, n);
      engine::ControlChannel<transport::InProcess> control(t, group, 10s);
      engine::ScheduleTuner tuner(settings, 3);
      tuner.candidate_name = [](std::size_t k) { return fmt::format("c{}", k); };
      tuner.plan(elements, predicted, [&](std::size_t b, std::size_t k) {
        // Class B's candidate 0 holds more than the limit, and more than the others: never tried.
        return elements[b] == 100000 && k == 0 ? std::size_t{1} << 30 : std::size_t{1000};
      });
      for (int it = 0; it < iterations; ++it) {
        auto& chosen = choices[static_cast<std::size_t>(rank)].emplace_back();
        for (std::size_t b = 0; b < elements.size(); ++b) {
          const std::size_t k = tuner.choice(b);
          chosen.push_back(k);
          double ms = 0;
          if (elements[b] == 1000) ms = k == 0 ? 1.0 : k == 1 ? (rank == 2 ? 3.0 : 0.5) : 50.0;
          else ms = k == 2 ? (it >= 24 ? 3.5 : 1.0) : k == 1 ? 2.0 : 3.0;  // candidate 2 drifts at iteration 24
          tuner.record(b, ms * 1e-3);
        }
        if (tuner.end_iteration()) tuner.agree(control, static_cast<std::uint64_t>(it), &logs[static_cast<std::size_t>(rank)]);
      }
    });
    for (const auto& e : errors)
      if (e) FAIL(std::string(e->what()));
    for (int r = 1; r < n; ++r) CHECK(choices[static_cast<std::size_t>(r)] == choices[0]);
    CHECK(logs[1] == logs[0]);
    const auto& c = choices[0];
    const auto each = [&](int from, int to, std::vector<std::size_t> expected) {
      for (int it = from; it < to; ++it) {
        CAPTURE(it);
        CHECK(c[static_cast<std::size_t>(it)] == expected);
      }
    };
    // Warm-up, iterations 0 and 1: the prior's choice (B's candidate 0 is ruled out by its scratch).
    each(0, 2, {0, 1, 0});
    // Exploring: A tries 0 (not 2, predicted 50x slower), B 1, three iterations each.
    each(2, 5, {0, 1, 0});
    // The next candidates' first trials, agreed after iteration 5. A: candidate 1 took 6 ms on
    // the slowest rank (its two buckets' times added up), beyond 2x candidate 0's 2 ms: no more
    // trials, and A keeps candidate 0. B: candidate 2 goes on.
    each(5, 6, {1, 2, 1});
    // B agrees after iteration 7: candidate 2.
    each(6, 28, {0, 2, 0});
    // Candidate 2 drifts to 3.5 ms from iteration 24, beyond 1.3 x candidate 1's 2 ms: B's check
    // after iteration 27 sends it exploring again (28-33; 3.5 ms is not beyond 2x, so all three
    // trials), and it settles on candidate 1.
    each(28, 31, {0, 1, 0});
    each(31, 34, {0, 2, 0});
    each(34, iterations, {0, 1, 0});
    CHECK(logs[0].find("buckets of 512 to 1023 values (measured): c0 2.000 ms, c1 6.000 ms -> c0") != std::string::npos);
    CHECK(logs[0].find("buckets of 65536 to 131071 values (measured): c1 2.000 ms, c2 1.000 ms -> c2") != std::string::npos);
    CHECK(logs[0].find("(drifted, exploring again)") != std::string::npos);
    CHECK(logs[0].find("c1 2.000 ms, c2 3.500 ms -> c1") != std::string::npos);
  }

  TEST_CASE("the scratch the tuner weighs a candidate by is the same on every rank") {
    // A leader holds its machine's buckets, the others none; 3 machines fold onto 2 in the butterfly.
    const topology::Auto<> chooser{.machines = {.ranks_per_machine = 4, .chunk_elements = 100}};
    constexpr int n = 12;
    for (std::size_t k = 0; k < topology::Auto<>::candidates; ++k)
      for (bool identity : {true, false}) {
        CAPTURE(chooser.candidate_name(k));
        CAPTURE(identity);
        const std::size_t weighed = engine::candidate_scratch(chooser, k, Group::world(0, n), 1000, {.identity = identity});
        std::set<std::size_t> own;
        for (int rank = 0; rank < n; ++rank) {
          const Group group = Group::world(rank, n);
          CHECK(engine::candidate_scratch(chooser, k, group, 1000, {.identity = identity}) == weighed);
          own.insert(engine::scratch_elements(chooser.candidate_schedule(k, group, 1000, {.identity = identity})));
        }
        CHECK(weighed >= engine::scratch_elements(chooser.candidate_schedule(k, Group::world(0, n), 1000, {.identity = identity})));
        if (k == static_cast<std::size_t>(topology::Auto<>::Choice::machines_leader_recursive_doubling))
          CHECK(own.size() > 1);  // what made ranks try different candidates before
      }
  }

  TEST_CASE("ScheduleTuner: a candidate predicted at infinity is not offered: never tried, its scratch never asked") {
    // Auto's hierarchical candidates on a group of one machine. Candidate 1 is not offered; 0 and 2 are tried.
    const std::vector<std::size_t> elements{1000};
    const auto errors = test::run_ranks(2, [&](transport::InProcess& t) {
      const Group group = Group::world(t.rank(), 2);  // the channel keeps a reference
      engine::ControlChannel<transport::InProcess> control(t, group, 10s);
      engine::ScheduleTuner tuner({.warmup = 1, .trials = 2}, 3);
      tuner.plan(
          elements, [](std::size_t, std::size_t k) { return k == 1 ? std::numeric_limits<double>::infinity() : 1.0 + k; },
          [](std::size_t, std::size_t k) {
            if (k == 1) throw std::logic_error("the scratch of a candidate not offered was asked for");
            return std::size_t{1000};
          });
      std::vector<std::size_t> ran;
      for (int it = 0; it < 8; ++it) {
        ran.push_back(tuner.choice(0));
        tuner.record(0, ran.back() == 2 ? 1e-3 : 2e-3);
        if (tuner.end_iteration()) tuner.agree(control, static_cast<std::uint64_t>(it));
      }
      CHECK(ran == std::vector<std::size_t>{0, 0, 0, 2, 2, 2, 2, 2});
      CHECK(tuner.settled());
    });
    for (const auto& e : errors)
      if (e) FAIL(std::string(e->what()));
    // A topology that offers nothing for a bucket is told so, the bucket named.
    engine::ScheduleTuner tuner({}, 2);
    const std::vector<std::size_t> two{10, 5000};
    try {
      tuner.plan(
          two, [](std::size_t b, std::size_t) { return b == 1 ? std::numeric_limits<double>::infinity() : 1.0; },
          [](std::size_t, std::size_t) { return std::size_t{0}; });
      FAIL("no Error");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      CHECK(e.context().bucket == std::optional<std::uint32_t>(1));
      CHECK(e.context().operation == "schedule tuning");
      CHECK(std::string(e.what()).find("5000 values") != std::string::npos);
    }
  }
}
