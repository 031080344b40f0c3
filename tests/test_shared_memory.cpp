// transport::SharedMemory between real processes on this machine, and transport::Routed over it
// and TCP: allreduce bit-identical on every rank for every topology and codec, a killed rank
// named by the others, segments that leave nothing behind and stale ones never joined; and the
// segment's locks (private to the library) when a process dies holding or waiting on one.

#include <doctest/doctest.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "allocation_count.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/routed.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "gradsync/transport/tcp.hpp"
#include "processes.hpp"
#include "support.hpp"
#include "transport/shm/sync.hpp"  // private to the library: src/

using namespace gradsync;
using namespace std::chrono_literals;
using transport::SharedMemory;
using transport::SharedMemoryOptions;

static_assert(TransportPolicy<transport::Routed<SharedMemory, transport::Tcp>>);
// Routed hands out the arena, so its buffers are memcpy-addressable for the machine's other ranks.
static_assert(TransportAllocator<transport::Routed<SharedMemory, transport::Tcp>>);
static_assert(!TransportAllocator<transport::Routed<transport::Tcp, transport::Tcp>>);

namespace {

constexpr const char* token = "shm-test-token";

// A job name no other test (or earlier run) uses.
std::string fresh_job() {
  static int count = 0;
  return fmt::format("test-job-{}-{}-{}", ::getpid(), count++, std::random_device{}());
}

SharedMemoryOptions options(int local_rank, int n, const std::string& job) {
  return {.local_rank = local_rank, .local_size = n, .job = job, .token = token, .setup_timeout = 20s};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool segment_exists(const std::string& job, int n) {
  return std::filesystem::exists("/dev/shm/" + SharedMemory::segment_name(options(0, n, job)));
}

// Each rank's result as text: rank 0 compares them (bit for bit) with everyone's.
std::string hex_bits(const std::vector<float>& values) {
  std::string out;
  for (float v : values) out += fmt::format("{:08x}", std::bit_cast<std::uint32_t>(v));
  return out;
}

// Runs three iterations of `sync` over gradients of `sizes`, with rank-dependent random inputs;
// returns the digest of what the last iteration left, and checks each iteration against the
// plain average within `tolerance` (negative: no check; lossy codecs).
template <class Sync>
std::string run_iterations(Sync& sync, int rank, int n, const std::vector<std::size_t>& sizes, float tolerance) {
  std::vector<std::vector<float>> grads;
  for (std::size_t s : sizes) grads.emplace_back(s);
  for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
  std::string digest;
  for (int iteration = 0; iteration < 3; ++iteration) {
    std::vector<std::vector<std::vector<float>>> inputs(sizes.size());
    for (std::size_t g = 0; g < sizes.size(); ++g)
      for (int r = 0; r < n; ++r)
        inputs[g].push_back(test::random_values(sizes[g], 1000u * static_cast<unsigned>(iteration) + 10u * g +
                                                              static_cast<unsigned>(r)));
    for (std::size_t g = 0; g < sizes.size(); ++g) grads[g] = inputs[g][static_cast<std::size_t>(rank)];
    for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
    sync.wait();
    digest.clear();
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      digest += hex_bits(grads[g]);
      if (tolerance < 0) continue;
      for (std::size_t e = 0; e < sizes[g]; ++e) {
        double sum = 0;
        for (int r = 0; r < n; ++r) sum += inputs[g][static_cast<std::size_t>(r)][e];
        const double expected = sum / n;
        if (std::abs(grads[g][e] - expected) > tolerance * (1 + std::abs(expected)))
          return fmt::format("gradient {} element {} is {}, expected {} in iteration {}", g, e, grads[g][e], expected,
                             iteration);
      }
    }
  }
  return digest;
}

const bucketing::FixedSize one_bucket{.cap_bytes = std::size_t{1} << 20, .first_cap_bytes = std::size_t{1} << 20};

// Two ranks taking turns: the side that must post second waits for the other's signal, and both
// meet at a barrier before either closes (a closed peer fails the other's operations).
struct Turns {
  SharedMemory& shm;
  int other;

  static std::chrono::steady_clock::time_point deadline() { return std::chrono::steady_clock::now() + 10s; }
  void signal(std::uint64_t tag) {
    SharedMemory::Request r;
    shm.send(r, other, tag, {});
    shm.wait(r, deadline());
  }
  void await_signal(std::uint64_t tag) {
    SharedMemory::Request r;
    shm.recv(r, other, tag, {});
    shm.wait(r, deadline());
  }
  void barrier() {
    SharedMemory::Request out, in;
    shm.send(out, other, 1, {});
    shm.recv(in, other, 1, {});
    shm.wait(out, deadline());
    shm.wait(in, deadline());
  }
};

// Every child's digest must equal rank 0's.
void check_identical(const std::vector<test::ChildResult>& results) {
  for (const auto& r : results) {
    const bool digest = !contains(r.report, "error") && !contains(r.report, "exception") && r.report.size() > 2;
    REQUIRE_MESSAGE(digest, r.report.substr(0, 300));
    CHECK_MESSAGE(r.report == results[0].report, "a rank's average differs from rank 0's bits");
  }
}

// With PerTensor every bucket is one gradient, reduced in the caller's own memory; buckets of
// several gradients live in the arena, where receives add on arrival (engine/exchange.hpp).
template <class Codec, class Topology, class Bucketing = bucketing::PerTensor>
void allreduce_everywhere_identical(const char* codec_name, Codec codec, Topology topology, float tolerance,
                                    Bucketing bucketing = {}) {
  const std::vector<std::size_t> sizes{0, 1, 13, 1009, 70001};
  for (int n = 2; n <= 6; ++n) {
    CAPTURE(n);
    CAPTURE(codec_name);
    const std::string job = fresh_job();
    Topology shaped = topology;
    // Hierarchical: machines of two ranks emulated within this one where n is even, else one machine.
    if constexpr (std::is_same_v<Topology, topology::Hierarchical>) shaped.ranks_per_machine = n % 2 == 0 ? 2 : n;
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      Synchronizer<Bucketing, Codec, Topology, SharedMemory> sync(SharedMemory(options(rank, n, job)), {.timeout = 30s},
                                                                  bucketing, codec, shaped);
      return run_iterations(sync, rank, n, sizes, tolerance);
    });
    check_identical(results);
    CHECK_FALSE(segment_exists(job, n));
  }
}

}  // namespace

TEST_SUITE("shared_memory") {
  TEST_CASE("messages between processes: matched by sender and tag, to itself, too long, withdrawn at the deadline, polled") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      SharedMemory shm(options(rank, 3, job));
      const int right = (rank + 1) % 3, left = (rank + 2) % 3;
      // Two tags posted in the opposite order on each side: matching is by tag, not arrival.
      std::vector<std::int32_t> out1(1000, rank), out2(7, rank * 10), in1(1000, -1), in2(7, -1), self_in(3, -1);
      const std::vector<std::int32_t> self_out{rank, rank, rank};
      SharedMemory::Request s1, s2, r1, r2, ss, sr;
      shm.recv(r2, left, 2, std::as_writable_bytes(std::span(in2)));
      shm.recv(r1, left, 1, std::as_writable_bytes(std::span(in1)));
      shm.send(s1, right, 1, std::as_bytes(std::span(out1)));
      shm.send(s2, right, 2, std::as_bytes(std::span(out2)));
      shm.send(ss, rank, 9, std::as_bytes(std::span(self_out)));
      shm.recv(sr, rank, 9, std::as_writable_bytes(std::span(self_in)));
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      for (auto* r : {&s1, &s2, &r1, &r2, &ss, &sr}) shm.wait(*r, deadline);
      if (in1 != std::vector<std::int32_t>(1000, left) || in2 != std::vector<std::int32_t>(7, left * 10) ||
          self_in != self_out)
        return "wrong contents";
      // Too long: 8 bytes into a 4-byte receive fails on both sides with the sizes.
      std::array<std::byte, 8> big{};
      std::array<std::byte, 4> small{};
      SharedMemory::Request tl;
      if (rank == 0) shm.send(tl, 1, 5, big);
      if (rank == 1) shm.recv(tl, 0, 5, small);
      if (rank < 2) {
        try {
          shm.wait(tl, std::chrono::steady_clock::now() + 10s);
          return "too-long message accepted";
        } catch (const Error& e) {
          if (e.kind() != ErrorKind::protocol || !contains(e.what(), "8 bytes")) return e.what();
        }
      }
      // Nobody sends tag 6: the receive is withdrawn at its deadline with Error(timeout).
      SharedMemory::Request lonely;
      shm.recv(lonely, left, 6, small);
      try {
        shm.wait(lonely, std::chrono::steady_clock::now() + 100ms);
        return "lonely receive completed";
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::timeout) return e.what();
      }
      // Polled with test() alone, never waited for: a completion no sink asked for reaches its owner
      // through test() itself.
      std::int32_t polled_out = rank, polled_in = -1;
      SharedMemory::Request ps, pr;
      shm.recv(pr, left, 7, std::as_writable_bytes(std::span(&polled_in, 1)));
      shm.send(ps, right, 7, std::as_bytes(std::span(&polled_out, 1)));
      for (const auto give_up = std::chrono::steady_clock::now() + 10s; !(shm.test(ps) && shm.test(pr));)
        if (std::chrono::steady_clock::now() > give_up) return "test() never saw the message complete";
      if (polled_in != left) return "wrong contents through test()";
      // Everyone is past the checks before anyone closes (a closed peer fails the others' operations).
      SharedMemory::Request b_out, b_in;
      shm.send(b_out, right, 100, {});
      shm.recv(b_in, left, 100, {});
      shm.wait(b_out, std::chrono::steady_clock::now() + 10s);
      shm.wait(b_in, std::chrono::steady_clock::now() + 10s);
      return "ok";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    CHECK_FALSE(segment_exists(job, 3));
  }

  TEST_CASE("ring over shared memory: every rank the same bits, 2-6 processes") {
    allreduce_everywhere_identical("none", compression::None{}, topology::Ring{.chunk_elements = 4096}, 1e-5f);
    allreduce_everywhere_identical("ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{},
                                   topology::Ring{.chunk_elements = 4096}, -1);
    allreduce_everywhere_identical("none, one bucket in the arena", compression::None{},
                                   topology::Ring{.chunk_elements = 4096}, 1e-5f, one_bucket);
  }

  TEST_CASE("parameter server over shared memory: every rank the same bits, 2-6 processes") {
    allreduce_everywhere_identical("none", compression::None{},
                                   topology::ParameterServer{.partitions = 5, .chunk_elements = 4096}, 1e-5f);
    allreduce_everywhere_identical("fp16", compression::Fp16{},
                                   topology::ParameterServer{.partitions = 5, .chunk_elements = 4096}, -1);
  }

  TEST_CASE("hierarchical over shared memory: every rank the same bits, 2-6 processes") {
    allreduce_everywhere_identical("none", compression::None{}, topology::Hierarchical{.chunk_elements = 4096}, 1e-5f);
    allreduce_everywhere_identical("ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{},
                                   topology::Hierarchical{.chunk_elements = 4096}, -1);
    allreduce_everywhere_identical("ef-two-bit, one bucket in the arena", compression::ErrorFeedback<compression::TwoBit>{},
                                   topology::Hierarchical{.chunk_elements = 4096}, -1, one_bucket);
  }

  TEST_CASE("the per-step path over shared memory allocates nothing") {
    // Each process counts its own allocations (every thread of it: the completion thread too) over
    // ten steps after three of warm-up: per-tensor buckets reduced in the caller's memory, and one
    // bucket in the arena whose receives add on arrival, with a codec of error feedback.
    const auto steps_allocate = [](auto& sync, const std::vector<std::size_t>& sizes, int rank) -> std::string {
      std::vector<std::vector<float>> grads;
      for (std::size_t s : sizes) grads.push_back(test::random_values(s, static_cast<std::uint64_t>(rank)));
      for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
      const auto step = [&] {
        for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
        sync.wait();
      };
      for (int i = 0; i < 3; ++i) step();  // the plan is agreed after the first
      test::allocation_count::start();
      for (int i = 0; i < 10; ++i) step();
      const std::size_t counted = test::allocation_count::stop();
      return counted == 0 ? "ok" : fmt::format("{} allocations in ten steps", counted);
    };
    constexpr int n = 4;
    const std::vector<std::size_t> sizes{7, 40, 500, 3000, 70001};
    const std::string ring_job = fresh_job(), arena_job = fresh_job();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, SharedMemory> ring(
          SharedMemory(options(rank, n, ring_job)), {.timeout = 30s}, {}, {}, {.chunk_elements = 4096});
      const std::string per_tensor = steps_allocate(ring, sizes, rank);
      Synchronizer<bucketing::FixedSize, compression::ErrorFeedback<compression::TwoBit>, topology::Hierarchical,
                   SharedMemory>
          arena(SharedMemory(options(rank, n, arena_job)), {.timeout = 30s}, one_bucket, {},
                {.ranks_per_machine = 2, .chunk_elements = 4096});
      const std::string in_arena = steps_allocate(arena, sizes, rank);
      return per_tensor == "ok" && in_arena == "ok" ? "ok" : fmt::format("ring, per tensor: {}; hierarchical, "
                                                                         "one bucket in the arena: {}", per_tensor,
                                                                         in_arena);
    });
    for (int r = 0; r < n; ++r) CHECK_MESSAGE(results[static_cast<std::size_t>(r)].ok(), r, ": ", results[static_cast<std::size_t>(r)].report);
  }

  TEST_CASE("the segment's lock and condition outlive a process killed holding or waiting on them") {
    struct Shared {
      transport::shm::RobustMutex mutex;
      transport::shm::SharedCondition condition;
      int value = 0;
    };
    void* memory = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(memory != MAP_FAILED);
    auto* shared = new (memory) Shared();
    const auto killed_child = [](auto body) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        body();
        ::raise(SIGKILL);
      }
      int status = 0;
      ::waitpid(pid, &status, 0);
      return WIFSIGNALED(status);
    };

    // Killed holding the lock: the next locker gets it, told that its holder died.
    CHECK(killed_child([&] { shared->mutex.lock(); }));
    CHECK_FALSE(shared->mutex.holder_died());
    {
      std::unique_lock lock(shared->mutex, std::defer_lock);
      REQUIRE(lock.try_lock_until(std::chrono::steady_clock::now() + 60s));  // a dead holder does not make it wait
      CHECK(shared->mutex.holder_died());
    }
    // Killed asleep on the condition (or before it got there): later waits and notifications
    // work as before.
    CHECK(killed_child([&] {
      std::thread([&] {
        std::unique_lock lock(shared->mutex);
        shared->condition.wait_until(lock, std::chrono::steady_clock::now() + 60s, [] { return false; });
      }).detach();
      std::this_thread::sleep_for(100ms);
    }));
    bool woken = false;
    std::thread waiter([&] {
      std::unique_lock lock(shared->mutex);
      woken = shared->condition.wait_until(lock, std::chrono::steady_clock::now() + 60s,
                                           [&] { return shared->value == 1; });
    });
    {
      std::unique_lock lock(shared->mutex);
      shared->value = 1;
    }
    shared->condition.notify_all();
    waiter.join();
    CHECK(woken);
    ::munmap(memory, sizeof(Shared));
  }

  TEST_CASE("a killed local rank makes the others fail fast, naming it; the segment is gone") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, SharedMemory> sync(
          SharedMemory(options(rank, 3, job)), {.timeout = 60s});
      std::vector<float> a(100000, 1.0f), b(1000, 2.0f);
      sync.add("a", view(a));
      sync.add("b", view(b));
      for (int iteration = 0; iteration < 2; ++iteration) {
        sync.ready(1);
        if (rank == 2 && iteration == 1) ::raise(SIGKILL);  // dies between its two gradients
        sync.ready(0);
        sync.wait();
      }
      return "ok";
    });
    CHECK(results[2].signalled());
    for (int r : {0, 1}) {
      const auto& report = results[static_cast<std::size_t>(r)].report;
      CAPTURE(report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      CHECK(contains(report, "error peer failed"));  // not a timeout: the 60 s did not run out
      CHECK(contains(report, "rank 2"));
    }
    CHECK_FALSE(segment_exists(job, 3));
  }

  TEST_CASE("a rank killed among 16 on one machine: every survivor names it") {
    // The first rank to abort is one that saw the death; the others must hear where it began.
    constexpr int n = 16, dead = 8;
    const std::string job = fresh_job();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, SharedMemory> sync(
          SharedMemory(options(rank, n, job)), {.timeout = 60s});
      std::vector<float> gradient(16384, 1.0f);
      sync.add("g", view(gradient));
      for (int iteration = 0; iteration < 1000; ++iteration) {
        if (rank == dead && iteration == 3) ::raise(SIGKILL);
        sync.ready(0);
        sync.wait();
      }
      return "ok";
    });
    CHECK(results[dead].signalled());
    for (int r = 0; r < n; ++r) {
      if (r == dead) continue;
      const auto& report = results[static_cast<std::size_t>(r)].report;
      CAPTURE(report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      CHECK(contains(report, "error peer failed"));
      CHECK((contains(report, fmt::format("peer {},", dead)) || contains(report, fmt::format("rank {} failed first", dead))));
    }
  }

  TEST_CASE("a local rank stopped past the liveness bound is killed and fails the others, naming it") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      SharedMemoryOptions o = options(rank, 3, job);
      o.liveness = 1s;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, SharedMemory> sync(SharedMemory(o),
                                                                                             {.timeout = 40s});
      std::vector<float> a(100000, 1.0f), b(1000, 2.0f);
      sync.add("a", view(a));
      sync.add("b", view(b));
      for (int iteration = 0; iteration < 2; ++iteration) {
        sync.ready(1);
        if (rank == 2 && iteration == 1) ::raise(SIGSTOP);  // silent, neither exiting nor closing anything
        sync.ready(0);
        sync.wait();
      }
      return "ok";
    });
    REQUIRE(results[2].signalled());
    CHECK(WTERMSIG(results[2].status) == SIGKILL);
    for (int r : {0, 1}) {
      const auto& report = results[static_cast<std::size_t>(r)].report;
      CAPTURE(report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      CHECK(contains(report, "error peer failed"));  // not the 40 s timeout
      CHECK(contains(report, "rank 2"));
      CHECK(contains(report, "stopped"));
    }
    CHECK_FALSE(segment_exists(job, 3));
  }

  TEST_CASE("a local rank that sleeps or computes past the liveness bound is not taken for dead; a negative bound is refused") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      SharedMemoryOptions o = options(rank, 3, job);
      o.liveness = 500ms;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, SharedMemory> sync(SharedMemory(o),
                                                                                             {.timeout = 40s});
      std::vector<float> a(1000, static_cast<float>(rank));
      sync.add("a", view(a));
      for (int iteration = 0; iteration < 3; ++iteration) {
        if (rank == 1 && iteration == 1) std::this_thread::sleep_for(2s);
        if (rank == 2 && iteration == 2)  // busy: on a CPU the whole time
          for (const auto until = std::chrono::steady_clock::now() + 2s; std::chrono::steady_clock::now() < until;) {}
        sync.ready(0);
        sync.wait();
      }
      return "ok";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    SharedMemoryOptions negative = options(0, 1, fresh_job());
    negative.liveness = -1ms;
    CHECK_THROWS_WITH_AS(SharedMemory{negative}, doctest::Contains("liveness"), Error);
  }

  TEST_CASE("allocate: 64-byte aligned blocks of the arena, reused once returned, ordinary memory when it is full") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(1, [&](int) -> std::string {
      SharedMemoryOptions o = options(0, 1, job);
      o.arena_bytes = std::size_t{4} << 20;
      SharedMemory shm(o);
      const auto aligned = [](std::span<std::byte> b) { return reinterpret_cast<std::uintptr_t>(b.data()) % 64 == 0; };
      if (!shm.allocate(0).empty()) return "zero bytes gave a block";
      std::vector<std::span<std::byte>> blocks;
      for (std::size_t bytes : {std::size_t{1}, std::size_t{100}, std::size_t{1} << 20, (std::size_t{1} << 20) + 13}) {
        blocks.push_back(shm.allocate(bytes));
        if (blocks.back().size() != bytes || !aligned(blocks.back())) return fmt::format("block of {} bytes", bytes);
        if (!shm.shared(blocks.back())) return fmt::format("a block of {} bytes is not in the arena", bytes);
        std::memset(blocks.back().data(), 0x5a, bytes);  // every page usable (no SIGBUS)
      }
      // Beyond the arena: ordinary memory, still aligned and usable.
      const auto big = shm.allocate(std::size_t{8} << 20);
      if (big.size() != (std::size_t{8} << 20) || !aligned(big) || shm.shared(big)) return "oversized block";
      std::memset(big.data(), 1, big.size());
      std::span<std::byte> filler[4];
      int in_arena = 0;
      for (auto& f : filler) in_arena += shm.shared(f = shm.allocate(std::size_t{1} << 20));
      if (in_arena == 4) return "the arena held more than its size";
      for (auto f : filler) shm.deallocate(f);
      for (auto b : blocks) shm.deallocate(b);
      shm.deallocate(big);
      // All returned: one block of nearly the whole arena fits again.
      const auto again = shm.allocate(std::size_t{3} << 20);
      if (!shm.shared(again)) return "returned blocks were not reused";
      shm.deallocate(again);
      shm.deallocate({});
      // No arena at all: every block is ordinary memory.
      SharedMemoryOptions off = options(0, 1, fresh_job());
      off.arena_bytes = 0;
      SharedMemory plain(off);
      const auto p = plain.allocate(4096);
      if (p.size() != 4096 || !aligned(p) || plain.shared(p)) return "arena_bytes 0 still gave arena memory";
      plain.deallocate(p);
      return "ok";
    });
    CHECK_MESSAGE(results[0].ok(), results[0].report);
    CHECK_FALSE(segment_exists(job, 1));
  }

  TEST_CASE("messages between arena and private buffers: all four combinations, either side posting first") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      SharedMemory shm(options(rank, 2, job));
      const int other = 1 - rank;
      Turns turns{shm, other};
      const std::size_t bytes = (std::size_t{3} << 20) + 5;  // more than one copy's worth, odd size
      const auto shared_block = shm.allocate(bytes + 64);
      if (!shm.shared(shared_block)) return "no arena block";
      std::vector<std::byte> private_block(bytes + 64);
      std::uint64_t tag = 1000;
      for (bool send_shared : {false, true})
        for (bool receive_shared : {false, true})
          for (bool sender_first : {false, true}) {
            const bool sending = rank == 0;
            // An odd offset: messages need not start where a block does.
            const bool here_shared = sending ? send_shared : receive_shared;
            std::byte* block = here_shared ? shared_block.data() : private_block.data();
            const std::span<std::byte> buffer(block + 3, bytes);
            const auto fill = static_cast<std::byte>(tag & 0xff);
            std::fill(buffer.begin(), buffer.end(), sending ? fill : std::byte{0});
            buffer.back() = sending ? ~fill : std::byte{0};
            SharedMemory::Request r;
            const bool first = sending == sender_first;
            if (!first) turns.await_signal(tag + 1);  // the other side has posted
            if (sending)
              shm.send(r, other, tag, buffer);
            else
              shm.recv(r, other, tag, buffer);
            if (first) turns.signal(tag + 1);
            const std::size_t n = shm.wait(r, Turns::deadline());
            const auto where = fmt::format("send {}, receive {}, {} first", send_shared ? "arena" : "private",
                                           receive_shared ? "arena" : "private", sender_first ? "sender" : "receiver");
            if (n != bytes) return fmt::format("{}: {} bytes", where, n);
            if (!sending && (std::any_of(buffer.begin(), buffer.end() - 1, [&](std::byte b) { return b != fill; }) ||
                             buffer.back() != ~fill))
              return fmt::format("{}: wrong contents", where);
            tag += 2;
          }
      turns.barrier();
      shm.deallocate(shared_block);
      return "ok";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    CHECK_FALSE(segment_exists(job, 2));
  }

  TEST_CASE("recv_add: the message added to arena values, f32 and f64, sender's buffer in the arena or private, either side first") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      SharedMemory shm(options(rank, 2, job));
      const int other = 1 - rank;
      const bool sending = rank == 0;
      Turns turns{shm, other};
      // Values the receiver adds to, and what arrives: both rank-independent, so each side knows
      // the expected sum; the sizes are more than one 64 KiB piece of a cross-memory read.
      const auto check = [&]<class T>(std::span<T> values, std::size_t count, std::uint64_t tag,
                                      const std::string& where) -> std::string {
        const auto mine = test::random_values(count, static_cast<unsigned>(tag));
        const auto sent = test::random_values(count, static_cast<unsigned>(tag) + 1);
        for (std::size_t i = 0; i < count; ++i)
          if (values[i] != static_cast<T>(mine[i]) + static_cast<T>(sent[i]))
            return fmt::format("{}: element {} is {}, expected {} + {}", where, i, values[i], mine[i], sent[i]);
        return "";
      };
      const std::size_t count = 100003;
      const auto shared_block = shm.allocate(count * sizeof(double) + 64);
      if (!shm.shared(shared_block)) return "no arena block";
      std::vector<double> private_block(count + 8);
      std::uint64_t tag = 2000;
      const auto run = [&]<class T>(T) -> std::string {
        for (bool send_shared : {false, true})
          for (bool sender_first : {false, true}) {
            const auto where = fmt::format("{}, send {}, {} first", sizeof(T) == 4 ? "f32" : "f64",
                                           send_shared ? "arena" : "private", sender_first ? "sender" : "receiver");
            const bool here_shared = !sending || send_shared;
            std::byte* block = here_shared ? shared_block.data() : reinterpret_cast<std::byte*>(private_block.data());
            const std::span<T> values(reinterpret_cast<T*>(block), count);
            const auto initial = test::random_values(count, static_cast<unsigned>(tag) + (sending ? 1 : 0));
            std::copy(initial.begin(), initial.end(), values.begin());
            SharedMemory::Request r;
            const bool first = sending == sender_first;
            if (!first) turns.await_signal(tag + 1);
            if (sending)
              shm.send(r, other, tag, std::as_bytes(values));
            else
              shm.recv_add(r, other, tag, values);
            if (first) turns.signal(tag + 1);
            const std::size_t n = shm.wait(r, Turns::deadline());
            if (n != values.size_bytes()) return fmt::format("{}: {} bytes", where, n);
            if (!sending)
              if (auto wrong = check(values, count, tag, where); !wrong.empty()) return wrong;
            tag += 2;
          }
        return "";
      };
      if (auto wrong = run(float{}); !wrong.empty()) return wrong;
      if (auto wrong = run(double{}); !wrong.empty()) return wrong;

      // Only arena memory can be added into; a message that is not whole values fails both sides.
      std::vector<float> outside(4);
      if (shm.adds_into(other, std::as_bytes(std::span(outside))) || !shm.adds_into(other, shared_block))
        return "adds_into: wrong answer";
      const std::span<float> four(reinterpret_cast<float*>(shared_block.data()), 4);
      std::string failure;
      SharedMemory::Request r;
      try {
        if (sending) {
          shm.send(r, other, tag, shared_block.first(6));
        } else {
          try {
            shm.recv_add(r, other, tag, std::span(outside));
            return "recv_add into private memory was accepted";
          } catch (const Error& e) {
            if (e.kind() != ErrorKind::invalid_argument) return e.what();
          }
          shm.recv_add(r, other, tag, four);
        }
        shm.wait(r, Turns::deadline());
      } catch (const Error& e) {
        failure = e.what();
      }
      if (!contains(failure, "not a whole number of f32 values")) return "misfit: " + failure;
      turns.barrier();
      shm.deallocate(shared_block);
      return "ok";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    CHECK_FALSE(segment_exists(job, 2));
  }

  TEST_CASE("a segment left by a killed job is replaced, never joined") {
    const std::string job = fresh_job();
    // A job's local rank 0 creates the segment and is killed before its peer attaches.
    const pid_t doomed = ::fork();
    if (doomed == 0) {
      try {
        SharedMemory shm(options(0, 2, job));
      } catch (...) {
      }
      ::_exit(0);
    }
    for (int i = 0; i < 500 && !segment_exists(job, 2); ++i) std::this_thread::sleep_for(10ms);
    REQUIRE(segment_exists(job, 2));
    std::this_thread::sleep_for(200ms);  // the name appears before the header is written
    ::kill(doomed, SIGKILL);
    ::waitpid(doomed, nullptr, 0);
    REQUIRE(segment_exists(job, 2));  // left behind

    // A local rank 1 alone does not join it: it waits for a live local rank 0, and says why not.
    const auto alone = test::run_processes(1, [&](int) -> std::string {
      SharedMemoryOptions o = options(1, 2, job);
      o.setup_timeout = 300ms;
      SharedMemory shm(o);
      return "joined";
    });
    CAPTURE(alone[0].report);
    CHECK(contains(alone[0].report, "error timeout"));
    CHECK(contains(alone[0].report, "has exited: not joined"));

    // A new job under the same name replaces it and runs.
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      SharedMemory shm(options(rank, 2, job));
      std::array<int, 4> out{rank, rank, rank, rank}, in{};
      SharedMemory::Request s, r;
      shm.send(s, 1 - rank, 3, std::as_bytes(std::span(out)));
      shm.recv(r, 1 - rank, 3, std::as_writable_bytes(std::span(in)));
      shm.wait(s, std::chrono::steady_clock::now() + 10s);
      shm.wait(r, std::chrono::steady_clock::now() + 10s);
      return in == std::array<int, 4>{1 - rank, 1 - rank, 1 - rank, 1 - rank} ? "ok" : "wrong contents";
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    CHECK_FALSE(segment_exists(job, 2));
  }

  TEST_CASE("a segment of another token is refused; ranks that count the machine differently are told") {
    const std::string job = fresh_job();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      SharedMemoryOptions o = options(rank, rank == 0 ? 2 : 3, job);
      o.setup_timeout = 5s;
      SharedMemory shm(o);
      return "ok";
    });
    CHECK(contains(results[1].report, "error ranks disagree"));
    CHECK(contains(results[1].report, "for 2 local ranks, this rank counts 3"));

    const std::string job2 = fresh_job();
    const auto forged = test::run_processes(2, [&](int rank) -> std::string {
      SharedMemoryOptions o = options(rank, 2, job2);
      if (rank == 0) o.token = "another token";
      o.setup_timeout = 5s;
      SharedMemory shm(o);
      return "ok";
    });
    CHECK(contains(forged[1].report, "not made by a holder of this job's token"));
  }
}
