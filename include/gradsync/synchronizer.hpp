#pragma once
// Synchronizer<Bucketing, Compression, Topology, Transport> — where the four policies meet.
//
// The life of an iteration:
//   ready(id)   from any thread, as backward produces gradient `id`. When the last gradient of a
//               bucket arrives, the communication thread is woken.
//   the communication thread takes buckets strictly in plan order (the same on every rank, which
//               is what keeps ranks from waiting on each other crosswise), copies the bucket's
//               gradients into its flat buffer and starts the topology's schedule with the codec
//               over the transport on the executor (Options::executor): the task graph runs it
//               on its own threads, several buckets at once, and writes the averages back as each
//               bucket completes; the serial executor runs it on this thread, bucket by bucket.
//               All of it while backward goes on.
//   wait()      returns once every bucket is done, and readies the next iteration.
//
// At the first synchronization the ranks exchange their layouts and policy settings, and stop
// with an Error on every rank if anything differs. Plans proposed by the bucketing policy are
// agreed (rank 0's wins) at iteration boundaries. Buffers are sized whenever a plan is installed;
// ready(), the exchange and wait() allocate nothing.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/aligned_buffer.hpp"
#include "gradsync/detail/convert.hpp"
#include "gradsync/detail/layout_check.hpp"
#include "gradsync/engine/cost_model.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/engine/task_graph.hpp"
#include "gradsync/options.hpp"

namespace gradsync {

template <BucketingPolicy B, CompressionPolicy C, TopologyPolicy T, TransportPolicy X>
class Synchronizer {
 public:
  using Bucketing = B;
  using Compression = C;
  using Topology = T;
  using Transport = X;

  explicit Synchronizer(X transport, Options options = {}, B bucketing = {}, C codec = {}, T topology = {})
      : transport_(std::move(transport)),
        options_(options),
        bucketing_(std::move(bucketing)),
        codec_(std::move(codec)),
        topology_(std::move(topology)),
        group_(Group::world(transport_.rank(), transport_.size())) {
    if (options_.compute_threads < 1)
      throw Error(ErrorKind::invalid_argument, here("options"),
                  fmt::format("compute_threads is {}; the task graph needs at least 1", options_.compute_threads));
    if (options_.selective_compression && !selective_topology)
      throw Error(ErrorKind::unsupported, here("options"),
                  fmt::format("selective compression needs a topology with shape() and chunk_elements; {} has not",
                              topology_.describe()));
    if (options_.coordination.enabled && options_.executor != Executor::task_graph)
      throw Error(ErrorKind::invalid_argument, here("options"), "coordinated sends need the task-graph executor");
    if (options_.coordination.enabled && options_.coordination.window < 1)
      throw Error(ErrorKind::invalid_argument, here("options"),
                  fmt::format("coordination window is {}; at least one batch per link must be allowed",
                              options_.coordination.window));
  }

  Synchronizer(const Synchronizer&) = delete;
  Synchronizer& operator=(const Synchronizer&) = delete;

  // Stops the communication thread. Destroyed in the middle of an iteration, it aborts the
  // transport so that the other ranks fail fast instead of waiting for it.
  ~Synchronizer() {
    if (!thread_.joinable()) return;
    bool mid_iteration;
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      mid_iteration = !error_ && (!idle_ || (order_size_.load() > 0 && !done_));
    }
    if (mid_iteration)
      transport_.abort(Error(ErrorKind::peer_failed, here("shutdown"),
                             fmt::format("the Synchronizer was destroyed during iteration {}", iteration_.load())));
    work_cv_.notify_all();
    thread_.join();
  }

  // Registers a gradient; ids are given out in order from 0. Every rank must register the same
  // gradients (name, size, dtype) in the same order, before its first ready() or wait().
  GradId add(std::string name, TensorView gradient) {
    if (frozen_.load())
      throw Error(ErrorKind::invalid_argument, here("add"),
                  fmt::format("add({:?}) after the first ready() or wait(): register every gradient first", name));
    if (gradient.device != Device::cpu())
      throw Error(ErrorKind::unsupported, here("add"),
                  fmt::format("gradient {:?} is on {}; this build synchronizes CPU memory only", name,
                              to_string(gradient.device)));
    if (gradient.data == nullptr && gradient.count != 0)
      throw Error(ErrorKind::invalid_argument, here("add"), fmt::format("gradient {:?} has no memory", name));
    layout_.push_back({std::move(name), gradient.count, gradient.dtype, gradient.device});
    views_.push_back(gradient);
    return static_cast<GradId>(layout_.size() - 1);
  }

  // Marks gradient `id` as holding this iteration's local value. Thread-safe; allocation-free.
  void ready(GradId id) {
    if (failed_.load(std::memory_order_acquire)) rethrow();
    freeze();
    if (id >= layout_.size())
      throw Error(ErrorKind::invalid_argument, here("ready"),
                  fmt::format("no gradient has id {} ({} registered)", id, layout_.size()));
    if (marked_[id].exchange(true, std::memory_order_acq_rel))
      throw Error(ErrorKind::invalid_argument, here("ready", slots_[id].bucket),
                  fmt::format("gradient {:?} (id {}) was marked ready twice in iteration {}; call wait() before "
                              "starting the next iteration",
                              layout_[id].name, id, iteration_.load()));
    const auto now = std::chrono::steady_clock::now();
    ready_at_[id] = now;
    std::int64_t none = 0;
    first_ready_.compare_exchange_strong(none, now.time_since_epoch().count());
    const std::uint32_t position = order_size_.fetch_add(1, std::memory_order_acq_rel);
    order_[position] = id;
    const bool bucket_complete = pending_[slots_[id].bucket].fetch_sub(1, std::memory_order_acq_rel) == 1;
    if (bucket_complete || position == 0) {  // the first ready() arms bucketing timers
      std::lock_guard lock(mutex_);
      work_cv_.notify_all();
    }
  }

  // Blocks until every gradient holds the average over the contributing ranks (all of them, unless
  // the topology has dedicated servers), then readies the next
  // iteration. Throws the Error that stopped synchronization, on this rank or another.
  void wait() {
    freeze();
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + options_.timeout;
    std::unique_lock lock(mutex_);
    bool past_deadline = false;
    for (;;) {
      if (error_) throw_when_released(lock);
      if (done_) break;
      if (past_deadline) {
        // Every gradient was marked ready: the exchange's own timeouts will end this wait.
        done_cv_.wait(lock);
      } else if (done_cv_.wait_until(lock, deadline) == std::cv_status::timeout && !done_ && !error_) {
        past_deadline = true;
        if (order_size_.load() < layout_.size()) {
          const Error e = never_ready_error();
          lock.unlock();
          fail(e);
          lock.lock();
        }
      }
    }
    next_iteration(std::chrono::steady_clock::now() - start);
  }

  // The non-blocking form of wait(): true (and the next iteration readied) once every gradient
  // holds the average; false while the exchange is still running.
  bool try_wait() {
    freeze();
    std::unique_lock lock(mutex_);
    if (error_) throw_when_released(lock);
    if (!done_) return false;
    next_iteration(std::chrono::nanoseconds{0});
    return true;
  }

  int rank() const noexcept { return transport_.rank(); }
  int size() const noexcept { return transport_.size(); }
  const Layout& layout() const noexcept { return layout_; }
  // The plan in use; read it between wait() and the next ready().
  const BucketPlan& plan() const noexcept { return plan_; }
  const IterationStats& last_iteration() const noexcept { return last_stats_; }
  const B& bucketing() const noexcept { return bucketing_; }

 private:
  // Whether the topology tells selective compression its pipeline and lets it choose the pieces.
  static constexpr bool selective_topology = requires(T t, const Group& g, std::size_t n) {
    { t.shape(g, n) } -> std::same_as<PipelineShape>;
    t.chunk_elements = n;
  };

  struct Slot {
    std::uint32_t bucket = 0;
    std::size_t offset = 0;  // first element in the bucket's buffer
  };

  struct Bucket {
    DType dtype = DType::f32;  // accumulation dtype
    std::size_t elements = 0;
    // A bucket of one gradient already in its accumulation dtype is reduced where it lies,
    // saving a copy in and a copy out; otherwise gradients are packed into `values`.
    bool in_place = false;
    detail::AlignedBuffer values;
    engine::BucketExchange<C, X> exchange;
  };

  // Control messages: each is a size, then a payload (message id + 1).
  enum ControlMessage : std::uint32_t {
    layout_message = 0,
    verdict_message = 2,
    plan_message = 4,
    calibration_message = 6,  // then 8, 9, ... for the transfer probes
  };
  static constexpr std::uint64_t max_control_bytes = std::uint64_t{64} << 20;

  ErrorContext here(std::string operation, std::optional<std::uint32_t> bucket = std::nullopt) const {
    return {.rank = rank(), .bucket = bucket, .operation = std::move(operation)};
  }

  [[noreturn]] void rethrow() {
    std::unique_lock lock(mutex_);
    throw_when_released(lock);
  }

  // The first ready() or wait(): the layout is final, so the plan is built and the thread started.
  void freeze() {
    if (frozen_.load(std::memory_order_acquire)) return;
    std::call_once(freeze_once_, [&] {
      const std::size_t n = layout_.size();
      marked_ = std::make_unique<std::atomic<bool>[]>(n);
      ready_at_.resize(n);
      order_.resize(n);
      ready_time_.resize(n);
      if (options_.executor == Executor::task_graph)
        engine_ = std::make_unique<engine::TaskGraph<C, X>>(
            transport_, codec_, group_, options_.compute_threads, options_.timeout,
            typename engine::TaskGraph<C, X>::Hooks{.bucket_done = [this](std::uint32_t b) { copy_back(b); },
                                                    .failed = [this] {
                                                      std::lock_guard lock(mutex_);
                                                      engine_failed_ = true;
                                                      work_cv_.notify_all();
                                                    }},
            options_.coordination);
      install(bucketing_.initial_plan(layout_));
      thread_ = std::thread([this] { communicate_then_exit(); });
      frozen_.store(true, std::memory_order_release);
    });
  }

  // Checks a plan and sizes everything it needs; the only place buffers are allocated.
  void install(BucketPlan plan) {
    const auto invalid = [&](std::string why) {
      return Error(ErrorKind::invalid_argument, here("plan"),
                   fmt::format("bucketing policy {} produced an invalid plan: {}", bucketing_.describe(), why));
    };
    if (plan.buckets.size() > engine::max_buckets)
      throw invalid(fmt::format("{} buckets, at most {} are supported", plan.buckets.size(), engine::max_buckets));
    std::vector<Slot> slots(layout_.size());
    std::vector<bool> placed(layout_.size());
    std::vector<Bucket> buckets(plan.buckets.size());
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const auto& ids = plan.buckets[b];
      if (ids.empty()) throw invalid(fmt::format("bucket {} is empty", b));
      Bucket& bucket = buckets[b];
      bucket.dtype = accumulation_dtype(ids.front() < layout_.size() ? layout_[ids.front()].dtype : DType::f32);
      for (GradId id : ids) {
        if (id >= layout_.size()) throw invalid(fmt::format("bucket {} names gradient id {}", b, id));
        if (placed[id]) throw invalid(fmt::format("gradient {:?} is in more than one bucket", layout_[id].name));
        if (accumulation_dtype(layout_[id].dtype) != bucket.dtype)
          throw invalid(fmt::format("bucket {} mixes {} and {} accumulation", b, to_string(bucket.dtype),
                                    to_string(accumulation_dtype(layout_[id].dtype))));
        placed[id] = true;
        slots[id] = {static_cast<std::uint32_t>(b), bucket.elements};
        bucket.elements += layout_[id].count;
      }
      bucket.in_place = ids.size() == 1 && layout_[ids.front()].dtype == bucket.dtype;
      if (!bucket.in_place) bucket.values = detail::AlignedBuffer(bucket.elements * size_of(bucket.dtype));
      bucket.exchange = exchange_for(b, bucket);
    }
    for (std::size_t id = 0; id < layout_.size(); ++id)
      if (!placed[id]) throw invalid(fmt::format("gradient {:?} is in no bucket", layout_[id].name));
    plan_ = std::move(plan);
    slots_ = std::move(slots);
    buckets_ = std::move(buckets);
    pending_ = std::make_unique<std::atomic<std::uint32_t>[]>(buckets_.size());
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      pending_[b].store(static_cast<std::uint32_t>(plan_.buckets[b].size()), std::memory_order_relaxed);
    hand_to_engine();
  }

  void hand_to_engine() {
    log_decisions();
    if (!engine_) return;
    std::vector<engine::BucketExchange<C, X>*> exchanges;
    for (Bucket& bucket : buckets_) exchanges.push_back(&bucket.exchange);
    engine_->install(exchanges);
  }

  // Bucket `b`'s schedule: compressed, unless selective compression has a cost model that says
  // sending it as it is would be faster; then also cut into the pieces the model chose.
  engine::BucketExchange<C, X> exchange_for(std::size_t b, const Bucket& bucket) {
    if constexpr (selective_topology) {
      if (costs_) {
        const PipelineShape shape = topology_.shape(group_, bucket.elements);
        const engine::Decision d = engine::decide(*costs_, shape, size_of(bucket.dtype), [&](std::size_t e) {
          return codec_.max_encoded_bytes(e, bucket.dtype);
        });
        T topology = topology_;
        topology.chunk_elements = std::max<std::size_t>(1, (shape.segment_elements + d.pieces - 1) / d.pieces);
        decisions_ += fmt::format("\n  bucket {}: {:.2f} MB {}, {} piece{} per segment, predicted {:.2f} ms ({:.2f} ms uncompressed)",
                                  b, static_cast<double>(bucket.elements * size_of(bucket.dtype)) / 1e6,
                                  d.compress ? "compressed" : "uncompressed", d.pieces, d.pieces == 1 ? "" : "s",
                                  d.predicted * 1e3, d.uncompressed * 1e3);
        return engine::BucketExchange<C, X>(
            topology.schedule(group_, bucket.elements, d.compress ? codec_traits<C>() : CodecTraits{.identity = true}),
            codec_, bucket.dtype, !d.compress && !C::identity);
      }
    }
    return engine::BucketExchange<C, X>(topology_.schedule(group_, bucket.elements, codec_traits<C>()), codec_,
                                        bucket.dtype);
  }

  void log_decisions() {
    if (!decisions_.empty() && rank() == 0)
      std::fputs(fmt::format("gradsync selective compression ({}): {}{}\n", codec_.describe(), costs_->describe(),
                             decisions_)
                     .c_str(),
                 stderr);
    decisions_.clear();
  }

  void communicate() {
    try {
      exchange_layouts();
      if (options_.selective_compression && !C::identity && size() > 1) {
        costs_ = calibrate();
        for (std::size_t b = 0; b < buckets_.size(); ++b) buckets_[b].exchange = exchange_for(b, buckets_[b]);
        hand_to_engine();
      }
      for (std::uint64_t iteration = 0;; ++iteration) {
        for (std::size_t b = 0; b < buckets_.size(); ++b) {
          if (!wait_for_bucket(b)) return;
          if (buckets_[b].dtype == DType::f64)
            synchronize_bucket<double>(b, iteration);
          else
            synchronize_bucket<float>(b, iteration);
        }
        if (engine_) tally(engine_->finish());
        end_iteration(iteration);
        std::unique_lock lock(mutex_);
        done_ = true;
        done_cv_.notify_all();
        const std::uint64_t generation = generation_;
        idle_ = true;  // until the next bucket (or agreement) gives it work
        work_cv_.wait(lock, [&] { return stop_ || generation_ != generation; });
        if (stop_) return;
      }
    } catch (const Error& e) {
      // Every rank learns of a layout mismatch from the same verdict; aborting the transport
      // would only turn the others' clear message into "peer failed".
      fail(e, e.kind() != ErrorKind::mismatch);
    } catch (const std::exception& e) {
      fail(Error(ErrorKind::internal, here("communication thread"), e.what()));
    }
  }

  // The communication thread's whole life: it marks its exit so that wait() never returns an
  // error while the thread may still touch the caller's gradients.
  void communicate_then_exit() {
    communicate();
    std::lock_guard lock(mutex_);
    exited_ = true;
    done_cv_.notify_all();
  }

  // Called with the lock held, once an error is recorded.
  [[noreturn]] void throw_when_released(std::unique_lock<std::mutex>& lock) {
    done_cv_.wait(lock, [&] { return exited_; });
    throw *error_;
  }

  // Sleeps until bucket `b` is complete, waking for the bucketing policy's deadline on the way.
  bool wait_for_bucket(std::size_t b) {
    std::unique_lock lock(mutex_);
    idle_ = true;
    bool late_reported = false;
    for (;;) {
      if (stop_) return false;
      if (engine_failed_) {  // finish() throws the engine's error once its threads are quiet
        lock.unlock();
        engine_->finish();
        lock.lock();
      }
      if (pending_[b].load(std::memory_order_acquire) == 0) break;
      const std::int64_t first = first_ready_.load(std::memory_order_acquire);
      const auto expected = late_reported || first == 0 ? std::nullopt : bucketing_.expected_ready(b);
      if (!expected) {
        work_cv_.wait(lock);
        continue;
      }
      const auto start = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(first));
      if (work_cv_.wait_until(lock, start + *expected) == std::cv_status::timeout &&
          pending_[b].load(std::memory_order_acquire) != 0) {
        late_reported = true;
        bucketing_.on_late(b, std::chrono::steady_clock::now() - start);
      }
    }
    idle_ = false;
    return true;
  }

  // Packs bucket `b` and runs it (serial) or starts it (task graph, which calls copy_back(b)).
  template <class V>
  void synchronize_bucket(std::size_t b, std::uint64_t iteration) {
    Bucket& bucket = buckets_[b];
    const auto values = bucket_values<V>(b);
    if (!bucket.in_place) {
      const auto started = std::chrono::steady_clock::now();
      for (GradId id : plan_.buckets[b]) detail::load<V>(views_[id], values.subspan(slots_[id].offset, layout_[id].count));
      stats_.compute += std::chrono::steady_clock::now() - started;
    }
    if (engine_) return engine_->start(static_cast<std::uint32_t>(b), values, iteration);
    tally(bucket.exchange.run(values, codec_, transport_,
                              {group_, iteration, static_cast<std::uint32_t>(b), options_.timeout}));
    const auto started = std::chrono::steady_clock::now();
    copy_back(b);
    stats_.compute += std::chrono::steady_clock::now() - started;
  }

  template <class V>
  std::span<V> bucket_values(std::size_t b) {
    Bucket& bucket = buckets_[b];
    if (bucket.in_place) return {static_cast<V*>(views_[plan_.buckets[b].front()].data), bucket.elements};
    return bucket.values.template as<V>(bucket.elements);
  }

  // Writes bucket `b`'s averages into its gradients (nothing to do for a bucket reduced in place).
  void copy_back(std::size_t b) {
    if (buckets_[b].in_place) return;
    const auto store = [&](auto values) {
      using V = typename decltype(values)::value_type;
      for (GradId id : plan_.buckets[b])
        detail::store<V>(std::span<const V>(values.subspan(slots_[id].offset, layout_[id].count)), views_[id]);
    };
    if (buckets_[b].dtype == DType::f64)
      store(bucket_values<double>(b));
    else
      store(bucket_values<float>(b));
  }

  void tally(const engine::ExchangeStats& e) {
    stats_.bytes_sent += e.bytes_sent;
    stats_.bytes_uncompressed += e.bytes_uncompressed;
    stats_.compute += e.compute;
    stats_.waiting += e.waiting;
    stats_.queued += e.queued;
    stats_.in_flight += e.in_flight;
    stats_.control_bytes += e.control_bytes;
    stats_.awaiting_grant += e.awaiting_grant;
  }

  // Hands this iteration's timings to the bucketing policy and, when due, agrees a new plan.
  void end_iteration(std::uint64_t iteration) {
    stats_.iteration = iteration;
    stats_.buckets = buckets_.size();
    const auto last_ready = std::max_element(ready_at_.begin(), ready_at_.end());
    if (last_ready != ready_at_.end()) stats_.after_last_ready = std::chrono::steady_clock::now() - *last_ready;
    const std::int64_t first = first_ready_.load(std::memory_order_acquire);
    const auto start = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(first));
    for (std::size_t id = 0; id < layout_.size(); ++id) ready_time_[id] = ready_at_[id] - start;
    const ReadyProfile profile{iteration, layout_, ready_time_, std::span<const GradId>(order_.data(), order_size_.load())};
    std::optional<BucketPlan> proposal = bucketing_.end_iteration(profile);
    if (!bucketing_.agreement_due(iteration)) return;
    {
      std::lock_guard lock(mutex_);
      idle_ = false;
    }
    std::string agreed;
    if (rank() == 0) {
      agreed = encode_plan(proposal ? *proposal : plan_);
      for (int peer = 1; peer < size(); ++peer) send_control(peer, iteration, plan_message, agreed);
    } else {
      agreed = recv_control(0, iteration, plan_message);
    }
    BucketPlan plan = decode_plan(agreed);
    if (plan != plan_) install(std::move(plan));
  }

  // Called with the lock held once the iteration is done.
  void next_iteration(std::chrono::nanoseconds exposed) {
    last_stats_ = stats_;
    last_stats_.exposed = exposed;
    stats_ = {};
    for (std::size_t id = 0; id < layout_.size(); ++id) marked_[id].store(false, std::memory_order_relaxed);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      pending_[b].store(static_cast<std::uint32_t>(plan_.buckets[b].size()), std::memory_order_relaxed);
    order_size_.store(0, std::memory_order_relaxed);
    first_ready_.store(0, std::memory_order_release);
    iteration_.fetch_add(1);
    done_ = false;
    ++generation_;
    work_cv_.notify_all();
  }

  // Makes the other ranks fail fast (unless they already know), then records the first failure
  // and wakes everyone. The transport is aborted first: once abort() returns it holds no buffer
  // of ours, so nothing reads or writes a gradient after wait() has thrown.
  void fail(const Error& e, bool tell_peers = true) {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (tell_peers) transport_.abort(e);
    {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = e;
      failed_.store(true, std::memory_order_release);
    }
    done_cv_.notify_all();
  }

  Error never_ready_error() const {
    std::string missing;
    std::size_t count = 0;
    std::optional<std::uint32_t> bucket;
    for (std::size_t id = 0; id < layout_.size(); ++id) {
      if (marked_[id].load()) continue;
      if (count++ < 5) missing += fmt::format("{}{:?} (id {})", missing.empty() ? "" : ", ", layout_[id].name, id);
      if (!bucket) bucket = slots_[id].bucket;
    }
    if (count > 5) missing += fmt::format(" and {} more", count - 5);
    return Error(ErrorKind::timeout, here("wait", bucket),
                 fmt::format("iteration {} did not complete within {} ms: {} of {} gradients were never marked ready "
                             "on this rank: {}",
                             iteration_.load(), options_.timeout.count(), count, layout_.size(), missing));
  }

  // ---- agreement between ranks -----------------------------------------------------------------

  void exchange_layouts() {
    const std::string policies =
        fmt::format("bucketing={} codec={} topology={} transport={} world={} selective-compression={} coordination={}",
                    bucketing_.describe(), codec_.describe(), topology_.describe(), transport_.describe(), size(),
                    options_.selective_compression,
                    options_.coordination.enabled ? fmt::format("window {}, batches of {} bytes", options_.coordination.window,
                                                                options_.coordination.batch_bytes)
                                                  : "off");
    const std::string mine = detail::describe_layout(layout_, policies);
    std::string verdict;
    if (rank() == 0) {
      for (int peer = 1; peer < size(); ++peer) {
        const std::string difference = detail::layout_differences(mine, recv_control(peer, 0, layout_message), peer);
        if (!difference.empty()) verdict += (verdict.empty() ? "" : "; ") + difference;
      }
      for (int peer = 1; peer < size(); ++peer) send_control(peer, 0, verdict_message, verdict);
    } else {
      send_control(0, 0, layout_message, mine);
      verdict = recv_control(0, 0, verdict_message);
    }
    if (!verdict.empty()) throw Error(ErrorKind::mismatch, here("layout check"), verdict);
  }

  // Selective compression's calibration: times encode and decode here, and a transfer to the right
  // neighbour of the ring (receiving from the left), at three sizes each; fits a + b * bytes; and
  // agrees on the slowest rank's coefficients (rank 0 gathers them and sends back the maximum).
  engine::CostModel calibrate() {
    using Clock = std::chrono::steady_clock;
    const auto median_of = [](auto&& once) {
      std::array<double, 5> t{};
      for (double& s : t) {
        const auto started = Clock::now();
        once();
        s = std::chrono::duration<double>(Clock::now() - started).count();
      }
      std::sort(t.begin(), t.end());
      return t[2];
    };
    constexpr std::array<std::size_t, 3> value_counts{std::size_t{1} << 14, std::size_t{1} << 17, std::size_t{1} << 20};
    std::vector<float> values(value_counts.back()), out(value_counts.back());
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<float>(static_cast<int>((i * 2654435761u) % 2001u) - 1000) * 1e-3f;
    std::vector<std::byte> encoded(codec_.max_encoded_bytes(values.size(), DType::f32));
    std::vector<std::pair<double, double>> encode_points, decode_points, transfer_points;
    for (std::size_t n : value_counts) {
      auto state = codec_.make_state(n, DType::f32);
      const std::span<const float> in(values.data(), n);
      std::size_t used = 0;
      const double bytes = static_cast<double>(n * sizeof(float));
      encode_points.emplace_back(bytes, median_of([&] { used = codec_.encode(in, state, encoded); }));
      decode_points.emplace_back(bytes, median_of([&] {
        codec_.decode(std::span<const std::byte>(encoded.data(), used), std::span<float>(out.data(), n), DecodeMode::add);
      }));
    }
    const int left = (rank() + size() - 1) % size(), right = (rank() + 1) % size();
    std::vector<std::byte> probe_out(std::size_t{1} << 21), probe_in(probe_out.size());
    std::uint32_t probe = 0;
    for (std::size_t bytes : {std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 21}) {
      transfer_points.emplace_back(static_cast<double>(bytes), median_of([&] {
        const auto tag = engine::make_tag(0, engine::control_bucket, calibration_message + 2 + probe++);
        const auto deadline = Clock::now() + options_.timeout;
        transport_.recv(control_requests_[0], left, tag, std::span(probe_in.data(), bytes));
        transport_.send(control_requests_[1], right, tag, std::span<const std::byte>(probe_out.data(), bytes));
        transport_.wait(control_requests_[0], deadline);
        transport_.wait(control_requests_[1], deadline);
      }));
    }
    std::array<double, 6> mine{};
    const engine::Linear fitted[3] = {engine::fit(encode_points), engine::fit(decode_points), engine::fit(transfer_points)};
    for (int i = 0; i < 3; ++i) mine[2 * i] = fitted[i].fixed, mine[2 * i + 1] = fitted[i].per_byte;
    const auto as_text = [](const std::array<double, 6>& c) { return std::string(reinterpret_cast<const char*>(c.data()), sizeof c); };
    const auto from_text = [&](const std::string& text, int peer) {
      if (text.size() != sizeof(std::array<double, 6>))
        throw Error(ErrorKind::protocol, {.rank = rank(), .peer = peer, .operation = "calibration"},
                    fmt::format("calibration message of {} bytes, expected {}", text.size(), sizeof(std::array<double, 6>)));
      std::array<double, 6> c;
      std::memcpy(c.data(), text.data(), sizeof c);
      return c;
    };
    std::array<double, 6> agreed = mine;
    if (rank() == 0) {
      for (int peer = 1; peer < size(); ++peer) {
        const auto theirs = from_text(recv_control(peer, 0, calibration_message), peer);
        for (std::size_t i = 0; i < agreed.size(); ++i) agreed[i] = std::max(agreed[i], theirs[i]);
      }
      for (int peer = 1; peer < size(); ++peer) send_control(peer, 0, calibration_message, as_text(agreed));
    } else {
      send_control(0, 0, calibration_message, as_text(mine));
      agreed = from_text(recv_control(0, 0, calibration_message), 0);
    }
    return {{agreed[0], agreed[1]}, {agreed[2], agreed[3]}, {agreed[4], agreed[5]}};
  }

  // Control traffic goes through members, not locals: if a wait fails, the transport is aborted
  // while the buffers it may still reference are alive.
  void send_control(int peer, std::uint64_t iteration, std::uint32_t message, std::string_view payload) {
    control_out_.assign(payload);
    control_size_ = control_out_.size();
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    transport_.send(control_requests_[0], peer, engine::make_tag(iteration, engine::control_bucket, message),
                    std::as_bytes(std::span(&control_size_, 1)));
    transport_.send(control_requests_[1], peer, engine::make_tag(iteration, engine::control_bucket, message + 1),
                    std::as_bytes(std::span(control_out_.data(), control_out_.size())));
    transport_.wait(control_requests_[0], deadline);
    transport_.wait(control_requests_[1], deadline);
  }

  std::string recv_control(int peer, std::uint64_t iteration, std::uint32_t message) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    transport_.recv(control_requests_[0], peer, engine::make_tag(iteration, engine::control_bucket, message),
                    std::as_writable_bytes(std::span(&control_size_, 1)));
    if (transport_.wait(control_requests_[0], deadline) != sizeof control_size_ || control_size_ > max_control_bytes)
      throw Error(ErrorKind::protocol, {.rank = rank(), .peer = peer, .operation = "control"},
                  fmt::format("control message announces {} bytes (limit {})", control_size_, max_control_bytes));
    control_in_.resize(control_size_);
    transport_.recv(control_requests_[1], peer, engine::make_tag(iteration, engine::control_bucket, message + 1),
                    std::as_writable_bytes(std::span(control_in_.data(), control_in_.size())));
    if (transport_.wait(control_requests_[1], deadline) != control_size_)
      throw Error(ErrorKind::protocol, {.rank = rank(), .peer = peer, .operation = "control"},
                  "control message shorter than announced");
    return control_in_;
  }

  // A plan on the wire: bucket count, then each bucket's size and ids, as 32-bit words.
  static std::string encode_plan(const BucketPlan& plan) {
    std::vector<std::uint32_t> words{static_cast<std::uint32_t>(plan.buckets.size())};
    for (const auto& ids : plan.buckets) {
      words.push_back(static_cast<std::uint32_t>(ids.size()));
      words.insert(words.end(), ids.begin(), ids.end());
    }
    return std::string(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(std::uint32_t));
  }

  BucketPlan decode_plan(std::string_view bytes) const {
    const auto malformed = [&] {
      return Error(ErrorKind::protocol, {.rank = rank(), .peer = 0, .operation = "plan agreement"},
                   fmt::format("malformed plan message of {} bytes", bytes.size()));
    };
    if (bytes.size() % sizeof(std::uint32_t) != 0) throw malformed();
    std::vector<std::uint32_t> words(bytes.size() / sizeof(std::uint32_t));
    if (!words.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
    std::size_t at = 0;
    const auto next = [&] {
      if (at >= words.size()) throw malformed();
      return words[at++];
    };
    // Every count is checked against the words left before anything is sized by it.
    const auto count = [&] {
      const std::uint32_t n = next();
      if (n > words.size() - at) throw malformed();
      return n;
    };
    BucketPlan plan;
    plan.buckets.resize(count());
    for (auto& ids : plan.buckets) {
      ids.resize(count());
      for (GradId& id : ids) id = next();
    }
    if (at != words.size()) throw malformed();
    return plan;
  }

  X transport_;
  Options options_;
  B bucketing_;
  C codec_;
  T topology_;
  Group group_;

  Layout layout_;
  std::vector<TensorView> views_;

  std::once_flag freeze_once_;
  std::atomic<bool> frozen_{false};
  BucketPlan plan_;
  std::vector<Slot> slots_;      // by gradient
  std::vector<Bucket> buckets_;  // by plan position

  // Per-iteration state written by ready() (any thread) and read by the communication thread.
  std::unique_ptr<std::atomic<std::uint32_t>[]> pending_;  // by bucket: gradients not yet ready
  std::unique_ptr<std::atomic<bool>[]> marked_;            // by gradient
  std::vector<std::chrono::steady_clock::time_point> ready_at_;
  std::vector<GradId> order_;
  std::atomic<std::uint32_t> order_size_{0};
  std::atomic<std::int64_t> first_ready_{0};  // steady_clock ticks of the iteration's first ready(); 0 = none
  std::atomic<std::uint64_t> iteration_{0};   // as the caller counts: bumped by wait()

  // Used by the communication thread only.
  std::vector<Duration> ready_time_;
  std::array<typename X::Request, 2> control_requests_;
  std::uint64_t control_size_ = 0;
  std::string control_out_;
  std::string control_in_;
  IterationStats stats_;
  std::optional<engine::CostModel> costs_;  // selective compression's agreed costs, once calibrated
  std::string decisions_;                   // its decisions for the plan being installed, for the log

  std::mutex mutex_;
  std::condition_variable work_cv_;  // wakes the communication thread
  std::condition_variable done_cv_;  // wakes wait()
  bool done_ = false;                // this iteration's buckets are all averaged
  bool stop_ = false;
  bool idle_ = false;                // the communication thread is waiting for work
  bool exited_ = false;              // the communication thread has returned
  std::uint64_t generation_ = 0;     // bumped by wait(), releases the communication thread
  std::optional<Error> error_;
  std::atomic<bool> failed_{false};
  bool engine_failed_ = false;  // the task graph reported a failure (guarded by mutex_)
  IterationStats last_stats_;

  // Declared after the buckets its threads work on, so that it stops before they go.
  std::unique_ptr<engine::TaskGraph<C, X>> engine_;
  std::thread thread_;
};

}  // namespace gradsync
