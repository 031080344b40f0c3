#include "gradsync/transport/tcp.hpp"

#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio.hpp>
#include <netinet/tcp.h>
#include <fmt/format.h>

#include "detail/hmac.hpp"
#include "detail/intrusive_queue.hpp"
#include "gradsync/launch/environment.hpp"
#include "transport/matcher.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

namespace detail {

using Request = Tcp::Request;
using gradsync::detail::IntrusiveQueue;

// One socket to one peer. The io thread owns the socket and the buffers; the queue, the flags and
// the parked header are shared with callers and guarded by the engine's lock.
struct Connection {
  Connection(tcp::socket s, int p, bool lane) : socket(std::move(s)), peer(p), express(lane) {}

  tcp::socket socket;
  const int peer;
  const bool express;  // the express lane: carries the small messages
  IntrusiveQueue<Request> queue;  // sends waiting for this socket
  bool writing = false;
  Request* sending = nullptr;
  std::array<std::byte, tcp_wire::header_bytes> out_header{};

  std::array<std::byte, tcp_wire::header_bytes> in_header{};
  std::optional<tcp_wire::FrameHeader> parked;  // a data frame nobody has asked for yet
  Request* receiving = nullptr;
  bool closed = false;  // the peer closed it cleanly, between frames
  std::array<char, tcp_wire::max_reason_bytes> reason{};
};

struct Peer {
  std::vector<std::unique_ptr<Connection>> connections;
  IntrusiveQueue<Request> receives;  // posted, not yet matched to a frame
  std::size_t next_connection = 0;
  std::optional<Error> failure;  // set once: every later operation with this peer throws it
};

class TcpEngine {
 public:
  explicit TcpEngine(const TcpOptions& options) : options_(options), peers_(static_cast<std::size_t>(options.world_size)) {
    check_options();
    for (auto& p : peers_) p.connections.resize(sockets_per_peer());
    connect_job(Clock::now() + options_.setup_timeout);
    for (auto& p : peers_)
      for (auto& c : p.connections) {
        if (!c) continue;
        c->socket.set_option(tcp::no_delay(true));
        set_congestion_control(*c);
        read_header(*c);
      }
    work_.emplace(asio::make_work_guard(io_));
    io_.restart();
    io_thread_ = std::thread([this] { io_.run(); });
  }

  ~TcpEngine() {
    work_.reset();
    asio::post(io_, [this] { close_all(); });
    io_thread_.join();
  }

  int rank() const noexcept { return options_.rank; }
  int size() const noexcept { return options_.world_size; }

  TcpTraffic traffic() {
    std::lock_guard lock(mutex_);
    return traffic_;
  }

  std::string describe() const {
    return options_.express_lane_bytes == 0
               ? fmt::format("tcp(connections={})", options_.connections_per_peer)
               : fmt::format("tcp(connections={}, express lane up to {} bytes)", options_.connections_per_peer,
                             options_.express_lane_bytes);
  }

  void post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source, std::byte* destination,
            std::size_t size) {
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
    if (is_send) {
      const auto data_sockets = static_cast<std::size_t>(options_.connections_per_peer);
      const bool express = options_.express_lane_bytes > 0 && size <= options_.express_lane_bytes;
      Connection& c = express ? *p.connections.back() : *p.connections[p.next_connection++ % data_sockets];
      c.queue.push(&r);
      if (!c.writing) {
        c.writing = true;
        asio::post(io_, [this, &c] { write_next(c); });
      }
      return;
    }
    for (auto& c : p.connections)
      if (c->parked && c->parked->tag == tag) return start_payload(*c, r);
    p.receives.push(&r);
  }

  bool test(Request& r) {
    std::lock_guard lock(mutex_);
    return settled(r);
  }

  std::size_t wait(Request& r, Clock::time_point deadline) {
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
    const bool withdrawn = r.peer_ == options_.rank
                               ? to_self_.withdraw(r)
                               : !r.is_send_ && peers_[static_cast<std::size_t>(r.peer_)].receives.remove(&r);
    if (withdrawn) {
      r.state_ = Request::State::idle;
      throw timeout;
    }
    lock.unlock();
    fail_peer_and_wait(r.peer_, timeout);
    throw timeout;
  }

  void abort(const Error& cause) {
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
          send_abort_notices();
          done->set_value();
        });
      }
      closed = aborted_closed_;
    }
    closed.wait();
  }

 private:
  ErrorContext where(int peer, std::string operation) const {
    return {.rank = options_.rank, .peer = peer >= 0 ? std::optional<int>(peer) : std::nullopt, .operation = std::move(operation)};
  }

  static void count(TcpTraffic::Count& c, std::uint64_t bytes) {
    ++c.messages;
    c.bytes += bytes;
  }

  // The data sockets, then the express lane's if there is one.
  std::size_t sockets_per_peer() const {
    return static_cast<std::size_t>(options_.connections_per_peer) + (options_.express_lane_bytes > 0 ? 1 : 0);
  }

  void check_options() const {
    const auto bad = [&](std::string why) { return Error(ErrorKind::invalid_argument, where(-1, "tcp setup"), std::move(why)); };
    if (options_.world_size < 1) throw bad(fmt::format("world size {} is not positive", options_.world_size));
    if (options_.rank < 0 || options_.rank >= options_.world_size)
      throw bad(fmt::format("rank {} is outside a world of {}", options_.rank, options_.world_size));
    if (options_.connections_per_peer < 1 || options_.connections_per_peer > 64)
      throw bad(fmt::format("{} connections per peer; use 1 to 64", options_.connections_per_peer));
    if (options_.token.empty()) throw bad("the job token is empty");
  }

  void set_congestion_control(Connection& c) const {
    const std::string& name = options_.congestion_control;
    if (name.empty()) return;
    if (::setsockopt(c.socket.native_handle(), IPPROTO_TCP, TCP_CONGESTION, name.data(),
                     static_cast<socklen_t>(name.size())) != 0)
      throw Error(ErrorKind::invalid_argument, where(c.peer, "tcp setup"),
                  fmt::format("TCP congestion control {:?} is not available here (see "
                              "/proc/sys/net/ipv4/tcp_available_congestion_control): {}",
                              name, std::strerror(errno)));
  }

  // Requires the lock. Throws the request's error if it failed.
  bool settled(Request& r) {
    switch (r.state_) {
      case Request::State::done: return true;
      case Request::State::failed: throw *r.error_;
      case Request::State::pending: return false;
      case Request::State::idle: break;
    }
    throw Error(ErrorKind::invalid_argument, where(r.peer_, "test"), "request was never posted");
  }

  // Requires the lock.
  void finish(Request& r, std::size_t bytes) {
    r.transferred_ = bytes;
    r.state_ = Request::State::done;
    cv_.notify_all();
    r.report();
  }

  // Requires the lock.
  void fail(Request& r, const Error& e) {
    r.error_ = e;
    r.state_ = Request::State::failed;
    cv_.notify_all();
    r.report();
  }

  // A message to ourselves is matched and copied here, under the lock, as the in-process
  // transport would.
  void post_to_self(Request& r) {
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

  // ---- the data path, on the io thread ------------------------------------------------------

  void write_next(Connection& c) {
    Request* r;
    {
      std::lock_guard lock(mutex_);
      r = c.queue.pop();
      c.sending = r;
      if (!r) {
        c.writing = false;
        return;
      }
    }
    c.out_header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::data, r->tag_, r->size_});
    const std::array<asio::const_buffer, 2> buffers{asio::buffer(c.out_header), asio::buffer(r->source_, r->size_)};
    asio::async_write(c.socket, buffers, [this, &c, r](const error_code& ec, std::size_t) {
      if (ec) return connection_broke(c, c.peer, ec);
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

  void read_header(Connection& c) {
    asio::async_read(c.socket, asio::buffer(c.in_header), [this, &c](const error_code& ec, std::size_t got) {
      const int peer = c.peer;
      if (ec == asio::error::eof && got == 0) return closed_between_frames(c);
      if (ec) return connection_broke(c, peer, ec);
      std::string why;
      const auto header = tcp_wire::decode_header(c.in_header, why);
      if (!header) return fail_peer(peer, protocol_error(peer, why));
      if (header->type == tcp_wire::FrameType::abort) return read_abort_reason(c, header->length);
      if (header->type != tcp_wire::FrameType::data)
        return fail_peer(peer, protocol_error(peer, fmt::format("unexpected frame type {} after setup", int(header->type))));
      if (header->length > options_.max_message_bytes)
        return fail_peer(peer, protocol_error(peer, fmt::format("frame of {} bytes exceeds the {}-byte limit",
                                                                header->length, options_.max_message_bytes)));
      std::lock_guard lock(mutex_);
      Peer& p = peers_[static_cast<std::size_t>(peer)];
      if (p.failure) return;
      count(c.express ? traffic_.express_received : traffic_.data_received, header->length);
      c.parked = header;
      if (Request* r = p.receives.take_if([&](const Request* q) { return q->tag_ == header->tag; })) start_payload(c, *r);
      // Otherwise the frame waits, and so does this socket, until a matching recv() arrives.
    });
  }

  // Requires the lock: binds the parked frame on `c` to receive `r` and reads its payload.
  void start_payload(Connection& c, Request& r) {
    const tcp_wire::FrameHeader header = *c.parked;
    c.parked.reset();
    if (header.length > r.size_) {
      const Error e = protocol_error(r.peer_, fmt::format("message of {} bytes (tag {:#x}) does not fit the {}-byte receive",
                                                          header.length, header.tag, r.size_));
      fail(r, e);
      // The stream cannot skip the payload without reading it somewhere: give up the peer.
      asio::post(io_, [this, peer = r.peer_, e] { fail_peer(peer, e); });
      return;
    }
    c.receiving = &r;
    asio::post(io_, [this, &c, length = header.length] {
      Request* target;
      {
        std::lock_guard lock(mutex_);
        target = c.receiving;
      }
      if (!target) return;  // failed meanwhile
      asio::async_read(c.socket, asio::buffer(target->destination_, length),
                       [this, &c, target, length](const error_code& ec, std::size_t) {
                         if (ec) return connection_broke(c, c.peer, ec);
                         {
                           std::lock_guard lock(mutex_);
                           if (c.receiving != target) return;  // failed and handed back meanwhile
                           c.receiving = nullptr;
                           finish(*target, length);
                         }
                         read_header(c);
                       });
    });
  }

  void read_abort_reason(Connection& c, std::uint64_t length) {
    const int peer = c.peer;
    if (length > c.reason.size())
      return fail_peer(peer, protocol_error(peer, fmt::format("abort notice of {} bytes", length)));
    asio::async_read(c.socket, asio::buffer(c.reason.data(), length), [this, &c, peer, length](const error_code& ec, std::size_t) {
      const std::string reason = ec ? std::string("(reason lost)") : std::string(c.reason.data(), length);
      fail_peer(peer, Error(ErrorKind::peer_failed, where(peer, "recv"), fmt::format("rank {} failed: {}", peer, reason)));
    });
  }

  Error protocol_error(int peer, std::string why) const {
    return Error(ErrorKind::protocol, where(peer, "recv"), fmt::format("from rank {}: {}", peer, why));
  }

  // A peer that finished closes all its sockets; what it sent before is still in the others, so
  // the peer counts as gone only once every one of its connections has closed.
  void closed_between_frames(Connection& c) {
    {
      std::lock_guard lock(mutex_);
      c.closed = true;
      for (const auto& other : peers_[static_cast<std::size_t>(c.peer)].connections)
        if (!other->closed) return;
    }
    fail_peer(c.peer, Error(ErrorKind::peer_failed, where(c.peer, "connection"),
                            fmt::format("rank {} closed its connections (it exited or failed)", c.peer)));
  }

  void connection_broke(Connection&, int peer, const error_code& ec) {
    if (ec == asio::error::operation_aborted) return;  // we closed it
    const bool closed = ec == asio::error::eof || ec == asio::error::connection_reset || ec == asio::error::broken_pipe;
    fail_peer(peer, Error(ErrorKind::peer_failed, where(peer, "connection"),
                          closed ? fmt::format("rank {} closed its connection in the middle of a message (it exited or failed)", peer)
                                 : fmt::format("connection to rank {} failed: {}", peer, ec.message())));
  }

  // On the io thread: every operation with `peer` fails with `e`, and its sockets close.
  void fail_peer(int peer, const Error& e) {
    std::lock_guard lock(mutex_);
    Peer& p = peers_[static_cast<std::size_t>(peer)];
    if (p.failure) return;
    fail_pending(p, e);
    close_sockets(p);
  }

  // Requires the lock: fails every operation pending with `p` (posted receives, queued sends, the
  // frames in flight) with `e`, lets go of their buffers, and marks the peer failed unless it was
  // already: every later operation with it throws the first failure. Its sockets stay open.
  void fail_pending(Peer& p, const Error& e) {
    if (!p.failure) p.failure = e;
    p.receives.drain([&](Request* r) { fail(*r, e); });
    for (auto& c : p.connections) {
      if (!c) continue;  // this rank's own entry has no sockets
      c->queue.drain([&](Request* r) { fail(*r, e); });
      if (c->sending) fail(*c->sending, e);
      if (c->receiving) fail(*c->receiving, e);
      c->sending = c->receiving = nullptr;
      c->parked.reset();
    }
  }

  void fail_peer_and_wait(int peer, const Error& e) {
    std::promise<void> done;
    asio::post(io_, [&] {
      fail_peer(peer, e);
      done.set_value();
    });
    done.get_future().wait();
  }

  // On the io thread: everything pending fails, every peer gets a short, best-effort notice, then
  // every socket closes.
  void send_abort_notices() {
    std::string reason;
    // A socket in the middle of a frame cannot carry a notice; the others can.
    std::vector<Connection*> between_frames;
    {
      std::lock_guard lock(mutex_);
      reason = std::string(aborted_->what()).substr(0, tcp_wire::max_reason_bytes);
      for (std::size_t peer = 0; peer < peers_.size(); ++peer) {
        Peer& p = peers_[peer];
        for (auto& c : p.connections)
          if (c && !c->sending && c->socket.is_open()) between_frames.push_back(c.get());
        fail_pending(p, aborted_->filled(where(static_cast<int>(peer), "abort")));
      }
      to_self_.drain([&](Request* r) { fail(*r, *aborted_); });
    }
    // Each notice goes only if the kernel takes it at once: never waiting on a peer that does not read.
    const auto header = tcp_wire::encode(tcp_wire::FrameHeader{tcp_wire::FrameType::abort, 0, reason.size()});
    const std::array<asio::const_buffer, 2> notice{asio::buffer(header), asio::buffer(reason)};
    for (Connection* c : between_frames) {
      error_code ignored;
      c->socket.non_blocking(true, ignored);
      c->socket.write_some(notice, ignored);
    }
    close_all();
  }

  void close_sockets(Peer& p) {
    for (auto& c : p.connections) {
      if (!c) continue;
      error_code ignored;
      c->socket.close(ignored);
    }
  }

  void close_all() {
    for (auto& p : peers_) close_sockets(p);
  }

  // ---- connection setup, on the constructing thread ----------------------------------------------

  // Runs one asynchronous step to completion here, or cancels it at the deadline.
  error_code run_until(Clock::time_point deadline, const std::function<void(std::function<void(error_code)>)>& start,
                       const std::function<void()>& cancel) {
    std::optional<error_code> result;
    start([&](error_code ec) { result = ec; });
    io_.restart();
    while (!result && io_.run_one_until(deadline)) {
    }
    if (result) return *result;
    cancel();
    io_.restart();
    while (!result) io_.run_one();
    return asio::error::timed_out;
  }

  void read_exactly(tcp::socket& s, asio::mutable_buffer b, Clock::time_point deadline, std::string_view what) {
    const error_code ec = run_until(
        deadline, [&](auto done) { asio::async_read(s, b, [done](error_code e, std::size_t) { done(e); }); },
        [&] { error_code ignored; s.close(ignored); });
    if (ec) throw setup_error(ec, what);
  }

  void write_all(tcp::socket& s, std::vector<asio::const_buffer> b, Clock::time_point deadline, std::string_view what) {
    const error_code ec = run_until(
        deadline, [&](auto done) { asio::async_write(s, b, [done](error_code e, std::size_t) { done(e); }); },
        [&] { error_code ignored; s.close(ignored); });
    if (ec) throw setup_error(ec, what);
  }

  Error setup_error(const error_code& ec, std::string_view what) const {
    if (ec == asio::error::timed_out)
      return Error(ErrorKind::timeout, where(-1, "tcp setup"),
                   fmt::format("{} did not finish within the {} s setup timeout", what,
                               std::chrono::duration_cast<std::chrono::seconds>(options_.setup_timeout).count()));
    return Error(ErrorKind::peer_failed, where(-1, "tcp setup"), fmt::format("{}: {}", what, ec.message()));
  }

  struct Handshake {
    std::optional<tcp_wire::Hello> peer;
    std::string refusal;  // why the peer was refused, when it was
  };

  Handshake handshake(tcp::socket& s, std::uint32_t connection, Clock::time_point deadline) {
    tcp_wire::Hello mine{.sockets = static_cast<std::uint16_t>(sockets_per_peer()),
                         .rank = static_cast<std::uint32_t>(options_.rank),
                         .world_size = static_cast<std::uint32_t>(options_.world_size),
                         .connection = connection};
    std::random_device entropy;
    for (auto& b : mine.nonce) b = static_cast<std::byte>(entropy());
    const auto own = tcp_wire::encode(mine);
    std::array<std::byte, tcp_wire::hello_bytes> theirs{};
    write_all(s, {asio::buffer(own)}, deadline, "sending the hello");
    read_exactly(s, asio::buffer(theirs), deadline, "reading the peer's hello");
    Handshake result;
    const auto hello = tcp_wire::decode_hello(theirs, result.refusal);
    if (!hello) return result;
    if (hello->world_size != static_cast<std::uint32_t>(options_.world_size)) {
      result.refusal = fmt::format("it belongs to a job of {} ranks, this one has {}", hello->world_size, options_.world_size);
      return result;
    }
    if (hello->sockets != mine.sockets) {
      result.refusal = fmt::format(
          "it opens {} sockets per peer, this process {}: connections per peer and the express lane (on or off) "
          "must be the same on every rank",
          hello->sockets, mine.sockets);
      return result;
    }
    const auto my_proof = tcp_wire::proof(options_.token, own, theirs);
    std::array<std::byte, tcp_wire::proof_bytes> their_proof{};
    write_all(s, {asio::buffer(my_proof)}, deadline, "sending the token proof");
    read_exactly(s, asio::buffer(their_proof), deadline, "reading the peer's token proof");
    const auto expected = tcp_wire::proof(options_.token, theirs, own);
    gradsync::detail::Digest a, b;
    std::memcpy(a.data(), their_proof.data(), a.size());
    std::memcpy(b.data(), expected.data(), b.size());
    if (!gradsync::detail::equal_digests(a, b)) {
      result.refusal = "its proof of the job token does not verify: the two processes were given different GRADSYNC_TOKEN values";
      return result;
    }
    result.peer = hello;
    return result;
  }

  void write_text_frame(tcp::socket& s, tcp_wire::FrameType type, const std::string& text, Clock::time_point deadline) {
    const auto header = tcp_wire::encode(tcp_wire::FrameHeader{type, 0, text.size()});
    write_all(s, {asio::buffer(header), asio::buffer(text)}, deadline, "sending rendezvous data");
  }

  std::string read_text_frame(tcp::socket& s, tcp_wire::FrameType type, Clock::time_point deadline, int peer) {
    std::array<std::byte, tcp_wire::header_bytes> bytes{};
    read_exactly(s, asio::buffer(bytes), deadline, "reading rendezvous data");
    std::string why;
    const auto header = tcp_wire::decode_header(bytes, why);
    if (header && header->type != type) why = fmt::format("frame type {} where {} belongs", int(header->type), int(type));
    if (header && header->length > tcp_wire::max_rendezvous_bytes) why = fmt::format("rendezvous frame of {} bytes", header->length);
    if (!why.empty()) throw protocol_error(peer, why);
    std::string text(header->length, '\0');
    read_exactly(s, asio::buffer(text), deadline, "reading rendezvous data");
    return text;
  }

  tcp::socket connect(const std::string& host, std::uint16_t port, int peer, std::uint32_t connection,
                      Clock::time_point deadline) {
    tcp::resolver resolver(io_);
    error_code last;
    for (;;) {
      tcp::socket s(io_);
      error_code resolved;
      const auto endpoints = resolver.resolve(host, std::to_string(port), resolved);
      if (!resolved) {
        last = run_until(
            deadline,
            [&](auto done) { asio::async_connect(s, endpoints, [done](error_code e, const tcp::endpoint&) { done(e); }); },
            [&] { error_code ignored; s.close(ignored); });
        if (!last) {
          const Handshake h = handshake(s, connection, deadline);
          if (!h.peer)
            throw Error(ErrorKind::mismatch, where(peer, "tcp setup"),
                        fmt::format("rank {} at {}:{} refused this process, or this process refused it: {}", peer, host,
                                    port, h.refusal));
          if (h.peer->rank != static_cast<std::uint32_t>(peer))
            throw Error(ErrorKind::mismatch, where(peer, "tcp setup"),
                        fmt::format("{}:{} answered as rank {}, expected rank {}", host, port, h.peer->rank, peer));
          return s;
        }
      } else {
        last = resolved;
      }
      if (Clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw Error(ErrorKind::timeout, where(peer, "tcp setup"),
                    fmt::format("could not connect to rank {} at {}:{} within the setup timeout: {}", peer, host, port,
                                last.message()));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it may not be listening yet
    }
  }

  void connect_job(Clock::time_point deadline) {
    const int n = options_.world_size;
    const int me = options_.rank;
    const auto connections = static_cast<std::uint32_t>(sockets_per_peer());
    if (n == 1) return;

    tcp::acceptor acceptor(io_);
    const auto listen_ip = options_.listen_addr.empty() ? asio::ip::address(asio::ip::address_v4::any())
                                                        : asio::ip::make_address(options_.listen_addr);
    const tcp::endpoint listen_at(listen_ip, me == 0 ? options_.master_port : 0);
    acceptor.open(listen_at.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    error_code bound;
    acceptor.bind(listen_at, bound);
    if (bound)
      throw Error(ErrorKind::invalid_argument, where(-1, "tcp setup"),
                  fmt::format("cannot listen on {}:{}: {}", listen_at.address().to_string(), listen_at.port(), bound.message()));
    acceptor.listen();

    std::vector<std::string> table(static_cast<std::size_t>(n));
    if (me > 0) {
      tcp::socket first = connect(options_.master_addr, options_.master_port, 0, 0, deadline);
      const std::string advertised = options_.listen_addr.empty() ? first.local_endpoint().address().to_string() : options_.listen_addr;
      write_text_frame(first, tcp_wire::FrameType::address, fmt::format("{} {}", advertised, acceptor.local_endpoint().port()), deadline);
      table = parse_table(read_text_frame(first, tcp_wire::FrameType::table, deadline, 0));
      install(0, 0, std::move(first));
      for (std::uint32_t c = 1; c < connections; ++c) install(0, c, connect(options_.master_addr, options_.master_port, 0, c, deadline));
      for (int peer = 1; peer < me; ++peer) {
        const auto space = table[static_cast<std::size_t>(peer)].rfind(' ');
        const std::string host = table[static_cast<std::size_t>(peer)].substr(0, space);
        const auto port = static_cast<std::uint16_t>(std::stoi(table[static_cast<std::size_t>(peer)].substr(space + 1)));
        for (std::uint32_t c = 0; c < connections; ++c) install(peer, c, connect(host, port, peer, c, deadline));
      }
    }

    // Accept every connection from the ranks above this one; rank 0 also serves the rendezvous.
    std::vector<std::string> refused;
    std::size_t expected = static_cast<std::size_t>(n - 1 - me) * connections;
    int addresses_known = 0;
    while (expected > 0) {
      tcp::socket s(io_);
      const error_code ec = run_until(
          deadline, [&](auto done) { acceptor.async_accept(s, [done](error_code e) { done(e); }); },
          [&] { error_code ignored; acceptor.close(ignored); });
      if (ec) throw missing_ranks(ec, refused);
      std::string from = "?";
      error_code remote_ec;
      const auto remote = s.remote_endpoint(remote_ec);
      if (!remote_ec) from = fmt::format("{}:{}", remote.address().to_string(), remote.port());
      Handshake h;
      try {
        h = handshake(s, 0, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
      } catch (const Error& e) {
        h.refusal = e.detail();
      }
      if (h.peer) {
        const auto peer = static_cast<int>(h.peer->rank);
        if (peer <= me || peer >= n || h.peer->connection >= connections)
          h.refusal = fmt::format("it claims rank {} connection {}, which this rank does not expect", peer, h.peer->connection);
        else if (peers_[static_cast<std::size_t>(peer)].connections[h.peer->connection])
          h.refusal = fmt::format("rank {} connection {} is already connected", peer, h.peer->connection);
      }
      if (!h.peer || !h.refusal.empty()) {
        const std::string line = fmt::format("refused a connection from {}: {}", from, h.refusal);
        std::fprintf(stderr, "gradsync: rank %d: %s\n", me, line.c_str());
        refused.push_back(line);
        continue;
      }
      const auto peer = static_cast<int>(h.peer->rank);
      if (me == 0 && h.peer->connection == 0) {
        table[static_cast<std::size_t>(peer)] = read_text_frame(s, tcp_wire::FrameType::address, deadline, peer);
        if (++addresses_known == n - 1) {
          install(peer, 0, std::move(s));
          send_table(table, deadline);
          --expected;
          continue;
        }
      }
      install(peer, h.peer->connection, std::move(s));
      --expected;
    }
  }

  void send_table(std::vector<std::string>& table, Clock::time_point deadline) {
    table[0] = fmt::format("{} {}", options_.master_addr, options_.master_port);
    std::string text;
    for (const auto& line : table) text += line + "\n";
    for (std::size_t peer = 1; peer < peers_.size(); ++peer)
      write_text_frame(peers_[peer].connections[0]->socket, tcp_wire::FrameType::table, text, deadline);
  }

  std::vector<std::string> parse_table(const std::string& text) const {
    std::vector<std::string> lines;
    std::size_t at = 0;
    while (at < text.size()) {
      const auto end = text.find('\n', at);
      if (end == std::string::npos) break;
      lines.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    if (lines.size() != peers_.size())
      throw protocol_error(0, fmt::format("address table has {} entries for {} ranks", lines.size(), peers_.size()));
    for (const auto& line : lines) {
      const auto space = line.rfind(' ');
      int port = 0;
      if (space == std::string::npos || space == 0 || std::sscanf(line.c_str() + space + 1, "%d", &port) != 1 || port < 1 || port > 65535)
        throw protocol_error(0, fmt::format("malformed address table entry {:?}", line));
    }
    return lines;
  }

  void install(int peer, std::uint32_t connection, tcp::socket s) {
    const bool express = options_.express_lane_bytes > 0 && connection + 1 == sockets_per_peer();
    peers_[static_cast<std::size_t>(peer)].connections[connection] =
        std::make_unique<Connection>(std::move(s), peer, express);
  }

  Error missing_ranks(const error_code& ec, const std::vector<std::string>& refused) const {
    std::string missing;
    for (std::size_t peer = 0; peer < peers_.size(); ++peer) {
      if (static_cast<int>(peer) == options_.rank) continue;
      for (const auto& c : peers_[peer].connections)
        if (!c) {
          missing += fmt::format("{}{}", missing.empty() ? "" : ", ", peer);
          break;
        }
    }
    std::string detail = ec == asio::error::timed_out
                             ? fmt::format("ranks {} did not connect within the setup timeout", missing)
                             : fmt::format("accepting connections failed ({}); ranks {} missing", ec.message(), missing);
    for (const auto& r : refused) detail += "; " + r;
    return Error(ec == asio::error::timed_out ? ErrorKind::timeout : ErrorKind::peer_failed, where(-1, "tcp setup"), detail);
  }

  TcpOptions options_;
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Peer> peers_;
  Matcher<Request> to_self_;  // this rank's messages to itself
  std::optional<Error> aborted_;
  std::shared_future<void> aborted_closed_;  // ready once abort() has let go of every buffer
  TcpTraffic traffic_;                       // guarded by mutex_
  std::thread io_thread_;
};

}  // namespace detail

Tcp::Tcp(const TcpOptions& options) : engine_(std::make_unique<detail::TcpEngine>(options)) {}
Tcp::Tcp(Tcp&&) noexcept = default;
Tcp& Tcp::operator=(Tcp&&) noexcept = default;
Tcp::~Tcp() = default;

TcpOptions Tcp::options_from_env() {
  const launch::Launch launch = launch::from_environment();
  TcpOptions o;
  o.rank = launch.rank;
  o.world_size = launch.world_size;
  o.master_addr = launch.master_addr;
  o.master_port = launch.master_port;
  o.token = launch.token;
  const auto number = [](const char* name, long low, long high) -> std::optional<long> {
    const auto text = launch::process_environment(name);
    if (!text) return std::nullopt;
    char* end = nullptr;
    const long value = std::strtol(text->c_str(), &end, 10);
    if (text->empty() || *end != '\0' || value < low || value > high)
      throw Error(ErrorKind::invalid_argument, {.operation = "launch"},
                  fmt::format("{}={:?} is not a whole number from {} to {}", name, *text, low, high));
    return value;
  };
  if (const auto listen = launch::process_environment("GRADSYNC_LISTEN_ADDR")) o.listen_addr = *listen;
  if (const auto c = number("GRADSYNC_CONNECTIONS_PER_PEER", 1, 64)) o.connections_per_peer = static_cast<int>(*c);
  if (const auto b = number("GRADSYNC_EXPRESS_LANE_BYTES", 0, 1L << 30)) o.express_lane_bytes = static_cast<std::size_t>(*b);
  if (const auto t = number("GRADSYNC_SETUP_TIMEOUT_S", 1, 86400)) o.setup_timeout = std::chrono::seconds(*t);
  if (const auto cc = launch::process_environment("GRADSYNC_TCP_CONGESTION")) o.congestion_control = *cc;
  return o;
}

int Tcp::rank() const noexcept { return engine_->rank(); }
int Tcp::size() const noexcept { return engine_->size(); }
TcpTraffic Tcp::traffic() const { return engine_->traffic(); }
std::string Tcp::describe() const { return engine_->describe(); }

void Tcp::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  engine_->post(r, true, peer, tag, bytes.data(), nullptr, bytes.size());
}
void Tcp::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  engine_->post(r, false, peer, tag, nullptr, bytes.data(), bytes.size());
}
bool Tcp::test(Request& r) { return engine_->test(r); }
std::size_t Tcp::wait(Request& r, std::chrono::steady_clock::time_point deadline) { return engine_->wait(r, deadline); }
void Tcp::abort(const Error& cause) { engine_->abort(cause); }

}  // namespace gradsync::transport
