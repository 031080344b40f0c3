#pragma once
// transport::Tcp — ranks are processes, connected pairwise over TCP (Boost.Asio, in the compiled
// library; nothing of Asio shows here).
//
// Setup: rank 0 listens on MASTER_PORT. Each machine's ranks (`local_rank`, `local_size`) gather
// where they listen up a binomial tree of their own over the machine's local sockets, and the
// machine's local rank 0 connects to rank 0 once, proves it holds the job token, tells rank 0 where
// the machine's ranks listen and hangs up; once every machine has, the table of every rank's
// address travels down a binomial tree rooted at rank 0. Rank 0 takes one report per machine. A pair of ranks connects only when
// the data path first needs it (the lower rank dials), so a rank holds sockets only to the peers
// its schedules use and its neighbours in that tree, not to every rank (docs/design.md, "TCP", says
// what a peer costs). Each pair gets `connections_per_peer` sockets;
// messages to a peer take them in turn, so consecutive pieces travel side by side. With an express
// lane (`express_lane_bytes` > 0) each pair gets one socket more, which carries every message of at
// most that many bytes and nothing else: a small message (a coordinator's grant, a plan) never
// waits behind megabytes already queued in a data socket's buffers.
//
// Every connection starts with a versioned hello and an HMAC-SHA-256 proof of the job token in
// both directions (the token itself never travels): a process with another token or wire version
// is refused, and says why on both sides. Every frame is length-checked: against the limit before
// anything is read, and against the receive it is matched to. A payload is read straight into the
// receive buffer it matches; a frame nobody has asked for yet waits in its socket (nothing is
// buffered on the frame's say-so). A connection that closes or breaks fails every operation with
// that peer at once. The wire format is in src/transport/tcp/wire.hpp.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"
#include "gradsync/launch/environment.hpp"
#include "gradsync/log.hpp"
#include "gradsync/transport/operation.hpp"
#include "gradsync/transport/read_interrupt.hpp"

namespace gradsync::detail {
template <class Request>
class IntrusiveQueue;
}

namespace gradsync::transport {

namespace detail {
class TcpEngine;
template <class Request>
class Matcher;
}

struct TcpOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  std::string token{};        // the job's shared secret
  std::string listen_addr{};  // address to listen on; empty: every interface
  // This rank's place among the job's ranks on its machine (LOCAL_RANK, LOCAL_WORLD_SIZE): local
  // ranks 0 .. local_size - 1 must share the machine's network namespace, where they find each
  // other by name. local_size 0 or 1: this rank reports to rank 0 for itself.
  int local_rank = 0;
  int local_size = 0;
  int connections_per_peer = 1;
  std::size_t express_lane_bytes = 0;  // messages up to this size take a socket of their own; 0: none
  std::chrono::milliseconds setup_timeout = std::chrono::minutes(2);  // for the rendezvous, and for each later connection
  std::uint64_t max_message_bytes = std::uint64_t{1} << 32;           // larger frames are refused unread
  // TCP congestion control for this job's sockets ("cubic", "bbr", ...); empty: the system's.
  std::string congestion_control{};
  // A peer this rank has heard nothing from for this long fails every operation with it
  // (peer_failed), whatever their own deadlines: a process stopped or a machine or link lost
  // without a connection closing. Each rank sends a heartbeat when it has sent a peer nothing for
  // a quarter of it. Bytes of a long message count as heard; the clock stands until a peer's first
  // frame and while a frame of the peer waits for its receive (its socket is not read). 0: off.
  std::chrono::milliseconds liveness = std::chrono::seconds(10);
  LogSink log = log_to_stderr;  // where setup reports the connections it refuses (log.hpp)
};

// What one rank has moved over its sockets: data frames and their payload bytes, sent (once
// written) and received (once their header arrived), on the data sockets and on the express lane.
// Messages to itself touch no socket and are not counted.
struct TcpTraffic {
  struct Count {
    std::uint64_t messages = 0;
    std::uint64_t bytes = 0;
    bool operator==(const Count&) const = default;
  };
  Count data_sent, data_received, express_sent, express_received;
};

class Tcp {
 public:
  class Request : private detail::Operation<Request> {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    using detail::Operation<Request>::report_to;

   private:
    friend class detail::TcpEngine;
    template <class>
    friend class gradsync::detail::IntrusiveQueue;
    template <class>
    friend class detail::Matcher;
    State state_ = State::idle;  // guarded by the engine's lock
  };

  // Runs the rendezvous; returns once this rank knows where every rank listens (so every rank
  // has started). Throws Error(timeout) naming what is missing after `setup_timeout`; a pair's
  // connection made later has as long.
  explicit Tcp(const TcpOptions& options);

  // Options from the launcher's environment (launch/environment.hpp), plus GRADSYNC_LISTEN_ADDR,
  // GRADSYNC_CONNECTIONS_PER_PEER, GRADSYNC_EXPRESS_LANE_BYTES, GRADSYNC_SETUP_TIMEOUT_S,
  // GRADSYNC_LIVENESS_MS and GRADSYNC_TCP_CONGESTION where set; the launcher's variables looked up
  // in `env` (SharedMemory::options_from_env says why).
  static TcpOptions options_from_env(const launch::Environment& env = launch::process_environment);
  static Tcp from_env() { return Tcp(options_from_env()); }

  Tcp(Tcp&&) noexcept;
  Tcp& operator=(Tcp&&) noexcept;
  ~Tcp();

  int rank() const noexcept;
  int size() const noexcept;
  std::string describe() const;
  TcpTraffic traffic() const;  // so far, this rank's

  void send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  bool test(Request& request);
  std::size_t wait(Request& request, std::chrono::steady_clock::time_point deadline);
  void abort(const Error& cause);

  // The short path for a thread that keeps many requests in flight (the task graph's communication
  // thread, CallerReader in concepts.hpp): reads the sockets of receive `request`'s peer on this
  // thread, as wait() does, until the receive settles (true), `until` passes or `interrupt` is raised
  // (false). Nothing is withdrawn or failed at `until`, and the outcome still goes to the request's
  // CompletionSink, from this thread. False at once where this thread cannot take the sockets: the
  // io thread is in the middle of one of the peer's frames, or the receive is not pending.
  bool read_until(Request& request, std::chrono::steady_clock::time_point until, const ReadInterrupt& interrupt);

 private:
  std::unique_ptr<detail::TcpEngine> engine_;
};

static_assert(TransportPolicy<Tcp>);

}  // namespace gradsync::transport
