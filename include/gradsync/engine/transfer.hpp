#pragma once
// engine::Transfer — one message a rank sends or receives through its transport, and the one way
// the engine's three paths move bytes: a bucket's exchange (exchange.hpp, under either executor),
// the asynchronous parameter server's messages (async/messages.hpp) and the sparse exchange
// (sparse/exchange.hpp) post a Transfer, hear or wait that it finished, and put it on the
// timeline the same way.
//
// A Transfer is its transport request and what its posting was: the peer (a transport rank),
// whether it sends, and when it was posted, kept only for the timeline. Posting and waiting are
// the transport's own calls (concepts.hpp, TransportPolicy); a caller that follows many transfers
// at once names the CompletionSink their reports go to (request().report_to()) and waits for each
// once it has heard that it finished, which returns at once with its bytes or throws its Error.
// Nothing here allocates: a path sizes its Transfers when it is set up and posts them again and
// again.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>

#include "gradsync/concepts.hpp"
#include "gradsync/timeline.hpp"

namespace gradsync::engine {

template <TransportPolicy X>
class Transfer {
 public:
  using Request = typename X::Request;

  Transfer() = default;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  void send(X& transport, int peer, std::uint64_t tag, std::span<const std::byte> bytes, const Timeline* timeline) {
    posted(peer, true, timeline);
    transport.send(request_, peer, tag, bytes);
  }
  void recv(X& transport, int peer, std::uint64_t tag, std::span<std::byte> bytes, const Timeline* timeline) {
    posted(peer, false, timeline);
    transport.recv(request_, peer, tag, bytes);
  }
  // A receive that adds what arrives into `values` (TransportAdder, concepts.hpp).
  template <class T>
    requires TransportAdder<X>
  void recv_add(X& transport, int peer, std::uint64_t tag, std::span<T> values, const Timeline* timeline) {
    posted(peer, false, timeline);
    transport.recv_add(request_, peer, tag, values);
  }

  // Blocks until the transfer settles or `deadline` passes; its bytes (sent, or received). Throws
  // the transport's Error, Error(timeout) past the deadline.
  std::size_t wait(X& transport, std::chrono::steady_clock::time_point deadline) {
    return transport.wait(request_, deadline);
  }

  // The finished transfer on `timeline`, if there is one: a send to or receive from its peer, from
  // its posting to now, for `bucket` (or whatever the path numbers its messages by), with `bytes`.
  void record(Timeline* timeline, std::uint32_t bucket, std::size_t bytes) const noexcept {
    if (timeline)
      timeline->record(is_send_ ? Timeline::Kind::send : Timeline::Kind::recv, posted_at_, bucket, bytes, peer_);
  }

  Request& request() noexcept { return request_; }
  int peer() const noexcept { return peer_; }

 private:
  void posted(int peer, bool is_send, const Timeline* timeline) noexcept {
    peer_ = peer;
    is_send_ = is_send;
    if (timeline) posted_at_ = Timeline::now();
  }

  Request request_;
  std::int64_t posted_at_ = 0;  // with a timeline: when it was last posted
  int peer_ = -1;
  bool is_send_ = false;
};

}  // namespace gradsync::engine
