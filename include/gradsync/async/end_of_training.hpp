#pragma once
// async::detail::EndOfTraining — how the asynchronous parameter server's ranks stop: a rank whose
// trainer is done (Synchronizer::finish()) says "done" to every server, and keeps serving its own
// part until every live worker has said the same, so that no worker's last pull goes unanswered.
// A rank closes only once every worker has finished, so a peer that goes after that is no failure.
// Called under the synchronizer's lock.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gradsync/async/messages.hpp"
#include "gradsync/concepts.hpp"

namespace gradsync::async::detail {

template <TransportPolicy X>
class EndOfTraining {
 public:
  explicit EndOfTraining(Messages<X>& messages)
      : m_(messages), done_from_(static_cast<std::size_t>(messages.group().size()), 0) {}

  // Posts the receives of every worker's "done".
  void start() {
    for (int w = 0; w < n(); ++w) m_.post(done_received, w, false, done, 0, {});
  }

  // This rank's trainer is done: from now on a peer that goes is no failure.
  void begin() { finishing_ = true; }
  bool finishing() const noexcept { return finishing_; }

  // Sends this rank's "done" to every server, once begin() was called.
  void progress() {
    if (!finishing_ || posted_) return;
    posted_ = true;
    for (int p = 0; p < n(); ++p) m_.post(done_sent, p, true, done, 0, {});
  }

  void arrived(int w) { done_from_[static_cast<std::size_t>(w)] = 1; }

  // Every live worker has finished and this rank's own "done" messages have left.
  bool over() const {
    if (!posted_) return false;
    for (int p = 0; p < n(); ++p)
      if (m_.posted(done_sent, p) || (!done_from_[static_cast<std::size_t>(p)] && !m_.dead(p))) return false;
    return true;
  }
  long finished_workers() const { return std::count(done_from_.begin(), done_from_.end(), 1); }

 private:
  int n() const noexcept { return m_.group().size(); }

  Messages<X>& m_;
  std::vector<std::uint8_t> done_from_;  // per worker: it has finished, as this rank's server heard
  bool finishing_ = false, posted_ = false;
};

}  // namespace gradsync::async::detail
