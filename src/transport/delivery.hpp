#pragma once
// Landing a message in its receive: the one place the transports that copy messages themselves
// (InProcess, SharedMemory) copy the bytes or add them to the values there (recv_add).

#include <cstddef>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "gradsync/transport/operation.hpp"

namespace gradsync::transport::detail {

// Bytes of one value a delivery adds (1 for a copy, which takes any number of bytes).
constexpr std::size_t value_bytes(Delivery delivery) noexcept {
  switch (delivery) {
    case Delivery::copy: return 1;
    case Delivery::add_f32: return sizeof(float);
    case Delivery::add_f64: return sizeof(double);
  }
  return 1;
}

constexpr const char* describe(Delivery delivery) noexcept {
  return delivery == Delivery::add_f64 ? "f64" : "f32";
}

// Whether a message of `sent` bytes can land in a receive of `room` bytes.
constexpr bool fits(std::size_t sent, std::size_t room, Delivery delivery) noexcept {
  return sent <= room && sent % value_bytes(delivery) == 0;
}

// Why it cannot, for the Error both sides get.
inline std::string misfit(std::size_t sent, std::size_t room, Delivery delivery, std::uint64_t tag) {
  if (sent > room) return fmt::format("message of {} bytes (tag {:#x}) does not fit the {}-byte receive", sent, tag, room);
  return fmt::format("message of {} bytes (tag {:#x}) is not a whole number of {} values, which the receive adds", sent,
                     tag, describe(delivery));
}

template <class T>
void add_values(std::byte* to, const std::byte* from, std::size_t bytes) {
  // Element by element through memcpy: the sender's bytes need not be aligned for T. The sum is
  // to[i] + from[i], what the exchange's decode-and-add computes, so results stay bit-identical.
  for (std::size_t i = 0; i < bytes / sizeof(T); ++i) {
    T a, b;
    std::memcpy(&a, to + i * sizeof(T), sizeof(T));
    std::memcpy(&b, from + i * sizeof(T), sizeof(T));
    a += b;
    std::memcpy(to + i * sizeof(T), &a, sizeof(T));
  }
}

// Lands `bytes` (which fit) from `from` in `to`.
inline void deliver(std::byte* to, const std::byte* from, std::size_t bytes, Delivery delivery) {
  if (bytes == 0) return;
  switch (delivery) {
    case Delivery::copy: std::memcpy(to, from, bytes); return;
    case Delivery::add_f32: add_values<float>(to, from, bytes); return;
    case Delivery::add_f64: add_values<double>(to, from, bytes); return;
  }
}

}  // namespace gradsync::transport::detail
