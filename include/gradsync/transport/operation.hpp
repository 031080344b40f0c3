#pragma once
// What a transport records about one posted send or receive. Each transport's Request derives
// from Operation<Request> and adds what only it needs (its state, kept the way its locking wants).

#include <cstddef>
#include <cstdint>
#include <optional>

#include "gradsync/error.hpp"
#include "gradsync/transport/completion.hpp"

namespace gradsync::transport::detail {

// How a receive takes its message: copied over the buffer (recv), or added to the values there,
// read as f32 or f64 (recv_add).
enum class Delivery : std::uint8_t { copy, add_f32, add_f64 };

template <class Request>
struct Operation {
  enum class State : std::uint8_t { idle, pending, done, failed };

  Request* next_ = nullptr;  // intrusive link in the transport's queues
  bool is_send_ = false;
  int peer_ = -1;
  std::uint64_t tag_ = 0;
  const std::byte* source_ = nullptr;  // a send's bytes
  std::byte* destination_ = nullptr;   // a receive's buffer
  std::size_t size_ = 0;               // bytes offered (send) or room (receive)
  Delivery delivery_ = Delivery::copy;  // a receive's
  std::size_t transferred_ = 0;
  std::optional<Error> error_;
  CompletionSink* sink_ = nullptr;  // told of every completion, if set (see completion.hpp)
  std::uint64_t sink_id_ = 0;

  // Names where this request reports its completions from now on; nullptr stops the reports.
  void report_to(CompletionSink* sink, std::uint64_t id) noexcept {
    sink_ = sink;
    sink_id_ = id;
  }
  void report() const noexcept {
    if (sink_) sink_->completed(sink_id_);
  }

  void start(bool is_send, int peer, std::uint64_t tag, const std::byte* source, std::byte* destination,
             std::size_t size, Delivery delivery = Delivery::copy) {
    is_send_ = is_send;
    delivery_ = delivery;
    peer_ = peer;
    tag_ = tag;
    source_ = source;
    destination_ = destination;
    size_ = size;
    transferred_ = 0;
    error_.reset();
  }
};

}  // namespace gradsync::transport::detail
