// SHA-256, HMAC-SHA-256 and the constant-time comparison, from libsodium.

#include "detail/hmac.hpp"

#include <sodium.h>

#include <stdexcept>

namespace gradsync::detail {

namespace {
// libsodium picks its implementations once, at sodium_init(); it is thread-safe and idempotent.
void initialize() {
  static const bool ready = sodium_init() >= 0;
  if (!ready) throw std::runtime_error("libsodium could not be initialized");
}

const unsigned char* bytes(std::span<const std::byte> s) { return reinterpret_cast<const unsigned char*>(s.data()); }
}  // namespace

Digest sha256(std::span<const std::byte> message) {
  initialize();
  Digest digest;
  crypto_hash_sha256(digest.data(), bytes(message), message.size());
  return digest;
}

Digest hmac_sha256(std::span<const std::byte> key, std::span<const std::byte> message) {
  initialize();
  crypto_auth_hmacsha256_state state;
  crypto_auth_hmacsha256_init(&state, bytes(key), key.size());  // any key length, as RFC 2104
  crypto_auth_hmacsha256_update(&state, bytes(message), message.size());
  Digest digest;
  crypto_auth_hmacsha256_final(&state, digest.data());
  sodium_memzero(&state, sizeof state);
  return digest;
}

bool equal_digests(const Digest& a, const Digest& b) noexcept { return sodium_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace gradsync::detail
