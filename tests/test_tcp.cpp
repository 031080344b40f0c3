// transport::Tcp between real processes over loopback: allreduce correctness, a peer killed
// mid-allreduce, refused tokens and wire versions, malformed frames.

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <filesystem>
#include <cstring>
#include <mutex>
#include <new>
#include <set>
#include <sstream>

#include <fmt/ranges.h>

#include "allocation_count.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"
#include "transport/tcp/wire.hpp"  // private to the library: src/
#include "processes.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using transport::Tcp;
using transport::TcpOptions;

namespace {

constexpr const char* token = "test-token-0123456789";

TcpOptions options(int rank, int n, std::uint16_t port) {
  TcpOptions o;
  o.rank = rank;
  o.world_size = n;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.token = token;
  o.setup_timeout = 20s;
  return o;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- a fake rank speaking the wire protocol by hand, on a blocking POSIX socket -------------------

struct RawPeer {
  int fd = -1;
  ~RawPeer() {
    if (fd >= 0) ::close(fd);
  }
  void connect_to(std::uint16_t port) {
    for (int attempt = 0; attempt < 400; ++attempt) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(port);
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) return;
      ::close(fd);
      std::this_thread::sleep_for(25ms);
    }
    throw std::runtime_error("could not connect");
  }
  void put(const void* data, std::size_t n) const {
    if (::send(fd, data, n, MSG_NOSIGNAL) != static_cast<ssize_t>(n)) throw std::runtime_error("send");
  }
  bool get(void* data, std::size_t n) const {
    auto* at = static_cast<char*>(data);
    for (std::size_t done = 0; done < n;) {
      const ssize_t got = ::recv(fd, at + done, n - done, 0);
      if (got <= 0) return false;
      done += static_cast<std::size_t>(got);
    }
    return true;
  }
  // Plays rank 1 of 2 through the rendezvous: reports to rank 0 where it listens, then takes rank
  // 0's connection (rank 1's parent in the table's tree) and the table on it, which becomes `fd`.
  // Returns rank 0's hello from the report (there, with another version, the fake stops).
  std::optional<transport::tcp_wire::Hello> join(std::uint16_t version = transport::tcp_wire::version,
                                                  std::string_view with_token = token) {
    namespace wire = transport::tcp_wire;
    const auto hello = greet(version, 1, with_token);  // connection 1 of a 1-socket pair: the report
    if (version != wire::version || !hello) return hello;
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof addr;
    ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(listener, 4);
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length);
    send_text(wire::FrameType::address, "1 127.0.0.1 " + std::to_string(ntohs(addr.sin_port)) + "\n");
    const bool acknowledged = receive_text().has_value();
    ::close(fd);
    fd = acknowledged ? ::accept(listener, nullptr, nullptr) : -1;
    ::close(listener);
    if (fd < 0 || !greet(wire::version, 0, with_token) || !receive_text()) return std::nullopt;
    return hello;
  }
  // Both hellos, then both proofs (those only where the versions match); returns the peer's hello.
  // Both sides write first, so a fake that accepted the connection greets the same way.
  std::optional<transport::tcp_wire::Hello> greet(std::uint16_t version, std::uint32_t connection,
                                                   std::string_view with_token, std::uint32_t rank = 1,
                                                   std::uint32_t world_size = 2) {
    namespace wire = transport::tcp_wire;
    const auto own = wire::encode(wire::Hello{.version = version, .rank = rank, .world_size = world_size, .connection = connection});
    put(own.data(), own.size());
    std::array<std::byte, wire::hello_bytes> theirs{};
    if (!get(theirs.data(), theirs.size())) return std::nullopt;
    std::string why;
    const auto hello = wire::decode_hello(theirs, why);
    if (version != wire::version || !hello) return hello;
    const auto p = wire::proof(with_token, own, theirs);
    put(p.data(), p.size());
    std::array<std::byte, wire::proof_bytes> their_proof{};
    if (!get(their_proof.data(), their_proof.size())) return std::nullopt;
    return hello;
  }
  void send_text(transport::tcp_wire::FrameType type, const std::string& text) const {
    const auto header = transport::tcp_wire::encode(transport::tcp_wire::FrameHeader{type, 0, text.size()});
    put(header.data(), header.size());
    put(text.data(), text.size());
  }
  std::optional<std::string> receive_text() const {
    std::array<std::byte, transport::tcp_wire::header_bytes> bytes{};
    if (!get(bytes.data(), bytes.size())) return std::nullopt;
    std::string why;
    const auto header = transport::tcp_wire::decode_header(bytes, why);
    if (!header) return std::nullopt;
    std::string text(header->length, '\0');
    if (!get(text.data(), text.size())) return std::nullopt;
    return text;
  }
  void frame(std::uint64_t tag, std::uint64_t length) const {
    const auto header = transport::tcp_wire::encode(transport::tcp_wire::FrameHeader{transport::tcp_wire::FrameType::data, tag, length});
    put(header.data(), header.size());
  }
};

// Rank 0 as a real Tcp endpoint that waits for one 16-byte message from rank 1, tag 7.
std::string receive_one(std::uint16_t port) {
  Tcp t(options(0, 2, port));
  std::array<std::byte, 16> buffer{};
  Tcp::Request r;
  t.recv(r, 1, 7, buffer);
  t.wait(r, std::chrono::steady_clock::now() + 20s);
  return "ok";
}

// A listening socket on 127.0.0.1:port, where a fake rank 0 waits.
int listen_on(std::uint16_t port, int backlog) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  const int yes = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::listen(listener, backlog);
  return listener;
}

// A fake rank 0 of an n-rank job: takes reports on `port` until ranks 1 .. n-1 are all in (or 20
// s pass), and returns how many report connections brought them, or why it stopped. Each report
// is acknowledged; no table is ever sent, so the real ranks end at their setup timeout.
struct Reports {
  int connections = 0;
  std::set<int> ranks;
  std::string failure;
};
Reports take_reports(std::uint16_t port, int n) {
  namespace wire = transport::tcp_wire;
  Reports got;
  const int listener = listen_on(port, 64);
  const timeval patience{.tv_sec = 20, .tv_usec = 0};
  ::setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof patience);
  while (static_cast<int>(got.ranks.size()) < n - 1) {
    RawPeer peer;
    peer.fd = ::accept(listener, nullptr, nullptr);
    if (peer.fd < 0) {
      got.failure = fmt::format("no report after {} ranks", got.ranks.size());
      break;
    }
    const auto hello = peer.greet(wire::version, 1, token, 0, static_cast<std::uint32_t>(n));
    const auto text = peer.receive_text();
    if (!hello || !text) {
      got.failure = "a report broke off";
      break;
    }
    ++got.connections;
    std::istringstream lines(*text);
    int rank = 0;
    std::string host, port_text;
    while (lines >> rank >> host >> port_text) {
      if (host != "127.0.0.1") got.failure = fmt::format("rank {} reported at host {}", rank, host);
      got.ranks.insert(rank);
    }
    peer.send_text(wire::FrameType::table, {});
  }
  ::close(listener);
  return got;
}

}  // namespace

TEST_SUITE("tcp") {
  TEST_CASE("the ranks of a machine report to rank 0 together: one report per machine") {
    // Ranks 1 .. 5 share a machine (local ranks 0 .. 4); rank 0, a fake, is a machine of its own.
    // Told which ranks share the machine, they gather up a tree within it and reach rank 0 once;
    // not told, each reports for itself.
    constexpr int n = 6;
    for (const int local_size : {5, 0}) {
      CAPTURE(local_size);
      const std::uint16_t port = test::free_port();
      Reports got;
      const auto results = test::run_processes(n, [&](int rank) -> std::string {
        if (rank == 0) {
          got = take_reports(port, n);
          if (!got.failure.empty()) return got.failure;
          return fmt::format("ok {} {}", got.connections, got.ranks.size());
        }
        TcpOptions o = options(rank, n, port);
        o.local_rank = rank - 1;
        o.local_size = local_size;
        o.setup_timeout = 3s;
        try {
          Tcp t(o);
        } catch (const Error& e) {
          if (e.kind() == ErrorKind::timeout) return "ok";
          return e.what();
        }
        return "set up without a table";
      });
      for (int r = 1; r < n; ++r) CHECK_MESSAGE(results[static_cast<std::size_t>(r)].ok(), r, ": ", results[static_cast<std::size_t>(r)].report);
      CHECK(results[0].report == fmt::format("ok {} {}", local_size > 1 ? 1 : n - 1, n - 1));
    }
  }

  TEST_CASE("a local rank that never starts, and ranks not numbered machine-major") {
    // The machine's tree only spares rank 0 work. Local rank 3 never starts: its parent, local rank
    // 2, goes on without it after a while, and rank 0 names it when the setup timeout ends.
    constexpr int n = 4, absent = 3;
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      if (rank == absent) return "ok";
      TcpOptions o = options(rank, n, port);
      o.local_rank = rank;
      o.local_size = n;
      o.setup_timeout = 3s;
      try {
        Tcp t(o);
      } catch (const Error& e) {
        return e.what();
      }
      return "set up without rank 3";
    });
    CAPTURE(results[0].report);
    CHECK(contains(results[0].report, "ranks 3 did not report where they listen within the setup timeout"));
    for (int r = 1; r < absent; ++r) CHECK(contains(results[static_cast<std::size_t>(r)].report, "tcp setup: timeout: the address table did not arrive"));

    // Two machines of 3, the ranks dealt to them in turn (machine r % 2, local rank r / 2), where
    // every name a rank looks for assumes rank - local rank is its machine's first: the parents'
    // names are not where the children look, so they report to rank 0 themselves, and the job
    // sets up and averages.
    constexpr int dealt = 6;
    const std::uint16_t port2 = test::free_port();
    const auto averaged = test::run_processes(dealt, [&](int rank) -> std::string {
      TcpOptions o = options(rank, dealt, port2);
      o.local_rank = rank / 2;
      o.local_size = 3;
      o.setup_timeout = 4s;
      o.log = {};
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(Tcp(o), {.timeout = 20s});
      std::vector<float> gradient(10, static_cast<float>(rank));
      sync.add("g", view(gradient));
      sync.ready(0);
      sync.wait();
      return gradient[0] == 2.5f ? "ok" : fmt::format("averaged to {}", gradient[0]);
    });
    for (int r = 0; r < dealt; ++r) CHECK_MESSAGE(averaged[static_cast<std::size_t>(r)].ok(), r, ": ", averaged[static_cast<std::size_t>(r)].report);
  }

  TEST_CASE("allreduce over TCP gives every process the ring-order reference, bit for bit") {
    const std::vector<std::size_t> sizes{0, 1, 13, 1009, 70001};
    // Coordinated sends too: with one connection per peer, a grant queued behind a message its
    // receiver does not expect yet (rank 0's plan after the first iteration) would never arrive.
    // With an express lane of 4 KiB the small gradients and the control messages take it, the
    // 70001-value gradient's 16 KiB pieces the data sockets.
    struct Variant {
      int connections;
      std::size_t express_lane_bytes;
      bool coordinated;
    };
    const Variant variants[] = {{1, 0, false}, {3, 0, false}, {1, 0, true},
                                {3, 0, true},  {1, 4096, false}, {2, 4096, true}};
    for (int n : {2, 3, 4}) {
      for (const auto& [connections, express_lane_bytes, coordinated] : variants) {
        CAPTURE(n);
        CAPTURE(connections);
        CAPTURE(express_lane_bytes);
        CAPTURE(coordinated);
        const std::uint16_t port = test::free_port();
        const auto results = test::run_processes(n, [&](int rank) -> std::string {
          TcpOptions o = options(rank, n, port);
          o.connections_per_peer = connections;
          o.express_lane_bytes = express_lane_bytes;
          Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(
              Tcp(o), {.timeout = 30s, .coordination = {.enabled = coordinated, .window = 1, .batch_bytes = 0}}, {}, {},
              {.chunk_elements = 4096});
          std::vector<std::vector<float>> grads;
          for (std::size_t s : sizes) grads.emplace_back(s);
          for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
          for (int iteration = 0; iteration < 3; ++iteration) {
            std::vector<std::vector<std::vector<float>>> inputs(sizes.size());
            for (std::size_t g = 0; g < sizes.size(); ++g)
              for (int r = 0; r < n; ++r)
                inputs[g].push_back(test::random_values(sizes[g], 1000u * static_cast<unsigned>(iteration) + 10u * g + static_cast<unsigned>(r)));
            for (std::size_t g = 0; g < sizes.size(); ++g) grads[g] = inputs[g][static_cast<std::size_t>(rank)];
            for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
            sync.wait();
            for (std::size_t g = 0; g < sizes.size(); ++g)
              if (grads[g] != test::ring_reference(compression::None{}, inputs[g]))
                return "gradient " + std::to_string(g) + " differs from the reference in iteration " + std::to_string(iteration);
          }
          return "ok";
        });
        for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
      }
    }
  }

  TEST_CASE("the per-step path over TCP allocates nothing: neither the engine nor the transport's threads") {
    // Each process counts its own allocations (every thread of it: the io thread, the engine's)
    // over ten steps after three of warm-up, with the small gradients on the express lane, two
    // data connections for the pieces of the large one, and coordinated sends.
    constexpr int n = 3;
    const std::vector<std::size_t> sizes{7, 40, 500, 3000, 70001};
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      TcpOptions o = options(rank, n, port);
      o.connections_per_peer = 2;
      o.express_lane_bytes = 4096;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(
          Tcp(o), {.timeout = 30s, .coordination = {.enabled = true, .window = 1, .batch_bytes = 0}}, {}, {},
          {.chunk_elements = 4096});
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
    });
    for (int r = 0; r < n; ++r) CHECK_MESSAGE(results[static_cast<std::size_t>(r)].ok(), r, ": ", results[static_cast<std::size_t>(r)].report);
  }

  TEST_CASE("dedicated parameter servers over TCP: the workers get their exact average") {
    // Whole-number inputs make every partial sum exact, so the expected bits do not depend on the
    // order the servers add in; the division by the worker count rounds the same way everywhere.
    // Coordinated sends and the express lane on, as a deployment with servers might run.
    const std::vector<std::size_t> sizes{1, 13, 70001};
    for (const auto& [n, servers] : {std::pair{3, 1}, std::pair{4, 2}}) {
      CAPTURE(n);
      CAPTURE(servers);
      const int workers = n - servers;
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(n, [&](int rank) -> std::string {
        TcpOptions o = options(rank, n, port);
        o.express_lane_bytes = 4096;
        const topology::ParameterServer ps{
            .partitions = 5, .servers = static_cast<std::size_t>(servers), .dedicated = true, .chunk_elements = 4096};
        Synchronizer<bucketing::PerTensor, compression::None, topology::ParameterServer, Tcp> sync(
            Tcp(o), {.timeout = 30s, .coordination = {.enabled = true}}, {}, {}, ps);
        std::vector<std::vector<float>> grads;
        for (std::size_t s : sizes) grads.emplace_back(s);
        for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
        const auto input = [](int r, std::size_t g, std::size_t e, int iteration) {
          return static_cast<float>((static_cast<std::size_t>(r) * 7 + g * 3 + e + static_cast<std::size_t>(iteration)) % 101);
        };
        for (int iteration = 0; iteration < 3; ++iteration) {
          for (std::size_t g = 0; g < sizes.size(); ++g)
            for (std::size_t e = 0; e < sizes[g]; ++e) grads[g][e] = input(rank, g, e, iteration);
          for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
          sync.wait();
          if (ps.aggregates_only(Group::world(rank, n))) continue;
          for (std::size_t g = 0; g < sizes.size(); ++g)
            for (std::size_t e = 0; e < sizes[g]; ++e) {
              float sum = 0;
              for (int w = 0; w < workers; ++w) sum += input(w, g, e, iteration);
              if (grads[g][e] != sum / static_cast<float>(workers))
                return fmt::format("gradient {} element {} is {}, expected {} in iteration {}", g, e, grads[g][e],
                                   sum / static_cast<float>(workers), iteration);
            }
        }
        return "ok";
      });
      for (const auto& r : results) CHECK_MESSAGE(r.ok(), r.report);
    }
  }

  TEST_CASE("64 ranks that may each open only 64 files set up and average: no full mesh") {
    // A full mesh needs 63 sockets per rank besides the listener and the process's own files.
    // Here a rank connects only to the peers its schedules use: the rendezvous tree, and what
    // Auto picks per bucket (recursive doubling, halving-doubling or the ring). Whole-number inputs
    // keep every partial sum exact, so every algorithm's average is the same float.
    constexpr int n = 64;
    const std::vector<std::size_t> sizes{1, 1000, 300000};
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      const rlimit files{.rlim_cur = 64, .rlim_max = 64};
      if (::setrlimit(RLIMIT_NOFILE, &files) != 0) return "setrlimit failed";
      TcpOptions o = options(rank, n, port);
      o.local_rank = rank;  // one machine: the ranks report up a tree within it
      o.local_size = n;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Auto<>, Tcp> sync(Tcp(o), {.timeout = 60s, .log = {}});
      std::vector<std::vector<float>> grads;
      for (std::size_t s : sizes) grads.emplace_back(s);
      for (std::size_t g = 0; g < sizes.size(); ++g) sync.add("g" + std::to_string(g), view(grads[g]));
      const auto input = [](int r, std::size_t g, std::size_t e) {
        return static_cast<float>((static_cast<std::size_t>(r) * 7 + g * 3 + e) % 101);
      };
      for (int iteration = 0; iteration < 2; ++iteration) {
        for (std::size_t g = 0; g < sizes.size(); ++g)
          for (std::size_t e = 0; e < sizes[g]; ++e) grads[g][e] = input(rank, g, e);
        for (std::size_t g = sizes.size(); g-- > 0;) sync.ready(static_cast<GradId>(g));
        sync.wait();
        for (std::size_t g = 0; g < sizes.size(); ++g)
          for (std::size_t e = 0; e < sizes[g]; ++e) {
            float sum = 0;
            for (int r = 0; r < n; ++r) sum += input(r, g, e);
            if (grads[g][e] != sum / n)
              return fmt::format("gradient {} element {} is {}, expected {}", g, e, grads[g][e], sum / n);
          }
      }
      const auto files_open = std::distance(std::filesystem::directory_iterator("/proc/self/fd"), {});
      return files_open < 64 ? "ok" : fmt::format("{} files open", files_open);
    }, 120s);
    for (int r = 0; r < n; ++r) CHECK_MESSAGE(results[static_cast<std::size_t>(r)].ok(), r, ": ", results[static_cast<std::size_t>(r)].report);
  }

  TEST_CASE("a rank killed in a 32-rank job: every survivor fails fast and names it") {
    // Only the dead rank's ring neighbours see its connections close; the others learn of it from
    // a neighbour's abort, which must carry where the failure began (rank 0's log, read alone,
    // must lead to the dead rank).
    constexpr int n = 32, dead = 16;
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(n, [&](int rank) -> std::string {
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(Tcp(options(rank, n, port)),
                                                                                    {.timeout = 60s});
      std::vector<float> gradient(16384, 1.0f);  // 64 KiB
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
      CAPTURE(r);
      CAPTURE(results[static_cast<std::size_t>(r)].report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      CHECK(contains(results[static_cast<std::size_t>(r)].report, "error peer failed"));
      // The neighbours saw it close; everyone else hears it named first, not through a chain of
      // each neighbour's own error (which an abort notice's length would cut).
      const std::string& report = results[static_cast<std::size_t>(r)].report;
      CHECK((contains(report, fmt::format("rank {} closed its connection", dead)) ||
             contains(report, fmt::format("rank {} failed first (rank {} closed its connection", dead, dead))));
    }
  }

  TEST_CASE("a peer killed mid-allreduce makes the others fail fast, naming it") {
    const std::pair<Executor, bool> variants[] = {{Executor::task_graph, false}, {Executor::serial, false},
                                                  {Executor::task_graph, true}};  // (executor, coordinated)
    for (const auto& [executor, coordinated] : variants) {
      CAPTURE(static_cast<int>(executor));
      CAPTURE(coordinated);
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(3, [&](int rank) -> std::string {
        Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(
            Tcp(options(rank, 3, port)), {.timeout = 60s, .executor = executor, .coordination = {.enabled = coordinated}});
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
        CAPTURE(results[static_cast<std::size_t>(r)].report);
        CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
        // peer_failed, not timeout: the 60 s timeout did not have to run out.
        CHECK(contains(results[static_cast<std::size_t>(r)].report, "error peer failed"));
        CHECK(contains(results[static_cast<std::size_t>(r)].report, "rank 2"));
      }
    }
  }

  TEST_CASE("a stopped peer (SIGSTOP) fails the others within the liveness bound, naming it") {
    int pid_pipe[2];
    REQUIRE(::pipe(pid_pipe) == 0);
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      TcpOptions o = options(rank, 3, port);
      o.liveness = 1s;
      Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(Tcp(o), {.timeout = 60s});
      std::vector<float> a(100000, 1.0f);
      sync.add("a", view(a));
      for (int iteration = 0; iteration < 2; ++iteration) {
        if (rank == 2 && iteration == 1) {
          const pid_t self = ::getpid();
          (void)!::write(pid_pipe[1], &self, sizeof self);
          ::raise(SIGSTOP);  // silent from now on: no close, no reset; its kernel still acknowledges
        }
        sync.ready(0);
        try {
          sync.wait();
        } catch (const Error&) {
          if (rank == 0) {  // the stopped rank would otherwise wait for the test's deadline
            pid_t stopped = 0;
            if (::read(pid_pipe[0], &stopped, sizeof stopped) == sizeof stopped) ::kill(stopped, SIGKILL);
          }
          throw;
        }
      }
      return "ok";
    });
    ::close(pid_pipe[0]);
    ::close(pid_pipe[1]);
    CHECK(results[2].signalled());
    for (int r : {0, 1}) {
      CAPTURE(results[static_cast<std::size_t>(r)].report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      // peer_failed from the liveness check, not the 60 s operation timeout.
      CHECK(contains(results[static_cast<std::size_t>(r)].report, "error peer failed"));
    }
    // Rank 1 waits on rank 2 directly (its left neighbour in the ring); rank 0 may hear of it
    // from rank 1's abort instead.
    CHECK(contains(results[1].report, "heard nothing from rank 2"));
  }

  TEST_CASE("no false alarm: idle peers, a frame waiting for its receive, and a transfer longer than the bound") {
    const std::uint16_t port = test::free_port();
    constexpr std::size_t bytes = std::size_t{256} << 20;
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      TcpOptions o = options(rank, 2, port);
      o.liveness = 300ms;
      Tcp t(o);
      std::vector<std::byte> buffer(bytes, std::byte{rank == 0 ? std::byte{0x5a} : std::byte{0}});
      Tcp::Request r;
      const auto deadline = [] { return std::chrono::steady_clock::now() + 60s; };
      if (rank == 0) {
        std::this_thread::sleep_for(1s);  // "computing" while rank 1 waits in recv: heartbeats only
        t.send(r, 1, 1, buffer);
        t.wait(r, deadline());
        std::this_thread::sleep_for(1s);  // rank 1's next frame parks here meanwhile
        t.recv(r, 1, 2, std::span(buffer).first(16));
        t.wait(r, deadline());
        t.recv(r, 1, 3, std::span(buffer).first(16));  // rank 1 sends it after a long pause of its own
        t.wait(r, deadline());
      } else {
        t.recv(r, 0, 1, buffer);
        t.wait(r, deadline());
        if (buffer.back() != std::byte{0x5a}) return "wrong bytes";
        t.send(r, 0, 2, std::span(buffer).first(16));
        t.wait(r, deadline());
        std::this_thread::sleep_for(1500ms);
        t.send(r, 0, 3, std::span(buffer).first(16));
        t.wait(r, deadline());
      }
      return "ok";
    });
    for (const auto& result : results) {
      CAPTURE(result.report);
      CHECK(result.ok());
    }
  }

  TEST_CASE("wait() with a gradient never marked ready: every process learns which, and from whom") {
    // A 5-minute timeout: the others must learn from rank 1's abort notice, not from a deadline.
    // "layer.a" is big enough that pieces are on the wire when rank 1 gives up.
    for (int attempt = 0; attempt < 3; ++attempt) {
      CAPTURE(attempt);
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(3, [&](int rank) -> std::string {
        Synchronizer<bucketing::PerTensor, compression::None, topology::Ring, Tcp> sync(Tcp(options(rank, 3, port)),
                                                                                        {.timeout = 5min});
        std::vector<float> a(1 << 20, 1.0f), b(8), c(1000);
        sync.add("layer.a", view(a));
        sync.add("layer.b", view(b));
        sync.add("layer.c", view(c));
        sync.ready(0);
        sync.ready(2);
        if (rank != 1) sync.ready(1);
        sync.wait();
        return "ok";
      });
      for (int r : {0, 1, 2}) {
        const std::string& report = results[static_cast<std::size_t>(r)].report;
        CAPTURE(r);
        CAPTURE(report);
        CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
        CHECK(contains(report, r == 1 ? "error invalid argument" : "error peer failed"));
        // Told by rank 1 itself ("rank 1 failed: ..."), or through rank 0, which stopped because of
        // it ("rank 1 failed first (...)").
        CHECK(contains(report, r == 1 ? "rank 1, bucket" : "rank 1 failed"));
        CHECK(contains(report, R"(never marked ready on this rank: "layer.b")"));
      }
    }
  }

  TEST_CASE("a rank waiting for a peer that never connected hears of its failure through another's notice") {
    // Connections come as the algorithms first need them: rank 2 waits for a message from rank 1,
    // which has never connected to it, and rank 1 gives up. Only rank 0 is connected to both; its
    // abort notice must fail rank 2's receive at once, not at the receive's 5-minute deadline.
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(3, [&](int rank) -> std::string {
      Tcp t(options(rank, 3, port));
      const auto deadline = std::chrono::steady_clock::now() + 5min;
      Tcp::Request r;
      std::array<std::byte, 16> buffer{};
      if (rank == 1) {
        t.send(r, 0, 1, buffer);
        t.wait(r, deadline);
        t.abort(Error(ErrorKind::invalid_argument, {.rank = 1, .operation = "test"}, "rank 1 gives up"));
        return "ok";
      }
      if (rank == 0) {
        t.send(r, 2, 1, buffer);
        t.wait(r, deadline);
        t.recv(r, 1, 1, buffer);
        t.wait(r, deadline);
        try {
          t.recv(r, 1, 2, buffer);
          t.wait(r, deadline);
        } catch (const Error& e) {
          t.abort(e);
          throw;
        }
        return "rank 1's abort notice never came";
      }
      t.recv(r, 0, 1, buffer);
      t.wait(r, deadline);
      t.recv(r, 1, 2, buffer);  // rank 1 would connect to send it: the lower rank of a pair dials
      t.wait(r, deadline);
      return "rank 1's message came";
    });
    CHECK(results[1].ok());
    for (int r : {0, 2}) {
      const std::string& report = results[static_cast<std::size_t>(r)].report;
      CAPTURE(r);
      CAPTURE(report);
      CHECK_FALSE(results[static_cast<std::size_t>(r)].killed_at_deadline);
      CHECK(contains(report, "error peer failed"));
      CHECK(contains(report, "rank 1 failed"));
      CHECK(contains(report, "rank 1 gives up"));
    }
    CHECK(contains(results[2].report, "while this rank waited for rank 1 to connect"));
  }

  TEST_CASE("ranks set up differently are refused, and both sides say why") {
    struct Case {
      const char* name;
      std::function<void(TcpOptions&)> rank1;  // how rank 1 differs
      std::vector<std::string> rank1_says, rank0_says;
    };
    const Case cases[] = {
        {"wrong job token", [](TcpOptions& o) { o.token = "not-the-job-token"; },
         {"error ranks disagree", "GRADSYNC_TOKEN"},
         {"error ranks disagree", "rank 1 (connecting from 127.0.0.1:", "cannot join this job", "GRADSYNC_TOKEN"}},
        {"express lane on one side only", [](TcpOptions& o) { o.express_lane_bytes = 65536; },
         {"error ranks disagree", "it opens 1 sockets per peer, this process 2"},
         {"error ranks disagree", "rank 1", "it opens 2 sockets per peer, this process 1"}},
    };
    for (const Case& c : cases) {
      CAPTURE(c.name);
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(2, [&](int rank) -> std::string {
        // Both sides end at once: with a 5-minute setup timeout, waiting would be killed at the
        // harness's deadline instead.
        TcpOptions o = options(rank, 2, port);
        o.setup_timeout = 5min;
        if (rank == 1) c.rank1(o);
        Tcp t(o);
        return "connected";
      });
      for (const auto& r : results) CHECK_FALSE(r.killed_at_deadline);
      CAPTURE(results[0].report);
      CAPTURE(results[1].report);
      for (const auto& text : c.rank1_says) CHECK(contains(results[1].report, text));
      for (const auto& text : c.rank0_says) CHECK(contains(results[0].report, text));
    }
  }

  TEST_CASE("a refused connection's line goes to TcpOptions::log") {
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      TcpOptions o = options(rank, 2, port);
      o.setup_timeout = 2s;
      if (rank == 1) {
        o.token = "not-the-job-token";
        Tcp t(o);
        return "connected";
      }
      std::mutex mutex;
      std::vector<std::string> lines;
      o.log = [&](std::string_view line) {
        std::lock_guard lock(mutex);
        lines.emplace_back(line);
      };
      try {
        Tcp t(o);
      } catch (const Error&) {
        // The setup times out waiting for the real rank 1: expected.
      }
      std::lock_guard lock(mutex);
      return lines.size() == 1 ? lines[0] : fmt::format("{} lines logged", lines.size());
    });
    CAPTURE(results[0].report);
    CHECK(results[0].report.starts_with("gradsync: rank 0: refused a connection from 127.0.0.1:"));
    CHECK(contains(results[0].report, "GRADSYNC_TOKEN"));
  }

  TEST_CASE("a flood of silent and garbage connections during setup does not stop the job") {
    // Process 4 floods rank 0's port with 200 connections, half never saying a word, half sending
    // garbage, all held open. Setting up one at a time with 10 s for each, the silent ones alone
    // would hold rank 0 past its 10 s setup timeout; run side by side, they cannot.
    constexpr int ranks = 4, connections = 200;
    const std::uint16_t port = test::free_port();
    // Set by the flooder once its connections are in; ranks 1-3 start then, so the flood comes first.
    void* shared = ::mmap(nullptr, sizeof(std::atomic<bool>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(shared != MAP_FAILED);
    auto* flooded = new (shared) std::atomic<bool>(false);
    const auto results = test::run_processes(ranks + 1, [&](int rank) -> std::string {
      if (rank == ranks) {
        std::vector<RawPeer> flood(connections);
        const std::array<unsigned char, 36> garbage{0xde, 0xad, 0xbe, 0xef};
        for (int c = 0; c < connections; ++c) {
          flood[static_cast<std::size_t>(c)].connect_to(port);
          if (c % 2) flood[static_cast<std::size_t>(c)].put(garbage.data(), garbage.size());
        }
        flooded->store(true);
        char byte;  // rank 0 closes every one of them by the end of its setup
        for (const RawPeer& p : flood) p.get(&byte, 1);
        return "ok";
      }
      while (rank > 0 && !flooded->load()) std::this_thread::sleep_for(10ms);
      TcpOptions o = options(rank, ranks, port);
      o.setup_timeout = 10s;
      std::mutex mutex;
      std::vector<std::string> lines;
      o.log = [&](std::string_view line) {
        std::lock_guard lock(mutex);
        lines.emplace_back(line);
      };
      { Tcp t(o); }
      std::lock_guard lock(mutex);
      // The first three refusals one by one, then one line for all the rest.
      if (lines.size() > 4) return fmt::format("{} lines logged", lines.size());
      if (rank == 0 && (lines.empty() || !lines.front().starts_with("gradsync: rank 0: refused a connection from 127.0.0.1:")))
        return fmt::format("rank 0 logged {}", fmt::join(lines, " | "));
      return "ok";
    }, 60s);
    ::munmap(shared, sizeof(std::atomic<bool>));
    for (int r = 0; r <= ranks; ++r) CHECK_MESSAGE(results[static_cast<std::size_t>(r)].ok(), r, ": ", results[static_cast<std::size_t>(r)].report);
  }

  TEST_CASE("a peer speaking another wire version is refused, and both sides say why") {
    namespace wire = transport::tcp_wire;
    const std::uint16_t newer = wire::version + 1;
    const std::string refusal = "it speaks gradsync wire version " + std::to_string(newer) +
                                ", this process speaks version " + std::to_string(wire::version);
    // A real rank 0 meets a rank 1 that speaks a newer version.
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      if (rank == 0) {
        TcpOptions o = options(0, 2, port);
        o.setup_timeout = 2s;
        Tcp t(o);
        return "connected";
      }
      RawPeer fake;
      fake.connect_to(port);
      const auto reply = fake.join(newer);
      char byte;
      const bool closed = !fake.get(&byte, 1);
      return reply && reply->version == wire::version && closed ? "ok" : "rank 0 did not answer with its own version and close";
    });
    CHECK_MESSAGE(results[1].ok(), results[1].report);
    CAPTURE(results[0].report);
    CHECK(contains(results[0].report, refusal));

    // A real rank 1 meets a rank 0 that speaks a newer version.
    const std::uint16_t port2 = test::free_port();
    const auto other = test::run_processes(2, [&](int rank) -> std::string {
      if (rank == 1) {
        Tcp t(options(1, 2, port2));
        return "connected";
      }
      const int listener = listen_on(port2, 4);
      RawPeer fake;
      fake.fd = ::accept(listener, nullptr, nullptr);
      ::close(listener);
      const auto own = wire::encode(wire::Hello{.version = newer, .rank = 0, .world_size = 2});
      fake.put(own.data(), own.size());
      std::array<std::byte, wire::hello_bytes> theirs{};
      fake.get(theirs.data(), theirs.size());
      return "ok";
    });
    CAPTURE(other[1].report);
    CHECK(contains(other[1].report, "error ranks disagree"));
    CHECK(contains(other[1].report, refusal));
  }

  TEST_CASE("oversized, ill-fitting and truncated frames are refused") {
    struct Case {
      const char* name;
      std::function<void(RawPeer&)> attack;
      const char* expected;
    };
    const std::vector<Case> cases{
        {"a frame claiming a terabyte", [](RawPeer& p) { p.frame(7, std::uint64_t{1} << 40); }, "exceeds the"},
        {"a frame larger than the receive", [](RawPeer& p) { p.frame(7, 100); }, "does not fit the 16-byte receive"},
        {"a frame cut short", [](RawPeer& p) {
           p.frame(7, 16);
           p.put("12345678", 8);
         }, "closed its connection in the middle of a message"},
        {"garbage instead of a header", [](RawPeer& p) { p.put("this is not a gradsync frame header", 24); },
         "without the GSYN mark"},
    };
    for (const Case& c : cases) {
      CAPTURE(c.name);
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(2, [&](int rank) -> std::string {
        if (rank == 0) return receive_one(port);
        RawPeer fake;
        fake.connect_to(port);
        if (!fake.join()) return "handshake failed";
        c.attack(fake);
        std::this_thread::sleep_for(200ms);  // closing at once would turn every case into a closed connection
        return "ok";
      });
      CHECK_MESSAGE(results[1].ok(), results[1].report);
      CAPTURE(results[0].report);
      CHECK(contains(results[0].report, "error "));
      CHECK(contains(results[0].report, c.expected));
      CHECK(contains(results[0].report, "rank 0, peer 1"));
    }
  }

  TEST_CASE("messages up to the express lane's size take the lane, larger ones the data sockets") {
    // Each of 2 ranks sends the other 3 messages of 100 bytes and 2 of 64 KiB, then reports what
    // its traffic counters say went where.
    constexpr std::size_t small = 100, large = 64 << 10;
    const auto traffic_of = [](std::size_t lane, int rank, std::uint16_t port) {
      TcpOptions o = options(rank, 2, port);
      o.express_lane_bytes = lane;
      Tcp t(o);
      const int peer = 1 - rank;
      std::vector<std::vector<std::byte>> out, in;
      for (std::size_t size : {small, large, small, large, small}) {
        out.emplace_back(size, std::byte{7});
        in.emplace_back(size);
      }
      std::array<Tcp::Request, 5> sends, receives;
      for (std::size_t m = 0; m < out.size(); ++m) {
        t.recv(receives[m], peer, m, in[m]);
        t.send(sends[m], peer, m, out[m]);
      }
      for (std::size_t m = 0; m < out.size(); ++m) {
        t.wait(sends[m], std::chrono::steady_clock::now() + 20s);
        t.wait(receives[m], std::chrono::steady_clock::now() + 20s);
      }
      return t.traffic();
    };
    using Count = transport::TcpTraffic::Count;
    struct Case {
      std::size_t lane;
      Count data, express;
    };
    for (const Case& c : {Case{0, {5, 3 * small + 2 * large}, {0, 0}},
                          Case{1024, {2, 2 * large}, {3, 3 * small}},
                          Case{small, {2, 2 * large}, {3, 3 * small}},  // the bound is inclusive
                          Case{small - 1, {5, 3 * small + 2 * large}, {0, 0}}}) {
      CAPTURE(c.lane);
      const std::uint16_t port = test::free_port();
      const auto results = test::run_processes(2, [&](int rank) -> std::string {
        const transport::TcpTraffic traffic = traffic_of(c.lane, rank, port);
        if (traffic.data_sent == c.data && traffic.data_received == c.data && traffic.express_sent == c.express &&
            traffic.express_received == c.express)
          return "ok";
        return fmt::format("data sent {}/{} received {}/{}, express sent {}/{} received {}/{} (messages/bytes)",
                           traffic.data_sent.messages, traffic.data_sent.bytes, traffic.data_received.messages,
                           traffic.data_received.bytes, traffic.express_sent.messages, traffic.express_sent.bytes,
                           traffic.express_received.messages, traffic.express_received.bytes);
      });
      for (const auto& r : results) CHECK(r.report == "ok");
    }
  }

  TEST_CASE("threads waiting on one peer at once each get their own frame, whoever reads the socket") {
    // Rank 0 sends rounds of 5 messages (empty, small, a lane's worth, 64 KiB, 3 MiB) over 2 data
    // sockets and an express lane. Rank 1 waits for them from 5 threads at once, its receives
    // posted in reverse order and one of them late, so that its frame parks: a caller reading a
    // socket meets frames of the other threads' receives, binds or parks them and hands the socket
    // back, and the io thread reads payloads a caller left.
    constexpr std::array<std::size_t, 5> sizes{0, 100, 4096, 64 << 10, 3 << 20};
    constexpr int rounds = 12;
    const auto fill = [](int round, std::size_t m, std::size_t i) {
      return static_cast<std::byte>((static_cast<std::size_t>(round) * 31 + m * 7 + i * 13) & 0xff);
    };
    const std::uint16_t port = test::free_port();
    const auto results = test::run_processes(2, [&](int rank) -> std::string {
      TcpOptions o = options(rank, 2, port);
      o.connections_per_peer = 2;
      o.express_lane_bytes = 4096;
      Tcp t(o);
      const auto deadline = [] { return std::chrono::steady_clock::now() + 30s; };
      std::array<std::vector<std::byte>, sizes.size()> buffers;
      std::array<Tcp::Request, sizes.size()> requests;
      for (int round = 0; round < rounds; ++round) {
        if (rank == 0) {
          for (std::size_t m = 0; m < sizes.size(); ++m) {
            buffers[m].resize(sizes[m]);
            for (std::size_t i = 0; i < sizes[m]; ++i) buffers[m][i] = fill(round, m, i);
            t.send(requests[m], 1, m, buffers[m]);
          }
          for (auto& r : requests) t.wait(r, deadline());
          t.recv(requests[0], 1, 99, {});  // rank 1 is through the round
          t.wait(requests[0], deadline());
          continue;
        }
        std::atomic<int> wrong{0};
        std::vector<std::thread> waiters;
        for (std::size_t m = sizes.size(); m-- > 0;) {
          buffers[m].assign(sizes[m], std::byte{0});
          if (m != 2) t.recv(requests[m], 0, m, buffers[m]);
          waiters.emplace_back([&, m] {
            if (m == 2) {
              std::this_thread::sleep_for(20ms);  // its frame has come and parked meanwhile
              t.recv(requests[m], 0, m, buffers[m]);
            }
            if (t.wait(requests[m], deadline()) != sizes[m]) ++wrong;
            for (std::size_t i = 0; i < sizes[m]; ++i)
              if (buffers[m][i] != fill(round, m, i)) {
                ++wrong;
                break;
              }
          });
        }
        for (auto& w : waiters) w.join();
        if (wrong > 0) return fmt::format("round {}: {} messages wrong", round, wrong.load());
        t.send(requests[0], 0, 99, {});
        t.wait(requests[0], deadline());
      }
      return "ok";
    });
    for (const auto& result : results) {
      CAPTURE(result.report);
      CHECK(result.ok());
    }
  }

  TEST_CASE("a rank sends to itself, and a world of one needs no network") {
    Tcp alone(options(0, 1, test::free_port()));
    std::array<std::byte, 4> out{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}}, in{};
    Tcp::Request s, r;
    alone.recv(r, 0, 5, in);
    alone.send(s, 0, 5, out);
    CHECK(alone.wait(r, std::chrono::steady_clock::now() + 1s) == 4);
    CHECK(in == out);
    // A receive from ourselves that nothing matches times out and is withdrawn.
    std::array<std::byte, 4> late{};
    alone.recv(r, 0, 6, late);
    CHECK_THROWS_AS(alone.wait(r, std::chrono::steady_clock::now() + 20ms), Error);
    alone.send(s, 0, 6, out);
    CHECK_FALSE(alone.test(s));
    CHECK(late == std::array<std::byte, 4>{});
  }
}
