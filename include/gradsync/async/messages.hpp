#pragma once
// async::detail::Messages — what the asynchronous parameter server's roles (worker.hpp,
// server.hpp, period_average.hpp) send and receive, and the one place they post it.
//
// Every transfer this rank posts (engine::Transfer, as a bucket's exchange posts its own) is one
// per kind of message, direction and peer (a Site and a group rank), posted again only after its
// last completion has been handled, so a completion always belongs to the posting it is handled
// for. Transports report completions into an inbox that the communication thread drains (next()),
// together with the trainer's wake-ups. Nothing goes to or comes from a peer marked dead; a
// failure found while posting goes to `left_behind`, the synchronizer's dead-peer policy.
//
// Wire format (tags: engine::control_tag with ControlMessage::async_parameter_server and the Kind):
// a push is its iteration and its bucket, then the codec's encoding of that bucket's chunk of the
// part (parts.hpp); a pull is the oldest iteration wanted; a reply is the newest iteration it
// brings, how many it brings (c), each one's contributors (a bit per worker), oldest first, then
// the encoding of their sum (the whole part); parameters and averages are a part's plain f32
// values; done and a plan round's up are empty, its down an encoded plan or empty
// (plan_round.hpp).

#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/engine/transfer.hpp"
#include "gradsync/error.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/transport/completion.hpp"

namespace gradsync::async::detail {

// Message kinds: offsets of ControlMessage::async_parameter_server (engine/tag.hpp).
enum Kind : std::uint32_t { push = 0, pull = 1, reply = 2, parameters = 3, average = 4, done = 5, up = 6, down = 7 };

// Every request this rank posts, per peer.
enum Site : std::uint32_t {
  push_sent, push_received, pull_sent, pull_received, reply_sent, reply_received,
  parameters_sent, parameters_received, average_sent, average_received, done_sent, done_received,
  up_sent, up_received, down_sent, down_received, sites
};

inline constexpr std::size_t header_bytes = 16;  // a push's, and a reply's before its contributors
constexpr std::size_t reply_header_bytes(std::size_t globals) { return 16 + 8 * globals; }
inline constexpr std::uint64_t nothing = ~std::uint64_t{0};

// Global gradients a server keeps: at most N replies read one at once, and the rest keep the
// newest ones for workers that pull behind the others.
constexpr int kept_globals(int workers, int staleness) { return workers + 2 * (staleness + 2); }

template <class X>
std::span<std::byte> whole(const gradsync::detail::TransportBuffer<X>& buffer) {
  return {buffer.data(), buffer.size()};
}

template <TransportPolicy X>
class Messages final : private transport::CompletionSink {
 public:
  using Clock = std::chrono::steady_clock;
  using LeftBehind = std::function<void(int peer, const Error&)>;

  Messages(X& transport, const Group& group, Timeline* timeline, LeftBehind left_behind)
      : transport_(transport),
        group_(group),
        n_(group.size()),
        timeline_(timeline),
        left_behind_(std::move(left_behind)),
        transfers_(static_cast<std::size_t>(sites) * static_cast<std::size_t>(n_)),
        posted_(transfers_.size(), 0),
        dead_(static_cast<std::size_t>(n_), 0) {
    completions_.reserve(transfers_.size());
  }

  // Where transfers and the roles' compute steps are recorded, if anywhere (set before any post).
  void trace_into(Timeline* timeline) noexcept { timeline_ = timeline; }
  const Group& group() const noexcept { return group_; }
  X& transport() noexcept { return transport_; }
  std::size_t requests() const noexcept { return transfers_.size(); }

  bool dead(int peer) const { return dead_[static_cast<std::size_t>(peer)] != 0; }
  void mark_dead(int peer) {
    dead_[static_cast<std::size_t>(peer)] = 1;
    dead_mask_ |= std::uint64_t{1} << peer;
  }
  int dead_count() const noexcept { return std::popcount(dead_mask_); }
  std::uint64_t dead_mask() const noexcept { return dead_mask_; }  // bit p: group rank p is dead
  bool posted(Site site, int peer) const { return posted_[index(site, peer)] != 0; }
  // Bytes this rank has sent to others (what goes to itself crosses no link).
  std::uint64_t bytes_sent() const noexcept { return sent_; }

  void post(Site site, int peer, bool is_send, Kind kind, std::uint64_t sequence, std::span<std::byte> bytes) {
    if (dead(peer)) return;
    const std::size_t i = index(site, peer);
    engine::Transfer<X>& transfer = transfers_[i];
    transfer.request().report_to(this, i);
    const std::uint64_t tag = engine::control_tag(sequence, engine::ControlMessage::async_parameter_server, kind);
    const int member = group_.members[static_cast<std::size_t>(peer)];
    try {
      if (is_send)
        transfer.send(transport_, member, tag, bytes, timeline_);
      else
        transfer.recv(transport_, member, tag, bytes, timeline_);
    } catch (const Error& e) {
      left_behind_(peer, e);
      return;
    }
    posted_[i] = 1;
    if (is_send && peer != group_.rank) sent_ += bytes.size();
  }

  // The communication thread's wait for work: completions (their request indexes, into `batch`)
  // or the trainer's wake(); false once stop() was called.
  bool next(std::vector<std::uint64_t>& batch) {
    std::unique_lock events(events_mutex_);
    events_cv_.wait(events, [&] { return stop_ || woken_ || !completions_.empty(); });
    if (stop_) return false;
    batch.swap(completions_);
    woken_ = false;
    return true;
  }
  void wake() {
    {
      std::lock_guard lock(events_mutex_);
      woken_ = true;
    }
    events_cv_.notify_one();
  }
  void stop() {
    {
      std::lock_guard lock(events_mutex_);
      stop_ = true;
    }
    events_cv_.notify_all();
  }

  // Request i's message: its site and peer.
  struct Message {
    Site site;
    int peer;
  };
  Message locate(std::size_t i) const {
    return {static_cast<Site>(i / static_cast<std::size_t>(n_)), static_cast<int>(i % static_cast<std::size_t>(n_))};
  }

  // Request i, reported complete: its bytes, or the transport's Error for it (either way it is no
  // longer posted).
  std::size_t settle(std::size_t i, std::chrono::milliseconds timeout) {
    posted_[i] = 0;
    const std::size_t bytes = transfers_[i].wait(transport_, Clock::now() + timeout);  // already settled
    if (timeline_) {
      const Message m = locate(i);
      transfers_[i].record(timeline_, static_cast<std::uint32_t>(part_of(m.site, m.peer)), bytes);
    }
    return bytes;
  }

  // Takes back what is still posted (a wait whose deadline has passed withdraws what is
  // unmatched), so the transport holds none of the roles' buffers; errors are the peers' business.
  void withdraw(Clock::time_point deadline) {
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      if (!posted_[i]) continue;
      try {
        transfers_[i].wait(transport_, deadline);
      } catch (const Error&) {
      }
    }
  }

  // A message shorter than its receive: the ranks registered different parameters (a longer one
  // the transport refuses itself).
  void expect_bytes(int peer, const char* operation, std::size_t bytes, std::size_t expected) const {
    if (bytes != expected)
      throw Error(ErrorKind::protocol,
                  {.rank = transport_.rank(), .peer = group_.members[static_cast<std::size_t>(peer)], .operation = operation},
                  fmt::format("{} bytes where {} were expected: do the ranks register the same parameters?", bytes,
                              expected));
  }

  // The timeline's compute events: an encode or decode of part p's `elements` values.
  std::int64_t trace_start() const noexcept { return timeline_ ? Timeline::now() : 0; }
  void trace_compute(Timeline::Kind kind, std::int64_t start, int p, std::size_t elements) {
    if (timeline_) timeline_->record(kind, start, static_cast<std::uint32_t>(p), elements);
  }

 private:
  std::size_t index(Site site, int peer) const {
    return static_cast<std::size_t>(site) * static_cast<std::size_t>(n_) + static_cast<std::size_t>(peer);
  }

  // Transports report here, from their threads or (in process) from the poster's: never under
  // the synchronizer's lock, which the communication thread holds while it posts.
  void completed(std::uint64_t id) noexcept override {
    {
      std::lock_guard lock(events_mutex_);
      completions_.push_back(id);
    }
    events_cv_.notify_one();
  }

  // The part a message carries, its "bucket" on the timeline: the peer's as server for what this
  // rank sends or gets as worker, this rank's own otherwise.
  int part_of(Site site, int peer) const {
    const bool as_worker = site == push_sent || site == pull_sent || site == reply_received ||
                           site == parameters_sent || site == average_received;
    return as_worker ? peer : group_.rank;
  }

  X& transport_;
  const Group& group_;
  int n_;
  Timeline* timeline_;
  LeftBehind left_behind_;
  std::vector<engine::Transfer<X>> transfers_;  // by site, then peer
  std::vector<std::uint8_t> posted_;            // per transfer: its completion not handled yet
  std::vector<std::uint8_t> dead_;              // per peer: failed and left behind
  std::uint64_t dead_mask_ = 0;
  std::uint64_t sent_ = 0;

  std::mutex events_mutex_;
  std::condition_variable events_cv_;
  std::vector<std::uint64_t> completions_;
  bool woken_ = false, stop_ = false;
};

}  // namespace gradsync::async::detail
