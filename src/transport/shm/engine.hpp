#pragma once
// SharedMemoryEngine — transport::SharedMemory's data path, behind the public class
// (shared_memory.hpp): matching in the segment's mailboxes (shm/segment.hpp), one
// cross-memory copy per message by whichever side posts second, completions reported by each
// rank's own completion thread.
//
// Locks: a rank's mailbox mutex guards the queues of messages addressed to it, so a request found
// queued there under that lock has not been matched yet and can be taken back safely; a rank's
// done mutex guards its completion list and is only ever taken after a mailbox mutex, never
// before. Both are robust (shm/sync.hpp): a rank killed holding one does not hang the others. A
// mailbox whose holder died may be half updated, so nobody searches it again: operations that
// need it fail. A completion list is walked defensively instead, and a completion its dying
// copier may have lost is recovered by failing the request (died_copying()).
// Within this process, pool_mutex_ guards the record pool, and settle_mutex_ is held by whoever
// settles a pending request (completes it, fails it or takes it back), so that the completion
// thread, failing orphans from a list it took earlier, can check that a request is still pending
// (and so still alive) and settle it before anyone else does. Order: settle_mutex_, then a
// mailbox mutex, then pool_mutex_.
//
// The engine's parts: the segment and its robust locks (segment.hpp, sync.hpp), this rank's
// arena (arena.hpp), the engine (engine.cpp), the public class (shared_memory.cpp).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/transport/shared_memory.hpp"
#include "transport/delivery.hpp"
#include "transport/shm/arena.hpp"
#include "transport/shm/segment.hpp"

namespace gradsync::transport::detail {

class SharedMemoryEngine {
 public:
  using Clock = std::chrono::steady_clock;
  using Request = SharedMemory::Request;
  using Record = shm::Record;

  explicit SharedMemoryEngine(const SharedMemoryOptions& o);
  ~SharedMemoryEngine();
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::string describe() const { return fmt::format("shared-memory({} local ranks)", size_); }

  void post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source, std::byte* destination,
            std::size_t bytes, Delivery delivery = Delivery::copy);
  bool test(Request& r);
  std::size_t wait(Request& r, Clock::time_point deadline);
  std::span<std::byte> allocate(std::size_t bytes) { return arena_.allocate(bytes); }
  void deallocate(std::span<std::byte> block) noexcept { arena_.deallocate(block); }
  bool shared(std::span<const std::byte> bytes) const noexcept;
  std::uint64_t offset_of(std::span<const std::byte> bytes) const;
  std::span<std::byte> at_offset(std::uint64_t offset, std::size_t bytes) const;
  void abort(const Error& cause);

 private:
  ErrorContext context(int peer, const char* operation) const;
  int launch_rank(int local) const { return options_.first_rank + local; }

  // ---- the record pool (this process only) ----

  std::uint32_t take_record(Request& r, int peer, const char* operation);
  void give_back(std::uint32_t index);

  // Out of the pool for good (see withdraw()).
  void retire(std::uint32_t index);
  bool any_pending();

  // ---- queues in the segment (callers hold the queue's lock) ----

  // Appends `handle` to `q`, linked through `link` (a mailbox's `next` or a completion list's `done_next`).
  void append(shm::FifoQueue& q, std::uint32_t handle, std::uint32_t Record::*link = &Record::next);
  template <class Pred>
  std::optional<std::uint32_t> take_if(shm::FifoQueue& q, Pred pred);
  using Lock = std::unique_lock<shm::RobustMutex>;
  Lock lock_mailbox(int box_rank, int peer, const char* operation);

  // Locks a rank's mailbox, or returns it unlocked if a rank died holding it (its queues may be
  // half updated) or it stayed locked for the whole lock patience.
  Lock try_lock_mailbox(int box_rank);

  // ---- matching (caller holds the receiver's mailbox lock) and copying (outside it) ----

  // Where this process sees a record's buffer: its own, or one in the segment; null otherwise.
  std::byte* visible(const Record& r) const;

  // Lands the send's bytes in the receive (copied, or added for recv_add), from whichever process
  // we are: directly when we can address both buffers (ours, or any in the segment), else by
  // cross-memory attach (the sender writes into the receiver, the receiver reads from the sender).
  void transfer(std::uint32_t send_handle, std::uint32_t receive_handle);

  // transfer()'s bytes; 0, or the errno of a failed cross-memory copy.
  int land(const Record& send, const Record& receive, Delivery delivery);
  void post_done(int owner, std::uint32_t handle);
  void wake(int local);
  void wake_everyone();

  // Takes back a request still waiting for its other half; false if it has been matched.
  bool withdraw(Request& r);

  // ---- failures ----

  // What a new operation with `peer` meets: the job's first failure, or the peer having left.
  std::optional<Error> failure_for(int peer, const char* operation);
  bool peer_gone(int peer);
  std::string departure(int peer) const;

  // Looks for peers that left; true if one left since the last look. A peer stopped for the
  // liveness bound is killed, and found gone at a later look like any killed rank. Failing its
  // requests while it lives would not do: the completion path trusts that a gone peer writes
  // nothing more, and a stopped one, continued, may finish a copy into a buffer whose request was
  // failed and has been reused since.
  bool notice_departures();

  // Kills a peer that is still the process that attached and still stopped; the first rank to
  // decide so leaves its note in the peer's area for everyone's error message. A pidfd pins the
  // process between the check and the signal, so a recycled pid is never signalled.
  void kill_stopped(int peer, Clock::duration stopped);

  // A matched request whose copy was left to a peer that is gone: it will never complete. (A gone
  // peer writes nothing more, so its record's outcome can be read without the lists' locks.) One
  // it finished is on our completion list and completes from there, unless it died holding the
  // list's lock, perhaps before linking it in.
  bool died_copying(const Request& r);

  // Calls f(handle) along a completion list of ours. Bounded and range-checked: a rank that died
  // holding the list's lock may have left a link half made.
  template <class F>
  void walk_done_list(std::uint32_t head, F f);

  // Fails every pending request that the job's failure or a departed peer leaves unanswerable.
  void fail_orphans();

  // ---- completions (this rank's thread, or a thread waiting in wait()) ----

  // Once the state is stored the owner may return and reuse `r`: the sink hears first. Whoever
  // waits for `r` sleeps on the completion list's condition and is woken by whoever drained it.
  void finish(Request& r, Request::State state);
  void complete(std::uint32_t handle);

  // Completes every record in this rank's completion list, releasing `lock` (on the list) while
  // it does; false if the list was empty.
  bool drain(Lock& lock);

  // test()'s part: completes what has arrived, unless another thread is at the list already.
  void complete_arrived();

  // A thread in wait() completes whatever arrives for this rank until `settled()` or the deadline,
  // sleeping on the list's shared condition, so a copier in another process wakes it directly.
  template <class Settled>
  bool serve_until(Clock::time_point deadline, Settled settled);
  bool awaits_prompt_completion(const shm::FifoQueue& done) const;
  void complete_loop();

  // Cross-memory attach needs ptrace permission over the peer. Checked once, at setup, by reading
  // the segment's magic through the next rank's address space, so that a system that forbids it
  // says so here (and fails the job's setup everywhere) rather than at the first message.
  void check_cross_memory_attach();
  SharedMemoryOptions options_;
  shm::Segment segment_;
  shm::Arena arena_;
  const int rank_;
  const int size_;
  std::mutex settle_mutex_;
  std::mutex pool_mutex_;
  std::vector<std::uint32_t> free_;
  std::vector<Request*> owners_;  // by record index: the request a pending record belongs to
  std::vector<bool> peer_gone_;
  std::vector<Clock::time_point> stopped_since_;  // the completion thread's: when a peer was first seen stopped
  // The completion thread's: fail_orphans' list of pending requests, sized with the pool, since a
  // peer that leaves the job first (its last step done) is noticed while this rank still steps.
  std::vector<std::pair<std::uint32_t, Request*>> orphans_;

  std::mutex local_mutex_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace gradsync::transport::detail
