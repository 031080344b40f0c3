#pragma once
// engine::coordinator_wire — the layout of coordinated sends' report and grant messages.
//
// Report and grant messages are small (at most `max_entries` entries, a few KiB) and batched: one
// message carries everything that happened on a rank since its previous one. A message is a
// Header followed by `count` entries: ReportEntry for reports (rank -> coordinator), a task id
// (u64) for grants (coordinator -> rank). Every message is checked for magic, version, kind,
// sender and length before use. Host byte order, like every control message (engine/control.hpp):
// the ranks of one job share an architecture; the transport's frames and the codecs' headers,
// which are little-endian, do not depend on it.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::engine {

namespace coordinator_wire {

inline constexpr std::uint32_t magic = 0x4f435347;  // "GSCO"
inline constexpr std::uint16_t version = 1;
inline constexpr std::size_t max_entries = 256;

enum class Kind : std::uint16_t { report = 1, grant = 2 };
// ready: a piece for `peer` of `bytes`, message `tag`, the sender's `task`; receiving: the sender
// has posted the receive for message `tag` from `peer`; sent: a granted piece to `peer` has left;
// finished: the sender's iteration is over; plan: the sender's new plan sends up to `bytes` pieces
// to `peer` per iteration, `task` pieces to all peers together.
enum class Event : std::uint32_t { ready = 1, receiving = 2, sent = 3, finished = 4, plan = 5 };

struct Header {
  std::uint32_t magic;
  std::uint16_t version;
  Kind kind;
  std::uint32_t sender;  // group rank
  std::uint32_t count;
};

struct ReportEntry {
  Event event;
  std::uint32_t peer;  // group rank
  std::uint64_t tag;
  std::uint64_t task;
  std::uint64_t bytes;
};

static_assert(sizeof(Header) == 16 && sizeof(ReportEntry) == 32);

template <class Entry>
constexpr std::size_t message_bytes(std::size_t entries) {
  return sizeof(Header) + entries * sizeof(Entry);
}

// Writes a message into `out` (sized for max_entries) and returns its length.
template <class Entry>
std::size_t write(std::span<std::byte> out, Kind kind, int sender, std::span<const Entry> entries) {
  const Header header{magic, version, kind, static_cast<std::uint32_t>(sender),
                      static_cast<std::uint32_t>(entries.size())};
  std::memcpy(out.data(), &header, sizeof header);
  if (!entries.empty()) std::memcpy(out.data() + sizeof header, entries.data(), entries.size_bytes());
  return message_bytes<Entry>(entries.size());
}

// Checks a received message from group rank `sender` and copies its entries into `out`.
template <class Entry>
void read(std::span<const std::byte> in, Kind kind, int sender, std::vector<Entry>& out) {
  const auto bad = [&](std::string why) {
    return Error(
        ErrorKind::protocol, {.operation = "coordinator"},
        fmt::format("{} message from group rank {}: {}", kind == Kind::report ? "report" : "grant", sender, why));
  };
  Header header;
  if (in.size() < sizeof header) throw bad(fmt::format("{} bytes, shorter than its header", in.size()));
  std::memcpy(&header, in.data(), sizeof header);
  if (header.magic != magic) throw bad("not a coordinator message");
  if (header.version != version)
    throw bad(fmt::format("wire version {}, this build speaks {}", header.version, version));
  if (header.kind != kind || header.sender != static_cast<std::uint32_t>(sender)) throw bad("wrong kind or sender");
  if (header.count > max_entries || in.size() != message_bytes<Entry>(header.count))
    throw bad(fmt::format("{} entries in {} bytes", header.count, in.size()));
  out.resize(header.count);
  if (header.count) std::memcpy(out.data(), in.data() + sizeof header, header.count * sizeof(Entry));
}

}  // namespace coordinator_wire

}  // namespace gradsync::engine
