// transport::Mpi under mpirun. Every rank of the job runs these cases in the same order (each case
// builds its own Mpi, a collective); rank 0 reports, the others print only failures. tests/
// meson.build runs the suite at several world sizes and thread levels, and tests/mpi/check.sh
// kills a rank.
//
//   test_mpi [--mpi-init=multiple|serialized|gradsync] [doctest options]
//     multiple (default), serialized: the program initialises MPI itself at that thread level;
//     gradsync: it leaves MPI to the transport, which initialises and finalises it.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/synchronizer.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/parameter_server.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/transport/in_process.hpp"
#include "gradsync/transport/mpi.hpp"
#include "gradsync/transport/routed.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using transport::Mpi;

namespace {

int required_level = MPI_THREAD_MULTIPLE;  // what main() initialised MPI with; -1: left to gradsync

auto soon(std::chrono::milliseconds d = 20s) { return std::chrono::steady_clock::now() + d; }

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}
template <class T>
std::span<std::byte> bytes_of(std::vector<T>& v) {
  return std::as_writable_bytes(std::span(v));
}

// Every rank reaches this point before any leaves it, over the transport itself.
void barrier(Mpi& t, std::uint64_t tag) {
  std::vector<Mpi::Request> out(static_cast<std::size_t>(t.size())), in(static_cast<std::size_t>(t.size()));
  for (int p = 0; p < t.size(); ++p) {
    t.send(out[static_cast<std::size_t>(p)], p, tag, {});
    t.recv(in[static_cast<std::size_t>(p)], p, tag, {});
  }
  for (int p = 0; p < t.size(); ++p) {
    t.wait(out[static_cast<std::size_t>(p)], soon());
    t.wait(in[static_cast<std::size_t>(p)], soon());
  }
}

std::vector<std::uint8_t> pattern(std::size_t n, int from, int to, int salt) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 131 + static_cast<std::size_t>(from * 17 + to * 5 + salt));
  return v;
}


// Averages of gradient-like values (support.hpp's spread of magnitudes) over a few iterations with
// Synchronizer<FixedSize, C, T, X>: what this rank holds after each iteration, one after another.
template <class C, class T, class X>
std::vector<float> averages(X transport, Options options, C codec, T topology, int rank) {
  const std::vector<std::size_t> sizes{1, 13, 1009, 70001};
  Synchronizer<bucketing::FixedSize, C, T, X> sync(std::move(transport), options,
                                                   bucketing::FixedSize{.cap_bytes = 64 << 10, .first_cap_bytes = 16 << 10},
                                                   codec, topology);
  std::vector<std::vector<float>> grads;
  for (std::size_t s : sizes) grads.emplace_back(s);
  for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(std::span(grads[g])));
  std::vector<float> out;
  for (int iteration = 0; iteration < 3; ++iteration) {
    for (std::size_t g = 0; g < sizes.size(); ++g) {  // into the registered buffers
      const auto values = test::random_values(sizes[g], 1000u * static_cast<unsigned>(iteration) + 10u * g + static_cast<unsigned>(rank));
      std::copy(values.begin(), values.end(), grads[g].begin());
    }
    for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
    sync.wait();
    for (const auto& g : grads) out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// The same Synchronizer over transport::InProcess, `n` threads: rank `rank`'s averages.
template <class C, class T>
std::vector<float> in_process_reference(Options options, C codec, T topology, int rank, int n) {
  std::vector<std::vector<float>> all(static_cast<std::size_t>(n));
  const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
    const int r = t.rank();
    all[static_cast<std::size_t>(r)] = averages(std::move(t), options, codec, topology, r);
  });
  for (const auto& e : errors) REQUIRE_MESSAGE(!e, e->what());
  return all[static_cast<std::size_t>(rank)];
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class C, class T>
void check_against_in_process(const char* name, C codec, T topology) {
  for (const Executor executor : {Executor::serial, Executor::task_graph}) {
    CAPTURE(name);
    CAPTURE(static_cast<int>(executor));
    Mpi mpi;
    const int rank = mpi.rank(), n = mpi.size();
    const Options options{.timeout = 30s, .executor = executor};
    const auto got = averages(std::move(mpi), options, codec, topology, rank);
    CHECK_MESSAGE(same_bits(got, in_process_reference(options, codec, topology, rank, n)),
                  "rank ", rank, "'s averages differ from the in-process run's bits");
  }
}

// Hierarchical with the link fixed (measuring it would let timing pick the schedule), machines of
// two ranks emulated where the world is even.
topology::Hierarchical hierarchical_for(int n) {
  return {.ranks_per_machine = n % 2 == 0 ? 2 : n, .chunk_elements = 4096, .measure_link = false};
}

}  // namespace

TEST_SUITE("mpi") {
  TEST_CASE("the transport takes MPI's thread level and says what it runs on") {
    Mpi t;
    CHECK(t.size() >= 2);
    CHECK(t.describe().find(std::to_string(t.size()) + " ranks") != std::string::npos);
    if (required_level >= 0) CHECK(t.thread_level() == required_level);
    else CHECK(t.thread_level() == MPI_THREAD_MULTIPLE);  // gradsync asks for MULTIPLE
    const transport::SharedMemoryOptions machine = t.machine_options();
    CHECK(machine.local_size == t.size());  // mpirun on one host: one machine
    CHECK(machine.local_rank == t.rank());
    CHECK(machine.first_rank == 0);
    CHECK(machine.job.size() > 8);
  }

  TEST_CASE("messages are matched by peer and tag whichever is posted first: to every rank, to itself, 0 bytes to 1 GiB + 3") {
    Mpi t;
    const int n = t.size(), me = t.rank();
    // Three messages to every rank, itself included: tags 10 (70001 bytes), 20 (0 bytes) and 30
    // (7 bytes), and two more on tag 40 that must arrive in the order they were sent. Receives go
    // up in the opposite order, each waited for before the next is posted: a message nobody has
    // asked for yet must not hold back a later one.
    std::vector<std::vector<std::uint8_t>> out;
    std::vector<Mpi::Request> sends(static_cast<std::size_t>(5 * n));
    for (int p = 0; p < n; ++p) {
      out.push_back(pattern(70001, me, p, 1));
      out.push_back({});
      out.push_back(pattern(7, me, p, 3));
      out.push_back(pattern(100, me, p, 4));
      out.push_back(pattern(200, me, p, 5));
    }
    const std::uint64_t tags[] = {10, 20, 30, 40, 40};
    for (int p = 0; p < n; ++p)
      for (int k = 0; k < 5; ++k)
        t.send(sends[static_cast<std::size_t>(5 * p + k)], p, tags[k], bytes_of(out[static_cast<std::size_t>(5 * p + k)]));
    for (int p = 0; p < n; ++p) {
      std::vector<std::uint8_t> a(70001 + 50), b(16), c(16), d(300), e(300);
      Mpi::Request ra, rb, rc, rd, re;
      t.recv(rc, p, 30, bytes_of(c));
      CHECK(t.wait(rc, soon()) == 7);
      t.recv(rb, p, 20, bytes_of(b));
      CHECK(t.wait(rb, soon()) == 0);
      t.recv(ra, p, 10, bytes_of(a));
      CHECK(t.wait(ra, soon()) == 70001);
      t.recv(rd, p, 40, bytes_of(d));
      t.recv(re, p, 40, bytes_of(e));
      CHECK(t.wait(re, soon()) == 200);
      CHECK(t.wait(rd, soon()) == 100);
      CHECK(std::equal(c.begin(), c.begin() + 7, pattern(7, p, me, 3).begin()));
      CHECK(std::equal(a.begin(), a.begin() + 70001, pattern(70001, p, me, 1).begin()));
      CHECK(std::equal(d.begin(), d.begin() + 100, pattern(100, p, me, 4).begin()));
      CHECK(std::equal(e.begin(), e.begin() + 200, pattern(200, p, me, 5).begin()));
    }
    for (auto& s : sends) t.wait(s, soon());
    // One message over MPI's int count travels as two payload pieces (at two ranks only: 1 GiB each).
    if (n == 2) {
      const std::size_t big = (std::size_t{1} << 30) + 3;
      std::vector<std::uint8_t> buffer(big);
      Mpi::Request r;
      if (me == 0) {
        buffer.front() = 7;
        buffer.back() = 9;
        t.send(r, 1, 50, bytes_of(buffer));
        t.wait(r, soon(120s));
      } else {
        t.recv(r, 0, 50, bytes_of(buffer));
        CHECK(t.wait(r, soon(120s)) == big);
        CHECK(buffer.front() == 7);
        CHECK(buffer.back() == 9);
      }
    }
    barrier(t, 60);
  }

  TEST_CASE("a message longer than its receive fails both sides; the others hear why") {
    Mpi t;
    const int me = t.rank();
    std::vector<std::byte> big(8), small(4), none;
    Mpi::Request r, next;
    if (me == 0) {
      t.send(r, 1, 5, big);
      try {
        t.wait(r, soon());  // an eager send may be done before rank 1 looks at it
        t.recv(next, 1, 6, bytes_of(none));
        t.wait(next, soon());
        FAIL("rank 1's refusal never came");
      } catch (const Error& e) {
        INFO(std::string(e.what()));
        CHECK(e.kind() == ErrorKind::protocol);
        CHECK(e.context().peer == 1);
        CHECK(std::string(e.what()).find("8 bytes") != std::string::npos);
      }
    } else if (me == 1) {
      t.recv(r, 0, 5, std::span(small));
      try {
        t.wait(r, soon());
        FAIL("the message did not fit, and wait() returned");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::protocol);
        CHECK(e.context().peer == 0);
        CHECK(std::string(e.what()).find("does not fit the 4-byte receive") != std::string::npos);
      }
    } else {
      t.recv(r, 1, 7, bytes_of(none));  // rank 1 never sends: its notice ends this
      CHECK_THROWS_AS(t.wait(r, soon()), Error);
    }
  }

  TEST_CASE("bad peers, sends over the message limit, reused requests and a null communicator are refused") {
    CHECK_THROWS_AS(Mpi({.communicator = MPI_COMM_NULL}), Error);
    Mpi t({.max_message_bytes = 16});
    std::vector<std::byte> big(17), room(64);
    Mpi::Request r;
    const auto kind_of = [](auto&& post) -> std::optional<ErrorKind> {
      try {
        post();
      } catch (const Error& e) {
        return e.kind();
      }
      return std::nullopt;
    };
    CHECK(kind_of([&] { t.send(r, t.size(), 1, {}); }) == ErrorKind::invalid_argument);
    CHECK(kind_of([&] { t.send(r, t.rank(), 1, big); }) == ErrorKind::invalid_argument);
    CHECK(kind_of([&] { t.wait(r, soon()); }) == ErrorKind::invalid_argument);  // never posted
    // A receive may have room beyond the limit; a request still pending is not posted again.
    t.recv(r, t.rank(), 2, room);
    CHECK(kind_of([&] { t.recv(r, t.rank(), 2, room); }) == ErrorKind::invalid_argument);
    Mpi::Request s;
    t.send(s, t.rank(), 2, std::span(big).first(16));
    CHECK(t.wait(r, soon()) == 16);
    t.wait(s, soon());
  }

  TEST_CASE("a wait past its deadline withdraws the receive; the message then lands in the next one") {
    Mpi t;
    const int me = t.rank();
    std::vector<std::uint32_t> value{0}, sent{7};
    Mpi::Request r, s, go;
    if (me == 0) {
      t.recv(r, 1, 3, bytes_of(value));
      try {
        t.wait(r, soon(100ms));
        FAIL("wait returned");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::timeout);
        CHECK(e.context().rank == 0);
        CHECK(e.context().peer == 1);
        CHECK(e.context().operation == "recv");
      }
      t.send(go, 1, 4, {});
      t.wait(go, soon());
      t.recv(r, 1, 3, bytes_of(value));
      CHECK(t.wait(r, soon()) == 4);
      CHECK(value[0] == 7);
    } else if (me == 1) {
      t.recv(go, 0, 4, {});
      t.wait(go, soon());
      t.send(s, 0, 3, bytes_of(sent));
      t.wait(s, soon());
    }
    barrier(t, 8);
  }

  TEST_CASE("abort reaches every rank at once: each fails with peer_failed naming the rank and its reason") {
    Mpi t;
    const int me = t.rank(), last = t.size() - 1;
    std::vector<std::uint32_t> value{0};
    Mpi::Request r, posted;
    if (me == last) {
      // Once every other rank waits for a message from this one, it aborts instead.
      for (int p = 0; p < last; ++p) {
        t.recv(posted, p, 1, {});
        t.wait(posted, soon());
      }
      t.abort(Error(ErrorKind::invalid_argument, {.rank = last, .operation = "backward"}, "user code threw"));
      CHECK_THROWS_AS(t.send(r, 0, 9, bytes_of(value)), Error);  // and this rank's transport is done
    } else {
      t.recv(r, last, 9, bytes_of(value));  // never sent
      t.send(posted, last, 1, {});
      try {
        t.wait(r, soon(60s));
        FAIL("wait returned");
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::peer_failed);
        CHECK(e.context().peer == last);
        CHECK(std::string(e.what()).find("user code threw") != std::string::npos);
        REQUIRE(e.origin());
        CHECK(e.origin()->rank == last);
      }
    }
  }

  TEST_CASE("Synchronizer over Mpi: ring, parameter server and hierarchical, four codecs, both executors, the in-process bits") {
    const int n = Mpi().size();
    check_against_in_process("ring none", compression::None{}, topology::Ring{.chunk_elements = 4096});
    check_against_in_process("ring fp16", compression::Fp16{}, topology::Ring{.chunk_elements = 4096});
    check_against_in_process("ring ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{},
                             topology::Ring{.chunk_elements = 4096});
    check_against_in_process("ring top-k", compression::TopK{}, topology::Ring{.chunk_elements = 4096});
    check_against_in_process("parameter server none", compression::None{}, topology::ParameterServer{});
    check_against_in_process("parameter server ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{},
                             topology::ParameterServer{});
    check_against_in_process("hierarchical none", compression::None{}, hierarchical_for(n));
    check_against_in_process("hierarchical ef-two-bit", compression::ErrorFeedback<compression::TwoBit>{},
                             hierarchical_for(n));
  }

  TEST_CASE("Routed<SharedMemory, Mpi> with hierarchical: the machine MPI reports, and machines of two emulated") {
    using World = transport::Routed<transport::SharedMemory, Mpi>;
    for (const bool emulated : {false, true}) {
      CAPTURE(emulated);
      Mpi mpi;
      const int rank = mpi.rank(), n = mpi.size();
      if (emulated && n % 2 != 0) continue;
      transport::SharedMemoryOptions machine = mpi.machine_options();
      if (emulated) {
        machine.local_rank = rank % 2;
        machine.local_size = 2;
        machine.first_rank = rank - rank % 2;
        machine.job += "-emulated";
      }
      const topology::Hierarchical topology{.ranks_per_machine = machine.local_size, .chunk_elements = 4096,
                                            .measure_link = false};
      const auto codec = compression::ErrorFeedback<compression::TwoBit>{};
      const Options options{.timeout = 30s};
      const auto got = averages(World(transport::SharedMemory(machine), std::move(mpi)), options, codec, topology, rank);
      CHECK_MESSAGE(same_bits(got, in_process_reference(options, codec, topology, rank, n)),
                    "rank ", rank, "'s averages differ from the in-process run's bits");
    }
  }

  // Run by tests/mpi/check.sh, which kills rank 1 this way and looks at what the others print.
  TEST_CASE("killed: rank 1 dies in the second iteration; the others print what they saw" * doctest::skip()) {
    Mpi mpi;
    const int rank = mpi.rank();
    Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, Mpi> sync(std::move(mpi), {.timeout = 5s});
    std::vector<float> gradient = test::random_values(std::size_t{1} << 18, static_cast<std::uint64_t>(rank));
    sync.add("g", view(std::span(gradient)));
    try {
      for (int iteration = 0; iteration < 2; ++iteration) {
        if (iteration == 1 && rank == 1) std::raise(SIGKILL);
        sync.ready(0);
        sync.wait();
      }
      std::printf("rank %d: no error\n", rank);
    } catch (const Error& e) {
      std::printf("rank %d saw: %s\n", rank, e.what());
    }
    std::fflush(stdout);
  }
}

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--mpi-init=gradsync") required_level = -1;
    else if (arg == "--mpi-init=serialized") required_level = MPI_THREAD_SERIALIZED;
    else if (arg == "--mpi-init=multiple") required_level = MPI_THREAD_MULTIPLE;
    else args.push_back(argv[i]);
  }
  int provided = 0;
  if (required_level >= 0) MPI_Init_thread(&argc, &argv, required_level, &provided);
  // The launcher's rank: MPI may not be initialised yet (--mpi-init=gradsync).
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (!rank) rank = std::getenv("PMI_RANK");
  doctest::Context context(static_cast<int>(args.size()), args.data());
  if (rank && std::string_view(rank) != "0") context.setOption("minimal", true);
  const int failed = context.run();
  if (required_level >= 0) MPI_Finalize();
  return failed;
}
