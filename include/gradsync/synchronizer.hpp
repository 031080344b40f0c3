#pragma once
// Synchronizer<Bucketing, Compression, Topology, Transport> — where the four policies meet.
//
// The life of an iteration:
//   ready(id)   from any thread, as backward produces gradient `id`. Buckets start strictly in plan
//               order (the same on every rank, which is what keeps ranks from waiting on each
//               other crosswise). On the task graph (Options::executor, engine/task_graph.hpp)
//               the ready() that completes the next bucket starts it, and any later ones already
//               complete, on its own thread: it packs a small bucket's gradients into its flat
//               buffer itself (a larger one's pack is the bucket's first task, on a compute
//               thread) and hands the topology's schedule with the codec over the transport to the
//               graph, whose threads run it, several buckets at once, and write the averages
//               back as each bucket completes. The serial executor has one thread of its own that
//               walks the buckets in order, packing and running each to its end.
//               All of it while backward goes on.
//   wait()      on the task graph, drives the graph itself until every bucket is done (the last
//               bucket's receives, adds and copy back then run on the waiting thread); on the
//               serial executor, waits for the walk. Then hands the iteration's timings to the
//               bucketing policy, agrees a new plan when due, and readies the next iteration.
//   on_averaged(update), if set, runs each gradient's update (its layer's optimizer step) as soon as
//               its bucket is averaged, on the synchronization side, so that a layer's parameters
//               change while backward still runs on earlier layers; wait() then also waits for them.
//
// At the first synchronization (the first ready() or wait(), which blocks until every rank has
// reached its own) the ranks exchange their layouts and policy settings, and stop with an Error on
// every rank if anything differs. Plans proposed by the bucketing policy are agreed (rank 0's
// wins) at iteration boundaries, in wait(). Both travel on the control channel
// (engine/control.hpp). Buffers are sized whenever a plan is installed; ready(), the exchange and
// wait() allocate nothing.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/detail/device_gradients.hpp"
#include "gradsync/detail/settings.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/engine/cost_model.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/engine/gradients.hpp"
#include "gradsync/engine/native_allreduce.hpp"
#include "gradsync/engine/schedule_tuner.hpp"
#include "gradsync/engine/task_graph.hpp"
#include "gradsync/options.hpp"
#include "gradsync/timeline.hpp"

namespace gradsync {

template <BucketingPolicy B, CompressionPolicy C, TopologyPolicy T, TransportPolicy X>
class Synchronizer {
  static_assert(!OrderMatchedTransport<X> || PairOrderedTopology<T>,
                "this transport (transport::Nccl) matches messages by order, not by tag: its topology must post "
                "each pair's messages in one order on both sides (PairOrderedTopology: topology::Ring, "
                "topology::ParameterServer or topology::Hierarchical)");

 public:
  using Bucketing = B;
  using Compression = C;
  using Topology = T;
  using Transport = X;

  // Averages over every rank of `transport`.
  explicit Synchronizer(X transport, Options options = {}, B bucketing = {}, C codec = {}, T topology = {})
      : Synchronizer(std::move(transport), std::nullopt, std::move(options), std::move(bucketing), std::move(codec),
                     std::move(topology)) {}

  // Averages over the members of `group` only (schedule.hpp: Group::machine, Group::across_machines,
  // Group::of), with the group's numbering: rank() and size() are the group's. Several
  // Synchronizers may share one transport (transport::Borrowed) when no two of their groups share
  // a pair of ranks, e.g. the machine-local and the cross-machine groups.
  Synchronizer(X transport, Group group, Options options = {}, B bucketing = {}, C codec = {}, T topology = {})
      : Synchronizer(std::move(transport), std::optional<Group>(std::move(group)), std::move(options),
                     std::move(bucketing), std::move(codec), std::move(topology)) {}

 private:
  Synchronizer(X transport, std::optional<Group> group, Options options, B bucketing, C codec, T topology)
      : transport_(std::move(transport)),
        options_(options),
        bucketing_(std::move(bucketing)),
        codec_(std::move(codec)),
        topology_(std::move(topology)),
        group_(group ? std::move(*group) : Group::world(transport_.rank(), transport_.size())),
        control_(transport_, group_, options_.timeout),
        gradients_(transport_) {
    detail::validate_policy(bucketing_);
    detail::validate_policy(codec_);
    detail::validate_policy(topology_);
    check(options_, {.rank = transport_.rank(),
                     .transport = transport_.describe(),
                     .topology = topology_.describe(),
                     .pipeline_topology = PipelineTopology<T>,
                     .device_transport = DeviceTransport<X>});
    group_.check_fits(transport_.rank(), transport_.size());
    gradients_.open_timeline(options_.timeline, Timeline::rank_tag(transport_.rank(), group_.name),
                             options_.timeline_events, options_.log);
  }

 public:
  Synchronizer(const Synchronizer&) = delete;
  Synchronizer& operator=(const Synchronizer&) = delete;

  // Destroyed in the middle of an iteration, it aborts the transport so that the other ranks fail
  // fast instead of waiting for it; then its threads stop.
  ~Synchronizer() {
    if (!started_.load(std::memory_order_acquire)) return;
    const bool mid_iteration = !failed_.load(std::memory_order_acquire) && gradients_.any_marked() && !iteration_over();
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    if (mid_iteration)
      transport_.abort(Error(ErrorKind::peer_failed, here("shutdown"),
                             fmt::format("the Synchronizer was destroyed during iteration {}", iteration_.load())));
    work_cv_.notify_all();
    if (walker_.joinable()) walker_.join();
  }

  // Registers a gradient; ids are given out in order from 0. Every rank must register the same
  // gradients (name, size, dtype) in the same order, before its first ready() or wait(). A
  // gradient in CUDA device memory (Device::cuda) is staged through host memory, with blocking
  // copies (detail/device_gradients.hpp), or over a device transport packed on its stream: it must
  // be complete, or queued on the device's legacy default stream, when ready() is called for it.
  GradId add(std::string name, TensorView gradient) {
    if (accumulation_dtype(gradient.dtype) == DType::f64 && !CodecFor<C, double>)
      throw Error(ErrorKind::unsupported, here("add"),
                  fmt::format("gradient {:?} is f64, but codec {} encodes f32 values only (it has no f64 encode "
                              "and decode); convert the gradient to f32 or choose a codec with an f64 path",
                              name, codec_.describe()));
    return gradients_.add(std::move(name), gradient);
  }

  // From now on `update(id)` (the optimizer step of gradient `id`'s parameters: the third source
  // document's per-layer background update) runs as soon as `id` holds the iteration's average, on
  // one of gradsync's threads (a task-graph compute thread, or for a bucket of at most
  // TaskGraph::short_path_bytes the thread moving its bytes; the serial executor's thread) while backward goes on; wait()
  // returns once every update has run. As it may run the moment ready(id) is called, backward
  // must be done reading those parameters by then. Updates of different buckets may run at once,
  // on different threads. An exception from one stops synchronization on every rank with
  // Error(internal) naming the gradient. Call before the first ready() or wait().
  void on_averaged(std::function<void(GradId)> update) {
    if (gradients_.frozen())
      throw Error(ErrorKind::invalid_argument, here("on_averaged"),
                  "on_averaged() after the first ready() or wait(): set the update before synchronizing");
    update_ = std::move(update);
  }

  // Marks gradient `id` as holding this iteration's local value, and on the task graph starts the
  // buckets it completes (the top of this file). Thread-safe; allocation-free.
  void ready(GradId id) {
    if (failed_.load(std::memory_order_acquire)) throw_failure();
    freeze();
    const auto marked = gradients_.mark(id, iteration_.load());
    {
      std::lock_guard lock(start_mutex_);
      report_if_late(marked);
      if (task_graph_) {
        if (marked.bucket_complete) start_complete_buckets();
        return;
      }
    }
    if (marked.bucket_complete) {
      std::lock_guard lock(mutex_);
      work_cv_.notify_all();
    }
  }

  // Blocks until every gradient holds the average over the contributing ranks (all of them, unless
  // the topology has dedicated servers), then readies the next iteration. Every ready() of the
  // iteration must have returned: a gradient not marked by then never will be, so wait() fails at
  // once, naming it, and the other ranks learn why from this rank's abort. Otherwise the
  // exchange's own timeouts (Options::timeout) bound the wait. Throws the Error that stopped
  // synchronization, on this rank or another.
  void wait() {
    freeze();
    const auto start = std::chrono::steady_clock::now();
    Timeline* timeline = gradients_.timeline();
    const std::int64_t traced_start = timeline ? timeline->now() : 0;
    if (!failed_.load(std::memory_order_acquire) && !gradients_.all_marked())
      fail(gradients_.never_ready(iteration_.load()));
    if (task_graph_) {
      await_task_graph();
    } else {
      std::unique_lock lock(mutex_);
      const bool blocked = !walked_;
      done_cv_.wait(lock, [&] { return error_ || walked_; });
      if (error_) {
        lock.unlock();
        throw_failure();
      }
      if (timeline && blocked) timeline->handed_off(Timeline::Queue::waiter, walked_at_, 0);
    }
    end_iteration();
    if (timeline) timeline->record(Timeline::Kind::wait, traced_start, 0, iteration_.load());
    next_iteration(std::chrono::steady_clock::now() - start);
  }

  // The non-blocking form of wait(): true (and the next iteration readied) once every gradient
  // holds the average; false while the exchange is still running. On the timeline the call that
  // returns true is a wait of no length (the trainer did not block).
  bool try_wait() {
    freeze();
    if (failed_.load(std::memory_order_acquire)) task_graph_ ? await_task_graph() : throw_failure();
    if (!iteration_over()) return false;
    if (task_graph_)
      await_task_graph();  // at once: it returns the iteration's costs, or throws
    else if (failed_.load(std::memory_order_acquire))
      throw_failure();
    end_iteration();
    if (Timeline* timeline = gradients_.timeline())
      timeline->record(Timeline::Kind::wait, timeline->now(), 0, iteration_.load());
    next_iteration(std::chrono::nanoseconds{0});
    return true;
  }

  // This rank in the group the Synchronizer averages over (the whole transport unless built on a group).
  int rank() const noexcept { return group_.rank; }
  int size() const noexcept { return group_.size(); }
  const Group& group() const noexcept { return group_; }
  const Layout& layout() const noexcept { return gradients_.layout(); }
  // The plan in use; read it between wait() and the next ready().
  const BucketPlan& plan() const noexcept { return plan_; }
  const IterationStats& last_iteration() const noexcept { return last_stats_; }
  const B& bucketing() const noexcept { return bucketing_; }

 private:
  struct Bucket {
    DType dtype = DType::f32;  // accumulation dtype
    std::size_t elements = 0;
    // A bucket of one host gradient already in its accumulation dtype is reduced where it lies,
    // saving a copy in and a copy out; otherwise gradients are packed into `storage`.
    bool in_place = false;
    detail::TransportBuffer<X> storage;  // from the transport when it hands out memory
    detail::PinnedRange pinned;          // `storage`, while it holds device gradients
    // Where the bucket is reduced, typed by its dtype: the one place the dtype becomes a type.
    engine::BucketValues values;
    engine::BucketExchange<C, X> exchange;  // an empty schedule where `native_allreduce`
    bool native_allreduce = false;          // summed by the transport's allreduce (Options::native_allreduce)
    std::int64_t traced_start = 0;  // on the timeline, when this iteration's packing began
    // Where the topology is tuned, the candidate `exchange` runs; this iteration's start and time
    // from its start to its averages written back (its update not included).
    std::size_t candidate = 0;
    std::chrono::steady_clock::time_point started{};
    std::chrono::nanoseconds took{0};
    // What `exchange` runs, by name, and the topology's prediction for it (last_iteration()).
    std::string schedule;
    double predicted_seconds = 0;
  };

  ErrorContext here(std::string operation, std::optional<std::uint32_t> bucket = std::nullopt) const {
    return {.rank = transport_.rank(), .bucket = bucket, .operation = std::move(operation)};
  }

  // The first ready() or wait(): the layout is final, so the plan is built and the thread started.
  void freeze();

  // Checks a plan and sizes everything it needs; the only place buffers are allocated.
  void install(BucketPlan plan) {
    const auto invalid = [&](std::string why) {
      return Error(ErrorKind::invalid_argument, here("plan"),
                   fmt::format("bucketing policy {} produced an invalid plan: {}", bucketing_.describe(), why));
    };
    if (plan.buckets.size() > engine::max_buckets)
      throw invalid(fmt::format("{} buckets, at most {} are supported", plan.buckets.size(), engine::max_buckets));
    const std::vector<engine::BucketShape> shapes = gradients_.place(plan, invalid);
    plan_tuner(shapes);
    std::vector<Bucket> buckets(plan.buckets.size());
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const auto& ids = plan.buckets[b];
      Bucket& bucket = buckets[b];
      bucket.dtype = shapes[b].dtype;
      bucket.elements = shapes[b].elements;
      // Over a device transport a bucket is always the transport's memory (allocate()), which
      // CudaStaged needs for its host mirrors: a device copy in and out is cheap beside a transfer.
      bucket.in_place = ids.size() == 1 && gradients_.reducible_in_place(ids.front());
      if (!bucket.in_place) {
        bucket.storage = detail::TransportBuffer<X>(&transport_, bucket.elements * size_of(bucket.dtype));
        if (!DeviceTransport<X> &&
            std::any_of(ids.begin(), ids.end(), [&](GradId id) { return gradients_.view(id).device != Device::cpu(); }))
          bucket.pinned = detail::PinnedRange(bucket.storage.data(), bucket.elements * size_of(bucket.dtype));
      }
      void* data = bucket.in_place ? gradients_.view(ids.front()).data : bucket.storage.data();
      if (bucket.dtype == DType::f64)
        bucket.values = std::span<double>(static_cast<double*>(data), bucket.elements);
      else
        bucket.values = std::span<float>(static_cast<float*>(data), bucket.elements);
      bucket.native_allreduce = allreduces_natively(bucket);
      bucket.exchange = bucket.native_allreduce
                            ? engine::BucketExchange<C, X>(Schedule{}, codec_, bucket.dtype, false, &transport_)
                            : exchange_for(b, bucket);
      if (bucket.native_allreduce) bucket.schedule = fmt::format("{}'s allreduce", transport_.describe());
    }
    const auto native = std::count_if(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.native_allreduce; });
    if (native > 0 && rank() == 0)
      log_line(options_.log, fmt::format("gradsync: {} of {} buckets are summed by {}'s own allreduce "
                                         "(Options::native_allreduce; false: gradsync's ring)",
                                         native, buckets.size(), transport_.describe()));
    plan_ = std::move(plan);
    buckets_ = std::move(buckets);
    hand_to_task_graph();
  }

  void hand_to_task_graph() {
    log_decisions();
    if (!task_graph_) return;
    std::vector<engine::BucketExchange<C, X>*> exchanges;
    for (Bucket& bucket : buckets_) exchanges.push_back(&bucket.exchange);
    task_graph_->install(exchanges);
  }

  // A TunedTopology's measured choice (engine/schedule_tuner.hpp), where it applies: the ranks'
  // times are what decide, and only host transports that match by tag can be timed and switched.
  // Nor with a codec whose state carries from one iteration to the next (error feedback's
  // residual, a random stream's position): it lives in the exchange's encode steps, which a
  // switch builds anew, so a switch would drop the residual a lossy codec owes the sum.
  void start_tuning() {
    if constexpr (TunedTopology<T> && !DeviceTransport<X> && !OrderMatchedTransport<X> &&
                  std::is_empty_v<typename C::State>) {
      if (!topology_.tunes() || size() == 1) return;
      tuner_.emplace(engine::TunerSettings{}, T::candidates);
      tuner_->candidate_name = [this](std::size_t k) { return topology_.candidate_name(k); };
    }
  }

  // The tuner's classes for buckets of these shapes, ordered by the topology's predictions over
  // its link (the prior): every class starts over.
  void plan_tuner(std::span<const engine::BucketShape> shapes) {
    if constexpr (TunedTopology<T>) {
      if (!tuner_) return;
      std::vector<std::size_t> elements;
      for (const engine::BucketShape& shape : shapes) elements.push_back(shape.elements);
      const CodecTraits traits = codec_traits<C>();
      tuner_->plan(
          elements,
          [&](std::size_t b, std::size_t k) {
            return topology_.candidate_seconds(k, group_, elements[b], size_of(shapes[b].dtype));
          },
          [&](std::size_t b, std::size_t k) {
            return engine::candidate_scratch(topology_, k, group_, elements[b], traits);
          });
    }
  }

  // In wait(): hands the tuner this iteration's bucket times and, where a class moves to another
  // candidate (an agreement, or the next trial), builds those buckets' exchanges anew.
  void tune(std::uint64_t iteration) {
    if constexpr (TunedTopology<T>) {
      if (!tuner_) return;
      for (std::size_t b = 0; b < buckets_.size(); ++b)
        if (!buckets_[b].native_allreduce) tuner_->record(b, std::chrono::duration<double>(buckets_[b].took).count());
      if (tuner_->end_iteration()) {
        std::string decisions;
        tuner_->agree(control_, iteration, &decisions);
        if (!decisions.empty() && rank() == 0)
          log_line(options_.log, fmt::format("gradsync {}: chosen by measured times{}", topology_.describe(), decisions));
      }
      bool changed = false;
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (buckets_[b].native_allreduce || tuner_->choice(b) == buckets_[b].candidate) continue;
        buckets_[b].exchange = exchange_for(b, buckets_[b]);
        changed = true;
      }
      if (changed) hand_to_task_graph();
    } else {
      (void)iteration;
    }
  }

  // Bucket `b`'s schedule: compressed, unless selective compression has a cost model that says
  // sending it as it is would be faster; then also cut into the pieces the model chose. Where the
  // topology is tuned, the candidate the tuner gives it now.
  engine::BucketExchange<C, X> exchange_for(std::size_t b, Bucket& bucket) {
    engine::BucketExchange<C, X> exchange = [&] {
      if constexpr (PipelineTopology<T>) {
        if (costs_) {
          engine::ChosenSchedule chosen =
              engine::choose_schedule(*costs_, codec_, topology_, group_, bucket.elements, bucket.dtype);
          decisions_ += fmt::format("\n  bucket {}: {}", b, chosen.explanation);
          return engine::BucketExchange<C, X>(std::move(chosen.schedule), codec_, bucket.dtype,
                                              !chosen.compressed && !C::identity, &transport_);
        }
      }
      CodecTraits traits = codec_traits<C>();
      traits.receives_at_use = OrderMatchedTransport<X>;  // NCCL's groups (schedule.hpp)
      Schedule schedule = [&] {
        if constexpr (TunedTopology<T>)
          if (tuner_) {
            bucket.candidate = tuner_->choice(b);
            return topology_.candidate_schedule(bucket.candidate, group_, bucket.elements, traits);
          }
        return topology_.schedule(group_, bucket.elements, traits);
      }();
      return engine::BucketExchange<C, X>(std::move(schedule), codec_, bucket.dtype, false, &transport_);
    }();
    exchange.trace(gradients_.timeline(), static_cast<std::uint32_t>(b));
    describe_schedule(bucket);
    return exchange;
  }

  // What `bucket` runs, by name, and the topology's prediction for it over its measured links,
  // where it predicts: a tuned topology's candidate, or its own choice.
  void describe_schedule(Bucket& bucket) const {
    bucket.predicted_seconds = 0;
    if constexpr (TunedTopology<T>) {
      if (tuner_) {
        bucket.schedule = topology_.candidate_name(bucket.candidate);
        bucket.predicted_seconds =
            topology_.candidate_seconds(bucket.candidate, group_, bucket.elements, size_of(bucket.dtype));
        return;
      }
    }
    if constexpr (requires { topology_.choice(group_, std::size_t{}); })
      bucket.schedule = topology_.choice(group_, bucket.elements);
    else
      bucket.schedule = topology_.describe();
    if constexpr (PredictedTopology<T> && LinkAwareTopology<T>)
      bucket.predicted_seconds = topology_.predicted_seconds(group_, bucket.elements, size_of(bucket.dtype), topology_.link);
  }

  // For last_iteration(): what each bucket ran this iteration, as predicted and as measured. A
  // name changes only where a bucket's exchange was built anew, so the copies reuse their strings.
  void report_schedules() {
    std::vector<BucketSchedule>& report = last_stats_.schedules;
    report.resize(buckets_.size());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      report[b].schedule = buckets_[b].schedule;
      report[b].predicted_seconds = buckets_[b].predicted_seconds;
      report[b].seconds = std::chrono::duration<double>(buckets_[b].took).count();
    }
  }

  void log_decisions() {
    if (!decisions_.empty() && rank() == 0)
      log_line(options_.log, fmt::format("gradsync selective compression ({}): {}{}", codec_.describe(),
                                         costs_->describe(), decisions_));
    decisions_.clear();
  }

  // topology::Auto and its kind choose per bucket by the link's costs: measured at the first
  // synchronization (engine::measure_links) and the buckets' schedules built again with them.
  // Over a device transport the control messages the probe would time are not what buckets take,
  // so the topology's own figures stand there.
  void measure_link()
    requires LinkAwareTopology<T>
  {
    if constexpr (DeviceTransport<X>) return;
    if (!topology_.measures_link() || size() == 1) return;
    const std::string links = engine::measure_links(topology_, control_);
    std::vector<engine::BucketShape> shapes;
    for (const Bucket& bucket : buckets_) shapes.push_back({.dtype = bucket.dtype, .elements = bucket.elements});
    plan_tuner(shapes);
    std::string choices;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (buckets_[b].native_allreduce) continue;
      buckets_[b].exchange = exchange_for(b, buckets_[b]);
      if constexpr (requires { topology_.choice(group_, std::size_t{}); })
        choices += fmt::format("\n  bucket {} ({} values): {}", b, buckets_[b].elements,
                               topology_.choice(group_, buckets_[b].elements));
    }
    hand_to_task_graph();
    if (rank() == 0) log_line(options_.log, fmt::format("gradsync {}: {}{}", topology_.describe(), links, choices));
  }

  // The first synchronization, on the caller's thread: the agreements every rank makes before its
  // first bucket, then selective compression's calibration and the link probe where they apply.
  void agree_before_first_bucket() {
    engine::agree_on_membership(control_);
    engine::agree_on_layout(control_, gradients_.layout(), describe_policies());
    if (options_.selective_compression && !C::identity && size() > 1) {
      costs_ = engine::calibrate(codec_, control_);
      for (std::size_t b = 0; b < buckets_.size(); ++b) buckets_[b].exchange = exchange_for(b, buckets_[b]);
      hand_to_task_graph();
    }
    if constexpr (LinkAwareTopology<T>) measure_link();
  }

  // Runs `work`, recording what it throws as this Synchronizer's failure (so every rank learns of
  // it) and throwing that failure on. A mismatch found by an agreement is every rank's verdict:
  // aborting the transport would only turn the others' clear message into "peer failed".
  template <class Work>
  void failing_on_error(const char* operation, Work work) {
    try {
      work();
    } catch (const Error& e) {
      fail(e, e.kind() != ErrorKind::mismatch);
      throw_failure();
    } catch (const std::exception& e) {
      fail(Error(ErrorKind::internal, here(operation), e.what()));
      throw_failure();
    }
  }

  // Throws the failure that stopped synchronization, once the serial walk's thread has let go of
  // the gradients (the task graph's threads are quiet once await_iteration() has returned or thrown).
  [[noreturn]] void throw_failure() {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return !walker_.joinable() || walker_exited_; });
    throw *error_;
  }

  // With start_mutex_ held: on the task graph, starts the buckets that are complete, in plan order,
  // from the next one not yet started.
  void start_complete_buckets() {
    failing_on_error("start", [&] {
      while (next_bucket_ < buckets_.size() && gradients_.bucket_complete(next_bucket_)) {
        const std::size_t b = next_bucket_++;
        late_reported_ = false;
        std::visit([&](auto values) { synchronize_bucket(b, values, iteration_.load()); }, buckets_[b].values);
      }
    });
  }

  // With start_mutex_ held, after `marked`: tells the bucketing policy that the next bucket to start
  // is late, if its expected time (since the iteration's first mark) has passed while it was
  // incomplete: it still is, or this very mark completed it. Once per bucket and iteration.
  void report_if_late(const typename engine::Gradients<X>::Marked& marked) {
    const std::size_t b = next_bucket_;
    if (late_reported_ || b >= buckets_.size()) return;
    if (gradients_.bucket_complete(b) && !(marked.bucket_complete && marked.bucket == b)) return;
    const auto expected = bucketing_.expected_ready(b);
    const auto first = gradients_.first_ready();
    if (!expected || !first) return;
    const Duration since_first = std::chrono::steady_clock::now() - *first;
    if (since_first <= *expected) return;
    late_reported_ = true;
    bucketing_.on_late(b, since_first);
  }

  // On the task graph: drives it until the iteration's buckets are done, then throws the first
  // failure, whether the graph's or one recorded elsewhere (which aborted the transport, so the
  // graph's pending transfers failed too).
  void await_task_graph() {
    try {
      stats_ += task_graph_->await_iteration();
    } catch (const Error& e) {
      fail(e);
    }
    if (failed_.load(std::memory_order_acquire)) throw_failure();
  }

  // Whether every bucket of this iteration is done.
  bool iteration_over() {
    if (!task_graph_) {
      std::lock_guard lock(mutex_);
      return walked_ || error_;
    }
    std::lock_guard lock(start_mutex_);
    return next_bucket_ == buckets_.size() && task_graph_->iteration_over();
  }

  // The serial executor's thread: walks each iteration's buckets in plan order, packing and running
  // each as it becomes complete. It marks its exit so that no error is thrown while it may still
  // touch gradients.
  void walk() {
    if constexpr (DeviceTransport<X>) transport_.cuda_stream().make_current();  // this thread's device
    try {
      for (;;) {
        const std::uint64_t iteration = iteration_.load();
        for (std::size_t b = 0; b < buckets_.size(); ++b) {
          {
            std::lock_guard lock(start_mutex_);
            next_bucket_ = b;
            late_reported_ = false;
          }
          {
            std::unique_lock lock(mutex_);
            work_cv_.wait(lock, [&] { return stop_ || gradients_.bucket_complete(b); });
            if (stop_) break;
          }
          std::visit([&](auto values) { synchronize_bucket(b, values, iteration); }, buckets_[b].values);
        }
        std::unique_lock lock(mutex_);
        if (stop_) break;
        walked_ = true;
        walked_at_ = std::chrono::steady_clock::now();
        done_cv_.notify_all();
        work_cv_.wait(lock, [&] { return stop_ || iteration_.load() != iteration; });
        if (stop_) break;
      }
    } catch (const Error& e) {
      fail(e);
    } catch (const std::exception& e) {
      fail(Error(ErrorKind::internal, here("serial executor"), e.what()));
    }
    std::lock_guard lock(mutex_);
    walker_exited_ = true;
    done_cv_.notify_all();
  }

  // Packs bucket `b` and runs it (serial walk) or starts it on the task graph (which then packs it,
  // if the caller did not, and copies it back: finish_bucket()).
  template <class V>
  void synchronize_bucket(std::size_t b, std::span<V> values, std::uint64_t iteration) {
    Bucket& bucket = buckets_[b];
    if (Timeline* timeline = gradients_.timeline()) {
      bucket.traced_start = timeline->now();
      if (!task_graph_)  // the walk's thread took the bucket from the ready() that completed it
        timeline->handed_off(Timeline::Queue::synchronizer, gradients_.last_ready(plan_.buckets[b]),
                             static_cast<std::uint32_t>(b));
    }
    // A bucket larger than the graph's short path is packed on a compute thread, so that ready()
    // returns to backward at once.
    bucket.started = std::chrono::steady_clock::now();
    const bool pack_here =
        !task_graph_ || values.size() * sizeof(V) <= engine::TaskGraph<C, X>::short_path_bytes;
    if (pack_here) pack_bucket(b);
    if (task_graph_)
      return task_graph_->start(static_cast<std::uint32_t>(b), bucket.values, iteration, pack_here,
                                b + 1 == buckets_.size());
    stats_ += bucket.native_allreduce ? allreduce_natively(b)
                                      : bucket.exchange.run(values, codec_, transport_,
                                                            {group_, iteration, static_cast<std::uint32_t>(b), options_.timeout});
    const auto started = std::chrono::steady_clock::now();
    finish_bucket(b);
    stats_.compute += std::chrono::steady_clock::now() - started;
  }

  // Copies bucket `b`'s gradients into its buffer (nothing to do for a bucket reduced in place;
  // never over a device transport, whose packing waits for ready()'s marks).
  void pack_bucket(std::size_t b) {
    if (buckets_[b].in_place) return;
    const auto started = std::chrono::steady_clock::now();
    std::visit([&](auto values) { gradients_.pack(b, std::span<const GradId>(plan_.buckets[b]), values); },
               buckets_[b].values);
    stats_.compute += std::chrono::steady_clock::now() - started;
  }

  // Whether `bucket` goes through the transport's own allreduce (Options::native_allreduce): an
  // uncompressed f32 bucket of a flat allreduce (Ring) over every rank of a transport that has one.
  bool allreduces_natively(const Bucket& bucket) const {
    if constexpr (DeviceAllreduce<X> && C::identity && FlatAllreduceTopology<T>)
      return options_.native_allreduce && bucket.dtype == DType::f32 && group_.size() == transport_.size();
    else
      return (void)bucket, false;
  }

  // Bucket `b` through the transport's own allreduce; only buckets allreduces_natively() chose.
  ExchangeStats allreduce_natively(std::size_t b) {
    if constexpr (DeviceAllreduce<X>)
      return engine::allreduce_natively(transport_, std::get<std::span<float>>(buckets_[b].values), group_.size(),
                                        options_.timeout, gradients_.timeline(),
                                        here("allreduce", static_cast<std::uint32_t>(b)));
    else
      throw Error(ErrorKind::internal, here("allreduce", static_cast<std::uint32_t>(b)),
                  fmt::format("bucket {} was marked for the transport's allreduce, which {} does not have", b,
                              transport_.describe()));
  }

  // Bucket `b` is averaged: its gradients get their values, then their updates run.
  void finish_bucket(std::size_t b) {
    if (!buckets_[b].in_place)
      std::visit([&](auto values) { gradients_.unpack(std::span<const GradId>(plan_.buckets[b]), values); },
                 buckets_[b].values);
    buckets_[b].took = std::chrono::steady_clock::now() - buckets_[b].started;
    if (Timeline* timeline = gradients_.timeline())
      timeline->record(Timeline::Kind::bucket, buckets_[b].traced_start, static_cast<std::uint32_t>(b));
    if (!update_) return;
    for (GradId id : plan_.buckets[b]) {
      try {
        update_(id);
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        throw Error(ErrorKind::internal, here("update", static_cast<std::uint32_t>(b)),
                    fmt::format("the update of gradient {:?} (id {}) threw: {}", layout()[id].name, id, e.what()));
      }
    }
  }

  // In wait(), every bucket done: hands this iteration's timings to the bucketing policy and, when
  // due, agrees a new plan (the serial walk's thread is idle until next_iteration()).
  void end_iteration() {
    failing_on_error("plan agreement", [&] {
      const std::uint64_t iteration = iteration_.load();
      stats_.iteration = iteration;
      stats_.buckets = buckets_.size();
      if (gradients_.size() > 0) stats_.after_last_ready = std::chrono::steady_clock::now() - gradients_.last_ready();
      report_schedules();
      tune(iteration);
      std::optional<BucketPlan> proposal = bucketing_.end_iteration(gradients_.profile(iteration, &options_.log));
      if (!bucketing_.agreement_due(iteration)) return;
      BucketPlan plan = engine::agree_on_plan(control_, iteration, proposal ? *proposal : plan_);
      if (plan != plan_) install(std::move(plan));
    });
  }

  // Readies the next iteration, and releases the serial walk's thread into it.
  void next_iteration(std::chrono::nanoseconds exposed) {
    std::vector<BucketSchedule> schedules = std::move(last_stats_.schedules);  // its strings keep their memory
    last_stats_ = stats_;
    last_stats_.exposed = exposed;
    last_stats_.schedules = std::move(schedules);
    stats_ = {};
    gradients_.next_iteration();
    {
      std::lock_guard lock(start_mutex_);
      next_bucket_ = 0;
      late_reported_ = false;
    }
    std::lock_guard lock(mutex_);
    walked_ = false;
    iteration_.fetch_add(1);
    work_cv_.notify_all();
  }

  // Records the first failure, makes the other ranks fail fast (unless they already know), and
  // wakes everyone. The first failure is kept before the transport is aborted, because the abort
  // makes this rank's own pending operations fail too, and those secondary errors must not
  // replace their cause. wait() throws only once the serial walk's thread has returned (or the task
  // graph's threads are quiet), and the thread that aborts returns from abort() before it can: by
  // then the transport holds no buffer of ours, so nothing reads or writes a gradient after wait()
  // has thrown.
  void fail(const Error& e, bool tell_peers = true) {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      if (!error_) error_ = e;
    }
    work_cv_.notify_all();
    if (tell_peers) transport_.abort(e);
    failed_.store(true, std::memory_order_release);
    done_cv_.notify_all();
  }

  // The policies every rank must share, as the layout check compares them.
  std::string describe_policies() const {
    std::string described = fmt::format(
        "bucketing={} codec={} topology={} transport={} world={} selective-compression={} coordination={}",
        bucketing_.describe(), codec_.describe(), topology_.describe(), transport_.describe(), size(),
        options_.selective_compression,
        options_.coordination.enabled
            ? fmt::format("window {}, batches of {} bytes", options_.coordination.window, options_.coordination.batch_bytes)
            : "off");
    // Ranks that disagreed would meet NCCL's allreduce and point-to-point groups, and hang.
    if constexpr (DeviceAllreduce<X>) described += fmt::format(" native-allreduce={}", options_.native_allreduce);
    return described;
  }

  X transport_;
  Options options_;
  B bucketing_;
  C codec_;
  T topology_;
  Group group_;
  engine::ControlChannel<X> control_;  // for agreements between ranks, at the first synchronization and in wait()

  // The registered gradients, their marks and their timeline. Declared before the buckets, whose
  // exchanges record into the timeline, and the task graph, whose threads do, so that it outlives both.
  engine::Gradients<X> gradients_;
  std::function<void(GradId)> update_;  // on_averaged()'s, if set

  std::once_flag freeze_once_;
  std::atomic<bool> started_{false};  // the plan is installed and the first agreements made
  BucketPlan plan_;
  std::vector<Bucket> buckets_;              // by plan position
  std::atomic<std::uint64_t> iteration_{0};   // as the caller counts: bumped by wait()

  // Written by whoever packs, starts or runs buckets and by wait(), which follows them all.
  IterationStats stats_;
  std::optional<engine::CostModel> costs_;  // selective compression's agreed costs, once calibrated
  std::optional<engine::ScheduleTuner> tuner_;  // a TunedTopology's measured choice, where it applies
  std::string decisions_;                   // its decisions for the plan being installed, for the log

  // Guards the buckets' start: which is next, and its lateness report (and the bucketing policy's
  // calls from ready()).
  std::mutex start_mutex_;
  std::size_t next_bucket_ = 0;  // the next bucket to start, in plan order
  bool late_reported_ = false;   // ... and its lateness is reported

  std::mutex mutex_;
  std::condition_variable work_cv_;  // wakes the serial walk's thread
  std::condition_variable done_cv_;  // wakes wait()
  bool walked_ = false;              // the serial walk has run this iteration's buckets
  std::chrono::steady_clock::time_point walked_at_;  // ... since then
  bool stop_ = false;
  bool walker_exited_ = false;  // the serial walk's thread has returned
  std::optional<Error> error_;
  std::atomic<bool> failed_{false};
  IterationStats last_stats_;

  // Declared after the buckets their threads work on, so that they stop before the buckets go.
  std::unique_ptr<engine::TaskGraph<C, X>> task_graph_;
  std::thread walker_;  // the serial executor's
};

// Outside the class, so not inline: a program's calls reach the engine only through here, and
// where this Synchronizer is compiled elsewhere (`extern template`), it is not instantiated again.
template <BucketingPolicy B, CompressionPolicy C, TopologyPolicy T, TransportPolicy X>
void Synchronizer<B, C, T, X>::freeze() {
  if (started_.load(std::memory_order_acquire)) return;
  std::call_once(freeze_once_, [&] {
    gradients_.freeze();
    // Over NCCL, messages match in posting order, which threads posting as work gets ready
    // would not keep alike on every rank, and buckets may go through its own allreduce: the
    // serial executor only.
    if (options_.executor == Executor::task_graph && !OrderMatchedTransport<X> && !DeviceAllreduce<X>)
      task_graph_ = std::make_unique<engine::TaskGraph<C, X>>(
          transport_, codec_, group_, options_.compute_threads, options_.timeout,
          typename engine::TaskGraph<C, X>::BucketTasks{.pack = [this](std::uint32_t b) { pack_bucket(b); },
                                                        .copy_back = [this](std::uint32_t b) { finish_bucket(b); }},
          options_.coordination, options_.spin_before_sleep, gradients_.timeline());
    start_tuning();
    install(bucketing_.initial_plan(gradients_.layout()));
    try {
      agree_before_first_bucket();
    } catch (const Error& e) {
      fail(e, e.kind() != ErrorKind::mismatch);
    } catch (const std::exception& e) {
      fail(Error(ErrorKind::internal, here("first synchronization"), e.what()));
    }
    if (!task_graph_ && !failed_.load(std::memory_order_acquire)) walker_ = std::thread([this] { walk(); });
    started_.store(true, std::memory_order_release);
  });
}

}  // namespace gradsync
