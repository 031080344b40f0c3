#pragma once
// engine::TransmissionPlanner — the coordinator of HiPress's CaSync (seed 001): which queued
// sends may go now. Pure bookkeeping, no I/O; the coordinator's channel (channel.hpp) feeds it
// reports and carries its grants.
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

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/error.hpp"
#include "gradsync/options.hpp"

namespace gradsync::engine {

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

}  // namespace gradsync::engine
