#pragma once
// A FIFO of caller-owned requests linked through their `next_` member: the transports keep
// pending operations in these, so posting one never allocates.

namespace gradsync::detail {

template <class Request>
class IntrusiveQueue {
 public:
  void push(Request* r) noexcept {
    r->next_ = nullptr;
    (tail_ ? tail_->next_ : head_) = r;
    tail_ = r;
  }

  Request* pop() noexcept {
    return take_if([](const Request*) { return true; });
  }

  // Removes and returns the first request that satisfies `pred`, or nullptr.
  template <class Pred>
  Request* take_if(Pred pred) noexcept {
    Request* previous = nullptr;
    for (Request* r = head_; r != nullptr; previous = r, r = r->next_) {
      if (!pred(r)) continue;
      (previous ? previous->next_ : head_) = r->next_;
      if (tail_ == r) tail_ = previous;
      r->next_ = nullptr;
      return r;
    }
    return nullptr;
  }

  bool empty() const noexcept { return head_ == nullptr; }

  bool remove(Request* target) noexcept {
    return take_if([&](const Request* r) { return r == target; }) != nullptr;
  }

  // Calls f on every request, emptying the queue; f may not touch the queue.
  template <class F>
  void drain(F&& f) {
    Request* r = head_;
    head_ = tail_ = nullptr;
    while (r != nullptr) {
      Request* next = r->next_;
      r->next_ = nullptr;
      f(r);
      r = next;
    }
  }

 private:
  Request* head_ = nullptr;
  Request* tail_ = nullptr;
};

}  // namespace gradsync::detail
