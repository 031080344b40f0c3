#pragma once
// engine::ControlChannel — the one way ranks exchange control messages: the layout check at the
// first synchronization, plan agreement, selective compression's calibration, and whatever the
// next collective agreement needs. (Coordinated sends stream their reports and grants
// asynchronously, on the task graph's thread: engine/coordinator/channel.hpp. Their ids come from
// the same enum, engine/tag.hpp.)
//
// A control message is a length (u64) followed by its payload, each its own transport message,
// so a receiver sizes its buffer from the length, checked against max_bytes before anything is
// allocated. Integers travel in host byte order: the ranks of one job share an architecture. Every
// wait has the channel's timeout; an Error names this rank, the peer and the operation. The
// channel owns the buffers its requests name: if a wait fails, the caller aborts the transport
// while they are still alive.
//
// The collectives are binomial trees rooted at group rank 0 (engine/binomial_tree.hpp), not
// stars: a rank talks to its parent and its children only, at most about log2(n) ranks, so a
// transport that connects ranks on first use never needs a full mesh, and rank 0 handles log2(n)
// messages, not n - 1. gather() packs texts on their way up, broadcast() forwards one text down.
// A packed text is a run of entries, each a u32 rank, a u64 length and that many bytes; every
// header and length is checked against the bytes left before it is read. A collective's messages
// take its own two tags in both directions without being confused: between two ranks of a tree
// the upward messages go from child to parent and the downward ones from parent to child, and a
// transport matches a receive by its sender.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/concepts.hpp"
#include "gradsync/engine/binomial_tree.hpp"
#include "gradsync/engine/tag.hpp"

namespace gradsync::engine {

template <TransportPolicy X>
class ControlChannel {
  using Clock = std::chrono::steady_clock;

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
    const int to = group_.members[peer];
    out_.assign(payload);
    start_send(one_, to, tags(iteration, m), out_);
    if (!finish_send(one_, Clock::now() + timeout_)) throw not_answered({to}, "control send");
  }

  // Receives control message `m` of `iteration` from group rank `peer`; the text stays valid until
  // the next receive.
  std::string_view recv(int peer, std::uint64_t iteration, ControlMessage m) {
    const int from = group_.members[peer];
    const Tags t = tags(iteration, m);
    start_receive(one_, from, t);
    if (!finish_receive(one_, from, t, in_, Clock::now() + timeout_)) throw not_answered({from}, "control recv");
    return in_;
  }

  // Group rank 0: calls on_each(peer, text) with every other rank's `mine`, in group rank order.
  // Each rank receives its children's packed subtrees, checks that each holds exactly the group
  // ranks of that subtree in order, appends them to its own entry and sends the result to its
  // parent: what reaches rank 0 is every rank's text in rank order, whatever order they came in.
  template <class OnEach>
  void gather(std::uint64_t iteration, ControlMessage m, std::string_view mine, OnEach&& on_each) {
    const Tree tree{group_.members, group_.rank, tags(iteration, m)};
    const auto whole_subtree = [&](int child, int from, std::string_view packed) {
      const int end = binomial_tree::subtree_end(child, tree.size());
      int next = child;
      for_each_entry(packed, from, [&](std::uint32_t rank, std::string_view) {
        if (next == end || rank != static_cast<std::uint32_t>(next))
          throw malformed(from, fmt::format("the packed texts of group ranks {} to {} hold group rank {} where {}",
                                            child, end - 1, rank,
                                            next == end ? "they should end" : fmt::format("{} belongs", next)));
        ++next;
      });
      if (next != end)
        throw malformed(from, fmt::format("the packed texts of group ranks {} to {} stop before group rank {}",
                                          child, end - 1, next));
    };
    const auto silent =
        gather_up(tree, static_cast<std::uint32_t>(group_.rank), mine, Clock::now() + timeout_, whole_subtree);
    if (!silent.empty()) throw not_answered(silent, "control gather");
    if (group_.rank != 0) {
      const int parent = tree.rank_at(binomial_tree::parent(group_.rank));
      start_send(one_, parent, tree.tags, pack_);
      if (!finish_send(one_, Clock::now() + timeout_)) throw not_answered({parent}, "control gather");
      return;
    }
    for_each_entry(pack_, self(), [&](std::uint32_t rank, std::string_view text) {
      if (rank != 0) on_each(static_cast<int>(rank), text);
    });
  }

  // Group rank 0's `text` on every rank (others pass anything): each rank receives it from its
  // parent and forwards it to its children. What every rank gets stays valid until the next
  // receive.
  std::string_view broadcast(std::uint64_t iteration, ControlMessage m, std::string_view text) {
    const Tree tree{group_.members, group_.rank, tags(iteration, m)};
    if (group_.rank == 0) {
      in_.assign(text);
    } else {
      const int parent = tree.rank_at(binomial_tree::parent(group_.rank));
      start_receive(one_, parent, tree.tags);
      if (!finish_receive(one_, parent, tree.tags, in_, Clock::now() + timeout_))
        throw not_answered({parent}, "control broadcast");
    }
    if (const auto silent = scatter_down(tree, in_, Clock::now() + timeout_); !silent.empty())
      throw not_answered(silent, "control broadcast");
    return in_;
  }

  // Hands every other member's `mine` to on_each(peer, text), in group order, for the membership
  // check at the first synchronization, while members may still disagree about the group. So the
  // texts go up and back down a tree whose positions are the members sorted by transport rank, not
  // numbered by group rank: members that count the same ranks in another order share one tree and
  // see each other's texts, which is what the check reports. In any such tree a parent has a lower
  // transport rank than its children, so even ranks whose trees differ never take an upward
  // message for a downward one. Members that count different ranks build different trees; a rank
  // learns of it as texts from ranks it does not count, or none from
  // a member (an Error(mismatch) in `what` names them), or as neighbours that never answer: all
  // waits share one deadline, so such a rank ends within the channel's timeout with an
  // Error(mismatch) naming the neighbours it waited for. Nothing stays pending when it throws one:
  // a mismatch does not abort the transport. Once, at the first synchronization: it allocates.
  template <class OnEach>
  void exchange_with_all(std::uint64_t iteration, ControlMessage m, std::string_view mine, std::string_view what,
                         OnEach&& on_each) {
    by_transport_rank_ = group_.members;
    std::ranges::sort(by_transport_rank_);
    const int me = static_cast<int>(std::ranges::lower_bound(by_transport_rank_, self()) - by_transport_rank_.begin());
    const Tree tree{by_transport_rank_, me, tags(iteration, m)};
    const auto deadline = Clock::now() + timeout_;
    // Every rank's text comes up one path only: an entry of a rank seen already, or of no rank of
    // the job, is its sender's error, caught where it arrives.
    std::vector<char> seen(static_cast<std::size_t>(transport_.size()));
    seen[static_cast<std::size_t>(self())] = 1;
    std::vector<int> silent = gather_up(tree, static_cast<std::uint32_t>(self()), mine, deadline,
                                        [&](int, int from, std::string_view packed) {
                                          each_rank_once(packed, from, seen, [](std::uint32_t, std::string_view) {});
                                        });
    int from = self();  // where every member's texts come from
    if (silent.empty() && me != 0) {
      from = tree.rank_at(binomial_tree::parent(me));
      start_send(one_, from, tree.tags, pack_);
      if (finish_send(one_, deadline)) {
        start_receive(one_, from, tree.tags);
        if (!finish_receive(one_, from, tree.tags, in_, deadline)) silent.push_back(from);
      } else {
        silent.push_back(from);
      }
    }
    const std::string_view all = me == 0 ? std::string_view(pack_) : std::string_view(in_);
    if (silent.empty()) silent = scatter_down(tree, all, deadline);
    if (!silent.empty()) {
      std::ranges::sort(silent);
      throw Error(ErrorKind::mismatch, {.rank = self(), .operation = std::string(what)},
                  fmt::format("{} did not answer within {} ms (each a neighbour of this rank in the exchange's "
                              "tree: it counts the members of {:?} otherwise than this rank, waits in vain itself "
                              "for a rank that does, or never got this far)",
                              named(silent), timeout_.count(), group_.name));
    }
    std::vector<std::optional<std::string_view>> texts(seen.size());
    std::ranges::fill(seen, 0);
    each_rank_once(all, from, seen, [&](std::uint32_t rank, std::string_view text) { texts[rank] = text; });
    std::vector<int> missing, strangers;
    for (const int member : group_.members)
      if (!texts[static_cast<std::size_t>(member)]) missing.push_back(member);
    for (std::size_t rank = 0; rank < texts.size(); ++rank)
      if (texts[rank] && !std::ranges::binary_search(by_transport_rank_, static_cast<int>(rank)))
        strangers.push_back(static_cast<int>(rank));
    if (!missing.empty() || !strangers.empty()) {
      std::vector<std::string> found;
      if (!missing.empty())
        found.push_back(fmt::format("no text came from {}: a rank on the way does not count {} in {:?}",
                                    named(missing), missing.size() == 1 ? "it" : "them", group_.name));
      if (!strangers.empty())
        found.push_back(fmt::format("texts came from {}, which this rank does not count in {:?}", named(strangers),
                                    group_.name));
      throw Error(ErrorKind::mismatch, {.rank = self(), .operation = std::string(what)},
                  fmt::format("{}", fmt::join(found, "; ")));
    }
    for (int peer = 0; peer < group_.size(); ++peer)
      if (peer != group_.rank) on_each(peer, *texts[static_cast<std::size_t>(group_.members[peer])]);
  }

  // One timed transfer of `bytes` raw bytes as message `tag`: sent to group rank `to` while as many
  // are received from group rank `from`. The channel's own buffers travel; their contents do not
  // matter.
  void probe(int to, int from, std::uint64_t tag, std::size_t bytes) {
    if (probe_out_.size() < bytes) probe_out_.resize(bytes), probe_in_.resize(bytes);
    const auto deadline = Clock::now() + timeout_;
    transport_.recv(one_.requests[0], group_.members[from], tag, std::span(probe_in_.data(), bytes));
    transport_.send(one_.requests[1], group_.members[to], tag, std::span<const std::byte>(probe_out_.data(), bytes));
    transport_.wait(one_.requests[0], deadline);
    transport_.wait(one_.requests[1], deadline);
  }

 private:
  // A control message's two transport messages: its length and its payload.
  struct Tags {
    std::uint64_t length, payload;
  };
  static Tags tags(std::uint64_t iteration, ControlMessage m) noexcept {
    return {control_tag(iteration, m), control_tag(iteration, m, 1)};
  }

  // A tree collective: the transport rank at each position of the tree, this rank's position, and
  // the tags its messages take.
  struct Tree {
    std::span<const int> ranks;
    int me;
    Tags tags;
    int size() const noexcept { return static_cast<int>(ranks.size()); }
    int rank_at(int position) const noexcept { return ranks[static_cast<std::size_t>(position)]; }
  };

  // One peer's end of a control message in flight: requests[0] carries the length, requests[1]
  // the payload, and `length` is what the first sends or receives.
  struct Link {
    typename X::Request requests[2];
    std::uint64_t length = 0;
  };
  // The most children a rank can have: one per bit of a group size.
  static constexpr int max_children = std::numeric_limits<int>::digits;

  int self() const noexcept { return group_.members[group_.rank]; }

  // Starts sending `text`, which must stay put until both requests complete (a member of the
  // channel), to transport rank `to`.
  void start_send(Link& link, int to, Tags t, std::string_view text) {
    if (text.size() > max_bytes)
      throw Error(ErrorKind::protocol, {.rank = self(), .peer = to, .operation = "control"},
                  fmt::format("a control message of {} bytes is over the channel's limit of {}", text.size(), max_bytes));
    link.length = text.size();
    transport_.send(link.requests[0], to, t.length, std::as_bytes(std::span(&link.length, 1)));
    transport_.send(link.requests[1], to, t.payload, std::as_bytes(std::span(text.data(), text.size())));
  }

  // Waits for a send started on `link`: false if the peer took nothing before `deadline`. Nothing
  // of it stays pending either way: behind a length that timed out, the payload is withdrawn too,
  // or fails with the connection the transport gave up on, which the timeout already says.
  bool finish_send(Link& link, Clock::time_point deadline) {
    if (in_time([&] { transport_.wait(link.requests[0], deadline); }))
      return in_time([&] { transport_.wait(link.requests[1], deadline); });
    try {
      transport_.wait(link.requests[1], deadline);
    } catch (const Error&) {
    }
    return false;
  }

  // Starts receiving a control message's length from transport rank `from`.
  void start_receive(Link& link, int from, Tags t) {
    transport_.recv(link.requests[0], from, t.length, std::as_writable_bytes(std::span(&link.length, 1)));
  }

  // Waits for the length started on `link`, then receives the payload into `into` (a member of
  // the channel): false if `from` sent nothing before `deadline`. The payload follows its length
  // at once; it has a timeout of its own so that a length that came just before the deadline does
  // not fail it.
  bool finish_receive(Link& link, int from, Tags t, std::string& into, Clock::time_point deadline) {
    std::size_t got = 0;
    if (!in_time([&] { got = transport_.wait(link.requests[0], deadline); })) return false;
    if (got != sizeof link.length || link.length > max_bytes)
      throw malformed(from, fmt::format("control message announces {} bytes (limit {})", link.length, max_bytes));
    into.resize(link.length);
    transport_.recv(link.requests[1], from, t.payload, std::as_writable_bytes(std::span(into.data(), into.size())));
    if (!in_time([&] { got = transport_.wait(link.requests[1], Clock::now() + timeout_); })) return false;
    if (got != link.length) throw malformed(from, "control message shorter than announced");
    return true;
  }

  // Runs a wait: false if it passed its deadline (the transport has withdrawn the request or given
  // up its connection), any other failure thrown.
  template <class Wait>
  static bool in_time(Wait&& wait) {
    try {
      wait();
      return true;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::timeout) throw;
      return false;
    }
  }

  // Leaves in pack_ this rank's subtree of `tree`: its own entry (`mine`, numbered `number`), then
  // each child's packed subtree, smallest first, once check(child position, its transport rank,
  // packed) has accepted it. Every child's receive is posted before any is waited for, and every
  // one is waited for; returns the transport ranks of the children that sent nothing before
  // `deadline`.
  template <class Check>
  std::vector<int> gather_up(const Tree& tree, std::uint32_t number, std::string_view mine, Clock::time_point deadline,
                             Check&& check) {
    pack_.clear();
    append_entry(number, mine);
    const int count = binomial_tree::children(tree.me, tree.size());
    for (int i = 0; i < count; ++i)
      start_receive(children_[static_cast<std::size_t>(i)], tree.rank_at(binomial_tree::child(tree.me, i)), tree.tags);
    std::vector<int> silent;
    for (int i = 0; i < count; ++i) {
      const int child = binomial_tree::child(tree.me, i), from = tree.rank_at(child);
      if (!finish_receive(children_[static_cast<std::size_t>(i)], from, tree.tags, in_, deadline)) {
        silent.push_back(from);
        continue;
      }
      check(child, from, std::string_view(in_));
      pack_ += in_;
    }
    return silent;
  }

  // Sends `text` (a member of the channel) to every child in `tree`, the largest subtree first
  // (its last leaf is the furthest away), all posted before any is waited for, and every one waited
  // for; returns the transport ranks of the children that took nothing before `deadline`.
  std::vector<int> scatter_down(const Tree& tree, std::string_view text, Clock::time_point deadline) {
    const int count = binomial_tree::children(tree.me, tree.size());
    const auto to = [&](int i) { return tree.rank_at(binomial_tree::child(tree.me, i)); };
    for (int i = count; i-- > 0;) start_send(children_[static_cast<std::size_t>(i)], to(i), tree.tags, text);
    std::vector<int> silent;
    for (int i = count; i-- > 0;)
      if (!finish_send(children_[static_cast<std::size_t>(i)], deadline)) silent.push_back(to(i));
    return silent;
  }

  void append_entry(std::uint32_t number, std::string_view text) {
    const std::uint64_t length = text.size();
    pack_.append(reinterpret_cast<const char*>(&number), sizeof number);
    pack_.append(reinterpret_cast<const char*>(&length), sizeof length);
    pack_.append(text);
  }

  // Calls on_entry(number, text) for each entry of `packed`, which came from transport rank
  // `from`; every header and length is checked against the bytes left before it is read.
  template <class OnEntry>
  void for_each_entry(std::string_view packed, int from, OnEntry&& on_entry) const {
    while (!packed.empty()) {
      std::uint32_t number = 0;
      std::uint64_t length = 0;
      if (packed.size() < sizeof number + sizeof length)
        throw malformed(from, fmt::format("packed texts end inside an entry's header ({} bytes left)", packed.size()));
      std::memcpy(&number, packed.data(), sizeof number);
      std::memcpy(&length, packed.data() + sizeof number, sizeof length);
      packed.remove_prefix(sizeof number + sizeof length);
      if (length > packed.size())
        throw malformed(from, fmt::format("packed texts: the entry of rank {} announces {} bytes, {} are left", number,
                                          length, packed.size()));
      on_entry(number, packed.substr(0, length));
      packed.remove_prefix(length);
    }
  }

  // for_each_entry, marking each entry's rank in `seen` (indexed by transport rank): an entry of a
  // rank marked already, or of no rank of the job, is malformed.
  template <class OnEntry>
  void each_rank_once(std::string_view packed, int from, std::vector<char>& seen, OnEntry&& on_entry) const {
    for_each_entry(packed, from, [&](std::uint32_t rank, std::string_view text) {
      if (rank >= seen.size() || seen[rank])
        throw malformed(from, fmt::format("packed texts hold rank {} {}", rank,
                                          rank >= seen.size() ? "(not a rank of this job)" : "twice"));
      seen[rank] = 1;
      on_entry(rank, text);
    });
  }

  // "rank 3", "ranks 1, 4"
  static std::string named(const std::vector<int>& ranks) {
    return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
  }

  Error not_answered(std::vector<int> ranks, const char* operation) const {
    std::ranges::sort(ranks);
    return Error(ErrorKind::timeout, {.rank = self(), .peer = ranks.front(), .operation = operation},
                 fmt::format("{} did not answer within {} ms", named(ranks), timeout_.count()));
  }

  Error malformed(int from, std::string why) const {
    return Error(ErrorKind::protocol, {.rank = self(), .peer = from, .operation = "control"}, std::move(why));
  }

  X& transport_;
  const Group& group_;
  std::chrono::milliseconds timeout_;
  Link one_;  // send(), recv(), probe() and a tree's parent
  std::array<Link, max_children> children_;
  std::string out_;   // what send() sends
  std::string in_;    // what the last receive brought
  std::string pack_;  // this rank's packed subtree (gather_up)
  std::vector<int> by_transport_rank_;  // exchange_with_all's tree
  std::vector<std::byte> probe_out_;
  std::vector<std::byte> probe_in_;
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
// group rank 0's; the message says what differs, for every rank that differs. Rank 0's description
// goes down the tree and each rank's difference from it comes back up, empty where there is none:
// gathering the descriptions themselves would bring rank 0's subtrees half the group's layouts in
// one message, over the channel's limit for a large model on a few hundred ranks.
template <TransportPolicy X>
void agree_on_layout(ControlChannel<X>& control, const Layout& layout, std::string_view policies) {
  const Group& group = control.group();
  const std::string mine = describe_layout(layout, policies);
  const std::string difference =
      layout_differences(control.broadcast(0, ControlMessage::layout, mine), mine, group.members[group.rank]);
  std::string verdict;
  control.gather(0, ControlMessage::layout, difference, [&](int, std::string_view theirs) {
    if (!theirs.empty()) verdict += fmt::format("{}{}", verdict.empty() ? "" : "; ", theirs);
  });
  const std::string_view agreed = control.broadcast(0, ControlMessage::verdict, verdict);
  if (!agreed.empty())
    throw Error(ErrorKind::mismatch, {.rank = group.members[group.rank], .operation = "layout check"},
                std::string(agreed));
}

// Stops with Error(mismatch) on every member that disagrees with another about the group's name
// or members, naming both versions. Members that count different ranks cannot share a tree
// (ControlChannel::exchange_with_all): a rank that waits for them in vain names, once the control
// timeout has passed, the neighbours it waited for.
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
