#include "transport/tcp/wire.hpp"

#include <cstring>

#include <fmt/format.h>

#include "detail/hmac.hpp"

namespace gradsync::transport::tcp_wire {

namespace {

template <class T>
void put(std::byte* at, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<std::byte>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff);
}

template <class T>
T get(const std::byte* at) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) value |= static_cast<std::uint64_t>(at[i]) << (8 * i);
  return static_cast<T>(value);
}

bool has_magic(const std::byte* at) { return std::memcmp(at, magic.data(), magic.size()) == 0; }

}  // namespace

std::array<std::byte, hello_bytes> encode(const Hello& hello) {
  std::array<std::byte, hello_bytes> out{};
  std::memcpy(out.data(), magic.data(), magic.size());
  put<std::uint16_t>(&out[4], hello.version);
  put<std::uint16_t>(&out[6], hello.sockets);
  put<std::uint32_t>(&out[8], hello.rank);
  put<std::uint32_t>(&out[12], hello.world_size);
  put<std::uint32_t>(&out[16], hello.connection);
  std::memcpy(&out[20], hello.nonce.data(), hello.nonce.size());
  return out;
}

std::optional<Hello> decode_hello(std::span<const std::byte, hello_bytes> bytes, std::string& why) {
  if (!has_magic(bytes.data())) {
    why = "it is not a gradsync peer (no GSYN greeting)";
    return std::nullopt;
  }
  Hello hello;
  hello.version = get<std::uint16_t>(&bytes[4]);
  if (hello.version != version) {
    why = fmt::format("it speaks gradsync wire version {}, this process speaks version {}", hello.version, version);
    return std::nullopt;
  }
  hello.sockets = get<std::uint16_t>(&bytes[6]);
  hello.rank = get<std::uint32_t>(&bytes[8]);
  hello.world_size = get<std::uint32_t>(&bytes[12]);
  hello.connection = get<std::uint32_t>(&bytes[16]);
  std::memcpy(hello.nonce.data(), &bytes[20], hello.nonce.size());
  return hello;
}

std::array<std::byte, proof_bytes> proof(std::string_view token, std::span<const std::byte, hello_bytes> own,
                                         std::span<const std::byte, hello_bytes> peer) {
  constexpr std::string_view label = "gradsync proof v1";
  std::array<std::byte, label.size() + 2 * hello_bytes> message{};
  std::memcpy(message.data(), label.data(), label.size());
  std::memcpy(message.data() + label.size(), own.data(), hello_bytes);
  std::memcpy(message.data() + label.size() + hello_bytes, peer.data(), hello_bytes);
  const auto digest = gradsync::detail::hmac_sha256(std::as_bytes(std::span(token.data(), token.size())), message);
  std::array<std::byte, proof_bytes> out;
  std::memcpy(out.data(), digest.data(), out.size());
  return out;
}

std::array<std::byte, header_bytes> encode(const FrameHeader& header) {
  std::array<std::byte, header_bytes> out{};
  std::memcpy(out.data(), magic.data(), magic.size());
  out[4] = static_cast<std::byte>(header.type);
  put<std::uint64_t>(&out[8], header.tag);
  put<std::uint64_t>(&out[16], header.length);
  return out;
}

std::optional<FrameHeader> decode_header(std::span<const std::byte, header_bytes> bytes, std::string& why) {
  if (!has_magic(bytes.data())) {
    why = "frame header without the GSYN mark (the stream is out of step)";
    return std::nullopt;
  }
  const auto type = static_cast<std::uint8_t>(bytes[4]);
  if (type < 1 || type > 5) {
    why = fmt::format("unknown frame type {}", type);
    return std::nullopt;
  }
  return FrameHeader{static_cast<FrameType>(type), get<std::uint64_t>(&bytes[8]), get<std::uint64_t>(&bytes[16])};
}

}  // namespace gradsync::transport::tcp_wire
