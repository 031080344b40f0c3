#include "gradsync/error.hpp"

#include <fmt/format.h>

namespace gradsync {

std::string_view to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::invalid_argument: return "invalid argument";
    case ErrorKind::mismatch: return "ranks disagree";
    case ErrorKind::timeout: return "timeout";
    case ErrorKind::peer_failed: return "peer failed";
    case ErrorKind::protocol: return "protocol error";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::internal: return "internal error";
  }
  return "error";
}

namespace {

std::string render(ErrorKind kind, const ErrorContext& c, const std::string& detail) {
  std::string where;
  const auto add = [&](const std::string& part) { where += (where.empty() ? "" : ", ") + part; };
  if (c.rank >= 0) add(fmt::format("rank {}", c.rank));
  if (c.peer) add(fmt::format("peer {}", *c.peer));
  if (c.bucket) add(fmt::format("bucket {}", *c.bucket));
  if (!c.operation.empty()) add(c.operation);
  return where.empty() ? fmt::format("gradsync: {}: {}", to_string(kind), detail)
                       : fmt::format("gradsync: {}: {}: {}", where, to_string(kind), detail);
}

}  // namespace

Error::Error(ErrorKind kind, ErrorContext context, std::string detail)
    : std::runtime_error(render(kind, context, detail)),
      kind_(kind),
      context_(std::move(context)),
      detail_(std::move(detail)) {}

Error Error::filled(const ErrorContext& outer) const {
  ErrorContext c = context_;
  if (c.rank < 0) c.rank = outer.rank;
  if (!c.peer) c.peer = outer.peer;
  if (!c.bucket) c.bucket = outer.bucket;
  if (c.operation.empty()) c.operation = outer.operation;
  Error e(kind_, std::move(c), detail_);
  e.origin_ = origin_;
  return e;
}

Error Error::with_origin(FailureOrigin origin) const {
  Error e = *this;
  e.origin_ = std::move(origin);
  return e;
}

}  // namespace gradsync
