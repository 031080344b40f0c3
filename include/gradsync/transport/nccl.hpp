#pragma once
// transport::Nccl — ranks are processes with a GPU each; device memory travels by NCCL
// (ncclSend / ncclRecv), the job's control messages over TCP. Declared where gradsync was built
// with CUDA and NCCL (GRADSYNC_HAS_NCCL); library gradsync_cuda, src/transport/nccl.cpp.
//
// Setup. A transport::Tcp is set up first, from the same options (the launcher's variables and
// token: TcpOptions), and stays as the control channel. Every rank tells rank 0 its GPU's UUID;
// rank 0 makes the NCCL unique id and sends it, with its verdict on the UUIDs, to every rank over
// those authenticated connections; then every rank joins the communicator. Two ranks on one GPU
// are told so by every rank in a gradsync::Error before NCCL is asked (NCCL >= 2.5 would refuse
// them with "Duplicate GPU detected"). The GPU is NcclOptions::device, by default LOCAL_RANK
// modulo the machine's device count (so too many ranks for the GPUs meet that same Error).
//
// Which way a message goes. A message whose tag is in the control bucket (engine/tag.hpp: bits
// 32-47 all ones: agreements, plans, calibration) goes over TCP, from and to host memory; every
// other message goes by NCCL and must be device memory of this rank's GPU (an Error otherwise).
// Both sides see the same tag, so both always choose the same way.
//
// Matching. NCCL has no tags: the device messages between two ranks are matched in the order the
// two post them, and a send must be exactly as long as its receive. The Synchronizer runs only
// topologies that post each pair's messages in one order on both sides (PairOrderedTopology,
// concepts.hpp: topology::Ring, topology::ParameterServer and topology::Hierarchical; a topology
// that does not claim it is refused at compile time),
// with sizes both sides know (plain values, or the device codecs' fixed-size encodings). A
// caller of its own must keep that order: mismatched messages of equal size would be swapped
// silently. Posted device operations wait in this rank's queue until a test() or wait() of one
// still queued, or flush(), then go to NCCL together in one group call, so a ring step's send and
// receive progress together instead of each waiting for the other's rank. NCCL completes a group
// as a whole, so a schedule must not list a receive before sends it does not need (Ring's and
// Hierarchical's rings over this transport list receives at use: CodecTraits::receives_at_use).
//
// Ordering with computation. Every NCCL operation runs on cuda_stream(), after whatever the
// caller queued there before posting it: a kernel that fills a buffer and a send of that buffer
// need no synchronization between them. Completion is an event recorded after the group; test()
// and wait() look at it. A buffer received into holds its message for work queued on
// cuda_stream() afterwards at once, and for the host once wait() has returned.
//
// Failure. Past wait()'s deadline the communicator is aborted (ncclCommAbort, which ends the
// kernels waiting for a peer) and Error(timeout) names the peer; NCCL's own asynchronous errors
// abort it too. A TCP receive from every peer stays posted on a tag nobody sends: when a peer's
// process ends, its connection closes, that receive fails, and the next test() or wait() aborts
// the communicator and throws Error(peer_failed) naming it; TCP's liveness bound (TcpOptions::
// liveness) covers a stopped process or a lost machine. After an abort every operation fails with
// the first error. abort() does the same on purpose, and makes every peer fail fast (TCP).
//
// Completions are seen by test() and wait() only, on the posting thread's call; a request that
// reports to a CompletionSink (the task-graph engine) is refused when posted: the task graph posts
// from several threads, and order-matched messages could not be told apart. The Synchronizer
// refuses Executor::task_graph over this transport for that reason.
//
//   auto nccl = gradsync::transport::Nccl::from_env();   // under gradsync-run, torchrun, mpirun

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/transport/operation.hpp"
#include "gradsync/transport/tcp.hpp"

namespace gradsync::transport {

namespace detail {
class NcclEngine;
}

struct NcclOptions {
  TcpOptions setup;  // rendezvous and control channel: rank, world size, master address, token
  int device = -1;   // CUDA device of this rank; -1: LOCAL_RANK modulo the machine's device count
  int local_rank = 0;  // for device -1 (options_from_env() fills it from the launcher)
};

class Nccl {
 public:
  class Request : private detail::Operation<Request> {
   public:
    Request() = default;
    ~Request();
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    using detail::Operation<Request>::report_to;

   private:
    friend class detail::NcclEngine;
    enum class Way : std::uint8_t { device, control };
    Way way_ = Way::device;
    State state_ = State::idle;
    void* event_ = nullptr;  // cudaEvent_t, made at the first device posting and kept
    Tcp::Request control_;   // the TCP request of a control message
  };

  // Sets up TCP, checks the GPUs, joins the communicator. Throws gradsync::Error: timeout (setup),
  // invalid_argument (two ranks on one GPU, no GPU), internal (CUDA or NCCL refused).
  static constexpr bool matches_by_order = true;  // OrderMatchedTransport (concepts.hpp)

  explicit Nccl(const NcclOptions& options);
  static NcclOptions options_from_env();  // Tcp::options_from_env() and LOCAL_RANK
  static Nccl from_env() { return Nccl(options_from_env()); }

  Nccl(Nccl&&) noexcept;
  Nccl& operator=(Nccl&&) noexcept;
  ~Nccl();

  int rank() const noexcept;
  int size() const noexcept;
  int device() const noexcept;
  std::string describe() const;  // "nccl 2.28.3 (4 ranks, a GPU each)": the same on every rank
  cuda::Stream& cuda_stream() noexcept;  // where the transfers run, and callers queue their kernels

  void send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  bool test(Request& request);
  std::size_t wait(Request& request, std::chrono::steady_clock::time_point deadline);
  void abort(const Error& cause);
  void flush();  // hands the queued device operations to NCCL now, as one group

  // Device memory of this rank's GPU (cudaMalloc), where the Synchronizer keeps its buckets and
  // scratch slots over this transport; 256-byte aligned. An Error when the device is out of memory.
  std::span<std::byte> allocate(std::size_t bytes);
  void deallocate(std::span<std::byte> block);

  // Sums `values` (device memory, f32) over every rank in place with ncclAllReduce on
  // cuda_stream(), waiting until `deadline`: every rank gets the same bits.
  void allreduce(std::span<float> values, std::chrono::steady_clock::time_point deadline);

 private:
  std::unique_ptr<detail::NcclEngine> engine_;
};

static_assert(TransportPolicy<Nccl>);
static_assert(DeviceTransport<Nccl> && OrderMatchedTransport<Nccl>);

}  // namespace gradsync::transport
