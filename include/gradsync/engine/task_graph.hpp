#pragma once
// engine::TaskGraph — runs buckets' schedules as dependency graphs of tasks, on two kinds of
// queue served by their own threads (the scheduling of HiPress's CaSync, seed 001):
//
//   compute         encode, decode-and-add, decode, average, and each bucket's first and last
//                   tasks (BucketTasks: the Synchronizer's pack of its gradients into the bucket's
//                   buffer, where the caller did not pack it, and its copy back); served by
//                   `compute_threads` worker threads.
//   communication   sends and receives; one thread posts them to the transport as they become
//                   ready, hears of their completion from the transport (CompletionSink) and
//                   enforces their deadlines. The bytes move on the transport's own threads.
//
// A task becomes ready when every task it depends on is done (dependencies.hpp): so one piece is
// encoded while another is on the wire, a receive is decoded as soon as it lands, and several
// buckets are in flight at once. Each queue hands out its ready tasks oldest bucket first, then in
// schedule order. Since the graph keeps every ordering the list order relied on, the results are
// bit for bit those of the serial executor, whatever the thread count or timing.
//
// With coordination (coordinator/planner.hpp), a ready send is not posted but reported to the group's
// coordinator and held until the coordinator grants it; the communication thread carries the
// reports and grants too, and on the coordinator (group rank 0) it also runs the planner. An
// iteration starts every installed bucket once; on the coordinator await_iteration() also waits until
// every rank has reported the iteration finished.
//
// The short path. Handing a task to another thread costs a wake-up (tens of microseconds, more on
// a loaded machine), far more than the work of a small piece. So a compute task whose piece is at
// most short_path_bytes of values, and the epilogue of a bucket that small, run on the
// communication thread itself, in the pass that finds them ready; and where the transport lets a
// thread read its own receives (CallerReader: Tcp), the communication thread, with nothing else
// to do, reads the oldest pending small receive's frames itself, interruptibly, rather than
// sleeping until the transport's thread hands the frame over. A small bucket thus goes from its
// start to its end on one thread: received, added, averaged and sent on without a hand-off, as the
// serial walk does, while several buckets stay in flight. Larger pieces keep the compute threads,
// which hide their encodes under the transfers of others. Which thread runs a step changes no bit:
// the dependencies order every step alike.
//
// The waiter drives. The communication thread's passes are a role one thread holds at a time.
// A thread in await_iteration() takes it while the communication thread has nothing in hand, and
// does the passes itself until the iteration ends: the last receive, add and epilogue then run on
// the thread that waits for them, as in Gloo, where a collective runs on its caller's thread,
// instead of ending with a wake-up of that thread. Not with coordination, whose channel is the
// communication thread's. The iteration's last bucket, where nothing started after it could hide
// under it and it has nothing of its own to hide (small, or an identity codec), the waiter does
// not even queue: it walks its steps in list order (BucketExchange::run, the serial executor's
// walk; walks_on_caller()), while the queues carry on with the buckets still in flight. Which
// buckets are walked follows from the plan alone, so it is the same on every rank.
//
// Every hand-off between threads is on the timeline (Timeline::Kind::handoff: which queue, how
// long the work waited), so a trace shows how many a bucket took.
//
// Over a device transport (transport::CudaStaged; not Nccl, whose messages match in posting
// order) a compute task queues its kernels on the transport's one stream and is done once they
// are queued: stream order carries the dependency to whatever is queued after it, and a send is
// ordered after its encode by the transport. Sends it holds back until their copies to host
// memory are done are handed on every pass (DeferredSender, concepts.hpp).
//
// Nothing is allocated per task: queues and per-step counters are sized by install().
// The transport must have no request of this engine pending when it is destroyed; the
// Synchronizer aborts the transport on failure, which settles them all.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <variant>
#include <vector>

#include "gradsync/engine/coordinator/channel.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/engine/task_job.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/transport/read_interrupt.hpp"

namespace gradsync::engine {

template <CompressionPolicy C, TransportPolicy X>
class TaskGraph final : private transport::CompletionSink {
 public:
  // A bucket's first and last tasks, which the bucket's owner (the Synchronizer) knows how to do:
  // `pack` fills its buffer before its first step, where start() was told so; `copy_back` runs
  // after its last step (the epilogue). Each runs on whichever thread takes the task, without the
  // lock; what it throws fails the iteration like any task's failure.
  struct BucketTasks {
    std::function<void(std::uint32_t bucket)> pack;
    std::function<void(std::uint32_t bucket)> copy_back;
  };

  // The largest piece (in bytes of values) whose compute runs on the communication thread, and
  // whose receive that thread reads itself (the top of this file): decoding and adding 64 KiB
  // takes about as long as one wake-up of another thread, and Tcp writes sends this small from the
  // posting thread too.
  static constexpr std::size_t short_path_bytes = std::size_t{64} << 10;

  // `spin`: how long a thread that runs out of work polls for more before it sleeps
  // (Options::spin_before_sleep). `timeline`, if given, gets the hand-offs between threads.
  TaskGraph(X& transport, const C& codec, const Group& group, int compute_threads, std::chrono::milliseconds timeout,
            BucketTasks bucket_tasks, Coordination coordination = {}, std::chrono::microseconds spin = {},
            Timeline* timeline = nullptr)
      : transport_(transport),
        codec_(codec),
        group_(group),
        timeout_(timeout),
        spin_(spin),
        bucket_tasks_(std::move(bucket_tasks)),
        timeline_(timeline) {
    if (coordination.enabled && group.size() > 1)
      channel_.emplace(transport, group, coordination, static_cast<transport::CompletionSink*>(this),
                       task_id(control_job, 0));
    reserve_completions(0);
    if (channel_) channel_->start();
    for (int i = 0; i < std::max(1, compute_threads); ++i) workers_.emplace_back([this] { compute_loop(); });
    std::lock_guard lock(mutex_);  // the thread starts once its id is known
    communication_ = std::thread([this] { communication_loop(); });
    communication_id_ = communication_.get_id();
    communicator_.store(communication_id_, std::memory_order_release);
  }

  TaskGraph(const TaskGraph&) = delete;
  TaskGraph& operator=(const TaskGraph&) = delete;

  ~TaskGraph() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      wake_all();
    }
    for (auto& worker : workers_) worker.join();
    communication_.join();
    channel_.reset();  // withdraws its standing receives, which may still report here
  }

  // Takes the buckets of a new plan, in plan order; no bucket may be running. The exchanges must
  // stay where they are until the next install().
  void install(std::span<BucketExchange<C, X>* const> exchanges) {
    std::unique_lock lock(mutex_);
    // With coordination the communication thread may be serving other ranks' reports: wait until
    // it is back under the lock before resizing what it works on.
    done_cv_.wait(lock, [&] { return !communicating_; });
    jobs_.clear();
    jobs_.resize(exchanges.size());
    std::size_t steps = 0, transfers = 0;
    for (std::size_t b = 0; b < exchanges.size(); ++b) {
      transfers += jobs_[b].install(exchanges[b], static_cast<std::uint32_t>(b), this);
      steps += jobs_[b].steps() + 2;  // with its epilogue and prologue
    }
    if (channel_) {
      sends_to_.assign(group_.members.size(), 0);
      receives_ = 0;
      for (const Job& job : jobs_)
        for (const Step& step : job.exchange->schedule().steps) {
          if (step.op == Step::Op::send) ++sends_to_[static_cast<std::size_t>(step.peer)];
          if (step.op == Step::Op::recv) ++receives_;
        }
      announce_ = true;
      wake_communication();
    }
    compute_ready_.reserve(steps);
    inline_ready_.reserve(steps);
    inlining_.reserve(steps);
    communication_ready_.reserve(transfers);
    reserve_completions(transfers);
    posting_.reserve(transfers);
    finished_.reserve(transfers);
    posted_.reserve(transfers);
    granted_.reserve(transfers);
  }

  // Starts bucket `bucket` of the installed plan on `values` (which must stay alive and untouched
  // until await_iteration() returns). `packed`: the caller has filled `values` (or the bucket needs
  // no packing); otherwise the bucket's pack task comes first, on a compute thread. `awaits_next`:
  // the caller calls await_iteration() next, with little in between, so where the communication
  // thread has nothing else in hand the bucket's first steps wait for the caller to drive them
  // (the top of this file) instead of waking it.
  void start(std::uint32_t bucket, BucketValues values, std::uint64_t iteration, bool packed,
             bool awaits_next = false) {
    std::lock_guard lock(mutex_);
    if (failed_) return;  // await_iteration() reports why
    Job& job = jobs_[bucket];
    job.restart(values, iteration);
    ++running_buckets_;
    iteration_active_ = true;
    if (awaits_next && walks_on_caller(job)) {
      job.walked = true;  // await_iteration() walks it; its transfers' reports are not the graph's
      walk_pending_ = bucket;
      walk_packed_ = packed;
      return;
    }
    if (!packed) return make_ready(bucket, job.prologue());
    quiet_ = awaits_next && !channel_ && !communicating_ && !has_communication_work();
    release_first_steps(bucket);
    quiet_ = false;
  }

  // Whether await_iteration() would return (or throw) at once. A caller that polls this instead
  // of waiting does not drive, so work start() left for the caller goes to the communication
  // thread here.
  bool iteration_over() {
    std::lock_guard lock(mutex_);
    if (quiet_after_failure()) return true;
    if (walk_pending_) {  // the caller polls instead of walking: the queues take the bucket
      const std::uint32_t bucket = *std::exchange(walk_pending_, std::nullopt);
      jobs_[bucket].walked = false;
      walk_packed_ ? release_first_steps(bucket) : make_ready(bucket, jobs_[bucket].prologue());
    }
    if (failed_ || running_buckets_ > 0 || report_finished_ || reports_pending_ ||
        (coordinating() && !everyone_finished())) {
      if (!driven_ && !communicating_ && has_communication_work()) communication_cv_.notify_one();
      return false;
    }
    return true;
  }

  // Blocks until every started bucket is done, its epilogue included, and returns what the
  // iteration cost. If a task failed, waits until no task graph thread touches a buffer any more,
  // then throws the first failure's Error (naming rank, peer, bucket and operation).
  ExchangeStats await_iteration() {
    std::unique_lock lock(mutex_);
    // Other ranks: the report that this iteration is over must have left before the caller may
    // move on (or destroy the task graph).
    const auto over = [&] {
      return (running_buckets_ == 0 && !report_finished_ && !reports_pending_) || quiet_after_failure();
    };
    if (walk_pending_) walk_on_caller(lock);
    if (!channel_) drive_until(lock, over);
    done_cv_.wait(lock, over);
    if (timeline_ && iteration_active_ && !failed_ && last_done_by_ != std::this_thread::get_id())
      timeline_->handed_off(Timeline::Queue::waiter, last_done_at_, last_done_bucket_);
    if (!failed_ && coordinating() && !done_cv_.wait_until(lock, Clock::now() + timeout_, [&] {
          return everyone_finished() || quiet_after_failure();
        }))
      fail(Error(ErrorKind::timeout,
                 {.rank = group_.members[0], .peer = group_.members[channel_behind_], .operation = "coordinator"},
                 fmt::format("group rank {} did not report the end of iteration {} within {} ms", channel_behind_,
                             iterations_, timeout_.count())));
    done_cv_.wait(lock, [&] { return !failed_ || quiet_after_failure(); });
    if (failed_) throw *error_;
    posted_.clear();
    posted_head_ = 0;
    buckets_done_ = 0;
    ++iterations_;
    iteration_active_ = false;
    return std::exchange(stats_, {});
  }

 private:
  using Clock = std::chrono::steady_clock;

  // How long one pass of the communication thread posts before it looks at completions again:
  // shorter than a 1 MiB copy, so cheap posts go in one batch and copies one or two at a time.
  static constexpr std::chrono::microseconds posting_budget{100};

  using Job = TaskJob<BucketExchange<C, X>>;
  struct Posted {
    Clock::time_point deadline;
    std::uint64_t task;
  };
  struct Completion {
    std::uint64_t task;
    Clock::time_point at;  // when the transport reported it
    bool handed = false;   // ... from a thread other than the communication thread
  };
  struct NoInterrupt {};
  static constexpr std::uint32_t control_job = 0xffffffffu;  // task ids of the coordinator channel's requests

  ExchangeContext context(const Job& job, std::uint32_t bucket) const {
    return {group_, job.iteration, bucket, timeout_};
  }

  // ---- with the lock held ----------------------------------------------------------------------

  // Room for a completion of every request that can be pending at once: completed() cannot
  // allocate, and drops what does not fit.
  void reserve_completions(std::size_t transfers) {
    const std::size_t requests = transfers + (channel_ ? channel_->requests() : 0);
    completions_.reserve(requests);
    settling_.reserve(requests);
  }

  void make_ready(std::uint32_t bucket, std::uint32_t step) {
    Job& job = jobs_[bucket];
    const std::uint64_t task = task_id(bucket, step);
    const auto queue = [&](std::vector<std::uint64_t>& heap) {
      job.ready_at[step] = Clock::now();
      job.queued_by[step] = std::this_thread::get_id();
      heap.push_back(task);
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    };
    if (step == job.prologue()) {
      queue(compute_ready_);  // a small bucket is packed by the caller itself (start's `packed`)
      wake_compute();
    } else if (step < job.steps() && is_transfer(job.exchange->schedule().steps[step].op)) {
      queue(communication_ready_);
      wake_communication();
    } else if (step < job.steps() && job.exchange->added_on_receive(step)) {
      done(task);  // an add its receive already did: handing it to a compute thread would only delay what follows
    } else if (on_short_path(job, step)) {
      queue(inline_ready_);
      wake_communication();
    } else {
      queue(compute_ready_);
      wake_compute();
    }
  }

  // Whether compute task `step` (or the epilogue) is small enough for the communication thread.
  static bool on_short_path(const Job& job, std::uint32_t step) {
    const std::size_t elements = step == job.steps()
                                     ? std::visit([](auto values) { return values.size(); }, job.values)
                                     : job.exchange->schedule().steps[step].range.size();
    return elements * value_bytes(job.values) <= short_path_bytes;
  }

  // Whether a bucket started with `awaits_next` is walked by the caller in await_iteration(), in
  // list order on its own thread (BucketExchange::run, the serial executor's walk) rather than
  // through the queues. Nothing started after it could hide under it, so the queues pay off only
  // where its own encodes hide under its own transfers: not for a bucket small enough for the
  // short path (latency-bound), nor with an identity codec (nothing to encode; its adds follow
  // their receives in list order). Decided by the plan alone (the codec, the bucket's size and
  // place), so every rank walks the same buckets. Not with coordination, whose grants the walk
  // would not wait for, nor over a device transport, whose stream the graph's tasks share.
  bool walks_on_caller(const Job& job) const {
    if constexpr (DeviceTransport<X>) return false;
    if (channel_) return false;
    const std::size_t bytes = std::visit([](auto values) { return values.size_bytes(); }, job.values);
    return C::identity || bytes <= short_path_bytes;
  }

  // With the lock held, and held again on return: walks the bucket start() left for the caller
  // (walks_on_caller()), its pack and copy back included, then ends it like any other.
  void walk_on_caller(std::unique_lock<std::mutex>& lock) {
    const std::uint32_t bucket = *std::exchange(walk_pending_, std::nullopt);
    Job& job = jobs_[bucket];
    if (failed_) {  // await_iteration() throws the failure
      job.walked = false;
      return done(task_id(bucket, job.steps()));
    }
    walking_ = true;
    // The walk's transfers are in flight for as long as it runs: its span counts as the graph's.
    if (in_flight_++ == 0) in_flight_since_ = Clock::now();
    lock.unlock();
    std::optional<Error> error;
    ExchangeStats walked;
    const auto in_bucket = [&](const char* operation) {
      return ErrorContext{.rank = group_.members[group_.rank], .bucket = bucket, .operation = operation};
    };
    try {
      if (!walk_packed_) bucket_tasks_.pack(bucket);
      walked = std::visit([&](auto values) { return job.exchange->run(values, codec_, transport_, context(job, bucket)); },
                          job.values);
      const auto started = Clock::now();
      bucket_tasks_.copy_back(bucket);
      walked.compute += Clock::now() - started;
    } catch (const Error& e) {
      error = e.filled(in_bucket("walk"));
    } catch (const std::exception& e) {  // a codec's or a policy's own exception
      error = Error(ErrorKind::internal, in_bucket("compute"), e.what());
    }
    lock.lock();
    walking_ = false;
    if (--in_flight_ == 0) stats_.in_flight += Clock::now() - in_flight_since_;
    job.walked = false;
    stats_ += walked;
    if (error) return fail(std::move(*error));
    done(task_id(bucket, job.steps()));
  }

  // With the lock held: bucket `bucket`'s values are packed, so the steps that depend on nothing
  // are ready (or, with nothing to exchange, the epilogue).
  void release_first_steps(std::uint32_t bucket) {
    Job& job = jobs_[bucket];
    if (job.left == 0) return make_ready(bucket, job.steps());
    for (std::uint32_t s = 0; s < job.steps(); ++s)
      if (job.waiting[s] == 0) make_ready(bucket, s);
  }

  // Task done: its successors may become ready; the bucket's pack readies its first steps, its last
  // step readies its epilogue, and the epilogue ends the bucket.
  void done(std::uint64_t task) {
    const std::uint32_t bucket = bucket_of(task), step = step_of(task);
    Job& job = jobs_[bucket];
    if (step == job.prologue()) return release_first_steps(bucket);
    if (step == job.steps()) {
      if (--running_buckets_ == 0) {
        last_done_at_ = Clock::now();
        last_done_by_ = std::this_thread::get_id();
        last_done_bucket_ = bucket;
        done_cv_.notify_all();
        if (driven_) wake_communication();  // the driving waiter sleeps on driver_cv_
      }
      if (channel_ && ++buckets_done_ == jobs_.size()) {
        report_finished_ = true;
        wake_communication();
      }
      return;
    }
    const Dependencies& graph = job.graph;
    for (std::uint32_t i = graph.first[step]; i < graph.first[step + 1]; ++i)
      if (--job.waiting[graph.successors[i]] == 0) make_ready(bucket, graph.successors[i]);
    if (--job.left == 0) make_ready(bucket, job.steps());
  }

  void fail(Error e) {
    if (failed_) return;
    failed_ = true;
    error_ = std::move(e);
    wake_all();
    done_cv_.notify_all();
  }

  // With the lock held: there is work for a compute thread, for the communication thread, or
  // for every thread (a failure, the end).
  void wake_compute() {
    compute_posted_.fetch_add(1, std::memory_order_release);
    compute_cv_.notify_one();
  }
  void wake_communication() {
    communication_posted_.fetch_add(1, std::memory_order_release);
    if (quiet_) return;
    (driven_ ? driver_cv_ : communication_cv_).notify_one();
    interrupt_reading();
  }
  void wake_all() {
    compute_posted_.fetch_add(1, std::memory_order_release);
    communication_posted_.fetch_add(1, std::memory_order_release);
    compute_cv_.notify_all();
    communication_cv_.notify_all();
    driver_cv_.notify_all();
    interrupt_reading();
  }
  // The communication thread, reading its own frames, has other work now.
  void interrupt_reading() {
    if constexpr (CallerReader<X>)
      if (reading_ && std::this_thread::get_id() != communicator()) interrupt_.raise();
  }

  // The thread that holds the communication role now (the top of this file).
  std::thread::id communicator() const noexcept { return communicator_.load(std::memory_order_acquire); }

  // With the lock held, before a thread sleeps for want of work: polls its queue's counter
  // (`posted`) for up to spin_, and not past `limit`, with the lock released; returns whether
  // `has_work` holds then. Waking a sleeping thread costs tens of microseconds (a condition
  // variable's futex), more than a piece's work on a GPU under MPS (bench/README.md, "The
  // hand-offs"); a thread that is still polling sees new work at once. Work another thread took
  // first does not end the polling.
  template <class HasWork>
  bool spin_for_work(std::unique_lock<std::mutex>& lock, const std::atomic<std::uint64_t>& posted, HasWork has_work,
                     Clock::time_point limit = Clock::time_point::max()) {
    if (has_work() || spin_.count() == 0) return has_work();
    const auto until = std::min(Clock::now() + spin_, limit);
    for (;;) {
      const std::uint64_t seen = posted.load(std::memory_order_acquire);
      lock.unlock();
      while (posted.load(std::memory_order_acquire) == seen && Clock::now() < until) std::this_thread::yield();
      lock.lock();
      if (has_work() || Clock::now() >= until) return has_work();
    }
  }

  bool quiet_after_failure() const { return failed_ && running_compute_ == 0 && !communicating_ && !walking_; }

  bool coordinating() const { return channel_ && group_.rank == 0; }
  bool everyone_finished() const { return finished_everywhere_ > iterations_; }

  // ---- the compute queue -----------------------------------------------------------------------

  void compute_loop() {
    if constexpr (DeviceTransport<X>) transport_.cuda_stream().make_current();  // this thread's device
    std::unique_lock lock(mutex_);
    for (;;) {
      const auto has_work = [&] { return stopping_ || (!failed_ && !compute_ready_.empty()); };
      if (!spin_for_work(lock, compute_posted_, has_work)) compute_cv_.wait(lock, has_work);
      if (stopping_) return;
      std::pop_heap(compute_ready_.begin(), compute_ready_.end(), std::greater<>{});
      const std::uint64_t task = compute_ready_.back();
      compute_ready_.pop_back();
      const auto started = Clock::now();
      took(Timeline::Queue::compute, task, started);
      ++running_compute_;
      lock.unlock();

      std::optional<Error> error = compute(task);
      const auto ended = Clock::now();

      lock.lock();
      --running_compute_;
      stats_.compute += ended - started;
      if (error)
        fail(std::move(*error));
      else if (!failed_)
        done(task);
      if (quiet_after_failure()) done_cv_.notify_all();
    }
  }

  // With the lock held: this thread takes queued task `task` at `now`; the wait is a hand-off
  // where another thread queued it, and counts as queued time for a compute task.
  void took(Timeline::Queue queue, std::uint64_t task, Clock::time_point now) {
    const Job& job = jobs_[bucket_of(task)];
    if (step_of(task) >= job.steps() || !is_transfer(job.exchange->schedule().steps[step_of(task)].op))
      stats_.queued += now - job.ready_at[step_of(task)];
    if (timeline_ && job.queued_by[step_of(task)] != std::this_thread::get_id())
      timeline_->handed_off(queue, job.ready_at[step_of(task)], bucket_of(task));
  }

  // Runs compute task `task` (or the bucket's pack or epilogue), without the lock; returns its failure.
  std::optional<Error> compute(std::uint64_t task) {
    const std::uint32_t bucket = bucket_of(task), step = step_of(task);
    Job& job = jobs_[bucket];
    try {
      if (step == job.prologue())
        bucket_tasks_.pack(bucket);
      else if (step == job.steps())
        bucket_tasks_.copy_back(bucket);
      else
        std::visit([&](auto values) { job.exchange->compute(step, values, codec_); }, job.values);
    } catch (const Error& e) {
      return step >= job.steps() ? e.filled({.rank = group_.members[group_.rank],
                                             .bucket = bucket,
                                             .operation = step == job.prologue() ? "pack" : "copy back"})
                                 : job.exchange->located(e, step, context(job, bucket));
    } catch (const std::exception& e) {
      return Error(ErrorKind::internal, {.rank = group_.members[group_.rank], .bucket = bucket, .operation = "compute"},
                   e.what());
    }
    return std::nullopt;
  }

  // ---- the communication queue -----------------------------------------------------------------

  // Posts transfer `task` (communication thread, without the lock).
  void post(std::uint64_t task, ExchangeStats& sent) {
    Job& job = jobs_[bucket_of(task)];
    std::visit([&](auto values) { job.exchange->post(step_of(task), values, transport_, context(job, bucket_of(task)), sent); },
               job.values);
  }

  // With the lock held: moves past transfers already settled; true if one is still pending.
  bool oldest_pending() {
    for (; posted_head_ < posted_.size(); ++posted_head_) {
      const std::uint64_t task = posted_[posted_head_].task;
      if (!jobs_[bucket_of(task)].settled[step_of(task)]) return true;
    }
    return false;
  }

  // Called by the transport, possibly under its lock: only records the completion.
  void completed(std::uint64_t task) noexcept override {
    const bool handed = std::this_thread::get_id() != communicator();
    std::lock_guard lock(mutex_);
    if (failed_ || completions_.size() == completions_.capacity()) return;
    if (bucket_of(task) != control_job && jobs_[bucket_of(task)].walked) return;  // the walk waits for it itself
    completions_.push_back({task, Clock::now(), handed});
    wake_communication();
  }

  // What one pass of the communication thread takes on, decided under the lock.
  struct Pass {
    bool overdue = false;             // the oldest pending transfer is past its deadline
    Posted oldest;                    // ... that transfer
    bool finished_iteration = false;  // every bucket is done: report it to the coordinator
    bool announce = false;            // a new plan's sends and receives: announce them
    bool active = false;              // a bucket was started since the last await_iteration()
    std::uint64_t iterations = 0;     // await_iteration() calls that had returned
  };

  // The communication thread: sleeps until there is work (or the oldest pending transfer's
  // deadline), takes it under the lock, does it without, and records the outcome under the lock.
  void communication_loop() {
    if constexpr (DeviceTransport<X>) transport_.cuda_stream().make_current();  // this thread's device
    std::unique_lock lock(mutex_);
    for (;;) {
      sleep_until_work(lock, [] { return false; });
      if (stopping_) return;
      if (failed_ || driven_) continue;
      pass(lock);
    }
  }

  // With the lock held: a thread in await_iteration() does the communication thread's passes
  // (the top of this file) until `over`, once that thread is out of its own. The role goes back
  // with whatever work is left.
  template <class Over>
  void drive_until(std::unique_lock<std::mutex>& lock, Over over) {
    while (!over() && !failed_ && communicating_) {
      wants_role_ = true;
      interrupt_reading();
      done_cv_.wait(lock, [&] { return over() || failed_ || !communicating_; });
    }
    // The communication thread may have left work it saw while the role was wanted.
    if (std::exchange(wants_role_, false) && (over() || failed_) && has_communication_work())
      communication_cv_.notify_one();
    if (over() || failed_) return;
    driven_ = true;
    communicator_.store(std::this_thread::get_id(), std::memory_order_release);
    while (!over() && !failed_) {
      sleep_until_work(lock, over);
      if (over() || failed_) break;
      pass(lock);
    }
    driven_ = false;
    communicator_.store(communication_id_, std::memory_order_release);
    if (has_communication_work()) communication_cv_.notify_one();  // the role is back, with work
  }

  // With the lock held, and held again on return: one pass of the communication role.
  void pass(std::unique_lock<std::mutex>& lock) {
    {
      const Pass pass = take_work();
      lock.unlock();

      std::optional<Error> error;
      ExchangeStats sent;
      try {
        if (pass.announce) {
          working_on_ = task_id(control_job, 0);
          channel_->announce(announced_, announced_receives_);
        }
        error = run_inline(sent);
        if (!error) {
          post_ready(sent);
          settle_completions();
          if constexpr (DeferredSender<X>) holding_back_ = transport_.post_deferred();
          if (channel_) serve_coordinator(pass, sent);
          if (pass.overdue) expire(pass.oldest);
        }
      } catch (const Error& e) {
        error = located(e, working_on_);
      }
      const auto now = Clock::now();

      lock.lock();
      record(now, sent, std::move(error));
    }
  }

  // With the lock held: there is something for the communication role to do.
  bool has_communication_work() const {
    return !failed_ && (!communication_ready_.empty() || !inline_ready_.empty() || !completions_.empty() ||
                        report_finished_ || announce_);
  }

  // With the lock held.
  // With the lock held, for the role's holder: sleeps until there is work or `over`. The
  // communication thread, while a waiter drives, sleeps until the role comes back.
  template <class Over>
  void sleep_until_work(std::unique_lock<std::mutex>& lock, Over over) {
    const auto me = std::this_thread::get_id();
    const auto has_work = [&] {
      return stopping_ || over() ||
             (communicator() == me && (driven_ || !wants_role_) && has_communication_work());
    };
    std::condition_variable& cv = driven_ && communicator() == me ? driver_cv_ : communication_cv_;
    if (communicator() != me || (wants_role_ && !driven_)) return cv.wait(lock, has_work);
    // A transport holding sends back (DeferredSender) is looked at again soon: nothing else
    // would wake this thread when they can go. Polling for work, and reading frames, end then
    // too, and by the oldest pending transfer's deadline.
    const auto soon = Clock::now() + deferred_poll;
    const Clock::time_point wake_at = std::min(holding_back_ && !failed_ ? soon : Clock::time_point::max(),
                                               !failed_ && oldest_pending() ? posted_[posted_head_].deadline
                                                                            : Clock::time_point::max());
    if (spin_.count() > 0 && spin_for_work(lock, communication_posted_, has_work, wake_at)) return;
    if constexpr (CallerReader<X>)
      if (!has_work() && !wants_role_) read_own_frames(lock, wake_at);
    if (wake_at == Clock::time_point::max())
      cv.wait(lock, has_work);
    else
      cv.wait_until(lock, wake_at, has_work);
  }

  // With the lock held, with nothing else to do: reads the oldest pending small receive's frames
  // on this thread (the short path, the top of this file) until it settles, `until`, or new work
  // interrupts it. Its completion comes to completed() from this thread, so no hand-off.
  void read_own_frames(std::unique_lock<std::mutex>& lock, Clock::time_point until)
    requires CallerReader<X>
  {
    if (failed_ || !oldest_pending()) return;
    typename X::Request* receive = nullptr;
    for (std::size_t i = posted_head_; i < posted_.size() && !receive; ++i) {
      const std::uint64_t task = posted_[i].task;
      Job& job = jobs_[bucket_of(task)];
      const Step& step = job.exchange->schedule().steps[step_of(task)];
      if (step.op == Step::Op::recv && !job.settled[step_of(task)] &&
          step.range.size() * value_bytes(job.values) <= short_path_bytes)
        receive = &job.exchange->request(step_of(task));
    }
    if (!receive) return;
    reading_ = true;
    communicating_ = true;  // in the transport with a job's request: install() and failures wait
    lock.unlock();
    try {
      transport_.read_until(*receive, until, interrupt_);
    } catch (const Error&) {
      // The receive failed: its completion, reported like any other, carries the Error.
    }
    lock.lock();
    reading_ = false;
    communicating_ = false;
    if (channel_ || wants_role_ || quiet_after_failure()) done_cv_.notify_all();
  }

  // The compute tasks take_work() found for this thread (the short path), run in queue order
  // until one fails (its Error returned); record() finishes them.
  std::optional<Error> run_inline(ExchangeStats& ran) {
    for (std::uint64_t task : inlining_) {
      const auto started = Clock::now();
      if (std::optional<Error> error = compute(task)) return error;
      ran.compute += Clock::now() - started;
    }
    return std::nullopt;
  }

  // With the lock held: moves ready transfers to `posting_` (in queue order) and reported
  // completions to `settling_`, and notes what else this pass must do.
  Pass take_work() {
    Pass pass;
    const auto now = Clock::now();
    pass.overdue = oldest_pending() && now >= posted_[posted_head_].deadline;
    if (pass.overdue) pass.oldest = posted_[posted_head_];
    const auto take = [&](std::vector<std::uint64_t>& heap, std::vector<std::uint64_t>& batch, Timeline::Queue queue) {
      while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
        batch.push_back(heap.back());
        heap.pop_back();
        took(queue, batch.back(), now);
      }
    };
    take(inline_ready_, inlining_, Timeline::Queue::communication);
    take(communication_ready_, posting_, Timeline::Queue::communication);
    posted_count_ = 0;
    std::swap(completions_, settling_);
    if (timeline_)
      for (const Completion& c : settling_)
        if (c.handed) timeline_->handed_off(Timeline::Queue::completion, c.at, bucket_of(c.task));
    pass.finished_iteration = std::exchange(report_finished_, false);
    if (pass.finished_iteration) reports_pending_ = true;  // until this pass has posted the report
    pass.announce = std::exchange(announce_, false);
    if (pass.announce) {
      announced_ = sends_to_;
      announced_receives_ = receives_;
    }
    pass.active = iteration_active_;
    pass.iterations = iterations_;
    communicating_ = true;
    return pass;
  }

  // Posts the transfers in `posting_`, in queue order, until the pass has taken `posting_budget`;
  // with coordination a send is reported and held for its grant instead, and a posted receive is
  // reported. A post that meets its other half may copy the message itself (shared memory, ranks
  // that are threads), so a batch can take milliseconds: what is left goes back to the queue
  // (record()), and a transfer that became ready meanwhile, earlier in the schedule, goes first.
  void post_ready(ExchangeStats& sent) {
    const auto started = Clock::now();
    for (std::uint64_t task : posting_) {
      if (posted_count_ > 0 && Clock::now() - started > posting_budget) break;
      ++posted_count_;
      working_on_ = task;
      Job& job = jobs_[bucket_of(task)];
      const Step& step = job.exchange->schedule().steps[step_of(task)];
      if (channel_ && step.op == Step::Op::send) {
        job.held[step_of(task)] = 1;
        ++holding_;
        job.ready_at[step_of(task)] = Clock::now();
        channel_->ready(task, step.peer, make_tag(job.iteration, bucket_of(task), step.message),
                        job.exchange->send_bytes(step_of(task), value_bytes(job.values)));
      } else {
        post(task, sent);
        if (channel_) channel_->receiving(step.peer, make_tag(job.iteration, bucket_of(task), step.message));
      }
    }
  }

  // Takes every completion in `settling_`: a finished receive's size is checked, a finished send
  // is reported to the coordinator; both go to `finished_`. The channel's own requests go to it.
  void settle_completions() {
    for (const Completion& completion : settling_) {
      const std::uint64_t task = completion.task;
      working_on_ = task;
      if (bucket_of(task) == control_job) {
        channel_->completed(step_of(task), granted_, timeout_);
        continue;
      }
      Job& job = jobs_[bucket_of(task)];
      const Step& step = job.exchange->schedule().steps[step_of(task)];
      const std::size_t bytes = transport_.wait(job.exchange->request(step_of(task)), Clock::now() + timeout_);
      job.exchange->transfer_done(step_of(task), bytes);
      if (step.op == Step::Op::recv)
        std::visit(
            [&](auto values) {
              job.exchange->template received<typename decltype(values)::value_type>(step_of(task), bytes);
            },
            job.values);
      else if (channel_)
        channel_->sent(step.peer);
      finished_.push_back(task);
    }
  }

  // Coordination: sends this rank's report (or, on the coordinator, plans and sends grants), posts
  // the sends granted to this rank, and fails if a peer whose reports or grants are still needed
  // has gone.
  void serve_coordinator(const Pass& pass, ExchangeStats& sent) {
    working_on_ = task_id(control_job, 0);
    if (pass.finished_iteration) channel_->finished();
    channel_->flush(granted_);
    for (std::uint64_t task : granted_) {
      working_on_ = task_id(control_job, 0);
      Job* job = bucket_of(task) < jobs_.size() ? &jobs_[bucket_of(task)] : nullptr;
      if (!job || step_of(task) >= job->steps() || !job->held[step_of(task)])
        throw Error(ErrorKind::protocol,
                    {.rank = group_.members[group_.rank], .peer = group_.members[0], .operation = "coordinator grant"},
                    fmt::format("grant for bucket {} step {}, which is not waiting for one", bucket_of(task),
                                step_of(task)));
      working_on_ = task;
      job->held[step_of(task)] = 0;
      --holding_;
      sent.awaiting_grant += Clock::now() - job->ready_at[step_of(task)];
      post(task, sent);
    }
    granted_.clear();
    working_on_ = task_id(control_job, 0);
    // A peer whose reports or grants are gone matters only while something waits on them.
    if (const auto& lost = channel_->lost();
        lost && (group_.rank == 0 ? pass.active && channel_->finished_by(channel_->lost_peer()) <= pass.iterations
                                  : holding_ > 0))
      throw *lost;
  }

  // The oldest pending transfer is past its deadline: the transport withdraws it and throws,
  // unless it has just completed (then its report is already on the way).
  void expire(const Posted& oldest) {
    working_on_ = oldest.task;
    if (jobs_[bucket_of(oldest.task)].held[step_of(oldest.task)])
      throw Error(ErrorKind::timeout, {},
                  fmt::format("no grant from the coordinator (rank {}) within {} ms", group_.members[0],
                              timeout_.count()));
    transport_.wait(jobs_[bucket_of(oldest.task)].exchange->request(step_of(oldest.task)), oldest.deadline);
  }

  // `e`, raised while working on `task`, with rank, peer, bucket and operation filled in.
  Error located(const Error& e, std::uint64_t task) const {
    if (bucket_of(task) == control_job) return e.filled({.rank = group_.members[group_.rank], .operation = "coordinator"});
    const Job& job = jobs_[bucket_of(task)];
    return job.exchange->located(e, step_of(task), context(job, bucket_of(task)));
  }

  // With the lock held: the pass's outcome. Posted transfers get their deadlines, finished ones
  // are settled and free their successors (unless the pass failed), and the counters advance.
  void record(Clock::time_point now, const ExchangeStats& sent, std::optional<Error> error) {
    communicating_ = false;
    if (channel_ || wants_role_) done_cv_.notify_all();  // install(), or a waiter for the role, may be waiting for this
    stats_.compute += sent.compute;
    for (std::size_t i = 0; i < posting_.size(); ++i) {
      const std::uint64_t task = posting_[i];
      if (i >= posted_count_) {  // the pass ran out of time before this one
        communication_ready_.push_back(task);
        std::push_heap(communication_ready_.begin(), communication_ready_.end(), std::greater<>{});
        continue;
      }
      if (in_flight_++ == 0) in_flight_since_ = now;
      posted_.push_back({now + timeout_, task});
    }
    for (std::uint64_t task : finished_) {
      jobs_[bucket_of(task)].settled[step_of(task)] = 1;
      if (--in_flight_ == 0) stats_.in_flight += now - in_flight_since_;
    }
    stats_.bytes_sent += sent.bytes_sent;
    stats_.bytes_uncompressed += sent.bytes_uncompressed;
    stats_.awaiting_grant += sent.awaiting_grant;
    if (channel_) {
      reports_pending_ = channel_->reports_pending();
      if (!reports_pending_) done_cv_.notify_all();
      stats_.control_bytes += channel_->bytes_sent() - control_bytes_counted_;
      control_bytes_counted_ = channel_->bytes_sent();
      if (coordinating()) {
        finished_everywhere_ = channel_->finished_everywhere();
        channel_behind_ = channel_->first_behind(iterations_ + 1);
        done_cv_.notify_all();
      }
    }
    if (error) {
      fail(std::move(*error));
    } else {
      for (std::uint64_t task : inlining_) done(task);
      for (std::uint64_t task : finished_) done(task);
    }
    posting_.clear();
    inlining_.clear();
    settling_.clear();
    finished_.clear();
    if (quiet_after_failure()) done_cv_.notify_all();
  }

  X& transport_;
  const C& codec_;
  const Group& group_;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds spin_;
  BucketTasks bucket_tasks_;

  std::mutex mutex_;
  std::condition_variable compute_cv_;
  std::condition_variable communication_cv_;
  std::condition_variable done_cv_;
  // Bumped, with the lock held, whenever work is added for that kind of thread (wake_compute(),
  // wake_communication()): what a polling thread watches without the lock.
  std::atomic<std::uint64_t> compute_posted_{0};
  std::atomic<std::uint64_t> communication_posted_{0};
  std::vector<Job> jobs_;
  std::vector<std::uint64_t> compute_ready_;        // min-heap: oldest bucket, then schedule order
  std::vector<std::uint64_t> inline_ready_;         // min-heap of compute tasks on the short path
  std::vector<std::uint64_t> communication_ready_;  // min-heap, likewise
  std::vector<Completion> completions_;             // reported by the transport, not yet settled
  std::vector<Posted> posted_;                      // this iteration's transfers, in posting order
  std::size_t posted_head_ = 0;                     // the oldest that may still be pending
  std::size_t running_buckets_ = 0;
  // The iteration's last step: when, on which thread, of which bucket (for the waiter's hand-off).
  Clock::time_point last_done_at_;
  std::thread::id last_done_by_;
  std::uint32_t last_done_bucket_ = 0;
  std::size_t running_compute_ = 0;
  bool communicating_ = false;  // the communication thread is working outside the lock
  std::size_t in_flight_ = 0;  // transfers posted and not yet finished, a walk on the caller counting as one
  Clock::time_point in_flight_since_;
  bool failed_ = false;
  bool stopping_ = false;
  std::optional<Error> error_;
  ExchangeStats stats_;

  // The communication thread's batches, kept here so that their capacity is reused.
  std::vector<std::uint64_t> posting_;
  std::size_t posted_count_ = 0;  // how many of posting_ this pass posted
  std::vector<std::uint64_t> inlining_;  // short-path compute tasks this pass runs
  std::vector<Completion> settling_;
  std::vector<std::uint64_t> finished_;
  std::uint64_t working_on_ = 0;  // the communication thread's current task, to locate its errors
  // The transport holds sends back (DeferredSender): the communication thread's own, looked at
  // again after deferred_poll. A copy of a piece to host memory takes tens of microseconds.
  bool holding_back_ = false;
  static constexpr std::chrono::microseconds deferred_poll{20};
  // The communication role (the top of this file): the communication thread's id, set as it
  // starts; who holds the role now (read without the lock by completed()); whether a waiter holds
  // it (driven_), sleeping on driver_cv_, or wants it once the communication thread is out of its pass.
  std::thread::id communication_id_;
  std::atomic<std::thread::id> communicator_{};
  bool driven_ = false;
  bool wants_role_ = false;
  bool quiet_ = false;  // start(awaits_next): what it readies waits for the caller, who drives next
  std::optional<std::uint32_t> walk_pending_;  // start(awaits_next) left this bucket for the caller's walk
  bool walk_packed_ = false;                   // ... packed already
  bool walking_ = false;                       // the caller walks it, outside the lock
  std::condition_variable driver_cv_;
  // The short path's reading (read_own_frames): the communication thread is in the transport
  // reading its own frames; raising the interrupt brings it back.
  bool reading_ = false;
  [[no_unique_address]] std::conditional_t<CallerReader<X>, transport::ReadInterrupt, NoInterrupt> interrupt_;
  Timeline* timeline_ = nullptr;

  // Coordination: the channel is used by the communication thread only; the rest under the lock.
  std::optional<CoordinatorChannel<X>> channel_;
  std::vector<std::uint64_t> granted_;  // sends the coordinator has just granted this rank
  std::size_t holding_ = 0;             // sends waiting for a grant
  std::vector<std::size_t> sends_to_;   // install(): sends per destination in the new plan
  std::size_t receives_ = 0;            // ... and its receives
  bool announce_ = false;               // ... not yet announced to the coordinator
  std::vector<std::size_t> announced_;  // the communication thread's copies
  std::size_t announced_receives_ = 0;
  std::uint64_t control_bytes_counted_ = 0;
  std::size_t buckets_done_ = 0;           // epilogues run since the last await_iteration()
  bool report_finished_ = false;           // every bucket is done: tell the coordinator
  bool reports_pending_ = false;           // the channel has report entries not yet posted
  bool iteration_active_ = false;          // a bucket was started since the last await_iteration()
  std::uint64_t iterations_ = 0;           // await_iteration() calls that returned
  std::uint64_t finished_everywhere_ = 0;  // coordinator: iterations every rank has reported finished
  int channel_behind_ = 0;                 // coordinator: a rank that has not, for the error message

  std::vector<std::thread> workers_;
  std::thread communication_;
};

}  // namespace gradsync::engine
