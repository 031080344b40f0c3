#pragma once
// async::detail::PlanRound — the rounds in which the asynchronous parameter server's ranks agree
// on a new bucket plan: at the iterations the bucketing policy names (agreement_due), group rank
// 0's proposal is installed everywhere, as the Synchronizer does (concepts.hpp, BucketingPolicy).
// Here the parts every server keeps are cut by the plan (parts.hpp), so a new plan takes over only
// where nothing cut the old way is needed any more. A round at iteration t, inside wait(t):
//
//   1. An exchange: every rank tells rank 0 it has come to the round, and rank 0 answers all with
//      its decision: the new plan, or nothing (keep the current one, the usual answer: the round
//      ends there). No rank is ever a round ahead of another.
//   2. A new plan: each rank's wait(t) waits for every part's g_t (as wait(0) does) and applies
//      it, so every global gradient of the old cut has been applied; then a second exchange says
//      that every rank has, and each installs the plan (worker and server). A faster rank's pushes
//      of t + 1, cut the new way, may reach a server before it has installed: the server holds
//      them until it has (PartServer::hold).
//
// Exchanges run on the communication thread: "up" messages (empty) from every rank to rank 0,
// "down" messages from rank 0 to every rank (the encoded plan, engine::encode_plan, or empty),
// each numbered by the exchange. Everything here is called under the synchronizer's lock.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/async/messages.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/error.hpp"
#include "gradsync/plan.hpp"

namespace gradsync::async::detail {

template <TransportPolicy X>
class PlanRound {
 public:
  // Buffers for a plan of `gradients` gradients (engine::encode_plan: a word per bucket, a word
  // per gradient, and one).
  PlanRound(Messages<X>& messages, std::size_t gradients)
      : m_(messages),
        capacity_(4 * (1 + 2 * gradients)),
        down_bytes_(&messages.transport(), capacity_),
        down_due_(static_cast<std::size_t>(n()), 0),
        ups_from_(static_cast<std::size_t>(n()), 0) {}

  // Posts the standing receives: rank 0 of every other rank's "up", the others of rank 0's "down".
  void start() {
    if (m_.group().rank != 0)
      m_.post(down_received, 0, false, down, 0, whole(down_bytes_));
    else
      for (int w = 1; w < n(); ++w) m_.post(up_received, w, false, up, 0, {});
  }

  // Starts this rank's next exchange; rank 0 answers every rank with `text` (at most a plan's
  // bytes) once all have come. done() says when it is over everywhere.
  void begin(std::string text) {
    if (text.size() > capacity_)
      throw Error(ErrorKind::internal, {.rank = m_.transport().rank(), .operation = "plan round"},
                  "a plan larger than its buffer");
    begun_ = true;
    if (m_.group().rank == 0)
      answer_ = std::move(text);
    else
      up_due_ = true;
  }

  // The exchange begun last is over: what rank 0 answered is text(). Then next() readies the one after.
  bool done() const { return begun_ && down_came_; }
  std::string_view text() const { return {reinterpret_cast<const char*>(down_bytes_.data()), text_size_}; }
  BucketPlan plan() const {
    return engine::decode_plan(text(), {.rank = m_.transport().rank(), .peer = m_.group().members[0], .operation = "plan round"});
  }
  void next() {
    begun_ = down_came_ = false;
    ++exchanges_;
  }

  // Sends what is due: this rank's "up", or on rank 0 the answers once every rank has come.
  void progress() {
    if (up_due_ && !m_.posted(up_sent, 0)) {
      up_due_ = false;
      m_.post(up_sent, 0, true, up, exchanges_, {});
    }
    if (m_.group().rank == 0 && begun_ && !down_came_ && everyone_came()) {
      std::memcpy(down_bytes_.data(), answer_.data(), answer_.size());
      text_size_ = answer_.size();
      down_came_ = true;
      for (int w = 1; w < n(); ++w) down_due_[w] = 1;
    }
    for (int w = 1; w < n(); ++w)
      if (down_due_[w] && !m_.posted(down_sent, w)) {
        down_due_[w] = 0;
        m_.post(down_sent, w, true, down, exchanges_, whole(down_bytes_).first(text_size_));
      }
  }

  // A rank's "up" has come (rank 0), or rank 0's "down" (the others): the next is awaited.
  void up_arrived(int w) { m_.post(up_received, w, false, up, ++ups_from_[w], {}); }
  void down_arrived(std::size_t bytes) {
    text_size_ = bytes;
    down_came_ = true;
    m_.post(down_received, 0, false, down, exchanges_ + 1, whole(down_bytes_));
  }

 private:
  int n() const noexcept { return m_.group().size(); }

  // Rank 0: every rank has come to this exchange, and the answers to the last one have left (they
  // are sent from the buffer this one's answer goes into).
  bool everyone_came() const {
    for (int w = 1; w < n(); ++w)
      if (ups_from_[w] <= exchanges_ || m_.posted(down_sent, w)) return false;
    return true;
  }

  Messages<X>& m_;
  std::size_t capacity_;
  gradsync::detail::TransportBuffer<X> down_bytes_;  // rank 0's answer: sent from here, received here
  std::size_t text_size_ = 0;
  std::vector<std::uint8_t> down_due_;  // rank 0, per rank: its answer is still to be sent
  std::uint64_t exchanges_ = 0;         // exchanges over: the sequence number of the next one's messages
  std::vector<std::uint64_t> ups_from_;  // rank 0, per rank: its "up" messages come so far
  std::string answer_;                   // rank 0: the answer of the exchange begun
  bool begun_ = false, up_due_ = false, down_came_ = false;
};

}  // namespace gradsync::async::detail
