// TcpEngine (engine.hpp): posting, waiting and aborting on the callers' threads; writing and
// reading frames on the io thread. A payload is read straight into the receive it matches; a
// frame nobody has asked for yet parks, and its socket is not read further until a matching
// receive is posted, so nothing is buffered on a frame's say-so. Any failure on a socket fails
// every operation with that peer at once.

#include "transport/tcp/engine.hpp"

#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

#include <algorithm>
#include <thread>

#include <boost/asio.hpp>
#include <fmt/format.h>

#include "transport/tcp/errors.hpp"

namespace gradsync::transport::detail {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {

void count(TcpTraffic::Count& c, std::uint64_t bytes) {
  ++c.messages;
  c.bytes += bytes;
}

// How long an abort may wait for frames already on the wire to end and for its notices to leave.
// Long enough for a piece of a few MiB on a slow link; a peer that does not read is not waited for
// longer than this.
constexpr auto abort_linger = std::chrono::seconds(1);

// A send of at most this many bytes to an idle socket is written from the caller's thread
// (TcpEngine::send_now); larger ones would copy that much into the kernel on a thread that has
// other work to post.
constexpr std::size_t send_now_bytes = std::size_t{64} << 10;

// A payload is read in pieces of this size, each one proof that its sender is alive.
constexpr std::uint64_t payload_piece_bytes = std::uint64_t{1} << 20;

// How long the destructor waits for its sockets' unsent bytes to leave before closing them.
constexpr auto close_linger = std::chrono::seconds(2);

}  // namespace

TcpEngine::TcpEngine(const TcpOptions& options)
    : options_(options), connector_(std::make_unique<Connector>(io_, options_)), peers_(static_cast<std::size_t>(options.world_size)) {
  for (PeerSockets& set : connector_->rendezvous()) attach(std::move(set));
  connector_->serve([this](PeerSockets set) { attach(std::move(set)); },
                    [this](int peer, const Error& e) { fail_peer(peer, e); });
  work_.emplace(asio::make_work_guard(io_));
  io_.restart();
  if (options_.liveness.count() > 0) {
    liveness_timer_.emplace(io_);
    arm_liveness();
  }
  io_thread_ = std::thread([this] { io_.run(); });
}

// Closes once what this rank sent has left its sockets (or after close_linger): a peer still
// reading may send a heartbeat meanwhile, and a socket closed with data unsent would answer it
// with a reset that drops that data.
TcpEngine::~TcpEngine() {
  work_.reset();
  asio::post(io_, [this] {
    const auto give_up = Clock::now() + close_linger;
    while (Clock::now() < give_up && !all_sent()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    close_all();
  });
  io_thread_.join();
}

// Whether the kernel has nothing left to send on the sockets of peers still in good standing.
bool TcpEngine::all_sent() {
  std::lock_guard lock(mutex_);
  for (const auto& p : peers_) {
    if (p.failure) continue;
    for (const auto& c : p.connections) {
      int unsent = 0;
      if (c->socket.is_open() && ::ioctl(c->socket.native_handle(), SIOCOUTQ, &unsent) == 0 && unsent > 0) return false;
    }
  }
  return true;
}

TcpTraffic TcpEngine::traffic() {
  std::lock_guard lock(mutex_);
  return traffic_;
}

std::string TcpEngine::describe() const {
  return options_.express_lane_bytes == 0
             ? fmt::format("tcp(connections={})", options_.connections_per_peer)
             : fmt::format("tcp(connections={}, express lane up to {} bytes)", options_.connections_per_peer,
                           options_.express_lane_bytes);
}

void TcpEngine::post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source,
                     std::byte* destination, std::size_t size) {
  const char* operation = is_send ? "send" : "recv";
  if (peer < 0 || peer >= options_.world_size)
    throw Error(ErrorKind::invalid_argument, where(peer, operation),
                fmt::format("no rank {} in a world of {}", peer, options_.world_size));
  std::lock_guard lock(mutex_);
  if (r.state_ == Request::State::pending)
    throw Error(ErrorKind::invalid_argument, where(peer, operation), "request reused while still pending");
  if (aborted_) throw aborted_->filled(where(peer, operation));
  Peer& p = peers_[static_cast<std::size_t>(peer)];
  if (p.failure) throw *p.failure;
  r.start(is_send, peer, tag, source, destination, size);
  r.state_ = Request::State::pending;
  if (peer == options_.rank) return post_to_self(r);
  if (p.connections.empty()) {
    (is_send ? p.unsent : p.receives).push(&r);
    if (peer > options_.rank && !p.dialing) {
      p.dialing = true;
      asio::post(io_, [this, peer] { connector_->dial(peer); });
    }
    return;
  }
  if (is_send) return queue_send(p, r);
  for (auto& c : p.connections)
    if (c->parked && c->parked->tag == tag) return start_payload(*c, r);
  p.receives.push(&r);
}

bool TcpEngine::test(Request& r) {
  std::lock_guard lock(mutex_);
  return settled(r);
}

std::size_t TcpEngine::wait(Request& r, Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  if (r.state_ == Request::State::idle)
    throw Error(ErrorKind::invalid_argument, where(r.peer_, "wait"), "request was never posted");
  if (cv_.wait_until(lock, deadline, [&] { return r.state_ != Request::State::pending; })) {
    settled(r);
    return r.transferred_;
  }
  const Error timeout(ErrorKind::timeout, where(r.peer_, r.is_send_ ? "send" : "recv"),
                      fmt::format("no progress on a {} of {} bytes (tag {:#x}) with rank {} before the deadline",
                                  r.is_send_ ? "send" : "receive", r.size_, r.tag_, r.peer_));
  // A message to ourselves, or a receive nobody has started filling, is simply withdrawn;
  // anything already on the wire cannot be, so the connection to that peer is given up.
  Peer& p = peers_[static_cast<std::size_t>(r.peer_)];
  const bool withdrawn = r.peer_ == options_.rank ? to_self_.withdraw(r) : (r.is_send_ ? p.unsent : p.receives).remove(&r);
  if (withdrawn) {
    r.state_ = Request::State::idle;
    throw timeout;
  }
  lock.unlock();
  fail_peer_and_wait(r.peer_, timeout);
  throw timeout;
}

void TcpEngine::abort(const Error& cause) {
  std::shared_future<void> closed;
  {
    std::lock_guard lock(mutex_);
    if (!aborted_) {
      aborted_ = cause;
      // Tell every peer why, then close, on the io thread; every caller waits for that, so
      // that no socket still reads into or writes from a buffer the caller is about to free.
      auto done = std::make_shared<std::promise<void>>();
      aborted_closed_ = done->get_future().share();
      asio::post(io_, [this, done] {
        abort_done_ = done;
        begin_abort();
      });
    }
    closed = aborted_closed_;
  }
  closed.wait();
}

ErrorContext TcpEngine::where(int peer, std::string operation) const {
  return error_context(options_.rank, peer, std::move(operation));
}

// ---- completing requests, under the lock ----------------------------------------------------------

// Throws the request's error if it failed.
bool TcpEngine::settled(Request& r) {
  switch (r.state_) {
    case Request::State::done: return true;
    case Request::State::failed: throw *r.error_;
    case Request::State::pending: return false;
    case Request::State::idle: break;
  }
  throw Error(ErrorKind::invalid_argument, where(r.peer_, "test"), "request was never posted");
}

void TcpEngine::finish(Request& r, std::size_t bytes) {
  r.transferred_ = bytes;
  r.state_ = Request::State::done;
  cv_.notify_all();
  r.report();
}

void TcpEngine::fail(Request& r, const Error& e) {
  r.error_ = e;
  r.state_ = Request::State::failed;
  cv_.notify_all();
  r.report();
}

// A message to ourselves is matched and copied here, under the lock, as the in-process
// transport would.
void TcpEngine::post_to_self(Request& r) {
  const auto match = to_self_.match_or_queue(r, [&](const Request&) { return options_.rank; });
  if (!match) return;
  Request& send = match->send;
  Request& receive = match->receive;
  if (!Matcher<Request>::copy(*match)) {
    const Error e(ErrorKind::protocol, where(options_.rank, "recv"),
                  fmt::format("message of {} bytes does not fit the {}-byte receive", send.size_, receive.size_));
    fail(send, e);
    fail(receive, e);
    return;
  }
  finish(send, send.size_);
  finish(receive, send.size_);
}

// ---- the data path, on the io thread ----------------------------------------------------------------

// Requires the lock and a connected peer.
void TcpEngine::queue_send(Peer& p, Request& r) {
  const auto data_sockets = static_cast<std::size_t>(options_.connections_per_peer);
  const bool express = options_.express_lane_bytes > 0 && r.size_ <= options_.express_lane_bytes;
  Connection& c = express ? *p.connections.back() : *p.connections[p.next_connection++ % data_sockets];
  if (!c.writing && r.size_ <= send_now_bytes && send_now(c, r)) return;
  c.queue.push(&r);
  if (!c.writing) {
    c.writing = true;
    asio::post(io_, [this, &c] { write_next(c); });
  }
}

// On the io thread (or the constructing thread, before it exists). A pair connected after this
// rank gave up on the peer, or on everything, is closed at once.
void TcpEngine::attach(PeerSockets set) {
  std::lock_guard lock(mutex_);
  Peer& p = peers_[static_cast<std::size_t>(set.peer)];
  p.dialing = false;
  if (p.failure || aborted_ || closed_) return;  // the sockets close as `set` goes
  const auto data_sockets = static_cast<std::size_t>(options_.connections_per_peer);
  for (auto& s : set.sockets) {
    const bool express = p.connections.size() == data_sockets;  // the one after the data sockets
    p.connections.push_back(std::make_unique<Connection>(std::move(s), set.peer, express));
  }
  p.heard = p.said = Clock::now();
  for (auto& c : p.connections) read_header(*c);
  while (Request* r = p.unsent.pop()) queue_send(p, *r);
}

// Under the lock, on the caller's thread, with the socket idle (nothing queued or being written):
// the frame goes out in one non-blocking sendmsg, so a small message leaves without waking the io
// thread, and its send completes here; on a loaded machine each such hand-off costs a wake-up per
// hop (design.md, "TCP"). Whatever the socket does not take at once, the io thread writes on from
// where it stopped. False where the socket refused with an error: the io thread's write meets it
// and fails the peer as usual.
bool TcpEngine::send_now(Connection& c, Request& r) {
  c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::data, r.tag_, r.size_});
  iovec parts[2] = {{c.out_header.data(), c.out_header.size()}, {const_cast<std::byte*>(r.source_), r.size_}};
  msghdr message{};
  message.msg_iov = parts;
  message.msg_iovlen = r.size_ > 0 ? 2 : 1;
  ssize_t written = ::sendmsg(c.socket.native_handle(), &message, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (written < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    written = 0;
  }
  peers_[static_cast<std::size_t>(c.peer)].said = Clock::now();
  if (static_cast<std::size_t>(written) == c.out_header.size() + r.size_) {
    count(c.express ? traffic_.express_sent : traffic_.data_sent, r.size_);
    finish(r, r.size_);
    return true;
  }
  c.writing = true;
  c.sending = &r;
  asio::post(io_, [this, &c, &r, done = static_cast<std::size_t>(written)] { write_frame(c, r, done); });
  return true;
}

void TcpEngine::write_next(Connection& c) {
  Request* r;
  {
    std::lock_guard lock(mutex_);
    r = c.queue.pop();
    c.sending = r;
    if (!r) {
      c.writing = false;
      return;
    }
    peers_[static_cast<std::size_t>(c.peer)].said = Clock::now();
  }
  c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::data, r->tag_, r->size_});
  write_frame(c, *r, 0);
}

// Writes the frame of `r` (its header in c.out_header) from byte `done` on, then the next.
void TcpEngine::write_frame(Connection& c, Request& r, std::size_t done) {
  const std::size_t header = std::min(done, c.out_header.size()), payload = done - header;
  const std::array<asio::const_buffer, 2> buffers{asio::buffer(c.out_header) + header,
                                                  asio::buffer(r.source_, r.size_) + payload};
  asio::async_write(c.socket, buffers, [this, &c, r = &r](const error_code& ec, std::size_t) {
    if (c.notice_after_frame) return ec ? abort_notice_done() : write_abort_notice(c);
    if (ec) return connection_broke(c.peer, ec);
    {
      std::lock_guard lock(mutex_);
      if (c.sending != r) return;  // failed and handed back meanwhile: not ours to touch
      c.sending = nullptr;
      count(c.express ? traffic_.express_sent : traffic_.data_sent, r->size_);
      finish(*r, r->size_);
    }
    write_next(c);
  });
}

void TcpEngine::read_header(Connection& c) {
  asio::async_read(c.socket, asio::buffer(c.in_header), [this, &c](const error_code& ec, std::size_t got) {
    const int peer = c.peer;
    if (ec == asio::error::eof && got == 0) return closed_between_frames(c);
    if (ec) return connection_broke(peer, ec);
    std::string why;
    const auto header = tcp_wire::decode_header(c.in_header, why);
    if (!header) return fail_peer(peer, protocol_error(options_.rank, peer, why));
    if (header->type == tcp_wire::FrameType::abort) return read_abort_reason(c, header->tag, header->length);
    if (header->type == tcp_wire::FrameType::heartbeat && header->length == 0) {
      {
        std::lock_guard lock(mutex_);
        Peer& p = peers_[static_cast<std::size_t>(peer)];
        p.heard = Clock::now();
        p.spoke = true;
      }
      return read_header(c);
    }
    if (header->type != tcp_wire::FrameType::data)
      return fail_peer(peer, protocol_error(options_.rank, peer,
                                            fmt::format("unexpected frame type {} after setup", int(header->type))));
    if (header->length > options_.max_message_bytes)
      return fail_peer(peer, protocol_error(options_.rank, peer,
                                            fmt::format("frame of {} bytes exceeds the {}-byte limit", header->length,
                                                        options_.max_message_bytes)));
    std::lock_guard lock(mutex_);
    Peer& p = peers_[static_cast<std::size_t>(peer)];
    if (p.failure) return;
    p.heard = Clock::now();
    p.spoke = true;
    count(c.express ? traffic_.express_received : traffic_.data_received, header->length);
    c.parked = header;
    if (Request* r = p.receives.take_if([&](const Request* q) { return q->tag_ == header->tag; })) start_payload(c, *r);
    // Otherwise the frame waits, and so does this socket, until a matching recv() arrives.
  });
}

// Requires the lock: binds the parked frame on `c` to receive `r` and has its payload read.
void TcpEngine::start_payload(Connection& c, Request& r) {
  const tcp_wire::FrameHeader header = *c.parked;
  c.parked.reset();
  peers_[static_cast<std::size_t>(c.peer)].heard = Clock::now();  // its clock stood while the socket was not read
  if (header.length > r.size_) {
    const Error e = protocol_error(options_.rank, r.peer_,
                                   fmt::format("message of {} bytes (tag {:#x}) does not fit the {}-byte receive",
                                               header.length, header.tag, r.size_));
    fail(r, e);
    // The stream cannot skip the payload without reading it somewhere: give up the peer.
    asio::post(io_, [this, peer = r.peer_, e] { fail_peer(peer, e); });
    return;
  }
  c.receiving = &r;
  asio::post(io_, [this, &c, length = header.length] { read_payload(c, length, 0); });
}

// Reads the payload of `length` bytes into the receive bound to `c`, from byte `done` on, piece by
// piece (each one counts as hearing from the peer), then the next header.
void TcpEngine::read_payload(Connection& c, std::uint64_t length, std::uint64_t done) {
  Request* target;
  {
    std::lock_guard lock(mutex_);
    target = c.receiving;
  }
  if (!target) return;  // failed meanwhile
  const std::uint64_t piece = std::min(length - done, payload_piece_bytes);
  asio::async_read(c.socket, asio::buffer(target->destination_ + done, piece),
                   [this, &c, target, length, done = done + piece](const error_code& ec, std::size_t) {
                     if (ec) return connection_broke(c.peer, ec);
                     {
                       std::lock_guard lock(mutex_);
                       if (c.receiving != target) return;  // failed and handed back meanwhile
                       peers_[static_cast<std::size_t>(c.peer)].heard = Clock::now();
                       if (done < length) {
                         asio::post(io_, [this, &c, length, done] { read_payload(c, length, done); });
                         return;
                       }
                       c.receiving = nullptr;
                       finish(*target, length);
                     }
                     read_header(c);
                   });
}

// ---- liveness, on the io thread -----------------------------------------------------------------

void TcpEngine::arm_liveness() {
  liveness_timer_->expires_after(std::max(options_.liveness / 4, std::chrono::milliseconds(1)));
  liveness_timer_->async_wait([this](const error_code& ec) {
    if (!ec && !closed_) check_liveness();
  });
}

// Every quarter of the bound: a heartbeat to each peer sent nothing for that long, and a failure
// for each peer heard nothing from for longer than the bound.
//
// A socket holding a frame that waits for its receive is not read, so what the peer sends behind
// that frame (heartbeats too) is not heard: while any of the peer's sockets is parked its clock
// stands. A heartbeat goes on the express lane, or any socket not busy writing, but never on one
// the peer has closed. (Reaching a peer that has closed its socket makes the peer's kernel reset
// the connection and drop what it had not sent yet; that is why the engine closes only once its
// own sockets have nothing left to send, see the destructor.)
void TcpEngine::check_liveness() {
  const auto now = Clock::now();
  std::vector<std::pair<int, Clock::duration>> silent;
  {
    std::lock_guard lock(mutex_);
    if (aborted_) return;
    for (std::size_t peer = 0; peer < peers_.size(); ++peer) {
      Peer& p = peers_[peer];
      if (p.connections.empty() || p.failure) continue;
      if (now - p.said >= options_.liveness / 4) {
        Connection* quiet = p.connections.back().get();  // the express lane first, else any idle socket
        if (quiet->writing || quiet->closed) quiet = nullptr;
        for (auto& c : p.connections)
          if (!quiet && !c->writing && !c->closed) quiet = c.get();
        if (quiet) {
          quiet->writing = quiet->beating = true;
          p.said = now;
          asio::post(io_, [this, quiet] { write_heartbeat(*quiet); });
        }
      }
      if (!p.spoke || std::any_of(p.connections.begin(), p.connections.end(),
                                  [](const auto& c) { return c->parked.has_value(); }))
        p.heard = now;
      else if (now - p.heard > options_.liveness)
        silent.emplace_back(static_cast<int>(peer), now - p.heard);
    }
  }
  for (const auto& [peer, quiet] : silent) {
    const std::string what = fmt::format(
        "heard nothing from rank {} for {} ms (the bound is {} ms): its process stopped, or its machine or the link "
        "to it is down",
        peer, std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count(), options_.liveness.count());
    fail_peer(peer, Error(ErrorKind::peer_failed, where(peer, "liveness"), what).with_origin({peer, what}));
  }
  arm_liveness();
}

void TcpEngine::write_heartbeat(Connection& c) {
  c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::heartbeat, 0, 0});
  asio::async_write(c.socket, asio::buffer(c.out_header), [this, &c](const error_code& ec, std::size_t) {
    c.beating = false;
    if (c.notice_after_frame) return ec ? abort_notice_done() : write_abort_notice(c);
    if (ec) return connection_broke(c.peer, ec);
    write_next(c);
  });
}

// An abort notice: the peer gave up, because of a failure that began at the rank its tag names
// (wire.hpp), which this rank's Error names first.
void TcpEngine::read_abort_reason(Connection& c, std::uint64_t tag, std::uint64_t length) {
  const int peer = c.peer;
  if (length > c.reason.size())
    return fail_peer(peer, protocol_error(options_.rank, peer, fmt::format("abort notice of {} bytes", length)));
  const int origin = tag > 0 && tag <= static_cast<std::uint64_t>(options_.world_size) ? static_cast<int>(tag - 1) : peer;
  asio::async_read(c.socket, asio::buffer(c.reason.data(), length), [this, &c, peer, origin, length](const error_code& ec, std::size_t) {
    const std::string reason = ec ? std::string("(reason lost)") : std::string(c.reason.data(), length);
    const std::string detail =
        origin == peer ? fmt::format("rank {} failed: {}", peer, reason)
                       : fmt::format("rank {} failed first ({}), and rank {} stopped because of it", origin, reason, peer);
    fail_peer(peer, Error(ErrorKind::peer_failed, where(peer, "recv"), detail).with_origin({origin, reason}));
  });
}

// ---- failures, on the io thread ---------------------------------------------------------------------

// A peer that finished closes all its sockets; what it sent before is still in the others, so
// the peer counts as gone only once every one of its connections has closed.
void TcpEngine::closed_between_frames(Connection& c) {
  {
    std::lock_guard lock(mutex_);
    c.closed = true;
    for (const auto& other : peers_[static_cast<std::size_t>(c.peer)].connections)
      if (!other->closed) return;
  }
  const std::string what = fmt::format("rank {} closed its connections (it exited or failed)", c.peer);
  fail_peer(c.peer, Error(ErrorKind::peer_failed, where(c.peer, "connection"), what).with_origin({c.peer, what}));
}

void TcpEngine::connection_broke(int peer, const error_code& ec) {
  if (ec == asio::error::operation_aborted) return;  // we closed it
  const bool closed = ec == asio::error::eof || ec == asio::error::connection_reset || ec == asio::error::broken_pipe;
  const std::string what =
      closed ? fmt::format("rank {} closed its connection in the middle of a message (it exited or failed)", peer)
             : fmt::format("connection to rank {} failed: {}", peer, ec.message());
  fail_peer(peer, Error(ErrorKind::peer_failed, where(peer, "connection"), what).with_origin({peer, what}));
}

// Every operation with `peer` fails with `e`, and its sockets close.
void TcpEngine::fail_peer(int peer, const Error& e) {
  std::lock_guard lock(mutex_);
  Peer& p = peers_[static_cast<std::size_t>(peer)];
  if (p.failure) return;
  if (!first_origin_ && e.origin()) first_origin_ = e.origin();
  fail_pending(p, e);
  close_sockets(p);
}

// From a caller's thread: fail_peer on the io thread, and back once it is done.
void TcpEngine::fail_peer_and_wait(int peer, const Error& e) {
  std::promise<void> done;
  asio::post(io_, [&] {
    fail_peer(peer, e);
    done.set_value();
  });
  done.get_future().wait();
}

// Requires the lock: fails every operation pending with `p` (posted receives, queued sends, the
// frames in flight) with `e`, lets go of their buffers, and marks the peer failed unless it was
// already: every later operation with it throws the first failure. Its sockets stay open.
void TcpEngine::fail_pending(Peer& p, const Error& e) {
  if (!p.failure) p.failure = e;
  p.receives.drain([&](Request* r) { fail(*r, e); });
  p.unsent.drain([&](Request* r) { fail(*r, e); });
  for (auto& c : p.connections) {
    c->queue.drain([&](Request* r) { fail(*r, e); });
    if (c->sending) fail(*c->sending, e);
    if (c->receiving) fail(*c->receiving, e);
    c->sending = c->receiving = nullptr;
    c->parked.reset();
  }
}

// Everything pending fails and every peer is told why, in an abort notice, before the sockets
// close. A socket in the middle of a frame cannot carry a notice until the frame ends, so that
// frame is finished first (its send has failed for the caller, but abort() has not returned, so
// its buffer is still there); cutting it off would leave that peer only a broken connection and no
// reason. All of it within abort_linger: then every socket closes, notice or not.
void TcpEngine::begin_abort() {
  connector_->close();
  std::vector<Connection*> between_frames;
  {
    std::lock_guard lock(mutex_);
    // Where the failure began: as the cause says, else where the first peer failure this rank saw
    // began (a layer above may have rewrapped the cause), else here.
    const std::optional<FailureOrigin> origin = aborted_->origin() ? aborted_->origin() : first_origin_;
    const std::string reason = (origin ? origin->cause : std::string(aborted_->what())).substr(0, tcp_wire::max_reason_bytes);
    const auto header = tcp_wire::encode(tcp_wire::FrameHeader{
        tcp_wire::FrameType::abort, static_cast<std::uint64_t>((origin ? origin->rank : options_.rank) + 1), reason.size()});
    abort_notice_.assign(header.begin(), header.end());
    for (char ch : reason) abort_notice_.push_back(static_cast<std::byte>(ch));
    for (std::size_t peer = 0; peer < peers_.size(); ++peer) {
      Peer& p = peers_[peer];
      for (auto& c : p.connections) {
        if (!c->socket.is_open()) continue;
        ++notices_due_;
        if (c->sending || c->beating)
          c->notice_after_frame = true;
        else
          between_frames.push_back(c.get());
      }
      fail_pending(p, aborted_->filled(where(static_cast<int>(peer), "abort")));
    }
    to_self_.drain([&](Request* r) { fail(*r, *aborted_); });
  }
  if (notices_due_ == 0) return finish_abort();
  abort_deadline_.emplace(io_, abort_linger);
  abort_deadline_->async_wait([this](const error_code& ec) {
    if (!ec) finish_abort();
  });
  for (Connection* c : between_frames) write_abort_notice(*c);
}

void TcpEngine::write_abort_notice(Connection& c) {
  c.notice_after_frame = false;
  asio::async_write(c.socket, asio::buffer(abort_notice_), [this, &c](const error_code& ec, std::size_t) {
    error_code ignored;
    if (!ec) c.socket.shutdown(asio::ip::tcp::socket::shutdown_send, ignored);  // the notice is the last word
    abort_notice_done();
  });
}

void TcpEngine::abort_notice_done() {
  if (notices_due_ > 0 && --notices_due_ == 0) finish_abort();
}

// Closes every socket, which ends every operation still reading or writing a caller's buffer, and
// lets abort() return. Once only: the last notice and the deadline may both call it.
void TcpEngine::finish_abort() {
  if (!abort_done_) return;
  notices_due_ = 0;
  if (abort_deadline_) abort_deadline_->cancel();
  linger_until_peers_close(Clock::now() + abort_linger);
  close_all();
  abort_done_->set_value();
  abort_done_.reset();
}

// After the notices: waits, until `until`, for each peer to close its end, reading and dropping
// what it still sends meanwhile. Closing first would make this rank's kernel answer those bytes
// with a reset, and a reset makes the peer's kernel drop what it has not read yet, the notice too;
// a rank reaches the ranks it has no connection to only through those it has, so the notice
// must arrive. A peer closes once it has read the notice (it fails, and lets go of its sockets).
void TcpEngine::linger_until_peers_close(Clock::time_point until) {
  std::array<std::byte, 64 << 10> unread;
  for (;;) {
    bool still_open = false;
    for (auto& p : peers_)
      for (auto& c : p.connections) {
        if (!c->socket.is_open()) continue;
        error_code ec;
        c->socket.non_blocking(true, ec);
        while (!ec) c->socket.read_some(asio::buffer(unread), ec);
        if (ec == asio::error::would_block || ec == asio::error::try_again)
          still_open = true;
        else
          c->socket.close(ec);  // the peer has closed (or the socket broke): nothing more will come
      }
    if (!still_open || Clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void TcpEngine::close_sockets(Peer& p) {
  for (auto& c : p.connections) {
    error_code ignored;
    c->socket.close(ignored);
  }
}

// What peers sent that nobody read is discarded first: closing a socket with unread data (a frame
// never asked for, heartbeats behind it) makes the kernel reset the connection and drop what it had
// not sent yet, an abort notice or the last message to a peer still reading.
void TcpEngine::close_all() {
  closed_ = true;
  connector_->close();
  if (liveness_timer_) liveness_timer_->cancel();
  std::array<std::byte, 64 << 10> unread;
  for (auto& p : peers_)
    for (auto& c : p.connections) {
      error_code ec;
      c->socket.non_blocking(true, ec);
      while (!ec) c->socket.read_some(asio::buffer(unread), ec);
    }
  for (auto& p : peers_) close_sockets(p);
}

}  // namespace gradsync::transport::detail
