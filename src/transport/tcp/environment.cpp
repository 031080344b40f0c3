// Tcp::options_from_env: TcpOptions from the launcher's variables (launch/environment.hpp) and
// the transport's own GRADSYNC_* settings. A malformed setting is an Error naming it, not a
// silent default.

#include <cstdlib>
#include <optional>

#include <fmt/format.h>

#include "gradsync/launch/environment.hpp"
#include "gradsync/transport/tcp.hpp"
#include "launch/setting.hpp"

namespace gradsync::transport {

TcpOptions Tcp::options_from_env(const launch::Environment& env) {
  const launch::Launch launch = launch::from_environment(env);
  TcpOptions o;
  o.rank = launch.rank;
  o.world_size = launch.world_size;
  o.master_addr = launch.master_addr;
  o.master_port = launch.master_port;
  o.token = launch.token;
  o.local_rank = launch.local_rank;
  o.local_size = launch.local_world_size;
  if (const auto listen = launch::process_environment("GRADSYNC_LISTEN_ADDR")) o.listen_addr = *listen;
  if (const auto c = launch::number_setting("GRADSYNC_CONNECTIONS_PER_PEER", 1, 64)) o.connections_per_peer = static_cast<int>(*c);
  if (const auto b = launch::number_setting("GRADSYNC_EXPRESS_LANE_BYTES", 0, 1L << 30)) o.express_lane_bytes = static_cast<std::size_t>(*b);
  if (const auto t = launch::number_setting("GRADSYNC_SETUP_TIMEOUT_S", 1, 86400)) o.setup_timeout = std::chrono::seconds(*t);
  if (const auto l = launch::number_setting("GRADSYNC_LIVENESS_MS", 0, 86400000)) o.liveness = std::chrono::milliseconds(*l);
  if (const auto cc = launch::process_environment("GRADSYNC_TCP_CONGESTION")) o.congestion_control = *cc;
  return o;
}

}  // namespace gradsync::transport
