#pragma once
// Locking and waking between the processes of a SharedMemory segment that survive a process
// killed in the middle. Boost.Interprocess's mutex and condition (pthread's, process-shared) do
// not: a process that dies holding the mutex leaves it locked for good, and one that dies waiting
// on glibc's condition variable keeps a reference that later notifications wait to see released.
// Here the mutex is a robust pthread mutex (the kernel hands it to the next locker, who is told
// its holder died) and the condition is a sequence number that waiters sleep on with futex(2),
// which a dead waiter leaves nothing behind in. Both live in the segment and are constructed once,
// in place, by the rank that creates it. Private to the library.

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace gradsync::transport::shm {

class RobustMutex {
 public:
  using Clock = std::chrono::steady_clock;

  RobustMutex();
  RobustMutex(const RobustMutex&) = delete;
  RobustMutex& operator=(const RobustMutex&) = delete;

  void lock();
  bool try_lock();
  bool try_lock_until(Clock::time_point deadline);
  void unlock();

  // True once a process died holding the lock: what the lock guards may be half updated.
  bool holder_died() const noexcept { return holder_died_.load(std::memory_order_acquire) != 0; }

 private:
  bool acquired(int status);

  pthread_mutex_t mutex_;
  std::atomic<std::uint32_t> holder_died_{0};
};

class SharedCondition {
 public:
  using Clock = std::chrono::steady_clock;

  // Callers change what waiters test with the lock held, then notify (with it held or not).
  void notify_one() noexcept { notify(1); }
  void notify_all() noexcept { notify(~0u >> 1); }

  // Waits with `lock` held on entry and on return (released while asleep) until pred() or the
  // deadline; returns pred().
  template <class Pred>
  bool wait_until(std::unique_lock<RobustMutex>& lock, Clock::time_point deadline, Pred pred) {
    for (;;) {
      if (pred()) return true;
      const auto now = Clock::now();
      if (now >= deadline) return false;
      // Read under the lock: a change made after it comes with a new number, and the sleep below
      // returns at once if the number has moved on.
      const std::uint32_t seen = sequence_.load();
      lock.unlock();
      sleep(seen, deadline - now);
      lock.lock();
    }
  }

 private:
  void notify(std::uint32_t waiters) noexcept;
  void sleep(std::uint32_t seen, Clock::duration timeout) noexcept;

  std::atomic<std::uint32_t> sequence_{0};
  std::atomic<std::uint32_t> sleepers_{0};  // a killed sleeper leaves one too many: a wasted wake-up, no more
};

}  // namespace gradsync::transport::shm
