// TcpEngine (engine.hpp), the io thread's side: serving the epoll set of data sockets, writing
// frames, liveness, failures, aborting and closing. Any failure on a socket fails every operation
// with that peer at once.

#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <thread>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "transport/tcp/engine.hpp"
#include "transport/errors.hpp"

namespace gradsync::transport::detail {

namespace asio = boost::asio;
using boost::system::error_code;

namespace {

// How long an abort may wait for frames already on the wire to end and for its notices to leave.
// Long enough for a piece of a few MiB on a slow link; a peer that does not read is not waited for
// longer than this.
constexpr auto abort_linger = std::chrono::seconds(1);

// How long the destructor waits for its sockets' unsent bytes to leave before closing them.
constexpr auto close_linger = std::chrono::seconds(2);

// Events taken from the epoll set at a time.
constexpr int events_per_turn = 64;

// Reads and drops what a socket has, without waiting: false once the stream has ended or broken.
bool drop_unread(int fd) {
  std::array<std::byte, 64 << 10> unread;
  for (;;) {
    const ssize_t got = ::recv(fd, unread.data(), unread.size(), MSG_DONTWAIT);
    if (got > 0) continue;
    if (got < 0 && errno == EINTR) continue;
    return got < 0 && would_block(errno);
  }
}

}  // namespace

// ---- the epoll set ------------------------------------------------------------------------------------

// Asio watches the set's descriptor edge-triggered, and a wait only sees edges after it starts: so
// the set is drained (a turn that found nothing) before each wait, and a turn that found something
// is followed by another, posted, so that timers and the connector get their turn between.
void TcpEngine::watch_sockets() {
  epoll_watch_.async_wait(asio::posix::stream_descriptor::wait_read, [this](const error_code& ec) {
    if (!ec) serve_sockets();
  });
}

void TcpEngine::serve_sockets() {
  if (closed_) return;
  std::array<epoll_event, events_per_turn> ready;
  const int n = ::epoll_wait(epoll_fd_, ready.data(), events_per_turn, 0);
  for (int i = 0; i < n; ++i) {
    auto& c = *static_cast<Connection*>(ready[static_cast<std::size_t>(i)].data.ptr);
    const std::uint32_t events = ready[static_cast<std::size_t>(i)].events;
    if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) socket_writable(c);
    if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) socket_readable(c);
  }
  if (n > 0 || (n < 0 && errno == EINTR))
    asio::post(io_, [this] { serve_sockets(); });
  else
    watch_sockets();
}

void TcpEngine::socket_readable(Connection& c) {
  {
    std::lock_guard lock(mutex_);
    if (c.io_reading || !io_reads(c)) return;
    c.io_reading = true;
  }
  read_frames(c, nullptr);
  std::lock_guard lock(mutex_);
  c.io_reading = false;
  watch(c);
}

// A read that met the end of the stream or an error.
void TcpEngine::read_failed(Connection& c, const error_code& ec) {
  std::optional<Error> notice;
  bool between_frames = false;
  {
    std::lock_guard lock(mutex_);
    if (c.incoming == Connection::Incoming::reason) notice = abort_notice_error(c, true);
    between_frames = ec == asio::error::eof && c.incoming == Connection::Incoming::header && c.header_got == 0;
  }
  if (notice) return notice_heard(c.peer, *notice);
  if (between_frames) return closed_between_frames(c);
  connection_broke(c.peer, ec);
}

// ---- writing ------------------------------------------------------------------------------------------

void TcpEngine::socket_writable(Connection& c) {
  {
    std::lock_guard lock(mutex_);
    if (c.fd < 0 || !c.write_blocked) return;
    c.write_blocked = false;
  }
  write_on(c);
}

void TcpEngine::write_next(Connection& c) {
  {
    std::lock_guard lock(mutex_);
    Request* r = c.queue.pop();
    c.sending = r;
    if (!r) {
      c.writing = false;
      watch(c);
      return;
    }
    peers_[static_cast<std::size_t>(c.peer)].said = Clock::now();
    c.outgoing = Connection::Outgoing::data;
    c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::data, r->tag_, r->size_});
    c.out_payload = r->source_;
    c.out_payload_bytes = r->size_;
    c.out_done = 0;
  }
  write_on(c);
}

// Writes the frame c.outgoing names from byte c.out_done on, as far as the socket takes it, the
// rest once epoll says the socket can take more; a turn's worth at a time, the next turn posted.
void TcpEngine::write_on(Connection& c) {
  const bool notice = c.outgoing == Connection::Outgoing::notice;
  const std::byte* head = notice ? abort_notice_.data() : c.out_header.data();
  const std::size_t head_bytes = notice ? abort_notice_.size() : c.out_header.size();
  const std::size_t body_bytes = c.outgoing == Connection::Outgoing::data ? c.out_payload_bytes : 0;
  for (const std::size_t turn_ends = c.out_done + io_turn_bytes; c.fd >= 0;) {
    if (c.out_done >= turn_ends) {
      asio::post(io_, [this, &c] { write_on(c); });
      return;
    }
    const std::size_t head_done = std::min(c.out_done, head_bytes), body_done = c.out_done - head_done;
    iovec parts[2] = {{const_cast<std::byte*>(head) + head_done, head_bytes - head_done},
                      {const_cast<std::byte*>(c.out_payload) + body_done, body_bytes - body_done}};
    msghdr message{};
    message.msg_iov = head_done < head_bytes ? parts : parts + 1;
    message.msg_iovlen = head_done < head_bytes && body_bytes > 0 ? 2 : 1;
    const ssize_t written = ::sendmsg(c.fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0 && would_block(errno)) {
      std::lock_guard lock(mutex_);
      c.write_blocked = true;
      watch(c);
      return;
    }
    if (written < 0) return write_failed(c, error_code(errno, boost::system::system_category()));
    c.out_done += static_cast<std::size_t>(written);
    if (c.out_done == head_bytes + body_bytes) return frame_written(c);
  }
}

void TcpEngine::frame_written(Connection& c) {
  const auto frame = c.outgoing;
  c.outgoing = Connection::Outgoing::none;
  if (frame == Connection::Outgoing::notice) {
    ::shutdown(c.fd, SHUT_WR);  // the notice is the last word
    return abort_notice_done();
  }
  bool failed_meanwhile = false;
  if (frame == Connection::Outgoing::data) {
    std::lock_guard lock(mutex_);
    if (Request* r = c.sending) {
      c.sending = nullptr;
      count(c.express ? traffic_.express_sent : traffic_.data_sent, r->size_);
      finish(*r, r->size_);
    } else {
      failed_meanwhile = true;  // its send failed meanwhile, and with it the peer
    }
  }
  if (c.notice_after_frame) return write_abort_notice(c);
  if (!failed_meanwhile) write_next(c);
}

void TcpEngine::write_failed(Connection& c, const error_code& ec) {
  const bool notice = c.outgoing == Connection::Outgoing::notice || c.notice_after_frame;
  c.outgoing = Connection::Outgoing::none;
  if (notice) return abort_notice_done();
  connection_broke(c.peer, ec);
}

void TcpEngine::write_abort_notice(Connection& c) {
  c.notice_after_frame = false;
  c.outgoing = Connection::Outgoing::notice;
  c.out_done = 0;
  write_on(c);
}

// ---- liveness -----------------------------------------------------------------------------------------

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
        const auto idle = [](const Connection& c) { return !c.writing && !c.closed && c.fd >= 0; };
        Connection* quiet = idle(*p.connections.back()) ? p.connections.back().get() : nullptr;  // the express lane first
        for (auto& c : p.connections)
          if (!quiet && idle(*c)) quiet = c.get();
        if (quiet) {
          quiet->writing = true;
          quiet->outgoing = Connection::Outgoing::heartbeat;
          quiet->out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::heartbeat, 0, 0});
          quiet->out_done = 0;
          p.said = now;
          asio::post(io_, [this, quiet] { write_on(*quiet); });
        }
      }
      // Bytes waiting in a socket were heard, if not yet read (the io thread may have been busy).
      const auto unread = [](const Connection& c) {
        int bytes = 0;
        return c.fd >= 0 && ::ioctl(c.fd, FIONREAD, &bytes) == 0 && bytes > 0;
      };
      if (!p.spoke || std::any_of(p.connections.begin(), p.connections.end(),
                                  [](const auto& c) { return c->parked.has_value(); }))
        p.heard = now;
      else if (now - p.heard > options_.liveness &&
               std::any_of(p.connections.begin(), p.connections.end(), [&](const auto& c) { return unread(*c); }))
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

// ---- failures -----------------------------------------------------------------------------------------

// A peer that finished closes all its sockets; what it sent before is still in the others, so
// the peer counts as gone only once every one of its connections has closed.
void TcpEngine::closed_between_frames(Connection& c) {
  {
    std::lock_guard lock(mutex_);
    c.closed = true;
    watch(c);
    for (const auto& other : peers_[static_cast<std::size_t>(c.peer)].connections)
      if (!other->closed) return;
  }
  const std::string what = fmt::format("rank {} closed its connections (it exited or failed)", c.peer);
  fail_peer(c.peer, Error(ErrorKind::peer_failed, where(c.peer, "connection"), what).with_origin({c.peer, what}));
}

void TcpEngine::connection_broke(int peer, const error_code& ec) {
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

// An abort notice from `peer`: it has given up, and with it the job. A peer this rank waits for
// but has no connection to yet (connections come as the algorithms first need them) could never
// say so itself, nor could anyone else but through a notice like this one: its operations fail now
// too, rather than at their deadline. Then this rank gives up as well and passes the notice on to
// every peer it is connected to, as abort() would: it may have nothing pending with `peer` while
// another rank waits, through it, for one that never connected to anyone (a 3-rank ring whose
// rank 1 fails before its first send: rank 0 waits on rank 2, rank 2 on rank 1), and the job is
// over either way. The layer above meets the failure in its pending operations; its own abort()
// then finds this one under way.
void TcpEngine::notice_heard(int peer, const Error& e) {
  fail_peer(peer, e);
  {
    std::lock_guard lock(mutex_);
    for (std::size_t other = 0; other < peers_.size(); ++other) {
      Peer& p = peers_[other];
      if (!p.connections.empty() || p.failure || (p.receives.empty() && p.unsent.empty())) continue;
      const int waited_for = static_cast<int>(other);
      fail_pending(p, Error(ErrorKind::peer_failed, where(waited_for, "connection"),
                            fmt::format("{} (while this rank waited for rank {} to connect)", e.detail(), waited_for))
                          .with_origin(*e.origin()));
    }
    if (aborted_) return;
    aborted_ = e;
    abort_done_ = std::make_shared<std::promise<void>>();
    aborted_closed_ = abort_done_->get_future().share();
  }
  begin_abort();
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
// already: every later operation with it throws the first failure. Its sockets stay open, but are
// no longer read.
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
    watch(*c);
  }
}

// Everything pending fails and every peer is told why, in an abort notice, before the sockets
// close. A socket in the middle of a frame cannot carry a notice until the frame ends, so that
// frame is finished first (its send has failed for the caller, but abort() has not returned, so
// its buffer is still there); cutting it off would leave that peer only a broken connection and no
// reason. A connection whose handshake is under way ends it first: the peer may already count the
// pair as made, and so is owed a notice too (attach). All of it within abort_linger: then every
// socket closes, notice or not.
void TcpEngine::begin_abort() {
  connector_->stop_connecting([this] {
    connections_settled_ = true;
    if (notices_due_ == 0) finish_abort();
  });
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
        if (c->fd < 0 || c->close_when_released) continue;
        ++notices_due_;
        if (c->outgoing != Connection::Outgoing::none) {
          c->notice_after_frame = true;
        } else {
          c->writing = true;  // nothing else goes on it now
          between_frames.push_back(c.get());
        }
      }
      fail_pending(p, aborted_->filled(where(static_cast<int>(peer), "abort")));
    }
    to_self_.drain([&](Request* r) { fail(*r, *aborted_); });
  }
  abort_deadline_.emplace(io_, abort_linger);
  abort_deadline_->async_wait([this](const error_code& ec) {
    if (!ec) finish_abort();
  });
  for (Connection* c : between_frames) write_abort_notice(*c);
}

void TcpEngine::abort_notice_done() {
  if (notices_due_ > 0 && --notices_due_ == 0 && connections_settled_) finish_abort();
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
// A socket a caller still holds is waited for: its caller lets go soon, its receive having failed.
void TcpEngine::linger_until_peers_close(Clock::time_point until) {
  for (;;) {
    bool still_open = false;
    {
      std::lock_guard lock(mutex_);
      for (auto& p : peers_)
        for (auto& c : p.connections) {
          if (c->fd < 0) continue;
          if (c->reader == Connection::Reader::caller || drop_unread(c->fd))
            still_open = true;
          else
            close_connection(*c);  // the peer has closed (or the socket broke): nothing more will come
        }
    }
    if (!still_open || Clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Requires the lock. A socket a caller reads is only shut down, which wakes the caller, and closed
// once it lets go (release): closing it under the caller's poll could hand its descriptor to a
// socket opened meanwhile. What the peer sent that nobody read is discarded first: closing a socket
// with unread data (a frame never asked for, heartbeats behind it) makes the kernel reset the
// connection and drop what it had not sent yet, an abort notice or the last message to a peer
// still reading.
void TcpEngine::close_connection(Connection& c) {
  if (c.fd < 0) return;
  if (c.reader == Connection::Reader::caller) {
    ::shutdown(c.fd, SHUT_RDWR);
    c.close_when_released = true;
    watch(c);
    return;
  }
  drop_unread(c.fd);
  ::close(c.fd);  // which takes it out of the epoll set
  c.fd = -1;
  c.watched = 0;
}

void TcpEngine::close_sockets(Peer& p) {
  for (auto& c : p.connections) close_connection(*c);
}

void TcpEngine::close_all() {
  connector_->close();
  if (liveness_timer_) liveness_timer_->cancel();
  std::lock_guard lock(mutex_);
  closed_ = true;
  for (auto& p : peers_) close_sockets(p);
  error_code ignored;
  epoll_watch_.close(ignored);  // the set's descriptor; its wait ends, and with it the io thread's last work
  epoll_fd_ = -1;
}

// The destructor's: closes once what this rank sent has left its sockets (or after close_linger):
// a peer still reading may send a heartbeat meanwhile, and a socket closed with data unsent would
// answer it with a reset that drops that data.
void TcpEngine::close_once_sent() {
  const auto give_up = Clock::now() + close_linger;
  while (Clock::now() < give_up && !all_sent()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  close_all();
}

// Whether the kernel has nothing left to send on the sockets of peers still in good standing.
bool TcpEngine::all_sent() {
  std::lock_guard lock(mutex_);
  for (const auto& p : peers_) {
    if (p.failure) continue;
    for (const auto& c : p.connections) {
      int unsent = 0;
      if (c->fd >= 0 && ::ioctl(c->fd, SIOCOUTQ, &unsent) == 0 && unsent > 0) return false;
    }
  }
  return true;
}

}  // namespace gradsync::transport::detail
