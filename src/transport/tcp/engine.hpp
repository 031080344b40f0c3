#pragma once
// TcpEngine — transport::Tcp's data path, behind the public class (tcp.hpp) so that no Asio shows
// there. Callers post sends and receives under one lock; one io thread moves the frames. Sends to
// a peer take its data sockets in turn, small ones the express lane; receives match frames by tag
// across all of a peer's sockets. The sockets come from connector.hpp when a pair is first used,
// the frame format from wire.hpp.
//
// The data sockets are not Asio's: they sit in an epoll set of the engine's own, which Asio
// watches as one descriptor, so that a socket can leave the io thread's sight while a caller waiting
// for a receive reads it itself (the short path, engine.cpp): a frame then wakes the caller, not
// the io thread that would wake the caller.

#include <array>
#include <cerrno>
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
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

#include "detail/intrusive_queue.hpp"
#include "gradsync/transport/tcp.hpp"
#include "transport/matcher.hpp"
#include "transport/tcp/connector.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport::detail {

using Request = Tcp::Request;

// Shared by the engine's two units (engine.cpp, io_thread.cpp).
inline void count(TcpTraffic::Count& c, std::uint64_t bytes) {
  ++c.messages;
  c.bytes += bytes;
}

// A non-blocking socket call that found nothing to read, or no room to write.
inline bool would_block(int error) { return error == EAGAIN || error == EWOULDBLOCK; }

// The io thread reads or writes at most this much of one socket's payload a turn, so that a long
// message does not hold up the other sockets, the heartbeats and the liveness check; each piece
// read counts as hearing from the peer.
inline constexpr std::size_t io_turn_bytes = std::size_t{1} << 20;

// One socket to one peer, and where its two streams stand. Everything here is guarded by the
// engine's lock; the bytes themselves move outside it, by the one thread the socket's state names:
// the io thread writes; the reader (the io thread, or a caller on the short path) reads.
struct Connection {
  enum class Reader : std::uint8_t { io, caller };
  enum class Incoming : std::uint8_t { header, payload, reason };  // what the next bytes read are
  enum class Outgoing : std::uint8_t { none, data, heartbeat, notice };  // the frame being written

  Connection(int descriptor, int p, bool lane) : fd(descriptor), peer(p), express(lane) {}
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd;  // -1 once closed
  const int peer;
  const bool express;      // the express lane: carries the small messages
  std::uint32_t watched = 0;  // the events the engine's epoll set watches for on it; 0: not in the set

  // Writing. `writing`: a frame is being written or the io thread has been asked to look at the queue.
  gradsync::detail::IntrusiveQueue<Request> queue;  // sends waiting for this socket
  bool writing = false;
  Request* sending = nullptr;  // the send being written; cleared if it fails meanwhile
  Outgoing outgoing = Outgoing::none;
  const std::byte* out_payload = nullptr;  // the frame's payload, as long as it is written
  std::size_t out_payload_bytes = 0, out_done = 0;
  bool write_blocked = false;  // the socket took no more; written on once epoll says it is writable
  bool notice_after_frame = false;  // aborting: the frame on the wire ends, then the abort notice goes
  std::array<std::byte, tcp_wire::header_bytes> out_header{};

  // Reading.
  Reader reader = Reader::io;
  bool io_reading = false;  // the io thread is in the middle of reading it
  Incoming incoming = Incoming::header;
  std::array<std::byte, tcp_wire::header_bytes> in_header{};
  std::size_t header_got = 0;
  std::optional<tcp_wire::FrameHeader> parked;  // a data frame nobody has asked for yet
  Request* receiving = nullptr;                 // the receive its payload goes to; cleared if it fails
  std::uint64_t payload_bytes = 0, payload_done = 0;
  std::array<char, tcp_wire::max_reason_bytes> reason{};  // an abort notice's reason, as it comes
  std::size_t reason_bytes = 0, reason_got = 0;
  int reason_origin = -1;
  bool closed = false;  // the peer closed it cleanly, between frames
  bool close_when_released = false;  // given up while a caller read it: closed once it lets go
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
  bool read_until(Request& r, Clock::time_point until, int interrupt_fd);
  void abort(const Error& cause);

 private:
  // What reading a socket came to (read_frames), and what a header read asks for (take_header).
  enum class ReadEnd : std::uint8_t { drained, stopped, released };
  enum class HeaderEnd : std::uint8_t { read_on, hand_to_io, failed };

  ErrorContext where(int peer, std::string operation) const;

  // Completing requests; each requires the lock.
  bool settled(Request& r);
  void finish(Request& r, std::size_t bytes);
  void fail(Request& r, const Error& e);
  void wake_reader(const Request& r);
  void post_to_self(Request& r);

  // A send to a connected peer, under the lock: written now if small and the socket idle, else queued.
  void queue_send(Peer& p, Request& r);
  // A small send to an idle socket, from the caller's thread, under the lock.
  bool send_now(Connection& c, Request& r);
  // A pair's sockets, once connected: reading starts, and the sends that waited for them go.
  void attach(PeerSockets set);

  // The epoll set; each requires the lock. watch() makes the set watch for what the socket's state
  // asks for now (reading it, if the io thread is its reader and has something to read; writing,
  // if a write is blocked).
  void watch(Connection& c);
  bool io_reads(const Connection& c) const;

  // The short path (engine.cpp): a caller waiting for receive `r` takes the peer's sockets that
  // only wait for bytes, reads them itself until `r` settles or the deadline (or, with
  // `interrupt_fd`, read_until's, until that is raised), and lets go of them. Requires the lock,
  // held again on return.
  void read_as_caller(Request& r, Clock::time_point deadline, std::unique_lock<std::mutex>& lock,
                      int interrupt_fd = -1);
  bool takes(const Connection& c, const Request& r) const;
  void release(Connection& c);  // requires the lock

  // Reads what `c` has, frame by frame, as its reader: the io thread (`own` null) or the caller
  // waiting for `own`. Without the lock.
  ReadEnd read_frames(Connection& c, Request* own);
  // A whole header in c.in_header, under the lock: heard, parked, bound to its receive, handed
  // back to the io thread, or the failure it is.
  HeaderEnd take_header(Connection& c, Request* own, std::optional<Error>& failure);
  // Requires the lock: binds the parked frame on `c` to receive `r`.
  void start_payload(Connection& c, Request& r);
  Error abort_notice_error(const Connection& c, bool reason_lost) const;

  // The io thread's side.
  void watch_sockets();
  void serve_sockets();
  void socket_readable(Connection& c);
  void socket_writable(Connection& c);
  void read_failed(Connection& c, const boost::system::error_code& ec);
  void write_next(Connection& c);
  void write_abort_notice(Connection& c);
  void write_on(Connection& c);
  void frame_written(Connection& c);
  void write_failed(Connection& c, const boost::system::error_code& ec);
  void close_connection(Connection& c);  // requires the lock

  // Liveness, on the io thread.
  void arm_liveness();
  void check_liveness();

  // Failures, on the io thread.
  void closed_between_frames(Connection& c);
  void connection_broke(int peer, const boost::system::error_code& ec);
  void fail_peer(int peer, const Error& e);
  void notice_heard(int peer, const Error& e);
  void fail_peer_and_wait(int peer, const Error& e);
  void fail_pending(Peer& p, const Error& e);
  void begin_abort();
  void abort_notice_done();
  void finish_abort();
  void linger_until_peers_close(Clock::time_point until);
  void close_sockets(Peer& p);
  void close_all();
  void close_once_sent();
  bool all_sent();

  TcpOptions options_;
  boost::asio::io_context io_;
  std::unique_ptr<Connector> connector_;  // after io_, which its coroutines and sockets use
  int epoll_fd_ = -1;                     // the data sockets' epoll set, owned by epoll_watch_
  boost::asio::posix::stream_descriptor epoll_watch_;  // Asio's watch of it, on the io thread
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Peer> peers_;
  Matcher<Request> to_self_;  // this rank's messages to itself
  std::optional<Error> aborted_;
  std::optional<FailureOrigin> first_origin_;  // where the first peer failure seen here began
  std::shared_future<void> aborted_closed_;  // ready once abort() has let go of every buffer
  // Callers on the short path, each with the receive it waits for and the eventfd it polls beside
  // its sockets: what settles that receive elsewhere (another socket, a failure) writes to it.
  std::vector<std::pair<const Request*, int>> readers_;

  // Aborting, on the io thread only: the notice every peer gets, the sockets still owed one, the
  // handshakes still under way, the deadline for all of them, and abort()'s promise.
  std::vector<std::byte> abort_notice_;
  std::size_t notices_due_ = 0;
  bool connections_settled_ = false;  // no handshake is under way any more (Connector::stop_connecting)
  std::optional<boost::asio::steady_timer> abort_deadline_;
  std::shared_ptr<std::promise<void>> abort_done_;
  std::optional<boost::asio::steady_timer> liveness_timer_;  // on the io thread only
  bool closed_ = false;                                      // close_all() has run
  TcpTraffic traffic_;                       // guarded by mutex_
  std::thread io_thread_;
};

}  // namespace gradsync::transport::detail
