#pragma once
// A fixed-size, 64-byte aligned byte buffer from the transport when it hands out memory
// (TransportAllocator, concepts.hpp: SharedMemory's arena, where a message is one memcpy), and an
// AlignedBuffer otherwise. Like AlignedBuffer it is sized once, when a plan is installed; it must
// not outlive the transport it came from.

#include <cstddef>
#include <span>
#include <utility>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/aligned_buffer.hpp"

namespace gradsync::detail {

template <class X>
class TransportBuffer {
 public:
  TransportBuffer() = default;
  // `transport` may be null: then, as for a transport without allocate, ordinary memory.
  TransportBuffer(X* transport, std::size_t bytes) {
    if constexpr (TransportAllocator<X>) {
      if (transport && bytes) {
        transport_ = transport;
        block_ = transport->allocate(bytes);
        return;
      }
    }
    plain_ = AlignedBuffer(bytes);
  }
  TransportBuffer(TransportBuffer&& o) noexcept
      : transport_(std::exchange(o.transport_, nullptr)),
        block_(std::exchange(o.block_, {})),
        plain_(std::move(o.plain_)) {}
  TransportBuffer& operator=(TransportBuffer&& o) noexcept {
    if (this != &o) {
      release();
      transport_ = std::exchange(o.transport_, nullptr);
      block_ = std::exchange(o.block_, {});
      plain_ = std::move(o.plain_);
    }
    return *this;
  }
  ~TransportBuffer() { release(); }

  std::byte* data() const noexcept { return transport_ ? block_.data() : plain_.data(); }
  std::size_t size() const noexcept { return transport_ ? block_.size() : plain_.size(); }

  template <class T>
  std::span<T> as(std::size_t count) const noexcept {
    return {reinterpret_cast<T*>(data()), count};
  }

 private:
  void release() noexcept {
    if constexpr (TransportAllocator<X>) {
      if (transport_) transport_->deallocate(block_);
    }
    transport_ = nullptr;
    block_ = {};
  }

  X* transport_ = nullptr;  // set when block_ came from it
  std::span<std::byte> block_{};
  AlignedBuffer plain_;
};

}  // namespace gradsync::detail
