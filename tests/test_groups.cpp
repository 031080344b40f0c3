// Groups: a rank set with its own numbering over an existing transport. How the launch's groups
// are numbered, Synchronizers on the machine-local and cross-machine groups of one transport at
// once, ranks that disagree about a group told so, and one world over shared memory and TCP. And
// the control channel's collectives over a group: binomial trees at sizes that are and are not
// powers of two, and packed texts that do not add up.

#include <doctest/doctest.h>

#include <bit>
#include <random>

#include "gradsync/engine/binomial_tree.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/gradsync.hpp"
#include "processes.hpp"
#include "routed_world.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

namespace {

launch::Launch placed(int rank, int world, int local_world) {
  return {.rank = rank, .world_size = world, .local_rank = rank % local_world, .local_world_size = local_world};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Group ranks numbered backwards from the transport's, so that a tree over group ranks is not one
// over transport ranks.
Group reversed(int rank, int n) {
  std::vector<int> members(static_cast<std::size_t>(n));
  for (int g = 0; g < n; ++g) members[static_cast<std::size_t>(g)] = n - 1 - g;
  return Group::of(std::move(members), rank, "reversed");
}

// One entry of a packed control message, as ControlChannel packs them: u32 rank, u64 length, bytes.
std::string entry(std::uint32_t rank, std::uint64_t length, std::string_view bytes) {
  std::string out(reinterpret_cast<const char*>(&rank), sizeof rank);
  out.append(reinterpret_cast<const char*>(&length), sizeof length);
  return out.append(bytes);
}

// Each rank's text: of a length of its own, rank 1's empty.
std::string text_of(int group_rank) {
  return group_rank == 1 ? std::string() : fmt::format("rank {}:{}", group_rank, std::string(static_cast<std::size_t>(group_rank) * 300, '.'));
}

using Borrowed = transport::Borrowed<transport::InProcess>;
using World = test::RoutedWorld;
using test::routed_world;

template <class X>
using RingSync = Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, X>;

}  // namespace

TEST_SUITE("groups") {
  TEST_CASE("the launch's groups: the machine's ranks and one rank per machine, numbered as documented") {
    // 3 machines of 4: rank 6 is local rank 2 of machine 1.
    const Group machine = Group::machine(placed(6, 12, 4));
    CHECK(machine.members == std::vector<int>{4, 5, 6, 7});
    CHECK(machine.rank == 2);
    CHECK(machine.name == "machine 1");
    const Group across = Group::across_machines(placed(6, 12, 4));
    CHECK(across.members == std::vector<int>{2, 6, 10});
    CHECK(across.rank == 1);
    CHECK(across.describe() == "local rank 2 across machines: ranks 2, 6, 10");

    const Group listed = Group::of({5, 1, 3}, 3, "odd");
    CHECK(listed.rank == 2);
    CHECK_THROWS_WITH_AS(Group::of({5, 1, 3}, 2, "odd"), doctest::Contains("does not include this rank"), Error);
    CHECK_THROWS_WITH_AS(Group::of({1, 2, 1}, 2, "twice"), doctest::Contains("names a rank twice"), Error);
    // 10 ranks cannot be machines of 4.
    CHECK_THROWS_WITH_AS(Group::machine(placed(5, 10, 4)), doctest::Contains("same number of ranks on every machine"),
                         Error);
  }

  TEST_CASE("a Synchronizer on a group averages over its members; machine and cross-machine groups share a transport") {
    // 2 machines x 3 ranks, one in-process world. Each rank first averages within its machine,
    // then (on the same transport, concurrently with the other machine) across machines, which
    // leaves the world's average everywhere: two-level averaging by hand.
    constexpr int machines = 2, local = 3, n = machines * local;
    const std::size_t count = 1000;
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(count, 77u + static_cast<unsigned>(r)));
    std::vector<std::vector<float>> results(n);
    const auto errors = test::run_ranks(n, [&](transport::InProcess& world) {
      const launch::Launch me = placed(world.rank(), n, local);
      RingSync<Borrowed> within(Borrowed(world), Group::machine(me), {.timeout = 20s});
      RingSync<Borrowed> across(Borrowed(world), Group::across_machines(me), {.timeout = 20s});
      CHECK(within.rank() == me.local_rank);
      CHECK(within.size() == local);
      CHECK(across.size() == machines);
      std::vector<float> g = inputs[static_cast<std::size_t>(world.rank())];
      within.add("g", view(g));
      across.add("g", view(g));
      within.ready(0);
      within.wait();
      across.ready(0);
      across.wait();
      results[static_cast<std::size_t>(world.rank())] = g;
    });
    for (const auto& e : errors) REQUIRE_MESSAGE(!e, e->what());
    for (std::size_t e = 0; e < count; ++e) {
      double sum = 0;
      for (int r = 0; r < n; ++r) sum += inputs[static_cast<std::size_t>(r)][e];
      for (int r = 0; r < n; ++r) CHECK(results[static_cast<std::size_t>(r)][e] == doctest::Approx(sum / n).epsilon(1e-5));
    }
    // The cross-machine step leaves the same bits on every rank.
    for (int r = 1; r < n; ++r) CHECK(results[static_cast<std::size_t>(r)] == results[0]);
  }

  TEST_CASE("ranks that disagree about a group's members are told, with both versions") {
    // Rank 2 numbers the same three ranks differently.
    const auto errors = test::run_ranks(3, [&](transport::InProcess& world) {
      const int rank = world.rank();
      const std::vector<int> members = rank == 2 ? std::vector<int>{2, 0, 1} : std::vector<int>{0, 1, 2};
      RingSync<transport::InProcess> sync(std::move(world), Group::of(members, rank, "trio"), {.timeout = 5s});
      std::vector<float> g(10, 1.0f);
      sync.add("g", view(g));
      sync.ready(0);
      sync.wait();
    });
    for (const auto& e : errors) {
      REQUIRE(e);
      CHECK(e->kind() == ErrorKind::mismatch);
    }
    CHECK(contains(errors[0]->what(), "this rank counts \"trio: ranks 0, 1, 2\", but rank 2 counts \"trio: ranks 2, 0, 1\""));

    // Rank 3 counts itself in the group of ranks 0-2, which do not count it: in its tree of the four
    // its parent is rank 2, which in the tree of the three has no child, so rank 3 waits for rank 2
    // in vain and names it.
    const auto unanswered = test::run_ranks(4, [&](transport::InProcess& world) {
      const int rank = world.rank();
      const std::vector<int> members = rank == 3 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 1, 2};
      RingSync<transport::InProcess> sync(std::move(world), Group::of(members, rank, "trio"), {.timeout = 500ms});
      std::vector<float> g(10, 1.0f);
      sync.add("g", view(g));
      sync.ready(0);
      sync.wait();
    });
    REQUIRE(unanswered[3]);
    CHECK(unanswered[3]->kind() == ErrorKind::mismatch);
    CHECK(contains(unanswered[3]->what(), "rank 2 did not answer within 500 ms"));
  }

  TEST_CASE("hierarchical over two machines of processes (shared memory within, TCP across): the exact average") {
    // Whole-number inputs keep every partial sum exact, so any summation order gives the bits of
    // the reference sum; the division by n rounds the same way everywhere.
    for (const auto& [machines, local] : {std::pair{2, 2}, std::pair{2, 3}}) {
      CAPTURE(machines);
      CAPTURE(local);
      const int n = machines * local;
      const std::uint16_t port = test::free_port();
      const std::string job = fmt::format("groups-hier-{}-{}", ::getpid(), std::random_device{}());
      const std::size_t count = 50003;
      const auto input = [](int r, std::size_t e) { return static_cast<float>((static_cast<std::size_t>(r) * 13 + e) % 97); };
      const auto results = test::run_processes(n, [&](int rank) -> std::string {
        Synchronizer<bucketing::PerTensor, compression::None, topology::Hierarchical, World> sync(
            routed_world(rank, local, n, port, job), {.timeout = 20s}, {}, {},
            {.ranks_per_machine = local, .chunk_elements = 4096});
        std::vector<float> g(count);
        for (std::size_t e = 0; e < count; ++e) g[e] = input(rank, e);
        sync.add("g", view(g));
        sync.ready(0);
        sync.wait();
        for (std::size_t e = 0; e < count; ++e) {
          float sum = 0;
          for (int r = 0; r < n; ++r) sum += input(r, e);
          if (g[e] != sum / static_cast<float>(n))
            return fmt::format("element {} is {}, the reference {}", e, g[e], sum / static_cast<float>(n));
        }
        return "ok";
      });
      for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    }
  }

  TEST_CASE("one world over shared memory within each machine and TCP across: Ring gives the same bits everywhere") {
    // 2 "machines" of 2 processes: each machine's pair shares a segment of its own.
    constexpr int machines = 2, local = 2, n = machines * local;
    const std::uint16_t port = test::free_port();
    const std::string job = fmt::format("groups-test-{}-{}", ::getpid(), std::random_device{}());
    const std::size_t count = 30001;
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      RingSync<World> sync(routed_world(rank, local, n, port, job), {.timeout = 20s}, {}, {}, {.chunk_elements = 4096});
      std::vector<float> g = test::random_values(count, 5u + static_cast<unsigned>(rank));
      sync.add("g", view(g));
      sync.ready(0);
      sync.wait();
      std::vector<std::vector<float>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(test::random_values(count, 5u + static_cast<unsigned>(r)));
      return g == test::ring_reference(compression::None{}, inputs) ? "ok" : "differs from the ring reference";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
  }
  TEST_CASE("a peer channel carries tensors between two ranks, in order within each stream, and counts its bytes") {
    const auto errors = test::run_ranks(3, [&](transport::InProcess& t) {
      if (t.rank() == 1) return;  // the channel joins ranks 0 and 2 only
      const int other = 2 - t.rank();
      PeerChannel<transport::InProcess> pair(std::move(t), other, 10s, "test pair");
      std::vector<float> a(100), b(7);
      std::vector<double> c(3);
      if (pair.rank() == 0) {
        for (int k = 0; k < 3; ++k) {
          std::iota(a.begin(), a.end(), static_cast<float>(k));
          pair.send(std::span<const float>(a), 0);
        }
        std::fill(b.begin(), b.end(), 5.5f);
        pair.send(std::span<const float>(b), 1);
        pair.recv(std::span(c), 2);
        CHECK(c == std::vector<double>{1.25, -2, 1e300});
        CHECK(pair.bytes_sent() == 3 * 100 * sizeof(float) + 7 * sizeof(float));
      } else {
        for (int k = 0; k < 3; ++k) {
          pair.recv(std::span(a), 0);
          CHECK(a.front() == static_cast<float>(k));
          CHECK(a.back() == static_cast<float>(k + 99));
        }
        pair.recv(std::span(b), 1);
        CHECK(b == std::vector<float>(7, 5.5f));
        c = {1.25, -2, 1e300};
        pair.send(std::span<const double>(c), 2);
      }
    });
    for (const auto& e : errors) CHECK_FALSE(e);
  }

  TEST_CASE("a peer channel's short message, silent peer or unknown stream is an Error naming rank, peer and stream") {
    SUBCASE("a message shorter than the receive") {
      const auto errors = test::run_ranks(2, [&](transport::InProcess& t) {
        PeerChannel<transport::InProcess> pair(std::move(t), 1 - t.rank(), 10s, "test pair");
        std::vector<float> values(pair.rank() == 0 ? 3 : 4);
        if (pair.rank() == 0) return pair.send(std::span<const float>(values), 5);
        pair.recv(std::span(values), 5);
      });
      REQUIRE(errors[1]);
      CHECK(errors[1]->kind() == ErrorKind::protocol);
      CHECK(errors[1]->context().peer == 0);
      CHECK(contains(errors[1]->what(), "test pair recv of stream 5"));
      CHECK(contains(errors[1]->what(), "12 bytes where 4 values of 4 bytes were expected"));
    }
    SUBCASE("a peer that never sends: a timeout, and the peer is told") {
      const auto errors = test::run_ranks(2, [&](transport::InProcess& t) {
        PeerChannel<transport::InProcess> pair(std::move(t), 1 - t.rank(), 200ms, "test pair");
        std::vector<float> values(4);
        pair.recv(std::span(values), pair.rank());  // each waits on a stream the other never sends
      });
      for (int r : {0, 1}) {
        REQUIRE(errors[static_cast<std::size_t>(r)]);
        const Error& e = *errors[static_cast<std::size_t>(r)];
        // Either rank's timeout can come first; the other then learns of it through the abort.
        CHECK((e.kind() == ErrorKind::timeout || e.kind() == ErrorKind::peer_failed));
        CHECK(e.context().peer == 1 - r);
      }
      const bool some_timeout = errors[0]->kind() == ErrorKind::timeout || errors[1]->kind() == ErrorKind::timeout;
      CHECK(some_timeout);
    }
    SUBCASE("misuse") {
      auto world = transport::InProcess::create_world(2);
      CHECK_THROWS_AS(PeerChannel<transport::InProcess>(std::move(world[0]), 0, 1s), Error);
      world = transport::InProcess::create_world(2);
      CHECK_THROWS_AS(PeerChannel<transport::InProcess>(std::move(world[0]), 2, 1s), Error);
      world = transport::InProcess::create_world(2);
      PeerChannel<transport::InProcess> pair(std::move(world[0]), 1, 1s);
      std::vector<float> values(1);
      try {
        pair.send(std::span<const float>(values), PeerChannel<transport::InProcess>::max_streams);
        FAIL("an unknown stream was accepted");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::invalid_argument);
        CHECK(contains(e.what(), "stream 16 is out of range"));
      }
    }
  }

  TEST_CASE("binomial tree: every position but the root is its parent's child, and subtrees are runs in order") {
    namespace tree = engine::binomial_tree;
    for (int n = 1; n <= 70; ++n) {
      CAPTURE(n);
      int edges = 0, depth = 0;
      for (int r = 0; r < n; ++r) {
        // r, then its children's subtrees smallest first, is the run r .. subtree_end(r) - 1.
        int next = r + 1;
        for (int i = 0; i < tree::children(r, n); ++i) {
          const int c = tree::child(r, i);
          CHECK(c == next);
          CHECK(tree::parent(c) == r);
          next = tree::subtree_end(c, n);
          ++edges;
        }
        CHECK(next == tree::subtree_end(r, n));
        int hops = 0;
        for (int p = r; p != 0; p = tree::parent(p)) ++hops;
        depth = std::max(depth, hops);
      }
      CHECK(edges == n - 1);
      CHECK(tree::subtree_end(0, n) == n);
      // ceil(log2 n) hops at most, and as many children at the root.
      const int log2_up = std::bit_width(static_cast<unsigned>(n - 1));
      CHECK(depth <= log2_up);
      if (std::has_single_bit(static_cast<unsigned>(n))) CHECK(depth == log2_up);
      CHECK(tree::children(0, n) == log2_up);
    }
  }

  TEST_CASE("the control channel's gather, broadcast and exchange over 1, 2, 3, 5 and 8 ranks: every text, in group order") {
    for (const int n : {1, 2, 3, 5, 8}) {
      CAPTURE(n);
      std::vector<std::vector<std::pair<int, std::string>>> gathered(static_cast<std::size_t>(n));
      std::vector<std::string> broadcast(static_cast<std::size_t>(n));
      std::vector<std::vector<std::pair<int, std::string>>> exchanged(static_cast<std::size_t>(n));
      const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
        const Group group = reversed(t.rank(), n);
        engine::ControlChannel<transport::InProcess> control(t, group, 10s);
        const auto g = static_cast<std::size_t>(group.rank);
        // Gather and broadcast on the same message and iteration: up and down the tree they
        // cannot be confused.
        control.gather(7, engine::ControlMessage::calibration, text_of(group.rank),
                       [&](int peer, std::string_view text) { gathered[g].emplace_back(peer, text); });
        broadcast[g] = control.broadcast(7, engine::ControlMessage::calibration, group.rank == 0 ? "rank 0's" : "");
        control.exchange_with_all(0, engine::ControlMessage::membership, text_of(group.rank), "test exchange",
                                  [&](int peer, std::string_view text) { exchanged[g].emplace_back(peer, text); });
      });
      for (const auto& e : errors)
        if (e) FAIL(std::string(e->what()));
      for (int g = 0; g < n; ++g) {
        CAPTURE(g);
        const auto at = static_cast<std::size_t>(g);
        std::vector<std::pair<int, std::string>> others;
        for (int peer = 0; peer < n; ++peer)
          if (peer != g) others.emplace_back(peer, text_of(peer));
        CHECK(gathered[at] == (g == 0 ? others : std::vector<std::pair<int, std::string>>{}));
        CHECK(broadcast[at] == "rank 0's");
        CHECK(exchanged[at] == others);
      }
    }
  }

  TEST_CASE("the control channel: packed texts that do not add up are an Error(protocol) naming the sender") {
    // Rank 1 plays a child of rank 0 in a gather over two ranks, sending its packed subtree by
    // hand; rank 0 expects exactly one entry, for group rank 1.
    const auto gather_from = [](std::string packed) {
      return test::run_ranks(2, [&](transport::InProcess& t) {
        const Group group = Group::world(t.rank(), 2);
        engine::ControlChannel<transport::InProcess> control(t, group, 2s);
        if (t.rank() == 0) return control.gather(0, engine::ControlMessage::layout, "mine", [](int, std::string_view) {});
        const std::uint64_t length = packed.size();
        transport::InProcess::Request a, b;
        t.send(a, 0, engine::control_tag(0, engine::ControlMessage::layout), std::as_bytes(std::span(&length, 1)));
        t.send(b, 0, engine::control_tag(0, engine::ControlMessage::layout, 1), std::as_bytes(std::span(packed)));
        const auto deadline = std::chrono::steady_clock::now() + 2s;
        t.wait(a, deadline);
        t.wait(b, deadline);
      });
    };
    const std::pair<std::string, std::string> cases[] = {
        {std::string(5, 'x'), "end inside an entry's header (5 bytes left)"},
        {entry(1, 100, "abc"), "the entry of rank 1 announces 100 bytes, 3 are left"},
        {entry(1, std::uint64_t{1} << 63, "abc"), "announces 9223372036854775808 bytes, 3 are left"},
        {entry(0, 3, "abc"), "hold group rank 0 where 1 belongs"},
        {entry(1, 3, "abc") + entry(2, 0, ""), "hold group rank 2 where they should end"},
        {"", "stop before group rank 1"},
    };
    for (const auto& [packed, complaint] : cases) {
      CAPTURE(complaint);
      const auto errors = gather_from(packed);
      CHECK_FALSE(errors[1]);
      REQUIRE(errors[0]);
      CHECK(errors[0]->kind() == ErrorKind::protocol);
      CHECK(errors[0]->context().peer == 1);
      CHECK(contains(errors[0]->what(), complaint));
    }
    // The same subtree, well formed, is accepted.
    const auto errors = gather_from(entry(1, 3, "abc"));
    CHECK_FALSE(errors[0]);
    CHECK_FALSE(errors[1]);
  }
}
