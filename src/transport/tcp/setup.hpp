#pragma once
// transport::Tcp's connection setup: the rendezvous through rank 0 and the handshake that opens
// every connection (wire.hpp has both formats). It runs once, on the constructing thread, driving
// the transport's io_context itself; the data path (engine.hpp) takes over the sockets it returns.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "gradsync/transport/tcp.hpp"

namespace gradsync::transport::detail {

// Connects this rank to every other and returns, per rank, its sockets: the data sockets, then the
// express lane's if there is one (none for this rank itself). Each is authenticated and set up
// (no Nagle delay; the chosen congestion control). Throws Error(invalid_argument) for unusable
// options, Error(mismatch) when a peer and this process refuse each other, and Error(timeout)
// naming the ranks still missing after `setup_timeout`.
std::vector<std::vector<boost::asio::ip::tcp::socket>> connect_job(boost::asio::io_context& io, const TcpOptions& options);

}  // namespace gradsync::transport::detail
