#pragma once
// transport::Mpi's messages on its communicator (include/gradsync/transport/mpi.hpp says why a
// message travels as a header and a payload). MPI tags:
//   0                 notices: a rank failed, or refused a message of ours (Notice below)
//   1                 headers, one per gradsync message, in the order the sender posted them
//   2 .. MPI_TAG_UB   payloads: sequence number s of a pair travels on 2 + s mod (MPI_TAG_UB - 1)
// All words are the sender's native byte order: MPI launches one job of one architecture.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <fmt/format.h>

namespace gradsync::transport::mpi_wire {

inline constexpr std::uint32_t magic = 0x6d707367;  // "gspm"
inline constexpr std::uint32_t version = 1;
inline constexpr std::uint64_t first_word = (std::uint64_t{magic} << 32) | version;

inline constexpr int notice_tag = 0;
inline constexpr int header_tag = 1;
inline constexpr int first_payload_tag = 2;

// MPI counts in int: a longer payload travels as pieces of this many bytes, a sequence number each.
inline constexpr std::uint64_t max_piece_bytes = std::uint64_t{1} << 30;

constexpr std::uint64_t pieces(std::uint64_t length) noexcept { return (length + max_piece_bytes - 1) / max_piece_bytes; }

constexpr int payload_tag(std::uint64_t sequence, int tag_ub) noexcept {
  return first_payload_tag + static_cast<int>(sequence % static_cast<std::uint64_t>(tag_ub - first_payload_tag + 1));
}

// A gradsync message: its tag, its length and the sequence number of its first payload piece.
struct Header {
  std::uint64_t tag = 0;
  std::uint64_t length = 0;
  std::uint64_t sequence = 0;
};
inline constexpr std::size_t header_words = 4;
using HeaderWords = std::uint64_t[header_words];

inline void encode(const Header& h, HeaderWords& out) noexcept {
  out[0] = first_word;
  out[1] = h.tag;
  out[2] = h.length;
  out[3] = h.sequence;
}

// The header in `in` (`received` bytes of it arrived), or why it is not one.
inline std::optional<Header> decode(const HeaderWords& in, int received, std::string& why) {
  if (received != static_cast<int>(sizeof(HeaderWords))) {
    why = fmt::format("a header of {} bytes, not {}", received, sizeof(HeaderWords));
    return std::nullopt;
  }
  if (in[0] >> 32 != magic) {
    why = fmt::format("a header that does not start with gradsync's mark ({:#x})", in[0]);
    return std::nullopt;
  }
  if ((in[0] & 0xffffffffu) != version) {
    why = fmt::format("wire version {}, this rank speaks {}", in[0] & 0xffffffffu, version);
    return std::nullopt;
  }
  return Header{.tag = in[1], .length = in[2], .sequence = in[3]};
}

// Why a rank stopped, sent to every other: `kind` is the gradsync::ErrorKind the receiver reports
// (peer_failed; protocol to the sender of a message that did not fit), `origin` the rank that
// failed first, then the reason's text.
inline constexpr std::size_t notice_words = 3;
inline constexpr std::size_t max_reason_bytes = 1024;
struct Notice {
  std::uint64_t words[notice_words] = {};
  char reason[max_reason_bytes] = {};
};

}  // namespace gradsync::transport::mpi_wire
