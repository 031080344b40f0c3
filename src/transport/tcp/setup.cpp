// transport::Tcp's connection setup (setup.hpp). Rank 0 listens on the master port; every other rank
// connects to it, and its first connection carries the rendezvous: the address that rank listens
// on goes to rank 0, and once all have reported, rank 0 sends back every rank's. Each rank then
// connects to the ranks below it and accepts the ranks above. Every connection opens with the
// handshake: hellos both ways, then proofs of the job token both ways. A connection that claims a
// rank this rank is waiting for, but disagrees with it (another token, world size or socket
// count), ends the setup at once with why: that rank has refused this one too and is failing
// with the same facts, so waiting for the setup timeout would only hide the cause. Any other
// refused connection (garbage, a rank already connected or not expected here) is logged
// (TcpOptions::log) and the wait goes on; the setup timeout's Error lists the refusals if the real
// rank never comes.
//
// Everything here blocks the constructing thread: each step runs the io_context until it is done
// or the setup deadline has passed, before the io thread exists.

#include "transport/tcp/setup.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include <boost/asio.hpp>
#include <netinet/tcp.h>
#include <fmt/format.h>

#include "detail/hmac.hpp"
#include "transport/tcp/errors.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport::detail {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

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
    acceptor.listen();
    return acceptor;
  }

  // Every rank but 0: tells rank 0 where it listens, over its first connection, and learns where
  // the others do; then connects every socket to each rank below it.
  void connect_lower_ranks(std::uint16_t listening_port, Clock::time_point deadline) {
    tcp::socket first = connect(options_.master_addr, options_.master_port, 0, 0, deadline);
    const std::string advertised = options_.listen_addr.empty() ? first.local_endpoint().address().to_string() : options_.listen_addr;
    write_text_frame(first, tcp_wire::FrameType::address, fmt::format("{} {}", advertised, listening_port), deadline);
    const std::vector<std::string> table = parse_table(read_text_frame(first, tcp_wire::FrameType::table, deadline, 0));
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

  // Accepts every connection from the ranks above this one; rank 0 also serves the rendezvous.
  void accept_higher_ranks(tcp::acceptor& acceptor, Clock::time_point deadline) {
    const int n = options_.world_size;
    const int me = options_.rank;
    std::vector<std::string> refused;
    std::vector<std::string> table(static_cast<std::size_t>(n));  // rank 0: every rank's address
    int addresses_known = 0;
    std::size_t expected = static_cast<std::size_t>(n - 1 - me) * sockets_per_peer();
    while (expected > 0) {
      tcp::socket s(io_);
      const error_code ec = run_until(
          deadline, [&](auto done) { acceptor.async_accept(s, [done](error_code e) { done(e); }); },
          [&] { error_code ignored; acceptor.close(ignored); });
      if (ec) throw missing_ranks(ec, refused);
      const std::string from = remote_address(s);  // before the handshake, which may close the socket
      const Handshake h = answer(s, deadline);
      if (!h.peer) {
        const std::string line = fmt::format("refused a connection from {}: {}", from, h.refusal);
        log_line(options_.log, fmt::format("gradsync: rank {}: {}", me, line));
        if (h.disagreeing_rank && awaited(*h.disagreeing_rank))
          throw Error(ErrorKind::mismatch, where(static_cast<int>(*h.disagreeing_rank), "tcp setup"),
                      fmt::format("rank {} (connecting from {}) cannot join this job: {}", *h.disagreeing_rank, from,
                                  h.refusal));
        refused.push_back(line);
        continue;
      }
      const auto peer = static_cast<int>(h.peer->rank);
      const bool reports_address = me == 0 && h.peer->connection == 0;
      if (reports_address) table[static_cast<std::size_t>(peer)] = read_text_frame(s, tcp_wire::FrameType::address, deadline, peer);
      install(peer, h.peer->connection, std::move(s));
      --expected;
      if (reports_address && ++addresses_known == n - 1) send_table(table, deadline);
    }
  }

  void send_table(std::vector<std::string>& table, Clock::time_point deadline) {
    table[0] = fmt::format("{} {}", options_.master_addr, options_.master_port);
    std::string text;
    for (const auto& line : table) text += line + "\n";
    for (std::size_t peer = 1; peer < sockets_.size(); ++peer)
      write_text_frame(*sockets_[peer][0], tcp_wire::FrameType::table, text, deadline);
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
    if (!why.empty()) throw protocol_error(options_.rank, peer, why);
    std::string text(header->length, '\0');
    read_exactly(s, asio::buffer(text), deadline, "reading rendezvous data");
    return text;
  }

  // ---- one connection ---------------------------------------------------------------------------

  // Connects to rank `peer` at host:port as connection number `connection`, retrying until the
  // deadline while it may not be listening yet.
  tcp::socket connect(const std::string& host, std::uint16_t port, int peer, std::uint32_t connection,
                      Clock::time_point deadline) {
    tcp::resolver resolver(io_);
    for (;;) {
      tcp::socket s(io_);
      const error_code ec = try_connect(resolver, s, host, port, deadline);
      if (!ec) {
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
      if (Clock::now() + std::chrono::milliseconds(50) >= deadline)
        throw Error(ErrorKind::timeout, where(peer, "tcp setup"),
                    fmt::format("could not connect to rank {} at {}:{} within the setup timeout: {}", peer, host, port,
                                ec.message()));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it may not be listening yet
    }
  }

  error_code try_connect(tcp::resolver& resolver, tcp::socket& s, const std::string& host, std::uint16_t port,
                         Clock::time_point deadline) {
    error_code resolved;
    const auto endpoints = resolver.resolve(host, std::to_string(port), resolved);
    if (resolved) return resolved;
    return run_until(
        deadline,
        [&](auto done) { asio::async_connect(s, endpoints, [done](error_code e, const tcp::endpoint&) { done(e); }); },
        [&] { error_code ignored; s.close(ignored); });
  }

  struct Handshake {
    std::optional<tcp_wire::Hello> peer;  // set only when the peer is accepted
    std::string refusal;                  // why it was refused, when it was
    // The rank a well-formed hello claimed, when the refusal is a disagreement between the two
    // processes (token, world size, socket count) rather than a stranger's garbage.
    std::optional<std::uint32_t> disagreeing_rank;
  };

  Handshake handshake(tcp::socket& s, std::uint32_t connection, Clock::time_point deadline) {
    const tcp_wire::Hello mine = own_hello(connection);
    const auto own = tcp_wire::encode(mine);
    std::array<std::byte, tcp_wire::hello_bytes> theirs{};
    write_all(s, {asio::buffer(own)}, deadline, "sending the hello");
    read_exactly(s, asio::buffer(theirs), deadline, "reading the peer's hello");
    Handshake result;
    const auto hello = tcp_wire::decode_hello(theirs, result.refusal);
    if (!hello) return result;
    result.refusal = disagreement(mine, *hello);
    if (result.refusal.empty() && !proofs_verify(s, own, theirs, deadline))
      result.refusal = "its proof of the job token does not verify: the two processes were given different GRADSYNC_TOKEN values";
    if (result.refusal.empty())
      result.peer = hello;
    else
      result.disagreeing_rank = hello->rank;
    return result;
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
  bool proofs_verify(tcp::socket& s, std::span<const std::byte, tcp_wire::hello_bytes> own,
                     std::span<const std::byte, tcp_wire::hello_bytes> theirs, Clock::time_point deadline) {
    const auto my_proof = tcp_wire::proof(options_.token, own, theirs);
    std::array<std::byte, tcp_wire::proof_bytes> their_proof{};
    write_all(s, {asio::buffer(my_proof)}, deadline, "sending the token proof");
    read_exactly(s, asio::buffer(their_proof), deadline, "reading the peer's token proof");
    const auto expected = tcp_wire::proof(options_.token, theirs, own);
    gradsync::detail::Digest a, b;
    std::memcpy(a.data(), their_proof.data(), a.size());
    std::memcpy(b.data(), expected.data(), b.size());
    return gradsync::detail::equal_digests(a, b);
  }

  // The handshake on a connection this rank accepted, and whether this rank expects that rank's
  // connection. It gets 10 s at most, so that a stranger who never speaks does not hold up the job.
  Handshake answer(tcp::socket& s, Clock::time_point deadline) {
    Handshake h;
    try {
      h = handshake(s, 0, std::min(deadline, Clock::now() + std::chrono::seconds(10)));
    } catch (const Error& e) {
      h.refusal = e.detail();
    }
    if (!h.peer) return h;
    const auto peer = static_cast<int>(h.peer->rank);
    if (peer <= options_.rank || peer >= options_.world_size || h.peer->connection >= sockets_per_peer())
      h.refusal = fmt::format("it claims rank {} connection {}, which this rank does not expect", peer, h.peer->connection);
    else if (sockets_[static_cast<std::size_t>(peer)][h.peer->connection])
      h.refusal = fmt::format("rank {} connection {} is already connected", peer, h.peer->connection);
    if (!h.refusal.empty()) h.peer.reset();
    return h;
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

  Error missing_ranks(const error_code& ec, const std::vector<std::string>& refused) const {
    std::string missing;
    for (std::size_t peer = 0; peer < sockets_.size(); ++peer)
      for (const auto& s : sockets_[peer])
        if (!s) {
          missing += fmt::format("{}{}", missing.empty() ? "" : ", ", peer);
          break;
        }
    std::string detail = ec == asio::error::timed_out
                             ? fmt::format("ranks {} did not connect within the setup timeout", missing)
                             : fmt::format("accepting connections failed ({}); ranks {} missing", ec.message(), missing);
    for (const auto& r : refused) detail += "; " + r;
    return Error(ec == asio::error::timed_out ? ErrorKind::timeout : ErrorKind::peer_failed, where(-1, "tcp setup"), detail);
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

  // ---- blocking steps with a deadline -------------------------------------------------------------

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

  asio::io_context& io_;
  const TcpOptions& options_;
  // Per rank, per connection index: filled as connections are set up (this rank's own stays empty).
  std::vector<std::vector<std::optional<tcp::socket>>> sockets_;
};

}  // namespace

std::vector<std::vector<tcp::socket>> connect_job(asio::io_context& io, const TcpOptions& options) {
  Setup setup(io, options);
  return setup.connect_job(Clock::now() + options.setup_timeout);
}

}  // namespace gradsync::transport::detail
