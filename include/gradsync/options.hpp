#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "gradsync/log.hpp"

namespace gradsync {

// How each bucket's schedule is run. Both give bit-identical results.
enum class Executor : std::uint8_t {
  // engine::TaskGraph: encode/decode on compute threads, transfers posted and completed by a
  // communication thread, so one piece's encode hides under another's transfer and several
  // buckets are in flight at once.
  task_graph,
  // engine::BucketExchange::run: one thread walks each bucket's steps in list order, one bucket
  // at a time; the naive baseline the task graph is measured against. Always over
  // transport::Nccl, whose messages match in posting order, which threads posting as work gets
  // ready would not keep alike on every rank.
  serial,
};

// Coordinated sends (engine/coordinator/planner.hpp): ranks report each piece ready to send to group rank
// 0, which batches pieces by destination and grants a batch while its sender's uplink and its
// destination's downlink each carry fewer than `window` batches.
struct Coordination {
  bool enabled = false;
  int window = 2;
  std::size_t batch_bytes = std::size_t{4} << 20;  // a batch closes once it holds this many bytes
};

// Settings of a Synchronizer that are not part of any policy.
struct Options {
  // How long any single wait may last: a transport operation, a control message (the layout
  // check, plan agreement), a coordinator's grant. A receive waits for its sender's backward pass,
  // so training steps that take longer than this between ready() calls need a larger value.
  // (wait() itself does not time out: with every gradient marked, the exchange's waits bound it;
  // with one missing, it fails at once.)
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  Executor executor = Executor::task_graph;
  // Threads serving the task graph's compute queue. Results do not depend on it.
  int compute_threads = 1;
  // How long the task graph's threads, out of work, poll for more before they sleep (0: at once;
  // at most 10 ms). Waking a sleeping thread takes tens of microseconds, once per piece and ring
  // step; where a piece's work takes less (a GPU shared under MPS) polling may pay, for the
  // cores the threads hold while they poll. Results do not depend on it.
  std::chrono::microseconds spin_before_sleep{0};
  // Selective compression (engine/cost_model.hpp): at the first synchronization the ranks time
  // encode, decode and a transfer to their ring neighbour (a few hundred ms), agree on the
  // slowest rank's costs, and from then on every bucket is sent compressed only where that is
  // predicted to be faster, cut into the predicted best number of pieces. Rank 0 logs each
  // plan's decisions. Needs a PipelineTopology (concepts.hpp; Ring and ParameterServer are;
  // other topologies are refused with ErrorKind::unsupported); with an identity codec it changes
  // nothing.
  bool selective_compression = false;
  // Coordinated sends (task graph only). Results do not depend on it.
  Coordination coordination{};
  // Over a transport with an allreduce of its own (DeviceAllreduce, concepts.hpp: transport::Nccl),
  // with an identity codec and topology::Ring over the whole world, f32 buckets are summed by
  // that allreduce (ncclAllReduce: NCCL picks its algorithm and uses NVLink, switches, several
  // channels) and divided on the device, instead of the ring's point-to-point steps. Every rank
  // still ends with the same bits (NCCL forwards each finished sum unchanged), but they are NCCL's
  // sums, not gradsync's ring's, and where NCCL reduces inside the switch (NVLS) they may differ
  // from run to run. false: gradsync's ring, the host path's bits.
  bool native_allreduce = true;
  // Where this Synchronizer and its bucketing policy print (log.hpp): new plans, selective
  // compression's decisions. Nothing is printed per step.
  LogSink log = log_to_stderr;
  // Chrome trace events of this rank's synchronization (timeline.hpp), written when the
  // Synchronizer is destroyed to this path with the rank inserted; empty: the environment's
  // GRADSYNC_TIMELINE if set, else no timeline.
  std::string timeline{};
  std::size_t timeline_events = std::size_t{1} << 18;  // kept at most (40 bytes each; 1 to 2^27); later ones are dropped
};

// What exchanges cost this rank: bytes sent, and time per kind of work.
struct ExchangeStats {
  std::uint64_t bytes_sent = 0;
  // What the same sends would have been in the accumulation dtype: bytes_uncompressed / bytes_sent
  // is the compression the codec achieved on the wire.
  std::uint64_t bytes_uncompressed = 0;
  // Time computing: packing buckets, encode/decode/average steps and copying averages back (summed
  // over the threads doing it).
  std::chrono::nanoseconds compute{0};
  // Serial executor: time its thread sat blocked on the transport.
  std::chrono::nanoseconds waiting{0};
  // Task graph: time compute tasks sat ready in the compute queue, waiting for a thread (summed).
  std::chrono::nanoseconds queued{0};
  // Task graph: time with at least one transfer in flight (the communication queue's busy time).
  std::chrono::nanoseconds in_flight{0};
  // Coordinated sends: bytes of report and grant messages this rank sent, and the time its sends
  // waited for their grants (summed over sends).
  std::uint64_t control_bytes = 0;
  std::chrono::nanoseconds awaiting_grant{0};

  ExchangeStats& operator+=(const ExchangeStats& o) {
    bytes_sent += o.bytes_sent;
    bytes_uncompressed += o.bytes_uncompressed;
    compute += o.compute;
    waiting += o.waiting;
    queued += o.queued;
    in_flight += o.in_flight;
    control_bytes += o.control_bytes;
    awaiting_grant += o.awaiting_grant;
    return *this;
  }

  double compression_ratio() const {
    return bytes_sent ? static_cast<double>(bytes_uncompressed) / static_cast<double>(bytes_sent) : 1.0;
  }
};

// What a bucket ran in an iteration, and why: the schedule its topology gave it (a tuned topology's
// candidate, by name), the time the topology predicted for it over the links it measured (the prior
// the choice started from; 0 where the topology predicts nothing), and the time it took on this
// rank, from its start to its averages written back.
struct BucketSchedule {
  std::string schedule;
  double predicted_seconds = 0;
  double seconds = 0;
};

// What the last completed iteration cost this rank: its exchanges, and when they ended.
struct IterationStats : ExchangeStats {
  std::uint64_t iteration = 0;
  std::size_t buckets = 0;
  // Time wait() spent blocked: the communication that backward did not hide.
  std::chrono::nanoseconds exposed{0};
  // From the last ready() to the last bucket's average: the synchronization left after backward.
  std::chrono::nanoseconds after_last_ready{0};
  // Per bucket of the plan, in order: what it ran and why (sized with the plan).
  std::vector<BucketSchedule> schedules;
};

// What a Synchronizer's policies can take, for checking its Options against them.
struct PolicyAbilities {
  int rank = 0;                    // the transport's, for the Error
  std::string transport;           // its describe()
  std::string topology;            // its describe()
  bool pipeline_topology = false;  // a PipelineTopology (concepts.hpp): selective compression can cut its buckets
  bool device_transport = false;   // a DeviceTransport: buckets travel from device memory
};

// Throws Error(invalid_argument) naming the first setting of `options` out of its range, or
// Error(unsupported) for one the policies cannot take.
void check(const Options& options, const PolicyAbilities& policies);

}  // namespace gradsync
