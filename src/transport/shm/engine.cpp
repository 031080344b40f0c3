// SharedMemoryEngine (engine.hpp): posting and matching in the segment's mailboxes, copying,
// completions, failures and liveness.

#include "transport/shm/engine.hpp"

#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <new>
#include <string_view>

#include <boost/interprocess/sync/scoped_lock.hpp>

namespace gradsync::transport::detail {

using shm::no_record;

namespace {

// How long a rank waits for another's lock (a dead holder hands it over at once; only queue
// operations hold one), or for a copy a peer has started to finish.
constexpr auto lock_patience = std::chrono::seconds(10);
// How often an idle completion thread looks whether its peers are still running.
constexpr auto liveness_period = std::chrono::milliseconds(50);

}  // namespace

SharedMemoryEngine::SharedMemoryEngine(const SharedMemoryOptions& o)
    : options_(o), segment_(o), arena_(segment_, o.local_rank), rank_(o.local_rank), size_(o.local_size) {
  free_.reserve(segment_.capacity());
  for (std::uint32_t i = segment_.capacity(); i-- > 0;) free_.push_back(i);
  owners_.assign(segment_.capacity(), nullptr);
  orphans_.reserve(segment_.capacity());
  peer_gone_.assign(static_cast<std::size_t>(size_), false);
  stopped_since_.assign(static_cast<std::size_t>(size_), Clock::time_point{});
  check_cross_memory_attach();
  thread_ = std::thread([this] { complete_loop(); });
}

SharedMemoryEngine::~SharedMemoryEngine() {
  segment_.rank(rank_).closed.store(1, std::memory_order_release);
  wake_everyone();
  {
    std::lock_guard lock(local_mutex_);
    stopping_ = true;
  }
  wake(rank_);
  thread_.join();
}

void SharedMemoryEngine::post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source,
                              std::byte* destination, std::size_t bytes, Delivery delivery) {
  const char* operation = is_send ? "send" : "recv";
  if (peer < 0 || peer >= size_)
    throw Error(ErrorKind::invalid_argument, context(peer, operation),
                fmt::format("no local rank {} among {}", peer, size_));
  if (r.state_.load(std::memory_order_acquire) == Request::State::pending)
    throw Error(ErrorKind::invalid_argument, context(peer, operation), "request reused while still pending");
  if (auto failure = failure_for(peer, operation)) throw *failure;

  const std::uint32_t index = take_record(r, peer, operation);
  const std::uint32_t handle = segment_.handle(rank_, index);
  Record& mine = segment_.record(handle);
  mine.next = mine.done_next = no_record;
  mine.owner = rank_;
  mine.peer = peer;
  mine.is_send = is_send;
  mine.prompt = r.sink_ != nullptr;
  mine.outcome = Record::Outcome::pending;
  mine.tag = tag;
  mine.address = reinterpret_cast<std::uint64_t>(is_send ? source : destination);
  mine.shared_offset = segment_.offset_of(is_send ? source : destination, bytes);
  mine.size = bytes;
  mine.transferred = mine.other_size = 0;
  mine.copy_errno = 0;
  mine.copier = -1;
  mine.delivery = static_cast<std::uint32_t>(delivery);
  r.start(is_send, peer, tag, source, destination, bytes, delivery);
  r.record_ = index;
  r.state_.store(Request::State::pending, std::memory_order_relaxed);

  // A send waits in the receiver's mailbox, a receive in our own.
  const int box_rank = is_send ? peer : rank_;
  shm::RankArea& box = segment_.rank(box_rank);
  std::optional<std::uint32_t> other;
  {
    auto lock = lock_mailbox(box_rank, peer, operation);
    // Checked under the mailbox lock: a failure scan that ran before we took it sees our record
    // queued; one that runs after finds this flag set.
    if (auto failure = failure_for(peer, operation)) {
      lock.unlock();
      std::lock_guard settling(settle_mutex_);
      give_back(index);
      r.state_.store(Request::State::idle, std::memory_order_relaxed);
      throw *failure;
    }
    const int sender = is_send ? rank_ : peer;
    shm::FifoQueue& others = is_send ? box.receives : box.sends;
    other = take_if(others, [&](const Record& o) {
      return o.tag == tag && (is_send ? o.peer : o.owner) == sender;
    });
    if (!other)
      append(is_send ? box.sends : box.receives, handle);
    else
      mine.copier = segment_.record(*other).copier = rank_;
  }
  // The copy runs outside the mailbox: a rank killed mid-copy must not leave the lock held (the
  // others would wait for it the whole lock patience, then blame the mailbox's owner), and other
  // posts to that rank need not wait for a whole message. Matched records are off the queues,
  // so nobody else touches them until post_done() hands them over.
  if (other) {
    transfer(is_send ? handle : *other, is_send ? *other : handle);
    post_done(rank_, handle);
    post_done(peer, *other);
  }
}

bool SharedMemoryEngine::test(Request& r) {
  if (r.state_.load(std::memory_order_acquire) == Request::State::pending) complete_arrived();
  switch (r.state_.load(std::memory_order_acquire)) {
    case Request::State::done: return true;
    case Request::State::failed: throw *r.error_;
    case Request::State::pending: return false;
    case Request::State::idle: break;
  }
  throw Error(ErrorKind::invalid_argument, context(-1, "test"), "request was never posted");
}

std::size_t SharedMemoryEngine::wait(Request& r, Clock::time_point deadline) {
  const auto settled = [&] { return r.state_.load(std::memory_order_acquire) != Request::State::pending; };
  if (r.state_.load(std::memory_order_acquire) == Request::State::idle)
    throw Error(ErrorKind::invalid_argument, context(-1, "wait"), "request was never posted");
  const bool in_time = settled() || serve_until(deadline, settled);
  if (!in_time) {
    std::unique_lock settling(settle_mutex_);
    // Failed meanwhile (its record given back, perhaps to another request): nothing to take back.
    if (!settled() && withdraw(r)) {
      r.state_.store(Request::State::idle, std::memory_order_relaxed);
      throw Error(ErrorKind::timeout, context(r.peer_, r.is_send_ ? "send" : "recv"),
                  fmt::format("rank {} posted no matching {} (tag {:#x}) before the deadline", launch_rank(r.peer_),
                              r.is_send_ ? "receive" : "send", r.tag_));
    }
  }
  // Matched while we gave up: its completion is on its way.
  if (!in_time && !serve_until(Clock::now() + lock_patience, settled))
    throw Error(ErrorKind::peer_failed, context(r.peer_, r.is_send_ ? "send" : "recv"),
                fmt::format("the {} (tag {:#x}) was matched but never completed: rank {} died copying it",
                            r.is_send_ ? "send" : "receive", r.tag_, launch_rank(r.peer_)))
        .with_origin({launch_rank(r.peer_), "died copying a message"});
  if (r.state_.load(std::memory_order_acquire) == Request::State::failed) throw *r.error_;
  return r.transferred_;
}

bool SharedMemoryEngine::shared(std::span<const std::byte> bytes) const noexcept {
  return segment_.offset_of(bytes.data(), bytes.size()) != shm::not_shared;
}

std::uint64_t SharedMemoryEngine::offset_of(std::span<const std::byte> bytes) const {
  const std::uint64_t at = segment_.offset_of(bytes.data(), bytes.size());
  if (at == shm::not_shared)
    throw Error(ErrorKind::invalid_argument, {.rank = options_.first_rank + rank_, .operation = "shared offset"},
                fmt::format("{} bytes at {} are not in this machine's shared segment", bytes.size(),
                            static_cast<const void*>(bytes.data())));
  return at;
}

std::span<std::byte> SharedMemoryEngine::at_offset(std::uint64_t offset, std::size_t bytes) const {
  if (offset > segment_.bytes() || bytes > segment_.bytes() - offset)
    throw Error(ErrorKind::protocol, {.rank = options_.first_rank + rank_, .operation = "shared offset"},
                fmt::format("{} bytes at offset {} reach past the shared segment ({} bytes)", bytes, offset,
                            segment_.bytes()));
  return {segment_.base() + offset, bytes};
}

void SharedMemoryEngine::abort(const Error& cause) {
  shm::Header& h = segment_.header();
  int expected = -1;
  if (h.failed_rank.compare_exchange_strong(expected, rank_)) {
    // Where the failure began, so that every rank of the machine names it (error.hpp).
    const auto& origin = cause.origin();
    h.origin_rank = origin ? origin->rank : launch_rank(rank_);
    const std::string text = origin ? origin->cause : std::string(cause.what());
    const std::size_t n = std::min(text.size(), h.failure.size() - 1);
    std::memcpy(h.failure.data(), text.data(), n);
    h.failure[n] = '\0';
    h.failure_written.store(1, std::memory_order_release);
  }
  wake_everyone();
  // Like Tcp, settle this rank's own operations before returning, since the caller may free
  // their buffers next: queued ones fail now; one a peer is copying completes when the copy is
  // done, or fails once that peer is seen gone (the completion thread's next look around).
  fail_orphans();
  serve_until(Clock::now() + lock_patience, [&] { return !any_pending(); });
}

ErrorContext SharedMemoryEngine::context(int peer, const char* operation) const {
  ErrorContext c{.rank = launch_rank(rank_), .operation = operation};
  if (peer >= 0) c.peer = launch_rank(peer);
  return c;
}

std::uint32_t SharedMemoryEngine::take_record(Request& r, int peer, const char* operation) {
  std::lock_guard lock(pool_mutex_);
  if (free_.empty())
    throw Error(ErrorKind::unsupported, context(peer, operation),
                fmt::format("more than {} operations pending on this rank (SharedMemoryOptions::max_pending)",
                            segment_.capacity()));
  const std::uint32_t index = free_.back();
  free_.pop_back();
  owners_[index] = &r;
  return index;
}

void SharedMemoryEngine::give_back(std::uint32_t index) {
  std::lock_guard lock(pool_mutex_);
  owners_[index] = nullptr;
  free_.push_back(index);
}

void SharedMemoryEngine::retire(std::uint32_t index) {
  std::lock_guard lock(pool_mutex_);
  owners_[index] = nullptr;
}

bool SharedMemoryEngine::any_pending() {
  std::lock_guard lock(pool_mutex_);
  return std::any_of(owners_.begin(), owners_.end(), [](const Request* r) { return r != nullptr; });
}

void SharedMemoryEngine::append(shm::FifoQueue& q, std::uint32_t handle, std::uint32_t Record::*link) {
  segment_.record(handle).*link = no_record;
  if (q.tail == no_record)
    q.head = handle;
  else
    segment_.record(q.tail).*link = handle;
  q.tail = handle;
}

template <class Pred>
std::optional<std::uint32_t> SharedMemoryEngine::take_if(shm::FifoQueue& q, Pred pred) {
  std::uint32_t previous = no_record;
  for (std::uint32_t h = q.head; h != no_record; previous = h, h = segment_.record(h).next) {
    if (!pred(segment_.record(h))) continue;
    const std::uint32_t next = segment_.record(h).next;
    (previous == no_record ? q.head : segment_.record(previous).next) = next;
    if (q.tail == h) q.tail = previous;
    return h;
  }
  return std::nullopt;
}

SharedMemoryEngine::Lock SharedMemoryEngine::lock_mailbox(int box_rank, int peer, const char* operation) {
  Lock lock = try_lock_mailbox(box_rank);
  if (!lock.owns_lock())
    throw Error(ErrorKind::peer_failed, context(peer, operation),
                fmt::format("local rank {}'s mailbox is unusable: a rank died holding its lock, or it stayed "
                            "locked for {} s", box_rank, lock_patience.count()));
  return lock;
}

SharedMemoryEngine::Lock SharedMemoryEngine::try_lock_mailbox(int box_rank) {
  shm::RobustMutex& mutex = segment_.rank(box_rank).mailbox_mutex;
  Lock lock(mutex, std::defer_lock);
  if (mutex.holder_died() || !lock.try_lock_until(Clock::now() + lock_patience)) return lock;
  if (mutex.holder_died()) lock.unlock();
  return lock;
}

std::byte* SharedMemoryEngine::visible(const Record& r) const {
  if (r.owner == rank_) return reinterpret_cast<std::byte*>(r.address);
  if (r.shared_offset != shm::not_shared) return segment_.base() + r.shared_offset;
  return nullptr;
}

void SharedMemoryEngine::transfer(std::uint32_t send_handle, std::uint32_t receive_handle) {
  Record& send = segment_.record(send_handle);
  Record& receive = segment_.record(receive_handle);
  const auto delivery = static_cast<Delivery>(receive.delivery);
  if (!detail::fits(send.size, receive.size, delivery)) {
    send.other_size = receive.size;
    receive.other_size = send.size;
    send.delivery = receive.delivery;  // for the sender's error message
    send.outcome = receive.outcome = Record::Outcome::misfit;
    return;
  }
  const int error = send.size == 0 ? 0 : land(send, receive, delivery);
  send.copy_errno = receive.copy_errno = error;
  send.outcome = receive.outcome = error ? Record::Outcome::copy_failed : Record::Outcome::done;
  send.transferred = receive.transferred = error ? 0 : send.size;
}

int SharedMemoryEngine::land(const Record& send, const Record& receive, Delivery delivery) {
  const bool we_send = send.owner == rank_;
  const std::byte* from = visible(send);
  std::byte* to = visible(receive);
  if (from && to) {
    detail::deliver(to, from, send.size, delivery);
    return 0;
  }
  const pid_t other = segment_.rank(we_send ? receive.owner : send.owner).process.pid;
  if (delivery == Delivery::copy) {
    iovec local{.iov_base = reinterpret_cast<void*>(we_send ? send.address : receive.address), .iov_len = send.size};
    iovec remote{.iov_base = reinterpret_cast<void*>(we_send ? receive.address : send.address), .iov_len = send.size};
    // One iovec each way: the kernel never splits an element, so it moves all or fails.
    const ssize_t n = we_send ? ::process_vm_writev(other, &local, 1, &remote, 1, 0)
                              : ::process_vm_readv(other, &local, 1, &remote, 1, 0);
    return n == static_cast<ssize_t>(send.size) ? 0 : (n < 0 ? errno : EIO);
  }
  // Adding needs the values here. recv_add's buffer lies in the arena, so only its receiver,
  // reaching into a sender's private memory, comes this way: it reads the message in pieces.
  if (we_send || !to) return EFAULT;
  alignas(double) std::byte piece[64 * 1024];
  for (std::size_t done = 0; done < send.size;) {
    const std::size_t n = std::min(sizeof piece, send.size - done);
    iovec local{.iov_base = piece, .iov_len = n};
    iovec remote{.iov_base = reinterpret_cast<void*>(send.address + done), .iov_len = n};
    const ssize_t got = ::process_vm_readv(other, &local, 1, &remote, 1, 0);
    if (got != static_cast<ssize_t>(n)) return got < 0 ? errno : EIO;
    detail::deliver(to + done, piece, n, delivery);
    done += n;
  }
  return 0;
}

void SharedMemoryEngine::post_done(int owner, std::uint32_t handle) {
  shm::RankArea& area = segment_.rank(owner);
  Lock lock(area.done_mutex, std::defer_lock);
  if (!lock.try_lock_until(Clock::now() + lock_patience)) return;
  append(area.done, handle, &Record::done_next);
  // A completion nobody waits for and no sink wants yet stays on the list until its owner's
  // next test() or wait(): waking the completion thread for it would cost a switch between
  // processes per message, the biggest cost here after the copy itself.
  if (area.serving != 0)
    area.served_changed.notify_all();
  else if (segment_.record(handle).prompt)
    area.done_changed.notify_one();
}

void SharedMemoryEngine::wake(int local) {
  shm::RankArea& area = segment_.rank(local);
  Lock lock(area.done_mutex, std::defer_lock);
  if (!lock.try_lock_until(Clock::now() + std::chrono::milliseconds(100))) return;
  area.wake = 1;
  area.done_changed.notify_one();
}

void SharedMemoryEngine::wake_everyone() {
  for (int r = 0; r < size_; ++r) wake(r);
}

bool SharedMemoryEngine::withdraw(Request& r) {
  const std::uint32_t handle = segment_.handle(rank_, r.record_);
  const int box_rank = r.is_send_ ? r.peer_ : rank_;
  shm::RankArea& box = segment_.rank(box_rank);
  auto lock = try_lock_mailbox(box_rank);
  if (!lock.owns_lock()) {
    // A mailbox a rank died holding is never searched again. Matched before that, the request
    // completes as any other; if not, nobody can match it any more, and it is ours again. Its
    // record may still be linked in the mailbox's queue, so it is retired rather than reused.
    if (segment_.record(handle).copier != -1) return false;
    retire(r.record_);
    return true;
  }
  if (!take_if(r.is_send_ ? box.sends : box.receives, [&](const Record& o) { return &o == &segment_.record(handle); }))
    return false;
  lock.unlock();
  give_back(r.record_);
  return true;
}

std::optional<Error> SharedMemoryEngine::failure_for(int peer, const char* operation) {
  shm::Header& h = segment_.header();
  const int failed = h.failed_rank.load(std::memory_order_acquire);
  if (failed >= 0) {
    while (h.failure_written.load(std::memory_order_acquire) == 0) std::this_thread::yield();
    const FailureOrigin origin{h.origin_rank, h.failure.data()};
    if (failed == rank_)
      return Error(ErrorKind::peer_failed, context(peer, operation), fmt::format("this rank aborted: {}", origin.cause))
          .with_origin(origin);
    const int stopped = launch_rank(failed);
    return Error(ErrorKind::peer_failed, {.rank = launch_rank(rank_), .peer = stopped, .operation = operation},
                 origin.rank == stopped ? fmt::format("rank {} failed: {}", stopped, origin.cause)
                                        : fmt::format("rank {} failed first ({}), and rank {} stopped because of it",
                                                      origin.rank, origin.cause, stopped))
        .with_origin(origin);
  }
  if (peer >= 0 && peer_gone(peer))
    return Error(ErrorKind::peer_failed, context(peer, operation), departure(peer))
        .with_origin({launch_rank(peer), departure(peer)});
  return std::nullopt;
}

bool SharedMemoryEngine::peer_gone(int peer) {
  std::lock_guard lock(pool_mutex_);
  return peer_gone_[static_cast<std::size_t>(peer)];
}

std::string SharedMemoryEngine::departure(int peer) const {
  const shm::RankArea& area = segment_.rank(peer);
  if (const std::int32_t killer = area.killed_by.load(std::memory_order_acquire); killer >= 0)
    return fmt::format("rank {} (pid {}) stayed stopped (SIGSTOP, or a debugger's stop) for {} ms, past the liveness "
                       "bound of {} ms, and was killed by rank {}",
                       launch_rank(peer), area.process.pid, area.stopped_ms.load(std::memory_order_relaxed),
                       options_.liveness.count(), launch_rank(killer));
  return area.closed.load(std::memory_order_acquire)
             ? fmt::format("rank {} closed its transport", launch_rank(peer))
             : fmt::format("rank {} (pid {}) exited without closing its transport (killed?)", launch_rank(peer),
                           area.process.pid);
}

bool SharedMemoryEngine::notice_departures() {
  using State = shm::ProcessIdentity::State;
  bool any = false;
  const auto now = Clock::now();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || peer_gone(p)) continue;
    const shm::RankArea& area = segment_.rank(p);
    const State state = area.closed.load(std::memory_order_acquire) ? State::gone : area.process.state();
    Clock::time_point& since = stopped_since_[static_cast<std::size_t>(p)];
    if (state == State::stopped) {
      if (since == Clock::time_point{})
        since = now;
      else if (options_.liveness.count() > 0 && now - since >= options_.liveness)
        kill_stopped(p, now - since);
      continue;
    }
    since = {};
    if (state == State::gone) {
      std::lock_guard lock(pool_mutex_);
      peer_gone_[static_cast<std::size_t>(p)] = true;
      any = true;
    }
  }
  return any;
}

void SharedMemoryEngine::kill_stopped(int peer, Clock::duration stopped) {
  shm::RankArea& area = segment_.rank(peer);
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, area.process.pid, 0));
  if (pidfd < 0) return;  // gone meanwhile: the next look finds it
  if (area.process.state() == shm::ProcessIdentity::State::stopped) {
    area.stopped_ms.store(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(stopped).count()),
                          std::memory_order_relaxed);
    std::int32_t nobody = -1;
    if (area.killed_by.compare_exchange_strong(nobody, rank_, std::memory_order_acq_rel))
      ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
  }
  ::close(pidfd);
}

bool SharedMemoryEngine::died_copying(const Request& r) {
  const std::uint32_t handle = segment_.handle(rank_, r.record_);
  const Record& record = segment_.record(handle);
  if (record.copier != r.peer_ || !peer_gone(r.peer_)) return false;
  if (record.outcome == Record::Outcome::pending) return true;
  shm::RankArea& area = segment_.rank(rank_);
  if (!area.done_mutex.holder_died()) return false;
  Lock lock(area.done_mutex);
  bool listed = false;
  walk_done_list(area.done.head, [&](std::uint32_t h) { listed = listed || h == handle; });
  return !listed;
}

template <class F>
void SharedMemoryEngine::walk_done_list(std::uint32_t head, F f) {
  const std::uint32_t first = segment_.handle(rank_, 0), end = first + segment_.capacity();
  for (std::uint32_t h = head, steps = 0; h >= first && h < end && steps < segment_.capacity(); ++steps) {
    const std::uint32_t next = segment_.record(h).done_next;  // read first: completing frees the record
    f(h);
    h = next;
  }
}

void SharedMemoryEngine::fail_orphans() {
  orphans_.clear();
  {
    std::lock_guard lock(pool_mutex_);
    for (std::uint32_t i = 0; i < owners_.size(); ++i)
      if (owners_[i]) orphans_.emplace_back(i, owners_[i]);
  }
  for (auto [index, r] : orphans_) {
    std::lock_guard settling(settle_mutex_);
    {
      std::lock_guard lock(pool_mutex_);
      if (owners_[index] != r) continue;  // settled since the list was taken, and perhaps destroyed
    }
    if (r->state_.load(std::memory_order_acquire) != Request::State::pending) continue;  // still being posted
    auto failure = failure_for(r->peer_, r->is_send_ ? "send" : "recv");
    if (!failure) continue;
    // Matched: its completion is on its way, unless the departed peer was copying it and died.
    if (!withdraw(*r)) {
      if (!died_copying(*r)) continue;
      retire(index);  // it may yet turn up on our completion list
    }
    r->error_ = std::move(*failure);
    finish(*r, Request::State::failed);
  }
}

void SharedMemoryEngine::finish(Request& r, Request::State state) {
  r.report();
  r.state_.store(state, std::memory_order_release);
}

void SharedMemoryEngine::complete(std::uint32_t handle) {
  const std::uint32_t index = handle - segment_.handle(rank_, 0);
  std::lock_guard settling(settle_mutex_);
  Request* r;
  {
    std::lock_guard lock(pool_mutex_);
    r = owners_[index];
  }
  if (!r) return;  // failed already, its copier gone (died_copying())
  const Record& rec = segment_.record(handle);
  r->transferred_ = rec.transferred;
  const char* operation = rec.is_send ? "send" : "recv";
  switch (rec.outcome) {
    case Record::Outcome::done: break;
    case Record::Outcome::misfit: {
      const auto send_size = rec.is_send ? rec.size : rec.other_size;
      const auto receive_size = rec.is_send ? rec.other_size : rec.size;
      r->error_ = Error(ErrorKind::protocol, context(rec.peer, operation),
                        detail::misfit(send_size, receive_size, static_cast<Delivery>(rec.delivery), rec.tag));
      break;
    }
    case Record::Outcome::copy_failed:
      if (rec.copy_errno == ESRCH) {  // the other process is gone: it died before its liveness was checked
        r->error_ = Error(ErrorKind::peer_failed, context(rec.peer, operation),
                          fmt::format("rank {} is gone: the copy of {} bytes (tag {:#x}) found no process",
                                      launch_rank(rec.peer), rec.size, rec.tag))
                        .with_origin({launch_rank(rec.peer), "its process is gone"});
        break;
      }
      [[fallthrough]];
    case Record::Outcome::pending:
      r->error_ = Error(ErrorKind::internal, context(rec.peer, operation),
                        fmt::format("cross-memory copy of {} bytes (tag {:#x}) failed: {}", rec.size, rec.tag,
                                    std::strerror(rec.copy_errno)));
      break;
  }
  const bool failed = r->error_.has_value();
  give_back(index);
  finish(*r, failed ? Request::State::failed : Request::State::done);
}

bool SharedMemoryEngine::drain(Lock& lock) {
  shm::RankArea& area = segment_.rank(rank_);
  std::uint32_t head = std::exchange(area.done.head, no_record);
  area.done.tail = no_record;
  if (head == no_record) return false;
  lock.unlock();
  walk_done_list(head, [&](std::uint32_t h) { complete(h); });
  lock.lock();
  return true;
}

void SharedMemoryEngine::complete_arrived() {
  shm::RankArea& area = segment_.rank(rank_);
  Lock lock(area.done_mutex, std::try_to_lock);
  if (lock && drain(lock) && area.serving != 0) area.served_changed.notify_all();
}

template <class Settled>
bool SharedMemoryEngine::serve_until(Clock::time_point deadline, Settled settled) {
  shm::RankArea& area = segment_.rank(rank_);
  Lock lock(area.done_mutex);
  ++area.serving;
  bool done = false;
  for (;;) {
    if ((done = settled())) break;
    if (drain(lock)) {
      if (area.serving > 1) area.served_changed.notify_all();  // the batch may have held others' requests
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    area.served_changed.wait_until(lock, std::min<Clock::time_point>(deadline, now + liveness_period),
                                   [&] { return area.done.head != no_record || settled(); });
  }
  // What arrives from now on is the completion thread's again, and whatever a sink is waiting for
  // that came meanwhile.
  if (--area.serving == 0 && awaits_prompt_completion(area.done)) area.done_changed.notify_one();
  return done;
}

bool SharedMemoryEngine::awaits_prompt_completion(const shm::FifoQueue& done) const {
  for (std::uint32_t h = done.head; h != no_record; h = segment_.record(h).done_next)
    if (segment_.record(h).prompt) return true;
  return false;
}

void SharedMemoryEngine::complete_loop() {
  shm::RankArea& area = segment_.rank(rank_);
  auto looked_around = Clock::now();
  for (;;) {
    bool look_around = false;
    {
      Lock lock(area.done_mutex);
      area.done_changed.wait_until(lock, Clock::now() + liveness_period, [&] {
        return (area.done.head != no_record && area.serving == 0) || area.wake != 0;
      });
      const bool completed = drain(lock);
      look_around = std::exchange(area.wake, 0u) != 0 || Clock::now() - looked_around >= liveness_period;
      // A waiter may have gone to sleep before we took its completion from the list.
      if (completed && area.serving != 0) area.served_changed.notify_all();
    }
    {
      std::lock_guard lock(local_mutex_);
      if (stopping_) return;
    }
    if (look_around) {
      looked_around = Clock::now();
      const bool departed = notice_departures();
      if (departed || segment_.header().failed_rank.load(std::memory_order_acquire) >= 0) {
        fail_orphans();
        Lock lock(area.done_mutex);
        if (area.serving != 0) area.served_changed.notify_all();
      }
    }
  }
}

void SharedMemoryEngine::check_cross_memory_attach() {
#ifdef PR_SET_PTRACER
  ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);  // Yama's ptrace_scope 1 wants the target's consent
#endif
  if (size_ == 1) return;
  const int peer = (rank_ + 1) % size_;
  const shm::RankArea& area = segment_.rank(peer);
  std::uint32_t magic = 0;
  iovec local{.iov_base = &magic, .iov_len = sizeof magic};
  iovec remote{.iov_base = reinterpret_cast<void*>(area.mapped_at), .iov_len = sizeof magic};
  const ssize_t n = ::process_vm_readv(area.process.pid, &local, 1, &remote, 1, 0);
  if (n == sizeof magic && magic == shm::segment_magic) return;
  if (n < 0 && errno == ESRCH) {  // no such process: the peer is gone, which says nothing of permissions
    const Error gone(ErrorKind::peer_failed, context(peer, "shared-memory setup"),
                     fmt::format("rank {} (pid {}) exited during setup", launch_rank(peer), area.process.pid));
    abort(gone);
    throw gone;
  }
  const Error refused(ErrorKind::unsupported, context(peer, "shared-memory setup"),
                      fmt::format("cross-memory attach to rank {} (pid {}) {}: SharedMemory copies with "
                                  "process_vm_readv/writev, which needs ptrace permission between the job's "
                                  "processes (same user; not forbidden by Yama's ptrace_scope 2-3, seccomp or a "
                                  "container's policy)",
                                  launch_rank(peer), area.process.pid,
                                  n < 0 ? fmt::format("refused ({})", std::strerror(errno)) : "read wrong bytes"));
  abort(refused);
  throw refused;
}

}  // namespace gradsync::transport::detail
