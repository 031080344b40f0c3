#pragma once
// How the process transports' errors (Tcp, Mpi) say where they happened, the same way in setup and
// on the data path: this rank, the peer concerned if there is one, and the operation.

#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::transport::detail {

// `peer` -1: no peer in particular.
inline ErrorContext error_context(int rank, int peer, std::string operation) {
  return {.rank = rank, .peer = peer >= 0 ? std::optional<int>(peer) : std::nullopt, .operation = std::move(operation)};
}

// What `peer` sent breaks the wire protocol.
inline Error protocol_error(int rank, int peer, const std::string& why) {
  return Error(ErrorKind::protocol, error_context(rank, peer, "recv"), fmt::format("from rank {}: {}", peer, why));
}

}  // namespace gradsync::transport::detail
