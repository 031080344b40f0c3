#pragma once
// engine::CoordinatorChannel — one rank's end of coordinated sends (planner.hpp): reports of
// ready pieces, posted receives and finished sends go to the coordinator (group rank 0), grants
// come back; on the coordinator it runs the planner.
//
// A rank reports each finished send back (the planner's links are freed by these reports), and
// the end of each iteration: the coordinator's own iteration ends only when every rank has ended
// its, so that no grant can still be owed to a rank when rank 0 moves on to messages that rank
// does not expect yet.
//
// Served by the task graph's communication thread only. Every rank keeps two report buffers (so
// one report can be written while the previous is on its way); the coordinator keeps one standing
// receive per rank for reports and two grant buffers per rank, and plans for itself without
// messages. Each direction numbers its messages, so a standing receive only ever matches the
// next one. A standing receive that fails (its peer went away) is kept as `lost()`: the task graph
// fails with it as soon as it needs that peer's reports or grants.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/engine/coordinator/planner.hpp"
#include "gradsync/engine/coordinator/wire.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/options.hpp"

namespace gradsync::engine {

template <TransportPolicy X>
class CoordinatorChannel {
 public:
  static constexpr std::uint64_t max_pieces = std::uint64_t{1} << 24;  // per rank and iteration

  // Completions of this channel's requests go to `sink` as id_base + request index.
  CoordinatorChannel(X& transport, const Group& group, Coordination limits, transport::CompletionSink* sink,
                     std::uint64_t id_base)
      : transport_(transport),
        group_(group),
        coordinator_(group.rank == 0),
        planner_(group.size(), limits),
        requests_(coordinator_ ? 3 * static_cast<std::size_t>(group.size()) : 3),
        buffers_(requests_.size()),
        report_seq_(group.size()),
        grant_seq_(group.size()),
        grants_(group.size()),
        grants_head_(group.size()),
        finished_(group.size()) {
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      buffers_[i] = detail::TransportBuffer<X>(
          &transport_,
          incoming_report(i) || outgoing_report(i)
              ? coordinator_wire::message_bytes<coordinator_wire::ReportEntry>(coordinator_wire::max_entries)
              : coordinator_wire::message_bytes<std::uint64_t>(coordinator_wire::max_entries));
      requests_[i].report_to(sink, id_base + i);
    }
    busy_.assign(requests_.size(), 0);
    unreported_.reserve(coordinator_wire::max_entries);
    report_in_.reserve(coordinator_wire::max_entries);
    grant_in_.reserve(coordinator_wire::max_entries);
  }

  // Posts the standing receives. Their completions may be reported at once (a message may be
  // waiting already), so the sink must be ready for requests() completions before this.
  void start() {
    if (coordinator_) {
      for (int peer = 1; peer < group_.size(); ++peer) post_report_receive(peer);
    } else {
      post_grant_receive();
    }
  }

  CoordinatorChannel(const CoordinatorChannel&) = delete;
  CoordinatorChannel& operator=(const CoordinatorChannel&) = delete;

  // Withdraws the standing receives and lets the last messages leave; errors no longer matter.
  ~CoordinatorChannel() {
    const auto soon = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (!busy_[i]) continue;
      try {
        transport_.wait(requests_[i], incoming(i) ? std::chrono::steady_clock::now() : soon);
      } catch (const Error&) {
      }
    }
  }

  std::size_t requests() const noexcept { return requests_.size(); }

  // This rank's events.
  void ready(std::uint64_t task, int destination, std::uint64_t tag, std::size_t bytes) {
    record({coordinator_wire::Event::ready, static_cast<std::uint32_t>(destination), tag, task, bytes});
  }
  void receiving(int source, std::uint64_t tag) {
    record({coordinator_wire::Event::receiving, static_cast<std::uint32_t>(source), tag, 0, 0});
  }
  void sent(int destination) {
    record({coordinator_wire::Event::sent, static_cast<std::uint32_t>(destination), 0, 0, 0});
  }
  void finished() { record({coordinator_wire::Event::finished, 0, 0, 0, 0}); }
  // A new plan sends `pieces[d]` pieces to each group rank d and posts `receives` receives per
  // iteration. An iteration's reports are sized here: ready and sent per piece, receiving per
  // receive (a parameter-server root receives more than it sends), the plan, finished.
  void announce(std::span<const std::size_t> pieces, std::size_t receives) {
    std::size_t total = 0;
    for (std::size_t count : pieces) total += count;
    unreported_.reserve(2 * total + receives + pieces.size() + 1);
    for (std::size_t d = 0; d < pieces.size(); ++d)
      if (pieces[d]) record({coordinator_wire::Event::plan, static_cast<std::uint32_t>(d), 0, total, pieces[d]});
  }

  // Request `index` completed (its transport reported so; the deadline only covers the moment
  // until the transport records it): a report or grant arrived, or one of ours left.
  void completed(std::size_t index, std::vector<std::uint64_t>& granted, std::chrono::milliseconds timeout) {
    try {
      const std::size_t bytes = transport_.wait(requests_[index], std::chrono::steady_clock::now() + timeout);
      busy_[index] = 0;
      if (!incoming(index)) return;
      const std::span<const std::byte> message(buffers_[index].data(), bytes);
      if (coordinator_) {
        const int peer = static_cast<int>(index);
        coordinator_wire::read(message, coordinator_wire::Kind::report, peer, report_in_);
        for (const auto& entry : report_in_) apply(peer, entry);
        post_report_receive(peer);
      } else {
        coordinator_wire::read(message, coordinator_wire::Kind::grant, 0, grant_in_);
        granted.insert(granted.end(), grant_in_.begin(), grant_in_.end());
        post_grant_receive();
      }
    } catch (const Error& e) {
      busy_[index] = 0;
      const int peer = coordinator_ ? (incoming(index) ? static_cast<int>(index) : peer_of_grant(index)) : 0;
      Error located =
          e.filled({.rank = group_.members[group_.rank],
                    .peer = group_.members[peer],
                    .operation = incoming(index) ? (coordinator_ ? "coordinator report" : "coordinator grant")
                                                 : (coordinator_ ? "coordinator grant" : "coordinator report")});
      if (!incoming(index) || e.kind() != ErrorKind::peer_failed) throw located;
      if (!lost_) {
        lost_ = std::move(located);
        lost_peer_ = peer;
      }
    }
  }

  // Sends what is due: this rank's report, or (coordinator) the grants the planner makes now; the
  // coordinator's own grants are appended to `granted`.
  void flush(std::vector<std::uint64_t>& granted) {
    if (coordinator_) {
      planner_.plan([&](int sender, int, std::span<const std::uint64_t> tasks) {
        if (sender == 0)
          granted.insert(granted.end(), tasks.begin(), tasks.end());
        else
          grants_[sender].insert(grants_[sender].end(), tasks.begin(), tasks.end());
      });
      for (int peer = 1; peer < group_.size(); ++peer) send_grants(peer);
    } else {
      send_report();
    }
  }

  // Coordinator: how many iterations every rank has finished.
  std::uint64_t finished_everywhere() const { return *std::min_element(finished_.begin(), finished_.end()); }
  // Coordinator: the first group rank that has finished fewer than `iterations`.
  int first_behind(std::uint64_t iterations) const {
    for (int r = 0; r < group_.size(); ++r)
      if (finished_[r] < iterations) return r;
    return -1;
  }

  // Events recorded but not yet on their way to the coordinator.
  bool reports_pending() const noexcept { return unreported_head_ < unreported_.size(); }

  // Coordinator: iterations group rank `r` has reported finished.
  std::uint64_t finished_by(int r) const { return finished_[r]; }

  // The failure of a standing receive (its peer went away), if any, and that peer's group rank.
  const std::optional<Error>& lost() const noexcept { return lost_; }
  int lost_peer() const noexcept { return lost_peer_; }

  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }
  std::uint64_t messages_sent() const noexcept { return messages_sent_; }

 private:
  // Request layout. Coordinator: [peer] report receive (peer >= 1), [n + 2 peer + k] grant sends.
  // Other ranks: [0], [1] report sends, [2] the grant receive.
  bool incoming(std::size_t i) const noexcept {
    return coordinator_ ? i < static_cast<std::size_t>(group_.size()) : i == 2;
  }
  bool incoming_report(std::size_t i) const noexcept { return coordinator_ && incoming(i); }
  bool outgoing_report(std::size_t i) const noexcept { return !coordinator_ && i < 2; }
  int peer_of_grant(std::size_t i) const noexcept { return static_cast<int>((i - group_.size()) / 2); }

  void record(const coordinator_wire::ReportEntry& entry) {
    if (coordinator_) return apply(0, entry);
    unreported_.push_back(entry);  // reserved by announce() for a whole iteration
  }

  void apply(int sender, const coordinator_wire::ReportEntry& entry) {
    const int peer = static_cast<int>(std::min<std::uint32_t>(entry.peer, static_cast<std::uint32_t>(group_.size())));
    switch (entry.event) {
      case coordinator_wire::Event::ready:
        planner_.ready(sender, peer, entry.tag, static_cast<std::uint32_t>(entry.bytes), entry.task);
        break;
      case coordinator_wire::Event::receiving:
        planner_.receiving(peer, sender, entry.tag);
        break;
      case coordinator_wire::Event::sent:
        planner_.sent(sender, peer);
        break;
      case coordinator_wire::Event::finished:
        ++finished_[sender];
        break;
      case coordinator_wire::Event::plan:
        if (entry.bytes > entry.task || entry.task > max_pieces)
          throw Error(ErrorKind::protocol, {.peer = group_.members[sender], .operation = "coordinator report"},
                      fmt::format("plan of {} pieces to group rank {}, {} in all (at most {})", entry.bytes, peer,
                                  entry.task, max_pieces));
        planner_.expect(sender, peer, entry.bytes);
        grants_[sender].reserve(entry.task);
        break;
      default:
        throw Error(ErrorKind::protocol, {.operation = "coordinator report"},
                    fmt::format("unknown event {}", static_cast<std::uint32_t>(entry.event)));
    }
  }

  void post_report_receive(int peer) {
    busy_[peer] = 1;
    transport_.recv(requests_[peer], group_.members[peer], control_tag(report_seq_[peer]++, ControlMessage::coordinator_report),
                    std::span(buffers_[peer].data(), buffers_[peer].size()));
  }

  void post_grant_receive() {
    busy_[2] = 1;
    transport_.recv(requests_[2], group_.members[0], control_tag(grant_seq_[0]++, ControlMessage::coordinator_grant),
                    std::span(buffers_[2].data(), buffers_[2].size()));
  }

  void send_report() {
    for (std::size_t i = 0; i < 2 && unreported_head_ < unreported_.size(); ++i) {
      if (busy_[i]) continue;
      const std::size_t count = std::min(coordinator_wire::max_entries, unreported_.size() - unreported_head_);
      post(i, 0, control_tag(report_seq_[0]++, ControlMessage::coordinator_report),
           coordinator_wire::write(
               std::span(buffers_[i].data(), buffers_[i].size()), coordinator_wire::Kind::report, group_.rank,
               std::span<const coordinator_wire::ReportEntry>(unreported_).subspan(unreported_head_, count)));
      unreported_head_ += count;
    }
    if (unreported_head_ == unreported_.size()) {
      unreported_.clear();
      unreported_head_ = 0;
    }
  }

  void send_grants(int peer) {
    auto& tasks = grants_[peer];
    std::size_t& head = grants_head_[peer];
    for (std::size_t k = 0; k < 2 && head < tasks.size(); ++k) {
      const std::size_t i = group_.size() + 2 * static_cast<std::size_t>(peer) + k;
      if (busy_[i]) continue;
      const std::size_t count = std::min(coordinator_wire::max_entries, tasks.size() - head);
      post(i, peer, control_tag(grant_seq_[peer]++, ControlMessage::coordinator_grant),
           coordinator_wire::write(std::span(buffers_[i].data(), buffers_[i].size()), coordinator_wire::Kind::grant, 0,
                                   std::span<const std::uint64_t>(tasks).subspan(head, count)));
      head += count;
    }
    if (head == tasks.size()) {
      tasks.clear();
      head = 0;
    }
  }

  void post(std::size_t i, int peer, std::uint64_t message_tag, std::size_t bytes) {
    busy_[i] = 1;
    transport_.send(requests_[i], group_.members[peer], message_tag,
                    std::span<const std::byte>(buffers_[i].data(), bytes));
    bytes_sent_ += bytes;
    ++messages_sent_;
  }

  X& transport_;
  const Group& group_;
  bool coordinator_;
  TransmissionPlanner planner_;  // coordinator only
  std::vector<typename X::Request> requests_;
  std::vector<detail::TransportBuffer<X>> buffers_;
  std::vector<std::uint8_t> busy_;         // request posted and not yet taken
  std::vector<std::uint64_t> report_seq_;  // coordinator: next report expected per peer; others: [0] next sent
  std::vector<std::uint64_t> grant_seq_;   // coordinator: next grant per peer; others: [0] next expected
  std::vector<coordinator_wire::ReportEntry> unreported_;
  std::size_t unreported_head_ = 0;
  std::vector<std::vector<std::uint64_t>> grants_;  // coordinator: granted tasks not yet sent, per peer
  std::vector<std::size_t> grants_head_;
  std::vector<std::uint64_t> finished_;  // coordinator: iterations each rank has finished
  std::vector<coordinator_wire::ReportEntry> report_in_;
  std::vector<std::uint64_t> grant_in_;
  std::optional<Error> lost_;
  int lost_peer_ = -1;
  std::uint64_t bytes_sent_ = 0;
  std::uint64_t messages_sent_ = 0;
};

}  // namespace gradsync::engine
