#pragma once
// SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), for proving knowledge of the job token when
// a connection is set up without sending the token itself. Private to the library; hmac.cpp
// takes them from libsodium.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace gradsync::detail {

using Digest = std::array<std::uint8_t, 32>;

Digest sha256(std::span<const std::byte> message);
Digest hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message);

// Constant-time comparison, so a forged proof learns nothing from how long rejection takes.
bool equal_digests(const Digest& a, const Digest& b) noexcept;

}  // namespace gradsync::detail
