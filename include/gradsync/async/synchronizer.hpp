#pragma once
// async::Synchronizer — a parameter server whose workers do not wait for each other (the fourth
// source document): pushes and pulls run on a communication thread while the trainer computes,
// each server forms an iteration's global gradient from the first M of the N workers' pushes, a
// worker applies every global gradient once as it comes (its own gradient standing in until then),
// never more than `staleness` iterations behind, and every `period` iterations the workers'
// parameters are averaged.
//
// Roles, each owning its state (async/): every rank is a Worker (worker.hpp: its gradient pushed
// bucket by bucket as backward readies each, cut as parts.hpp says; the global gradients pulled
// and applied) and the PartServer (server.hpp) of part p = its group rank; PeriodAverage
// (period_average.hpp), PlanRound (plan_round.hpp: new bucket plans) and EndOfTraining
// (end_of_training.hpp). They post through one Messages (messages.hpp). This class is where they
// meet: the trainer's calls, the communication thread, the dead-peer policy.
//
// An iteration t, on the trainer's thread: ready() for every gradient (each bucket's last wakes
// the communication thread, which packs it and pushes its chunks); wait() leaves in the gradients
// what this iteration applies, blocking while a part's newest global gradient is older than
// t - staleness (staleness 0: it waits for iteration t itself and applies exactly g_t); the trainer
// updates its parameters, then parameters_updated(), which at the end of every period of `period`
// iterations waits for the parameters' average. With staleness 0 and quorum N every wait()
// applies exactly g_t; with period 1 too, the result is the synchronous parameter server's bit for
// bit (identity codec, any bucketing on either side; docs/design.md says why). Every rank calls
// finish() after its last wait().
//
// Gradients are registered as the Synchronizer's are (engine::Gradients: add(name, TensorView), f32
// or f16/bf16 averaged in f32, host or CUDA memory staged through the host; a host transport only),
// and at the first ready() or wait() the ranks check they registered the same gradients,
// parameters and policies (engine::agree_on_layout): each is told what differs. The bucketing
// policy's plans are agreed in rounds (plan_round.hpp; a new one costs that iteration its
// staleness) with quorum N only: a round needs every rank, which a quorum below N exists to
// avoid, so there the policy's initial plan stays (TimeClustered's is FixedSize's).
//
// A dead rank: the others go on without it while the quorum can still be met (leave_behind()).
// Timeline (Options::timeline or GRADSYNC_TIMELINE): ready marks and wait() here, the roles'
// messages, encodes and decodes (messages.hpp).
//
// Not yet: dedicated servers and partition counts other than N (a dead rank's part could then move
// to a live server); f64 gradients (a second flat gradient and codec path, per accumulation dtype).

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

#include "gradsync/async/end_of_training.hpp"
#include "gradsync/async/messages.hpp"
#include "gradsync/async/options.hpp"
#include "gradsync/async/parts.hpp"
#include "gradsync/async/period_average.hpp"
#include "gradsync/async/plan_round.hpp"
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

template <BucketingPolicy B, CompressionPolicy C, TransportPolicy X>
class Synchronizer {
  static_assert(!DeviceTransport<X>, "async::Synchronizer works in host memory: give it a host transport");
  static_assert(!OrderMatchedTransport<X>, "async::Synchronizer's messages come in the workers' own order, which a "
                                           "transport matching by posting order (transport::Nccl) cannot carry");

 public:
  Synchronizer(X transport, Options options = {}, B bucketing = {}, C codec = {})
      : transport_(std::move(transport)),
        options_(options),
        bucketing_(std::move(bucketing)),
        codec_(std::move(codec)),
        group_(Group::world(transport_.rank(), transport_.size())),
        n_(group_.size()),
        quorum_(options.quorum == 0 ? n_ : options.quorum),
        gradients_(transport_),
        messages_(transport_, group_, nullptr, [this](int peer, const Error& e) { leave_behind(peer, e); }),
        period_(messages_),
        end_(messages_) {
    check(options_, n_, transport_.rank());
    gradsync::detail::validate_policy(bucketing_);
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
    end_.begin();
    await(lock, Clock::now() + options_.timeout, [&] { return end_.over(); }, [&] {
      return Error(ErrorKind::timeout, here("finish"),
                   fmt::format("{} of {} workers finished within {} ms", end_.finished_workers(), n_,
                               options_.timeout.count()));
    });
    finished_ = true;
  }

  // Registers a gradient (f32, or f16/bf16 averaged in f32; in host or CUDA device memory, staged
  // through host memory) in the same order on every rank, before the first ready() or wait(). The
  // ranks check at the first of those that they registered the same gradients and settings.
  GradId add(std::string name, TensorView gradient) {
    check_gradient(name, gradient.dtype, transport_.rank());
    return gradients_.add(std::move(name), gradient);
  }

  // Parameters for the period average (f32, the same on every rank), before the first ready().
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
  // wait(0) leaves every global gradient up to now applied and no stand-in: the model to evaluate
  // or save (on fmnist worth 1.9 points of one-epoch test accuracy at staleness 2, 5.8 at 4).
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
    std::optional<BucketPlan> new_plan = plan_round(t, lock, started + options_.timeout);
    if (new_plan) staleness = 0;  // every global gradient of the old cut applied (plan_round.hpp)
    await(lock, started + options_.timeout, [&] { return worker_->pushed() > t && worker_->applicable(t, staleness); },
          [&] { return Error(ErrorKind::timeout, here("wait"), worker_->too_old(t, staleness, options_.timeout)); });
    if (timeline) timeline->record(Timeline::Kind::wait, traced_start, 0, t);
    report_.iteration = t;
    report_.blocked = Clock::now() - started;
    worker_->apply(t, report_);
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b)
      gradients_.unpack(std::span<const GradId>(plan_.buckets[b]),
                        worker_->values().subspan(parts_.bucket(b).begin, parts_.bucket(b).size()));
    if (new_plan) {
      exchange({}, lock, started + options_.timeout);  // every rank has applied them
      install(std::move(*new_plan));
    }
    gradients_.next_iteration();
    report_.dropped_pushes = server_->dropped_pushes();
    report_.lost_workers = messages_.dead_mask();
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
    await(lock, deadline, [&] { return period_.averaged(); }, [&] {
      return Error(ErrorKind::timeout, here("parameter average"),
                   fmt::format("period ending at iteration {}: no average within {} ms from {}", iteration_,
                               options_.timeout.count(), period_.missing()));
    });
    period_.end();
    period_due_ = false;
  }

  // What the last wait() applied. Read it between wait() and the next ready().
  const StepReport& last_step() const noexcept { return report_; }
  const BucketPlan& plan() const noexcept { return plan_; }  // the plan in use (empty before the first ready())
  int rank() const noexcept { return group_.rank; }
  int size() const noexcept { return n_; }

 private:
  using Clock = std::chrono::steady_clock;
  using Worker = detail::Worker<C, X>;
  using Server = detail::PartServer<C, X>;

  ErrorContext here(const char* operation) const { return {.rank = transport_.rank(), .operation = operation}; }

  // Wakes the communication thread and waits, `lock` held, until done() or its Error (thrown), or
  // until `deadline`: then throws late().
  template <class Done, class Late>
  void await(std::unique_lock<std::mutex>& lock, Clock::time_point deadline, Done&& done, Late&& late) {
    lock.unlock();
    messages_.wake();
    lock.lock();
    if (!state_cv_.wait_until(lock, deadline, [&] { return error_ || done(); })) throw late();
    if (error_) throw *error_;
  }

  // Checks the layout with the other ranks and sizes every role, at the first ready() or wait().
  void start() {
    if (error_) throw *error_;  // the layout check failed at an earlier call
    if (gradients_.size() == 0)
      throw Error(ErrorKind::invalid_argument, here("ready"),
                  "no gradients registered: add() them before the first ready() or wait()");
    check_layout();
    gradients_.freeze();
    std::size_t total = 0;
    for (const GradientInfo& gradient : gradients_.layout()) total += gradient.count;
    worker_.emplace(messages_, codec_, options_.staleness, total, gradients_.size());
    server_.emplace(messages_, codec_, quorum_, options_.staleness, total, gradients_.size());
    round_.emplace(messages_, gradients_.size());
    install(bucketing_.initial_plan(gradients_.layout()));
    report_.applied.assign(static_cast<std::size_t>(n_), -1);
    report_.contributors.assign(static_cast<std::size_t>(n_), 0);
    thread_ = std::thread([this] { run(); });
  }

  // Checks a plan (every gradient in one bucket) and cuts it between the servers (async/parts.hpp).
  void install(BucketPlan plan) {
    const std::vector<engine::BucketShape> shapes = gradients_.place(plan, [&](std::string why) {
      return Error(ErrorKind::invalid_argument, here("plan"),
                   fmt::format("bucketing policy {} produced an invalid plan: {}", bucketing_.describe(), why));
    });
    std::vector<std::size_t> elements;
    for (const engine::BucketShape& shape : shapes) elements.push_back(shape.elements);
    plan_ = std::move(plan);
    parts_ = detail::Parts(elements, n_);
    worker_->install(parts_);
    server_->install(parts_);
  }

  // The plan round of iteration t, if the bucketing policy names one and the quorum is N (the top
  // of this file): rank 0's new plan, or nullopt to keep the current one.
  std::optional<BucketPlan> plan_round(std::uint64_t t, std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
    if (quorum_ < n_) return std::nullopt;
    const std::optional<BucketPlan> proposal = bucketing_.end_iteration(gradients_.profile(t, &log_));
    if (!bucketing_.agreement_due(t)) return std::nullopt;
    exchange(group_.rank == 0 && proposal && *proposal != plan_ ? engine::encode_plan(*proposal) : std::string(), lock,
             deadline);
    if (round_->text().empty()) return std::nullopt;
    server_->hold(t);
    return round_->plan();
  }

  // One exchange of a plan round, over by `deadline`.
  void exchange(std::string text, std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
    round_->begin(std::move(text));
    await(lock, deadline, [&] { return round_->done(); }, [&] {
      return Error(ErrorKind::timeout, here("plan round"),
                   fmt::format("iteration {}: not all ranks came to the plan round in {} ms", iteration_, options_.timeout.count()));
    });
    round_->next();
  }

  // Every rank registered the same gradients, parameters and settings, or each is told what
  // differs (engine::agree_on_layout), before anything is sized by them. A failure is kept.
  void check_layout() {
    const std::string policies = fmt::format(
        "asynchronous parameter server: bucketing={} codec={} transport={} world={} staleness={} quorum={} period={} {}",
        bucketing_.describe(), codec_.describe(), transport_.describe(), n_, options_.staleness, quorum_, options_.period, period_.describe());
    try {
      engine::ControlChannel<X> control(transport_, group_, options_.timeout);
      engine::agree_on_membership(control);
      engine::agree_on_layout(control, gradients_.layout(), policies);
    } catch (const Error& e) {
      error_ = e;
      throw;
    }
  }

  // ---- the communication thread ----

  void run() {
    using namespace detail;
    try {
      std::unique_lock lock(mutex_);
      server_->start();
      round_->start();
      end_.start();
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
    worker_->push_due(
        iteration_, [&](std::size_t b) { return gradients_.bucket_complete(b); },
        [&](std::size_t b, std::span<float> values) { gradients_.pack(b, std::span<const GradId>(plan_.buckets[b]), values); });
    for (int p = 0; p < n_; ++p) worker_->refill_pull(p, iteration_);
    for (int w = 0; w < n_; ++w) server_->answer_pull(w);
    round_->progress();
    period_.progress();
    end_.progress();
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
      case done_received: end_.arrived(peer); break;
      case up_received: round_->up_arrived(peer); break;
      case down_received: round_->down_arrived(bytes); break;
      default: break;  // a send has left: its buffer is free, which the role asks the transport
    }
  }

  // A peer's failure, reported for a message to or from it (Error(peer_failed) naming it: a killed
  // process over Tcp or SharedMemory). The others go on without it as long as the quorum can still
  // be met (at most N - M dead); one more is an Error naming it, and with quorum N every death is.
  // Its server is gone with it, so its part keeps each worker's local gradient from then on, and
  // period averages cover the live workers; StepReport::lost_workers names the dead. (A rank that
  // aborts fails the transport for everyone, which no quorum hides.) Any other Error stands, with
  // who and what filled in.
  void leave_behind(int peer, const Error& e) {
    const int member = group_.members[peer];
    if (e.kind() != ErrorKind::peer_failed || e.context().peer != member || peer == group_.rank)
      throw e.filled({.rank = transport_.rank(), .peer = member});
    if (messages_.dead(peer)) return;
    if (end_.finishing()) {
      // This rank's training is over, and so is the peer's, or it would not have closed: every
      // rank closes only once every worker has finished. Nothing more is needed from it.
      messages_.mark_dead(peer);
      return;
    }
    const int left = n_ - messages_.dead_count() - 1;
    if (left < quorum_)
      throw Error(ErrorKind::peer_failed, {.rank = transport_.rank(), .peer = member, .operation = "worker"},
                  fmt::format("rank {} failed and {} of {} workers would be left, fewer than the quorum {}: {}", member,
                              left, n_, quorum_, e.what()));
    messages_.mark_dead(peer);
    server_->forget(peer);
    period_.forget(peer);  // its part's server is gone: the part stays local, its share of an average too
  }

  X transport_;
  Options options_;
  B bucketing_;
  C codec_;
  Group group_;
  int n_;
  int quorum_;
  // The registered gradients, their marks and the timeline (set before the thread: read by both
  // sides); the plan's buckets one after another are the worker's flat gradient.
  engine::Gradients<X> gradients_;
  BucketPlan plan_;
  detail::Parts parts_;
  detail::Messages<X> messages_;
  detail::PeriodAverage<X> period_;
  detail::EndOfTraining<X> end_;
  std::optional<Worker> worker_;  // sized at start()
  std::optional<Server> server_;
  std::optional<detail::PlanRound<X>> round_;
  LogSink log_ = log_to_stderr;  // where the bucketing policy says what it plans
  std::thread thread_;

  // Shared by the trainer and the thread, under mutex_.
  std::mutex mutex_;
  std::condition_variable state_cv_;
  std::optional<Error> error_;
  std::uint64_t iteration_ = 0;  // the trainer's
  bool period_due_ = false;
  bool finished_ = false;
  StepReport report_;
  std::uint64_t sent_reported_ = 0;  // bytes this rank had sent as of the last wait()
};

}  // namespace gradsync::async
