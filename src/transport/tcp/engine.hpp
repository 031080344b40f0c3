#pragma once
// TcpEngine — transport::Tcp's data path, behind the public class (tcp.hpp) so that no Asio shows
// there. Callers post sends and receives under one lock; one io thread moves the frames. Sends to
// a peer take its data sockets in turn, small ones the express lane; receives match frames by tag
// across all of a peer's sockets. The sockets come from connector.hpp when a pair is first used,
// the frame format from wire.hpp.

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "detail/intrusive_queue.hpp"
#include "gradsync/transport/tcp.hpp"
#include "transport/matcher.hpp"
#include "transport/tcp/connector.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport::detail {

using Request = Tcp::Request;

// One socket to one peer. The io thread owns the socket and the buffers; the queue, the flags and
// the parked header are shared with callers and guarded by the engine's lock.
struct Connection {
  Connection(boost::asio::ip::tcp::socket s, int p, bool lane) : socket(std::move(s)), peer(p), express(lane) {}

  boost::asio::ip::tcp::socket socket;
  const int peer;
  const bool express;  // the express lane: carries the small messages
  gradsync::detail::IntrusiveQueue<Request> queue;  // sends waiting for this socket
  bool writing = false;
  Request* sending = nullptr;
  bool beating = false;  // a heartbeat frame is being written (writing is set too)
  std::array<std::byte, tcp_wire::header_bytes> out_header{};

  std::array<std::byte, tcp_wire::header_bytes> in_header{};
  std::optional<tcp_wire::FrameHeader> parked;  // a data frame nobody has asked for yet
  Request* receiving = nullptr;
  bool closed = false;  // the peer closed it cleanly, between frames
  std::array<char, tcp_wire::max_reason_bytes> reason{};
  bool notice_after_frame = false;  // aborting: the frame on the wire ends, then the abort notice goes
};

struct Peer {
  std::vector<std::unique_ptr<Connection>> connections;  // none until the pair is first used; none for this rank
  gradsync::detail::IntrusiveQueue<Request> receives;   // posted, not yet matched to a frame
  gradsync::detail::IntrusiveQueue<Request> unsent;     // sends posted before the pair was connected
  bool dialing = false;                                 // this rank (the lower of the pair) asked for it
  std::size_t next_connection = 0;
  std::optional<Error> failure;  // set once: every later operation with this peer throws it
  // Liveness (TcpOptions::liveness): when a byte last came from the peer, and when a frame to it
  // last started; heartbeats go first on the last socket (the express lane, if there is one). A
  // peer is watched only once a frame has come from it: until its own setup is over (it may wait
  // for slower ranks) it sends no heartbeats.
  std::chrono::steady_clock::time_point heard, said;
  bool spoke = false;
};

class TcpEngine {
 public:
  using Clock = std::chrono::steady_clock;

  // Runs the rendezvous (connector.hpp), then starts the io thread.
  explicit TcpEngine(const TcpOptions& options);
  ~TcpEngine();

  int rank() const noexcept { return options_.rank; }
  int size() const noexcept { return options_.world_size; }
  TcpTraffic traffic();
  std::string describe() const;

  void post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source, std::byte* destination,
            std::size_t size);
  bool test(Request& r);
  std::size_t wait(Request& r, Clock::time_point deadline);
  void abort(const Error& cause);

 private:
  ErrorContext where(int peer, std::string operation) const;

  // Completing requests; each requires the lock.
  bool settled(Request& r);
  void finish(Request& r, std::size_t bytes);
  void fail(Request& r, const Error& e);
  void post_to_self(Request& r);

  // A send to a connected peer, under the lock: written now if small and the socket idle, else queued.
  void queue_send(Peer& p, Request& r);
  // A small send to an idle socket, from the caller's thread, under the lock.
  bool send_now(Connection& c, Request& r);
  // A pair's sockets, once connected: reading starts, and the sends that waited for them go.
  void attach(PeerSockets set);

  // The data path, on the io thread.
  void write_next(Connection& c);
  void write_frame(Connection& c, Request& r, std::size_t done);
  void read_header(Connection& c);
  void start_payload(Connection& c, Request& r);
  void read_payload(Connection& c, std::uint64_t length, std::uint64_t done);
  void read_abort_reason(Connection& c, std::uint64_t tag, std::uint64_t length);

  // Liveness, on the io thread.
  void arm_liveness();
  void check_liveness();
  void write_heartbeat(Connection& c);

  // Failures, on the io thread.
  void closed_between_frames(Connection& c);
  void connection_broke(int peer, const boost::system::error_code& ec);
  void fail_peer(int peer, const Error& e);
  void fail_peer_and_wait(int peer, const Error& e);
  void fail_pending(Peer& p, const Error& e);
  void begin_abort();
  void write_abort_notice(Connection& c);
  void abort_notice_done();
  void finish_abort();
  void linger_until_peers_close(Clock::time_point until);
  void close_sockets(Peer& p);
  void close_all();
  bool all_sent();

  TcpOptions options_;
  boost::asio::io_context io_;
  std::unique_ptr<Connector> connector_;  // after io_, which its coroutines and sockets use
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Peer> peers_;
  Matcher<Request> to_self_;  // this rank's messages to itself
  std::optional<Error> aborted_;
  std::optional<FailureOrigin> first_origin_;  // where the first peer failure seen here began
  std::shared_future<void> aborted_closed_;  // ready once abort() has let go of every buffer

  // Aborting, on the io thread only: the notice every peer gets, the sockets still owed one, the
  // deadline for all of them, and abort()'s promise.
  std::vector<std::byte> abort_notice_;
  std::size_t notices_due_ = 0;
  std::optional<boost::asio::steady_timer> abort_deadline_;
  std::shared_ptr<std::promise<void>> abort_done_;
  std::optional<boost::asio::steady_timer> liveness_timer_;  // on the io thread only
  bool closed_ = false;                                      // close_all() has run
  TcpTraffic traffic_;                       // guarded by mutex_
  std::thread io_thread_;
};

}  // namespace gradsync::transport::detail
