#pragma once
// The TCP transport's wire format, version 5. All integers are little-endian.
//
// Connection setup, both directions, initiator first:
//   hello  (36 bytes)  magic "GSYN" | u16 version | u16 sockets per peer | u32 rank | u32 world size
//                      | u32 connection index | 16-byte random nonce
//   proof  (32 bytes)  HMAC-SHA-256(token, "gradsync proof v1" | own hello | peer's hello)
// A side whose peer's hello has another magic, version, world size or number of sockets per peer,
// or whose proof does not verify, closes the connection; the peer sees the same facts and reports
// them itself. The connection index numbers a pair's sockets from 0 (the data sockets, then the
// express lane's); the index one past them, `sockets per peer`, is a report: a rank tells rank 0
// where it and the ranks it reports for listen, in an address frame, and rank 0 answers with an
// empty table frame once it has them; then both hang up. The table itself travels as the first
// frame on data connection 0 from a rank's parent in the rendezvous tree
// (transport/tcp/connector.cpp). Within a machine the same two frames carry a local rank's report
// to its parent over a local socket, without hello or proof (connector.cpp, "the machine's
// reports"). (Version 2 added the socket count, where version 1 had a reserved field; version 3
// the heartbeat frame; version 4 the report connection and the table's tree, where version 3 sent
// every table from rank 0; version 5 the ranks in an address frame, one report for a machine.)
//
// After setup, frames:
//   header (24 bytes)  magic "GSYN" | u8 type | 3 bytes reserved (0) | u64 tag | u64 payload length
//   payload            `length` bytes
// Types: data (1) carries a message; abort (2) carries a UTF-8 reason of at most 4096 bytes from
// a rank that is giving up, its tag 1 + the rank where the failure began (gradsync::FailureOrigin;
// the reason is what was said of that rank), or 0 where the sender does not say; address (3)
// carries "rank host port" lines, one per rank reported (within a machine the host may be "*":
// wherever the machine's report to rank 0 comes from), its tag the sender's local rank; table (4)
// carries "host port" of every rank, one per line in rank order, or nothing as an
// acknowledgement; heartbeat (5), tag 0 and no payload, says the sender is alive when it has had
// nothing else to send for a while.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace gradsync::transport::tcp_wire {

inline constexpr std::array<std::byte, 4> magic{std::byte{'G'}, std::byte{'S'}, std::byte{'Y'}, std::byte{'N'}};
inline constexpr std::uint16_t version = 5;
inline constexpr std::size_t hello_bytes = 36;
inline constexpr std::size_t proof_bytes = 32;
inline constexpr std::size_t header_bytes = 24;
inline constexpr std::size_t max_reason_bytes = 4096;
inline constexpr std::size_t max_rendezvous_bytes = std::size_t{1} << 24;

struct Hello {
  std::uint16_t version = tcp_wire::version;
  std::uint16_t sockets = 1;  // per pair of ranks: data connections plus the express lane
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::uint32_t connection = 0;
  std::array<std::byte, 16> nonce{};
};

enum class FrameType : std::uint8_t { data = 1, abort = 2, address = 3, table = 4, heartbeat = 5 };

struct FrameHeader {
  FrameType type = FrameType::data;
  std::uint64_t tag = 0;
  std::uint64_t length = 0;
};

std::array<std::byte, hello_bytes> encode(const Hello& hello);
// The hello, or why these bytes are not one of this version.
std::optional<Hello> decode_hello(std::span<const std::byte, hello_bytes> bytes, std::string& why);

std::array<std::byte, proof_bytes> proof(std::string_view token, std::span<const std::byte, hello_bytes> own,
                                         std::span<const std::byte, hello_bytes> peer);

std::array<std::byte, header_bytes> encode(const FrameHeader& header);
std::optional<FrameHeader> decode_header(std::span<const std::byte, header_bytes> bytes, std::string& why);

}  // namespace gradsync::transport::tcp_wire
