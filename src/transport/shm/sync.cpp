#include "transport/shm/sync.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <ctime>
#include <system_error>

namespace gradsync::transport::shm {

namespace {

timespec timespec_of(std::chrono::nanoseconds d) {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(d);
  return {.tv_sec = static_cast<time_t>(seconds.count()), .tv_nsec = static_cast<long>((d - seconds).count())};
}

void check(int status, const char* what) {
  if (status != 0) throw std::system_error(status, std::generic_category(), what);
}

// The futex word behind an atomic: process-shared, so no FUTEX_PRIVATE_FLAG.
int* futex_word(std::atomic<std::uint32_t>& a) {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(int) && std::atomic<std::uint32_t>::is_always_lock_free);
  return reinterpret_cast<int*>(&a);
}

}  // namespace

RobustMutex::RobustMutex() {
  pthread_mutexattr_t attributes;
  check(pthread_mutexattr_init(&attributes), "pthread_mutexattr_init");
  check(pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED), "pthread_mutexattr_setpshared");
  check(pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST), "pthread_mutexattr_setrobust");
  check(pthread_mutex_init(&mutex_, &attributes), "pthread_mutex_init");
  pthread_mutexattr_destroy(&attributes);
}

// EOWNERDEAD: we hold it, and make it usable again for everyone after us.
bool RobustMutex::acquired(int status) {
  if (status == EOWNERDEAD) {
    holder_died_.store(1, std::memory_order_release);
    pthread_mutex_consistent(&mutex_);
    return true;
  }
  if (status == EBUSY || status == ETIMEDOUT) return false;
  check(status, "pthread_mutex_lock");
  return true;
}

void RobustMutex::lock() { acquired(pthread_mutex_lock(&mutex_)); }
bool RobustMutex::try_lock() { return acquired(pthread_mutex_trylock(&mutex_)); }

bool RobustMutex::try_lock_until(Clock::time_point deadline) {
  if (try_lock()) return true;  // the usual case, without glibc's timed path
  // steady_clock is CLOCK_MONOTONIC.
  const timespec at = timespec_of(deadline.time_since_epoch());
  return acquired(pthread_mutex_clocklock(&mutex_, CLOCK_MONOTONIC, &at));
}

void RobustMutex::unlock() { pthread_mutex_unlock(&mutex_); }

void SharedCondition::notify(std::uint32_t waiters) noexcept {
  sequence_.fetch_add(1);
  // Sequentially consistent with sleep()'s increment then futex read: either it sees this
  // number or we see it asleep.
  if (sleepers_.load() != 0)
    ::syscall(SYS_futex, futex_word(sequence_), FUTEX_WAKE, static_cast<int>(std::min<std::uint32_t>(waiters, INT_MAX)),
              nullptr, nullptr, 0);
}

void SharedCondition::sleep(std::uint32_t seen, Clock::duration timeout) noexcept {
  const timespec relative = timespec_of(timeout);
  sleepers_.fetch_add(1);
  ::syscall(SYS_futex, futex_word(sequence_), FUTEX_WAIT, static_cast<int>(seen), &relative, nullptr, 0);
  sleepers_.fetch_sub(1);
}

}  // namespace gradsync::transport::shm
