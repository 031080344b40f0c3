// TcpEngine (engine.hpp), the callers' side: posting, waiting and aborting, completing requests,
// small sends written from the caller's thread, and the short path, where a caller waiting for a
// receive reads its peer's sockets itself. A payload is read straight into the receive it matches;
// a frame nobody has asked for yet parks, and its socket is not read further until a matching
// receive is posted, so nothing is buffered on a frame's say-so. The io thread's side (the epoll
// set, writing, liveness, failures) is in io_thread.cpp.

#include "transport/tcp/engine.hpp"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <limits>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "transport/errors.hpp"

namespace gradsync::transport::detail {

namespace asio = boost::asio;

namespace {

// A send of at most this many bytes to an idle socket is written from the caller's thread
// (TcpEngine::send_now); larger ones would copy that much into the kernel on a thread that has
// other work to post.
constexpr std::size_t send_now_bytes = std::size_t{64} << 10;

// The most sockets a pair has: 64 data sockets and the express lane (connector.cpp's limits).
constexpr std::size_t most_connections = 65;

// A caller on the short path looks at its receive at least this often, whatever wakes it.
constexpr int reader_poll_limit_ms = 1000;

// Each thread that takes the short path polls an eventfd of its own beside its sockets, made once.
int reader_wake_fd() {
  struct WakeFd {
    int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ~WakeFd() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local WakeFd wake;
  return wake.fd;
}

// The eventfd of the short path this thread is on, -1 when none: a thread completing the receive
// it waits for itself has no need to wake itself.
thread_local int reading_wake_fd = -1;

}  // namespace

Connection::~Connection() {
  if (fd >= 0) ::close(fd);
}

TcpEngine::TcpEngine(const TcpOptions& options)
    : options_(options),
      connector_(std::make_unique<Connector>(io_, options_)),
      epoll_fd_(::epoll_create1(EPOLL_CLOEXEC)),
      epoll_watch_(io_),
      peers_(static_cast<std::size_t>(options.world_size)) {
  if (epoll_fd_ < 0)
    throw Error(ErrorKind::internal, where(-1, "setup"), fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
  epoll_watch_.assign(epoll_fd_);
  for (PeerSockets& set : connector_->rendezvous()) attach(std::move(set));
  connector_->serve([this](PeerSockets set) { attach(std::move(set)); },
                    [this](int peer, const Error& e) { fail_peer(peer, e); });
  work_.emplace(asio::make_work_guard(io_));
  io_.restart();
  if (options_.liveness.count() > 0) {
    liveness_timer_.emplace(io_);
    arm_liveness();
  }
  // Sockets attached during the rendezvous may hold frames already: looked at first, then watched.
  asio::post(io_, [this] { serve_sockets(); });
  io_thread_ = std::thread([this] { io_.run(); });
}

TcpEngine::~TcpEngine() {
  work_.reset();
  asio::post(io_, [this] { close_once_sent(); });
  io_thread_.join();
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
  if (r.state_ == Request::State::pending && !r.is_send_ && r.peer_ != options_.rank) read_as_caller(r, deadline, lock);
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

bool TcpEngine::read_until(Request& r, Clock::time_point until, int interrupt_fd) {
  std::unique_lock lock(mutex_);
  if (r.state_ == Request::State::idle)
    throw Error(ErrorKind::invalid_argument, where(r.peer_, "recv"), "request was never posted");
  if (r.state_ == Request::State::pending && !r.is_send_ && r.peer_ != options_.rank)
    read_as_caller(r, until, lock, interrupt_fd);
  return r.state_ != Request::State::pending;
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
  wake_reader(r);
  r.report();
}

void TcpEngine::fail(Request& r, const Error& e) {
  r.error_ = e;
  r.state_ = Request::State::failed;
  wake_reader(r);
  r.report();
}

// Callers wait on cv_, or, on the short path, poll their eventfd.
void TcpEngine::wake_reader(const Request& r) {
  cv_.notify_all();
  for (const auto& [awaited, wake_fd] : readers_)
    if (awaited == &r && wake_fd != reading_wake_fd) {
      const std::uint64_t one = 1;
      [[maybe_unused]] const auto written = ::write(wake_fd, &one, sizeof one);  // a full counter wakes as well
    }
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

// ---- sends, under the lock --------------------------------------------------------------------------

// Requires a connected peer.
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

// On the caller's thread, with the socket idle (nothing queued or being written): the frame goes
// out in one non-blocking sendmsg, so a small message leaves without waking the io thread, and its
// send completes here; on a loaded machine each such hand-off costs a wake-up per hop (design.md,
// "TCP"). Whatever the socket does not take at once, the io thread writes once the socket can take
// more. False where the socket refused with an error: the io thread's write meets it and fails the
// peer as usual.
bool TcpEngine::send_now(Connection& c, Request& r) {
  if (c.fd < 0) return false;
  c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::data, r.tag_, r.size_});
  iovec parts[2] = {{c.out_header.data(), c.out_header.size()}, {const_cast<std::byte*>(r.source_), r.size_}};
  msghdr message{};
  message.msg_iov = parts;
  message.msg_iovlen = r.size_ > 0 ? 2 : 1;
  ssize_t written = ::sendmsg(c.fd, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (written < 0) {
    if (!would_block(errno) && errno != EINTR) return false;
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
  c.outgoing = Connection::Outgoing::data;
  c.out_payload = r.source_;
  c.out_payload_bytes = r.size_;
  c.out_done = static_cast<std::size_t>(written);
  c.write_blocked = true;
  watch(c);
  return true;
}

// On the io thread (or the constructing thread, before it exists). A pair connected after this
// rank gave up on the peer is closed at once. One connected while this rank aborts is kept for the
// abort notice: the peer has taken the connection as made and, closed without a word, would
// conclude that this rank exited and tell the others so, in place of the real reason.
void TcpEngine::attach(PeerSockets set) {
  std::vector<Connection*> owed_notice;
  {
    std::lock_guard lock(mutex_);
    Peer& p = peers_[static_cast<std::size_t>(set.peer)];
    p.dialing = false;
    const bool aborting = aborted_ && !closed_;
    if (closed_ || (p.failure && !aborting)) return;  // the sockets close as `set` goes
    const auto data_sockets = static_cast<std::size_t>(options_.connections_per_peer);
    const std::size_t first_new = p.connections.size();
    for (auto& s : set.sockets) {
      const bool express = p.connections.size() == data_sockets;  // the one after the data sockets
      p.connections.push_back(std::make_unique<Connection>(s.release(), set.peer, express));
    }
    p.heard = p.said = Clock::now();
    // begin_abort() has built the notice and counted the sockets it owes one: these are owed too.
    // Before it runs, it finds them with the others.
    const bool notice_built = !abort_notice_.empty();
    for (std::size_t i = first_new; i < p.connections.size(); ++i) {
      Connection& c = *p.connections[i];
      watch(c);
      if (notice_built) {
        ++notices_due_;
        c.writing = true;  // nothing else goes on it now
        owed_notice.push_back(&c);
      }
    }
    if (!aborted_)
      while (Request* r = p.unsent.pop()) queue_send(p, *r);
  }
  for (Connection* c : owed_notice) write_abort_notice(*c);
}

// ---- the epoll set, under the lock ------------------------------------------------------------------

bool TcpEngine::io_reads(const Connection& c) const {
  if (c.fd < 0 || c.reader != Connection::Reader::io || c.closed || c.close_when_released ||
      peers_[static_cast<std::size_t>(c.peer)].failure)
    return false;
  switch (c.incoming) {
    case Connection::Incoming::header: return !c.parked;
    case Connection::Incoming::payload: return c.receiving != nullptr;
    case Connection::Incoming::reason: return true;
  }
  return false;
}

// The set is level-triggered: a socket left with bytes in it is reported again.
void TcpEngine::watch(Connection& c) {
  std::uint32_t wanted = 0;
  if (c.fd >= 0 && epoll_fd_ >= 0 && !c.close_when_released) {
    if (io_reads(c)) wanted |= EPOLLIN;
    if (c.write_blocked) wanted |= EPOLLOUT;
  }
  if (wanted == c.watched) return;
  if (c.fd >= 0 && epoll_fd_ >= 0) {
    epoll_event event{};
    event.events = wanted;
    event.data.ptr = &c;
    const int op = wanted == 0 ? EPOLL_CTL_DEL : c.watched == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD;
    if (::epoll_ctl(epoll_fd_, op, c.fd, &event) != 0) {
      const Error e(ErrorKind::internal, where(c.peer, "connection"),
                    fmt::format("cannot watch the socket to rank {}: {}", c.peer, std::strerror(errno)));
      asio::post(io_, [this, peer = c.peer, e] { fail_peer(peer, e); });
      return;
    }
  }
  c.watched = wanted;
}

// ---- reading a socket: the io thread, or a caller on the short path ----------------------------------

// Each receive otherwise hands a frame from the io thread to the caller: the kernel wakes the io
// thread, which wakes the caller, and on a loaded machine each wake-up waits for a core. Here a
// caller waiting for a receive from a peer takes the peer's sockets that only wait for bytes (the io
// thread between frames, none parked; or the caller's own payload, bound and not being read) out of
// the epoll set, reads what is there, polls them if its frame has not come, and reads its frame
// straight into its receive; heartbeats it hears, another receive's frame it binds or parks and
// hands back with the socket. It lets go once its receive has settled (the sockets go back into the
// set, which reports any bytes already waiting, so the io thread wakes only for those) or at the
// deadline. While a caller holds a socket nothing else reads or closes it: the io thread shuts it
// down to wake the caller and closes it when the caller lets go.
void TcpEngine::read_as_caller(Request& r, Clock::time_point deadline, std::unique_lock<std::mutex>& lock,
                               int interrupt_fd) {
  Peer& p = peers_[static_cast<std::size_t>(r.peer_)];
  // An interruptible reader is woken through its interrupt, for its own receive too.
  const int wake_fd = interrupt_fd >= 0 ? interrupt_fd : reader_wake_fd();
  if (p.failure || aborted_ || closed_ || wake_fd < 0) return;
  std::array<Connection*, most_connections> held{};
  std::size_t holding = 0;
  for (auto& c : p.connections)
    if (holding < held.size() && takes(*c, r)) {
      c->reader = Connection::Reader::caller;
      watch(*c);
      held[holding++] = c.get();
    }
  if (holding == 0) return;
  readers_.emplace_back(&r, wake_fd);
  reading_wake_fd = wake_fd;
  std::array<pollfd, most_connections + 1> polled{};
  bool interrupted = false;
  for (bool first = true; holding > 0 && r.state_ == Request::State::pending && !interrupted; first = false) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    lock.unlock();
    if (!first) {  // the first turn reads what is there already
      for (std::size_t i = 0; i < holding; ++i) polled[i] = {held[i]->fd, POLLIN, 0};
      polled[holding] = {wake_fd, POLLIN, 0};
      ::poll(polled.data(), holding + 1, static_cast<int>(std::min<decltype(left)>(left, reader_poll_limit_ms)));
      std::uint64_t wakes = 0;
      interrupted = ::read(wake_fd, &wakes, sizeof wakes) > 0 && interrupt_fd >= 0;
    }
    std::size_t kept = 0;
    for (std::size_t i = 0; i < holding; ++i)
      if ((!first && polled[i].revents == 0) || read_frames(*held[i], &r) != ReadEnd::released) held[kept++] = held[i];
    holding = kept;
    lock.lock();
  }
  reading_wake_fd = -1;
  std::erase_if(readers_, [&](const auto& reader) { return reader.first == &r; });
  for (std::size_t i = 0; i < holding; ++i) release(*held[i]);
}

// Requires the lock.
bool TcpEngine::takes(const Connection& c, const Request& r) const {
  if (c.fd < 0 || c.reader != Connection::Reader::io || c.io_reading || c.closed || c.close_when_released) return false;
  switch (c.incoming) {
    case Connection::Incoming::header: return !c.parked && c.header_got < c.in_header.size();
    case Connection::Incoming::payload: return c.receiving == &r;
    case Connection::Incoming::reason: return false;
  }
  return false;
}

// Requires the lock: the io thread reads `c` again, from where the caller stopped.
void TcpEngine::release(Connection& c) {
  c.reader = Connection::Reader::io;
  if (c.close_when_released) {
    asio::post(io_, [this, &c] {
      std::lock_guard lock(mutex_);
      close_connection(c);
    });
    return;
  }
  watch(c);
}

// Reads what `c` has, frame by frame, into the header, the payload's receive or the abort reason,
// until the socket has nothing more (drained), reading must stop (stopped: a frame parked, a
// receive failed, the io thread's turn used up, the caller's receive settled) or a caller hands the
// socket back (released: what comes next is not the caller's to read). `own` null: the io thread;
// else the caller waiting for `own`, which reads only headers, heartbeats and its own payload.
TcpEngine::ReadEnd TcpEngine::read_frames(Connection& c, Request* const own) {
  std::uint64_t turn = io_turn_bytes;
  for (;;) {
    std::byte* into = nullptr;
    std::size_t wanted = 0;
    Request* target = nullptr;
    std::optional<Error> failure;
    bool notice = false;  // the failure is an abort notice's
    {
      std::lock_guard lock(mutex_);
      if (c.fd < 0) return ReadEnd::stopped;
      if (own && (own->state_ != Request::State::pending || c.close_when_released)) return ReadEnd::stopped;
      const auto hand_back = [&](bool io_must_look) {
        release(c);
        if (io_must_look) asio::post(io_, [this, &c] { socket_readable(c); });
        return ReadEnd::released;
      };
      switch (c.incoming) {
        case Connection::Incoming::header:
          if (c.parked) return own ? hand_back(false) : ReadEnd::stopped;
          if (c.header_got == c.in_header.size()) {
            switch (take_header(c, own, failure)) {
              case HeaderEnd::read_on: continue;
              case HeaderEnd::hand_to_io: return hand_back(c.header_got == c.in_header.size());
              case HeaderEnd::failed: break;
            }
            break;
          }
          into = c.in_header.data() + c.header_got;
          wanted = c.in_header.size() - c.header_got;
          break;
        case Connection::Incoming::payload:
          target = c.receiving;
          if (!target) return own ? hand_back(false) : ReadEnd::stopped;
          if (own && target != own) return hand_back(false);
          into = target->destination_ + c.payload_done;
          wanted = static_cast<std::size_t>(std::min(c.payload_bytes - c.payload_done, own ? c.payload_bytes : turn));
          break;
        case Connection::Incoming::reason:
          if (own) return hand_back(true);
          if (c.reason_got == c.reason_bytes) {
            failure = abort_notice_error(c, false);
            notice = true;
            break;
          }
          into = reinterpret_cast<std::byte*>(c.reason.data()) + c.reason_got;
          wanted = c.reason_bytes - c.reason_got;
          break;
      }
    }
    if (failure) {  // the io thread's only: a caller hands such headers back unread
      notice ? notice_heard(c.peer, *failure) : fail_peer(c.peer, *failure);
      return ReadEnd::stopped;
    }
    const ssize_t got = ::recv(c.fd, into, wanted, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && would_block(errno)) return ReadEnd::drained;
    if (got <= 0) {
      if (own) {  // the io thread meets the end of the stream, or the error, itself
        std::lock_guard lock(mutex_);
        release(c);
        return ReadEnd::released;
      }
      read_failed(c, got == 0 ? boost::system::error_code(asio::error::eof)
                              : boost::system::error_code(errno, boost::system::system_category()));
      return ReadEnd::stopped;
    }
    const auto bytes = static_cast<std::size_t>(got);
    std::lock_guard lock(mutex_);
    switch (c.incoming) {
      case Connection::Incoming::header: c.header_got += bytes; break;
      case Connection::Incoming::reason: c.reason_got += bytes; break;
      case Connection::Incoming::payload: {
        if (c.receiving != target) return ReadEnd::stopped;  // failed meanwhile
        Peer& p = peers_[static_cast<std::size_t>(c.peer)];
        p.heard = Clock::now();
        c.payload_done += bytes;
        if (c.payload_done == c.payload_bytes) {
          c.receiving = nullptr;
          c.incoming = Connection::Incoming::header;
          finish(*target, c.payload_bytes);
          if (own) return ReadEnd::stopped;
        }
        if (!own && (turn -= bytes) == 0) return ReadEnd::stopped;  // reported again: the set is level-triggered
        break;
      }
    }
  }
}

// Requires the lock, with a whole header in c.in_header. A caller reads on only through heartbeats
// and into its own payload: any other frame it binds or parks and hands back, anything else (an
// abort notice, a broken header) it hands back unread.
TcpEngine::HeaderEnd TcpEngine::take_header(Connection& c, Request* own, std::optional<Error>& failure) {
  const int peer = c.peer;
  std::string why;
  const auto header = tcp_wire::decode_header(c.in_header, why);
  const bool heartbeat = header && header->type == tcp_wire::FrameType::heartbeat && header->length == 0;
  const bool data = header && header->type == tcp_wire::FrameType::data && header->length <= options_.max_message_bytes;
  if (own && !heartbeat && !data) return HeaderEnd::hand_to_io;
  c.header_got = 0;
  if (!header) {
    failure = protocol_error(options_.rank, peer, why);
    return HeaderEnd::failed;
  }
  if (header->type == tcp_wire::FrameType::abort) {
    if (header->length > c.reason.size()) {
      failure = protocol_error(options_.rank, peer, fmt::format("abort notice of {} bytes", header->length));
      return HeaderEnd::failed;
    }
    c.incoming = Connection::Incoming::reason;
    c.reason_bytes = static_cast<std::size_t>(header->length);
    c.reason_got = 0;
    c.reason_origin = header->tag > 0 && header->tag <= static_cast<std::uint64_t>(options_.world_size)
                          ? static_cast<int>(header->tag - 1)
                          : peer;
    return HeaderEnd::read_on;
  }
  if (!heartbeat && !data) {
    failure = protocol_error(
        options_.rank, peer,
        header->type != tcp_wire::FrameType::data
            ? fmt::format("unexpected frame type {} after setup", int(header->type))
            : fmt::format("frame of {} bytes exceeds the {}-byte limit", header->length, options_.max_message_bytes));
    return HeaderEnd::failed;
  }
  Peer& p = peers_[static_cast<std::size_t>(peer)];
  if (p.failure) {
    failure = *p.failure;
    return HeaderEnd::failed;
  }
  p.heard = Clock::now();
  p.spoke = true;
  if (heartbeat) return HeaderEnd::read_on;
  count(c.express ? traffic_.express_received : traffic_.data_received, header->length);
  c.parked = header;
  if (Request* r = p.receives.take_if([&](const Request* q) { return q->tag_ == header->tag; })) start_payload(c, *r);
  // Otherwise the frame waits, and so does this socket, until a matching recv() arrives.
  if (own && (c.incoming == Connection::Incoming::header ? c.parked.has_value() : c.receiving != own))
    return HeaderEnd::hand_to_io;
  return HeaderEnd::read_on;
}

// Requires the lock: binds the parked frame on `c` to receive `r`; its payload is read by whoever
// reads the socket.
void TcpEngine::start_payload(Connection& c, Request& r) {
  const tcp_wire::FrameHeader header = *c.parked;
  c.parked.reset();
  peers_[static_cast<std::size_t>(c.peer)].heard = Clock::now();  // its clock stood while the socket was not read
  c.incoming = Connection::Incoming::payload;
  if (header.length > r.size_) {
    const Error e = protocol_error(options_.rank, r.peer_,
                                   fmt::format("message of {} bytes (tag {:#x}) does not fit the {}-byte receive",
                                               header.length, header.tag, r.size_));
    fail(r, e);
    // The stream cannot skip the payload without reading it somewhere: give up the peer. Until
    // then nothing reads the socket (a payload with no receive).
    c.receiving = nullptr;
    watch(c);
    asio::post(io_, [this, peer = r.peer_, e] { fail_peer(peer, e); });
    return;
  }
  c.receiving = &r;
  c.payload_bytes = header.length;
  c.payload_done = 0;
  if (header.length == 0) {
    c.receiving = nullptr;
    c.incoming = Connection::Incoming::header;
    finish(r, 0);
  }
  watch(c);
}

// Requires the lock: the failure an abort notice read on `c` stands for.
Error TcpEngine::abort_notice_error(const Connection& c, bool reason_lost) const {
  const int peer = c.peer, origin = c.reason_origin;
  const std::string reason = reason_lost ? std::string("(reason lost)") : std::string(c.reason.data(), c.reason_got);
  const std::string detail =
      origin == peer ? fmt::format("rank {} failed: {}", peer, reason)
                     : fmt::format("rank {} failed first ({}), and rank {} stopped because of it", origin, reason, peer);
  return Error(ErrorKind::peer_failed, where(peer, "recv"), detail).with_origin({origin, reason});
}

}  // namespace gradsync::transport::detail
