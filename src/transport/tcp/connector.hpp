#pragma once
// transport::Tcp's connections: the rendezvous that tells every rank where the others listen, and
// the authenticated connections between pairs of ranks, each made when the data path first needs
// it (wire.hpp has the formats). No rank connects to all others: a rank holds sockets only to the
// peers its schedules use, plus its neighbours in the rendezvous tree.
//
// The rendezvous runs on the constructing thread, which drives the io_context itself before the io
// thread exists. After it, everything here runs on the io thread: the listener accepts the pairs'
// connections for the whole job, and dial() opens one when the engine asks.

#include <functional>
#include <memory>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "gradsync/transport/tcp.hpp"

namespace gradsync::transport::detail {

// One peer's sockets, authenticated and set up (no Nagle delay; the chosen congestion control):
// its data sockets, then the express lane's if there is one.
struct PeerSockets {
  int peer = -1;
  std::vector<boost::asio::ip::tcp::socket> sockets;
};

class Connector {
 public:
  using Connected = std::function<void(PeerSockets)>;
  using Failed = std::function<void(int peer, const Error& error)>;

  Connector(boost::asio::io_context& io, const TcpOptions& options);
  ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  // The rendezvous, on the constructing thread: every rank tells rank 0 where it listens, and the
  // table of every rank's address comes back down a binomial tree (rank r passes it to r + 2^k for
  // every 2^k below r's lowest set bit), over the connections the pairs of that tree keep. Returns
  // the peers connected by then. Throws Error(invalid_argument) for unusable options,
  // Error(mismatch) when a peer and this process refuse each other, and Error(timeout) naming what
  // is missing after `setup_timeout`.
  std::vector<PeerSockets> rendezvous();

  // From now on, on the io thread: every peer connected later (this rank dialed it, or it dialed
  // this rank) goes to `connected`, a dial that cannot be made to `failed`.
  void serve(Connected connected, Failed failed);

  // Connects to `peer`, a rank above this one (the lower rank of a pair dials). On the io thread.
  void dial(int peer);

  // No new connections, on the io thread: the listener closes and no dial starts, but a handshake
  // already under way runs to its end, and a pair it completes still goes to `connected`. An
  // aborting rank tells such a pair why (its peer may already count it as made); `settled` runs
  // once no handshake is left, at once if none was under way.
  using Settled = std::function<void()>;
  void stop_connecting(Settled settled);

  // No more connections: the listener and every handshake and dial still under way close. On the
  // io thread.
  void close();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::transport::detail
