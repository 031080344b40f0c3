#include "gradsync/transport/in_process.hpp"

#include <condition_variable>
#include <mutex>

#include <fmt/format.h>

#include "transport/matcher.hpp"

namespace gradsync::transport {

namespace detail {

using Request = InProcess::Request;

// Everything addressed to one rank: receives it posted and sends nobody has received yet. Copies
// happen under this lock, so a rank that aborts cannot free a buffer that is being read.
struct Mailbox {
  std::mutex mutex;
  Matcher<Request> waiting;
};

// Where a rank sleeps while it waits for one of its requests.
struct Waker {
  std::mutex mutex;
  std::condition_variable cv;
};

struct InProcessWorld {
  explicit InProcessWorld(int n) : size(n), mailboxes(n), wakers(n) {}

  // The rank whose send `r` is, or waits for. (Every request in a mailbox is addressed to its rank.)
  static int sender_of(const Request& r) { return r.is_send_ ? r.owner_ : r.peer_; }

  const int size;
  std::vector<Mailbox> mailboxes;
  std::vector<Waker> wakers;

  std::atomic<bool> failed{false};
  std::mutex failure_mutex;
  std::optional<Error> failure;  // the first abort's cause
  int failed_rank = -1;

  // Once the state is stored the owner may return and free `r`: touch nothing of it afterwards.
  // The sink hears first, while `r` is certainly alive.
  void finish(Request& r, Request::State state) {
    Waker& w = wakers[r.owner_];
    r.report();
    r.state_.store(state, std::memory_order_release);
    { std::lock_guard lock(w.mutex); }
    w.cv.notify_all();
  }

  void fail(Request& r, Error error) {
    r.error_ = std::move(error);
    finish(r, Request::State::failed);
  }

  // Moves the send's bytes into the receive and completes both; a message too big for the receive
  // fails both with the same explanation.
  void transfer(const Matcher<Request>::Match& m) {
    Request& send = m.send;
    Request& receive = m.receive;
    if (!Matcher<Request>::copy(m)) {
      // Everything is read before either request is handed back: its owner may reuse it at once.
      const int sender = send.owner_, receiver = receive.owner_;
      const auto detail = misfit(send.size_, receive.size_, receive.delivery_, send.tag_);
      fail(send, Error(ErrorKind::protocol, {.rank = sender, .peer = receiver, .operation = "send"}, detail));
      fail(receive, Error(ErrorKind::protocol, {.rank = receiver, .peer = sender, .operation = "recv"}, detail));
      return;
    }
    send.transferred_ = receive.transferred_ = send.size_;
    finish(send, Request::State::done);
    finish(receive, Request::State::done);
  }

  Error failure_seen_by(int rank, std::string_view operation) {
    std::lock_guard lock(failure_mutex);
    if (failed_rank == rank) return failure->filled({.rank = rank, .operation = std::string(operation)});
    return Error(ErrorKind::peer_failed, {.rank = rank, .peer = failed_rank, .operation = std::string(operation)},
                 fmt::format("rank {} failed: {}", failed_rank, failure->what()));
  }
};

}  // namespace detail

std::vector<InProcess> InProcess::create_world(int size) {
  if (size < 1)
    throw Error(ErrorKind::invalid_argument, {.operation = "create_world"},
                fmt::format("an in-process world needs at least one rank, not {}", size));
  auto world = std::make_shared<detail::InProcessWorld>(size);
  std::vector<InProcess> ranks;
  ranks.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) ranks.push_back(InProcess(world, r));
  return ranks;
}

int InProcess::size() const noexcept { return world_->size; }

std::string InProcess::describe() const { return "in-process"; }

void InProcess::post(Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source,
                     std::byte* destination, std::size_t size, detail::Delivery delivery) {
  const char* operation = is_send ? "send" : "recv";
  if (peer < 0 || peer >= world_->size)
    throw Error(ErrorKind::invalid_argument, {.rank = rank_, .peer = peer, .operation = operation},
                fmt::format("no rank {} in a world of {}", peer, world_->size));
  if (r.state_.load(std::memory_order_acquire) == Request::State::pending)
    throw Error(ErrorKind::invalid_argument, {.rank = rank_, .peer = peer, .operation = operation},
                "request reused while still pending");
  r.start(is_send, peer, tag, source, destination, size, delivery);
  r.owner_ = rank_;
  r.state_.store(Request::State::pending, std::memory_order_relaxed);

  // A send lives in the receiver's mailbox; a receive in our own.
  auto& box = world_->mailboxes[is_send ? peer : rank_];
  std::lock_guard lock(box.mutex);
  if (world_->failed.load(std::memory_order_acquire)) {
    r.state_.store(Request::State::idle, std::memory_order_relaxed);
    throw world_->failure_seen_by(rank_, operation);
  }
  if (const auto match = box.waiting.match_or_queue(r, detail::InProcessWorld::sender_of)) world_->transfer(*match);
}

void InProcess::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  post(r, true, peer, tag, bytes.data(), nullptr, bytes.size());
}

void InProcess::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  post(r, false, peer, tag, nullptr, bytes.data(), bytes.size());
}
void InProcess::recv_add(Request& r, int peer, std::uint64_t tag, std::span<float> values) {
  post(r, false, peer, tag, nullptr, reinterpret_cast<std::byte*>(values.data()), values.size_bytes(),
       detail::Delivery::add_f32);
}
void InProcess::recv_add(Request& r, int peer, std::uint64_t tag, std::span<double> values) {
  post(r, false, peer, tag, nullptr, reinterpret_cast<std::byte*>(values.data()), values.size_bytes(),
       detail::Delivery::add_f64);
}

bool InProcess::test(Request& r) {
  switch (r.state_.load(std::memory_order_acquire)) {
    case Request::State::done: return true;
    case Request::State::failed: throw *r.error_;
    case Request::State::pending: return false;
    case Request::State::idle: break;
  }
  throw Error(ErrorKind::invalid_argument, {.rank = rank_, .operation = "test"}, "request was never posted");
}

std::size_t InProcess::wait(Request& r, std::chrono::steady_clock::time_point deadline) {
  const auto settled = [&] { return r.state_.load(std::memory_order_acquire) != Request::State::pending; };
  if (r.state_.load(std::memory_order_acquire) == Request::State::idle)
    throw Error(ErrorKind::invalid_argument, {.rank = rank_, .operation = "wait"}, "request was never posted");
  auto& waker = world_->wakers[rank_];
  bool in_time;
  {
    std::unique_lock lock(waker.mutex);
    in_time = waker.cv.wait_until(lock, deadline, settled);
  }
  if (!in_time) {
    // Withdraw it, unless it completed while we were giving up.
    auto& box = world_->mailboxes[r.is_send_ ? r.peer_ : rank_];
    std::lock_guard lock(box.mutex);
    if (!settled()) {
      box.waiting.withdraw(r);
      r.state_.store(Request::State::idle, std::memory_order_relaxed);
      throw Error(ErrorKind::timeout, {.rank = rank_, .peer = r.peer_, .operation = r.is_send_ ? "send" : "recv"},
                  fmt::format("rank {} posted no matching {} (tag {:#x}) before the deadline", r.peer_,
                              r.is_send_ ? "receive" : "send", r.tag_));
    }
  }
  if (r.state_.load(std::memory_order_acquire) == Request::State::failed) throw *r.error_;
  return r.transferred_;
}

void InProcess::abort(const Error& cause) {
  {
    std::lock_guard lock(world_->failure_mutex);
    if (!world_->failure) {
      world_->failure = cause;
      world_->failed_rank = rank_;
    }
  }
  world_->failed.store(true, std::memory_order_release);
  for (auto& box : world_->mailboxes) {
    std::lock_guard lock(box.mutex);
    const auto fail = [&](Request* r) { world_->fail(*r, world_->failure_seen_by(r->owner_, r->is_send_ ? "send" : "recv")); };
    box.waiting.drain(fail);
  }
}

}  // namespace gradsync::transport
