#pragma once
// async::detail::Parts — how a bucket plan cuts the worker's gradient between the servers.
//
// The worker's gradient is the plan's buckets one after another (bucket-major, as the Synchronizer
// packs them). Bucket b is cut into N chunks (topology::Ring::segment), chunk p served by group
// rank p; part p, what server p serves, is its chunks in plan order. A worker pushes a bucket's
// chunks as soon as the bucket is ready, one message each; a server closes an iteration of its
// whole part and answers pulls with it, so the worker keeps what it pulls part by part
// (part-major: the parts one after another, each its chunks in plan order). Empty chunks (a
// bucket of fewer values than servers) are never sent.
//
// Buffers that messages travel in are sized once, for any plan of the same gradients
// (chunk_bound, part_bound): a new plan reallocates none that a transfer may still hold.

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/topology/ring.hpp"
#include "gradsync/types.hpp"

namespace gradsync::async::detail {

// Chunk (b, p) of a plan: where it lies in the bucket-major gradient and in part p.
struct Chunk {
  std::size_t flat = 0;
  std::size_t in_part = 0;
  std::size_t size = 0;
};

class Parts {
 public:
  Parts() = default;

  // The plan's buckets of `bucket_elements` values each, cut between `servers` servers.
  Parts(std::span<const std::size_t> bucket_elements, int servers) : n_(static_cast<std::size_t>(servers)) {
    part_size_.assign(n_, 0);
    for (const std::size_t elements : bucket_elements) {
      bucket_.push_back({elements_, elements_ + elements});
      for (std::size_t p = 0; p < n_; ++p) {
        const ElemRange segment = topology::Ring::segment(elements, servers, static_cast<int>(p));
        chunks_.push_back({.flat = elements_ + segment.begin, .in_part = part_size_[p], .size = segment.size()});
        part_size_[p] += segment.size();
      }
      elements_ += elements;
    }
    std::size_t offset = 0;
    for (const std::size_t size : part_size_) {
      part_offset_.push_back(offset);
      offset += size;
    }
  }

  std::size_t buckets() const noexcept { return bucket_.size(); }
  std::size_t elements() const noexcept { return elements_; }
  ElemRange bucket(std::size_t b) const { return bucket_[b]; }
  const Chunk& chunk(std::size_t b, int p) const { return chunks_[b * n_ + static_cast<std::size_t>(p)]; }
  std::size_t part_size(int p) const { return part_size_[static_cast<std::size_t>(p)]; }
  // Where part p starts in the part-major order.
  std::size_t part_offset(int p) const { return part_offset_[static_cast<std::size_t>(p)]; }

  // The most values one chunk of any plan of `elements` values can hold, and one part of any plan
  // of `gradients` gradients holding them: each bucket's chunk p is at most one value more than
  // its share, and there are at most as many buckets as gradients.
  static std::size_t chunk_bound(std::size_t elements, int servers) {
    return topology::Ring::segment(elements, servers, 0).size();
  }
  static std::size_t part_bound(std::size_t elements, std::size_t gradients, int servers) {
    return std::min(elements, chunk_bound(elements, servers) + gradients);
  }

 private:
  std::size_t n_ = 0;
  std::size_t elements_ = 0;
  std::vector<ElemRange> bucket_;          // by bucket: its values in the bucket-major gradient
  std::vector<Chunk> chunks_;              // by bucket, then part
  std::vector<std::size_t> part_size_;     // by part
  std::vector<std::size_t> part_offset_;   // by part, in the part-major order
};

}  // namespace gradsync::async::detail
