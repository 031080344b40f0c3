#pragma once
// The four policy families a Synchronizer is built from. Each concept below is the whole contract
// of its family; every shipped policy ends its header with a static_assert against it, and a type
// that does not satisfy one is rejected where the Synchronizer is named, with the concept's name
// in the compiler's message.
//
// Policies are plain values: configuration lives in their fields and is printed by describe(),
// which the Synchronizer compares across ranks at the first synchronization. Any policy may also
// have validate() const, which throws Error(invalid_argument) naming a setting out of its range
// (detail/settings.hpp); the Synchronizer calls it when it is built.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "gradsync/error.hpp"
#include "gradsync/plan.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/transport/completion.hpp"
#include "gradsync/types.hpp"

namespace gradsync::transport {
class ReadInterrupt;  // transport/read_interrupt.hpp
}

namespace gradsync {

namespace cuda {
class Stream;
}

// ---------------------------------------------------------------------------------------------
// BucketingPolicy: which gradients travel together, in what order.
//
// A plan (BucketPlan, plan.hpp) lists buckets in launch order, each with its gradients in packing
// order. The Synchronizer installs a plan only if
//   - every registered gradient is in exactly one bucket, and no bucket is empty;
//   - the gradients of a bucket share one accumulation dtype (types.hpp: f64 for f64 gradients,
//     f32 for f32, f16 and bf16 ones), because a bucket is one flat buffer of that dtype;
//   - there are at most engine::max_buckets (65,534) buckets, the bucket field of a message tag;
// and throws Error(invalid_argument) naming the policy otherwise. Every rank must run the same
// plan: buckets launch strictly in plan order and the ranks pair their messages by bucket, so
// initial_plan must be a pure function of the layout and the policy's fields (every rank computes
// its own), and later plans are agreed, never taken alone (agreement_due, end_iteration).
//
//   initial_plan(layout)      the plan for the first iteration, from the registered layout alone.
//   agreement_due(iteration)  true when, after `iteration` (0-based) completes, the ranks should
//                             agree on a new plan. Must give the same answer on every rank for the
//                             same iteration: it decides whether a collective round happens.
//   end_iteration(profile)    called after every iteration with this rank's ready times; may
//                             return a proposed plan. When agreement is due, rank 0's proposal (or
//                             the current plan, if it has none) is installed on every rank before
//                             the next iteration, so membership never differs between ranks.
//   expected_ready(bucket)    optional time (since the first ready() of the iteration) by which
//                             the bucket is expected to be complete. The Synchronizer calls
//   on_late(bucket, now)      at the first ready() after that time with the bucket still
//                             incomplete (or completed by that very ready()), so a timing-driven
//                             policy sees drift as it happens, not only afterwards.
//
// The Synchronizer calls a policy from one thread at a time (ready()'s under its lock, the rest
// from the first synchronization and wait()); policies need no locking.
template <class B>
concept BucketingPolicy = std::copyable<B> &&
    requires(B& b, const B& cb, const Layout& layout, const ReadyProfile& profile, std::uint64_t iteration,
             std::size_t bucket, Duration now) {
      { cb.describe() } -> std::convertible_to<std::string>;
      { b.initial_plan(layout) } -> std::same_as<BucketPlan>;
      { cb.agreement_due(iteration) } -> std::same_as<bool>;
      { b.end_iteration(profile) } -> std::same_as<std::optional<BucketPlan>>;
      { cb.expected_ready(bucket) } -> std::same_as<std::optional<Duration>>;
      b.on_late(bucket, now);
    };

// ---------------------------------------------------------------------------------------------
// How decode() combines decoded values with what the destination already holds.
enum class DecodeMode : std::uint8_t { overwrite, add };

// CodecFor<C, T>: C encodes and decodes contiguous runs of T values (float or double).
//
//   encode(values, state, out)  writes at most max_encoded_bytes and returns the bytes written.
//   decode(bytes, out, mode)  overwrites or adds into `out`; bytes that do not describe exactly
//                             out.size() values are an Error (protocol), never a crash
//                             (tests/fuzz/codecs.cpp). `bytes` start at an address aligned for
//                             any scalar (the library's buffers are 64-byte aligned, and an
//                             encoding starts at most 16 bytes of header into one), so a codec
//                             may read its words in place. The same
//                             bytes must decode to the same values on every rank: topologies send
//                             one encoding to all, and that is what leaves them the same bits.
template <class C, class T>
concept CodecFor = requires(const C& c, typename C::State& state, std::span<const T> in, std::span<T> out,
                            std::span<std::byte> encoded_out, std::span<const std::byte> encoded_in, DecodeMode mode) {
  { c.encode(in, state, encoded_out) } -> std::same_as<std::size_t>;
  c.decode(encoded_in, out, mode);
};

// CompressionPolicy: a codec for contiguous runs of f32 values, and optionally of f64 values.
//
//   State                     per-site state (an error-feedback residual, a random stream);
//                             make_state(n, t) builds it for a site that encodes n values of
//                             accumulation dtype t, when the plan is installed. Stateless
//                             codecs use an empty struct. The Synchronizer keeps one per encode
//                             site and never shares it between sites.
//   identity                  encoded bytes are the values themselves (no work to encode/decode;
//                             schedules send and receive in place).
//   lossless                  decode(encode(x)) == x bit for bit. The engine does not read it;
//                             bench/replay checks exact averages when it is set, and
//                             tests/test_compression.cpp that the 16-bit codecs do not claim it.
//   max_encoded_bytes(n, t)   an upper bound for n values of accumulation dtype t; buffers are
//                             sized with it once, when the plan is made.
//   encode and decode for f32 (CodecFor<C, float>). Every gradient but an f64 one accumulates in
//                             f32, so this is the path every codec needs.
//   Optional: encode and decode for f64 (CodecFor<C, double>). Without them a Synchronizer
//                             refuses f64 gradients in add() (ErrorKind::unsupported), and
//                             ErrorFeedback<C> has no f64 path either.
//   Optional: encode_keeping_error(values, residual, state, out)
//                             encodes p = residual + values (of equal sizes) and leaves
//                             -(-p + decode(encoding)) in residual, bit for bit what
//                             ErrorFeedback<C>'s own steps leave (signed zeros included; a NaN
//                             stays a NaN, but the compiler may flip its sign bit), in fewer
//                             passes; ErrorFeedback<C> uses it when C has it.
template <class C>
concept CompressionPolicy = std::copyable<C> && CodecFor<C, float> &&
    requires(const C& c, std::size_t n, DType dtype) {
      typename C::State;
      { C::identity } -> std::convertible_to<bool>;
      { C::lossless } -> std::convertible_to<bool>;
      { c.describe() } -> std::convertible_to<std::string>;
      { c.make_state(n, dtype) } -> std::same_as<typename C::State>;
      { c.max_encoded_bytes(n, dtype) } -> std::same_as<std::size_t>;
    };

template <CompressionPolicy C>
constexpr CodecTraits codec_traits() noexcept {
  return {.identity = C::identity};
}

// ---------------------------------------------------------------------------------------------
// TopologyPolicy: how a group allreduces one bucket.
//
//   schedule(group, elements, codec)  the steps this rank runs to leave the group's average of a
//                             bucket of `elements` values in place, given what the codec allows
//                             (see schedule.hpp); Schedule::contributors says how many ranks'
//                             values the average covers. Must be a pure function of its arguments and the
//                             policy's fields: each rank computes its own list, and the lists must
//                             pair every send with exactly one receive.
template <class T>
concept TopologyPolicy = std::copyable<T> &&
    requires(const T& t, const Group& group, std::size_t elements, CodecTraits codec) {
      { t.describe() } -> std::convertible_to<std::string>;
      { t.schedule(group, elements, codec) } -> std::same_as<Schedule>;
    };

// PipelineTopology: a topology that selective compression (Options::selective_compression,
// engine/cost_model.hpp) can plan for.
//
//   shape(group, elements)    how a piece of the bucket's largest segment travels: hops in
//                             sequence, pieces sharing a link at each (schedule.hpp), which the
//                             cost model turns into predicted times;
//   chunk_elements            the piece size the schedule cuts segments into, which selective
//                             compression sets to the size it predicts fastest.
template <class T>
concept PipelineTopology = TopologyPolicy<T> && requires(T t, const T& ct, const Group& group, std::size_t elements) {
  { ct.shape(group, elements) } -> std::same_as<PipelineShape>;
  t.chunk_elements = elements;
};

// PairOrderedTopology: a topology whose schedules post, for every pair of ranks, the messages one
// sends the other in the order the other posts its receives for them, with the same sizes
// (static constexpr bool posts_pairs_in_order = true). A transport that matches messages by order
// instead of by tag (transport::Nccl: NCCL has no tags) runs only such a topology; tests/
// test_topology.cpp checks the property for those that claim it.
template <class T>
concept PairOrderedTopology = TopologyPolicy<T> && requires { requires T::posts_pairs_in_order; };

// FlatAllreduceTopology: a topology that is a plain allreduce of the bucket over the group and
// nothing more (static constexpr bool flat_allreduce = true: topology::Ring), so that a
// transport's own allreduce may stand in for it with an identity codec (Options::native_allreduce).
// A hierarchy or a parameter server is a choice of its own and keeps its schedule.
template <class T>
concept FlatAllreduceTopology = TopologyPolicy<T> && requires { requires T::flat_allreduce; };

// PredictedTopology: a topology that predicts its time for a bucket (topology::Auto chooses between
// such topologies per bucket):
//
//   predicted_seconds(group, elements, value_bytes, link)
//                             seconds to allreduce `elements` values of `value_bytes` each over
//                             `link` (LinkModel, schedule.hpp: one message's latency and cost per
//                             byte), counting the steps that wait for one another.
template <class T>
concept PredictedTopology = TopologyPolicy<T> &&
    requires(const T& t, const Group& group, std::size_t elements, const LinkModel& link) {
      { t.predicted_seconds(group, elements, elements, link) } -> std::same_as<double>;
    };

// LinkAwareTopology: a topology whose schedules depend on the link's measured costs (topology::
// Auto). Where measures_link() says so (its `measure_link` set, and a choice left to make), the
// Synchronizer measures the link at the first synchronization (engine::calibrate_link), every rank
// taking the same figures, and sets `link` before it builds any bucket's schedule.
template <class T>
concept LinkAwareTopology = TopologyPolicy<T> && requires(T t, LinkModel link) {
  t.link = link;
  { t.measures_link() } -> std::convertible_to<bool>;
};

// TunedTopology: a link-aware topology that offers each bucket several candidate schedules
// (topology::Auto; topology::Hierarchical's arrangements within and across machines) and lets
// the Synchronizer keep the one that runs fastest, by the exchanges' measured times
// (engine::ScheduleTuner):
// `candidates` of them, numbered from 0, each with its schedule, its predicted time over the
// topology's own (measured) links, the prior that orders the trials, infinite for one not offered
// on this group, and its name for the log; tunes() says whether to (not where the user pinned one).
template <class T>
concept TunedTopology = LinkAwareTopology<T> && requires(const T t, const Group& group, std::size_t n, CodecTraits codec) {
  { T::candidates } -> std::convertible_to<std::size_t>;
  { t.tunes() } -> std::convertible_to<bool>;
  { t.candidate_schedule(n, group, n, codec) } -> std::same_as<Schedule>;
  { t.candidate_seconds(n, group, n, n) } -> std::same_as<double>;
  { t.candidate_name(n) } -> std::convertible_to<std::string>;
};

// MachineLinkTopology: a link-aware topology that, on a group of whole machines numbered
// machine-major, chooses by two links, between ranks of one machine and between machines
// (topology::Hierarchical; topology::Auto with its hierarchical candidates). The Synchronizer
// measures the two apart (engine::calibrate_machine_links) with measured_ranks_per_machine(group)
// ranks a machine, or one link for the whole group (engine::calibrate_link) where that is 0, and
// hands the figures to take_links(within, across).
template <class T>
concept MachineLinkTopology = LinkAwareTopology<T> && requires(T t, const Group& group, LinkModel link) {
  { t.measured_ranks_per_machine(group) } -> std::convertible_to<int>;
  t.take_links(link, link);
};

// ---------------------------------------------------------------------------------------------
// TransportPolicy: moves bytes between ranks; full duplex, tagged, non-blocking.
//
//   Request                   caller-owned record of one operation; it and the buffer it names
//                             must stay put until the operation completes or fails.
//   send(req, peer, tag, bytes) / recv(req, peer, tag, bytes)
//                             start an operation and return at once. A send matches the earliest
//                             receive posted by `peer` with the same tag; a message longer than
//                             the receive buffer is an Error on both sides.
//   test(req)                 true once complete; throws the operation's Error if it failed.
//   wait(req, deadline)       blocks until complete and returns the bytes transferred; past the
//                             deadline it withdraws the operation and throws Error(timeout).
//   req.report_to(sink, id)   from then on, every completion or failure of `req` is also reported
//                             to `sink` as `id` (transport/completion.hpp), so one thread can
//                             follow many requests at once without polling.
//   abort(error)              fails every pending operation of this rank and makes every rank
//                             that depends on it fail fast with an Error that names this rank.
//   Optional: allocate(bytes) -> std::span<std::byte> and deallocate(span)
//                             memory that messages travel from and to more cheaply than from
//                             ordinary memory (SharedMemory: its arena, one memcpy per message).
//                             Blocks are 64-byte aligned, never fail for want of the special
//                             memory (they fall back to ordinary memory), and are returned before
//                             the transport is destroyed. When a transport has them, the
//                             Synchronizer's bucket storage and the exchanges' scratch slots come
//                             from it (detail::TransportBuffer), allocated when a plan is installed.
//   Optional: recv_add(req, peer, tag, values), values a std::span<float> or std::span<double>,
//             and adds_into(peer, bytes) -> bool
//                             a receive that adds the message to `values` (values[i] += value i
//                             of the message, read as the same type) instead of overwriting them,
//                             so a reduction needs no scratch copy of what arrives; a message that
//                             is not a whole number of such values, or too long, is an Error on
//                             both sides. recv_add may only be posted where adds_into(peer, the
//                             values' bytes) says so (SharedMemory: values in its arena; Routed:
//                             from a rank of this machine). The executors use it where a schedule
//                             receives plain values only to add them (engine/exchange.hpp).
//   Optional: passes_unmatched(peer) -> bool
//                             true where a message between this rank and `peer` that no receive
//                             matches yet holds back no later message between them (SharedMemory:
//                             it waits in the mailbox; Routed: within the machine). Tcp stops
//                             reading a socket at such a message, so it does not say so.
//                             transport::CudaStaged's CUDA IPC needs it (transport/cuda_ipc.hpp).
template <class X>
concept TransportPolicy = std::movable<X> &&
    requires(X& x, const X& cx, typename X::Request& req, int peer, std::uint64_t tag,
             std::span<const std::byte> out, std::span<std::byte> in,
             std::chrono::steady_clock::time_point deadline, const Error& error,
             transport::CompletionSink* sink, std::uint64_t id) {
      requires std::default_initializable<typename X::Request>;
      req.report_to(sink, id);
      { cx.rank() } -> std::same_as<int>;
      { cx.size() } -> std::same_as<int>;
      { cx.describe() } -> std::convertible_to<std::string>;
      x.send(req, peer, tag, out);
      x.recv(req, peer, tag, in);
      { x.test(req) } -> std::same_as<bool>;
      { x.wait(req, deadline) } -> std::same_as<std::size_t>;
      x.abort(error);
    };

// The optional parts of TransportPolicy. A transport that hands out its own memory:
template <class X>
concept TransportAllocator = TransportPolicy<X> && requires(X& x, std::size_t bytes, std::span<std::byte> block) {
  { x.allocate(bytes) } -> std::same_as<std::span<std::byte>>;
  x.deallocate(block);
};

// A transport of device memory (transport::Nccl): its allocate() hands out memory of one CUDA
// device, where the Synchronizer then keeps its buckets and scratch slots, and every compute step
// (packing, the codecs, adding, averaging) runs as kernels on its cuda_stream(), which it also
// orders its transfers on (engine/exchange.hpp). cuda::Stream is in gradsync/cuda/codecs.hpp.
template <class X>
concept DeviceTransport = TransportAllocator<X> && requires(X& x) {
  { x.cuda_stream() } -> std::same_as<cuda::Stream&>;
};

// A transport that may hold a posted send back until something of its own is done
// (transport::CudaStaged: the send's copy to host memory): post_deferred() hands on those that
// can go and returns true while some are still held. Its test() and wait() do that too; an
// executor that only hears of completions through a CompletionSink (the task graph) calls it
// instead, and looks again soon while it returns true. A held send that fails to go completes
// with its Error, reported to its sink like any other completion.
template <class X>
concept DeferredSender = TransportPolicy<X> && requires(X& x) {
  { x.post_deferred() } -> std::same_as<bool>;
};

// A device transport with an allreduce of its own (transport::Nccl: ncclAllReduce, NCCL's
// algorithms over its links): allreduce(values, deadline) sums f32 device values over every rank
// of the transport in place, every rank ending with the same bits. The Synchronizer sends
// uncompressed Ring buckets through it (Options::native_allreduce).
template <class X>
concept DeviceAllreduce = DeviceTransport<X> &&
    requires(X& x, std::span<float> values, std::chrono::steady_clock::time_point deadline) {
      x.allreduce(values, deadline);
    };

// A transport that matches messages by the order they are posted, not by tag (transport::Nccl:
// NCCL has no tags), says so (static constexpr bool matches_by_order = true); the Synchronizer
// then takes only a PairOrderedTopology.
template <class X>
concept OrderMatchedTransport = TransportPolicy<X> && requires { requires X::matches_by_order; };

// A transport whose receives a thread may read for itself while it keeps other requests in flight
// (transport::Tcp's short path): read_until(req, until, interrupt) reads receive req's sockets on the
// calling thread until the receive settles (true), `until` passes or `interrupt` is raised (false,
// the receive still posted; also at once where it cannot). The task graph's communication thread
// reads a small piece's frames so (engine/task_graph.hpp) instead of waiting for the transport's
// thread to hand each one over.
template <class X>
concept CallerReader = TransportPolicy<X> &&
    requires(X& x, typename X::Request& req, std::chrono::steady_clock::time_point until,
             const transport::ReadInterrupt& interrupt) {
      { x.read_until(req, until, interrupt) } -> std::same_as<bool>;
    };

// A transport that can add what it receives to the values already there:
template <class X>
concept TransportAdder = TransportPolicy<X> &&
    requires(X& x, const X& cx, typename X::Request& req, int peer, std::uint64_t tag, std::span<float> f32,
             std::span<double> f64, std::span<const std::byte> bytes) {
      { cx.adds_into(peer, bytes) } -> std::same_as<bool>;
      x.recv_add(req, peer, tag, f32);
      x.recv_add(req, peer, tag, f64);
    };

}  // namespace gradsync
