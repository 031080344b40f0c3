#pragma once
// How a message is named on the wire, and every control message's name.
//
// A tag carries the iteration (mod 2^16), the bucket and a message id. Data messages take their
// id from the schedule (Step::message) and their bucket's plan position, so messages of
// neighbouring iterations or buckets can never be mistaken for each other. Control messages take
// the bucket id `control_bucket`, which no plan can give a bucket, and an id from ControlMessage:
// this enum is the one place control ids are assigned.

#include <cstdint>
#include <cstddef>

namespace gradsync::engine {

inline constexpr std::uint32_t control_bucket = 0xffff;
// The bucket id of sparse::SparseExchange's dense path, an allreduce beside the Synchronizer's.
inline constexpr std::uint32_t sparse_bucket = 0xfffe;
inline constexpr std::size_t max_buckets = sparse_bucket;  // bucket ids 0..0xfffd
// How many streams a PeerChannel has: ids ControlMessage::peer_tensors + 0 .. + 15.
inline constexpr std::uint32_t peer_tensor_streams = 16;

// Data message ids stay below 2^31 (schedule.hpp's ids count a bucket's pieces): bit 31 of a
// tag is transport::CudaStaged's, for its acknowledgements of messages passed through CUDA IPC.
constexpr std::uint64_t make_tag(std::uint64_t iteration, std::uint32_t bucket, std::uint32_t message) noexcept {
  return ((iteration & 0xffffu) << 48) | (static_cast<std::uint64_t>(bucket & 0xffffu) << 32) | message;
}

// Control message ids (in bucket `control_bucket`). A length-prefixed message (ControlChannel)
// takes two ids: its length travels as `id`, its payload as `id + 1`.
enum class ControlMessage : std::uint32_t {
  layout = 0,                  // rank 0's layout and policies to every rank, what differs back (first synchronization)
  verdict = 2,                 // rank 0's verdict: empty, or what differs
  plan = 4,                    // the agreed bucket plan, from rank 0, when the bucketing policy asks
  calibration = 6,             // selective compression's fitted costs, to rank 0 and back
  calibration_probe = 8,       // its timed transfers: probe k takes id 8 + k (raw bytes, no length)
  link = 0x30,                 // topology::Auto's measured link (calibrate_link), to rank 0 and back
  link_probe = 0x40,           // its timed transfers: probe k takes id 0x40 + k (raw bytes, no length)
  schedule_times = 0x1000,     // engine::ScheduleTuner's medians, to rank 0 and the slowest back
  embedding_table = 0x20000000u,  // where local rank 0 put the machine's embedding table (sparse/)
  sparse = 0x20000010u,        // a sparse exchange's messages: ids sparse + 0 .. sparse + 4 (sparse/exchange.hpp)
  async_parameter_server = 0x20000020u,  // async::Synchronizer's messages: ids + 0 .. + 7 (async/messages.hpp)
  peer_tensors = 0x20000030u,  // PeerChannel's streams: ids + 0 .. + 15 (peer_channel.hpp)
  membership = 0x40000000u,    // whom each rank counts in its group, up a tree of the members and back
  transports = 0x7ffffff0u,    // ids + 0 .. + 15: transports' own messages, each transport naming
                               // its ids where it is written (transport/nccl.cpp: + 0 .. + 2,
                               // transport/cuda_ipc.hpp: + 8 .. + 10; apart, as both ride on Tcp)
  coordinator_report = 0x80000000u,  // coordinated sends: rank -> coordinator (sequence-numbered)
  coordinator_grant = 0x80000001u,   // coordinator -> rank
};

constexpr std::uint32_t id(ControlMessage m) noexcept { return static_cast<std::uint32_t>(m); }

// The tag of control message `m` (plus `offset`), numbered `sequence` (an iteration, or a
// per-direction message count for the coordinator's streams).
constexpr std::uint64_t control_tag(std::uint64_t sequence, ControlMessage m, std::uint32_t offset = 0) noexcept {
  return make_tag(sequence, control_bucket, id(m) + offset);
}

}  // namespace gradsync::engine
