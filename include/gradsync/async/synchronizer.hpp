#pragma once
// async::Synchronizer — a parameter server whose workers do not wait for each other (the fourth
// source document): pushes and pulls run on a communication thread while the trainer computes,
// each server forms an iteration's global gradient from the first M of the N workers' pushes, a
// worker applies every global gradient once as it comes (its own gradient standing in until then),
// never more than `staleness` iterations behind, and every `period` iterations the workers'
// parameters are averaged.
//
// Roles, each owning its state (async/): every rank is a Worker (worker.hpp: its gradient cut into
// N parts, pushed, the global gradients pulled and applied) and a PartServer of one part
// (server.hpp: part p served by group rank p, co-located as topology::ParameterServer's); a
// PeriodAverage (period_average.hpp) averages the registered parameters. They post through one
// Messages (messages.hpp: the wire format, the requests, the inbox). A worker talks to the server
// of its own part through the transport too (every transport carries messages to itself). This
// class is where they meet: the trainer's calls, the communication thread, the dead-peer policy.
//
// An iteration t, on the trainer's thread: ready() for every gradient (the last one wakes the
// communication thread, which packs and pushes them); wait() leaves in the gradients what this
// iteration applies, blocking while a part's newest global gradient is older than t - staleness
// (staleness 0: it waits for iteration t itself and applies exactly g_t); the trainer updates its
// parameters, then parameters_updated(), which at the end of every period of `period` iterations
// waits for the parameters' average. With staleness 0 and quorum N (any period) every wait()
// applies exactly g_t, and with period 1 the result is, bit for bit, the synchronous parameter
// server's (topology::ParameterServer, co-located, identity codec, any bucketing): every element
// summed in group order, the same division; the period average of identical parameters is
// accumulated in f64 and so gives them back unchanged. (With a lossy codec a server's own
// worker's part is encoded too, where the synchronous server adds its raw values.) Every rank
// calls finish() after its last wait(): servers keep answering until every worker has finished.
//
// Gradients are registered as the Synchronizer's are (engine::Gradients: add(name, TensorView), f32
// or f16/bf16 averaged in f32, host or CUDA memory staged through the host; a host transport only),
// and at the first ready() or wait() the ranks check they registered the same gradients,
// parameters and settings (engine::agree_on_layout): each is told what differs.
//
// A dead rank. When the transport says a peer failed (Error(peer_failed) naming it, for a message
// to or from it: a killed process over Tcp or SharedMemory), the others go on without it as long
// as the quorum can still be met (at most N - M dead); one more is an Error naming it. Its server
// is gone with it, so its part keeps each worker's local gradient from then on, and period
// averages cover the live workers; StepReport::lost_workers names the dead. With quorum N every
// death is an Error. (A rank that aborts fails the transport for everyone, which no quorum hides.)
// Once this rank is in finish(), a peer that goes is not a failure: ranks close only after every
// worker has finished.
//
// Timeline. With Options::timeline (or GRADSYNC_TIMELINE) set, each rank writes Chrome trace
// events (timeline.hpp) when it is destroyed: ready marks and wait() on the trainer's thread;
// every push, pull, reply, parameter and average message as a transfer from posting to completion
// (its "bucket" is the part it carries); the encodes and decodes of pushes and global gradients.
//
// Not yet: dedicated servers and partition counts other than N (a dead rank's part could then move
// to a live server); f64 gradients; a bucketing policy (one bucket, pushed once backward is done).

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/async/messages.hpp"
#include "gradsync/async/options.hpp"
#include "gradsync/async/period_average.hpp"
#include "gradsync/async/server.hpp"
#include "gradsync/async/worker.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/settings.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/engine/gradients.hpp"
#include "gradsync/error.hpp"
#include "gradsync/log.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/types.hpp"

namespace gradsync::async {

template <CompressionPolicy C, TransportPolicy X>
class Synchronizer {
  static_assert(!DeviceTransport<X>, "async::Synchronizer works in host memory: give it a host transport");
  static_assert(!OrderMatchedTransport<X>, "async::Synchronizer's messages come in the workers' own order, which a "
                                           "transport matching by posting order (transport::Nccl) cannot carry");

 public:
  Synchronizer(X transport, Options options = {}, C codec = {})
      : transport_(std::move(transport)),
        options_(options),
        codec_(std::move(codec)),
        group_(Group::world(transport_.rank(), transport_.size())),
        n_(group_.size()),
        quorum_(options.quorum == 0 ? n_ : options.quorum),
        gradients_(transport_),
        messages_(transport_, group_, nullptr, [this](int peer, const Error& e) { leave_behind(peer, e); }),
        period_(messages_) {
    check(options_, n_, transport_.rank());
    gradsync::detail::validate_policy(codec_);
    gradients_.open_timeline(options_.timeline, fmt::format("{}.async", transport_.rank()), options_.timeline_events,
                             log_to_stderr);
    messages_.trace_into(gradients_.timeline());
  }

  Synchronizer(const Synchronizer&) = delete;
  Synchronizer& operator=(const Synchronizer&) = delete;

  // Finishes (unless an exception is unwinding the trainer, or synchronization failed), settles
  // what is still posted and stops. Unfinished, it aborts the transport: the peers fail fast.
  ~Synchronizer() {
    if (!thread_.joinable()) return;
    if (!finished_ && std::uncaught_exceptions() == 0) {
      try {
        finish();
      } catch (const Error&) {
      }
    }
    messages_.stop();
    thread_.join();
    if (!finished_) transport_.abort(Error(ErrorKind::peer_failed, here("shutdown"),
                                           "the asynchronous synchronizer was destroyed before finish()"));
    // The server's standing receives and unanswered pulls or replies: taken back.
    messages_.withdraw(finished_ ? Clock::now() : Clock::now() + options_.timeout);
  }

  // Ends training on this rank: tells every server so, and keeps serving this rank's part until
  // every worker has said the same, so that no worker's last pull goes unanswered. Every rank
  // calls it once, after its last wait() (the destructor does, if the trainer did not).
  void finish() {
    if (!thread_.joinable() || finished_) return;
    std::unique_lock lock(mutex_);
    finishing_ = true;
    lock.unlock();
    messages_.wake();
    lock.lock();
    if (!state_cv_.wait_until(lock, Clock::now() + options_.timeout, [&] {
          return error_ || (everyone_done() && done_posted_ && done_sends_left() == 0);
        }))
      throw Error(ErrorKind::timeout, here("finish"),
                  fmt::format("{} of {} workers finished within {} ms",
                              std::count(done_from_.begin(), done_from_.end(), 1), n_, options_.timeout.count()));
    if (error_) throw *error_;
    finished_ = true;
  }

  // Registers a gradient (f32, or f16/bf16 averaged in f32; in host or CUDA device memory, staged
  // through host memory) in the same order on every rank, before the first ready() or wait(). The
  // ranks check at the first of those that they registered the same gradients and settings.
  GradId add(std::string name, TensorView gradient) {
    if (accumulation_dtype(gradient.dtype) != DType::f32)
      throw Error(ErrorKind::unsupported, here("add"),
                  fmt::format("gradient {:?} is {}; the asynchronous parameter server averages f32, f16 and bf16 "
                              "gradients (in f32)",
                              name, to_string(gradient.dtype)));
    return gradients_.add(std::move(name), gradient);
  }

  // Registers parameters for the period average (f32, the same sizes in the same order on every
  // rank), before the first ready().
  void add_parameters(std::span<float> parameters) {
    if (thread_.joinable())
      throw Error(ErrorKind::invalid_argument, here("add_parameters"), "parameters registered after the first ready()");
    period_.add(parameters);
  }

  // Marks gradient `id` as holding this iteration's local value; the last one starts the push.
  void ready(GradId id) {
    if (!thread_.joinable()) start();
    if (gradients_.mark(id, iteration_).bucket_complete) messages_.wake();
  }

  // Leaves in the gradients what this iteration applies, part by part (see the top of this file),
  // and readies the next iteration. Throws Error(timeout) naming the parts that stayed too old.
  void wait() { wait(options_.staleness); }

  // wait() with a tighter bound for this iteration only, 0 <= staleness <= Options::staleness.
  // wait(0) blocks until every part's global gradient of this iteration has come, so what it
  // leaves brings the worker to every global gradient up to now with no stand-in left in its
  // parameters: the model to evaluate or save at the end of an epoch or of training (on fmnist,
  // worth 1.9 points of one-epoch test accuracy at staleness 2 and 5.8 at staleness 4).
  void wait(int staleness) {
    if (staleness < 0 || staleness > options_.staleness)
      throw Error(ErrorKind::invalid_argument, here("wait"),
                  fmt::format("staleness {} for one wait(): between 0 and the synchronizer's {}", staleness,
                              options_.staleness));
    if (!thread_.joinable()) start();
    const auto started = Clock::now();
    Timeline* timeline = gradients_.timeline();
    const std::int64_t traced_start = timeline ? Timeline::now() : 0;
    std::unique_lock lock(mutex_);
    const std::uint64_t t = iteration_;
    if (!gradients_.all_marked()) throw gradients_.never_ready(t);
    if (period_due_)
      throw Error(ErrorKind::invalid_argument, here("wait"),
                  fmt::format("iteration {}: parameters_updated() was not called at the end of the period", t));
    if (!state_cv_.wait_until(lock, started + options_.timeout,
                              [&] { return error_ || (worker_->pushed() > t && worker_->applicable(t, staleness)); }))
      throw too_old(t, staleness);
    if (error_) throw *error_;
    if (timeline) timeline->record(Timeline::Kind::wait, traced_start, 0, t);
    report_.iteration = t;
    report_.blocked = Clock::now() - started;
    worker_->apply(t, report_);
    report_.skipped_globals = worker_->skipped_globals();
    report_.summed_replies = worker_->summed_replies();
    gradients_.unpack(every_gradient_, worker_->values());
    gradients_.next_iteration();
    report_.dropped_pushes = server_->dropped_pushes();
    report_.lost_workers = lost_;
    report_.bytes_sent = messages_.bytes_sent() - sent_reported_;
    sent_reported_ = messages_.bytes_sent();
    ++iteration_;
    period_due_ = options_.period > 0 && iteration_ % static_cast<std::uint64_t>(options_.period) == 0;
    lock.unlock();
    messages_.wake();  // the next iteration's gradients may already be ready
  }

  // Call after the trainer's update of each iteration. At the end of a period it pushes the
  // registered parameters, waits for every part's average over all workers and leaves it in them.
  void parameters_updated() {
    std::unique_lock lock(mutex_);
    if (!period_due_) return;
    const auto deadline = Clock::now() + options_.timeout;
    period_.begin();
    lock.unlock();
    messages_.wake();
    lock.lock();
    if (!state_cv_.wait_until(lock, deadline, [&] { return error_ || period_.averaged(); }))
      throw Error(ErrorKind::timeout, here("parameter average"),
                  fmt::format("period ending at iteration {}: no average within {} ms from {}", iteration_,
                              options_.timeout.count(), period_.missing()));
    if (error_) throw *error_;
    period_.end();
    period_due_ = false;
  }

  // What the last wait() applied. Read it between wait() and the next ready().
  const StepReport& last_step() const noexcept { return report_; }
  int rank() const noexcept { return group_.rank; }
  int size() const noexcept { return n_; }

 private:
  using Clock = std::chrono::steady_clock;
  using Worker = detail::Worker<C, X>;
  using Server = detail::PartServer<C, X>;

  ErrorContext here(const char* operation) const { return {.rank = transport_.rank(), .operation = operation}; }

  // Checks the layout with the other ranks and sizes every role, at the first ready() or wait().
  void start() {
    if (error_) throw *error_;  // the layout check failed at an earlier call
    if (gradients_.size() == 0)
      throw Error(ErrorKind::invalid_argument, here("ready"),
                  "no gradients registered: add() them before the first ready() or wait()");
    check_layout();
    gradients_.freeze();
    BucketPlan plan{.buckets = {{}}};
    for (GradId id = 0; id < gradients_.size(); ++id) plan.buckets[0].push_back(id);
    const std::size_t total =
        gradients_.place(plan, [&](std::string why) { return Error(ErrorKind::internal, here("plan"), why); })[0].elements;
    every_gradient_ = std::move(plan.buckets[0]);
    worker_.emplace(messages_, codec_, options_.staleness, total);
    server_.emplace(messages_, codec_, quorum_, options_.staleness, worker_->part_size(group_.rank),
                    worker_->biggest_part());
    done_from_.assign(static_cast<std::size_t>(n_), 0);
    report_.applied.assign(static_cast<std::size_t>(n_), -1);
    report_.contributors.assign(static_cast<std::size_t>(n_), 0);
    thread_ = std::thread([this] { run(); });
  }

  // Every rank registered the same gradients and parameters, with the same settings, or each is
  // told what differs (engine::agree_on_layout), before anything is sized by them. A failure is
  // kept: every later call throws it.
  void check_layout() {
    const std::string policies = fmt::format(
        "asynchronous parameter server: codec={} transport={} world={} staleness={} quorum={} period={} {}",
        codec_.describe(), transport_.describe(), n_, options_.staleness, quorum_, options_.period, period_.describe());
    try {
      engine::ControlChannel<X> control(transport_, group_, options_.timeout);
      engine::agree_on_membership(control);
      engine::agree_on_layout(control, gradients_.layout(), policies);
    } catch (const Error& e) {
      error_ = e;
      throw;
    }
  }

  Error too_old(std::uint64_t t, int staleness) {
    return Error(ErrorKind::timeout, here("wait"),
                 worker_->pushed() <= t
                     ? fmt::format("iteration {}: this rank's push did not leave within {} ms", t, options_.timeout.count())
                     : fmt::format("iteration {}: no global gradient of iteration {} or later within {} ms for {}", t,
                                   static_cast<std::int64_t>(t) - staleness, options_.timeout.count(),
                                   worker_->too_old(t, staleness)));
  }

  int done_sends_left() const {
    int left = 0;
    for (int p = 0; p < n_; ++p) left += messages_.posted(detail::done_sent, p);
    return left;
  }

  bool everyone_done() const {
    for (int w = 0; w < n_; ++w)
      if (!done_from_[w] && !messages_.dead(w)) return false;
    return true;
  }

  // ---- the communication thread ----

  void run() {
    using namespace detail;
    try {
      std::unique_lock lock(mutex_);
      server_->start();
      for (int w = 0; w < n_; ++w) messages_.post(done_received, w, false, done, 0, {});
      period_.start();
      progress();
      lock.unlock();
      std::vector<std::uint64_t> batch;
      batch.reserve(messages_.requests());
      while (messages_.next(batch)) {
        lock.lock();
        for (const std::uint64_t id : batch) on_completion(static_cast<std::size_t>(id));
        batch.clear();
        progress();
        lock.unlock();
        state_cv_.notify_all();
      }
    } catch (const Error& e) {
      {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = e;
      }
      transport_.abort(e);
      state_cv_.notify_all();
    }
  }

  // Starts whatever has become possible: this iteration's pushes, pulls, answers to parked pulls,
  // a period's parameters and averages, the end of training.
  void progress() {
    using namespace detail;
    if (gradients_.bucket_complete(0))
      worker_->push_due(iteration_, [&](std::span<float> flat) { gradients_.pack(0, every_gradient_, flat); });
    for (int p = 0; p < n_; ++p) worker_->refill_pull(p, iteration_);
    for (int w = 0; w < n_; ++w) server_->answer_pull(w);
    period_.progress();
    if (finishing_ && !done_posted_) {
      done_posted_ = true;
      for (int p = 0; p < n_; ++p) messages_.post(done_sent, p, true, done, 0, {});
    }
  }

  void on_completion(std::size_t i) {
    using namespace detail;
    const auto [site, peer] = messages_.locate(i);
    std::size_t bytes = 0;
    try {
      bytes = messages_.settle(i, options_.timeout);
    } catch (const Error& e) {
      if (site == reply_sent) server_->reply_left(peer);
      if (site == pull_sent || site == reply_received) worker_->pull_failed(peer);
      leave_behind(peer, e);
      return;
    }
    switch (site) {
      case push_received: server_->pushed(peer, bytes); break;
      case pull_received: server_->pulled(peer, bytes); break;
      case reply_sent: server_->reply_left(peer); break;
      case reply_received: worker_->reply_arrived(peer, bytes); break;
      case parameters_received: period_.parameters_arrived(peer, bytes); break;
      case average_received: period_.average_arrived(peer, bytes); break;
      case done_received: done_from_[peer] = 1; break;
      case push_sent:
      case pull_sent:
      case parameters_sent:
      case average_sent:
      case done_sent:
      case sites: break;
    }
  }

  // A peer's failure, reported for a message to or from it: with quorum < N and the quorum still
  // within reach the others go on without it (the top of this file); otherwise `e` stands, with
  // who and what filled in.
  void leave_behind(int peer, const Error& e) {
    const int member = group_.members[peer];
    if (e.kind() != ErrorKind::peer_failed || e.context().peer != member || peer == group_.rank)
      throw e.filled({.rank = transport_.rank(), .peer = member});
    if (messages_.dead(peer)) return;
    if (finishing_) {
      // This rank's training is over, and so is the peer's, or it would not have closed: every
      // rank closes only once every worker has finished. Nothing more is needed from it.
      messages_.mark_dead(peer);
      return;
    }
    if (n_ - dead_count_ - 1 < quorum_)
      throw Error(ErrorKind::peer_failed, {.rank = transport_.rank(), .peer = member, .operation = "worker"},
                  fmt::format("rank {} failed and {} of {} workers would be left, fewer than the quorum {}: {}", member,
                              n_ - dead_count_ - 1, n_, quorum_, e.what()));
    messages_.mark_dead(peer);
    ++dead_count_;
    lost_ |= std::uint64_t{1} << peer;
    server_->forget(peer);
    period_.forget(peer);  // its part's server is gone: the part stays local, its share of an average too
  }

  X transport_;
  Options options_;
  C codec_;
  Group group_;
  int n_;
  int quorum_;
  // The registered gradients, their marks and the timeline (set before the thread: read by both
  // sides); one bucket holds them all, in registration order: the worker's flat gradient.
  engine::Gradients<X> gradients_;
  std::vector<GradId> every_gradient_;
  detail::Messages<X> messages_;
  detail::PeriodAverage<X> period_;
  std::optional<Worker> worker_;  // sized at start()
  std::optional<Server> server_;
  std::thread thread_;

  // Shared by the trainer and the thread, under mutex_.
  std::mutex mutex_;
  std::condition_variable state_cv_;
  std::optional<Error> error_;
  std::uint64_t iteration_ = 0;  // the trainer's
  bool period_due_ = false;
  bool finishing_ = false, done_posted_ = false, finished_ = false;
  std::vector<std::uint8_t> done_from_;  // per worker: it has finished, as this rank's server heard
  int dead_count_ = 0;
  std::uint64_t lost_ = 0;  // the dead, as a mask
  StepReport report_;
  std::uint64_t sent_reported_ = 0;  // bytes this rank had sent as of the last wait()
};

}  // namespace gradsync::async
