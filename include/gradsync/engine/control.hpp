#pragma once
// engine::ControlChannel — the one way ranks exchange control messages: the layout check at the
// first synchronization, plan agreement, selective compression's calibration, and whatever the
// next collective agreement needs. (Coordinated sends stream their reports and grants
// asynchronously, on the task graph's thread: engine/coordinator/channel.hpp. Their ids come from
// the same enum, engine/tag.hpp.)
//
// A control message is a length (u64) followed by its payload, each its own transport message,
// so a receiver sizes its buffer from the length, checked against max_bytes before anything is
// allocated. Integers travel in host byte order: the ranks of one job share an architecture. Every wait has the channel's timeout; an Error names this rank, the peer and the
// operation. The channel owns the buffers its requests name: if a wait fails, the caller aborts
// the transport while they are still alive.
//
// Collectives here are rooted at group rank 0: gather() brings every rank's text to it,
// broadcast() sends its text to all. Messages travel in group rank order, so a rank that stops
// answering is named by the first wait that expires.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/concepts.hpp"
#include "gradsync/engine/tag.hpp"

namespace gradsync::engine {

template <TransportPolicy X>
class ControlChannel {
 public:
  static constexpr std::uint64_t max_bytes = std::uint64_t{64} << 20;

  ControlChannel(X& transport, const Group& group, std::chrono::milliseconds timeout)
      : transport_(transport), group_(group), timeout_(timeout) {}

  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  const Group& group() const noexcept { return group_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  // Sends `payload` as control message `m` of `iteration` to group rank `peer`.
  void send(int peer, std::uint64_t iteration, ControlMessage m, std::string_view payload) {
    out_.assign(payload);
    size_ = out_.size();
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    transport_.send(requests_[0], group_.members[peer], control_tag(iteration, m),
                    std::as_bytes(std::span(&size_, 1)));
    transport_.send(requests_[1], group_.members[peer], control_tag(iteration, m, 1),
                    std::as_bytes(std::span(out_.data(), out_.size())));
    transport_.wait(requests_[0], deadline);
    transport_.wait(requests_[1], deadline);
  }

  // Receives control message `m` of `iteration` from group rank `peer`; the text stays valid until
  // the next receive.
  std::string_view recv(int peer, std::uint64_t iteration, ControlMessage m) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    transport_.recv(requests_[0], group_.members[peer], control_tag(iteration, m),
                    std::as_writable_bytes(std::span(&size_, 1)));
    if (transport_.wait(requests_[0], deadline) != sizeof size_ || size_ > max_bytes)
      throw malformed(peer, fmt::format("control message announces {} bytes (limit {})", size_, max_bytes));
    in_.resize(size_);
    transport_.recv(requests_[1], group_.members[peer], control_tag(iteration, m, 1),
                    std::as_writable_bytes(std::span(in_.data(), in_.size())));
    if (transport_.wait(requests_[1], deadline) != size_) throw malformed(peer, "control message shorter than announced");
    return in_;
  }

  // Group rank 0: calls on_each(peer, text) with every other rank's message, in rank order.
  // Others: send `mine` to group rank 0.
  template <class OnEach>
  void gather(std::uint64_t iteration, ControlMessage m, std::string_view mine, OnEach&& on_each) {
    if (group_.rank != 0) return send(0, iteration, m, mine);
    for (int peer = 1; peer < group_.size(); ++peer) on_each(peer, recv(peer, iteration, m));
  }

  // Group rank 0's `text` on every rank (others pass anything; what they get stays valid until
  // the next receive).
  std::string_view broadcast(std::uint64_t iteration, ControlMessage m, std::string_view text) {
    if (group_.rank != 0) return recv(0, iteration, m);
    for (int peer = 1; peer < group_.size(); ++peer) send(peer, iteration, m, text);
    return text;
  }

  // Sends `mine` to every other member and hands each member's own text to on_each(peer, text),
  // in group order; the texts travel raw (at most `max_text` bytes). Members that send nothing
  // before the deadline are listed in the Error(mismatch) `what` names: they do not count this
  // rank in the same exchange. Used once, at the first synchronization: it allocates.
  template <class OnEach>
  void exchange_with_all(std::uint64_t iteration, ControlMessage m, std::string_view mine, std::string_view what,
                         OnEach&& on_each) {
    constexpr std::size_t max_text = std::size_t{1} << 20;
    const int n = group_.size();
    if (mine.size() > max_text) throw malformed(group_.rank, fmt::format("{} is over {} bytes", what, max_text));
    // The channel owns what the transfers name: a failed wait leaves the rest pending until the
    // Synchronizer aborts the transport, and they must not point into a finished stack frame.
    all_sends_ = std::make_unique<typename X::Request[]>(static_cast<std::size_t>(n));
    all_receives_ = std::make_unique<typename X::Request[]>(static_cast<std::size_t>(n));
    all_texts_.assign(static_cast<std::size_t>(n), std::string(max_text, '\0'));
    all_out_.assign(mine);
    auto& sends = all_sends_;
    auto& receives = all_receives_;
    auto& texts = all_texts_;
    const auto out = std::as_bytes(std::span(all_out_.data(), all_out_.size()));
    for (int peer = 0; peer < n; ++peer) {
      if (peer == group_.rank) continue;
      transport_.recv(receives[peer], group_.members[peer], control_tag(iteration, m),
                      std::as_writable_bytes(std::span(texts[peer].data(), max_text)));
      transport_.send(sends[peer], group_.members[peer], control_tag(iteration, m), out);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::vector<int> silent;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == group_.rank) continue;
      try {
        texts[peer].resize(transport_.wait(receives[peer], deadline));
        transport_.wait(sends[peer], deadline);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::timeout) throw;
        silent.push_back(group_.members[peer]);
      }
    }
    if (!silent.empty())
      throw Error(ErrorKind::mismatch, {.rank = group_.members[group_.rank], .operation = std::string(what)},
                  fmt::format("ranks {} did not answer within {} ms: they do not count this rank in {:?} (or "
                              "never got this far)",
                              fmt::join(silent, ", "), timeout_.count(), group_.name));
    for (int peer = 0; peer < n; ++peer)
      if (peer != group_.rank) on_each(peer, std::string_view(texts[peer]));
  }

  // One timed transfer of `bytes` raw bytes as message `tag`: sent to group rank `to` while as many
  // are received from group rank `from`. The channel's own buffers travel; their contents do not
  // matter.
  void probe(int to, int from, std::uint64_t tag, std::size_t bytes) {
    if (probe_out_.size() < bytes) probe_out_.resize(bytes), probe_in_.resize(bytes);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    transport_.recv(requests_[0], group_.members[from], tag, std::span(probe_in_.data(), bytes));
    transport_.send(requests_[1], group_.members[to], tag, std::span<const std::byte>(probe_out_.data(), bytes));
    transport_.wait(requests_[0], deadline);
    transport_.wait(requests_[1], deadline);
  }

 private:
  Error malformed(int peer, std::string why) const {
    return Error(ErrorKind::protocol,
                 {.rank = group_.members[group_.rank], .peer = group_.members[peer], .operation = "control"},
                 std::move(why));
  }

  X& transport_;
  const Group& group_;
  std::chrono::milliseconds timeout_;
  typename X::Request requests_[2];
  std::uint64_t size_ = 0;
  std::string out_;
  std::string in_;
  std::vector<std::byte> probe_out_;
  std::vector<std::byte> probe_in_;
  std::unique_ptr<typename X::Request[]> all_sends_, all_receives_;  // exchange_with_all's
  std::vector<std::string> all_texts_;
  std::string all_out_;
};

// ---- what the Synchronizer agrees on ---------------------------------------------------------

// The text every rank sends at the first synchronization: one line of header, one of policies,
// one per gradient. Compiled in src/engine/control.cpp, like the three functions below.
std::string describe_layout(const Layout& layout, std::string_view policies);

// Empty when equal; otherwise what `other_rank` has that rank 0 does not, e.g.
// "rank 2 differs from rank 0: gradient 1: rank 0 has "fc.bias" f32[10] cpu, rank 2 has "fc.bias" f32[11] cpu".
std::string layout_differences(std::string_view rank0, std::string_view other, int other_rank);

// A plan on the wire: bucket count, then each bucket's size and ids, as 32-bit words in host
// byte order. decode_plan checks every count against the words left before sizing anything, and
// throws Error(protocol) in `where` for a malformed message.
std::string encode_plan(const BucketPlan& plan);
BucketPlan decode_plan(std::string_view bytes, const ErrorContext& where);

// Stops with the same Error(mismatch) on every rank if any rank's layout or policies differ from
// group rank 0's; the message says what differs, for every rank that differs.
template <TransportPolicy X>
void agree_on_layout(ControlChannel<X>& control, const Layout& layout, std::string_view policies) {
  const std::string mine = describe_layout(layout, policies);
  std::string verdict;
  control.gather(0, ControlMessage::layout, mine, [&](int peer, std::string_view theirs) {
    const std::string difference = layout_differences(mine, theirs, control.group().members[peer]);
    if (!difference.empty()) verdict += (verdict.empty() ? "" : "; ") + difference;
  });
  const std::string_view agreed = control.broadcast(0, ControlMessage::verdict, verdict);
  if (!agreed.empty())
    throw Error(ErrorKind::mismatch,
                {.rank = control.group().members[control.group().rank], .operation = "layout check"},
                std::string(agreed));
}

// Stops with Error(mismatch) on every member that disagrees with another about the group's name
// or members, naming both versions. Members a rank does not count at all cannot answer it; they
// are named once the control timeout has passed.
template <TransportPolicy X>
void agree_on_membership(ControlChannel<X>& control) {
  const Group& group = control.group();
  if (group.size() == 1) return;
  const std::string mine = group.describe();
  std::string differences;
  control.exchange_with_all(0, ControlMessage::membership, mine, "group membership check",
                            [&](int peer, std::string_view theirs) {
                              if (theirs == mine) return;
                              differences += fmt::format("{}rank {} counts {:?}", differences.empty() ? "" : "; ",
                                                         group.members[peer], theirs);
                            });
  if (!differences.empty())
    throw Error(ErrorKind::mismatch, {.rank = group.members[group.rank], .operation = "group membership check"},
                fmt::format("this rank counts {:?}, but {}", mine, differences));
}

// Group rank 0's `proposal` installed everywhere: the plan every rank uses from the next iteration.
template <TransportPolicy X>
BucketPlan agree_on_plan(ControlChannel<X>& control, std::uint64_t iteration, const BucketPlan& proposal) {
  const Group& group = control.group();
  const std::string text = group.rank == 0 ? encode_plan(proposal) : std::string();
  return decode_plan(control.broadcast(iteration, ControlMessage::plan, text),
                     {.rank = group.members[group.rank], .peer = group.members[0], .operation = "plan agreement"});
}

}  // namespace gradsync::engine
