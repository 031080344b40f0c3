#pragma once
// async::Synchronizer — a parameter server whose workers do not wait for each other (the fourth
// source document): pushes and pulls run on a communication thread while the trainer computes,
// each server forms an iteration's global gradient from the first M of the N workers' pushes, a
// worker applies every global gradient once as it comes (its own gradient standing in until then),
// never more than `staleness` iterations behind, and every `period` iterations the workers'
// parameters are averaged.
//
// Roles. Every rank is a worker and also serves one part of the flat gradient (the registered
// gradients one after another, cut into N parts as topology::ParameterServer cuts a bucket:
// co-located servers, part p served by group rank p). A worker talks to the server of its own
// part through the transport too (every transport carries messages to itself), so the two roles
// share nothing but the communication thread.
//
// An iteration t, on worker w:
//   1. ready() for every gradient: the communication thread encodes the local gradient l_t and
//      pushes part p to server p (its own part it hands over in memory) — unless a global gradient
//      of iteration t or later has already come for that part: t is closed there, and the push
//      would only be dropped (a straggler's pushes, with quorum < N).
//   2. wait(): for each part p, every global gradient the worker has pulled since its last wait(),
//      summed, plus the worker's own gradient l_t standing in for the global gradient of t until
//      that arrives (l_t is the worker's best estimate of g_t: the same parameters, other samples).
//      When the global gradient of t comes with w among its contributors, the next wait() subtracts
//      that stand-in again, so every global gradient is applied exactly once and the worker's own
//      gradient once, inside it or on its own (when t closed without w). Once g_t has arrived by
//      wait(t), nothing stands in. wait()
//      blocks while a part's newest global gradient is older than t - staleness, so the applied
//      global gradients are never more than `staleness` iterations behind (staleness 0: wait()
//      waits for iteration t itself and applies exactly g_t, as the synchronous parameter server).
//   3. The trainer updates its parameters; then parameters_updated(). At the end of every period
//      of `period` iterations it pushes the parameters; each server averages its part over all N
//      workers and sends the same bits back to all, so every worker starts the next period from
//      the same parameters.
// Meanwhile the communication thread keeps one pull per part outstanding, "the global gradients
// after the last one I have", decodes each reply into the part's pending sum as it arrives, and
// pulls again at once, unless what is pending already reaches the trainer's current iteration:
// then it pulls again after the next wait(). A worker behind the others (a straggler, whose global
// gradients run ahead of its own iterations) thus pulls once an iteration and gets every global
// gradient closed since its last pull in one reply, summed by the server, where pulling each as
// it closed cost every server a reply per global gradient (fmnist, 4 ranks, one 2x slower: a fast
// rank sends 9% fewer bytes).
//
// Where this departs from the fourth document, which applies only the newest global gradient not
// yet used and otherwise the local gradient, never taken back: skipped global gradients are lost,
// and a local gradient is counted again inside its global one. Why the stand-in is the whole l_t
// and not its share l_t / M: in the limit where every worker's gradient is the same, the whole
// stand-in applies each step's gradient at once and the global gradient's later correction is
// zero, so the delay is only in the samples' noise; a share applies (M - 1) / M of every step
// `staleness` iterations late, which is what costs accuracy (delayed gradient descent needs a
// smaller learning rate to stay stable). On fmnist (4 emulated hosts, one rank 2x slower,
// staleness 2, quorum 3, batch 128) one epoch's test accuracy ends on average 0.26 points above
// the synchronous server's with the whole stand-in and the epoch's last wait(0) (20 seeds), 1.6
// below without that catch-up (15 seeds), 4.9 below with the share (10 seeds); the newest-only
// rule lost more than the share (examples/fmnist/results/README.md has the runs).
//
// A server closes iteration t of its part when M = `quorum` pushes of iteration t have arrived:
// it sums them in group order (as topology::ParameterServer's roots do: an element's sum does not
// depend on which rank serves it), divides by M, encodes the result once and keeps that encoding, with which workers
// it used, for the pulls. It keeps the last few (N + 2 (staleness + 2)) for workers that pull
// behind the others; a worker that falls further behind than that gets the oldest one kept, and
// StepReport::skipped_globals counts what it missed. A pull that finds several global gradients
// it asks for gets them in one reply: decoded in iteration order, summed, and encoded for that
// worker (with a lossy codec, under an error-feedback state of its own per worker, so what the
// re-encoding loses reaches the worker in its next summed reply), with every iteration's
// contributors. A push that arrives after its iteration closed is counted and dropped.
// Pushes of one worker arrive in order and a worker cannot push iteration t before it has applied
// a global gradient of iteration t - 1 - staleness or later, so iterations close in order and at
// most staleness + 1 are open at once: the server's buffers are sized for that.
//
// With staleness 0 and quorum N (any period) every wait() applies exactly g_t, and with period 1
// the result is, bit for bit, the synchronous parameter server's (topology::ParameterServer,
// co-located, identity codec, any bucketing): every element summed in group order, the same
// division; the period average of identical parameters is accumulated in f64 and so gives them
// back unchanged. (With a lossy codec a server's own worker's part is encoded too,
// where the synchronous server adds its raw values.)
//
// Every rank calls finish() after its last wait(): servers keep answering until every worker has
// finished.
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
// Gradients are registered as the Synchronizer's are (engine::Gradients: add(name, TensorView),
// f32 or f16/bf16 averaged in f32, host or CUDA memory staged through the host), and the ranks
// check at the first ready() or wait() that they registered the same gradients, parameters and
// settings (engine::agree_on_layout): each is told what differs.
//
// Not yet: dedicated servers and partition counts other than N (a dead rank's part could then
// move to a live server); f64 gradients; a bucketing policy (one bucket, pushed once backward is done).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/aligned_buffer.hpp"
#include "gradsync/detail/settings.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/engine/gradients.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/error.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/transport/completion.hpp"
#include "gradsync/types.hpp"

namespace gradsync::async {

struct Options {
  int staleness = 0;  // s: iterations an applied global gradient may lag the worker's own
  int quorum = 0;     // M: pushes that close an iteration; 0 means every worker (N)
  int period = 0;     // K: parameters averaged every K iterations; 0: never
  std::chrono::milliseconds timeout = std::chrono::minutes(2);  // every wait of the trainer's
  // Chrome trace events of this rank (the top of async/synchronizer.hpp), written when the
  // synchronizer is destroyed to this path with the rank inserted before ".json"; empty: the
  // environment variable GRADSYNC_TIMELINE if set, else no timeline.
  std::string timeline{};
  std::size_t timeline_events = std::size_t{1} << 18;  // kept at most (1 to 2^27); later ones are dropped
};

// What the last wait() applied, part by part, and what this rank's server did so far.
struct StepReport {
  std::uint64_t iteration = 0;
  int age = 0;               // max over parts of iteration - the newest global gradient applied so far
  int local_parts = 0;       // parts where this iteration's own gradient stood in (its global had not come)
  std::vector<std::int64_t> applied;  // per part: the newest global gradient applied now, -1 for none
  std::vector<std::uint64_t> contributors;  // per part: the workers its server used for it, bit w = worker w
  std::uint64_t skipped_globals = 0;  // so far: global gradients this worker never got (pulled too late)
  std::uint64_t summed_replies = 0;   // so far: replies that brought this worker several global gradients summed
  std::uint64_t dropped_pushes = 0;  // this rank's server, so far: pushes that came after their iteration closed
  std::chrono::nanoseconds blocked{0};  // wait() blocked for a new enough global gradient
  std::uint64_t bytes_sent = 0;         // by this rank to others since the wait() before (worker and server)
  std::uint64_t lost_workers = 0;       // ranks found dead so far (bit w = group rank w), left behind
};


template <CompressionPolicy C, TransportPolicy X>
class Synchronizer final : private transport::CompletionSink {
 public:
  Synchronizer(X transport, Options options = {}, C codec = {})
      : transport_(std::move(transport)),
        options_(options),
        codec_(std::move(codec)),
        group_(Group::world(transport_.rank(), transport_.size())),
        n_(group_.size()),
        quorum_(options.quorum == 0 ? n_ : options.quorum),
        gradients_(transport_) {
    if (options_.staleness < 0 || quorum_ < 1 || quorum_ > n_ || options_.period < 0)
      throw Error(ErrorKind::invalid_argument, here("options"),
                  fmt::format("staleness {} (>= 0), quorum {} (0 or 1..{}) and period {} (>= 0) do not fit",
                              options_.staleness, options_.quorum, n_, options_.period));
    if (n_ > 64)
      throw Error(ErrorKind::unsupported, here("options"), fmt::format("{} workers; contributor masks hold 64", n_));
    detail::check_setting(options_.timeout.count() > 0, "async::Options", "timeout",
                          fmt::format("{} ms", options_.timeout.count()), "more than 0 ms");
    detail::check_setting(options_.timeline_events >= 1 && options_.timeline_events <= Timeline::max_capacity,
                          "async::Options", "timeline_events", options_.timeline_events,
                          fmt::format("between 1 and {}", Timeline::max_capacity));
    detail::validate_policy(codec_);
    gradients_.open_timeline(options_.timeline, fmt::format("{}.async", transport_.rank()), options_.timeline_events,
                             log_to_stderr);
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
    stop_thread();
    if (!finished_) transport_.abort(Error(ErrorKind::peer_failed, here("shutdown"),
                                           "the asynchronous synchronizer was destroyed before finish()"));
    // The server's standing receives and unanswered pulls or replies: taken back (a wait whose
    // deadline has passed withdraws what is unmatched), so the transport holds none of ours.
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (!posted_[i]) continue;
      try {
        transport_.wait(requests_[i], finished_ ? Clock::now() : Clock::now() + options_.timeout);
      } catch (const Error&) {
      }
    }
  }

  // Ends training on this rank: tells every server so, and keeps serving this rank's part until
  // every worker has said the same, so that no worker's last pull goes unanswered. Every rank
  // calls it once, after its last wait() (the destructor does, if the trainer did not).
  void finish() {
    if (!thread_.joinable() || finished_) return;
    std::unique_lock lock(mutex_);
    finishing_ = true;
    lock.unlock();
    wake_thread();
    lock.lock();
    if (!state_cv_.wait_until(lock, Clock::now() + options_.timeout, [&] {
          return error_ || (everyone_done() && done_posted_ && std::none_of(done_sends(), done_sends_end(), [](auto p) { return p != 0; }));
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
    parameters_.push_back(parameters);
  }

  // Marks gradient `id` as holding this iteration's local value; the last one starts the push.
  void ready(GradId id) {
    if (!thread_.joinable()) start();
    if (gradients_.mark(id, iteration_).bucket_complete) wake_thread();
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
                              [&] { return error_ || (pushed_ > t && applicable(t, staleness)); }))
      throw too_old(t, staleness);
    if (error_) throw *error_;
    if (timeline) timeline->record(Timeline::Kind::wait, traced_start, 0, t);
    report_.iteration = t;
    report_.blocked = Clock::now() - started;
    report_.age = 0;
    report_.local_parts = 0;
    for (int p = 0; p < n_; ++p) {
      apply_part(p, t);
      if (applied_[p] >= 0)
        report_.age = std::max(report_.age, static_cast<int>(static_cast<std::int64_t>(t) - applied_[p]));
    }
    report_.skipped_globals = skipped_;
    report_.summed_replies = summed_received_;
    gradients_.unpack(every_gradient_, std::span(flat_));
    gradients_.next_iteration();
    report_.dropped_pushes = dropped_;
    report_.lost_workers = lost_;
    report_.bytes_sent = sent_ - sent_reported_;
    sent_reported_ = sent_;
    ++iteration_;
    period_due_ = options_.period > 0 && iteration_ % static_cast<std::uint64_t>(options_.period) == 0;
    lock.unlock();
    wake_thread();  // the next iteration's gradients may already be ready
  }

  // Call after the trainer's update of each iteration. At the end of a period it pushes the
  // registered parameters, waits for every part's average over all workers and leaves it in them.
  void parameters_updated() {
    std::unique_lock lock(mutex_);
    if (!period_due_) return;
    const auto deadline = Clock::now() + options_.timeout;
    gather(parameters_, parameter_flat_);
    averaging_ = true;
    lock.unlock();
    wake_thread();
    lock.lock();
    if (!state_cv_.wait_until(lock, deadline, [&] { return error_ || !averaging_; }))
      throw Error(ErrorKind::timeout, here("parameter average"),
                  fmt::format("period ending at iteration {}: no average within {} ms from {}", iteration_,
                              options_.timeout.count(), missing_averages()));
    if (error_) throw *error_;
    scatter(parameter_flat_, parameters_);
    period_due_ = false;
  }

  // What the last wait() applied. Read it between wait() and the next ready().
  const StepReport& last_step() const noexcept { return report_; }
  int rank() const noexcept { return group_.rank; }
  int size() const noexcept { return n_; }

 private:
  using Clock = std::chrono::steady_clock;
  using Request = typename X::Request;
  static constexpr std::uint64_t nothing = ~std::uint64_t{0};
  // A push: its iteration, and 8 bytes of zeros. A reply: the newest iteration it brings, how many
  // (c, the iterations before it), and each one's contributors, oldest first.
  static constexpr std::size_t header_bytes = 16;
  static constexpr std::size_t reply_header_bytes(std::size_t globals) { return 16 + 8 * globals; }
  static constexpr int summed_reply = -2;  // reply_from_: the reply in flight reads summed_bytes_

  // Every request this rank posts: one per kind of message and peer.
  enum Site : std::uint32_t {
    push_sent, push_received, pull_sent, pull_received, reply_sent, reply_received, parameters_sent, parameters_received, average_sent, average_received, done_sent, done_received, sites
  };
  // Message kinds: offsets of ControlMessage::async_parameter_server (engine/tag.hpp).
  enum Kind : std::uint32_t { push = 0, pull = 1, reply = 2, parameters = 3, average = 4, done = 5 };

  // A closed iteration's global gradient of the served part, with the replies still reading it.
  struct GlobalSlot {
    detail::TransportBuffer<X> bytes;
    std::size_t size = 0;
    std::uint64_t iteration = 0;
    bool filled = false;
    int readers = 0;
  };

  // How the worker's own gradient of iteration t enters its updates, part by part (the top of this
  // file): kept for the last staleness + 1 iterations, entry t % (staleness + 1).
  enum class Own : std::uint8_t {
    waiting,    // wait(t) has not come yet, nor a global gradient of t with this worker in it
    in_global,  // g_t with this worker in it came first: wait(t) adds nothing of its own
    stood_in,   // wait(t) applied a stand-in (kept in stand_ins_); g_t, if it has this worker in it, takes it back
    settled,    // stood in, and then taken back
  };
  struct OwnEntry {
    std::int64_t iteration = -1;
    Own state = Own::waiting;
  };

  static std::span<std::byte> whole(const detail::TransportBuffer<X>& buffer) { return {buffer.data(), buffer.size()}; }

  // The registered buffers one after another into `flat`, and back.
  static void gather(const std::vector<std::span<float>>& buffers, std::vector<float>& flat) {
    auto at = flat.begin();
    for (auto b : buffers) at = std::copy(b.begin(), b.end(), at);
  }
  static void scatter(const std::vector<float>& flat, const std::vector<std::span<float>>& buffers) {
    auto at = flat.begin();
    for (auto b : buffers) {
      std::copy_n(at, b.size(), b.begin());
      at += static_cast<std::ptrdiff_t>(b.size());
    }
  }
  ErrorContext here(const char* operation) const { return {.rank = transport_.rank(), .operation = operation}; }
  std::span<float> flat_part(int p) { return std::span(flat_).subspan(parts_[p].begin, parts_[p].size()); }
  std::span<float> pending_part(int p) { return std::span(pending_flat_).subspan(parts_[p].begin, parts_[p].size()); }
  std::size_t own_ring() const { return static_cast<std::size_t>(options_.staleness) + 1; }
  OwnEntry& own_entry(std::uint64_t t, int p) {
    return own_[(t % own_ring()) * static_cast<std::size_t>(n_) + static_cast<std::size_t>(p)];
  }
  std::span<float> stand_in_part(std::uint64_t t, int p) {
    return std::span(stand_ins_).subspan((t % own_ring()) * flat_.size() + parts_[p].begin, parts_[p].size());
  }
  std::span<float> parameter_part(int p) {
    return std::span(parameter_flat_).subspan(parameter_parts_[p].begin, parameter_parts_[p].size());
  }

  // Sizes everything at the first ready() or wait(), once the gradients are known.
  void start() {
    if (error_) throw *error_;  // the layout check failed at an earlier call
    if (gradients_.size() == 0)
      throw Error(ErrorKind::invalid_argument, here("ready"), "no gradients registered: add() them before the first ready() or wait()");
    check_layout();
    gradients_.freeze();
    BucketPlan plan{.buckets = {{}}};
    for (GradId id = 0; id < gradients_.size(); ++id) plan.buckets[0].push_back(id);
    const std::size_t total = gradients_.place(plan, [&](std::string why) {
      return Error(ErrorKind::internal, here("plan"), why);
    })[0].elements;
    every_gradient_ = std::move(plan.buckets[0]);
    std::size_t parameter_total = 0, biggest = 0;
    for (auto q : parameters_) parameter_total += q.size();
    flat_.assign(total, 0.0f);
    parameter_flat_.assign(parameter_total, 0.0f);
    for (int p = 0; p < n_; ++p) {
      parts_.push_back(topology::detail::segment(total, n_, p));
      parameter_parts_.push_back(topology::detail::segment(parameter_total, n_, p));
      biggest = std::max(biggest, parts_.back().size());
    }
    const std::size_t own = parts_[group_.rank].size(), own_parameters = parameter_parts_[group_.rank].size();
    // At most N replies read a global gradient at once; the rest keep the newest ones for workers
    // that pull behind the others.
    kept_globals_ = n_ + 2 * (options_.staleness + 2);
    const std::size_t encoded = codec_.max_encoded_bytes(biggest, DType::f32);
    const std::size_t capacity = header_bytes + encoded;
    const std::size_t reply_capacity = reply_header_bytes(static_cast<std::size_t>(kept_globals_)) + encoded;
    const auto per_peer = static_cast<std::size_t>(n_);
    for (int p = 0; p < n_; ++p) {
      push_bytes_.emplace_back(&transport_, capacity);
      push_states_.push_back(codec_.make_state(parts_[p].size(), DType::f32));
      reply_bytes_.emplace_back(&transport_, reply_capacity);
      received_pushes_.emplace_back(&transport_, capacity);
      summed_bytes_.emplace_back(&transport_, reply_capacity);
      summed_states_.push_back(codec_.make_state(own, DType::f32));
    }
    pending_flat_.assign(total, 0.0f);
    pending_newest_.assign(per_peer, -1);
    pending_contributors_.assign(per_peer, 0);
    arrived_newest_.assign(per_peer, -1);
    stand_ins_.assign(own_ring() * total, 0.0f);
    own_.assign(own_ring() * per_peer, {});
    for (int g = 0; g < kept_globals_; ++g)
      globals_.emplace_back().bytes = detail::TransportBuffer<X>(&transport_, reply_header_bytes(1) + encoded);
    reply_slots_.reserve(static_cast<std::size_t>(kept_globals_));
    summed_.assign(own, 0.0f);
    window_ = static_cast<std::size_t>(options_.staleness) + 2;
    contributions_.assign(window_ * per_peer * own, 0.0f);
    arrived_.assign(window_ * per_peer, 0);
    arrivals_.assign(window_, 0);
    sum_.assign(own, 0.0f);
    global_state_ = codec_.make_state(own, DType::f32);
    parameter_contributions_.assign(per_peer * own_parameters, 0.0f);
    parameter_average_.assign(own_parameters, 0.0f);
    requests_ = std::vector<Request>(static_cast<std::size_t>(sites) * per_peer);
    posted_.assign(requests_.size(), 0);
    completions_.reserve(requests_.size());
    pull_min_.assign(per_peer, 0);
    received_pull_.assign(per_peer, 0);
    pulls_sent_.assign(per_peer, 0);
    pulls_received_.assign(per_peer, 0);
    replies_sent_.assign(per_peer, 0);
    pushes_received_.assign(per_peer, 0);
    parked_.assign(per_peer, nothing);
    reply_from_.assign(per_peer, -1);
    pull_outstanding_.assign(per_peer, 0);
    pushes_encoded_.assign(per_peer, 0);
    pushes_sent_.assign(per_peer, 0);
    averages_sent_.assign(per_peer, 0);
    averages_arrived_.assign(per_peer, 0);
    applied_.assign(per_peer, -1);
    dead_.assign(per_peer, 0);
    done_from_.assign(per_peer, 0);
    parameters_from_.assign(per_peer, 0);
    report_.applied.assign(per_peer, -1);
    report_.contributors.assign(per_peer, 0);
    posted_at_.assign(requests_.size(), 0);
    thread_ = std::thread([this] { run(); });
  }

  // ---- the trainer's side (under mutex_) --------------------------------------------------------

  // Every live part has a global gradient of t - staleness or later, applied or pending.
  bool applicable(std::uint64_t t, int staleness) {
    const auto oldest = static_cast<std::int64_t>(t) - staleness;
    for (int p = 0; p < n_; ++p)
      if (!dead_[p] && arrived_newest_[p] < oldest) return false;  // a dead server's part: local only
    return true;
  }

  // Part p of what wait(t) leaves (flat_ holds l_t): the pending global gradients, summed, and the
  // stand-in l_t for g_t unless g_t with this worker in it came first; a dead server's part adds
  // l_t too, never taken back, with nobody else to average with.
  void apply_part(int p, std::uint64_t t) {
    const std::span<float> out = flat_part(p);
    const std::span<const float> pending = pending_part(p);
    const bool has_pending = pending_newest_[p] >= 0;
    report_.applied[p] = pending_newest_[p];
    report_.contributors[p] = has_pending ? pending_contributors_[p] : 0;
    if (has_pending) applied_[p] = pending_newest_[p];
    pending_newest_[p] = -1;
    if (dead_[p]) {
      ++report_.local_parts;
      if (has_pending)
        for (std::size_t e = 0; e < out.size(); ++e) out[e] += pending[e];
      return;
    }
    OwnEntry& own = own_entry(t, p);
    if (own.iteration == static_cast<std::int64_t>(t) && own.state == Own::in_global) {
      if (has_pending)
        std::copy(pending.begin(), pending.end(), out.begin());  // exactly the global gradients' bits
      else
        std::fill(out.begin(), out.end(), 0.0f);
      return;
    }
    ++report_.local_parts;
    const std::span<float> stand_in = stand_in_part(t, p);
    std::copy(out.begin(), out.end(), stand_in.begin());
    own = {.iteration = static_cast<std::int64_t>(t), .state = Own::stood_in};
    if (has_pending)
      for (std::size_t e = 0; e < out.size(); ++e) out[e] += pending[e];
  }

  Error too_old(std::uint64_t t, int staleness) {
    std::string parts;
    for (int p = 0; p < n_; ++p) {
      const std::int64_t have = arrived_newest_[p];
      if (!dead_[p] && have < static_cast<std::int64_t>(t) - staleness)
        parts += fmt::format("{}part {} (server rank {}, newest iteration {})", parts.empty() ? "" : ", ", p,
                             group_.members[p], have);
    }
    return Error(ErrorKind::timeout, here("wait"),
                 pushed_ <= t ? fmt::format("iteration {}: this rank's push did not leave within {} ms", t,
                                            options_.timeout.count())
                              : fmt::format("iteration {}: no global gradient of iteration {} or later within {} ms "
                                            "for {}",
                                            t, static_cast<std::int64_t>(t) - staleness,
                                            options_.timeout.count(), parts));
  }

  std::string missing_averages() const {
    std::string out;
    for (int p = 0; p < n_; ++p)
      if (!averages_arrived_[p]) out += fmt::format("{}rank {}", out.empty() ? "" : ", ", group_.members[p]);
    return out;
  }

  auto done_sends() const { return posted_.begin() + static_cast<std::ptrdiff_t>(index(done_sent, 0)); }
  auto done_sends_end() const { return done_sends() + n_; }

  void stop_thread() {
    {
      std::lock_guard lock(events_mutex_);
      stop_ = true;
    }
    events_cv_.notify_all();
    thread_.join();
  }

  void wake_thread() {
    {
      std::lock_guard lock(events_mutex_);
      trainer_event_ = true;
    }
    events_cv_.notify_one();
  }

  // ---- the communication thread -----------------------------------------------------------------

  std::size_t index(Site site, int peer) const {
    return static_cast<std::size_t>(site) * static_cast<std::size_t>(n_) + static_cast<std::size_t>(peer);
  }

  // Transports report here, from their threads or (in process) from the poster's: never under
  // mutex_, which the thread holds while it posts.
  void completed(std::uint64_t id) noexcept override {
    {
      std::lock_guard lock(events_mutex_);
      completions_.push_back(id);
    }
    events_cv_.notify_one();
  }

  // A request is posted again only after its last completion has been handled (posted_ == 0), so a
  // completion always belongs to the posting it is handled for.
  //
  // Nothing goes to or comes from a dead peer; one found dead while posting is left behind here.
  void post(Site site, int peer, bool is_send, Kind kind, std::uint64_t sequence, std::span<std::byte> bytes) {
    if (dead_[peer]) return;
    const std::size_t i = index(site, peer);
    requests_[i].report_to(this, i);
    const std::uint64_t tag = engine::control_tag(sequence, engine::ControlMessage::async_parameter_server, kind);
    try {
      if (is_send)
        transport_.send(requests_[i], group_.members[peer], tag, bytes);
      else
        transport_.recv(requests_[i], group_.members[peer], tag, bytes);
    } catch (const Error& e) {
      leave_behind(peer, e);
      return;
    }
    posted_[i] = 1;
    if (gradients_.timeline()) posted_at_[i] = Timeline::now();
    if (is_send && peer != group_.rank) sent_ += bytes.size();  // what goes to itself crosses no link
  }

  // A peer's failure, reported for a message to or from it: with quorum < N and the quorum still
  // within reach the others go on without it (the top of this file); otherwise `e` stands, with
  // who and what filled in.
  void leave_behind(int peer, const Error& e) {
    const int member = group_.members[peer];
    if (e.kind() != ErrorKind::peer_failed || e.context().peer != member || peer == group_.rank)
      throw e.filled({.rank = transport_.rank(), .peer = member});
    if (dead_[peer]) return;
    if (finishing_) {
      // This rank's training is over, and so is the peer's, or it would not have closed: every
      // rank closes only once every worker has finished. Nothing more is needed from it.
      dead_[peer] = 1;
      return;
    }
    if (n_ - dead_count_ - 1 < quorum_)
      throw Error(ErrorKind::peer_failed, {.rank = transport_.rank(), .peer = member, .operation = "worker"},
                  fmt::format("rank {} failed and {} of {} workers would be left, fewer than the quorum {}: {}", member,
                              n_ - dead_count_ - 1, n_, quorum_, e.what()));
    dead_[peer] = 1;
    ++dead_count_;
    lost_ |= std::uint64_t{1} << peer;
    parked_[peer] = nothing;
    // Its part's server is gone: the part stays local, and its share of a period average too.
    averages_arrived_[peer] = 1;
    check_averages();
    // As its server, this rank no longer waits for its parameters.
    check_parameters();
  }

  bool everyone_done() const {
    for (int w = 0; w < n_; ++w)
      if (!done_from_[w] && !dead_[w]) return false;
    return true;
  }

  void run() {
    try {
      std::unique_lock lock(mutex_);
      for (int w = 0; w < n_; ++w) {
        post(push_received, w, false, push, 0, whole(received_pushes_[w]));
        post(pull_received, w, false, pull, 0, std::as_writable_bytes(std::span(&received_pull_[w], 1)));
        post(done_received, w, false, done, 0, {});
      }
      post_parameter_receives();
      progress();
      lock.unlock();
      std::vector<std::uint64_t> batch;
      batch.reserve(requests_.size());
      for (;;) {
        {
          std::unique_lock events(events_mutex_);
          events_cv_.wait(events, [&] { return stop_ || trainer_event_ || !completions_.empty(); });
          if (stop_) return;
          batch.swap(completions_);
          trainer_event_ = false;
        }
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

  void on_completion(std::size_t i) {
    const auto site = static_cast<Site>(i / static_cast<std::size_t>(n_));
    const int peer = static_cast<int>(i % static_cast<std::size_t>(n_));
    std::size_t bytes = 0;
    try {
      bytes = transport_.wait(requests_[i], Clock::now() + options_.timeout);  // already settled
    } catch (const Error& e) {
      posted_[i] = 0;
      if (site == reply_sent) reply_left(peer);
      if (site == pull_sent || site == reply_received) pull_outstanding_[peer] = 0;
      leave_behind(peer, e);
      return;
    }
    posted_[i] = 0;
    if (gradients_.timeline()) trace_transfer(site, peer, i, bytes);
    switch (site) {
      case push_received:
        contribute(peer, whole(received_pushes_[peer]).first(bytes));
        post(push_received, peer, false, push, ++pushes_received_[peer], whole(received_pushes_[peer]));
        break;
      case pull_received:
        expect_bytes(peer, "pull", bytes, sizeof received_pull_[peer]);
        parked_[peer] = received_pull_[peer];
        post(pull_received, peer, false, pull, ++pulls_received_[peer],
             std::as_writable_bytes(std::span(&received_pull_[peer], 1)));
        break;
      case reply_sent: reply_left(peer); break;
      case reply_received:
        take_global(peer, whole(reply_bytes_[peer]).first(bytes));
        pull_outstanding_[peer] = 0;
        break;
      case parameters_received:
        expect_bytes(peer, "parameters", bytes, parameter_parts_[group_.rank].size() * sizeof(float));
        parameters_from_[peer] = 1;
        ++parameters_arrived_;
        check_parameters();
        break;
      case done_received: done_from_[peer] = 1; break;
      case average_received:
        expect_bytes(peer, "parameter average", bytes, parameter_parts_[peer].size() * sizeof(float));
        averages_arrived_[peer] = 1;
        check_averages();
        break;
      case push_sent:
      case pull_sent:
      case parameters_sent:
      case average_sent:
      case done_sent:
      case sites: break;
    }
  }

  // ---- the layout check and the timeline ----

  // Every rank registered the same gradients and parameters, with the same settings, or each is
  // told what differs (engine::agree_on_layout), before anything is sized by them. A failure is
  // kept: every later call throws it.
  void check_layout() {
    std::string parameters;
    for (auto q : parameters_) parameters += fmt::format("{}{}", parameters.empty() ? "" : ",", q.size());
    const std::string policies =
        fmt::format("asynchronous parameter server: codec={} transport={} world={} staleness={} quorum={} period={} "
                    "parameters=[{}]",
                    codec_.describe(), transport_.describe(), n_, options_.staleness, quorum_, options_.period,
                    parameters);
    try {
      engine::ControlChannel<X> control(transport_, group_, options_.timeout);
      engine::agree_on_membership(control);
      engine::agree_on_layout(control, gradients_.layout(), policies);
    } catch (const Error& e) {
      error_ = e;
      throw;
    }
  }

  std::int64_t trace_start() const noexcept { return gradients_.timeline() ? Timeline::now() : 0; }

  // An encode or decode of part p's `elements` values that began at `start`.
  void trace_compute(Timeline::Kind kind, std::int64_t start, int p, std::size_t elements) {
    if (Timeline* timeline = gradients_.timeline()) timeline->record(kind, start, static_cast<std::uint32_t>(p), elements);
  }

  // A completed request, from its posting: its "bucket" is the part the message carries (the
  // peer's as server for what this rank sends or gets as worker, this rank's own otherwise).
  void trace_transfer(Site site, int peer, std::size_t i, std::size_t bytes) {
    const bool as_worker = site == push_sent || site == pull_sent || site == reply_received ||
                           site == parameters_sent || site == average_received;
    const bool sent = site == push_sent || site == pull_sent || site == reply_sent || site == parameters_sent ||
                      site == average_sent || site == done_sent;
    gradients_.timeline()->record(sent ? Timeline::Kind::send : Timeline::Kind::recv, posted_at_[i],
                      static_cast<std::uint32_t>(as_worker ? peer : group_.rank), bytes, group_.members[peer]);
  }

  // A message shorter than its receive: the ranks registered different parameters (a longer one
  // the transport refuses itself).
  void expect_bytes(int peer, const char* operation, std::size_t bytes, std::size_t expected) const {
    if (bytes != expected)
      throw Error(ErrorKind::protocol, {.rank = transport_.rank(), .peer = group_.members[peer], .operation = operation},
                  fmt::format("{} bytes where {} were expected: do the ranks register the same parameters?", bytes,
                              expected));
  }

  // Starts whatever has become possible: this iteration's pushes, pulls, answers to parked pulls,
  // a period's parameters and averages.
  void progress() {
    push_due_parts();
    for (int p = 0; p < n_; ++p) refill_pull(p);
    for (int w = 0; w < n_; ++w) answer_pull(w);
    if (averaging_ && !parameters_pushed_) push_parameters();
    send_averages();
    if (finishing_ && !done_posted_) {
      done_posted_ = true;
      for (int p = 0; p < n_; ++p) post(done_sent, p, true, done, 0, {});
    }
  }

  // ---- worker: pushes and pulls ----

  // Once every gradient of the trainer's iteration is ready, copies them out and encodes and sends
  // each part as soon as its previous push has left.
  void push_due_parts() {
    if (pushed_ > iteration_ || !gradients_.bucket_complete(0)) return;
    const std::uint64_t t = iteration_;
    if (!copied_) {
      gradients_.pack(0, every_gradient_, std::span(flat_));
      copied_ = true;
    }
    bool all = true;
    for (int p = 0; p < n_; ++p) {
      if (pushes_encoded_[p] > t) continue;
      // A dead server takes nothing; nor does one that has closed iteration t already.
      if (dead_[p] || arrived_newest_[p] >= static_cast<std::int64_t>(t)) {
        pushes_encoded_[p] = t + 1;
        continue;
      }
      if (posted_[index(push_sent, p)]) {
        all = false;
        continue;
      }
      const std::span<std::byte> out = whole(push_bytes_[p]);
      const std::int64_t encoding = trace_start();
      const std::size_t bytes =
          header_bytes + codec_.encode(std::span<const float>(flat_part(p)), push_states_[p], out.subspan(header_bytes));
      trace_compute(Timeline::Kind::encode, encoding, p, parts_[p].size());
      std::memcpy(out.data(), &t, 8);
      std::memset(out.data() + 8, 0, 8);
      pushes_encoded_[p] = t + 1;
      post(push_sent, p, true, push, pushes_sent_[p]++, out.first(bytes));
    }
    if (!all) return;
    copied_ = false;
    pushed_ = t + 1;  // flat_ is the trainer's again
  }

  // Keeps one pull of part p outstanding, "the global gradients after the last one I have", while
  // what is pending does not reach the trainer's iteration yet (the top of this file).
  void refill_pull(int p) {
    if (dead_[p] || pull_outstanding_[p] || posted_[index(pull_sent, p)] || posted_[index(reply_received, p)]) return;
    if (pending_newest_[p] >= static_cast<std::int64_t>(iteration_)) return;  // pulled again after wait()
    pull_outstanding_[p] = 1;
    pull_min_[p] = static_cast<std::uint64_t>(arrived_newest_[p] + 1);
    const std::uint64_t sequence = pulls_sent_[p]++;
    post(reply_received, p, false, reply, sequence, whole(reply_bytes_[p]));
    post(pull_sent, p, true, pull, sequence, std::as_writable_bytes(std::span(&pull_min_[p], 1)));
  }

  // Global gradients of part p have come, one or several summed: decoded into the part's pending
  // sum at once, and for each that has this worker in it, the worker's stand-in for that iteration
  // taken back (or not applied at all, if wait() has not come to that iteration yet).
  void take_global(int p, std::span<const std::byte> message) {
    const ErrorContext from{.rank = transport_.rank(), .peer = group_.members[p], .operation = "pull"};
    std::uint64_t t = 0, count = 0;
    if (message.size() >= header_bytes) {
      std::memcpy(&t, message.data(), 8);
      std::memcpy(&count, message.data() + 8, 8);
    }
    if (message.size() < header_bytes || count == 0 || count > static_cast<std::uint64_t>(kept_globals_) ||
        message.size() < reply_header_bytes(count))
      throw Error(ErrorKind::protocol, from,
                  fmt::format("a reply of {} bytes whose header says {} global gradients (1 to {})", message.size(),
                              count, kept_globals_));
    const auto newest = static_cast<std::int64_t>(t);
    const std::int64_t oldest = newest - static_cast<std::int64_t>(count) + 1;
    if (oldest <= arrived_newest_[p])
      throw Error(ErrorKind::protocol, from,
                  fmt::format("global gradients of iterations {} to {} after {}: the server must answer with newer ones",
                              oldest, newest, arrived_newest_[p]));
    skipped_ += static_cast<std::uint64_t>(oldest - arrived_newest_[p] - 1);
    if (count > 1) ++summed_received_;
    arrived_newest_[p] = newest;
    const std::span<float> pending = pending_part(p);
    const std::int64_t decoding = trace_start();
    codec_.decode(message.subspan(reply_header_bytes(count)), pending,
                  pending_newest_[p] < 0 ? DecodeMode::overwrite : DecodeMode::add);
    trace_compute(Timeline::Kind::decode, decoding, p, pending.size());
    pending_newest_[p] = newest;
    for (std::int64_t iteration = oldest; iteration <= newest; ++iteration) {
      std::uint64_t contributors;
      std::memcpy(&contributors, message.data() + 16 + 8 * (iteration - oldest), 8);
      pending_contributors_[p] = contributors;
      if (!(contributors >> group_.rank & 1)) continue;  // this worker's own gradient of it is not in it
      OwnEntry& own = own_entry(static_cast<std::uint64_t>(iteration), p);
      if (own.iteration == iteration && own.state == Own::stood_in) {
        const std::span<const float> stand_in = stand_in_part(static_cast<std::uint64_t>(iteration), p);
        for (std::size_t e = 0; e < pending.size(); ++e) pending[e] -= stand_in[e];
        own.state = Own::settled;
      } else if (own.iteration < iteration) {
        own = {.iteration = iteration, .state = Own::in_global};
      }
    }
  }

  // ---- server of part group_.rank: pushes and pulls ----

  void contribute(int worker, std::span<const std::byte> message) {
    const ErrorContext from{.rank = transport_.rank(), .peer = group_.members[worker], .operation = "push"};
    if (message.size() < header_bytes)
      throw Error(ErrorKind::protocol, from, fmt::format("a push of {} bytes has no header", message.size()));
    std::uint64_t t;
    std::memcpy(&t, message.data(), 8);
    const auto next = static_cast<std::uint64_t>(closed_ + 1);
    if (t < next) {
      ++dropped_;  // its iteration closed without it
      return;
    }
    if (t >= next + window_)
      throw Error(ErrorKind::protocol, from,
                  fmt::format("iteration {} pushed while the oldest open one is {}: beyond staleness {}", t, next,
                              options_.staleness));
    const std::size_t own = parts_[group_.rank].size();
    const std::size_t at = (t % window_) * static_cast<std::size_t>(n_) + static_cast<std::size_t>(worker);
    const std::int64_t decoding = trace_start();
    codec_.decode(message.subspan(header_bytes), std::span(contributions_).subspan(at * own, own), DecodeMode::overwrite);
    trace_compute(Timeline::Kind::decode, decoding, group_.rank, own);
    arrived_[at] = 1;
    ++arrivals_[t % window_];
    // Iterations close in order: a worker's pushes arrive in order, so a later iteration never
    // reaches the quorum before an earlier one.
    while (arrivals_[static_cast<std::size_t>(closed_ + 1) % window_] >= static_cast<std::uint32_t>(quorum_))
      close(static_cast<std::uint64_t>(closed_ + 1));
  }

  // Iteration t's global gradient of the served part: the first `quorum` pushes to arrive, summed
  // in group order (as topology::ParameterServer's roots do), divided by the quorum, encoded once.
  void close(std::uint64_t t) {
    const std::size_t own = parts_[group_.rank].size();
    const std::size_t base = (t % window_) * static_cast<std::size_t>(n_);
    std::uint64_t used = 0;
    int taken = 0;
    const auto take = [&](int w) {
      const std::size_t at = base + static_cast<std::size_t>(w);
      if (!arrived_[at] || taken == quorum_) return;
      const float* values = contributions_.data() + at * own;
      if (taken == 0)
        std::copy_n(values, own, sum_.begin());
      else
        for (std::size_t e = 0; e < own; ++e) sum_[e] += values[e];
      used |= std::uint64_t{1} << w;
      ++taken;
    };
    for (int w = 0; w < n_; ++w) take(w);
    const auto divisor = static_cast<float>(quorum_);
    for (float& v : sum_) v /= divisor;
    // The oldest slot no reply reads: at most N replies are in flight, and there are more slots.
    GlobalSlot* global = nullptr;
    for (auto& g : globals_)
      if (g.readers == 0 && (!global || (global->filled && (!g.filled || g.iteration < global->iteration)))) global = &g;
    const std::span<std::byte> out = whole(global->bytes);
    const std::uint64_t one = 1;
    std::memcpy(out.data(), &t, 8);
    std::memcpy(out.data() + 8, &one, 8);
    std::memcpy(out.data() + 16, &used, 8);
    const std::int64_t encoding = trace_start();
    global->size = reply_header_bytes(1) +
                   codec_.encode(std::span<const float>(sum_), global_state_, out.subspan(reply_header_bytes(1)));
    trace_compute(Timeline::Kind::encode, encoding, group_.rank, own);
    global->iteration = t;
    global->filled = true;
    std::fill_n(arrived_.begin() + static_cast<std::ptrdiff_t>(base), n_, std::uint8_t{0});
    arrivals_[t % window_] = 0;
    closed_ = static_cast<std::int64_t>(t);
  }

  // Answers worker w's parked pull, once there is a global gradient kept of the iterations it asks
  // for and no earlier reply to w is still on its way: with that one's encoding if it is the only
  // one, else with all of them summed (the top of this file).
  void answer_pull(int w) {
    if (dead_[w] || parked_[w] == nothing || reply_from_[w] != -1 || posted_[index(reply_sent, w)]) return;
    reply_slots_.clear();
    for (auto& g : globals_)
      if (g.filled && g.iteration >= parked_[w]) reply_slots_.push_back(&g);
    if (reply_slots_.empty()) return;
    parked_[w] = nothing;
    // The newest run of consecutive iterations: a slot a slow reply still read was kept while a
    // newer one was reused, and what lies before that gap the worker counts as skipped.
    std::sort(reply_slots_.begin(), reply_slots_.end(),
              [](const GlobalSlot* a, const GlobalSlot* b) { return a->iteration < b->iteration; });
    auto first = reply_slots_.end() - 1;
    while (first != reply_slots_.begin() && (*(first - 1))->iteration + 1 == (*first)->iteration) --first;
    reply_slots_.erase(reply_slots_.begin(), first);
    if (reply_slots_.size() == 1) {
      GlobalSlot& g = *reply_slots_.front();
      post(reply_sent, w, true, reply, replies_sent_[w]++, whole(g.bytes).first(g.size));
      if (!posted_[index(reply_sent, w)]) return;  // w was found dead: nothing reads the slot
      ++g.readers;
      reply_from_[w] = static_cast<int>(&g - globals_.data());
      return;
    }
    const std::span<std::byte> out = whole(summed_bytes_[w]);
    const std::uint64_t newest = reply_slots_.back()->iteration, count = reply_slots_.size();
    std::memcpy(out.data(), &newest, 8);
    std::memcpy(out.data() + 8, &count, 8);
    const std::int64_t summing = trace_start();
    for (std::size_t i = 0; i < reply_slots_.size(); ++i) {
      const GlobalSlot& g = *reply_slots_[i];
      std::memcpy(out.data() + 16 + 8 * i, whole(g.bytes).data() + 16, 8);  // its contributors
      codec_.decode(whole(g.bytes).first(g.size).subspan(reply_header_bytes(1)), std::span(summed_),
                    i == 0 ? DecodeMode::overwrite : DecodeMode::add);
    }
    trace_compute(Timeline::Kind::decode, summing, group_.rank, summed_.size() * count);
    const std::int64_t encoding = trace_start();
    const std::size_t size =
        reply_header_bytes(count) + codec_.encode(std::span<const float>(summed_), summed_states_[w],
                                                  out.subspan(reply_header_bytes(count)));
    trace_compute(Timeline::Kind::encode, encoding, group_.rank, summed_.size());
    post(reply_sent, w, true, reply, replies_sent_[w]++, out.first(size));
    if (posted_[index(reply_sent, w)]) reply_from_[w] = summed_reply;
  }

  // Worker w's reply has left (or failed): what it read is free again.
  void reply_left(int w) {
    if (reply_from_[w] >= 0) --globals_[static_cast<std::size_t>(reply_from_[w])].readers;
    reply_from_[w] = -1;
  }

  // ---- period averages ----

  void post_parameter_receives() {
    const std::size_t own = parameter_parts_[group_.rank].size();
    parameters_arrived_ = 0;
    period_averaged_ = false;
    std::fill(parameters_from_.begin(), parameters_from_.end(), 0);
    for (int w = 0; w < n_; ++w)
      post(parameters_received, w, false, parameters, period_,
           std::as_writable_bytes(std::span(parameter_contributions_).subspan(static_cast<std::size_t>(w) * own, own)));
  }

  // The worker's part: its parameters to every server, and a receive for each average. The
  // average lands where the part was sent from: it cannot come before that send has completed.
  void push_parameters() {
    for (int p = 0; p < n_; ++p)
      if (posted_[index(parameters_sent, p)] || posted_[index(average_received, p)]) return;
    parameters_pushed_ = true;
    for (int p = 0; p < n_; ++p) {
      averages_arrived_[p] = dead_[p];  // a dead server's part keeps this worker's own parameters
      post(average_received, p, false, average, period_, std::as_writable_bytes(parameter_part(p)));
      post(parameters_sent, p, true, parameters, period_, std::as_writable_bytes(parameter_part(p)));
    }
    check_averages();
  }

  // The server's part: once every live worker's parameters are here, the average of those that
  // came, accumulated in f64 in group order (so that equal parameters come back unchanged), goes
  // to all of them.
  void check_parameters() {
    if (period_averaged_ || parameters_arrived_ == 0) return;
    for (int w = 0; w < n_; ++w)
      if (!parameters_from_[w] && !dead_[w]) return;
    period_averaged_ = true;
    const std::size_t own = parameter_parts_[group_.rank].size();
    for (std::size_t e = 0; e < own; ++e) {
      double sum = 0;
      for (int w = 0; w < n_; ++w)
        if (parameters_from_[w]) sum += parameter_contributions_[static_cast<std::size_t>(w) * own + e];
      parameter_average_[e] = static_cast<float>(sum / parameters_arrived_);
    }
    std::fill(averages_sent_.begin(), averages_sent_.end(), 0);
    average_ready_ = true;
    average_period_ = period_;
  }

  void send_averages() {
    if (!average_ready_) return;
    bool all = true;
    for (int w = 0; w < n_; ++w) {
      if (averages_sent_[w]) continue;
      if (posted_[index(average_sent, w)]) {
        all = false;
        continue;
      }
      averages_sent_[w] = 1;
      post(average_sent, w, true, average, average_period_, std::as_writable_bytes(std::span(parameter_average_)));
      if (!posted_[index(average_sent, w)]) continue;  // dead
    }
    if (all) average_ready_ = false;
  }

  void check_averages() {
    if (!averaging_ || !parameters_pushed_ ||
        std::count(averages_arrived_.begin(), averages_arrived_.end(), 1) < n_)
      return;
    // The whole period is done here; every worker's parameters of the next one go to new receives.
    ++period_;
    parameters_pushed_ = false;
    averaging_ = false;
    post_parameter_receives();
  }

  X transport_;
  Options options_;
  C codec_;
  Group group_;
  int n_;
  int quorum_;
  // The registered gradients, their marks and the timeline (set before the thread: read by both
  // sides); one bucket holds them all, in registration order: flat_.
  engine::Gradients<X> gradients_;
  std::vector<GradId> every_gradient_;
  std::vector<std::span<float>> parameters_;
  std::thread thread_;

  // Shared by the trainer and the thread.
  std::mutex mutex_;
  std::condition_variable state_cv_;
  std::optional<Error> error_;
  std::uint64_t iteration_ = 0;          // the trainer's
  std::uint64_t pushed_ = 0;             // iterations whose pushes have all been encoded
  bool period_due_ = false, averaging_ = false;
  bool finishing_ = false, done_posted_ = false, finished_ = false;
  std::vector<std::uint8_t> done_from_;  // per worker: it has finished, as this rank's server heard
  std::vector<std::uint8_t> dead_;       // per rank: failed and left behind
  int dead_count_ = 0;
  std::uint64_t lost_ = 0;               // dead_ as a mask
  StepReport report_;

  // The thread's inbox.
  std::mutex events_mutex_;
  std::condition_variable events_cv_;
  std::vector<std::uint64_t> completions_;
  bool trainer_event_ = false, stop_ = false;

  // Requests, and whether each is posted (its completion not handled yet).
  std::vector<Request> requests_;
  std::vector<std::uint8_t> posted_;
  std::vector<std::int64_t> posted_at_;  // per request, on the timeline: when it was posted

  // Worker.
  std::vector<float> flat_;  // the gradients, one after another
  std::vector<ElemRange> parts_;
  bool copied_ = false;
  std::vector<detail::TransportBuffer<X>> push_bytes_;
  std::vector<typename C::State> push_states_;
  std::vector<std::uint64_t> pushes_encoded_;
  std::vector<std::uint64_t> pushes_sent_;  // per part: push messages sent (their sequence numbers)
  std::vector<detail::TransportBuffer<X>> reply_bytes_;  // per part: where the pulled global gradient lands
  std::vector<std::uint64_t> pull_min_, pulls_sent_;
  std::vector<std::uint8_t> pull_outstanding_;
  std::vector<std::int64_t> arrived_newest_;  // per part: the newest global gradient come, -1 none
  std::vector<float> pending_flat_;  // per part: the global gradients come since the last wait(), summed
  std::vector<std::int64_t> pending_newest_;  // per part: the newest of those, -1 none
  std::vector<std::uint64_t> pending_contributors_;  // per part: its contributors
  std::vector<std::int64_t> applied_;  // per part: the newest global gradient applied, -1 none
  std::vector<OwnEntry> own_;     // (staleness + 1) x N
  std::vector<float> stand_ins_;  // (staleness + 1) x the flat gradient: the stand-ins applied
  std::uint64_t skipped_ = 0;
  std::uint64_t summed_received_ = 0;  // replies that brought several global gradients

  // Server of part group_.rank.
  std::vector<detail::TransportBuffer<X>> received_pushes_;
  std::vector<std::uint64_t> received_pull_, pushes_received_, pulls_received_, replies_sent_;
  std::vector<std::uint64_t> parked_;  // per worker: the oldest iteration its unanswered pull takes
  std::vector<int> reply_from_;        // per worker: the global slot its reply in flight reads
  std::size_t window_ = 0;             // iterations that can be open at once, and one more
  std::vector<float> contributions_;   // window x N pushes, decoded
  std::vector<std::uint8_t> arrived_;
  std::vector<std::uint32_t> arrivals_;
  std::vector<float> sum_;
  typename C::State global_state_{};
  std::vector<GlobalSlot> globals_;
  int kept_globals_ = 0;
  std::vector<GlobalSlot*> reply_slots_;  // answer_pull()'s: the kept global gradients a pull asks for
  std::vector<detail::TransportBuffer<X>> summed_bytes_;  // per worker: its summed reply
  std::vector<typename C::State> summed_states_;          // per worker: the encoding of its summed replies
  std::vector<float> summed_;
  std::int64_t closed_ = -1;
  std::uint64_t dropped_ = 0;
  std::uint64_t sent_ = 0, sent_reported_ = 0;  // bytes this rank has sent, and as of the last wait()

  // Period averages.
  std::vector<float> parameter_flat_;
  std::vector<ElemRange> parameter_parts_;
  std::vector<float> parameter_contributions_, parameter_average_;
  int parameters_arrived_ = 0;
  std::vector<std::uint8_t> parameters_from_;  // per worker: its parameters of this period are here
  std::vector<std::uint8_t> averages_sent_, averages_arrived_;
  bool parameters_pushed_ = false, average_ready_ = false;
  bool period_averaged_ = false;  // this period's average of the served part has been formed
  std::uint64_t period_ = 0, average_period_ = 0;
};

}  // namespace gradsync::async
