#pragma once
// Matcher — posted sends and receives that wait for their other half, for the transports that copy
// a message themselves: InProcess (one per receiving rank) and Tcp (a rank's messages to itself).
// A send and a receive are halves of one message when they name the same sender and tag; the
// first request posted is the first matched. Whoever posts the second half copies the message
// straight from the send's buffer into the receive's, so nothing is buffered or allocated.
//
// The matcher knows nothing of locks, completion or errors: each transport guards it with its
// own lock and completes a match its own way.

#include <cstddef>
#include <optional>

#include "detail/intrusive_queue.hpp"
#include "transport/delivery.hpp"

namespace gradsync::transport::detail {

template <class Request>
class Matcher {
 public:
  struct Match {
    Request& send;
    Request& receive;
  };

  // Takes out and returns the first request of the other kind that `r` completes, or queues `r`.
  // `sender(request)` is the rank whose send the request is, or is waiting for.
  template <class SenderOf>
  std::optional<Match> match_or_queue(Request& r, SenderOf sender) {
    const int from = sender(r);
    Request* other = (r.is_send_ ? receives_ : sends_).take_if([&](const Request* o) {
      return o->tag_ == r.tag_ && sender(*o) == from;
    });
    if (!other) {
      (r.is_send_ ? sends_ : receives_).push(&r);
      return std::nullopt;
    }
    return r.is_send_ ? Match{r, *other} : Match{*other, r};
  }

  // Lands the message in the receive (copied, or added: delivery.hpp); false, touching nothing,
  // when it does not fit there.
  static bool copy(const Match& m) {
    if (!fits(m.send.size_, m.receive.size_, m.receive.delivery_)) return false;
    deliver(m.receive.destination_, m.send.source_, m.send.size_, m.receive.delivery_);
    return true;
  }

  // Takes out a request still waiting for its other half; false if it is not here.
  bool withdraw(Request& r) noexcept { return (r.is_send_ ? sends_ : receives_).remove(&r); }

  // Calls f on every waiting request, sends first, and empties the matcher.
  template <class F>
  void drain(F&& f) {
    sends_.drain(f);
    receives_.drain(f);
  }

 private:
  gradsync::detail::IntrusiveQueue<Request> sends_, receives_;
};

}  // namespace gradsync::transport::detail
