// topology::Ring and topology::ParameterServer run by engine::BucketExchange over real in-process
// ranks: schedules pair up, every rank ends bit-identical, and the result equals a reference summed
// in the topology's order.

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/engine/coordinator/channel.hpp"
#include "gradsync/engine/cost_model.hpp"
#include "gradsync/engine/dependencies.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/auto.hpp"
#include "gradsync/topology/parameter_server.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

// PairOrderedTopology's promise (concepts.hpp): for every pair (a, b), the sends a posts to b, in
// list order, are the receives b posts from a, in list order, message for message and size for
// size. Empty when it holds, else the first pair where it does not.
template <class T>
std::string pair_order_broken(const T& topology, int n, std::size_t elements, bool identity,
                              bool receives_at_use = false) {
  std::vector<Schedule> schedules;
  for (int r = 0; r < n; ++r)
    schedules.push_back(
        topology.schedule(Group::world(r, n), elements, {.identity = identity, .receives_at_use = receives_at_use}));
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      std::vector<std::pair<std::uint32_t, std::size_t>> sent, received;
      for (const Step& step : schedules[a].steps)
        if (step.op == Step::Op::send && step.peer == b) sent.emplace_back(step.message, step.range.size());
      for (const Step& step : schedules[b].steps)
        if (step.op == Step::Op::recv && step.peer == a) received.emplace_back(step.message, step.range.size());
      if (sent != received) return fmt::format("{} ranks, {} elements: {} -> {}", n, elements, a, b);
    }
  return {};
}

// Plays every rank's list as the serial executor walks it over transport::Nccl: transfers are
// queued as they are posted; every wait (a step's `after` not waited for yet, and each transfer
// at the end) first hands the queue to NCCL as one group on the rank's one stream, done or not;
// a rank's groups run one after another, and a group completes only as a whole, once every
// transfer in it meets its partner (the peer's transfer of the same pair, direction and ordinal)
// in the group running on the peer. Empty if every rank finishes, else where the first stuck
// rank waits.
std::string nccl_deadlock(const std::vector<Schedule>& schedules) {
  const int n = static_cast<int>(schedules.size());
  const auto transfer = [](const Step& s) { return s.op == Step::Op::send || s.op == Step::Op::recv; };
  // partner[r][i]: the rank and step transfer i of rank r meets.
  std::vector<std::vector<std::pair<int, std::uint32_t>>> partner(static_cast<std::size_t>(n));
  std::map<std::tuple<int, int, bool>, std::vector<std::uint32_t>> by_pair;  // (from, to, is send) -> steps
  for (int r = 0; r < n; ++r) {
    const auto& steps = schedules[static_cast<std::size_t>(r)].steps;
    partner[static_cast<std::size_t>(r)].assign(steps.size(), {-1, no_step});
    for (std::uint32_t i = 0; i < steps.size(); ++i)
      if (steps[i].op == Step::Op::send) by_pair[{r, steps[i].peer, true}].push_back(i);
      else if (steps[i].op == Step::Op::recv) by_pair[{steps[i].peer, r, false}].push_back(i);
  }
  for (const auto& [key, sends] : by_pair) {
    const auto [from, to, is_send] = key;
    if (!is_send) continue;
    const auto& recvs = by_pair[{from, to, false}];
    if (recvs.size() != sends.size()) return fmt::format("{} sends from {} to {}, {} receives", sends.size(), from, to, recvs.size());
    for (std::size_t k = 0; k < sends.size(); ++k) {
      partner[static_cast<std::size_t>(from)][sends[k]] = {to, recvs[k]};
      partner[static_cast<std::size_t>(to)][recvs[k]] = {from, sends[k]};
    }
  }
  struct Rank {
    std::size_t pc = 0;       // the next step to walk
    std::size_t closing = 0;  // after the walk: the next transfer to wait for
    std::vector<std::uint32_t> queue;
    std::vector<std::vector<std::uint32_t>> stream;  // groups handed to NCCL, oldest first
    std::vector<bool> done, waited;
  };
  std::vector<Rank> ranks(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    ranks[static_cast<std::size_t>(r)].done.assign(schedules[static_cast<std::size_t>(r)].steps.size(), false);
    ranks[static_cast<std::size_t>(r)].waited.assign(schedules[static_cast<std::size_t>(r)].steps.size(), false);
  }
  const auto flush = [](Rank& rank) {
    if (rank.queue.empty()) return false;
    rank.stream.push_back(std::exchange(rank.queue, {}));
    return true;
  };
  // The executor's wait for transfer i: flushes if i is still queued, then goes on only once i is
  // done.
  const auto wait = [&](Rank& rank, std::uint32_t i, bool& progress) {
    if (rank.waited[i]) return true;
    if (std::find(rank.queue.begin(), rank.queue.end(), i) != rank.queue.end()) progress |= flush(rank);
    if (!rank.done[i]) return false;
    rank.waited[i] = true;
    return true;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      Rank& rank = ranks[static_cast<std::size_t>(r)];
      const auto& steps = schedules[static_cast<std::size_t>(r)].steps;
      while (rank.pc < steps.size()) {
        const Step& step = steps[rank.pc];
        if (step.after != no_step && transfer(steps[step.after]) && !wait(rank, step.after, progress)) break;
        if (transfer(step)) rank.queue.push_back(static_cast<std::uint32_t>(rank.pc));
        ++rank.pc;
        progress = true;
      }
      if (rank.pc < steps.size()) continue;
      while (rank.closing < steps.size()) {
        const auto i = static_cast<std::uint32_t>(rank.closing);
        if (transfer(steps[i]) && !wait(rank, i, progress)) break;
        ++rank.closing;
        progress = true;
      }
    }
    for (int r = 0; r < n; ++r) {
      Rank& rank = ranks[static_cast<std::size_t>(r)];
      if (rank.stream.empty()) continue;
      const auto& group = rank.stream.front();
      const bool met = std::all_of(group.begin(), group.end(), [&](std::uint32_t i) {
        const auto [peer, j] = partner[static_cast<std::size_t>(r)][i];
        const Rank& other = ranks[static_cast<std::size_t>(peer)];
        if (other.done[j]) return true;
        return !other.stream.empty() && std::find(other.stream.front().begin(), other.stream.front().end(), j) !=
                                            other.stream.front().end();
      });
      if (!met) continue;
      for (std::uint32_t i : group) rank.done[i] = true;
      rank.stream.erase(rank.stream.begin());
      progress = true;
    }
  }
  for (int r = 0; r < n; ++r) {
    const Rank& rank = ranks[static_cast<std::size_t>(r)];
    if (rank.closing < schedules[static_cast<std::size_t>(r)].steps.size() || !rank.stream.empty())
      return fmt::format("{} ranks: rank {} stuck at step {} of {}, {} group(s) unfinished", n, r, rank.pc,
                         schedules[static_cast<std::size_t>(r)].steps.size(), rank.stream.size());
  }
  return {};
}

template <class T>
std::string nccl_deadlock(const T& topology, int n, std::size_t elements, CodecTraits traits) {
  std::vector<Schedule> schedules;
  for (int r = 0; r < n; ++r) schedules.push_back(topology.schedule(Group::world(r, n), elements, traits));
  return nccl_deadlock(schedules);
}

template <class C>
void check_ring(int n, std::size_t elements, std::size_t chunk, bool receives_at_use = false) {
  CAPTURE(n);
  CAPTURE(elements);
  CAPTURE(chunk);
  CAPTURE(receives_at_use);
  const C codec;
  const topology::Ring ring{.chunk_elements = chunk};
  std::vector<std::vector<float>> inputs, outputs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(elements, 1000u * static_cast<unsigned>(r) + elements));
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const Group group = Group::world(t.rank(), n);
    engine::BucketExchange<C, transport::InProcess> exchange(
        ring.schedule(group, elements, {.identity = C::identity, .receives_at_use = receives_at_use}), codec, DType::f32);
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

// Across all ranks' schedules, every send meets exactly one receive of the same size, slots fit
// their ranges, and nothing travels when there is nothing to exchange.
template <class Topology>
void check_pairing(const Topology& topology, int n) {
  CAPTURE(n);
  CAPTURE(topology.describe());
  for (std::size_t elements : {0u, 1u, 4u, 17u, 1000u}) {
    for (bool identity : {true, false}) {
      // (sender, receiver, message) -> elements
      std::map<std::tuple<int, int, std::uint32_t>, std::size_t> sends, recvs;
      for (int r = 0; r < n; ++r) {
        const Schedule s = topology.schedule(Group::world(r, n), elements, {.identity = identity});
        for (const Step& step : s.steps) {
          if (step.op == Step::Op::send) CHECK(sends.emplace(std::tuple{r, step.peer, step.message}, step.range.size()).second);
          if (step.op == Step::Op::recv) CHECK(recvs.emplace(std::tuple{step.peer, r, step.message}, step.range.size()).second);
          if (step.slot != no_slot) CHECK(s.slot_elements[step.slot] == step.range.size());
        }
        CHECK((s.slot_raw.empty() || s.slot_raw.size() == s.slot_elements.size()));
      }
      CHECK(sends == recvs);
      CHECK(sends.empty() == (n == 1 || elements == 0));
    }
  }
}

// The parameter server's arithmetic done by hand: each part's root adds the contributors' values
// in group order (the others' through the codec, its own as they are),
// averages over the contributors, and the contributors get the average through the codec.
template <class C>
std::vector<float> ps_reference(const C& codec, const topology::ParameterServer& ps,
                                const std::vector<std::vector<float>>& inputs) {
  const int n = static_cast<int>(inputs.size());
  const Group group = Group::world(0, n);
  const int contributors = ps.contributors(group);  // ranks 0 .. contributors-1 when dedicated
  const std::size_t elements = inputs[0].size();
  const std::size_t parts = ps.partitions ? ps.partitions : static_cast<std::size_t>(n);
  std::vector<float> out(elements);
  for (std::size_t p = 0; p < parts; ++p) {
    const int root = ps.root(group, p);
    const ElemRange range = topology::Ring::segment(elements, static_cast<int>(parts), static_cast<int>(p));
    for (std::size_t e = range.begin; e < range.end; ++e) {
      const auto contribution = [&](int s) {
        const float x = inputs[static_cast<std::size_t>(s)][e];
        return C::identity || s == root ? x : compression::round_trip(codec, x);
      };
      std::optional<float> sum;
      for (int s = 0; s < contributors; ++s) sum = sum ? *sum + contribution(s) : contribution(s);
      const float average = *sum / static_cast<float>(contributors);
      out[e] = C::identity || n == 1 ? average : compression::round_trip(codec, average);
    }
  }
  return out;
}

template <class C>
std::vector<std::vector<float>> run_ps(const C& codec, const topology::ParameterServer& ps,
                                       const std::vector<std::vector<float>>& inputs, int iterations = 1) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t elements = inputs[0].size();
  std::vector<std::vector<float>> outputs(static_cast<std::size_t>(n));
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const Group group = Group::world(t.rank(), n);
    engine::BucketExchange<C, transport::InProcess> exchange(ps.schedule(group, elements, codec_traits<C>()), codec,
                                                             DType::f32);
    auto& values = outputs[static_cast<std::size_t>(t.rank())];
    for (int iteration = 0; iteration < iterations; ++iteration) {
      values = inputs[static_cast<std::size_t>(t.rank())];
      exchange.run(std::span<float>(values), codec, t, {group, static_cast<std::uint64_t>(iteration), 0, 10s});
    }
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  return outputs;
}

// dependencies_of against brute force: edges point forward, counts match the edges, and every
// pair of steps whose list order matters (an `after`, or the same memory touched with one of them
// writing) is ordered by a path through the graph.
template <class Topology>
void check_dependencies(const Topology& topology, int n) {
  CAPTURE(n);
  CAPTURE(topology.describe());
  const auto writes_over = [](const Step& a, const Step& b) {
    const auto x = engine::access_of(a), y = engine::access_of(b);
    const bool ranges_meet = a.range.begin < b.range.end && b.range.begin < a.range.end;
    const bool values = ranges_meet && (x.reads_values || x.writes_values) && (y.reads_values || y.writes_values) &&
                        (x.writes_values || y.writes_values);
    const bool slot = a.slot != no_slot && a.slot == b.slot && (x.writes_slot || y.writes_slot);
    return values || slot;
  };
  for (std::size_t elements : {1u, 5u, 17u, 300u})
    for (bool identity : {true, false})
      for (int rank = 0; rank < n; ++rank) {
        CAPTURE(elements);
        CAPTURE(identity);
        CAPTURE(rank);
        const Schedule schedule = topology.schedule(Group::world(rank, n), elements, {.identity = identity});
        const auto graph = engine::dependencies_of(schedule);
        const std::size_t m = schedule.steps.size();
        std::vector<std::vector<bool>> reaches(m, std::vector<bool>(m));
        std::vector<std::uint32_t> incoming(m);
        for (std::size_t i = m; i-- > 0;)
          for (std::uint32_t e = graph.first[i]; e < graph.first[i + 1]; ++e) {
            const std::uint32_t next = graph.successors[e];
            REQUIRE(next > i);
            ++incoming[next];
            reaches[i][next] = true;
            for (std::size_t k = 0; k < m; ++k)
              if (reaches[next][k]) reaches[i][k] = true;
          }
        CHECK(incoming == graph.count);
        std::size_t roots = 0;
        for (std::size_t j = 0; j < m; ++j) {
          roots += graph.count[j] == 0;
          for (std::size_t i = 0; i < j; ++i)
            if (schedule.steps[j].after == i || writes_over(schedule.steps[i], schedule.steps[j])) {
              CAPTURE(i);
              CAPTURE(j);
              REQUIRE(reaches[i][j]);
            }
        }
        // Not a chain: independent steps exist where a rank has two receives or more to post
        // without waiting (not for a rank that only hands its bucket on and takes the average back,
        // as the log-depth topologies' folded ranks and a hierarchical leader's ranks do, nor for
        // a leader of two ranks that the fold hands on).
        const auto free_receives = std::count_if(schedule.steps.begin(), schedule.steps.end(), [](const Step& step) {
          return step.op == Step::Op::recv && step.after == no_step;
        });
        if (n > 1 && elements >= 17 && free_receives >= 2) CHECK(roots > 1);
      }
}


// The ring's schedules as they were before topology::detail::RingPhases was factored out of it,
// pinned: a readable listing of a small one, and a fingerprint of many shapes.
std::string listing(const Schedule& s) {
  std::string out = fmt::format("contributors {}; slots", s.contributors);
  for (std::size_t e : s.slot_elements) out += fmt::format(" {}", e);
  for (const Step& step : s.steps) {
    out += fmt::format("\n{} [{},{})", engine::name(step.op), step.range.begin, step.range.end);
    if (engine::is_transfer(step.op)) out += fmt::format(" peer {} message {}", step.peer, step.message);
    if (step.slot != no_slot) out += fmt::format(" slot {}", step.slot);
    if (step.after != no_step) out += fmt::format(" after {}", step.after);
  }
  return out;
}

std::uint64_t fingerprint(const Schedule& s, std::uint64_t h = 14695981039346656037ull) {
  const auto mix = [&](std::uint64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ull;
  };
  mix(static_cast<std::uint64_t>(s.contributors));
  mix(s.slot_elements.size());
  for (std::size_t e : s.slot_elements) mix(e);
  mix(s.steps.size());
  for (const Step& step : s.steps) {
    mix(static_cast<std::uint64_t>(step.op));
    mix(static_cast<std::uint64_t>(static_cast<std::int64_t>(step.peer)));
    mix(step.message);
    mix(step.range.begin);
    mix(step.range.end);
    mix(step.slot);
    mix(step.after);
  }
  return h;
}

// The hierarchical topology's arithmetic done by hand (hierarchical.hpp): shard s of L is summed
// within each machine starting at local rank s and going round; segment t of M of the shard is
// summed across machines starting at machine t and going round, each partial sum through the codec
// (compression::round_trip) before the next machine adds its own; the owner divides by n, and
// everyone gets the average after one more trip through the codec.
template <class C>
std::vector<float> hierarchical_reference(const C& codec, int per_machine, const std::vector<std::vector<float>>& inputs) {
  const int n = static_cast<int>(inputs.size());
  const int machines = n / per_machine;
  const std::size_t elements = inputs[0].size();
  const auto x = [&](int machine, int local, std::size_t e) {
    return inputs[static_cast<std::size_t>(machine * per_machine + local)][e];
  };
  std::vector<float> out(elements);
  for (int s = 0; s < per_machine; ++s) {
    const ElemRange shard = topology::Ring::segment(elements, per_machine, s);
    for (int t = 0; t < machines; ++t) {
      const ElemRange seg = topology::Ring::segment(shard.size(), machines, t);
      for (std::size_t e = shard.begin + seg.begin; e < shard.begin + seg.end; ++e) {
        const auto machine_sum = [&](int m) {
          float sum = x(m, s, e);
          for (int k = 1; k < per_machine; ++k) sum = x(m, (s + k) % per_machine, e) + sum;
          return sum;
        };
        float partial = machine_sum(t);
        for (int k = 1; k < machines; ++k) {
          const float arrived = C::identity ? partial : compression::round_trip(codec, partial);
          partial = machine_sum((t + k) % machines) + arrived;
        }
        const float average = partial / static_cast<float>(n);
        out[e] = C::identity ? average : compression::round_trip(codec, average);
      }
    }
  }
  return out;
}

// Runs `topology` on in-process ranks, `iterations` times over the same inputs; returns every
// rank's values and the last iteration's exchange statistics.
template <class C, class Topology>
std::pair<std::vector<std::vector<float>>, std::vector<ExchangeStats>> run_topology(
    const C& codec, const Topology& topology, const std::vector<std::vector<float>>& inputs, int iterations = 1,
    bool receives_at_use = false) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t elements = inputs[0].size();
  std::vector<std::vector<float>> outputs(static_cast<std::size_t>(n));
  std::vector<ExchangeStats> stats(static_cast<std::size_t>(n));
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const Group group = Group::world(t.rank(), n);
    const auto r = static_cast<std::size_t>(t.rank());
    CodecTraits traits = codec_traits<C>();
    traits.receives_at_use = receives_at_use;
    engine::BucketExchange<C, transport::InProcess> exchange(topology.schedule(group, elements, traits), codec, DType::f32);
    for (int iteration = 0; iteration < iterations; ++iteration) {
      outputs[r] = inputs[r];
      stats[r] = exchange.run(std::span<float>(outputs[r]), codec, t, {group, static_cast<std::uint64_t>(iteration), 0, 10s});
    }
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  return {outputs, stats};
}

// Shapes (machines, ranks per machine) the hierarchical tests run.
const std::vector<std::pair<int, int>> machine_shapes{{2, 2}, {2, 3}, {3, 2}, {1, 3}, {3, 1}};

// Hierarchical's arrangements (within, across), each forced (not left to the links' prediction).
using Across = topology::Hierarchical::Across;
using Within = topology::Hierarchical::Within;
using Arrangement = topology::Hierarchical::Arrangement;
const std::vector<Arrangement> every_arrangement = [] {
  std::vector<Arrangement> all;
  for (std::size_t k = 0; k < topology::Hierarchical::candidates; ++k) all.push_back(topology::Hierarchical::candidate(k));
  return all;
}();

}  // namespace

TEST_SUITE("topology") {
  TEST_CASE("the ring's schedules are pinned: the same steps and message ids as before RingPhases") {
    // Rank 1 of 2, 3 elements in pieces of 1, through a codec: segment 0 (two pieces) is its own.
    const Schedule small = topology::Ring{.chunk_elements = 1}.schedule(Group::world(1, 2), 3, {.identity = false});
    CHECK(listing(small) ==
          "contributors 2; slots 1 1 1 1 1 1\n"
          "recv [0,1) peer 0 message 0 slot 0\n"
          "recv [1,2) peer 0 message 1 slot 1\n"
          "recv [2,3) peer 0 message 2 slot 2\n"
          "encode [2,3) slot 3\n"
          "send [2,3) peer 0 message 0 slot 3\n"
          "decode-add [0,1) slot 0 after 0\n"
          "average [0,1)\n"
          "encode [0,1) slot 4\n"
          "decode-copy [0,1) slot 4\n"
          "send [0,1) peer 0 message 2 slot 4\n"
          "decode-add [1,2) slot 1 after 1\n"
          "average [1,2)\n"
          "encode [1,2) slot 5\n"
          "decode-copy [1,2) slot 5\n"
          "send [1,2) peer 0 message 3 slot 5\n"
          "decode-copy [2,3) slot 2 after 2");
    CHECK(small.slot_raw.empty());
    // Every rank's schedule for many shapes, identity codec first: one fingerprint per (codec kind,
    // world size), taken from the ring as it was written before the refactor.
    const std::vector<std::uint64_t> pinned{
        0xb01f9eacf186f80a, 0x96f6baa6e8cb82d7, 0xdf7bccbf865798c5, 0x9fd4798ef0d0e7e9,
        0xed819b7173b1f34e, 0xfc871cfcd474c45c, 0x5c2136f079e17277, 0x2fe11cefa50ddb46,
        0xced242f62d824f1d, 0xdd7c164fc4d5b3e6, 0xfbea58bb34411c50, 0xefda10a525cfcb30};
    std::size_t next = 0;
    for (bool identity : {true, false})
      for (int n : {1, 2, 3, 4, 5, 8}) {
        CAPTURE(identity);
        CAPTURE(n);
        std::uint64_t h = 14695981039346656037ull;
        for (std::size_t elements : {0u, 1u, 7u, 100u, 1009u})
          for (std::size_t chunk : {1u, 3u, 1u << 18})
            for (int r = 0; r < n; ++r)
              h = fingerprint(
                  topology::Ring{.chunk_elements = chunk}.schedule(Group::world(r, n), elements, {.identity = identity}), h);
        CHECK(h == pinned[next++]);
      }
  }

  TEST_CASE("every hierarchical send meets exactly one receive of the same size") {
    for (const auto& shape : std::vector<std::pair<int, int>>{{1, 4}, {4, 1}, {2, 2}, {2, 3}, {3, 2}, {1, 1}})
      for (std::size_t chunk : {std::size_t{3}, std::size_t{8}, std::size_t{1} << 18})
        for (const Arrangement a : every_arrangement) {
          const int machines = shape.first, per_machine = shape.second;
          CAPTURE(machines);
          CAPTURE(topology::Hierarchical::describe(a));
          check_pairing(topology::Hierarchical{.ranks_per_machine = per_machine, .chunk_elements = chunk, .across = a.across, .within = a.within},
                        machines * per_machine);
        }
  }

  TEST_CASE("the hierarchical schedule: raw hops within a machine, the codec across, Ring's with one rank per machine") {
    for (const Arrangement a : every_arrangement)
    for (int rank = 0; rank < 6; ++rank) {
      CAPTURE(topology::Hierarchical::describe(a));
      CAPTURE(rank);
      const topology::Hierarchical two{.ranks_per_machine = 2, .chunk_elements = 5, .across = a.across, .within = a.within};
      const Group group = Group::world(rank, 6);
      const Schedule s = two.schedule(group, 100, {.identity = false});
      // 3 machines fold onto 2 (fold.hpp): the fold-out is the log-depth schedule's last message id.
      std::uint32_t fold_out = 0;
      for (const Step& step : s.steps)
        if (engine::is_transfer(step.op) && step.peer / 2 != rank / 2) fold_out = std::max(fold_out, step.message);
      CHECK(s.contributors == 6);
      REQUIRE(s.slot_raw.size() == s.slot_elements.size());
      for (const Step& step : s.steps) {
        if (!engine::is_transfer(step.op)) continue;
        const bool same_machine = step.peer / 2 == rank / 2;
        CHECK(same_machine != (step.peer % 2 == rank % 2));  // a peer on this machine, or this local rank elsewhere
        if (same_machine) CHECK((step.slot == no_slot || s.raw(step.slot)));  // in place, or into a raw slot
        else if (step.slot != no_slot) CHECK(!s.raw(step.slot));             // encoded
        else CHECK((a.across != Across::ring && step.message == fold_out));     // the fold's average coming back (fold.hpp)
      }
    }
    // One rank per machine: the ring, step for step.
    for (int n : {1, 2, 3, 5})
      for (bool identity : {true, false})
        for (int rank = 0; rank < n; ++rank) {
          const Group group = Group::world(rank, n);
          const topology::Hierarchical flat{.ranks_per_machine = 1, .chunk_elements = 3, .across = Across::ring};
          CHECK(listing(flat.schedule(group, 50, {.identity = identity})) ==
                listing(topology::Ring{.chunk_elements = 3}.schedule(group, 50, {.identity = identity})));
        }
  }

  TEST_CASE("the hierarchical schedule is pipelined: column by column, the link pacing the machine's reduce-scatter") {
    // 2 machines of 2, 1000 elements, pieces of at most 50: each rank's shard of 500 is 2 segments
    // across machines of 250, each cut 12, 25, 44 x 4, 25, 12 (the first two and last two pieces
    // tapered), so 8 columns of 2 pieces within the machine.
    const topology::Hierarchical two{.ranks_per_machine = 2, .chunk_elements = 50, .across = Across::ring};
    for (bool identity : {true, false})
      for (int rank = 0; rank < 4; ++rank) {
        CAPTURE(identity);
        CAPTURE(rank);
        const Schedule s = two.schedule(Group::world(rank, 4), 1000, {.identity = identity});
        const auto across = [&](const Step& step) { return step.peer / 2 != rank / 2; };
        std::set<std::pair<std::size_t, std::size_t>> within_pieces;
        std::vector<std::size_t> first_sizes;  // of the first transfers in list order
        std::size_t within_sends = 0, within_sends_before_across = 0, paced = 0, gathered = 0;
        bool across_yet = false;
        for (const Step& step : s.steps) {
          if (!engine::is_transfer(step.op)) continue;
          if (first_sizes.size() < 2) first_sizes.push_back(step.range.size());
          if (across(step)) {
            across_yet = across_yet || step.op == Step::Op::send;
            continue;
          }
          within_pieces.emplace(step.range.begin, step.range.end);
          if (step.op != Step::Op::send) continue;
          ++within_sends;
          within_sends_before_across += !across_yet;
          const bool after_across =
              step.after != no_step && s.steps[step.after].op == Step::Op::recv && across(s.steps[step.after]);
          (step.message < 16 ? paced : gathered) += after_across;  // messages 0..15 reduce-scatter, 16..31 allgather
        }
        // Every piece across machines is one piece within, so the graph links exactly those.
        for (const Step& step : s.steps)
          if (engine::is_transfer(step.op) && across(step))
            CHECK(within_pieces.count({step.range.begin, step.range.end}) == 1);
        // Every piece is one of the tapered cut's sizes, and the first column is the smallest.
        for (const auto& [begin, end] : within_pieces) CHECK((end - begin == 12 || end - begin == 25 || end - begin == 44));
        CHECK(first_sizes == std::vector<std::size_t>{12, 12});
        // The link starts after two columns of the reduce-scatter within (16 sends each way in
        // all: 8 columns x 2 pieces, reduce-scatter and allgather, one hop each), not after all.
        CHECK(within_sends == 32);
        CHECK(within_sends_before_across == 4);
        // Columns 2..7 wait for the link: their first sends follow a receive from across.
        CHECK(paced == 6 * 2);
        // Of each column's 2 pieces of the shard, one is finished on the other machine: its send
        // round this machine follows the receive that brings it.
        CHECK(gathered == 8);
      }
  }

  TEST_CASE("a tapered cut tiles its part: a quarter and a half chunk at each end, even pieces between") {
    for (std::size_t chunk : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{50}, std::size_t{1} << 16})
      for (bool taper : {false, true}) {
        const topology::detail::PieceCut cut{.chunk = chunk, .taper = taper};
        std::size_t previous_count = 0;
        for (std::size_t part : {std::size_t{0}, std::size_t{1}, chunk, 4 * chunk - 1, 4 * chunk, 4 * chunk + 1,
                                 7 * chunk + 3, 40 * chunk + 1}) {
          CAPTURE(chunk);
          CAPTURE(taper);
          CAPTURE(part);
          const std::size_t count = cut.count(part);
          CHECK(count >= previous_count);  // more elements never give fewer pieces
          previous_count = count;
          std::size_t next = 0;
          for (std::size_t q = 0; q < count; ++q) {
            const ElemRange piece = cut.piece(part, q);
            REQUIRE(piece.begin == next);
            REQUIRE(!piece.empty());
            CHECK(piece.size() <= chunk);
            next = piece.end;
          }
          CHECK(next == part);
          CHECK(cut.piece(part, count).empty());
          if (cut.tapers(part)) {
            CHECK(cut.piece(part, 0).size() == chunk / 4);
            CHECK(cut.piece(part, 1).size() == chunk / 2);
            CHECK(cut.piece(part, count - 2).size() == chunk / 2);
            CHECK(cut.piece(part, count - 1).size() == chunk / 4);
          }
          CHECK(cut.tapers(part) == (taper && chunk >= 4 && part >= 4 * chunk));
        }
      }
  }

  TEST_CASE("receives that only feed an add may add on arrival: the ring's reduce-scatter, hierarchical's hops within a machine") {
    // 4 ranks, 1000 elements: segments of 250, pieces of at most 100, so 3 per segment.
    const Group group = Group::world(1, 4);
    const topology::Ring ring{.chunk_elements = 100};
    using Exchange = engine::BucketExchange<compression::None, transport::InProcess>;
    CHECK(Exchange(ring.schedule(group, 1000, {.identity = true}), {}, DType::f32).receives_that_may_add() == 3 * 3);
    // A codec's encodings must be decoded: nothing to add on arrival, unless selective compression
    // left the bucket raw.
    using Fp16Exchange = engine::BucketExchange<compression::Fp16, transport::InProcess>;
    CHECK(Fp16Exchange(ring.schedule(group, 1000, {}), {}, DType::f32).receives_that_may_add() == 0);
    CHECK(Fp16Exchange(ring.schedule(group, 1000, {.identity = true}), {}, DType::f32, true).receives_that_may_add() == 9);
    // 2 machines of 2: the reduce-scatter within the machine (segments of 500, cut in 2 parts of
    // 250 like the ring across, 3 pieces each) adds on arrival whatever the codec; the ring across
    // machines, compressed, does not.
    const topology::Hierarchical two{.ranks_per_machine = 2, .chunk_elements = 100, .across = Across::ring};
    CHECK(Fp16Exchange(two.schedule(group, 1000, {}), {}, DType::f32).receives_that_may_add() == 6);
  }

  TEST_CASE("a hierarchical group that is not whole machines is refused") {
    for (const auto& bad : std::vector<std::tuple<int, int, std::string>>{
             {2, 3, "a group of 3 ranks is not whole machines of 2 ranks each"},
             {4, 6, "a group of 6 ranks is not whole machines of 4 ranks each"},
             {0, 4, "ranks_per_machine is 0"},
             {-1, 4, "ranks_per_machine is -1"}}) {
      const auto& [per_machine, n, why] = bad;
      CAPTURE(std::get<0>(bad));
      try {
        (void)topology::Hierarchical{.ranks_per_machine = per_machine}.schedule(Group::world(0, n), 10, {});
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::invalid_argument);
        CHECK(std::string(e.what()).find(why) != std::string::npos);
      }
    }
  }

  TEST_CASE_TEMPLATE("hierarchical allreduce: every rank the same bits, equal to the reference in its summation order", C,
                     compression::None, compression::Fp16, compression::Bf16) {
    const C codec;
    for (const auto& shape : machine_shapes)
      for (std::size_t elements : {1u, 2u, 7u, 13u, 1009u})
        for (std::size_t chunk : {std::size_t{4}, std::size_t{1} << 18})
          for (bool receives_at_use : {false, true}) {  // the listing for tagged transports, and NCCL's
            const int machines = shape.first, per_machine = shape.second;
            const int n = machines * per_machine;
            CAPTURE(machines);
            CAPTURE(per_machine);
            CAPTURE(elements);
            CAPTURE(chunk);
            CAPTURE(receives_at_use);
            std::vector<std::vector<float>> inputs;
            for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(elements, 300u * static_cast<unsigned>(r) + elements));
            const topology::Hierarchical hierarchical{
                .ranks_per_machine = per_machine, .chunk_elements = chunk, .across = Across::ring};
            const auto outputs = run_topology(codec, hierarchical, inputs, 2, receives_at_use).first;
            const auto reference = hierarchical_reference(codec, per_machine, inputs);
            for (int r = 0; r < n; ++r) {
              CAPTURE(r);
              REQUIRE(std::memcmp(outputs[static_cast<std::size_t>(r)].data(), reference.data(), elements * sizeof(float)) == 0);
            }
            if constexpr (C::identity)
              for (std::size_t e = 0; e < elements; ++e) {
                double exact = 0, scale = 0;
                for (const auto& in : inputs) {
                  exact += in[e];
                  scale += std::fabs(in[e]);
                }
                REQUIRE(std::fabs(reference[e] - exact / n) <= 1e-6 * scale / n);
              }
          }
  }

  TEST_CASE("hierarchical with error feedback: the same bits everywhere, compressed across machines only") {
    using C = compression::ErrorFeedback<compression::TwoBit>;
    const C codec{{.threshold = 0.25f}};
    for (const auto& shape : machine_shapes)
    for (const Arrangement a : every_arrangement) {
      const int machines = shape.first, per_machine = shape.second;
      const int n = machines * per_machine;
      CAPTURE(machines);
      CAPTURE(per_machine);
      CAPTURE(topology::Hierarchical::describe(a));
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(301, 11u * static_cast<unsigned>(r)));
      const topology::Hierarchical hierarchical{.ranks_per_machine = per_machine, .chunk_elements = 16, .across = a.across, .within = a.within};
      const auto [outputs, stats] = run_topology(codec, hierarchical, inputs, 3);
      // Receives listed at use (transport::Nccl) change the order of the list, not the bits.
      CHECK(run_topology(codec, hierarchical, inputs, 3, /*receives_at_use=*/true).first == outputs);
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(outputs[static_cast<std::size_t>(r)] == outputs[0]);
        const auto& st = stats[static_cast<std::size_t>(r)];
        // Within a machine values travel as they are; across machines two-bit packs 16 to a word.
        // Through a leader only local rank 0 sends across.
        const bool sends_across = machines > 1 && (a.within != Within::leader || r % per_machine == 0);
        if (sends_across) CHECK(st.bytes_sent < st.bytes_uncompressed);
        else CHECK(st.bytes_sent == st.bytes_uncompressed);
      }
    }
  }

  TEST_CASE("every ring send meets exactly one receive of the same size") {
    for (int n : {1, 2, 3, 5, 8}) check_pairing(topology::Ring{.chunk_elements = 3}, n);
  }

  TEST_CASE("topology: the parameter server's lists, and Ring's and Hierarchical's with receives at use, get "
          "through NCCL's all-or-nothing groups") {
  for (int n = 1; n <= 6; ++n)
    for (std::size_t elements : {5u, 1000u, 100003u})
      for (std::size_t chunk : {64u, 1u << 18})
        for (bool identity : {true, false}) {
          CAPTURE(n);
          CAPTURE(elements);
          CAPTURE(chunk);
          CAPTURE(identity);
          for (std::size_t partitions : {0u, 5u})
            for (std::size_t servers = 0; servers < static_cast<std::size_t>(n); ++servers)
              for (bool dedicated : {false, true}) {
                if (dedicated && servers == 0) continue;
                const std::string stuck = nccl_deadlock(
                    topology::ParameterServer{
                        .partitions = partitions, .servers = servers, .dedicated = dedicated, .chunk_elements = chunk},
                    n, elements, {.identity = identity});
                CHECK_MESSAGE(stuck.empty(), "parameter server: " << stuck);
              }
          const std::string stuck_rd =
              nccl_deadlock(topology::RecursiveDoubling{}, n, elements, {.identity = identity, .receives_at_use = true});
          CHECK_MESSAGE(stuck_rd.empty(), "recursive doubling, receives at use: " << stuck_rd);
          const std::string stuck_hd =
              nccl_deadlock(topology::HalvingDoubling{}, n, elements, {.identity = identity, .receives_at_use = true});
          CHECK_MESSAGE(stuck_hd.empty(), "halving-doubling, receives at use: " << stuck_hd);
          const topology::Ring ring{.chunk_elements = chunk};
          const std::string stuck = nccl_deadlock(ring, n, elements, {.identity = identity, .receives_at_use = true});
          CHECK_MESSAGE(stuck.empty(), "ring, receives at use: " << stuck);
          CHECK_MESSAGE(pair_order_broken(ring, n, elements, identity, true).empty(), "ring, receives at use");
          for (int per_machine = 1; per_machine <= n; ++per_machine) {
            if (n % per_machine != 0) continue;
            for (const Arrangement a : every_arrangement) {
              const topology::Hierarchical hierarchical{.ranks_per_machine = per_machine, .chunk_elements = chunk, .across = a.across, .within = a.within};
              const std::string stuck_h =
                  nccl_deadlock(hierarchical, n, elements, {.identity = identity, .receives_at_use = true});
              CHECK_MESSAGE(stuck_h.empty(), "hierarchical, " << per_machine << " ranks per machine, "
                                                              << topology::Hierarchical::describe(a) << ": " << stuck_h);
            }
          }
          // Listed up front (for tagged transports, so that data lands where it goes), every
          // receive of the ring comes before its first send: over NCCL the first wait would flush
          // receives of later steps, which the neighbour sends only after its own first group.
          const bool hangs = n >= 3 || (n == 2 && !identity);
          CHECK(nccl_deadlock(ring, n, elements, {.identity = identity}).empty() == !hangs);
        }
}

TEST_CASE("topology: Ring with receives at use gives the same bits") {
  for (int n : {2, 3, 5})
    for (std::size_t elements : {1u, 1000u, 4099u}) {
      check_ring<compression::None>(n, elements, 64, true);
      check_ring<compression::TwoBit>(n, elements, 64, true);
    }
}

TEST_CASE("the task graph orders every pair of steps that list order relies on") {
    for (int n : {1, 2, 3, 5}) {
      check_dependencies(topology::Ring{.chunk_elements = 7}, n);
      check_dependencies(topology::ParameterServer{.partitions = 7, .chunk_elements = 5}, n);
      check_dependencies(topology::ParameterServer{.partitions = 2, .servers = 1}, n);
      for (const Arrangement a : every_arrangement) {
        check_dependencies(topology::Hierarchical{.ranks_per_machine = 1, .chunk_elements = 7, .across = a.across, .within = a.within}, n);
        check_dependencies(topology::Hierarchical{.ranks_per_machine = n, .chunk_elements = 4, .across = a.across, .within = a.within}, n);
      }
      check_dependencies(topology::RecursiveDoubling{}, n);
      check_dependencies(topology::HalvingDoubling{}, n);
      if (n > 1) check_dependencies(topology::ParameterServer{.partitions = 3, .servers = 1, .dedicated = true}, n);
    }
    for (const Arrangement a : every_arrangement) {
      check_dependencies(topology::Hierarchical{.ranks_per_machine = 2, .chunk_elements = 4, .across = a.across, .within = a.within}, 4);
      check_dependencies(topology::Hierarchical{.ranks_per_machine = 2, .chunk_elements = 3, .across = a.across, .within = a.within}, 6);
      check_dependencies(topology::Hierarchical{.ranks_per_machine = 3, .chunk_elements = 5, .across = a.across, .within = a.within}, 6);
      check_dependencies(topology::Hierarchical{.ranks_per_machine = 2, .chunk_elements = 4, .across = a.across, .within = a.within}, 10);
    }
    for (int n : {6, 8}) {
      check_dependencies(topology::RecursiveDoubling{}, n);
      check_dependencies(topology::HalvingDoubling{}, n);
    }
  }

  TEST_CASE("a bucket left uncompressed by selective compression is exact, whatever the codec") {
    using C = compression::ErrorFeedback<compression::TwoBit>;
    const C codec;
    for (int n : {2, 3, 5}) {
      CAPTURE(n);
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(301, 77u * static_cast<unsigned>(r)));
      const topology::Ring ring{.chunk_elements = 16};
      const topology::ParameterServer ps{.partitions = 4, .chunk_elements = 9};
      std::vector<std::vector<float>> ring_out(static_cast<std::size_t>(n)), ps_out(static_cast<std::size_t>(n));
      const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
        const Group group = Group::world(t.rank(), n);
        const auto r = static_cast<std::size_t>(t.rank());
        engine::BucketExchange<C, transport::InProcess> on_ring(ring.schedule(group, 301, {.identity = true}), codec,
                                                                 DType::f32, true);
        engine::BucketExchange<C, transport::InProcess> on_ps(ps.schedule(group, 301, {.identity = true}), codec,
                                                               DType::f32, true);
        ring_out[r] = inputs[r];
        on_ring.run(std::span<float>(ring_out[r]), codec, t, {group, 0, 0, 10s});
        ps_out[r] = inputs[r];
        on_ps.run(std::span<float>(ps_out[r]), codec, t, {group, 0, 1, 10s});
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
      const auto ring_reference = test::ring_reference(compression::None{}, inputs);
      const auto ps_expected = ps_reference(compression::None{}, ps, inputs);
      for (int r = 0; r < n; ++r) {
        CHECK(ring_out[static_cast<std::size_t>(r)] == ring_reference);
        CHECK(ps_out[static_cast<std::size_t>(r)] == ps_expected);
      }
    }
  }

  TEST_CASE("selective compression's cost model") {
    SUBCASE("the fit recovers a line, and clamps what cannot be negative") {
      const std::vector<std::pair<double, double>> line{{1000, 2e-5}, {2000, 3e-5}, {4000, 5e-5}};
      const engine::Linear l = engine::fit(line);
      CHECK(l.fixed == doctest::Approx(1e-5));
      CHECK(l.per_byte == doctest::Approx(1e-8));
      const std::vector<std::pair<double, double>> falling{{1000, 3e-5}, {2000, 1e-5}};
      CHECK(engine::fit(falling).per_byte == 0);
      const std::vector<std::pair<double, double>> one{{1000, 4e-5}};
      CHECK(engine::fit(one).fixed == doctest::Approx(4e-5));
    }
    // A 1 Gbit/s link with 50 us per message; encode at 3 GB/s and decode at 15 GB/s with 5 us
    // each; a 16x codec with an 8-byte header, on a 4-rank ring.
    const engine::CostModel model{.encode = {5e-6, 1 / 3e9}, .decode = {5e-6, 1 / 15e9}, .transfer = {50e-6, 1 / 125e6}};
    const auto two_bit_bytes = [](std::size_t e) { return 12 + 4 * ((e + 15) / 16); };
    const Group four = Group::world(0, 4);
    const topology::Ring ring;
    SUBCASE("a large bucket is compressed and pipelined") {
      const auto d = engine::decide(model, ring.shape(four, 25u << 18), 4, two_bit_bytes);  // 25 MiB of f32
      CHECK(d.compress);
      CHECK(d.pieces > 1);
      CHECK(d.predicted < d.uncompressed / 4);
    }
    SUBCASE("a tiny bucket goes as it is: fixed costs dominate") {
      const auto d = engine::decide(model, ring.shape(four, 64), 4, two_bit_bytes);
      CHECK_FALSE(d.compress);
      CHECK(d.pieces == 1);
    }
    SUBCASE("on a fast enough link compression does not pay") {
      engine::CostModel fast = model;
      fast.transfer = {2e-6, 1 / 50e9};
      CHECK_FALSE(engine::decide(fast, ring.shape(four, 25u << 18), 4, two_bit_bytes).compress);
    }
    SUBCASE("alone, there is nothing to send and nothing to decide") {
      const auto d = engine::decide(model, ring.shape(Group::world(0, 1), 1000), 4, two_bit_bytes);
      CHECK_FALSE(d.compress);
      CHECK(d.predicted == 0);
    }
    SUBCASE("a parameter server's fan-in counts on the root's link") {
      const topology::ParameterServer ps;
      const PipelineShape shape = ps.shape(four, 1000);
      CHECK(shape.hops == 2);
      CHECK(shape.fan_in == 3);
      CHECK(shape.segment_elements == 250);
    }
  }

  TEST_CASE("the coordinator's plan grants every piece once, after its receive, within the link limits") {
    // Random piece sets whose sends and receives are reported in random order, interleaved with
    // random completions: every piece is granted exactly once and only once its receive is
    // posted, a pair's grantable pieces in the order reported; a batch holds one pair's pieces and
    // closes once it reaches batch_bytes; no link ever carries more than `window` batches; and
    // the plan is work-conserving (a pair with a grantable piece left has a full link).
    for (std::uint64_t seed = 0; seed < 300; ++seed) {
      CAPTURE(seed);
      std::mt19937_64 gen(seed);
      const auto pick = [&](std::uint64_t bound) { return static_cast<std::uint64_t>(gen() % bound); };
      const int n = 2 + static_cast<int>(pick(7));
      const Coordination limits{.enabled = true, .window = 1 + static_cast<int>(pick(3)),
                                .batch_bytes = std::vector<std::size_t>{0, 100, 1000, 1 << 20}[pick(4)]};
      struct Piece {
        int sender, destination;
        std::uint32_t bytes;
        bool ready = false, receiving = false;
      };
      std::map<std::uint64_t, Piece> pieces;  // by task id; the tag is the task id plus one
      std::vector<std::pair<std::uint64_t, bool>> events;  // (task, receive side)
      for (std::size_t i = 0, count = pick(200); i < count; ++i) {
        const int s = static_cast<int>(pick(static_cast<std::uint64_t>(n)));
        const int d = (s + 1 + static_cast<int>(pick(static_cast<std::uint64_t>(n - 1)))) % n;
        const std::uint64_t task = (std::uint64_t{static_cast<std::uint32_t>(s)} << 32) | i;
        pieces[task] = {s, d, static_cast<std::uint32_t>(1 + pick(500))};
        events.push_back({task, false});
        events.push_back({task, true});
      }
      std::shuffle(events.begin(), events.end(), gen);

      engine::TransmissionPlanner planner(n, limits);
      std::map<std::pair<int, int>, std::vector<std::uint64_t>> queued;  // reported sends not yet granted, per pair
      std::vector<std::pair<int, int>> in_flight;                        // granted pieces not yet sent
      std::set<std::uint64_t> granted;
      const auto grantable = [&](std::uint64_t task) { return pieces.at(task).ready && pieces.at(task).receiving; };
      const auto plan = [&] {
        planner.plan([&](int s, int d, std::span<const std::uint64_t> batch) {
          REQUIRE_FALSE(batch.empty());
          auto& q = queued[{s, d}];
          std::vector<std::uint64_t> expected;  // this pair's grantable pieces, oldest first
          for (std::uint64_t task : q)
            if (grantable(task)) expected.push_back(task);
          REQUIRE(batch.size() <= expected.size());
          std::size_t bytes = 0;
          for (std::size_t k = 0; k < batch.size(); ++k) {
            CHECK(batch[k] == expected[k]);
            CHECK(granted.insert(batch[k]).second);
            const Piece& p = pieces.at(batch[k]);
            CHECK((p.sender == s && p.destination == d));
            if (k > 0) CHECK(bytes < limits.batch_bytes);  // the batch was still open
            bytes += p.bytes;
            in_flight.push_back({s, d});
            q.erase(std::find(q.begin(), q.end(), batch[k]));
          }
          if (batch.size() < expected.size()) CHECK(bytes >= limits.batch_bytes);  // it closed because it was full
          CHECK(planner.uplink_batches(s) <= limits.window);
          CHECK(planner.downlink_batches(d) <= limits.window);
        });
        for (const auto& [pair, q] : queued)
          if (std::any_of(q.begin(), q.end(), grantable))
            CHECK((planner.uplink_batches(pair.first) == limits.window || planner.downlink_batches(pair.second) == limits.window));
      };
      while (!events.empty() || !in_flight.empty()) {
        if (!events.empty() && (in_flight.empty() || pick(2) == 0)) {
          const auto [task, receive_side] = events.back();
          events.pop_back();
          Piece& p = pieces.at(task);
          if (receive_side) {
            p.receiving = true;
            planner.receiving(p.sender, p.destination, task + 1);
          } else {
            p.ready = true;
            planner.ready(p.sender, p.destination, task + 1, p.bytes, task);
            queued[{p.sender, p.destination}].push_back(task);
          }
        } else {
          const std::size_t k = pick(in_flight.size());
          planner.sent(in_flight[k].first, in_flight[k].second);
          in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(k));
        }
        plan();
      }
      CHECK(granted.size() == pieces.size());
      CHECK(planner.queued() == 0);
      for (int r = 0; r < n; ++r) {
        CHECK(planner.uplink_batches(r) == 0);
        CHECK(planner.downlink_batches(r) == 0);
      }
    }
  }

  TEST_CASE("coordinator messages are checked before use") {
    using namespace engine::coordinator_wire;
    std::vector<std::byte> buffer(message_bytes<ReportEntry>(max_entries));
    const std::vector<ReportEntry> entries{{Event::ready, 2, 5, 77, 4096}, {Event::sent, 1, 0, 0, 0}};
    const std::size_t length = write(std::span(buffer), Kind::report, 3, std::span<const ReportEntry>(entries));
    std::vector<ReportEntry> out;
    read(std::span<const std::byte>(buffer.data(), length), Kind::report, 3, out);
    REQUIRE(out.size() == 2);
    CHECK(out[0].task == 77);
    CHECK(out[1].peer == 1);
    const auto refused = [&](std::vector<std::byte> message, Kind kind, int sender, const char* why) {
      CAPTURE(why);
      try {
        read(std::span<const std::byte>(message), kind, sender, out);
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::protocol);
        CHECK(e.detail().find(why) != std::string::npos);
      }
    };
    const std::vector<std::byte> good(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(length));
    refused({good.begin(), good.begin() + 10}, Kind::report, 3, "shorter than its header");
    refused({good.begin(), good.end() - 1}, Kind::report, 3, "2 entries in 79 bytes");
    refused(good, Kind::report, 2, "wrong kind or sender");
    refused(good, Kind::grant, 3, "wrong kind or sender");
    auto versioned = good;
    versioned[4] = std::byte{9};
    refused(versioned, Kind::report, 3, "wire version 9");
    auto foreign = good;
    foreign[0] = std::byte{0};
    refused(foreign, Kind::report, 3, "not a coordinator message");
    // A finished send the coordinator never granted is refused too.
    engine::TransmissionPlanner planner(3, {.enabled = true});
    CHECK_THROWS_WITH_AS(planner.sent(1, 2), doctest::Contains("never granted"), Error);
    CHECK_THROWS_WITH_AS(planner.ready(1, 1, 5, 10, 0), doctest::Contains("for group rank 1"), Error);
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

  TEST_CASE("every parameter-server send meets exactly one receive of the same size") {
    for (int n : {1, 2, 3, 5}) {
      check_pairing(topology::ParameterServer{.chunk_elements = 3}, n);
      check_pairing(topology::ParameterServer{.partitions = 7, .servers = 2}, n);
      if (n > 1) check_pairing(topology::ParameterServer{.partitions = 7, .servers = 1, .dedicated = true}, n);
      if (n > 2) check_pairing(topology::ParameterServer{.partitions = 3, .servers = 2, .dedicated = true}, n);
    }
  }

  TEST_CASE("a schedule that averages without saying over how many ranks is refused") {
    Schedule schedule = topology::Ring{}.schedule(Group::world(0, 1), 10, {.identity = true});
    REQUIRE(schedule.contributors == 1);
    schedule.contributors = 0;  // as a user's topology that never sets it
    try {
      engine::BucketExchange<compression::None, transport::InProcess> exchange(schedule, {}, DType::f32);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      CHECK(std::string(e.what()).find("Schedule::contributors") != std::string::npos);
    }
  }

  TEST_CASE("dedicated parameter servers: placement, roles, and placements that cannot work") {
    const topology::ParameterServer ps{.partitions = 5, .servers = 2, .dedicated = true};
    for (int rank = 0; rank < 5; ++rank) {
      const Group group = Group::world(rank, 5);
      CHECK(ps.aggregates_only(group) == (rank >= 3));
      CHECK(ps.contributors(group) == 3);
      const Schedule s = ps.schedule(group, 100, {});
      CHECK(s.contributors == 3);
      for (const Step& step : s.steps)
        if (step.op == Step::Op::send || step.op == Step::Op::recv) {
          CAPTURE(rank);
          CHECK((rank >= 3) != (step.peer >= 3));  // workers talk to servers only, and servers to workers
        }
    }
    for (std::size_t p = 0; p < 5; ++p) CHECK(ps.root(Group::world(0, 5), p) == 3 + static_cast<int>(p % 2));
    CHECK_FALSE(topology::ParameterServer{.servers = 2}.aggregates_only(Group::world(4, 5)));  // co-located
    for (const topology::ParameterServer bad :
         {topology::ParameterServer{.dedicated = true}, topology::ParameterServer{.servers = 3, .dedicated = true}}) {
      CAPTURE(bad.describe());
      try {
        (void)bad.schedule(Group::world(0, 3), 10, {});
        FAIL("a placement with no worker or no server was accepted");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::invalid_argument);
        CHECK(std::string(e.what()).find("dedicated servers in a group of 3") != std::string::npos);
      }
    }
  }

  TEST_CASE_TEMPLATE("parameter server: every rank ends with the root's bits, equal to the reference", C,
                     compression::None, compression::Fp16, compression::TwoBit) {
    const C codec;
    for (int n : {1, 2, 3, 4, 5}) {
      // Partitions dividing evenly or not, more partitions than elements, roots on some ranks only,
      // pieces smaller than a partition.
      // Dedicated servers (one, or two with more partitions than elements): the workers end with
      // the reference, and each server with it on the parts it serves.
      std::vector<topology::ParameterServer> placements{
          topology::ParameterServer{}, topology::ParameterServer{.partitions = 7},
          topology::ParameterServer{.partitions = 3, .servers = 1},
          topology::ParameterServer{.partitions = 5, .servers = 2, .chunk_elements = 4}};
      if (n > 1) placements.push_back({.partitions = 3, .servers = 1, .dedicated = true});
      if (n > 2) placements.push_back({.partitions = 5, .servers = 2, .dedicated = true, .chunk_elements = 4});
      for (const topology::ParameterServer& ps : placements) {
        for (std::size_t elements : {1u, 2u, 13u, 1009u}) {
          CAPTURE(n);
          CAPTURE(elements);
          CAPTURE(ps.describe());
          std::vector<std::vector<float>> inputs;
          for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(elements, 500u * static_cast<unsigned>(r) + elements));
          const auto outputs = run_ps(codec, ps, inputs, 2);
          const auto reference = ps_reference(codec, ps, inputs);
          const std::size_t parts = ps.partitions ? ps.partitions : static_cast<std::size_t>(n);
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            const Group group = Group::world(r, n);
            for (std::size_t p = 0; p < parts; ++p) {
              if (ps.aggregates_only(group) && ps.root(group, p) != r) continue;  // unspecified there
              const ElemRange range = topology::Ring::segment(elements, static_cast<int>(parts), static_cast<int>(p));
              CAPTURE(p);
              REQUIRE(std::memcmp(outputs[static_cast<std::size_t>(r)].data() + range.begin, reference.data() + range.begin,
                                  range.size() * sizeof(float)) == 0);
            }
          }
        }
      }
    }
  }

  TEST_CASE("parameter server with error feedback: every rank the same bits, iteration after iteration") {
    using C = compression::ErrorFeedback<compression::TwoBit>;
    const C codec{{.threshold = 0.25f}};
    for (int n : {2, 3, 5}) {
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(301, 9u * static_cast<unsigned>(r)));
      const auto outputs = run_ps(codec, topology::ParameterServer{.partitions = 4, .chunk_elements = 16}, inputs, 3);
      for (int r = 1; r < n; ++r) REQUIRE(outputs[static_cast<std::size_t>(r)] == outputs[0]);
    }
  }
}

TEST_CASE("topology: Ring and ParameterServer post each pair's messages in one order on both sides, as "
          "transport::Nccl needs") {
  static_assert(PairOrderedTopology<topology::Ring>);
  static_assert(PairOrderedTopology<topology::ParameterServer>);
  static_assert(PairOrderedTopology<topology::Hierarchical>);
  static_assert(PairOrderedTopology<topology::RecursiveDoubling>);
  static_assert(PairOrderedTopology<topology::HalvingDoubling>);
  static_assert(PairOrderedTopology<topology::Auto<>>);
  for (int n = 1; n <= 6; ++n)
    for (std::size_t elements : {0u, 1u, 5u, 64u, 1000u, 100003u})
      for (std::size_t chunk : {7u, 64u, 1u << 18})
        for (bool identity : {true, false}) {
          CAPTURE(chunk);
          CAPTURE(identity);
          std::string broken = pair_order_broken(topology::Ring{.chunk_elements = chunk}, n, elements, identity);
          CHECK_MESSAGE(broken.empty(), "ring: " << broken);
          for (bool receives_at_use : {false, true}) {
            broken = pair_order_broken(topology::RecursiveDoubling{}, n, elements, identity, receives_at_use);
            CHECK_MESSAGE(broken.empty(), "recursive doubling: " << broken);
            broken = pair_order_broken(topology::HalvingDoubling{}, n, elements, identity, receives_at_use);
            CHECK_MESSAGE(broken.empty(), "halving-doubling: " << broken);
          }
          for (int per_machine = 1; per_machine <= n; ++per_machine)
            for (bool receives_at_use : {false, true})
              for (const Arrangement a : every_arrangement) {
                if (n % per_machine != 0) continue;
                broken = pair_order_broken(
                    topology::Hierarchical{.ranks_per_machine = per_machine, .chunk_elements = chunk, .across = a.across, .within = a.within}, n,
                    elements, identity, receives_at_use);
                CHECK_MESSAGE(broken.empty(), "hierarchical, " << per_machine << " per machine, "
                                                               << topology::Hierarchical::describe(a)
                                                               << (receives_at_use ? ", receives at use: " : ": ") << broken);
              }
          for (std::size_t partitions : {0u, 1u, 5u})
            for (std::size_t servers = 0; servers < static_cast<std::size_t>(n); ++servers)
              for (bool dedicated : {false, true}) {
                if (dedicated && servers == 0) continue;
                broken = pair_order_broken(topology::ParameterServer{.partitions = partitions,
                                                                     .servers = servers,
                                                                     .dedicated = dedicated,
                                                                     .chunk_elements = chunk},
                                           n, elements, identity);
                CHECK_MESSAGE(broken.empty(), "parameter server, " << partitions << " partitions, " << servers
                                                                   << " servers" << (dedicated ? " dedicated" : "")
                                                                   << ": " << broken);
              }
        }
}
