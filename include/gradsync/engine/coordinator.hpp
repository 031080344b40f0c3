#pragma once
// engine::TransmissionPlanner and its wire format — the coordinator of HiPress's CaSync (seed 001).
//
// With coordination on (Options::coordination), a rank does not post a send as soon as the task
// graph makes it ready. It reports the piece — destination, bytes, message tag — to the group's
// coordinator (group rank 0), which keeps one queue per (sender, destination) pair, groups the
// queued pieces of a pair into batches and grants them: a rank posts exactly the sends it was
// granted. Ranks report the receives they post too, and a piece is granted only once its receive
// is posted: a granted transfer then depends on nothing but the network, so it cannot hold a link
// while waiting for its receiver (with transports that deliver only into a posted receive, that
// wait could close a cycle and deadlock). The planner grants a batch only while the sender's
// uplink and the destination's downlink each carry fewer than `window` batches, and among the
// pairs that qualify it serves the one whose oldest grantable piece has waited longest. So no
// receiver is swamped by several senders while another idles, and with a window of 2 a link has
// its next batch granted before the current one ends.
//
// A rank reports each finished send back (the planner's links are freed by these reports), and
// the end of each iteration: the coordinator's own iteration ends only when every rank has ended
// its, so that no grant can still be owed to a rank when rank 0 moves on to messages that rank
// does not expect yet.
//
// Report and grant messages are small (at most `max_entries` entries, a few KiB) and batched: one
// message carries everything that happened on a rank since its previous one. Their layout is
// below; every message is checked for magic, version, kind, sender and length before use.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/options.hpp"

namespace gradsync::engine {

// ---- the planner: pure bookkeeping, no I/O -----------------------------------------------------

class TransmissionPlanner {
 public:
  TransmissionPlanner(int ranks, Coordination limits)
      : ranks_(ranks),
        limits_(limits),
        pairs_(static_cast<std::size_t>(ranks) * ranks),
        uplink_(ranks),
        downlink_(ranks) {
    limits_.window = std::max(1, limits_.window);
  }

  // `sender` will send up to `pieces` pieces to `destination` per iteration of its current plan:
  // the queues are sized for them, so planning allocates nothing afterwards.
  void expect(int sender, int destination, std::size_t pieces) {
    check_pair(sender, destination, "announces pieces");
    Pair& p = pair(sender, destination);
    p.queued.reserve(pieces);
    p.receiving.reserve(pieces);
    p.batches.reserve(pieces);
    batch_.reserve(pieces);
  }

  // `sender` has a piece of `bytes` for `destination`: message `tag`, known to the sender as `task`.
  void ready(int sender, int destination, std::uint64_t tag, std::uint32_t bytes, std::uint64_t task) {
    check_pair(sender, destination, "reports a piece");
    Pair& p = pair(sender, destination);
    const auto posted = std::find(p.receiving.begin(), p.receiving.end(), tag);
    const bool matched = posted != p.receiving.end();
    if (matched) {
      *posted = p.receiving.back();
      p.receiving.pop_back();
    }
    p.queued.push_back({task, tag, bytes, arrivals_++, matched});
    ++queued_;
  }

  // `destination` has posted the receive for message `tag` from `sender`.
  void receiving(int sender, int destination, std::uint64_t tag) {
    check_pair(sender, destination, "reports a receive");
    Pair& p = pair(sender, destination);
    for (std::size_t i = p.head; i < p.queued.size(); ++i)
      if (!p.queued[i].granted && !p.queued[i].receivable && p.queued[i].tag == tag) {
        p.queued[i].receivable = true;
        return;
      }
    p.receiving.push_back(tag);
  }

  // One granted piece from `sender` to `destination` has left; frees the link once its batch has.
  void sent(int sender, int destination) {
    check_pair(sender, destination, "reports a finished send");
    Pair& p = pair(sender, destination);
    if (p.batches_head == p.batches.size())
      throw Error(ErrorKind::protocol, {.peer = sender, .operation = "coordinator"},
                  fmt::format("rank reports a finished send to group rank {} that was never granted", destination));
    if (++p.sent_of_front < p.batches[p.batches_head]) return;
    p.sent_of_front = 0;
    if (++p.batches_head == p.batches.size()) {
      p.batches.clear();
      p.batches_head = 0;
    }
    --uplink_[sender];
    --downlink_[destination];
  }

  // Grants every batch the links allow now: grant(sender, destination, tasks) for each.
  template <class Grant>
  void plan(Grant&& grant) {
    for (;;) {
      Pair* best = nullptr;
      std::size_t best_first = 0;
      int best_sender = 0, best_destination = 0;
      for (int s = 0; s < ranks_; ++s) {
        if (uplink_[s] >= limits_.window) continue;
        for (int d = 0; d < ranks_; ++d) {
          if (downlink_[d] >= limits_.window) continue;
          Pair& p = pair(s, d);
          const std::size_t first = p.first_grantable();
          if (first < p.queued.size() && (!best || p.queued[first].arrival < best->queued[best_first].arrival)) {
            best = &p;
            best_first = first;
            best_sender = s;
            best_destination = d;
          }
        }
      }
      if (!best) return;
      batch_.clear();
      std::size_t bytes = 0;
      for (std::size_t i = best_first; i < best->queued.size() && (batch_.empty() || bytes < limits_.batch_bytes);
           ++i) {
        Piece& piece = best->queued[i];
        if (piece.granted || !piece.receivable) continue;
        piece.granted = true;
        bytes += piece.bytes;
        batch_.push_back(piece.task);
      }
      while (best->head < best->queued.size() && best->queued[best->head].granted) ++best->head;
      if (best->head == best->queued.size()) {
        best->queued.clear();
        best->head = 0;
      }
      queued_ -= batch_.size();
      best->batches.push_back(static_cast<std::uint32_t>(batch_.size()));
      ++uplink_[best_sender];
      ++downlink_[best_destination];
      grant(best_sender, best_destination, std::span<const std::uint64_t>(batch_));
    }
  }

  std::size_t queued() const noexcept { return queued_; }
  int uplink_batches(int rank) const { return uplink_[rank]; }
  int downlink_batches(int rank) const { return downlink_[rank]; }

 private:
  struct Piece {
    std::uint64_t task;
    std::uint64_t tag;
    std::uint32_t bytes;
    std::uint64_t arrival;
    bool receivable;  // its receive is posted: once granted, nothing but the network holds it up
    bool granted = false;
  };
  struct Pair {
    std::vector<Piece> queued;  // reported, oldest first; those before `head` all granted
    std::size_t head = 0;
    std::vector<std::uint64_t> receiving;  // receives posted before their piece was reported
    std::vector<std::uint32_t> batches;    // pieces in each granted batch not yet freed, oldest first
    std::size_t batches_head = 0;
    std::uint32_t sent_of_front = 0;  // finished sends counted towards the oldest batch

    std::size_t first_grantable() const {
      std::size_t i = head;
      while (i < queued.size() && (queued[i].granted || !queued[i].receivable)) ++i;
      return i;
    }
  };

  Pair& pair(int s, int d) { return pairs_[static_cast<std::size_t>(s) * ranks_ + d]; }

  void check_pair(int s, int d, const char* what) const {
    if (s < 0 || s >= ranks_ || d < 0 || d >= ranks_ || s == d)
      throw Error(ErrorKind::protocol, {.peer = s, .operation = "coordinator"},
                  fmt::format("rank {} {} for group rank {} (group of {})", s, what, d, ranks_));
  }

  int ranks_;
  Coordination limits_;
  std::vector<Pair> pairs_;
  std::vector<int> uplink_;    // batches in flight from each rank
  std::vector<int> downlink_;  // batches in flight to each rank
  std::uint64_t arrivals_ = 0;
  std::size_t queued_ = 0;
  std::vector<std::uint64_t> batch_;
};

// ---- the wire ----------------------------------------------------------------------------------
//
// A message is a Header followed by `count` entries: ReportEntry for reports (rank -> coordinator),
// a task id (u64) for grants (coordinator -> rank). Host byte order, as every gradsync message.
namespace coordinator_wire {

inline constexpr std::uint32_t magic = 0x4f435347;  // "GSCO"
inline constexpr std::uint16_t version = 1;
inline constexpr std::size_t max_entries = 256;

enum class Kind : std::uint16_t { report = 1, grant = 2 };
// ready: a piece for `peer` of `bytes`, message `tag`, the sender's `task`; receiving: the sender
// has posted the receive for message `tag` from `peer`; sent: a granted piece to `peer` has left;
// finished: the sender's iteration is over; plan: the sender's new plan sends up to `bytes` pieces
// to `peer` per iteration, `task` pieces to all peers together.
enum class Event : std::uint32_t { ready = 1, receiving = 2, sent = 3, finished = 4, plan = 5 };

struct Header {
  std::uint32_t magic;
  std::uint16_t version;
  Kind kind;
  std::uint32_t sender;  // group rank
  std::uint32_t count;
};

struct ReportEntry {
  Event event;
  std::uint32_t peer;  // group rank
  std::uint64_t tag;
  std::uint64_t task;
  std::uint64_t bytes;
};

static_assert(sizeof(Header) == 16 && sizeof(ReportEntry) == 32);

template <class Entry>
constexpr std::size_t message_bytes(std::size_t entries) {
  return sizeof(Header) + entries * sizeof(Entry);
}

// Writes a message into `out` (sized for max_entries) and returns its length.
template <class Entry>
std::size_t write(std::span<std::byte> out, Kind kind, int sender, std::span<const Entry> entries) {
  const Header header{magic, version, kind, static_cast<std::uint32_t>(sender),
                      static_cast<std::uint32_t>(entries.size())};
  std::memcpy(out.data(), &header, sizeof header);
  if (!entries.empty()) std::memcpy(out.data() + sizeof header, entries.data(), entries.size_bytes());
  return message_bytes<Entry>(entries.size());
}

// Checks a received message from group rank `sender` and copies its entries into `out`.
template <class Entry>
void read(std::span<const std::byte> in, Kind kind, int sender, std::vector<Entry>& out) {
  const auto bad = [&](std::string why) {
    return Error(
        ErrorKind::protocol, {.operation = "coordinator"},
        fmt::format("{} message from group rank {}: {}", kind == Kind::report ? "report" : "grant", sender, why));
  };
  Header header;
  if (in.size() < sizeof header) throw bad(fmt::format("{} bytes, shorter than its header", in.size()));
  std::memcpy(&header, in.data(), sizeof header);
  if (header.magic != magic) throw bad("not a coordinator message");
  if (header.version != version)
    throw bad(fmt::format("wire version {}, this build speaks {}", header.version, version));
  if (header.kind != kind || header.sender != static_cast<std::uint32_t>(sender)) throw bad("wrong kind or sender");
  if (header.count > max_entries || in.size() != message_bytes<Entry>(header.count))
    throw bad(fmt::format("{} entries in {} bytes", header.count, in.size()));
  out.resize(header.count);
  if (header.count) std::memcpy(out.data(), in.data() + sizeof header, header.count * sizeof(Entry));
}

}  // namespace coordinator_wire

// ---- one rank's end of the protocol --------------------------------------------------------------
//
// Served by the task graph's communication thread only. Every rank keeps two report buffers (so
// one report can be written while the previous is on its way); the coordinator keeps one standing
// receive per rank for reports and two grant buffers per rank, and plans for itself without
// messages. Each direction numbers its messages, so a standing receive only ever matches the
// next one. A standing receive that fails (its peer went away) is kept as `lost()`: the task graph
// fails with it as soon as it needs that peer's reports or grants.
template <TransportPolicy X>
class CoordinatorChannel {
 public:
  static constexpr std::uint32_t report_message = 0x80000000u;  // tag message ids, bucket control_bucket
  static constexpr std::uint32_t grant_message = 0x80000001u;
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
      buffers_[i] = detail::AlignedBuffer(
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

  std::uint64_t tag(std::uint32_t message, std::uint64_t seq) const { return make_tag(seq, control_bucket, message); }

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
    transport_.recv(requests_[peer], group_.members[peer], tag(report_message, report_seq_[peer]++),
                    std::span(buffers_[peer].data(), buffers_[peer].size()));
  }

  void post_grant_receive() {
    busy_[2] = 1;
    transport_.recv(requests_[2], group_.members[0], tag(grant_message, grant_seq_[0]++),
                    std::span(buffers_[2].data(), buffers_[2].size()));
  }

  void send_report() {
    for (std::size_t i = 0; i < 2 && unreported_head_ < unreported_.size(); ++i) {
      if (busy_[i]) continue;
      const std::size_t count = std::min(coordinator_wire::max_entries, unreported_.size() - unreported_head_);
      post(i, 0, tag(report_message, report_seq_[0]++),
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
      post(i, peer, tag(grant_message, grant_seq_[peer]++),
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
  std::vector<detail::AlignedBuffer> buffers_;
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
