// transport::Tcp's connections (connector.hpp).
//
// The rendezvous. Rank 0 listens on the master port, every other rank on a port of the system's
// choosing. The ranks of a machine gather where they listen up a tree within the machine ("the
// machine's reports" below); its local rank 0 (every rank, where the launcher does not say which
// ranks share a machine) connects to rank 0 once, as the report connection (wire.hpp), says where
// they listen, waits for rank 0's acknowledgement and hangs up: rank 0 takes one report per
// machine, each for as long as one handshake, never a socket per rank. Once every rank is in, the table of
// addresses travels down a binomial tree rooted at rank 0, on the first data connection of each
// pair of the tree (the parent dials its child). A rank's tree neighbours are log2(n) + 1 at most,
// and the table reaches every rank after log2(n) handshakes one after another.
//
// Connections on demand. The lower rank of a pair dials the higher: both take part in every
// exchange between them (a send completes only once its receive is posted), so the lower rank
// always learns that the pair is needed, and two dials never cross. The listener stays open for
// the whole job.
//
// Every connection opens with the handshake: hellos both ways, then proofs of the job token both
// ways. The listening side runs every accepted connection's handshake at once, each as a coroutine
// with a deadline of its own (handshake_limit), and at most max_handshakes of them (the oldest is
// dropped for a new one; a rank whose connection is dropped dials again): whoever can reach the
// port may connect, and a stranger that never speaks, or a flood of them, must not hold up the
// ranks of the job. A connection that claims a rank this rank is waiting for, but disagrees with it
// (another token, world size or socket count), ends the rendezvous at once with why: that rank has
// refused this one too and is failing with the same facts, so waiting for the setup timeout would
// only hide the cause. Any other refused connection (garbage, silence, a rank already connected or
// not expected here) is counted; the first few are logged (TcpOptions::log) and kept for the setup
// timeout's Error, the rest only summarized, so a flood costs neither memory nor log lines.
//
// Every wait ends at a deadline: a timer closes the socket it waits on.

#include "transport/tcp/connector.hpp"

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
#include <unordered_map>

#include <boost/asio.hpp>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "detail/hmac.hpp"
#include "gradsync/engine/binomial_tree.hpp"
#include "transport/errors.hpp"
#include "transport/tcp/wire.hpp"

namespace gradsync::transport::detail {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using local_stream = asio::local::stream_protocol;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

template <class T>
using Task = asio::awaitable<T>;

// How long an accepted connection has for its handshake (and a report for its address), and how
// many may be in one at once.
constexpr auto handshake_limit = std::chrono::seconds(5);
constexpr std::size_t max_handshakes = 64;
// Refused connections logged and kept for the timeout's Error; the rest are only counted.
constexpr std::size_t refusals_kept = 3;
// Between two tries to reach a rank that did not answer.
constexpr auto redial_pause = std::chrono::milliseconds(50);

// The rendezvous tree is the control channel's (engine/binomial_tree.hpp) over ranks: rank r's
// parent clears r's lowest set bit.
int tree_parent(int rank) { return gradsync::engine::binomial_tree::parent(rank); }

}  // namespace

class Connector::Impl {
 public:
  Impl(asio::io_context& io, const TcpOptions& options)
      : io_(io), options_(options), acceptor_(io), machine_acceptor_(io), connected_(static_cast<std::size_t>(options.world_size), false) {
    check_options();
  }

  std::vector<PeerSockets> rendezvous() {
    try {
      rendezvous_until(Clock::now() + options_.setup_timeout);
    } catch (...) {
      wind_down();
      throw;
    }
    rendezvous_over_ = true;
    return std::exchange(ready_, {});
  }

  void rendezvous_until(Clock::time_point deadline) {
    if (options_.world_size > 1) {
      listen();
      spawn(accept_loop(), -1);
      if (options_.rank == 0) {
        reported_.assign(static_cast<std::size_t>(options_.world_size), {});
        reported_[0] = fmt::format("{} {}", options_.master_addr, options_.master_port);
      }
      std::vector<Entry> entries{own_entry()};
      bool reported = false;
      if (by_machine()) {
        listen_within_machine();
        run_until_done([&] { return fatal_ || machine_gathered(); }, std::min(deadline, Clock::now() + machine_patience()));
        entries = stop_gathering();
        if (!fatal_ && options_.local_rank != 0) {
          try {
            complete(report_within_machine(entries, std::min(deadline, Clock::now() + machine_patience()), reported));
          } catch (const Error& e) {
            if (!fatal_) fatal_ = e;
          }
        }
      }
      if (!fatal_ && !reported) {
        try {
          if (options_.rank == 0)
            record(entries, options_.master_addr);
          else
            complete(report_address(entries, deadline));
        } catch (const Error& e) {
          if (!fatal_) fatal_ = e;
        }
      }
      if (options_.rank == 0) {
        run_until_done([&] { return fatal_ || reports_ == options_.world_size - 1; }, deadline);
        if (!fatal_ && reports_ == options_.world_size - 1) table_ = std::exchange(reported_, {});
      } else {
        run_until_done([&] { return fatal_ || !table_.empty(); }, deadline);
      }
      if (!fatal_ && !table_.empty()) forward_table(deadline);
      if (refused_ > refusals_kept) log_line(options_.log, fmt::format("gradsync: rank {}: {}", options_.rank, summary()));
      if (fatal_) throw *fatal_;
      if (table_.empty()) throw missing();
    }
  }

  // A failed rendezvous, on the constructing thread: everything closes, and every coroutine ends
  // here before the io_context (which holds them) outlives this object.
  void wind_down() {
    close();
    if (io_.stopped()) io_.restart();
    io_.run();
  }

  void serve(Connected connected, Failed failed) {
    on_connected_ = std::move(connected);
    on_failed_ = std::move(failed);
  }

  void dial(int peer) {
    if (stopping()) return;
    spawn(dial_peer(peer, Clock::now() + options_.setup_timeout, {}), peer);
  }

  void stop_connecting(Connector::Settled settled) {
    winding_down_ = true;
    error_code ignored;
    acceptor_.close(ignored);
    machine_acceptor_.close(ignored);
    if (connecting_ == 0 || closing_)
      asio::post(io_, std::move(settled));
    else
      on_settled_ = std::move(settled);
  }

  void close() {
    closing_ = true;
    on_settled_ = nullptr;
    error_code ignored;
    acceptor_.close(ignored);
    machine_acceptor_.close(ignored);
    for (const auto& w : watches_) w->expire();
  }

 private:
  ErrorContext where(int peer) const { return error_context(options_.rank, peer, rendezvous_over_ ? "tcp connect" : "tcp setup"); }

  // The data sockets, then the express lane's if there is one.
  std::uint32_t sockets_per_peer() const {
    return static_cast<std::uint32_t>(options_.connections_per_peer) + (options_.express_lane_bytes > 0 ? 1 : 0);
  }
  // The connection index of a report to rank 0 (wire.hpp): one past the data connections.
  std::uint32_t report_connection() const { return sockets_per_peer(); }

  void check_options() const {
    const auto bad = [&](std::string why) { return Error(ErrorKind::invalid_argument, where(-1), std::move(why)); };
    if (options_.world_size < 1) throw bad(fmt::format("world size {} is not positive", options_.world_size));
    if (options_.rank < 0 || options_.rank >= options_.world_size)
      throw bad(fmt::format("rank {} is outside a world of {}", options_.rank, options_.world_size));
    if (options_.connections_per_peer < 1 || options_.connections_per_peer > 64)
      throw bad(fmt::format("{} connections per peer; use 1 to 64", options_.connections_per_peer));
    if (options_.token.empty()) throw bad("the job token is empty");
  }

  // No new connections: closing, or winding down (stop_connecting).
  bool stopping() const noexcept { return closing_ || winding_down_; }
  Error closed_before_connected(int peer) const {
    return Error(ErrorKind::peer_failed, where(peer), "the transport closed before the connection was made");
  }

  // Counts a pair's dial or an accepted connection while it is under way; the last to end while
  // winding down says the connections have settled.
  class Connecting {
   public:
    explicit Connecting(Impl& c) : c_(c) { ++c_.connecting_; }
    Connecting(const Connecting&) = delete;
    Connecting& operator=(const Connecting&) = delete;
    ~Connecting() {
      if (--c_.connecting_ == 0 && c_.on_settled_) asio::post(c_.io_, std::exchange(c_.on_settled_, nullptr));
    }

   private:
    Impl& c_;
  };

  // ---- sockets with deadlines -------------------------------------------------------------------

  // A socket a step is working on. Its timer closes it once the deadline passes (or close() does
  // at once), which fails whatever is pending on it; the step that fails then reports a timeout
  // rather than a closed socket. Shared with the timer's handler, which may run after the step.
  struct Watch {
    explicit Watch(asio::io_context& io) : timer(io) {}
    std::function<void()> close_socket;  // empty once the step is over
    bool expired = false;
    asio::steady_timer timer;
    void expire() {
      if (!close_socket || expired) return;
      expired = true;
      timer.cancel();
      close_socket();
    }
  };

  // Registers a step's socket (TCP, or a local one within the machine) and deadline for its scope.
  template <class Socket>
  class TimedStep {
   public:
    TimedStep(Impl& c, Socket& s, Clock::time_point deadline)
        : socket_(s), watches_(c.watches_), at_(watches_.insert(watches_.end(), std::make_shared<Watch>(c.io_))) {
      const std::shared_ptr<Watch> w = *at_;
      w->close_socket = [&s] {
        error_code ignored;
        s.close(ignored);
      };
      w->timer.expires_at(deadline);
      w->timer.async_wait([w](const error_code& ec) {
        if (!ec) w->expire();
      });
      if (c.closing_) w->expire();
    }
    TimedStep(const TimedStep&) = delete;
    TimedStep& operator=(const TimedStep&) = delete;
    ~TimedStep() {
      (*at_)->close_socket = nullptr;
      (*at_)->timer.cancel();
      watches_.erase(at_);
    }

    Socket& socket() const noexcept { return socket_; }
    bool expired() const noexcept { return (*at_)->expired; }
    // Ends the step now, as if its deadline had passed.
    void expire() const noexcept { (*at_)->expire(); }

   private:
    Socket& socket_;
    std::list<std::shared_ptr<Watch>>& watches_;
    std::list<std::shared_ptr<Watch>>::iterator at_;
  };

  using Timed = TimedStep<tcp::socket>;
  using LocalTimed = TimedStep<local_stream::socket>;

  // The constructing thread: runs io_ here until `done()` or `until`.
  template <class Done>
  void run_until_done(Done&& done, Clock::time_point until = Clock::time_point::max()) {
    while (!done() && Clock::now() < until) {
      if (io_.stopped()) io_.restart();
      io_.run_one_until(std::min(until, Clock::now() + std::chrono::seconds(1)));
    }
  }

  // The constructing thread: runs one coroutine to its end here and returns, or throws what it threw.
  void complete(Task<void> task) {
    std::exception_ptr failure;
    bool finished = false;
    asio::co_spawn(io_, std::move(task), [&](std::exception_ptr e) { failure = e, finished = true; });
    run_until_done([&] { return finished; });
    if (failure) std::rethrow_exception(failure);
  }

  // Starts a coroutine that runs alongside the rest. What escapes it ends the rendezvous, or
  // later fails the peer it was connecting (`peer` -1: the listener).
  void spawn(Task<void> task, int peer) {
    asio::co_spawn(io_, std::move(task), [this, peer](std::exception_ptr e) {
      if (!e || stopping()) return;
      Error error(ErrorKind::internal, where(peer), "unknown failure");
      try {
        std::rethrow_exception(e);
      } catch (const Error& caught) {
        error = caught;
      } catch (const std::exception& caught) {
        error = Error(ErrorKind::internal, where(peer), caught.what());
      }
      if (!rendezvous_over_) {
        if (!fatal_) fatal_ = error;
      } else if (peer >= 0 && on_failed_) {
        on_failed_(peer, error);
      } else {
        log_line(options_.log, fmt::format("gradsync: rank {}: {}", options_.rank, error.what()));
      }
    });
  }

  Task<void> pause(std::chrono::milliseconds how_long) {
    asio::steady_timer timer(io_, how_long);
    error_code ignored;
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  }

  template <class Socket>
  Task<void> read_exactly(const TimedStep<Socket>& t, asio::mutable_buffer b, std::string_view what) {
    error_code ec;
    co_await asio::async_read(t.socket(), b, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) throw step_error(ec, t, what);
  }

  // (GCC 12 miscompiles a braced list in a co_await's arguments, "array used as initializer": the
  // callers name their buffer lists first.)
  template <class Socket>
  Task<void> write_all(const TimedStep<Socket>& t, std::vector<asio::const_buffer> b, std::string_view what) {
    error_code ec;
    co_await asio::async_write(t.socket(), b, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) throw step_error(ec, t, what);
  }

  template <class Socket>
  Error step_error(const error_code& ec, const TimedStep<Socket>& t, std::string_view what) const {
    if (t.expired()) return Error(ErrorKind::timeout, where(-1), fmt::format("{} did not finish in time", what));
    return Error(ErrorKind::peer_failed, where(-1), fmt::format("{}: {}", what, ec.message()));
  }

  template <class Socket>
  Task<void> write_text_frame(const TimedStep<Socket>& t, tcp_wire::FrameType type, std::string text, std::uint64_t tag = 0) {
    const auto header = tcp_wire::encode(tcp_wire::FrameHeader{type, tag, text.size()});
    std::vector<asio::const_buffer> frame{asio::buffer(header), asio::buffer(text)};
    co_await write_all(t, std::move(frame), "sending rendezvous data");
  }

  struct TextFrame {
    std::uint64_t tag = 0;
    std::string text;
  };

  template <class Socket>
  Task<std::string> read_text_frame(const TimedStep<Socket>& t, tcp_wire::FrameType type, int peer) {
    TextFrame frame = co_await read_tagged_frame(t, type, peer);
    co_return std::move(frame.text);
  }

  template <class Socket>
  Task<TextFrame> read_tagged_frame(const TimedStep<Socket>& t, tcp_wire::FrameType type, int peer) {
    std::array<std::byte, tcp_wire::header_bytes> bytes{};
    co_await read_exactly(t, asio::buffer(bytes), "reading rendezvous data");
    std::string why;
    const auto header = tcp_wire::decode_header(bytes, why);
    if (header && header->type != type) why = fmt::format("frame type {} where {} belongs", int(header->type), int(type));
    if (header && header->length > tcp_wire::max_rendezvous_bytes) why = fmt::format("rendezvous frame of {} bytes", header->length);
    if (!why.empty()) throw protocol_error(options_.rank, peer, why);
    TextFrame frame{.tag = header->tag, .text = std::string(header->length, '\0')};
    co_await read_exactly(t, asio::buffer(frame.text), "reading rendezvous data");
    co_return frame;
  }

  // ---- the rendezvous ---------------------------------------------------------------------------

  void listen() {
    const auto listen_ip = options_.listen_addr.empty() ? asio::ip::address(asio::ip::address_v4::any())
                                                        : asio::ip::make_address(options_.listen_addr);
    const tcp::endpoint listen_at(listen_ip, options_.rank == 0 ? options_.master_port : 0);
    acceptor_.open(listen_at.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    error_code bound;
    acceptor_.bind(listen_at, bound);
    if (bound)
      throw Error(ErrorKind::invalid_argument, where(-1),
                  fmt::format("cannot listen on {}:{}: {}", listen_at.address().to_string(), listen_at.port(), bound.message()));
    acceptor_.listen(asio::socket_base::max_listen_connections);
  }

  // One rank's place in a report: where rank `rank` listens, "host port", the host "*" until the
  // machine's report to rank 0 says where the machine is.
  struct Entry {
    int rank = 0;
    std::string address;
  };

  Entry own_entry() const {
    return {options_.rank, fmt::format("{} {}", options_.listen_addr.empty() ? "*" : options_.listen_addr,
                                       acceptor_.local_endpoint().port())};
  }

  // "rank host port" lines; a host "*" becomes `machine_host` unless that is empty.
  static std::string report_text(const std::vector<Entry>& entries, std::string_view machine_host) {
    std::string text;
    for (const Entry& e : entries)
      text += fmt::format("{} {}\n", e.rank,
                          e.address.starts_with("* ") && !machine_host.empty() ? fmt::format("{}{}", machine_host, e.address.substr(1))
                                                                                : e.address);
    return text;
  }

  // The entries of a report from `from` (a rank, or -1 within the machine, where hosts may be "*").
  std::vector<Entry> parse_report(const std::string& text, int from, bool within_machine) const {
    std::vector<Entry> entries;
    std::size_t at = 0;
    while (at < text.size()) {
      const auto end = text.find('\n', at);
      if (end == std::string::npos) break;
      const std::string line = text.substr(at, end - at);
      at = end + 1;
      int rank = -1, used = 0;
      if (std::sscanf(line.c_str(), "%d %n", &rank, &used) != 1 || rank < 0 || rank >= options_.world_size)
        throw protocol_error(options_.rank, from, fmt::format("malformed report line {:?} (world of {})", line, options_.world_size));
      Entry e{rank, line.substr(static_cast<std::size_t>(used))};
      if (!(within_machine && e.address.starts_with("* "))) check_address(e.address, from);
      entries.push_back(std::move(e));
    }
    if (at != text.size() || entries.empty()) throw protocol_error(options_.rank, from, "malformed report");
    return entries;
  }

  // Rank 0: the ranks of a report are in the table (rank 0's own line, preset, is skipped).
  void record(const std::vector<Entry>& entries, std::string_view machine_host) {
    for (const Entry& e : entries) {
      if (e.rank == 0) continue;
      auto& slot = reported_[static_cast<std::size_t>(e.rank)];
      if (slot.empty()) ++reports_;
      slot = e.address.starts_with("* ") ? fmt::format("{}{}", machine_host, e.address.substr(1)) : e.address;
    }
  }

  // A rank that reports to rank 0 (the machine's local rank 0, or every rank where the machine is
  // not known): tells rank 0 where the ranks of `entries` listen, and asks again until rank 0 says
  // it has them (a rank 0 still serving an earlier job on the same port refuses the report).
  Task<void> report_address(std::vector<Entry> entries, Clock::time_point deadline) {
    for (;;) {
      tcp::socket s = co_await dial_socket(options_.master_addr, options_.master_port, 0, report_connection(), deadline, true);
      const std::string advertised = options_.listen_addr.empty() ? s.local_endpoint().address().to_string() : options_.listen_addr;
      bool acknowledged = false;
      {
        const Timed t(*this, s, deadline);
        try {
          co_await write_text_frame(t, tcp_wire::FrameType::address, report_text(entries, advertised));
          co_await read_text_frame(t, tcp_wire::FrameType::table, 0);
          acknowledged = true;
        } catch (const Error& e) {
          if (e.kind() != ErrorKind::peer_failed) throw;
        }
      }
      if (acknowledged) co_return;
      if (Clock::now() + redial_pause >= deadline)
        throw Error(ErrorKind::timeout, where(0), "rank 0 did not take this rank's address within the setup timeout");
      co_await pause(redial_pause);
    }
  }

  // Rank 0: one report (a machine's ranks, or one rank's), acknowledged with an empty table frame.
  Task<void> take_report(tcp::socket& s, int peer) {
    const Timed t(*this, s, Clock::now() + handshake_limit);
    const auto entries = parse_report(co_await read_text_frame(t, tcp_wire::FrameType::address, peer), peer, false);
    if (reported_.empty()) co_return;  // every rank reported meanwhile (these before): nothing to add
    record(entries, {});
    co_await write_text_frame(t, tcp_wire::FrameType::table, {});
  }

  // ---- the machine's reports --------------------------------------------------------------------
  //
  // Where the launcher says which ranks share a machine (TcpOptions::local_rank, local_size), they
  // gather their entries up a binomial tree over local ranks (engine/binomial_tree.hpp), and local
  // rank 0 sends the machine's to rank 0 in one report: rank 0 takes one report per machine, and a
  // machine makes one connection to it. Local rank l listens, while it has children to hear from,
  // on a name in Linux's abstract socket namespace (no file, gone with its process; one namespace
  // per network namespace, that is per machine, or per emulated host), unique to the job by a
  // digest of its token, rank 0's address and the world size, and to the machine by its first
  // rank (rank - local rank: ranks numbered machine-major, as launchers number them by default, and
  // as gradsync-run's emulated machines on one host are told apart), so that every local rank can
  // name its parent without being told. A child sends an address frame (tag: its local rank) of
  // its subtree's entries, and its parent acknowledges with an empty table frame. Only a process of
  // this process's user is heard (SO_PEERCRED): such a process can read this one's memory anyway,
  // so the token's proof adds nothing there.
  //
  // The tree only spares rank 0 work; rank 0 counts ranks, not reports. A parent waits for its
  // children for machine_patience(), then goes on with the entries it has and hears no more; a
  // child whose parent has not acknowledged within as long reports to rank 0 itself. So a child
  // that starts late, a local rank that never starts (rank 0 names it at the setup timeout, as
  // always) and ranks numbered otherwise (their parents' names are not where they look) cost at
  // most two patiences, not the setup.

  // A parent's wait for its children, and a child's for its parent's acknowledgement: long enough
  // for a machine's ranks to start, a fraction of the setup timeout.
  std::chrono::milliseconds machine_patience() const {
    return std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(options_.setup_timeout) / 4,
                      std::chrono::milliseconds(100), std::chrono::milliseconds(10000));
  }

  bool by_machine() const { return options_.local_size > 1; }

  local_stream::endpoint machine_endpoint(int local_rank) const {
    const std::string job = fmt::format("gradsync machine rendezvous {} {} {}", options_.master_addr, options_.master_port, options_.world_size);
    const auto digest = gradsync::detail::hmac_sha256(std::as_bytes(std::span(options_.token)), std::as_bytes(std::span(job)));
    std::string name(1, '\0');  // the abstract namespace
    name += "gradsync-";
    for (std::size_t i = 0; i < 8; ++i) name += fmt::format("{:02x}", static_cast<unsigned>(digest[i]));
    name += fmt::format("-m{}-{}", options_.rank - options_.local_rank, local_rank);
    return local_stream::endpoint(name);
  }

  void listen_within_machine() {
    if (options_.local_rank < 0 || options_.local_rank >= options_.local_size)
      throw Error(ErrorKind::invalid_argument, where(-1),
                  fmt::format("local rank {} is outside the {} ranks of this machine", options_.local_rank, options_.local_size));
    const int children = gradsync::engine::binomial_tree::children(options_.local_rank, options_.local_size);
    machine_children_.assign(static_cast<std::size_t>(children), {});
    if (children == 0) return;
    error_code ec;
    machine_acceptor_.open(local_stream(), ec);
    if (!ec) machine_acceptor_.bind(machine_endpoint(options_.local_rank), ec);
    if (!ec) machine_acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec)
      throw Error(ErrorKind::invalid_argument, where(-1),
                  fmt::format("cannot take local rank {}'s name on this machine ({}): another process of this job claims "
                              "LOCAL_RANK {} here",
                              options_.local_rank, ec.message(), options_.local_rank));
    spawn(machine_accept_loop(), -1);
  }

  bool machine_gathered() const {
    return std::all_of(machine_children_.begin(), machine_children_.end(), [](const auto& c) { return !c.empty(); });
  }

  // Hears no more children; returns this rank's entry, then those of the subtrees that came, in
  // order (local ranks in order).
  std::vector<Entry> stop_gathering() {
    gathering_over_ = true;
    error_code ignored;
    machine_acceptor_.close(ignored);
    std::vector<Entry> entries{own_entry()};
    for (const auto& child : machine_children_) entries.insert(entries.end(), child.begin(), child.end());
    return entries;
  }

  Task<void> machine_accept_loop() {
    for (;;) {
      local_stream::socket s(io_);
      error_code ec;
      co_await machine_acceptor_.async_accept(s, asio::redirect_error(asio::use_awaitable, ec));
      if (closing_ || !machine_acceptor_.is_open()) co_return;
      if (ec) throw Error(ErrorKind::peer_failed, where(-1), fmt::format("accepting this machine's reports failed: {}", ec.message()));
      spawn(take_machine_report(std::move(s)), -1);
    }
  }

  // One child's report: its subtree's entries, acknowledged. A child that reports again (it missed
  // the acknowledgement) replaces what it sent.
  Task<void> take_machine_report(local_stream::socket s) {
    const LocalTimed t(*this, s, Clock::now() + handshake_limit);
    std::string why = foreign_user(s);
    TextFrame frame;
    std::vector<Entry> entries;
    if (why.empty()) {
      try {
        frame = co_await read_tagged_frame(t, tcp_wire::FrameType::address, -1);
        entries = parse_report(frame.text, -1, true);
      } catch (const Error& e) {
        why = e.detail();
      }
    }
    namespace tree = gradsync::engine::binomial_tree;
    std::size_t child = machine_children_.size();
    for (std::size_t i = 0; why.empty() && i < machine_children_.size(); ++i)
      if (frame.tag == static_cast<std::uint64_t>(tree::child(options_.local_rank, static_cast<int>(i)))) child = i;
    if (why.empty() && child == machine_children_.size())
      why = fmt::format("local rank {} is not one that local rank {} gathers for", frame.tag, options_.local_rank);
    if (!why.empty()) {
      refuse("this machine's local socket", Handshake{.refusal = why});
      co_return;
    }
    // Too late: this rank has gone on without it. No acknowledgement, so the child reports to rank
    // 0 itself.
    if (gathering_over_) co_return;
    machine_children_[child] = std::move(entries);
    co_await write_text_frame(t, tcp_wire::FrameType::table, {});
  }

  // Why the process at the other end of `s` is not heard; empty if it is of this process's user.
  static std::string foreign_user(local_stream::socket& s) {
    ucred peer{};
    socklen_t size = sizeof peer;
    if (::getsockopt(s.native_handle(), SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0)
      return fmt::format("cannot tell whose process connected: {}", std::strerror(errno));
    if (peer.uid != ::geteuid())
      return fmt::format("process {} belongs to user {}, this job to user {}", peer.pid, peer.uid, ::geteuid());
    return {};
  }

  // A local rank but 0: its subtree's entries to its parent, asked again until the parent says it
  // has them (it may not listen yet: the pauses between tries start short, as a local connection
  // costs microseconds, and double up to redial_pause) or `until`; `acknowledged` says which.
  Task<void> report_within_machine(std::vector<Entry> entries, Clock::time_point until, bool& acknowledged) {
    const int parent = gradsync::engine::binomial_tree::parent(options_.local_rank);
    const std::string text = report_text(entries, {});
    for (auto pause_for = std::chrono::milliseconds(1);; pause_for = std::min(2 * pause_for, redial_pause)) {
      local_stream::socket s(io_);
      {
        const LocalTimed t(*this, s, until);
        error_code ec;
        co_await s.async_connect(machine_endpoint(parent), asio::redirect_error(asio::use_awaitable, ec));
        if (!ec) {
          try {
            co_await write_text_frame(t, tcp_wire::FrameType::address, text, static_cast<std::uint64_t>(options_.local_rank));
            co_await read_text_frame(t, tcp_wire::FrameType::table, -1);
            acknowledged = true;
            co_return;
          } catch (const Error& e) {
            if (e.kind() != ErrorKind::peer_failed && e.kind() != ErrorKind::timeout) throw;
          }
        }
      }
      if (closing_) throw Error(ErrorKind::peer_failed, where(-1), "the transport closed before this rank reported");
      if (Clock::now() + pause_for >= until) break;
      co_await pause(pause_for);
    }
    if (options_.local_rank == 1)  // one line a machine
      log_line(options_.log,
               fmt::format("gradsync: rank {}: local rank 0 of this machine did not take its report in {} ms; reporting to "
                           "rank 0 directly (are LOCAL_RANK and LOCAL_WORLD_SIZE one machine's ranks, numbered "
                           "machine-major?)",
                           options_.rank, machine_patience().count()));
  }

  // Passes the table to this rank's children in the tree, all at once, each on the first data
  // connection of the pair.
  void forward_table(Clock::time_point deadline) {
    std::string text;
    for (const auto& line : table_) text += line + "\n";
    namespace tree = gradsync::engine::binomial_tree;
    auto unfinished = static_cast<std::size_t>(tree::children(options_.rank, options_.world_size));
    for (int i = static_cast<int>(unfinished); i-- > 0;)  // the largest subtree first
      asio::co_spawn(io_, dial_peer(tree::child(options_.rank, i), deadline, text), [this, &unfinished](std::exception_ptr e) {
        --unfinished;
        if (!e || fatal_) return;
        try {
          std::rethrow_exception(e);
        } catch (const Error& error) {
          fatal_ = error;
        } catch (const std::exception& error) {
          fatal_ = Error(ErrorKind::internal, where(-1), error.what());
        }
      });
    run_until_done([&] { return unfinished == 0; });
  }

  // Rank 0's table as every rank reads it: one "host port" line per rank.
  std::vector<std::string> parse_table(const std::string& text, int from) const {
    std::vector<std::string> lines;
    std::size_t at = 0;
    while (at < text.size()) {
      const auto end = text.find('\n', at);
      if (end == std::string::npos) break;
      lines.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    if (lines.size() != static_cast<std::size_t>(options_.world_size))
      throw protocol_error(options_.rank, from, fmt::format("address table has {} entries for {} ranks", lines.size(), options_.world_size));
    for (const auto& line : lines) check_address(line, from);
    return lines;
  }

  void check_address(const std::string& line, int from) const {
    const auto space = line.rfind(' ');
    int port = 0;
    if (space == std::string::npos || space == 0 || std::sscanf(line.c_str() + space + 1, "%d", &port) != 1 || port < 1 || port > 65535)
      throw protocol_error(options_.rank, from, fmt::format("malformed address {:?}", line));
  }

  // ---- dialing ----------------------------------------------------------------------------------

  // Opens every socket of the pair with `peer` (a rank above this one, or rank 0's children in the
  // rendezvous); `table`, when not empty, goes first on the first socket.
  Task<void> dial_peer(int peer, Clock::time_point deadline, std::string table) {
    const Connecting counted(*this);
    const std::string& address = table_[static_cast<std::size_t>(peer)];
    const auto space = address.rfind(' ');
    const std::string host = address.substr(0, space);
    const auto port = static_cast<std::uint16_t>(std::stoi(address.substr(space + 1)));
    PeerSockets set{.peer = peer, .sockets = {}};
    for (std::uint32_t c = 0; c < sockets_per_peer(); ++c) {
      // Winding down: the peer takes the pair as made only once every socket is in, so a pair
      // not yet whole is given up rather than finished.
      if (stopping()) throw closed_before_connected(peer);
      set.sockets.push_back(co_await dial_socket(host, port, peer, c, deadline, false));
      if (c == 0 && !table.empty()) {
        const Timed t(*this, set.sockets.back(), deadline);
        co_await write_text_frame(t, tcp_wire::FrameType::table, table);
      }
    }
    deliver(std::move(set));
  }

  // Connects to rank `peer` at host:port as connection number `connection` and runs the
  // handshake. Tries again, until the deadline, while the peer closes the connection without a
  // word or breaks it off (it dropped it among too many others) and, with `retry_refused`, while nothing listens
  // there yet (rank 0, whom every rank reaches first). Once the rendezvous is over every rank
  // listens, so a refused connection means the peer's process is gone.
  Task<tcp::socket> dial_socket(std::string host, std::uint16_t port, int peer, std::uint32_t connection,
                                Clock::time_point deadline, bool retry_refused) {
    tcp::resolver resolver(io_);
    for (;;) {
      tcp::socket s(io_);
      error_code ec;
      const auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), asio::redirect_error(asio::use_awaitable, ec));
      if (!ec) {
        const Timed t(*this, s, deadline);
        co_await asio::async_connect(s, endpoints, asio::redirect_error(asio::use_awaitable, ec));
        if (t.expired()) ec = asio::error::timed_out;
        if (!ec) {
          Handshake h;
          try {
            h = co_await handshake(t, connection);
          } catch (const Error& e) {
            // Closed or reset halfway: the peer dropped it among too many others, or it is an
            // earlier job's rank closing on the same port. A deadline is not retried.
            if (e.kind() != ErrorKind::peer_failed) throw;
            h.unanswered = true;
          }
          if (h.peer && t.expired()) throw Error(ErrorKind::timeout, where(peer), "the handshake did not finish in time");
          if (h.peer && h.peer->rank != static_cast<std::uint32_t>(peer))
            throw Error(ErrorKind::mismatch, where(peer),
                        fmt::format("{}:{} answered as rank {}, expected rank {}", host, port, h.peer->rank, peer));
          if (h.peer) co_return std::move(s);
          if (!h.unanswered)
            throw Error(ErrorKind::mismatch, where(peer),
                        fmt::format("rank {} at {}:{} refused this process, or this process refused it: {}", peer, host,
                                    port, h.refusal));
          ec = asio::error::connection_reset;
        }
      }
      if (stopping()) throw closed_before_connected(peer);
      if (ec == asio::error::connection_refused && !retry_refused) {
        const std::string what =
            fmt::format("nothing listens for rank {} at {}:{} any more: its process has exited", peer, host, port);
        throw Error(ErrorKind::peer_failed, where(peer), what).with_origin({peer, what});
      }
      if (Clock::now() + redial_pause >= deadline)
        throw Error(ErrorKind::timeout, where(peer),
                    fmt::format("could not connect to rank {} at {}:{} within the setup timeout: {}", peer, host, port,
                                ec.message()));
      co_await pause(redial_pause);
    }
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
    if (ec) throw step_error(ec, t, "reading the peer's hello");
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

  Task<void> accept_loop() {
    for (;;) {
      tcp::socket s(io_);
      error_code ec;
      co_await acceptor_.async_accept(s, asio::redirect_error(asio::use_awaitable, ec));
      if (closing_ || !acceptor_.is_open()) co_return;
      if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space) {
        // Out of file descriptors, a flood's doing: free one and carry on.
        drop_oldest();
        co_await pause(std::chrono::milliseconds(10));
        continue;
      }
      if (ec) throw Error(ErrorKind::peer_failed, where(-1), fmt::format("accepting connections failed: {}", ec.message()));
      if (handshaking_.size() >= max_handshakes) drop_oldest();
      spawn(admit(std::move(s)), -1);
    }
  }

  // Ends the oldest handshake still running (one already ended leaves the list when it resumes).
  void drop_oldest() {
    for (const Timed* t : handshaking_)
      if (!t->expired()) {
        ++dropped_;
        t->expire();
        return;
      }
  }

  // One accepted connection: its handshake, whether this rank expects it, and what the
  // rendezvous sends on it (a report to rank 0, or the table from this rank's parent).
  Task<void> admit(tcp::socket s) {
    const Connecting counted(*this);
    const std::string from = remote_address(s);  // before the handshake, which may close the socket
    Handshake h;
    {
      const Timed t(*this, s, Clock::now() + handshake_limit);
      handshaking_.push_back(&t);
      struct Unlist {  // leaves the list however the handshake ends
        std::list<const Timed*>& list;
        std::list<const Timed*>::iterator at;
        ~Unlist() { list.erase(at); }
      } unlist{handshaking_, std::prev(handshaking_.end())};
      try {
        h = co_await handshake(t, 0);
      } catch (const Error& e) {
        h.refusal = e.detail();
        h.unanswered = t.expired();
      }
      if (h.peer && t.expired()) {  // dropped (or timed out) just as it ended: the socket is closed
        h.peer.reset();
        h.refusal = "its handshake was dropped for newer ones as it ended";
        h.unanswered = true;
      }
    }
    if (closing_) co_return;
    if (h.peer) {
      h.refusal = unexpected(*h.peer);
      if (!h.refusal.empty()) h.peer.reset();
    }
    if (!h.peer) {
      refuse(from, h);
      co_return;
    }
    const auto peer = static_cast<int>(h.peer->rank);
    const std::uint32_t connection = h.peer->connection;
    try {
      if (connection == report_connection()) {
        co_await take_report(s, peer);
        co_return;
      }
      if (table_.empty() && peer == tree_parent(options_.rank) && connection == 0) {
        const Timed t(*this, s, Clock::now() + handshake_limit);
        table_ = parse_table(co_await read_text_frame(t, tcp_wire::FrameType::table, peer), peer);
      }
    } catch (const Error& e) {
      if (!rendezvous_over_ && !fatal_) fatal_ = e.filled(where(peer));
      co_return;
    }
    install(peer, connection, std::move(s));
  }

  // Why this rank does not take a connection from a rank that passed the handshake; empty if it does.
  std::string unexpected(const tcp_wire::Hello& hello) const {
    const auto peer = static_cast<int>(hello.rank);
    if (peer >= options_.world_size) return fmt::format("it claims rank {}, outside a world of {}", peer, options_.world_size);
    if (hello.connection == report_connection()) {
      if (options_.rank == 0 && !reported_.empty() && peer != 0) return {};
      return fmt::format("rank {} reports its address, which only rank 0 takes, and only during the rendezvous", peer);
    }
    if (hello.connection > report_connection())
      return fmt::format("rank {} claims connection {}, beyond the {} a pair has", peer, hello.connection, sockets_per_peer());
    if (peer >= options_.rank)
      return fmt::format("rank {} dialed rank {}: the lower rank of a pair dials", peer, options_.rank);
    const auto partial = partial_.find(peer);
    if (connected_[static_cast<std::size_t>(peer)] ||
        (partial != partial_.end() && partial->second[hello.connection].has_value()))
      return fmt::format("rank {} connection {} is already connected", peer, hello.connection);
    return {};
  }

  // Counts a refused connection, and keeps and logs the first few; a rank this rank is waiting
  // for in the rendezvous that disagrees with it ends the rendezvous.
  void refuse(const std::string& from, const Handshake& h) {
    ++refused_;
    if (h.unanswered) ++silent_;
    if (first_refusals_.size() < refusals_kept) {
      const std::string line = fmt::format("refused a connection from {}: {}", from, h.refusal);
      log_line(options_.log, fmt::format("gradsync: rank {}: {}", options_.rank, line));
      first_refusals_.push_back(line);
    }
    if (h.disagreeing_rank && awaited(*h.disagreeing_rank) && !fatal_)
      fatal_ = Error(ErrorKind::mismatch, where(static_cast<int>(*h.disagreeing_rank)),
                     fmt::format("rank {} (connecting from {}) cannot join this job: {}", *h.disagreeing_rank, from,
                                 h.refusal));
  }

  // Whether the rendezvous still waits for `rank`: rank 0 for its report, the others for their
  // parent's table.
  bool awaited(std::uint32_t rank) const {
    if (rendezvous_over_ || rank >= static_cast<std::uint32_t>(options_.world_size)) return false;
    if (options_.rank == 0) return !reported_.empty() && rank > 0 && reported_[rank].empty();
    return table_.empty() && static_cast<int>(rank) == tree_parent(options_.rank);
  }

  std::string summary() const {
    return fmt::format(
        "refused {} connections ({} said nothing in time or closed unanswered, {} of them dropped for newer ones "
        "beyond {} handshakes at once); the first: {}",
        refused_, silent_, dropped_, max_handshakes, fmt::join(first_refusals_, "; "));
  }

  static std::string remote_address(const tcp::socket& s) {
    error_code ec;
    const auto remote = s.remote_endpoint(ec);
    return ec ? std::string("?") : fmt::format("{}:{}", remote.address().to_string(), remote.port());
  }

  // An accepted socket of a lower rank's pair; the pair is delivered once all of its sockets are in.
  void install(int peer, std::uint32_t connection, tcp::socket s) {
    auto& slots = partial_[peer];
    slots.resize(sockets_per_peer());
    slots[connection].emplace(std::move(s));
    if (std::any_of(slots.begin(), slots.end(), [](const auto& slot) { return !slot; })) return;
    PeerSockets set{.peer = peer, .sockets = {}};
    for (auto& slot : slots) set.sockets.push_back(std::move(*slot));
    partial_.erase(peer);
    deliver(std::move(set));
  }

  void deliver(PeerSockets set) {
    connected_[static_cast<std::size_t>(set.peer)] = true;
    for (auto& s : set.sockets) {
      s.set_option(tcp::no_delay(true));
      set_congestion_control(s, set.peer);
    }
    if (rendezvous_over_ && on_connected_)
      on_connected_(std::move(set));
    else
      ready_.push_back(std::move(set));
  }

  void set_congestion_control(tcp::socket& s, int peer) const {
    const std::string& name = options_.congestion_control;
    if (name.empty()) return;
    if (::setsockopt(s.native_handle(), IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) != 0)
      throw Error(ErrorKind::invalid_argument, where(peer),
                  fmt::format("TCP congestion control {:?} is not available here (see "
                              "/proc/sys/net/ipv4/tcp_available_congestion_control): {}",
                              name, std::strerror(errno)));
  }

  Error missing() const {
    std::string detail;
    if (options_.rank == 0) {
      std::vector<int> silent;
      for (std::size_t r = 1; r < reported_.size(); ++r)
        if (reported_[r].empty()) silent.push_back(static_cast<int>(r));
      detail = fmt::format("ranks {} did not report where they listen within the setup timeout", fmt::join(silent, ", "));
    } else {
      detail = fmt::format(
          "the address table did not arrive within the setup timeout: rank 0 did not hear from every rank, or rank {} "
          "(which passes the table on to this rank) did not get it",
          tree_parent(options_.rank));
    }
    if (refused_ > 0) detail += "; " + (refused_ > refusals_kept ? summary() : fmt::format("{}", fmt::join(first_refusals_, "; ")));
    return Error(ErrorKind::timeout, where(-1), detail);
  }

  asio::io_context& io_;
  const TcpOptions& options_;
  tcp::acceptor acceptor_;
  local_stream::acceptor machine_acceptor_;  // while this rank has local ranks to hear from
  std::vector<std::vector<Entry>> machine_children_;  // per child in the machine's tree: its subtree's entries, once in
  bool gathering_over_ = false;  // this rank has gone on with the entries it had
  std::vector<std::string> table_;     // every rank's "host port", once the rendezvous brought it
  std::vector<std::string> reported_;  // rank 0 during the rendezvous: the addresses reported so far
  int reports_ = 0;
  std::vector<bool> connected_;        // per rank: a pair set up (it stays counted if it fails later)
  std::unordered_map<int, std::vector<std::optional<tcp::socket>>> partial_;  // pairs being accepted
  std::vector<PeerSockets> ready_;     // pairs set up before serve()
  Connected on_connected_;
  Failed on_failed_;
  bool rendezvous_over_ = false;
  bool closing_ = false;
  bool winding_down_ = false;         // stop_connecting(): no new connections, those under way end
  std::size_t connecting_ = 0;        // dials and accepted connections under way
  Connector::Settled on_settled_;     // stop_connecting()'s, until none is under way
  std::optional<Error> fatal_;  // ends the rendezvous
  std::list<std::shared_ptr<Watch>> watches_;  // every step under way, for close()
  std::list<const Timed*> handshaking_;        // accepted connections in their handshake, oldest first
  std::size_t refused_ = 0, silent_ = 0, dropped_ = 0;
  std::vector<std::string> first_refusals_;  // at most refusals_kept
};

Connector::Connector(asio::io_context& io, const TcpOptions& options) : impl_(std::make_unique<Impl>(io, options)) {}
Connector::~Connector() = default;
std::vector<PeerSockets> Connector::rendezvous() { return impl_->rendezvous(); }
void Connector::serve(Connected connected, Failed failed) { impl_->serve(std::move(connected), std::move(failed)); }
void Connector::dial(int peer) { impl_->dial(peer); }
void Connector::stop_connecting(Settled settled) { impl_->stop_connecting(std::move(settled)); }
void Connector::close() { impl_->close(); }

}  // namespace gradsync::transport::detail
