#pragma once
// engine::BucketExchange — everything one bucket's schedule needs to run, and the serial way of
// running it.
//
// The exchange owns what the steps touch besides the bucket's values: the encoded scratch slots,
// one transport request and one codec state per step. All of it is sized in the constructor, when
// a plan is installed, so running allocates nothing. Each building block (perform a compute step,
// post a transfer, take a finished receive) touches only its own step's slot, request and state,
// so steps that do not depend on each other may run on different threads: that is what the task
// graph engine (task_graph.hpp) does with them.
//
// run() is the serial executor, kept as the naive baseline: the calling thread walks the list in
// order, performing encode, decode and averaging inline; a step waits for the transfer it depends
// on, and transfers proceed on the transport's own threads meanwhile.
//
// A slot holds plain values instead of an encoding when the schedule marks it raw (Schedule::
// slot_raw), or when the whole exchange is raw; compute() is where that is decided, so both
// executors (run() and the task graph, which calls compute() too) treat raw slots alike.
//
// Adding on receive. A receive of plain values (a raw slot, or any slot of an identity codec)
// whose only use is the decode-and-add right after it can skip the slot: where the transport
// adds what it receives (TransportAdder) into the bucket's memory, the receive is posted as
// recv_add and the add step has nothing left to do. One pass over the bytes instead of two (copy
// into the slot, then add), the same sums bit for bit. Decided per receive when it is posted
// (adds_into), so a peer the transport cannot add from, or a bucket outside the transport's
// memory, falls back to the slot. Only a receive that is the first step of its schedule to touch
// its range qualifies: posted early, it adds while the schedule runs, so nothing else may read or
// write those values until its add step.
//
// On a device transport (DeviceTransport, concepts.hpp: transport::Nccl, transport::CudaStaged)
// the bucket and the slots are device memory, and compute() queues each step as kernels on the
// transport's stream: the device codecs (cuda/codecs.hpp, the CPU codecs' bits), their fused error
// feedback with a device residual per encode step, a kernel add for plain values and a kernel
// division for the average. The transport orders its transfers after what is queued on that
// stream, so a send follows its encode without the host waiting; the host waits only for
// receives (and the task graph not even there). A step's compute time is the time to queue its
// kernels. f32 buckets only, and codecs with a device path (every codec has one); the constructor says so
// otherwise.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/aligned_buffer.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/engine/transfer.hpp"
#include "gradsync/options.hpp"
#include "gradsync/timeline.hpp"
#include "gradsync/version.hpp"
#if GRADSYNC_HAS_CUDA
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/cuda/codecs.hpp"
#endif

namespace gradsync::engine {

// A bucket's values in its accumulation dtype. The Synchronizer decides which when it installs a
// plan; everything downstream visits the span it was given.
using BucketValues = std::variant<std::span<float>, std::span<double>>;

inline std::size_t value_bytes(const BucketValues& values) noexcept {
  return values.index() == 0 ? sizeof(float) : sizeof(double);
}

struct ExchangeContext {
  const Group& group;
  std::uint64_t iteration;
  std::uint32_t bucket;
  std::chrono::milliseconds timeout;
};

constexpr bool is_transfer(Step::Op op) noexcept { return op == Step::Op::send || op == Step::Op::recv; }

constexpr std::string_view name(Step::Op op) noexcept {
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

#if GRADSYNC_HAS_CUDA
template <class C>
struct ErrorFeedbackOf : std::false_type {};
template <class Inner>
struct ErrorFeedbackOf<compression::ErrorFeedback<Inner>> : std::true_type {
  using inner = Inner;
};

// Whether codec C has kernels (cuda/codecs.hpp), so that the device path can run it.
template <class C>
constexpr bool has_device_codec() {
  if constexpr (C::identity) return true;
  else if constexpr (ErrorFeedbackOf<C>::value) return has_device_codec<typename ErrorFeedbackOf<C>::inner>();
  else
    return requires(const C& codec, typename C::State& state, const float* in, std::byte* out, cuda::Stream& stream) {
      cuda::encode(codec, state, in, std::size_t{}, out, stream);
    };
}
#endif

template <CompressionPolicy C, TransportPolicy X>
class BucketExchange {
 public:
  BucketExchange() = default;
  // `raw`: the schedule was built for the identity (selective compression left this bucket
  // uncompressed), so every slot holds plain values whatever the codec, as if all were marked in
  // Schedule::slot_raw. `transport`, if given, provides the scratch slots when it hands out memory
  // (detail::TransportBuffer).
  BucketExchange(Schedule schedule, const C& codec, DType dtype, bool raw = false, X* transport = nullptr)
      : schedule_(std::move(schedule)),
        raw_(raw),
        slot_offset_(schedule_.slot_elements.size()),
        slot_capacity_(schedule_.slot_elements.size()),
        slot_bytes_(schedule_.slot_elements.size()),
        transfers_(schedule_.steps.size()),
        completed_(schedule_.steps.size()),
        absorbed_recv_(schedule_.steps.size(), no_step),
        adds_on_receive_(schedule_.steps.size()),
        added_(schedule_.steps.size()) {
    if (!schedule_.slot_raw.empty() && schedule_.slot_raw.size() != schedule_.slot_elements.size())
      throw Error(ErrorKind::invalid_argument, {.operation = "schedule"},
                  fmt::format("the topology's schedule marks {} slots raw or not, but has {} slots: "
                              "Schedule::slot_raw must be empty or have one entry per slot",
                              schedule_.slot_raw.size(), schedule_.slot_elements.size()));
    std::size_t total = 0;
    for (std::size_t s = 0; s < slot_offset_.size(); ++s) {
      slot_offset_[s] = total;
      const std::size_t elements = schedule_.slot_elements[s];
      slot_capacity_[s] = raw_slot(static_cast<std::uint32_t>(s)) ? elements * size_of(dtype)
                                                                  : codec.max_encoded_bytes(elements, dtype);
      total += detail::align_up(slot_capacity_[s]);
    }
    scratch_ = detail::TransportBuffer<X>(transport, total);
    for (const Step& step : schedule_.steps)
      if (step.op == Step::Op::average && schedule_.contributors < 1)
        throw Error(ErrorKind::invalid_argument, {.operation = "schedule"},
                    fmt::format("the topology's schedule averages over {} contributors: a topology must set "
                                "Schedule::contributors to the number of ranks whose values the average covers",
                                schedule_.contributors));
    states_.reserve(schedule_.steps.size());
    for (const Step& step : schedule_.steps)
      states_.push_back(codec.make_state(step.op == Step::Op::encode && !raw_slot(step.slot) ? step.range.size() : 0, dtype));
    if constexpr (TransportAdder<X>) find_adds_on_receive(C::identity);
    if constexpr (DeviceTransport<X>) prepare_device(codec, dtype, transport);
  }

  // This is bucket `bucket`'s exchange: its steps go in `timeline` from now on (the
  // Synchronizer's, if it keeps one), and a fault its device decodes find names it.
  void trace(Timeline* timeline, std::uint32_t bucket) {
    timeline_ = timeline;
    bucket_ = bucket;
  }

  // Send or receive `index` has completed with `bytes`: its span from posting, on the timeline.
  void transfer_done(std::size_t index, std::size_t bytes) noexcept {
    transfers_[index].record(timeline_, bucket_, bytes);
  }

  // Receives that may add on arrival (the top of this file): what the tests check.
  std::size_t receives_that_may_add() const noexcept {
    return static_cast<std::size_t>(std::count(adds_on_receive_.begin(), adds_on_receive_.end(), std::uint8_t{1}));
  }

  const Schedule& schedule() const noexcept { return schedule_; }

  // Whether decode-and-add step `index` has nothing left to do: its receive added on arrival.
  // Known once that receive is posted.
  bool added_on_receive(std::size_t index) const noexcept {
    return absorbed_recv_[index] != no_step && added_[absorbed_recv_[index]];
  }

  // The serial executor: leaves the group's average in `values`; returns what it cost.
  template <class T>
  ExchangeStats run(std::span<T> values, const C& codec, X& transport, const ExchangeContext& ctx) {
    std::fill(completed_.begin(), completed_.end(), std::uint8_t{0});
    ExchangeStats stats;
    std::size_t current = 0;
    try {
      for (; current < schedule_.steps.size(); ++current) {
        const Step& step = schedule_.steps[current];
        if (step.after != no_step) complete<T>(step.after, transport, ctx, stats);
        if (is_transfer(step.op)) {
          post(current, values, transport, ctx, stats);
        } else {
          const auto started = std::chrono::steady_clock::now();
          compute(current, values, codec);
          stats.compute += std::chrono::steady_clock::now() - started;
        }
      }
      for (current = 0; current < schedule_.steps.size(); ++current)
        if (is_transfer(schedule_.steps[current].op)) complete<T>(static_cast<std::uint32_t>(current), transport, ctx, stats);
    } catch (const Error& e) {
      throw located(e, std::min(current, schedule_.steps.size() - 1), ctx);
    }
    return stats;
  }

  // ---- building blocks, each touching only its own step's slot, request and state --------------

  // Runs encode, decode or average step `index` on `values`.
  template <class T>
  void compute(std::size_t index, std::span<T> values, const C& codec) {
    if (!timeline_) return compute_step(index, values, codec);
    const std::int64_t started = timeline_->now();
    compute_step(index, values, codec);
    const Step& step = schedule_.steps[index];
    timeline_->record(step.op == Step::Op::encode    ? Timeline::Kind::encode
                      : step.op == Step::Op::average ? Timeline::Kind::average
                                                     : Timeline::Kind::decode,
                      started, bucket_, step.range.size());
  }

  // Posts send or receive step `index`; counts the bytes a send puts on the wire.
  template <class T>
  void post(std::size_t index, std::span<T> values, X& transport, const ExchangeContext& ctx, ExchangeStats& stats) {
    const Step& step = schedule_.steps[index];
    const auto range = values.subspan(step.range.begin, step.range.size());
    const int peer = ctx.group.members[step.peer];
    const std::uint64_t tag = make_tag(ctx.iteration, ctx.bucket, step.message);
    Transfer<X>& transfer = transfers_[index];
    if (step.op == Step::Op::send) {
      const auto bytes = step.slot == no_slot ? std::as_bytes(range) : encoded(step.slot);
      transfer.send(transport, peer, tag, bytes, timeline_);
      stats.bytes_sent += bytes.size();
      stats.bytes_uncompressed += range.size_bytes();
    } else if (adds_on_receive(index, peer, range, transport)) {
      if constexpr (TransportAdder<X>) transfer.recv_add(transport, peer, tag, range, timeline_);
    } else {
      transfer.recv(transport, peer, tag, step.slot == no_slot ? std::as_writable_bytes(range) : capacity(step.slot),
                    timeline_);
    }
  }

  // Records what finished receive `index` delivered: the slot's encoded size, or a check that an
  // in-place receive filled its whole range.
  template <class T>
  void received(std::size_t index, std::size_t bytes) {
    const Step& step = schedule_.steps[index];
    if (step.slot != no_slot && !added_[index]) {
      slot_bytes_[step.slot] = bytes;
    } else if (bytes != step.range.size() * sizeof(T)) {
      throw Error(ErrorKind::protocol, {.operation = "recv"},
                  fmt::format("expected {} bytes for elements [{}, {}), got {}", step.range.size() * sizeof(T),
                              step.range.begin, step.range.end, bytes));
    }
  }

  typename X::Request& request(std::size_t index) noexcept { return transfers_[index].request(); }

  // The bytes send step `index` puts on the wire (once its encode, if any, has run), for values
  // of `value_bytes` each.
  std::size_t send_bytes(std::size_t index, std::size_t value_bytes) const noexcept {
    const Step& step = schedule_.steps[index];
    return step.slot == no_slot ? step.range.size() * value_bytes : slot_bytes_[step.slot];
  }

  // `e` with this rank, step `index`'s peer, the bucket and the step's operation filled in.
  Error located(const Error& e, std::size_t index, const ExchangeContext& ctx) const {
    const Step& step = schedule_.steps[index];
    return e.filled({.rank = ctx.group.members[ctx.group.rank],
                     .peer = step.peer >= 0 ? std::optional<int>(ctx.group.members[step.peer]) : std::nullopt,
                     .bucket = ctx.bucket,
                     .operation = std::string(name(step.op))});
  }

 private:
  // compute()'s work, untimed.
  template <class T>
  void compute_step(std::size_t index, std::span<T> values, const C& codec) {
    const Step& step = schedule_.steps[index];
    if constexpr (DeviceTransport<X>) {
      compute_on_device(index, values, codec);
    } else if constexpr (!CodecFor<C, T>) {
      // Executors visit both dtypes of BucketValues, so this is compiled for f64 even when C has
      // only the f32 path; the Synchronizer's add() keeps f64 buckets away from such a codec.
      throw Error(ErrorKind::unsupported, {.operation = std::string(name(step.op))},
                  fmt::format("codec {} has no {} path", codec.describe(), to_string(dtype_of<T>())));
    } else {
      const auto range = values.subspan(step.range.begin, step.range.size());
      if (added_on_receive(index)) return;
      if (step.slot != no_slot && raw_slot(step.slot)) {
        if (step.op == Step::Op::decode_add || step.op == Step::Op::decode_copy)
          return take_raw(encoded(step.slot), range, step.op == Step::Op::decode_add);
        if (step.op == Step::Op::encode) {
          if (!range.empty()) std::memcpy(capacity(step.slot).data(), range.data(), range.size_bytes());
          slot_bytes_[step.slot] = range.size_bytes();
          return;
        }
      }
      switch (step.op) {
        case Step::Op::encode:
          slot_bytes_[step.slot] = codec.encode(std::span<const T>(range), states_[index], capacity(step.slot));
          break;
        case Step::Op::decode_add: codec.decode(encoded(step.slot), range, DecodeMode::add); break;
        case Step::Op::decode_copy: codec.decode(encoded(step.slot), range, DecodeMode::overwrite); break;
        case Step::Op::average: {
          const T n = static_cast<T>(schedule_.contributors);
          for (T& v : range) v /= n;
          break;
        }
        case Step::Op::send:
        case Step::Op::recv: break;
      }
    }
  }

  // The device path (the top of this file): the transport's stream, and a zeroed residual per
  // encode step for error feedback.
  void prepare_device(const C& codec, DType dtype, X* transport) {
#if GRADSYNC_HAS_CUDA
    if (!transport)
      throw Error(ErrorKind::invalid_argument, {.operation = "exchange"},
                  "an exchange over a device transport needs the transport, for its memory and stream");
    if (dtype != DType::f32)
      throw Error(ErrorKind::unsupported, {.operation = "exchange"},
                  fmt::format("{} buckets over {}: the device path reduces f32 only", to_string(dtype),
                              transport->describe()));
    if (!has_device_codec<C>())
      throw Error(ErrorKind::unsupported, {.operation = "exchange"},
                  fmt::format("codec {} has no device path (cuda/codecs.hpp), so it cannot run over {}",
                              codec.describe(), transport->describe()));
    device_stream_ = &transport->cuda_stream();
    // The codecs' scratch for this schedule's largest encode, now rather than mid-iteration (growing
    // it waits for the stream and frees what it had).
    std::size_t largest_encode = 0;
    for (const Step& step : schedule_.steps)
      if (step.op == Step::Op::encode && !raw_slot(step.slot)) largest_encode = std::max(largest_encode, step.range.size());
    device_stream_->reserve(largest_encode);
    if constexpr (ErrorFeedbackOf<C>::value) {
      residual_offset_.assign(schedule_.steps.size(), 0);
      std::size_t total = 0;
      for (std::size_t i = 0; i < schedule_.steps.size(); ++i)
        if (schedule_.steps[i].op == Step::Op::encode && !raw_slot(schedule_.steps[i].slot)) {
          residual_offset_[i] = total;
          total += detail::align_up(schedule_.steps[i].range.size() * sizeof(float));
        }
      residuals_ = detail::TransportBuffer<X>(transport, total);
      cuda::fill_zero(residuals_.data(), total, *device_stream_);
    }
#else
    (void)codec, (void)dtype, (void)transport;
#endif
  }

  // compute_step() on the device (the top of this file): queued on the transport's stream.
  template <class T>
  void compute_on_device(std::size_t index, std::span<T> values, const C& codec) {
#if GRADSYNC_HAS_CUDA
    const Step& step = schedule_.steps[index];
    if constexpr (std::is_same_v<T, float> && has_device_codec<C>()) {
      cuda::Stream& stream = *device_stream_;
      // A decode's fault (error feedback's encodes decode too) is found at some later
      // synchronize(), maybe for another bucket's work: it names this one.
      stream.set_bucket(bucket_);
      const auto range = values.subspan(step.range.begin, step.range.size());
      const std::size_t n = range.size();
      if (step.op == Step::Op::average)
        return cuda::divide(range.data(), n, static_cast<float>(schedule_.contributors), stream);
      const bool raw = C::identity || raw_slot(step.slot);
      std::byte* slot = scratch_.data() + slot_offset_[step.slot];
      if (step.op == Step::Op::encode) {
        if (raw) {
          cuda::copy(slot, range.data(), range.size_bytes(), stream);
          slot_bytes_[step.slot] = range.size_bytes();
        } else if constexpr (ErrorFeedbackOf<C>::value) {
          auto* residual = reinterpret_cast<float*>(residuals_.data() + residual_offset_[index]);
          slot_bytes_[step.slot] =
              cuda::encode_with_feedback(codec.codec, states_[index].inner, range.data(), residual, n, slot, stream);
        } else if constexpr (!C::identity) {
          slot_bytes_[step.slot] = cuda::encode(codec, states_[index], range.data(), n, slot, stream);
        }
        return;
      }
      const bool add = step.op == Step::Op::decode_add;
      const std::size_t bytes = slot_bytes_[step.slot];
      if (raw) {
        if (bytes != range.size_bytes())
          throw Error(ErrorKind::protocol, {.operation = "recv"},
                      fmt::format("expected {} bytes of uncompressed values, got {}", range.size_bytes(), bytes));
        if (add) cuda::accumulate(range.data(), reinterpret_cast<const float*>(slot), n, stream);
        else cuda::copy(range.data(), slot, bytes, stream);
      } else if constexpr (ErrorFeedbackOf<C>::value) {
        cuda::decode(codec.codec, slot, bytes, range.data(), n, add ? DecodeMode::add : DecodeMode::overwrite, stream);
      } else if constexpr (!C::identity) {
        cuda::decode(codec, slot, bytes, range.data(), n, add ? DecodeMode::add : DecodeMode::overwrite, stream);
      }
    } else {
      // Compiled for both dtypes of BucketValues; prepare_device() refused what this cannot run.
      throw Error(ErrorKind::unsupported, {.operation = std::string(name(step.op))},
                  fmt::format("codec {} on {} values has no device path", codec.describe(), to_string(dtype_of<T>())));
    }
#else
    (void)index, (void)values, (void)codec;
#endif
  }

  std::span<std::byte> capacity(std::uint32_t slot) const {
    return {scratch_.data() + slot_offset_[slot], slot_capacity_[slot]};
  }
  std::span<const std::byte> encoded(std::uint32_t slot) const {
    return {scratch_.data() + slot_offset_[slot], slot_bytes_[slot]};
  }
  // True when `slot` holds plain values in the accumulation dtype, not the codec's encoding.
  bool raw_slot(std::uint32_t slot) const noexcept { return raw_ || schedule_.raw(slot); }

  // Marks the receives that may add on arrival and the add steps they absorb (the top of this
  // file): a receive into a slot of plain values, read by nothing but the decode-and-add that
  // waits for it, over the same range, where no other step touches that range before the add.
  void find_adds_on_receive(bool identity_codec) {
    const auto& steps = schedule_.steps;
    const auto overlaps = [](ElemRange a, ElemRange b) { return a.begin < b.end && b.begin < a.end; };
    for (std::uint32_t add = 0; add < steps.size(); ++add) {
      const Step& step = steps[add];
      if (step.op != Step::Op::decode_add || step.after == no_step || step.range.size() == 0) continue;
      const std::uint32_t recv = step.after;
      const Step& arrival = steps[recv];
      if (arrival.op != Step::Op::recv || arrival.slot != step.slot || arrival.slot == no_slot ||
          arrival.after != no_step || arrival.range.begin != step.range.begin || arrival.range.end != step.range.end ||
          !(identity_codec || raw_slot(arrival.slot)))
        continue;
      bool alone = true;
      for (std::uint32_t k = 0; k < steps.size() && alone; ++k)
        if (k != recv && k != add)
          alone = steps[k].slot != arrival.slot && !(k < add && overlaps(steps[k].range, step.range));
      if (!alone) continue;
      adds_on_receive_[recv] = 1;
      absorbed_recv_[add] = recv;
    }
  }

  // Whether receive `index` is posted as recv_add this time; remembers the answer.
  template <class T>
  bool adds_on_receive(std::size_t index, int peer, std::span<T> range, const X& transport) {
    bool adds = false;
    if constexpr (TransportAdder<X>)
      adds = adds_on_receive_[index] && transport.adds_into(peer, std::as_bytes(range));
    added_[index] = adds;
    return adds;
  }

  // A raw slot's values into `range`: added, or copied.
  template <class T>
  static void take_raw(std::span<const std::byte> bytes, std::span<T> range, bool add) {
    if (bytes.size() != range.size_bytes())
      throw Error(ErrorKind::protocol, {.operation = "recv"},
                  fmt::format("expected {} bytes of uncompressed values, got {}", range.size_bytes(), bytes.size()));
    if (!add) {
      if (!range.empty()) std::memcpy(range.data(), bytes.data(), bytes.size());
      return;
    }
    for (std::size_t i = 0; i < range.size(); ++i) {
      T v;
      std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
      range[i] += v;
    }
  }

  // Waits for send or receive `index` once (serial executor only).
  template <class T>
  void complete(std::uint32_t index, X& transport, const ExchangeContext& ctx, ExchangeStats& stats) {
    if (completed_[index]) return;
    const auto started = std::chrono::steady_clock::now();
    const std::size_t bytes = transfers_[index].wait(transport, started + ctx.timeout);
    stats.waiting += std::chrono::steady_clock::now() - started;
    completed_[index] = 1;
    transfer_done(index, bytes);
    if (schedule_.steps[index].op == Step::Op::recv) received<T>(index, bytes);
  }

  Schedule schedule_;
  bool raw_ = false;
  std::vector<std::size_t> slot_offset_;
  std::vector<std::size_t> slot_capacity_;
  std::vector<std::size_t> slot_bytes_;
  detail::TransportBuffer<X> scratch_;
  std::vector<Transfer<X>> transfers_;         // one per step; only sends and receives use theirs
  std::vector<std::uint8_t> completed_;        // serial executor: transfers already waited for
  std::vector<std::uint32_t> absorbed_recv_;   // per add step: the receive that may do its work, or no_step
  std::vector<std::uint8_t> adds_on_receive_;  // per receive: may be posted as recv_add
  std::vector<std::uint8_t> added_;            // per receive: was, this time
  std::vector<typename C::State> states_;      // one per step; encode steps get real state
  cuda::Stream* device_stream_ = nullptr;      // device path: the transport's stream
  detail::TransportBuffer<X> residuals_;       // device path, error feedback: residuals of the encode steps
  std::vector<std::size_t> residual_offset_;   // ... where each encode step's starts
  Timeline* timeline_ = nullptr;               // trace(): where steps are recorded, if anywhere
  std::uint32_t bucket_ = 0;                   // trace(): which bucket this exchange is
};

}  // namespace gradsync::engine
