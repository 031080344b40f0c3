#pragma once

// This rank's arena (segment.hpp): Boost.Interprocess's best-fit allocator manages a prefix of it
// that grows as allocations need more. The prefix's pages are claimed (Segment::reserve) before
// the allocator may touch them, so neither its bookkeeping nor a block can meet a missing page;
// when claiming fails, or the arena is full, blocks come from ordinary memory instead. Pages once
// claimed stay with the job until it ends (the segment is freed with its last process).

#include <cstddef>
#include <mutex>
#include <optional>
#include <span>

#include <boost/interprocess/managed_external_buffer.hpp>

#include "transport/shm/segment.hpp"

namespace gradsync::transport::shm {

class Arena {
 public:
  static constexpr std::size_t alignment = 64;
  Arena(const shm::Segment& segment, int local_rank);
  std::span<std::byte> allocate(std::size_t bytes);
  void deallocate(std::span<std::byte> block) noexcept;

 private:
  // Claims at least this much more at a time, so that many small blocks grow it rarely.
  static constexpr std::size_t first_claim = std::size_t{64} << 10;
  static constexpr std::size_t least_growth = std::size_t{1} << 20;
  void* from_arena(std::size_t bytes);
  const shm::Segment& segment_;
  const std::span<std::byte> region_;
  const std::size_t at_;  // the region's offset in the segment
  std::mutex mutex_;
  std::optional<boost::interprocess::managed_external_buffer> manager_;
  std::size_t managed_ = 0;  // the prefix of region_ the allocator manages, all of it claimed
};

}  // namespace gradsync::transport::shm
