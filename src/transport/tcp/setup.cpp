// transport::Tcp's connection setup (setup.hpp). Rank 0 listens on the master port; every other rank
// connects to it, and its first connection carries the rendezvous: the address that rank listens
// on goes to rank 0, and once all have reported, rank 0 sends back every rank's. Each rank then
// connects to the ranks below it and accepts the ranks above. Every connection opens with the
// handshake: hellos both ways, then proofs of the job token both ways.
//
// The listening side runs every accepted connection's handshake at once, each as a coroutine with
// a deadline of its own (handshake_limit), and at most max_handshakes of them (the oldest is
// dropped for a new one): whoever can reach the port may connect, and a stranger that never
// speaks, or a flood of them, must not hold up the ranks of the job. A connection that claims a
// rank this rank is waiting for, but disagrees with it (another token, world size or socket
// count), ends the setup at once with why: that rank has refused this one too and is failing with
// the same facts, so waiting for the setup timeout would only hide the cause. Any other refused
// connection (garbage, silence, a rank already connected or not expected here) is counted; the
// first few are logged (TcpOptions::log) and kept for the setup timeout's Error, the rest only
// summarized, so a flood costs neither memory nor log lines.
//
// Everything here runs on the constructing thread, which drives the io_context itself before the
// io thread exists; each wait ends at a deadline, by closing the socket it waits on.

#include "transport/tcp/setup.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <list>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include <boost/asio.hpp>
#include <netinet/tcp.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/hmac.hpp"
#include "transport/tcp/errors.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport::detail {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

template <class T>
using Task = asio::awaitable<T>;

// How long an accepted connection has for its handshake, and how many may be in one at once.
constexpr auto handshake_limit = std::chrono::seconds(5);
constexpr std::size_t max_handshakes = 64;
// Refused connections logged and kept for the timeout's Error; the rest are only counted.
constexpr std::size_t refusals_kept = 3;

class Setup {
 public:
  Setup(asio::io_context& io, const TcpOptions& options) : io_(io), options_(options) {
    check_options();
    sockets_.resize(static_cast<std::size_t>(options_.world_size));
    for (std::size_t peer = 0; peer < sockets_.size(); ++peer)
      if (static_cast<int>(peer) != options_.rank) sockets_[peer].resize(sockets_per_peer());
  }

  std::vector<std::vector<tcp::socket>> connect_job(Clock::time_point deadline) {
    if (options_.world_size > 1) {
      tcp::acceptor acceptor = listen();
      if (options_.rank > 0) connect_lower_ranks(acceptor.local_endpoint().port(), deadline);
      accept_higher_ranks(acceptor, deadline);
    }
    return configured_sockets();
  }

 private:
  ErrorContext where(int peer, std::string operation) const {
    return error_context(options_.rank, peer, std::move(operation));
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

  // ---- sockets with deadlines -------------------------------------------------------------------

  // A socket a setup step is working on, and when it must be done. The loops that run io_ close
  // it once its deadline passes (expire()), which fails whatever is pending on it; the step that
  // fails then reports a timeout rather than a closed socket. Registered for its scope.
  struct Watch {
    tcp::socket* socket;
    Clock::time_point deadline;
    bool expired = false;
  };

  class Timed {
   public:
    Timed(Setup& setup, tcp::socket& s, Clock::time_point deadline)
        : watches_(setup.watches_), at_(watches_.insert(watches_.end(), Watch{&s, deadline})) {}
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;
    ~Timed() { watches_.erase(at_); }

    tcp::socket& socket() const noexcept { return *at_->socket; }
    bool expired() const noexcept { return at_->expired; }
    // Ends the step now, as if its deadline had passed.
    void expire() const noexcept {
      at_->expired = true;
      error_code ignored;
      at_->socket->close(ignored);
    }

   private:
    std::list<Watch>& watches_;
    std::list<Watch>::iterator at_;
  };

  // Closes every watched socket whose deadline has passed; returns the next deadline to wake for.
  Clock::time_point expire(Clock::time_point limit) {
    const auto now = Clock::now();
    for (Watch& w : watches_) {
      if (!w.expired && w.deadline <= now) {
        w.expired = true;
        error_code ignored;
        w.socket->close(ignored);
      }
      if (!w.expired) limit = std::min(limit, w.deadline);
    }
    return limit;
  }

  // Runs io_ on this thread until `done()`, enforcing the watched deadlines; wakes by `until` to
  // look at `done()` again even if nothing happens.
  template <class Done>
  void run_until_done(Done&& done, Clock::time_point until = Clock::time_point::max()) {
    io_.restart();
    while (!done()) {
      const auto wake = expire(std::min(until, Clock::now() + std::chrono::seconds(1)));
      if (!done()) io_.run_one_until(wake);
    }
  }

  // Runs one coroutine to its end here and returns its result, or throws what it threw.
  template <class T>
  T complete(Task<T> task) {
    std::optional<T> result;
    std::exception_ptr failure;
    asio::co_spawn(io_, std::move(task), [&](std::exception_ptr e, T value) {
      failure = e;
      if (!e) result.emplace(std::move(value));
    });
    run_until_done([&] { return failure || result; });
    if (failure) std::rethrow_exception(failure);
    return std::move(*result);
  }

  void complete(Task<void> task) {
    std::exception_ptr failure;
    bool finished = false;
    asio::co_spawn(io_, std::move(task), [&](std::exception_ptr e) { failure = e, finished = true; });
    run_until_done([&] { return finished; });
    if (failure) std::rethrow_exception(failure);
  }

  Task<void> read_exactly(const Timed& t, asio::mutable_buffer b, std::string_view what) {
    error_code ec;
    co_await asio::async_read(t.socket(), b, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) throw setup_error(ec, t, what);
  }

  // (GCC 12 miscompiles a braced list in a co_await's arguments, "array used as initializer": the
  // callers name their buffer lists first.)
  Task<void> write_all(const Timed& t, std::vector<asio::const_buffer> b, std::string_view what) {
    error_code ec;
    co_await asio::async_write(t.socket(), b, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) throw setup_error(ec, t, what);
  }

  Error setup_error(const error_code& ec, const Timed& t, std::string_view what) const {
    if (t.expired())
      return Error(ErrorKind::timeout, where(-1, "tcp setup"), fmt::format("{} did not finish in time", what));
    return Error(ErrorKind::peer_failed, where(-1, "tcp setup"), fmt::format("{}: {}", what, ec.message()));
  }

  // ---- the rendezvous ---------------------------------------------------------------------------

  // Rank 0 on the master port, every other rank on a port of the system's choosing.
  tcp::acceptor listen() {
    tcp::acceptor acceptor(io_);
    const auto listen_ip = options_.listen_addr.empty() ? asio::ip::address(asio::ip::address_v4::any())
                                                        : asio::ip::make_address(options_.listen_addr);
    const tcp::endpoint listen_at(listen_ip, options_.rank == 0 ? options_.master_port : 0);
    acceptor.open(listen_at.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    error_code bound;
    acceptor.bind(listen_at, bound);
    if (bound)
      throw Error(ErrorKind::invalid_argument, where(-1, "tcp setup"),
                  fmt::format("cannot listen on {}:{}: {}", listen_at.address().to_string(), listen_at.port(), bound.message()));
    acceptor.listen(asio::socket_base::max_listen_connections);
    return acceptor;
  }

  // Every rank but 0: tells rank 0 where it listens, over its first connection, and learns where
  // the others do; then connects every socket to each rank below it.
  void connect_lower_ranks(std::uint16_t listening_port, Clock::time_point deadline) {
    tcp::socket first = connect(options_.master_addr, options_.master_port, 0, 0, deadline);
    const std::string advertised = options_.listen_addr.empty() ? first.local_endpoint().address().to_string() : options_.listen_addr;
    std::string text;
    {
      const Timed t(*this, first, deadline);
      complete(write_text_frame(t, tcp_wire::FrameType::address, fmt::format("{} {}", advertised, listening_port)));
      text = complete(read_text_frame(t, tcp_wire::FrameType::table, 0));
    }
    const std::vector<std::string> table = parse_table(text);
    install(0, 0, std::move(first));
    const auto connections = static_cast<std::uint32_t>(sockets_per_peer());
    for (std::uint32_t c = 1; c < connections; ++c) install(0, c, connect(options_.master_addr, options_.master_port, 0, c, deadline));
    for (int peer = 1; peer < options_.rank; ++peer) {
      const std::string& address = table[static_cast<std::size_t>(peer)];
      const auto space = address.rfind(' ');
      const std::string host = address.substr(0, space);
      const auto port = static_cast<std::uint16_t>(std::stoi(address.substr(space + 1)));
      for (std::uint32_t c = 0; c < connections; ++c) install(peer, c, connect(host, port, peer, c, deadline));
    }
  }

  Task<void> send_table(std::vector<std::string> table, Clock::time_point deadline) {
    table[0] = fmt::format("{} {}", options_.master_addr, options_.master_port);
    std::string text;
    for (const auto& line : table) text += line + "\n";
    for (std::size_t peer = 1; peer < sockets_.size(); ++peer) {
      const Timed t(*this, *sockets_[peer][0], deadline);
      co_await write_text_frame(t, tcp_wire::FrameType::table, text);
    }
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
    if (lines.size() != sockets_.size())
      throw protocol_error(options_.rank, 0, fmt::format("address table has {} entries for {} ranks", lines.size(), sockets_.size()));
    for (const auto& line : lines) {
      const auto space = line.rfind(' ');
      int port = 0;
      if (space == std::string::npos || space == 0 || std::sscanf(line.c_str() + space + 1, "%d", &port) != 1 || port < 1 || port > 65535)
        throw protocol_error(options_.rank, 0, fmt::format("malformed address table entry {:?}", line));
    }
    return lines;
  }

  Task<void> write_text_frame(const Timed& t, tcp_wire::FrameType type, std::string text) {
    const auto header = tcp_wire::encode(tcp_wire::FrameHeader{type, 0, text.size()});
    std::vector<asio::const_buffer> frame{asio::buffer(header), asio::buffer(text)};
    co_await write_all(t, std::move(frame), "sending rendezvous data");
  }

  Task<std::string> read_text_frame(const Timed& t, tcp_wire::FrameType type, int peer) {
    std::array<std::byte, tcp_wire::header_bytes> bytes{};
    co_await read_exactly(t, asio::buffer(bytes), "reading rendezvous data");
    std::string why;
    const auto header = tcp_wire::decode_header(bytes, why);
    if (header && header->type != type) why = fmt::format("frame type {} where {} belongs", int(header->type), int(type));
    if (header && header->length > tcp_wire::max_rendezvous_bytes) why = fmt::format("rendezvous frame of {} bytes", header->length);
    if (!why.empty()) throw protocol_error(options_.rank, peer, why);
    std::string text(header->length, '\0');
    co_await read_exactly(t, asio::buffer(text), "reading rendezvous data");
    co_return text;
  }

  // ---- connecting -------------------------------------------------------------------------------

  // Connects to rank `peer` at host:port as connection number `connection`, retrying until the
  // deadline while it may not be listening yet, or closes the connection without a word (it
  // dropped it among too many others).
  tcp::socket connect(const std::string& host, std::uint16_t port, int peer, std::uint32_t connection,
                      Clock::time_point deadline) {
    tcp::resolver resolver(io_);
    for (;;) {
      tcp::socket s(io_);
      error_code ec = try_connect(resolver, s, host, port, deadline);
      if (!ec) {
        const Timed t(*this, s, deadline);
        const Handshake h = complete(handshake(t, connection));
        if (h.peer && h.peer->rank != static_cast<std::uint32_t>(peer))
          throw Error(ErrorKind::mismatch, where(peer, "tcp setup"),
                      fmt::format("{}:{} answered as rank {}, expected rank {}", host, port, h.peer->rank, peer));
        if (h.peer) return s;
        if (!h.unanswered)
          throw Error(ErrorKind::mismatch, where(peer, "tcp setup"),
                      fmt::format("rank {} at {}:{} refused this process, or this process refused it: {}", peer, host,
                                  port, h.refusal));
        ec = asio::error::connection_reset;
      }
      if (Clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw Error(ErrorKind::timeout, where(peer, "tcp setup"),
                    fmt::format("could not connect to rank {} at {}:{} within the setup timeout: {}", peer, host, port,
                                ec.message()));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  error_code try_connect(tcp::resolver& resolver, tcp::socket& s, const std::string& host, std::uint16_t port,
                         Clock::time_point deadline) {
    error_code resolved;
    const auto endpoints = resolver.resolve(host, std::to_string(port), resolved);
    if (resolved) return resolved;
    std::optional<error_code> result;
    const Timed t(*this, s, deadline);
    asio::async_connect(s, endpoints, [&](error_code e, const tcp::endpoint&) { result = e; });
    run_until_done([&] { return result.has_value(); });
    return t.expired() ? asio::error::timed_out : *result;
  }

  // ---- the handshake ----------------------------------------------------------------------------

  struct Handshake {
    std::optional<tcp_wire::Hello> peer;  // set only when the peer is accepted
    std::string refusal;                  // why it was refused, when it was
    // The rank a well-formed hello claimed, when the refusal is a disagreement between the two
    // processes (token, world size, socket count) rather than a stranger's garbage.
    std::optional<std::uint32_t> disagreeing_rank;
    bool unanswered = false;  // the other side closed before sending its hello
  };

  Task<Handshake> handshake(const Timed& t, std::uint32_t connection) {
    const tcp_wire::Hello mine = own_hello(connection);
    const auto own = tcp_wire::encode(mine);
    std::array<std::byte, tcp_wire::hello_bytes> theirs{};
    Handshake result;
    std::vector<asio::const_buffer> own_buffer{asio::buffer(own)};
    co_await write_all(t, std::move(own_buffer), "sending the hello");
    error_code ec;
    co_await asio::async_read(t.socket(), asio::buffer(theirs), asio::redirect_error(asio::use_awaitable, ec));
    if (ec && !t.expired() && (ec == asio::error::eof || ec == asio::error::connection_reset)) {
      result.unanswered = true;
      result.refusal = "it closed the connection without a hello";
      co_return result;
    }
    if (ec) throw setup_error(ec, t, "reading the peer's hello");
    const auto hello = tcp_wire::decode_hello(theirs, result.refusal);
    if (!hello) co_return result;
    result.refusal = disagreement(mine, *hello);
    if (result.refusal.empty()) {
      const bool verified = co_await proofs_verify(t, own, theirs);
      if (!verified)
        result.refusal =
            "its proof of the job token does not verify: the two processes were given different GRADSYNC_TOKEN values";
    }
    if (result.refusal.empty())
      result.peer = hello;
    else
      result.disagreeing_rank = hello->rank;
    co_return result;
  }

  tcp_wire::Hello own_hello(std::uint32_t connection) const {
    tcp_wire::Hello mine{.sockets = static_cast<std::uint16_t>(sockets_per_peer()),
                         .rank = static_cast<std::uint32_t>(options_.rank),
                         .world_size = static_cast<std::uint32_t>(options_.world_size),
                         .connection = connection};
    std::random_device entropy;
    for (auto& b : mine.nonce) b = static_cast<std::byte>(entropy());
    return mine;
  }

  // Why two hellos of this wire version cannot belong to one job; empty if they can.
  std::string disagreement(const tcp_wire::Hello& mine, const tcp_wire::Hello& theirs) const {
    if (theirs.world_size != mine.world_size)
      return fmt::format("it belongs to a job of {} ranks, this one has {}", theirs.world_size, options_.world_size);
    if (theirs.sockets != mine.sockets)
      return fmt::format(
          "it opens {} sockets per peer, this process {}: connections per peer and the express lane (on or off) "
          "must be the same on every rank",
          theirs.sockets, mine.sockets);
    return {};
  }

  // Each side proves it holds the job token, over both hellos, its own first.
  Task<bool> proofs_verify(const Timed& t, std::array<std::byte, tcp_wire::hello_bytes> own,
                           std::array<std::byte, tcp_wire::hello_bytes> theirs) {
    const auto my_proof = tcp_wire::proof(options_.token, own, theirs);
    std::array<std::byte, tcp_wire::proof_bytes> their_proof{};
    std::vector<asio::const_buffer> proof{asio::buffer(my_proof)};
    co_await write_all(t, std::move(proof), "sending the token proof");
    co_await read_exactly(t, asio::buffer(their_proof), "reading the peer's token proof");
    const auto expected = tcp_wire::proof(options_.token, theirs, own);
    gradsync::detail::Digest a, b;
    std::memcpy(a.data(), their_proof.data(), a.size());
    std::memcpy(b.data(), expected.data(), b.size());
    co_return gradsync::detail::equal_digests(a, b);
  }

  // ---- accepting --------------------------------------------------------------------------------

  // What the accepting side has seen: the connections still missing, rank 0's address table, the
  // error that ends the setup at once, and the refusals.
  struct Admissions {
    std::size_t expected = 0;                 // connections still to come from the ranks above
    std::vector<std::string> table;           // rank 0: every rank's address
    int addresses_known = 0;
    bool table_sent = false;                  // rank 0: the table has gone to every rank
    std::optional<Error> fatal;
    std::list<const Timed*> handshaking;      // oldest first
    bool winding_down = false;                // every step still to start ends at once
    std::size_t running = 0;                  // coroutines still to end: the accept loop and handshakes
    std::size_t refused = 0, silent = 0, dropped = 0;
    std::vector<std::string> first_refusals;  // at most refusals_kept
  };

  // Accepts every connection from the ranks above this one; rank 0 also serves the rendezvous.
  void accept_higher_ranks(tcp::acceptor& acceptor, Clock::time_point deadline) {
    Admissions a;
    a.expected = static_cast<std::size_t>(options_.world_size - 1 - options_.rank) * sockets_per_peer();
    a.table.resize(static_cast<std::size_t>(options_.world_size));
    a.table_sent = options_.rank != 0 || options_.world_size == 1;
    const auto finished = [&] { return a.fatal || (a.expected == 0 && a.table_sent) || Clock::now() >= deadline; };
    spawn(accept_loop(acceptor, deadline, a), a);
    run_until_done(finished, deadline);
    // Wind down: no more connections, and every step still running ends now (one not started yet,
    // when it starts).
    a.winding_down = true;
    error_code ignored;
    acceptor.close(ignored);
    for (Watch& w : watches_) {
      w.expired = true;
      w.socket->close(ignored);
    }
    run_until_done([&] { return a.running == 0; });
    if (a.refused > refusals_kept) log_line(options_.log, fmt::format("gradsync: rank {}: {}", options_.rank, summary(a)));
    if (a.fatal) throw *a.fatal;
    if (a.expected > 0 || !a.table_sent) throw missing_ranks(a);
  }

  Task<void> accept_loop(tcp::acceptor& acceptor, Clock::time_point deadline, Admissions& a) {
    for (;;) {
      tcp::socket s(io_);
      error_code ec;
      co_await acceptor.async_accept(s, asio::redirect_error(asio::use_awaitable, ec));
      if (!acceptor.is_open()) co_return;  // wound down
      if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space) {
        // Out of file descriptors, a flood's doing: free one and carry on.
        drop_oldest(a);
        asio::steady_timer pause(io_, std::chrono::milliseconds(10));
        co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
        continue;
      }
      if (ec) {
        a.fatal = Error(ErrorKind::peer_failed, where(-1, "tcp setup"), fmt::format("accepting connections failed: {}", ec.message()));
        co_return;
      }
      if (a.handshaking.size() >= max_handshakes) drop_oldest(a);
      spawn(admit(std::move(s), std::min(deadline, Clock::now() + handshake_limit), deadline, a), a);
    }
  }

  // Ends the oldest handshake still running (one already ended leaves the list when it resumes).
  static void drop_oldest(Admissions& a) {
    for (const Timed* t : a.handshaking)
      if (!t->expired()) {
        ++a.dropped;
        t->expire();
        return;
      }
  }

  // Starts one of the accepting side's coroutines; what escapes it ends the setup.
  void spawn(Task<void> task, Admissions& a) {
    ++a.running;
    asio::co_spawn(io_, std::move(task), [this, &a](std::exception_ptr e) {
      --a.running;
      if (!e || a.fatal) return;
      try {
        std::rethrow_exception(e);
      } catch (const Error& error) {
        a.fatal = error;
      } catch (const std::exception& error) {
        a.fatal = Error(ErrorKind::internal, where(-1, "tcp setup"), error.what());
      }
    });
  }

  // One accepted connection: its handshake, whether this rank expects that rank's connection, and
  // on rank 0 the address a rank's first connection reports.
  Task<void> admit(tcp::socket s, Clock::time_point handshake_deadline, Clock::time_point deadline, Admissions& a) {
    const std::string from = remote_address(s);  // before the handshake, which may close the socket
    Handshake h;
    {
      const Timed t(*this, s, handshake_deadline);
      if (a.winding_down) t.expire();
      a.handshaking.push_back(&t);
      const auto handshaking = a.handshaking.end();
      struct Unlist {  // leaves the list however the handshake ends
        std::list<const Timed*>& list;
        std::list<const Timed*>::iterator at;
        ~Unlist() { list.erase(at); }
      } unlist{a.handshaking, std::prev(handshaking)};
      try {
        h = co_await handshake(t, 0);
      } catch (const Error& e) {
        h.refusal = e.detail();
        h.unanswered = t.expired();
      }
    }
    if (h.peer) {
      const auto peer = static_cast<int>(h.peer->rank);
      if (peer <= options_.rank || peer >= options_.world_size || h.peer->connection >= sockets_per_peer())
        h.refusal = fmt::format("it claims rank {} connection {}, which this rank does not expect", peer, h.peer->connection);
      else if (sockets_[static_cast<std::size_t>(peer)][h.peer->connection])
        h.refusal = fmt::format("rank {} connection {} is already connected", peer, h.peer->connection);
      if (!h.refusal.empty()) h.peer.reset();
    }
    if (!h.peer) {
      refuse(a, from, h);
      co_return;
    }
    const auto peer = static_cast<int>(h.peer->rank);
    if (options_.rank == 0 && h.peer->connection == 0) {
      try {
        const Timed t(*this, s, deadline);
        a.table[static_cast<std::size_t>(peer)] = co_await read_text_frame(t, tcp_wire::FrameType::address, peer);
      } catch (const Error& e) {
        a.fatal = e.filled(where(peer, "tcp setup"));
        co_return;
      }
    }
    install(peer, h.peer->connection, std::move(s));
    --a.expected;
    if (options_.rank == 0 && h.peer->connection == 0 && ++a.addresses_known == options_.world_size - 1) {
      try {
        co_await send_table(a.table, deadline);
        a.table_sent = true;
      } catch (const Error& e) {
        a.fatal = e;
      }
    }
  }

  // Counts a refused connection, and keeps and logs the first few; a rank this rank is waiting
  // for that disagrees with it ends the setup.
  void refuse(Admissions& a, const std::string& from, const Handshake& h) {
    ++a.refused;
    if (h.unanswered) ++a.silent;
    if (a.first_refusals.size() < refusals_kept) {
      const std::string line = fmt::format("refused a connection from {}: {}", from, h.refusal);
      log_line(options_.log, fmt::format("gradsync: rank {}: {}", options_.rank, line));
      a.first_refusals.push_back(line);
    }
    if (h.disagreeing_rank && awaited(*h.disagreeing_rank))
      a.fatal = Error(ErrorKind::mismatch, where(static_cast<int>(*h.disagreeing_rank), "tcp setup"),
                      fmt::format("rank {} (connecting from {}) cannot join this job: {}", *h.disagreeing_rank, from,
                                  h.refusal));
  }

  static std::string summary(const Admissions& a) {
    return fmt::format(
        "refused {} connections during setup ({} said nothing in time or closed unanswered, {} of them dropped for "
        "newer ones beyond {} handshakes at once); the first: {}",
        a.refused, a.silent, a.dropped, max_handshakes, fmt::join(a.first_refusals, "; "));
  }

  // Whether this rank still waits for a connection from `rank`.
  bool awaited(std::uint32_t rank) const {
    if (rank <= static_cast<std::uint32_t>(options_.rank) || rank >= sockets_.size()) return false;
    const auto& connections = sockets_[rank];
    return std::any_of(connections.begin(), connections.end(), [](const auto& s) { return !s; });
  }

  static std::string remote_address(const tcp::socket& s) {
    error_code ec;
    const auto remote = s.remote_endpoint(ec);
    return ec ? std::string("?") : fmt::format("{}:{}", remote.address().to_string(), remote.port());
  }

  void install(int peer, std::uint32_t connection, tcp::socket s) {
    sockets_[static_cast<std::size_t>(peer)][connection].emplace(std::move(s));
  }

  Error missing_ranks(const Admissions& a) const {
    std::string missing;
    for (std::size_t peer = 0; peer < sockets_.size(); ++peer)
      for (const auto& s : sockets_[peer])
        if (!s) {
          missing += fmt::format("{}{}", missing.empty() ? "" : ", ", peer);
          break;
        }
    std::string detail = missing.empty() ? std::string("the address table did not reach every rank within the setup timeout")
                                         : fmt::format("ranks {} did not connect within the setup timeout", missing);
    if (a.refused > 0) detail += "; " + (a.refused > refusals_kept ? summary(a) : fmt::format("{}", fmt::join(a.first_refusals, "; ")));
    return Error(ErrorKind::timeout, where(-1, "tcp setup"), detail);
  }

  // Every socket, in the order the data path takes them, without Nagle's delay and with the
  // chosen congestion control.
  std::vector<std::vector<tcp::socket>> configured_sockets() {
    std::vector<std::vector<tcp::socket>> out(sockets_.size());
    for (std::size_t peer = 0; peer < sockets_.size(); ++peer)
      for (auto& s : sockets_[peer]) {
        s->set_option(tcp::no_delay(true));
        set_congestion_control(*s, static_cast<int>(peer));
        out[peer].push_back(std::move(*s));
      }
    return out;
  }

  void set_congestion_control(tcp::socket& s, int peer) const {
    const std::string& name = options_.congestion_control;
    if (name.empty()) return;
    if (::setsockopt(s.native_handle(), IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) != 0)
      throw Error(ErrorKind::invalid_argument, where(peer, "tcp setup"),
                  fmt::format("TCP congestion control {:?} is not available here (see "
                              "/proc/sys/net/ipv4/tcp_available_congestion_control): {}",
                              name, std::strerror(errno)));
  }

  asio::io_context& io_;
  const TcpOptions& options_;
  // Per rank, per connection index: filled as connections are set up (this rank's own stays empty).
  std::vector<std::vector<std::optional<tcp::socket>>> sockets_;
  std::list<Watch> watches_;  // the sockets setup steps work on now, with their deadlines
};

}  // namespace

std::vector<std::vector<tcp::socket>> connect_job(asio::io_context& io, const TcpOptions& options) {
  Setup setup(io, options);
  return setup.connect_job(Clock::now() + options.setup_timeout);
}

}  // namespace gradsync::transport::detail
