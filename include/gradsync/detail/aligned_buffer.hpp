#pragma once
// A fixed-size, 64-byte aligned byte buffer: bucket values and encoded scratch live in these, sized
// once when a plan is installed, so the per-step path never allocates.

#include <cstddef>
#include <memory>
#include <new>
#include <span>

namespace gradsync::detail {

class AlignedBuffer {
 public:
  static constexpr std::size_t alignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes)
      : data_(bytes ? static_cast<std::byte*>(::operator new(bytes, std::align_val_t{alignment})) : nullptr),
        size_(bytes) {}

  std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }

  template <class T>
  std::span<T> as(std::size_t count) const noexcept {
    return {reinterpret_cast<T*>(data_.get()), count};
  }

 private:
  struct Release {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{alignment}); }
  };
  std::unique_ptr<std::byte[], Release> data_;
  std::size_t size_ = 0;
};

// Rounds `bytes` up so that consecutive regions stay aligned.
constexpr std::size_t align_up(std::size_t bytes) noexcept {
  return (bytes + AlignedBuffer::alignment - 1) / AlignedBuffer::alignment * AlignedBuffer::alignment;
}

}  // namespace gradsync::detail
