#pragma once
// engine::Gradients — the trainer-facing front every synchronizer stands on: the registered
// gradients and their checks, where each sits in the plan's buckets, the ready marks of the
// iteration (from any thread, allocation-free), the error for gradients never marked, the copies
// between gradients and bucket buffers (host or device memory, 16-bit gradients widened and
// narrowed), and the rank's timeline.
//
// The synchronizer above it owns the buffers and says when an iteration ends; Gradients only keeps
// the per-gradient side. Its life:
//   add() ...     registration, before the first mark;
//   freeze()      the layout is final: marks are sized (the synchronizer's first ready() or wait());
//   place(plan)   every gradient gets its bucket and offset; pending counts are per bucket (again
//                 whenever a new plan is installed, between iterations);
//   mark(id) ...  one per gradient and iteration, from the trainer's threads;
//   next_iteration()  clears the marks.
//
// Over a device transport (DeviceTransport, concepts.hpp) buckets live in device memory and the
// copies are queued on the transport's stream; everything CUDA-specific of the front is here.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/device_gradients.hpp"
#include "gradsync/error.hpp"
#include "gradsync/log.hpp"
#include "gradsync/plan.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/types.hpp"
#if GRADSYNC_HAS_CUDA
#include "gradsync/cuda/codecs.hpp"
#endif

namespace gradsync::engine {

// A bucket as a plan makes it: the dtype its values are reduced in and how many there are.
struct BucketShape {
  DType dtype = DType::f32;
  std::size_t elements = 0;
};

template <TransportPolicy X>
class Gradients {
 public:
  using Clock = std::chrono::steady_clock;

  // Errors name `transport`'s rank; device copies use its stream. It must outlive this.
  explicit Gradients(X& transport) : transport_(transport) {}

  Gradients(const Gradients&) = delete;
  Gradients& operator=(const Gradients&) = delete;

  // Writes the timeline, if there is one: destroy this only once nothing records into it.
  ~Gradients() {
    if (!timeline_) return;
    try {
      timeline_->write();
    } catch (const Error& e) {
      log_line(log_, e.what());  // a destructor must not throw
    }
  }

  // Registers a gradient, with the checks every synchronizer needs; ids are given out from 0. A
  // gradient in CUDA device memory is staged through host memory (detail/device_gradients.hpp), or
  // over a device transport copied on its stream: then it must be f32, f16 or bf16 on the
  // transport's device.
  GradId add(std::string name, TensorView gradient) {
    if (frozen_.load(std::memory_order_acquire))
      throw Error(ErrorKind::invalid_argument, here("add"),
                  fmt::format("add({:?}) after the first ready() or wait(): register every gradient first", name));
    if (gradient.data == nullptr && gradient.count != 0)
      throw Error(ErrorKind::invalid_argument, here("add"), fmt::format("gradient {:?} has no memory", name));
    const bool on_device = gradient.device != Device::cpu();
    if (on_device) detail::check_device_gradient(name, gradient, here("add"));
    if constexpr (DeviceTransport<X>) check_for_device_transport(name, gradient);
    layout_.push_back({std::move(name), gradient.count, gradient.dtype, gradient.device});
    views_.push_back(gradient);
    staging_.push_back(on_device && !DeviceTransport<X> && gradient.dtype != accumulation_dtype(gradient.dtype)
                           ? detail::HostStaging(gradient.bytes())
                           : detail::HostStaging());
    return static_cast<GradId>(layout_.size() - 1);
  }

  const Layout& layout() const noexcept { return layout_; }
  std::size_t size() const noexcept { return layout_.size(); }
  const TensorView& view(GradId id) const { return views_[id]; }
  bool frozen() const noexcept { return frozen_.load(std::memory_order_acquire); }

  // Options' timeline path, else GRADSYNC_TIMELINE: this rank's trace file, `tag` naming it
  // (Timeline::rank_path), written on destruction (a failure to `log`). Call before freeze(), which
  // names the gradients on it.
  void open_timeline(std::string path, std::string_view tag, std::size_t events, LogSink log) {
    if (const char* from_env = std::getenv("GRADSYNC_TIMELINE"); path.empty() && from_env) path = from_env;
    if (path.empty()) return;
    timeline_ = std::make_unique<Timeline>(Timeline::rank_path(path, tag), transport_.rank(), events);
    log_ = std::move(log);
  }
  Timeline* timeline() const noexcept { return timeline_.get(); }

  // The layout is final: the marks are sized. Called once, before the first mark.
  void freeze() {
    const std::size_t n = layout_.size();
    marked_ = std::make_unique<std::atomic<bool>[]>(n);
    ready_at_.resize(n);
    order_.resize(n);
    ready_time_.resize(n);
    if (timeline_) {
      std::vector<std::string> names;
      for (const auto& gradient : layout_) names.push_back(gradient.name);
      timeline_->name_gradients(std::move(names));
    }
    frozen_.store(true, std::memory_order_release);
  }

  // Places every gradient in its bucket of `plan` (one dtype of accumulation per bucket, every
  // gradient exactly once) and returns the buckets' shapes; `invalid(why)` makes the Error for a
  // plan that is not. Between iterations only.
  template <class Invalid>
  std::vector<BucketShape> place(const BucketPlan& plan, Invalid&& invalid) {
    std::vector<Slot> slots(layout_.size());
    std::vector<bool> placed(layout_.size());
    std::vector<BucketShape> shapes(plan.buckets.size());
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const auto& ids = plan.buckets[b];
      if (ids.empty()) throw invalid(fmt::format("bucket {} is empty", b));
      BucketShape& shape = shapes[b];
      shape.dtype = accumulation_dtype(ids.front() < layout_.size() ? layout_[ids.front()].dtype : DType::f32);
      for (GradId id : ids) {
        if (id >= layout_.size()) throw invalid(fmt::format("bucket {} names gradient id {}", b, id));
        if (placed[id]) throw invalid(fmt::format("gradient {:?} is in more than one bucket", layout_[id].name));
        if (accumulation_dtype(layout_[id].dtype) != shape.dtype)
          throw invalid(fmt::format("bucket {} mixes {} and {} accumulation", b, to_string(shape.dtype),
                                    to_string(accumulation_dtype(layout_[id].dtype))));
        placed[id] = true;
        slots[id] = {static_cast<std::uint32_t>(b), shape.elements};
        shape.elements += layout_[id].count;
      }
    }
    for (std::size_t id = 0; id < layout_.size(); ++id)
      if (!placed[id]) throw invalid(fmt::format("gradient {:?} is in no bucket", layout_[id].name));
    slots_ = std::move(slots);
    bucket_sizes_.clear();
    for (const auto& ids : plan.buckets) bucket_sizes_.push_back(static_cast<std::uint32_t>(ids.size()));
    pending_ = std::make_unique<std::atomic<std::uint32_t>[]>(bucket_sizes_.size());
    for (std::size_t b = 0; b < bucket_sizes_.size(); ++b) pending_[b].store(bucket_sizes_[b], std::memory_order_relaxed);
#if GRADSYNC_HAS_CUDA
    if constexpr (DeviceTransport<X>) default_stream_marks_ = std::make_unique<cuda::Event[]>(bucket_sizes_.size());
#endif
    return shapes;
  }

  std::uint32_t bucket_of(GradId id) const { return slots_[id].bucket; }
  // Whether every gradient of a bucket that holds exactly `id` lies in host memory in its
  // accumulation dtype, so that it can be reduced where it lies.
  bool reducible_in_place(GradId id) const {
    return !DeviceTransport<X> && views_[id].device == Device::cpu() && layout_[id].dtype == accumulation_dtype(layout_[id].dtype);
  }

  struct Marked {
    std::uint32_t bucket = 0;
    bool bucket_complete = false;  // this was its bucket's last gradient
    bool first = false;            // and the iteration's first mark (which arms bucketing timers)
  };

  // Gradient `id` holds iteration `iteration`'s local value. Thread-safe; allocation-free.
  Marked mark(GradId id, std::uint64_t iteration) {
    if (id >= layout_.size())
      throw Error(ErrorKind::invalid_argument, here("ready"),
                  fmt::format("no gradient has id {} ({} registered)", id, layout_.size()));
    const std::uint32_t bucket = slots_[id].bucket;
    if (marked_[id].exchange(true, std::memory_order_acq_rel))
      throw Error(ErrorKind::invalid_argument, here("ready", bucket),
                  fmt::format("gradient {:?} (id {}) was marked ready twice in iteration {}; call wait() before "
                              "starting the next iteration",
                              layout_[id].name, id, iteration));
    if (timeline_) timeline_->record(Timeline::Kind::ready, Timeline::now(), bucket, id);
    const auto now = Clock::now();
    ready_at_[id] = now;
    std::int64_t none = 0;
    first_ready_.compare_exchange_strong(none, now.time_since_epoch().count());
#if GRADSYNC_HAS_CUDA
    // A device gradient may still be computed on the default stream (the host path's blocking
    // copies wait for that work too). Its bucket's packing must follow what was queued there by
    // now, so the mark is recorded here, on the trainer's thread, before the bucket can go: the
    // last mark of several threads to record it is the latest on that stream, covering all.
    if constexpr (DeviceTransport<X>) default_stream_marks_[bucket].record_default_stream(transport_.cuda_stream().device());
#endif
    const std::uint32_t position = order_size_.fetch_add(1, std::memory_order_acq_rel);
    order_[position] = id;
    const bool complete = pending_[bucket].fetch_sub(1, std::memory_order_acq_rel) == 1;
    return {bucket, complete, position == 0};
  }

  bool bucket_complete(std::size_t b) const { return pending_[b].load(std::memory_order_acquire) == 0; }
  bool all_marked() const { return order_size_.load(std::memory_order_acquire) == layout_.size(); }
  bool any_marked() const { return order_size_.load(std::memory_order_acquire) > 0; }
  // When the iteration's first mark came; nullopt before it.
  std::optional<Clock::time_point> first_ready() const {
    const std::int64_t first = first_ready_.load(std::memory_order_acquire);
    if (first == 0) return std::nullopt;
    return Clock::time_point(Clock::duration(first));
  }
  Clock::time_point last_ready() const { return *std::max_element(ready_at_.begin(), ready_at_.end()); }
  // When gradients `ids` were all marked this iteration (once they are).
  Clock::time_point last_ready(std::span<const GradId> ids) const {
    Clock::time_point last{};
    for (GradId id : ids) last = std::max(last, ready_at_[id]);
    return last;
  }

  // The iteration's marks as a bucketing policy learns from them. Once every gradient is marked.
  ReadyProfile profile(std::uint64_t iteration, const LogSink* log) {
    const Clock::time_point start = first_ready().value_or(Clock::now());
    for (std::size_t id = 0; id < layout_.size(); ++id) ready_time_[id] = ready_at_[id] - start;
    return {iteration, layout_, ready_time_, std::span<const GradId>(order_.data(), order_size_.load()), log};
  }

  // The Error for wait() called with gradients not marked: the first few named, and a bucket.
  Error never_ready(std::uint64_t iteration) const {
    std::string missing;
    std::size_t count = 0;
    std::optional<std::uint32_t> bucket;
    for (std::size_t id = 0; id < layout_.size(); ++id) {
      if (marked_[id].load()) continue;
      if (count++ < 5) missing += fmt::format("{}{:?} (id {})", missing.empty() ? "" : ", ", layout_[id].name, id);
      if (!bucket) bucket = slots_[id].bucket;
    }
    if (count > 5) missing += fmt::format(" and {} more", count - 5);
    return Error(ErrorKind::invalid_argument, here("wait", bucket),
                 fmt::format("iteration {}: wait() was called with {} of {} gradients never marked ready on this "
                             "rank: {}",
                             iteration, count, layout_.size(), missing));
  }

  // Clears the marks for the next iteration (nobody marks meanwhile).
  void next_iteration() {
    for (std::size_t id = 0; id < layout_.size(); ++id) marked_[id].store(false, std::memory_order_relaxed);
    for (std::size_t b = 0; b < bucket_sizes_.size(); ++b) pending_[b].store(bucket_sizes_[b], std::memory_order_relaxed);
    order_size_.store(0, std::memory_order_relaxed);
    first_ready_.store(0, std::memory_order_release);
  }

  // The gradients `ids` of bucket `b` into its buffer `values`, each at its offset: over a device
  // transport copies (for 16-bit gradients widening kernels) queued on its stream after what the
  // default stream held at their marks, else detail::load_gradient.
  template <class V>
  void pack(std::size_t b, std::span<const GradId> ids, std::span<V> values) {
#if GRADSYNC_HAS_CUDA
    if constexpr (DeviceTransport<X>) {
      default_stream_marks_[b].order_before(transport_.cuda_stream());
      for (GradId id : ids) {
        const TensorView& g = views_[id];
        const std::span<V> into = values.subspan(slots_[id].offset, g.count);
        if constexpr (std::is_same_v<V, float>)  // the only buckets there (check_for_device_transport)
          if (g.dtype != DType::f32) {
            cuda::widen(g.data, g.dtype, into.data(), into.size(), transport_.cuda_stream());
            continue;
          }
        cuda::copy(into.data(), g.data, into.size_bytes(), transport_.cuda_stream());
      }
      return;
    }
#endif
    (void)b;
    for (GradId id : ids) detail::load_gradient<V>(views_[id], values.subspan(slots_[id].offset, views_[id].count), staging_[id]);
  }

  // Bucket values back into their gradients `ids`. Over a device transport the copies (narrowing
  // kernels for 16-bit gradients) are queued on its stream and waited for, so the gradients hold
  // their values, and the stream's work is done, on return.
  template <class V>
  void unpack(std::span<const GradId> ids, std::span<V> values) {
    for (GradId id : ids) {
      const TensorView& g = views_[id];
      const std::span<const V> from = values.subspan(slots_[id].offset, g.count);
#if GRADSYNC_HAS_CUDA
      if constexpr (DeviceTransport<X>) {
        if constexpr (std::is_same_v<V, float>)
          if (g.dtype != DType::f32) {
            cuda::narrow(from.data(), g.dtype, g.data, from.size(), transport_.cuda_stream());
            continue;
          }
        cuda::copy(g.data, from.data(), from.size_bytes(), transport_.cuda_stream());
        continue;
      }
#endif
      detail::store_gradient<V>(from, g, staging_[id]);
    }
#if GRADSYNC_HAS_CUDA
    if constexpr (DeviceTransport<X>) transport_.cuda_stream().synchronize();
#endif
  }

 private:
  struct Slot {
    std::uint32_t bucket = 0;
    std::size_t offset = 0;  // first element in the bucket's buffer
  };

  ErrorContext here(std::string operation, std::optional<std::uint32_t> bucket = std::nullopt) const {
    return {.rank = transport_.rank(), .bucket = bucket, .operation = std::move(operation)};
  }

  // add()'s checks for a device transport: the gradient is f32, f16 or bf16 (f32 buckets) in the
  // memory of its device.
  void check_for_device_transport(const std::string& name, const TensorView& gradient) {
#if GRADSYNC_HAS_CUDA
    const int device = transport_.cuda_stream().device();
    if (gradient.device != Device::cuda(device))
      throw Error(ErrorKind::invalid_argument, here("add"),
                  fmt::format("gradient {:?} is on {}; over {} every gradient must be in the memory of cuda:{}",
                              name, to_string(gradient.device), transport_.describe(), device));
    if (accumulation_dtype(gradient.dtype) != DType::f32)
      throw Error(ErrorKind::unsupported, here("add"),
                  fmt::format("gradient {:?} is {}; over {} gradients are f32, f16 or bf16 (the device path "
                              "reduces in f32 only)",
                              name, to_string(gradient.dtype), transport_.describe()));
#else
    (void)name, (void)gradient;
#endif
  }

  X& transport_;
  Layout layout_;
  std::vector<TensorView> views_;
  std::vector<detail::HostStaging> staging_;  // by gradient: for 16-bit device gradients
  std::atomic<bool> frozen_{false};
  std::unique_ptr<Timeline> timeline_;
  LogSink log_;  // where a timeline that cannot be written says so

  std::vector<Slot> slots_;                  // by gradient
  std::vector<std::uint32_t> bucket_sizes_;  // by bucket: its gradients
  // Written by mark() (any thread), read by the synchronizer's thread.
  std::unique_ptr<std::atomic<std::uint32_t>[]> pending_;  // by bucket: gradients not yet marked
  std::unique_ptr<std::atomic<bool>[]> marked_;            // by gradient
#if GRADSYNC_HAS_CUDA
  std::unique_ptr<cuda::Event[]> default_stream_marks_;  // by bucket, device transports: mark()'s
#endif
  std::vector<Clock::time_point> ready_at_;
  std::vector<GradId> order_;
  std::atomic<std::uint32_t> order_size_{0};
  std::atomic<std::int64_t> first_ready_{0};  // steady_clock ticks of the iteration's first mark; 0 = none
  std::vector<Duration> ready_time_;          // profile()'s
};

}  // namespace gradsync::engine
