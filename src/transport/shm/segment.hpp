#pragma once
// The shared-memory segment of transport::SharedMemory (shared_memory.hpp): its layout, and how
// local rank 0 creates it and the others attach to it. Private to the library.
//
// Layout: a Header, then one RankArea per local rank, then each rank's pool of Records, then (page
// aligned) one arena per local rank, arena_bytes each. Every field another process reads is either
// set before the header's magic is published (release) or guarded by the process-shared mutex
// named beside it. The arenas are sparse: a page takes memory only once reserve() has claimed it
// for an allocation (see arena.hpp).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <boost/interprocess/sync/interprocess_condition.hpp>
#include <boost/interprocess/sync/interprocess_mutex.hpp>

#include "detail/hmac.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "transport/shm/sync.hpp"

namespace gradsync::transport::shm {

namespace ipc = boost::interprocess;

inline constexpr std::uint32_t segment_magic = 0x6d687367;  // "gshm"
inline constexpr std::uint32_t segment_version = 9;
inline constexpr std::uint32_t no_record = 0xffffffffu;
inline constexpr std::uint64_t not_shared = ~std::uint64_t{0};  // Record::shared_offset of a private buffer
inline constexpr std::size_t page_bytes = 4096;

// A process as the kernel knows it: pid and start time (clock ticks since boot), so a recycled
// pid is never taken for the process that once had it.
struct ProcessIdentity {
  std::int32_t pid = 0;
  std::uint64_t start_ticks = 0;

  enum class State { running, stopped, gone };

  static ProcessIdentity self();
  // gone once it has exited (a zombie counts as exited); stopped by a signal (SIGSTOP, SIGTSTP)
  // or a debugger; otherwise running, whether on a CPU, sleeping or waiting for the disk.
  State state() const;
  bool running() const { return state() != State::gone; }
};

// One posted send or receive. Lives in its owner's pool; while it waits for its other half it is
// queued in the receiving rank's mailbox (`next`), and once matched it is queued in its owner's
// completion list (`done_next`).
struct Record {
  enum class Outcome : std::uint32_t { pending, done, misfit, copy_failed };
  std::uint32_t next = no_record;
  std::uint32_t done_next = no_record;
  std::int32_t owner = -1;  // local ranks
  std::int32_t peer = -1;
  std::uint32_t is_send = 0;
  // The owner's request reports to a CompletionSink, so its completion thread must hear of it at
  // once; without one the completion waits in `done` for the owner's next test() or wait().
  std::uint32_t prompt = 0;
  Outcome outcome = Outcome::pending;
  std::uint64_t tag = 0;
  std::uint64_t address = 0;  // the buffer, in its owner's address space
  std::uint64_t shared_offset = not_shared;  // where the buffer lies in the segment, if it does
  std::uint64_t size = 0;     // bytes offered (send) or room (receive)
  std::uint64_t transferred = 0;
  std::uint64_t other_size = 0;  // the other half's size, for a too-long message
  std::int32_t copy_errno = 0;
  // A receive's transport::detail::Delivery: copied over, or added as f32 or f64 values. On a
  // send, its receive's once they turn out not to fit, for the sender's error message.
  std::uint32_t delivery = 0;
  // Who copies the message, once its two halves have met: the local rank that posted the second
  // half. It copies after leaving the mailbox, so a record that is neither queued nor finished
  // is being copied by this rank; if that rank is gone, the copy never ends.
  std::int32_t copier = -1;
};

struct FifoQueue {
  std::uint32_t head = no_record;
  std::uint32_t tail = no_record;
};

struct RankArea {
  ProcessIdentity process;
  std::uint64_t mapped_at = 0;            // where this rank mapped the segment, for the setup's cross-memory check
  std::atomic<std::uint32_t> closed{0};  // the rank destroyed its transport
  // Set by the rank that killed this one for staying stopped past the liveness bound, before the
  // signal, so that every survivor's error can say what happened.
  std::atomic<std::int32_t> killed_by{-1};
  std::atomic<std::uint64_t> stopped_ms{0};
  RobustMutex mailbox_mutex;              // guards sends/receives addressed to this rank (not the copies)
  FifoQueue sends;                        // others' sends to this rank, unmatched
  FifoQueue receives;                     // this rank's receives, unmatched
  RobustMutex done_mutex;                 // guards `done`; taken after mailbox_mutex, never before
  SharedCondition done_changed;
  FifoQueue done;                         // this rank's matched records, for its completion thread
  std::uint32_t wake = 0;                 // a failure or a close asks the thread to look around
  // Threads of this rank blocked in wait(), which complete `done` themselves meanwhile: a copier
  // wakes them (served_changed) rather than the completion thread, one hand-off fewer.
  std::uint32_t serving = 0;
  SharedCondition served_changed;
};

struct Header {
  std::atomic<std::uint32_t> magic{0};  // published last: the rest is complete once it reads segment_magic
  std::uint32_t version = segment_version;
  std::uint32_t local_size = 0;
  std::uint32_t capacity = 0;  // records per rank
  ProcessIdentity creator;
  std::array<std::uint8_t, 16> nonce{};
  gradsync::detail::Digest proof{};  // HMAC-SHA-256(token, "gradsync-shm" + nonce): the creator holds the token
  ipc::interprocess_mutex setup_mutex;
  ipc::interprocess_condition setup_changed;
  std::uint32_t attached = 0;  // guarded by setup_mutex
  // The first failure (an abort), for every rank to report: who, where it began (the launch rank
  // of gradsync::FailureOrigin: another rank's failure may have caused this one), and what was said
  // of that.
  std::atomic<std::int32_t> failed_rank{-1};
  std::atomic<std::uint32_t> failure_written{0};
  std::int32_t origin_rank = -1;  // written before failure_written
  std::array<char, 512> failure{};
  std::uint64_t arenas_at = 0;    // offset of local rank 0's arena; the others follow it
  std::uint64_t arena_bytes = 0;  // each rank's (local rank 0's SharedMemoryOptions::arena_bytes, page aligned)
};

// A mapped segment, attached and checked. Unlinks its name when every local rank has attached.
class Segment {
 public:
  // Creates (local rank 0) or attaches; returns once all local ranks have attached.
  explicit Segment(const SharedMemoryOptions& options);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header& header() const { return *header_; }
  RankArea& rank(int local) const { return areas_[local]; }
  Record& record(std::uint32_t handle) const { return records_[handle]; }
  std::uint32_t handle(int owner, std::uint32_t index) const {
    return static_cast<std::uint32_t>(owner) * header_->capacity + index;
  }
  std::uint32_t capacity() const { return header_->capacity; }

  // The whole mapping, which every local rank has at its own address.
  std::byte* base() const { return static_cast<std::byte*>(region_->get_address()); }
  std::size_t bytes() const { return region_->get_size(); }
  // Where `p` (of `n` bytes) lies in the segment, or not_shared.
  std::uint64_t offset_of(const void* p, std::size_t n) const {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= base() && n <= bytes() && static_cast<std::size_t>(b - base()) <= bytes() - n
               ? static_cast<std::uint64_t>(b - base())
               : not_shared;
  }
  std::span<std::byte> arena(int local) const {
    return {base() + header_->arenas_at + static_cast<std::size_t>(local) * header_->arena_bytes,
            static_cast<std::size_t>(header_->arena_bytes)};
  }
  // Gives the segment's pages [offset, offset + n) memory now (posix_fallocate), so that touching
  // them cannot raise SIGBUS later on a full /dev/shm; false if there is not that much room.
  bool reserve(std::size_t offset, std::size_t n) const;
  static std::string name(const SharedMemoryOptions& options);

 private:
  void create(const SharedMemoryOptions& options, std::chrono::steady_clock::time_point deadline);
  void attach(const SharedMemoryOptions& options, std::chrono::steady_clock::time_point deadline);
  void await_everyone(const SharedMemoryOptions& options, std::chrono::steady_clock::time_point deadline);
  void lay_out();

  std::string name_;
  std::optional<ipc::shared_memory_object> object_;  // kept open for reserve(), after the name is gone
  std::unique_ptr<ipc::mapped_region> region_;
  Header* header_ = nullptr;
  RankArea* areas_ = nullptr;
  Record* records_ = nullptr;
  bool named_ = false;  // this rank still has to unlink the name (local rank 0)
};

// A deadline for a process-shared lock or wait: Boost.Interprocess reads absolute UTC time.
boost::posix_time::ptime utc_deadline(std::chrono::steady_clock::duration from_now);

}  // namespace gradsync::transport::shm
