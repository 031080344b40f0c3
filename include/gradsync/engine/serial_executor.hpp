#pragma once
// engine::BucketExchange — runs one bucket's schedule on the calling thread: sends and receives
// are posted to the transport and proceed on their own; encode, decode and averaging run inline
// in list order. Everything it touches (encoded scratch, transport requests, codec state) is
// sized in the constructor, when a plan is installed, so running it allocates nothing.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/aligned_buffer.hpp"

namespace gradsync::engine {

// Tags carry the iteration (mod 2^16), the bucket and the schedule's message id, so messages of
// neighbouring iterations or buckets can never be mistaken for each other.
inline constexpr std::uint32_t control_bucket = 0xffff;
inline constexpr std::size_t max_buckets = control_bucket;  // bucket ids 0..0xfffe

constexpr std::uint64_t make_tag(std::uint64_t iteration, std::uint32_t bucket, std::uint32_t message) noexcept {
  return ((iteration & 0xffffu) << 48) | (static_cast<std::uint64_t>(bucket & 0xffffu) << 32) | message;
}

struct ExchangeContext {
  const Group& group;
  std::uint64_t iteration;
  std::uint32_t bucket;
  std::chrono::milliseconds timeout;
};

// What one run cost: bytes sent, the bytes those sends would have been in the accumulation dtype
// (so their ratio is the compression achieved), time in encode/decode/average, and time blocked
// waiting for the transport.
struct ExchangeStats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_uncompressed = 0;
  std::chrono::nanoseconds compute{0};
  std::chrono::nanoseconds waiting{0};
};

template <CompressionPolicy C, TransportPolicy X>
class BucketExchange {
 public:
  BucketExchange() = default;
  BucketExchange(Schedule schedule, const C& codec, DType dtype)
      : schedule_(std::move(schedule)),
        slot_offset_(schedule_.slot_elements.size()),
        slot_capacity_(schedule_.slot_elements.size()),
        slot_bytes_(schedule_.slot_elements.size()),
        requests_(schedule_.steps.size()),
        completed_(schedule_.steps.size()) {
    std::size_t total = 0;
    for (std::size_t s = 0; s < slot_offset_.size(); ++s) {
      slot_offset_[s] = total;
      slot_capacity_[s] = codec.max_encoded_bytes(schedule_.slot_elements[s], dtype);
      total += detail::align_up(slot_capacity_[s]);
    }
    scratch_ = detail::AlignedBuffer(total);
    states_.reserve(schedule_.steps.size());
    for (const Step& step : schedule_.steps)
      states_.push_back(codec.make_state(step.op == Step::Op::encode ? step.range.size() : 0, dtype));
  }

  const Schedule& schedule() const noexcept { return schedule_; }

  // Leaves the group's average in `values`; returns what it cost.
  template <class T>
  ExchangeStats run(std::span<T> values, const C& codec, X& transport, const ExchangeContext& ctx) {
    std::fill(completed_.begin(), completed_.end(), std::uint8_t{0});
    stats_ = {};
    std::size_t current = 0;
    try {
      for (; current < schedule_.steps.size(); ++current) {
        const Step& step = schedule_.steps[current];
        if (step.after != no_step) complete<T>(step.after, transport, ctx);
        const auto range = values.subspan(step.range.begin, step.range.size());
        const auto started = std::chrono::steady_clock::now();
        switch (step.op) {
          case Step::Op::send: {
            const auto bytes = step.slot == no_slot ? std::as_bytes(range) : encoded(step.slot);
            transport.send(requests_[current], ctx.group.members[step.peer], tag(ctx, step), bytes);
            stats_.bytes_sent += bytes.size();
            stats_.bytes_uncompressed += range.size_bytes();
            break;
          }
          case Step::Op::recv:
            transport.recv(requests_[current], ctx.group.members[step.peer], tag(ctx, step),
                           step.slot == no_slot ? std::as_writable_bytes(range) : capacity(step.slot));
            break;
          case Step::Op::encode:
            slot_bytes_[step.slot] = codec.encode(std::span<const T>(range), states_[current], capacity(step.slot));
            break;
          case Step::Op::decode_add: codec.decode(encoded(step.slot), range, DecodeMode::add); break;
          case Step::Op::decode_copy: codec.decode(encoded(step.slot), range, DecodeMode::overwrite); break;
          case Step::Op::average: {
            const T n = static_cast<T>(ctx.group.size());
            for (T& v : range) v /= n;
            break;
          }
        }
        if (step.op != Step::Op::send && step.op != Step::Op::recv) stats_.compute += std::chrono::steady_clock::now() - started;
      }
      for (current = 0; current < schedule_.steps.size(); ++current) {
        const Step::Op op = schedule_.steps[current].op;
        if (op == Step::Op::send || op == Step::Op::recv) complete<T>(static_cast<std::uint32_t>(current), transport, ctx);
      }
    } catch (const Error& e) {
      const Step& step = schedule_.steps[std::min(current, schedule_.steps.size() - 1)];
      throw e.filled({.rank = ctx.group.members[ctx.group.rank],
                      .peer = step.peer >= 0 ? std::optional<int>(ctx.group.members[step.peer]) : std::nullopt,
                      .bucket = ctx.bucket,
                      .operation = std::string(name(step.op))});
    }
    return stats_;
  }

 private:
  static std::string_view name(Step::Op op) {
    switch (op) {
      case Step::Op::send: return "send";
      case Step::Op::recv: return "recv";
      case Step::Op::encode: return "encode";
      case Step::Op::decode_add: return "decode-add";
      case Step::Op::decode_copy: return "decode-copy";
      case Step::Op::average: return "average";
    }
    return "step";
  }

  static std::uint64_t tag(const ExchangeContext& ctx, const Step& step) {
    return make_tag(ctx.iteration, ctx.bucket, step.message);
  }

  std::span<std::byte> capacity(std::uint32_t slot) const {
    return {scratch_.data() + slot_offset_[slot], slot_capacity_[slot]};
  }
  std::span<const std::byte> encoded(std::uint32_t slot) const {
    return {scratch_.data() + slot_offset_[slot], slot_bytes_[slot]};
  }

  // Waits for send or receive `index` once; a receive records how many bytes its slot now holds.
  template <class T>
  void complete(std::uint32_t index, X& transport, const ExchangeContext& ctx) {
    if (completed_[index]) return;
    const Step& step = schedule_.steps[index];
    const auto started = std::chrono::steady_clock::now();
    const std::size_t bytes = transport.wait(requests_[index], started + ctx.timeout);
    stats_.waiting += std::chrono::steady_clock::now() - started;
    completed_[index] = 1;
    if (step.op != Step::Op::recv) return;
    if (step.slot != no_slot) {
      slot_bytes_[step.slot] = bytes;
    } else if (bytes != step.range.size() * sizeof(T)) {
      throw Error(ErrorKind::protocol, {.operation = "recv"},
                  fmt::format("expected {} bytes for elements [{}, {}), got {}", step.range.size() * sizeof(T),
                              step.range.begin, step.range.end, bytes));
    }
  }

  Schedule schedule_;
  std::vector<std::size_t> slot_offset_;
  std::vector<std::size_t> slot_capacity_;
  std::vector<std::size_t> slot_bytes_;
  detail::AlignedBuffer scratch_;
  std::vector<typename X::Request> requests_;  // one per step; only sends and receives use theirs
  std::vector<std::uint8_t> completed_;
  std::vector<typename C::State> states_;  // one per step; encode steps get real state
  ExchangeStats stats_;
};

}  // namespace gradsync::engine
