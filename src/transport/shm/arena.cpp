// shm::Arena (arena.hpp): a rank's blocks in the segment, or in ordinary memory when it is full.

#include "transport/shm/arena.hpp"

#include <algorithm>
#include <new>

namespace gradsync::transport::shm {

namespace ipc = boost::interprocess;

Arena::Arena(const shm::Segment& segment, int local_rank)
    : segment_(segment),
      region_(segment.arena(local_rank)),
      at_(static_cast<std::size_t>(region_.data() - segment.base())) {
  const std::size_t first = std::min(first_claim, region_.size());
  if (first < ipc::managed_external_buffer::segment_manager::get_min_size() || !segment_.reserve(at_, first)) return;
  manager_.emplace(ipc::create_only, region_.data(), first);
  managed_ = first;
}

std::span<std::byte> Arena::allocate(std::size_t bytes) {
  if (bytes == 0) return {};
  {
    std::lock_guard lock(mutex_);
    if (void* p = from_arena(bytes)) return {static_cast<std::byte*>(p), bytes};
  }
  return {static_cast<std::byte*>(::operator new(bytes, std::align_val_t{alignment})), bytes};
}

void Arena::deallocate(std::span<std::byte> block) noexcept {
  if (block.data() == nullptr) return;
  if (block.data() >= region_.data() && block.data() < region_.data() + region_.size()) {
    std::lock_guard lock(mutex_);
    manager_->get_segment_manager()->deallocate(block.data());
  } else {
    ::operator delete(block.data(), std::align_val_t{alignment});
  }
}

void* Arena::from_arena(std::size_t bytes) {
  if (!manager_) return nullptr;
  auto* manager = manager_->get_segment_manager();
  if (void* p = manager->allocate_aligned(bytes, alignment, std::nothrow)) return p;
  // Grow the managed prefix by the block, its alignment and the allocator's headers; the new
  // space joins the free block at the end, if there is one.
  const std::size_t room = region_.size() - managed_;
  if (bytes > room) return nullptr;
  const std::size_t wanted = (bytes + alignment + 2 * shm::page_bytes - 1) / shm::page_bytes * shm::page_bytes;
  const std::size_t extra = std::min(room, std::max(least_growth, wanted));
  if (!segment_.reserve(at_ + managed_, extra)) return nullptr;
  manager_->grow(extra);
  managed_ += extra;
  return manager->allocate_aligned(bytes, alignment, std::nothrow);
}

}  // namespace gradsync::transport::shm
