#pragma once
// transport::SharedMemory — the ranks of one machine, as processes, exchanging through a shared
// memory segment (Boost.Interprocess, in the compiled library).
//
// The segment holds what the ranks must agree on: one mailbox per rank, where posted sends and
// receives wait for their other half, and one completion list per rank, each behind a process-
// shared mutex and condition. The payload does not pass through it: whoever posts the second half
// of a message copies it once, straight from the sender's buffer into the receiver's: a memcpy
// when both lie in ranks' arenas (allocate(), below) or the copier's own memory, else Linux's
// cross-memory attach (process_vm_readv/writev), as Open MPI's shared-memory transport does for
// large messages. One copy, like InProcess; nothing buffered, nothing allocated per message.
// Completions wait on the owner's completion list for the owner's own test() or wait(); a thread
// blocked in wait() sleeps on the list (no spinning), so the copier wakes it directly. Each rank
// also runs one thread that completes, at once, requests that report to a CompletionSink (the
// task graph) while no thread of the rank waits. Waking a process costs far more than waking a
// thread, so a completion nobody is waiting for wakes nobody.
//
// The segment is named after the job (a digest of GRADSYNC_TOKEN, MASTER_ADDR and MASTER_PORT)
// and the machine, created by local rank 0 and unlinked as soon as every local rank has mapped it,
// so a job that ends or is killed leaves nothing behind. A segment found under the name whose
// creator is no longer running (a job killed during setup) is replaced, never joined; one whose
// creator runs belongs to another job and is refused. The creator proves it holds the job token
// (HMAC-SHA-256, the token never stored) and the others check the proof before attaching.
//
// Memory the transport can share: allocate() hands out blocks of this rank's arena, a region of
// the segment that every local rank maps, so whichever side copies a message can address a buffer
// that lies there and copies it with one memcpy; cross-memory attach remains for a buffer the
// copier cannot address (another rank's private memory), and costs about a third of memcpy's
// bandwidth (it pins pages per call). The Synchronizer puts its bucket and scratch buffers there
// (TransportPolicy's optional allocate/deallocate, concepts.hpp); an application gets zero-copy
// sends of its own data by allocating it here. Arena pages take memory only when an allocation
// claims them, and are claimed with posix_fallocate, so a small /dev/shm (Docker's 64 MiB) means
// ordinary memory instead, never SIGBUS.
//
// A rank that exits or aborts makes every other rank's pending and later operations fail at once
// with Error(peer_failed) naming it. A rank that stays stopped (SIGSTOP, a debugger's stop) for
// `liveness` is killed by the first peer to see it, and then fails the others the same way: a
// stopped process may be continued, so its copies cannot be written off while it lives. A rank
// that is busy, sleeping or waiting for the disk is never taken for dead. Ranks and peers are numbered 0..local_size-1; errors name
// the launch's ranks (first_rank + local rank), which is what the job's logs say.
//
//   auto shm = gradsync::transport::SharedMemory::from_env();   // under gradsync-run -n 4

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"
#include "gradsync/launch/environment.hpp"
#include "gradsync/transport/operation.hpp"

namespace gradsync::transport {

namespace detail {
class SharedMemoryEngine;
}

struct SharedMemoryOptions {
  int local_rank = 0;
  int local_size = 1;
  int first_rank = 0;  // the launch rank of local rank 0, for messages and the segment's name
  std::string job{};   // what tells jobs apart: the token, rank 0's address and port
  std::string token{};  // the job's shared secret
  std::chrono::milliseconds setup_timeout = std::chrono::minutes(2);
  std::size_t max_pending = 16384;  // operations one rank may have posted and not yet completed
  // A local rank stopped this long is killed (above); 0: never. From the environment:
  // GRADSYNC_LIVENESS_MS, as for transport::Tcp.
  std::chrono::milliseconds liveness = std::chrono::seconds(10);
  // Address space reserved for each rank's arena (allocate()); pages take memory only as blocks
  // are allocated. Local rank 0's value is the machine's; 0 turns arenas off. From the
  // environment: GRADSYNC_SHM_ARENA_BYTES (a number of bytes, or with a K, M or G suffix).
  std::size_t arena_bytes = std::size_t{4} << 30;
};

class SharedMemory {
 public:
  class Request : private detail::Operation<Request> {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    using detail::Operation<Request>::report_to;

   private:
    friend class detail::SharedMemoryEngine;
    std::atomic<State> state_{State::idle};  // completed by this rank's completion thread
    std::uint32_t record_ = 0;               // its record in the segment while pending
  };

  // Creates (local rank 0) or attaches to the machine's segment; returns once every local rank
  // has attached. Throws Error(timeout) naming the local ranks still missing after setup_timeout.
  explicit SharedMemory(const SharedMemoryOptions& options);

  // Options from the launcher's environment (launch/environment.hpp): LOCAL_RANK and
  // LOCAL_WORLD_SIZE give the machine's ranks, RANK - LOCAL_RANK its first launch rank (launchers
  // number ranks machine by machine), plus GRADSYNC_SETUP_TIMEOUT_S where set. `env` is where the
  // launcher's variables are looked up (a program that learns them another way, such as from
  // torch.distributed's store, passes its own); the GRADSYNC_ settings come from the process.
  static SharedMemoryOptions options_from_env(const launch::Environment& env = launch::process_environment);
  static SharedMemory from_env() { return SharedMemory(options_from_env()); }

  // The segment's name for a job and machine (what /dev/shm shows while it is being set up).
  static std::string segment_name(const SharedMemoryOptions& options);

  SharedMemory(SharedMemory&&) noexcept;
  SharedMemory& operator=(SharedMemory&&) noexcept;
  ~SharedMemory();

  int rank() const noexcept;
  int size() const noexcept;
  std::string describe() const;

  void send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  // A receive that adds the message to `values` (TransportAdder, concepts.hpp). Whoever posts
  // second adds, so `values` must lie in this rank's arena, where the sender can reach them:
  // adds_into() says whether they do; elsewhere recv_add throws Error(invalid_argument).
  void recv_add(Request& request, int peer, std::uint64_t tag, std::span<float> values);
  void recv_add(Request& request, int peer, std::uint64_t tag, std::span<double> values);
  bool adds_into(int peer, std::span<const std::byte> bytes) const noexcept;
  // A message no receive matches yet waits in the mailbox and holds back no later one (concepts.hpp).
  static constexpr bool passes_unmatched(int /*peer*/) noexcept { return true; }
  bool test(Request& request);
  std::size_t wait(Request& request, std::chrono::steady_clock::time_point deadline);
  void abort(const Error& cause);

  // `bytes` of memory, 64-byte aligned, that this rank's messages can be sent from and received
  // into without cross-memory attach: from this rank's arena, or from ordinary memory when the
  // arena (or /dev/shm) is full or off, so it never fails for want of shared memory. Every other
  // local rank can address an arena block, so a message is one memcpy when the side that copies
  // (whichever posts second) can address both buffers: arena to arena always; arena and private
  // when the private buffer's owner copies. Thread-safe. Blocks must be returned
  // with deallocate() before this transport is destroyed (the arena goes with it).
  std::span<std::byte> allocate(std::size_t bytes);
  void deallocate(std::span<std::byte> block) noexcept;
  // Whether `bytes` lies in this machine's shared segment (an arena block, or part of one).
  bool shared(std::span<const std::byte> bytes) const noexcept;
  // Where shared bytes lie in the segment, the same number in every local rank, and the bytes at
  // such an offset in this rank's mapping: how one rank hands another a block of its arena
  // (sparse::EmbeddingTable). Errors for bytes outside the segment.
  std::uint64_t offset_of(std::span<const std::byte> bytes) const;
  std::span<std::byte> at_offset(std::uint64_t offset, std::size_t bytes) const;

 private:
  template <class T>
  void post_add(Request& request, int peer, std::uint64_t tag, std::span<T> values);

  std::unique_ptr<detail::SharedMemoryEngine> engine_;
};

static_assert(TransportPolicy<SharedMemory>);
static_assert(TransportAdder<SharedMemory>);

}  // namespace gradsync::transport
