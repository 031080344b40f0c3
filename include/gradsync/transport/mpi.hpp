#pragma once
// transport::Mpi — ranks are the processes of an MPI job; messages travel by MPI point-to-point
// over whatever fabric MPI drives (Open MPI: InfiniBand and RoCE through UCX or verbs, Omni-Path
// through PSM2, EFA through libfabric, shared memory within a machine, TCP elsewhere). Declared
// where gradsync was built with MPI (GRADSYNC_HAS_MPI, Meson feature `mpi`); library gradsync_mpi,
// src/transport/mpi/, dependency 'gradsync-mpi' (only programs that use it link MPI).
//
// Setup. The constructor duplicates the communicator it is given (MPI_COMM_WORLD by default), so
// gradsync's messages never meet the program's own, and sets MPI_ERRORS_RETURN on its copy: an MPI
// failure becomes a gradsync::Error naming rank, peer and operation, never MPI's default abort. It
// initialises MPI (asking for MPI_THREAD_MULTIPLE) only where the program has not, and then
// finalises it at exit; a program that called MPI_Init or MPI_Init_thread keeps MPI as its own.
// The ranks compare their wire versions there (a collective, like the duplication): a rank of
// another gradsync is refused by every rank, naming it. MPI launched the processes and carries
// their messages, so the job is MPI's to authenticate: no token is needed.
//
// Threads. With MPI_THREAD_MULTIPLE the caller's threads post their operations to MPI themselves
// and one progress thread of the transport tests them; with MPI_THREAD_SERIALIZED every MPI call
// the transport makes goes through that thread (the program must then make no MPI calls of its own
// while the transport exists: two threads may not be inside MPI at once). MPI_THREAD_FUNNELED
// and SINGLE allow MPI calls from the main thread only and are refused (ErrorKind::unsupported).
// The progress thread polls while operations are in flight and sleeps when there are none: MPI
// offers nothing to block on, and most of it moves bytes only inside MPI calls.
//
// Matching. gradsync's tags are 64 bits, MPI's at most MPI_TAG_UB (>= 32767 by the standard, 2^31
// - 1 in Open MPI's ob1, 2^23 - 1 in its UCX layer), so a message travels as two: a 32-byte
// header (wire version, tag, length, a per-pair sequence number) on one MPI tag, then the payload
// on an MPI tag its sequence number picks, which the receiver posts only once the header has met
// its receive. The payload lands straight in the receive buffer; a header that no receive wants
// yet waits in this rank's memory, its payload in MPI's, and holds back no later message
// (passes_unmatched). Every header is checked (version, sequence, length against the receive) and
// a message longer than its receive fails both sides. A message over 1 GiB travels as several
// payload messages (MPI counts in int).
//
// Failure. Every wait keeps its deadline. An operation past it is withdrawn where MPI lets it be (a
// receive whose header has not come, a payload receive MPI has not matched: MPI_Cancel); one MPI
// holds on to (a send whose receiver never takes it: Open MPI cannot cancel a matched or
// rendezvous transfer) fails the whole transport instead, its peers are told, and gradsync makes no
// MPI call for it again: its buffer must not be freed before the transport is destroyed, and the
// destructor ends the job with MPI_Abort if MPI still holds it then (a Synchronizer destroys its
// transport last). abort() tells every rank (an MPI message each), which fails every pending and
// later operation with Error(peer_failed) naming the rank that failed first. A process that dies
// is MPI's to notice: Open MPI's mpirun ends the whole job within seconds (tests/mpi/check.sh
// measures it); under --enable-recovery, where the others go on, their waits end at their deadline
// with Error(timeout) naming the peer.
//
//   auto world = gradsync::transport::Mpi();                      // under mpirun or srun
//   auto local = gradsync::transport::SharedMemory(world.machine_options());   // this machine's ranks

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"
#include "gradsync/transport/operation.hpp"
#include "gradsync/transport/shared_memory.hpp"

namespace gradsync::detail {
template <class Request>
class IntrusiveQueue;
}

namespace gradsync::transport {

namespace detail {
class MpiEngine;
struct MpiState;
}

struct MpiOptions {
  MPI_Comm communicator = MPI_COMM_WORLD;  // duplicated; its ranks are the transport's
  std::uint64_t max_message_bytes = std::uint64_t{1} << 32;  // a header announcing more is refused
};

class Mpi {
 public:
  class Request : private detail::Operation<Request> {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    using detail::Operation<Request>::report_to;

   private:
    friend class detail::MpiEngine;
    template <class>
    friend class gradsync::detail::IntrusiveQueue;
    // All guarded by the engine's lock.
    State state_ = State::idle;
    std::uint32_t in_mpi_ = 0;      // its MPI operations not yet complete
    bool withdrawn_ = false;        // MPI cancelled one of them (a wait past its deadline)
    std::uint64_t sequence_ = 0;    // its header's first payload sequence number
    std::uint64_t length_ = 0;      // a receive's: the length its header announced
    std::uint64_t header_[4] = {};  // a send's header, while MPI sends it
  };

  // Collective over `options.communicator`. Throws gradsync::Error: unsupported (a thread level
  // below MPI_THREAD_SERIALIZED), protocol (ranks of different wire versions), internal (MPI refused).
  explicit Mpi(const MpiOptions& options = {});

  Mpi(Mpi&&) noexcept;
  Mpi& operator=(Mpi&&) noexcept;
  ~Mpi();

  int rank() const noexcept;
  int size() const noexcept;
  std::string describe() const;  // "mpi Open MPI v4.1.4 (8 ranks, 2 machines)": the same on every rank
  // MPI's thread level (MPI_THREAD_MULTIPLE or MPI_THREAD_SERIALIZED), and whether callers post to
  // MPI themselves (MULTIPLE) or through the progress thread.
  int thread_level() const noexcept;

  // This rank's machine as MPI sees it (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED), for a
  // transport::SharedMemory of its ranks: local rank and size, the first rank, and a job name and
  // token rank 0 drew at setup and sent every rank over MPI. Throws Error(invalid_argument) where
  // a machine's ranks are not numbered consecutively (mpirun --map-by node), which
  // transport::Routed needs.
  SharedMemoryOptions machine_options() const;

  void send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  bool test(Request& request);
  std::size_t wait(Request& request, std::chrono::steady_clock::time_point deadline);
  void abort(const Error& cause);
  // A message no receive has matched waits in this rank's memory and MPI's (see the top).
  bool passes_unmatched(int) const noexcept { return true; }

 private:
  std::unique_ptr<detail::MpiState> state_;
};

static_assert(TransportPolicy<Mpi>);

}  // namespace gradsync::transport
