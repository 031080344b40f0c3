#pragma once
// PeerChannel<X> — tensors between two ranks, outside any group's averaging: what a
// model-parallel pair passes across its cut, the activations going forward and their gradients
// coming back (the third source document's conv rank and fc rank). It runs on the same transport
// as the pair's Synchronizers (transport::Borrowed) and keeps their rules:
//   - every wait has the channel's timeout and ends in an Error naming this rank, the peer, the
//     channel and the stream;
//   - a message of another length than the receiver expects is an Error(protocol) on both sides
//     (longer: the transport's check; shorter: the channel's), never a partial tensor;
//   - any failure aborts the transport before it is thrown, so the ranks of both groups fail fast
//     instead of waiting for a pair that will never answer;
//   - bytes travel as the transport sends them: over TCP framed, versioned and authenticated.
// Messages are numbered per stream and direction, so both sides must send and receive a stream's
// messages in the same order; different streams never match each other. The tags come from
// ControlMessage::peer_tensors (engine/tag.hpp), which no Synchronizer uses, so a channel may join
// two ranks that also share a group.
//
//   transport::Tcp world = transport::Tcp::from_env();
//   PeerChannel<transport::Borrowed<transport::Tcp>> pair(transport::Borrowed(world), partner, 60s, "conv-fc");
//   pair.send(std::span<const float>(activations), 0);   // on the conv rank
//   pair.recv(std::span<float>(activation_gradients), 1);

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/engine/tag.hpp"

namespace gradsync {

template <TransportPolicy X>
class PeerChannel {
 public:
  static constexpr std::uint32_t max_streams = engine::peer_tensor_streams;

  // Joins this rank to transport rank `peer`; `name` is how errors name the channel.
  PeerChannel(X transport, int peer, std::chrono::milliseconds timeout, std::string name = "peer channel")
      : transport_(std::move(transport)), peer_(peer), timeout_(timeout), name_(std::move(name)) {
    if (peer < 0 || peer >= transport_.size() || peer == transport_.rank())
      throw Error(ErrorKind::invalid_argument, {.rank = transport_.rank(), .operation = name_},
                  fmt::format("peer {} is not another rank of the transport's {}", peer, transport_.size()));
    if (timeout <= std::chrono::milliseconds::zero())
      throw Error(ErrorKind::invalid_argument, {.rank = transport_.rank(), .operation = name_},
                  fmt::format("timeout is {} ms; it must be above 0", timeout.count()));
  }

  PeerChannel(const PeerChannel&) = delete;
  PeerChannel& operator=(const PeerChannel&) = delete;

  int rank() const noexcept { return transport_.rank(); }
  int peer() const noexcept { return peer_; }
  // Bytes of every message sent so far (payloads; the transport's framing not included).
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

  // Sends `values` as the next message of `stream`; returns once the transport is done with them.
  template <class T>
    requires std::same_as<T, float> || std::same_as<T, double>
  void send(std::span<const T> values, std::uint32_t stream) {
    const std::uint64_t tag = next_tag(sent_, stream, "send");
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    try {
      transport_.send(request_, peer_, tag, std::as_bytes(values));
      transport_.wait(request_, deadline);
    } catch (const Error& e) {
      fail(e, "send", stream);
    }
    bytes_sent_ += values.size_bytes();
  }

  // Receives the next message of `stream` into `values`, which it must fill exactly.
  template <class T>
    requires std::same_as<T, float> || std::same_as<T, double>
  void recv(std::span<T> values, std::uint32_t stream) {
    const std::uint64_t tag = next_tag(received_, stream, "recv");
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::size_t bytes = 0;
    try {
      transport_.recv(request_, peer_, tag, std::as_writable_bytes(values));
      bytes = transport_.wait(request_, deadline);
    } catch (const Error& e) {
      fail(e, "recv", stream);
    }
    if (bytes != values.size_bytes())
      fail(Error(ErrorKind::protocol, {},
                 fmt::format("the peer sent {} bytes where {} values of {} bytes were expected", bytes,
                             values.size(), sizeof(T))),
           "recv", stream);
  }

 private:
  std::uint64_t next_tag(std::array<std::uint64_t, max_streams>& counts, std::uint32_t stream, const char* what) {
    if (stream >= max_streams)
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer_, .operation = operation(what, stream)},
                  fmt::format("stream {} is out of range: a channel has streams 0 to {}", stream, max_streams - 1));
    return engine::control_tag(counts[stream]++, engine::ControlMessage::peer_tensors, stream);
  }

  std::string operation(const char* what, std::uint32_t stream) const {
    return fmt::format("{} {} of stream {}", name_, what, stream);
  }

  // Names where it happened, tells every rank (the transport's abort), and throws.
  [[noreturn]] void fail(const Error& e, const char* what, std::uint32_t stream) {
    const Error located(e.kind(), {.rank = rank(), .peer = e.context().peer.value_or(peer_),
                                   .operation = operation(what, stream)},
                        e.detail());
    transport_.abort(located);
    throw located;
  }

  X transport_;
  int peer_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  typename X::Request request_;
  std::array<std::uint64_t, max_streams> sent_{};      // messages sent so far, per stream
  std::array<std::uint64_t, max_streams> received_{};  // and received
  std::uint64_t bytes_sent_ = 0;
};

}  // namespace gradsync
