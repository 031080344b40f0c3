#pragma once
// Gradients in CUDA device memory, staged through host memory: the Synchronizer copies each one
// into its bucket when the bucket is packed and back when its average is ready, converting 16-bit
// gradients on the host as detail::load/store do (convert.hpp), so the results are the host
// path's bits. The copies are blocking, on the device's legacy default stream (cuda/memory.hpp):
// a gradient must be complete, or queued on that stream, when ready() is called for it, and holds
// its average when wait() returns. Where gradsync was built without CUDA (GRADSYNC_HAS_CUDA),
// such a gradient is refused when it is added.

#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "gradsync/detail/aligned_buffer.hpp"
#include "gradsync/detail/convert.hpp"
#include "gradsync/error.hpp"
#include "gradsync/types.hpp"
#include "gradsync/version.hpp"
#if GRADSYNC_HAS_CUDA
#include "gradsync/cuda/memory.hpp"
#endif

namespace gradsync::detail {

// Throws unless `g`, said to be on a CUDA device, can be synchronized.
inline void check_device_gradient(const std::string& name, const TensorView& g, const ErrorContext& where) {
#if GRADSYNC_HAS_CUDA
  if (g.count != 0 && !cuda::on_device(g.data, g.device.index))
    throw Error(ErrorKind::invalid_argument, where,
                fmt::format("gradient {:?} is said to be on {}, but its memory is not that device's", name,
                            to_string(g.device)));
#else
  throw Error(ErrorKind::unsupported, where,
              fmt::format("gradient {:?} is on {}; this build of gradsync has no CUDA (built without nvcc)", name,
                          to_string(g.device)));
#endif
}

// Host memory page-locked for the device copies while it lives (nothing without CUDA, or where
// the system refuses: the copies then go through the driver's own staging, slower).
class PinnedRange {
 public:
  PinnedRange() = default;
  PinnedRange(void* p, std::size_t bytes) {
#if GRADSYNC_HAS_CUDA
    if (p && cuda::pin(p, bytes)) p_ = p;
#else
    (void)p, (void)bytes;
#endif
  }
  PinnedRange(PinnedRange&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  PinnedRange& operator=(PinnedRange&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~PinnedRange() {
#if GRADSYNC_HAS_CUDA
    if (p_) cuda::unpin(p_);
#endif
  }

 private:
  void* p_ = nullptr;
};

// Where a device gradient whose dtype is not its accumulation dtype (f16, bf16) lands on the host
// before it is widened, and is narrowed into before it goes back; sized when it is added.
struct HostStaging {
  AlignedBuffer buffer;
  PinnedRange pinned;

  HostStaging() = default;
  explicit HostStaging(std::size_t bytes) : buffer(bytes), pinned(buffer.data(), bytes) {}
  TensorView view(const TensorView& g) const { return {buffer.data(), g.count, g.dtype, Device::cpu()}; }
};

// detail::load, wherever `g` lives.
template <class V>
void load_gradient(const TensorView& g, std::span<V> out, const HostStaging& staging) {
  if (g.device == Device::cpu()) return load<V>(g, out);
#if GRADSYNC_HAS_CUDA
  if (size_of(g.dtype) == sizeof(V)) return cuda::copy_to_host(out.data(), g.data, g.bytes(), g.device.index);
  cuda::copy_to_host(staging.buffer.data(), g.data, g.bytes(), g.device.index);
  load<V>(staging.view(g), out);
#else
  (void)staging;
#endif
}

// detail::store, wherever `g` lives.
template <class V>
void store_gradient(std::span<const V> in, const TensorView& g, const HostStaging& staging) {
  if (g.device == Device::cpu()) return store<V>(in, g);
#if GRADSYNC_HAS_CUDA
  if (size_of(g.dtype) == sizeof(V)) return cuda::copy_to_device(g.data, in.data(), g.bytes(), g.device.index);
  store<V>(in, staging.view(g));
  cuda::copy_to_device(g.data, staging.buffer.data(), g.bytes(), g.device.index);
#else
  (void)staging;
#endif
}

}  // namespace gradsync::detail
