#pragma once
// async::detail::Worker — the worker role of the asynchronous parameter server: its gradient, cut
// into one part per server (topology::Ring::segment of the whole flat gradient, part p served by
// group rank p), pushed each iteration, and the global gradients pulled back.
//
// An iteration t: once every gradient is ready, each part of the local gradient l_t is encoded and
// pushed to its server, unless a global gradient of iteration t or later has already come for that
// part (t is closed there, and the push would only be dropped: a straggler's pushes, with quorum <
// N). Meanwhile one pull per part stays outstanding, "the global gradients after the last one I
// have"; each reply is decoded into the part's pending sum as it arrives, and the worker pulls
// again at once, unless what is pending already reaches the trainer's current iteration: then it
// pulls again after the next wait(). A worker behind the others thus pulls once an iteration and
// gets every global gradient closed since its last pull in one reply, summed by the server.
//
// wait(t) applies, part by part, every global gradient pulled since the last wait(), summed, plus
// the worker's own l_t standing in for g_t until that arrives (l_t is the worker's best estimate of
// g_t: the same parameters, other samples). When g_t comes with this worker among its
// contributors, a later wait() subtracts the stand-in again, so every global gradient is applied
// exactly once and the worker's own gradient once, inside it or on its own (when t closed without
// it). Once g_t has arrived by wait(t), nothing stands in. A dead server's part adds l_t, never
// taken back. The communication thread runs the pushes and pulls, the trainer apply(), both under
// the synchronizer's lock.
//
// Where this departs from the fourth document, which applies only the newest global gradient not
// yet used and otherwise the local gradient, never taken back: skipped global gradients are lost,
// and a local gradient is counted again inside its global one. Why the stand-in is the whole l_t
// and not its share l_t / M: in the limit where every worker's gradient is the same, the whole
// stand-in applies each step's gradient at once and the global gradient's later correction is
// zero, so the delay is only in the samples' noise; a share applies (M - 1) / M of every step
// `staleness` iterations late, which is what costs accuracy (delayed gradient descent needs a
// smaller learning rate to stay stable). On fmnist (4 emulated hosts, one rank 2x slower,
// staleness 2, quorum 3, batch 128) one epoch's test accuracy ends on average 0.26 points above
// the synchronous server's with the whole stand-in and the epoch's last wait(0) (20 seeds), 1.6
// below without that catch-up (15 seeds), 4.9 below with the share (10 seeds); the newest-only
// rule lost more than the share (examples/fmnist/results/README.md has the runs).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/async/messages.hpp"
#include "gradsync/async/options.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/error.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::async::detail {

template <CompressionPolicy C, TransportPolicy X>
class Worker {
 public:
  Worker(Messages<X>& messages, const C& codec, int staleness, std::size_t elements)
      : m_(messages), codec_(codec), staleness_(staleness) {
    X& transport = m_.transport();
    const auto parts = static_cast<std::size_t>(n());
    std::size_t biggest = 0;
    for (int p = 0; p < n(); ++p) {
      parts_.push_back(topology::Ring::segment(elements, n(), p));
      biggest = std::max(biggest, parts_.back().size());
    }
    const std::size_t encoded = codec_.max_encoded_bytes(biggest, DType::f32);
    for (int p = 0; p < n(); ++p) {
      push_bytes_.emplace_back(&transport, header_bytes + encoded);
      push_states_.push_back(codec_.make_state(parts_[static_cast<std::size_t>(p)].size(), DType::f32));
      reply_bytes_.emplace_back(&transport, reply_header_bytes(static_cast<std::size_t>(kept_globals(n(), staleness))) + encoded);
    }
    flat_.assign(elements, 0.0f);
    pending_flat_.assign(elements, 0.0f);
    stand_ins_.assign(own_ring() * elements, 0.0f);
    own_.assign(own_ring() * parts, {});
    pending_newest_.assign(parts, -1);
    pending_contributors_.assign(parts, 0);
    arrived_newest_.assign(parts, -1);
    applied_.assign(parts, -1);
    pull_min_.assign(parts, 0);
    pulls_sent_.assign(parts, 0);
    pull_outstanding_.assign(parts, 0);
    pushes_encoded_.assign(parts, 0);
    pushes_sent_.assign(parts, 0);
  }

  // The flat gradient: l_t while it is pushed, then what wait() leaves.
  std::span<float> values() noexcept { return flat_; }
  std::size_t biggest_part() const {
    std::size_t biggest = 0;
    for (const ElemRange& part : parts_) biggest = std::max(biggest, part.size());
    return biggest;
  }
  std::size_t part_size(int p) const { return parts_[static_cast<std::size_t>(p)].size(); }
  // Iterations whose pushes have all been encoded.
  std::uint64_t pushed() const noexcept { return pushed_; }
  std::uint64_t skipped_globals() const noexcept { return skipped_; }
  std::uint64_t summed_replies() const noexcept { return summed_received_; }

  // ---- the trainer's side ----

  // Every live part has a global gradient of t - staleness or later, applied or pending.
  bool applicable(std::uint64_t t, int staleness) const {
    const auto oldest = static_cast<std::int64_t>(t) - staleness;
    for (int p = 0; p < n(); ++p)
      if (!m_.dead(p) && arrived_newest_[static_cast<std::size_t>(p)] < oldest) return false;
    return true;
  }

  // What wait(t) leaves in values(), part by part, and its account in `report`.
  void apply(std::uint64_t t, StepReport& report) {
    report.age = 0;
    report.local_parts = 0;
    for (int p = 0; p < n(); ++p) {
      apply_part(p, t, report);
      if (applied_[p] >= 0) report.age = std::max(report.age, static_cast<int>(static_cast<std::int64_t>(t) - applied_[p]));
    }
  }

  // The live parts whose newest global gradient is older than t - staleness, for a timeout's Error.
  std::string too_old(std::uint64_t t, int staleness) const {
    std::string parts;
    for (int p = 0; p < n(); ++p) {
      const std::int64_t have = arrived_newest_[static_cast<std::size_t>(p)];
      if (!m_.dead(p) && have < static_cast<std::int64_t>(t) - staleness)
        parts += fmt::format("{}part {} (server rank {}, newest iteration {})", parts.empty() ? "" : ", ", p,
                             m_.group().members[static_cast<std::size_t>(p)], have);
    }
    return parts;
  }

  // ---- the communication thread's side ----

  void reply_arrived(int p, std::size_t bytes) {
    take_global(p, whole(reply_bytes_[p]).first(bytes));
    pull_outstanding_[p] = 0;
  }
  void pull_failed(int p) { pull_outstanding_[p] = 0; }

  // Once every gradient of the trainer's iteration t is ready: copies them out (`pack` into the
  // flat gradient), and encodes and sends each part as soon as its previous push has left.
  template <class Pack>
  void push_due(std::uint64_t t, Pack&& pack) {
    if (pushed_ > t) return;
    if (!copied_) {
      pack(std::span(flat_));
      copied_ = true;
    }
    bool all = true;
    for (int p = 0; p < n(); ++p) {
      if (pushes_encoded_[p] > t) continue;
      // A dead server takes nothing; nor does one that has closed iteration t already.
      if (m_.dead(p) || arrived_newest_[p] >= static_cast<std::int64_t>(t)) {
        pushes_encoded_[p] = t + 1;
        continue;
      }
      if (m_.posted(push_sent, p)) {
        all = false;
        continue;
      }
      const std::span<std::byte> out = whole(push_bytes_[p]);
      const std::int64_t encoding = m_.trace_start();
      const std::size_t bytes =
          header_bytes + codec_.encode(std::span<const float>(flat_part(p)), push_states_[p], out.subspan(header_bytes));
      m_.trace_compute(Timeline::Kind::encode, encoding, p, parts_[p].size());
      std::memcpy(out.data(), &t, 8);
      std::memset(out.data() + 8, 0, 8);
      pushes_encoded_[p] = t + 1;
      m_.post(push_sent, p, true, push, pushes_sent_[p]++, out.first(bytes));
    }
    if (!all) return;
    copied_ = false;
    pushed_ = t + 1;  // flat_ is the trainer's again
  }

  // Keeps one pull of part p outstanding, "the global gradients after the last one I have", while
  // what is pending does not reach the trainer's iteration yet.
  void refill_pull(int p, std::uint64_t iteration) {
    if (m_.dead(p) || pull_outstanding_[p] || m_.posted(pull_sent, p) || m_.posted(reply_received, p)) return;
    if (pending_newest_[p] >= static_cast<std::int64_t>(iteration)) return;  // pulled again after wait()
    pull_outstanding_[p] = 1;
    pull_min_[p] = static_cast<std::uint64_t>(arrived_newest_[p] + 1);
    const std::uint64_t sequence = pulls_sent_[p]++;
    m_.post(reply_received, p, false, reply, sequence, whole(reply_bytes_[p]));
    m_.post(pull_sent, p, true, pull, sequence, std::as_writable_bytes(std::span(&pull_min_[p], 1)));
  }

  // Global gradients of part p have come, one or several summed: decoded into the part's pending
  // sum at once, and for each that has this worker in it, the worker's stand-in for that iteration
  // taken back (or not applied at all, if wait() has not come to that iteration yet).
  void take_global(int p, std::span<const std::byte> message) {
    const ErrorContext from{.rank = m_.transport().rank(), .peer = m_.group().members[static_cast<std::size_t>(p)], .operation = "pull"};
    std::uint64_t t = 0, count = 0;
    if (message.size() >= header_bytes) {
      std::memcpy(&t, message.data(), 8);
      std::memcpy(&count, message.data() + 8, 8);
    }
    if (message.size() < header_bytes || count == 0 || count > static_cast<std::uint64_t>(kept_globals(n(), staleness_)) ||
        message.size() < reply_header_bytes(count))
      throw Error(ErrorKind::protocol, from,
                  fmt::format("a reply of {} bytes whose header says {} global gradients (1 to {})", message.size(),
                              count, kept_globals(n(), staleness_)));
    const auto newest = static_cast<std::int64_t>(t);
    const std::int64_t oldest = newest - static_cast<std::int64_t>(count) + 1;
    if (oldest <= arrived_newest_[p])
      throw Error(ErrorKind::protocol, from,
                  fmt::format("global gradients of iterations {} to {} after {}: the server must answer with newer ones",
                              oldest, newest, arrived_newest_[p]));
    skipped_ += static_cast<std::uint64_t>(oldest - arrived_newest_[p] - 1);
    if (count > 1) ++summed_received_;
    arrived_newest_[p] = newest;
    const std::span<float> pending = pending_part(p);
    const std::int64_t decoding = m_.trace_start();
    codec_.decode(message.subspan(reply_header_bytes(count)), pending,
                  pending_newest_[p] < 0 ? DecodeMode::overwrite : DecodeMode::add);
    m_.trace_compute(Timeline::Kind::decode, decoding, p, pending.size());
    pending_newest_[p] = newest;
    for (std::int64_t iteration = oldest; iteration <= newest; ++iteration) {
      std::uint64_t contributors;
      std::memcpy(&contributors, message.data() + 16 + 8 * (iteration - oldest), 8);
      pending_contributors_[p] = contributors;
      if (!(contributors >> m_.group().rank & 1)) continue;  // this worker's own gradient of it is not in it
      OwnEntry& own = own_entry(static_cast<std::uint64_t>(iteration), p);
      if (own.iteration == iteration && own.state == Own::stood_in) {
        const std::span<const float> stand_in = stand_in_part(static_cast<std::uint64_t>(iteration), p);
        for (std::size_t e = 0; e < pending.size(); ++e) pending[e] -= stand_in[e];
        own.state = Own::settled;
      } else if (own.iteration < iteration) {
        own = {.iteration = iteration, .state = Own::in_global};
      }
    }
  }

 private:
  // How the worker's own gradient of iteration t enters its updates, part by part (the top of this
  // file): kept for the last staleness + 1 iterations, entry t % (staleness + 1).
  enum class Own : std::uint8_t {
    waiting,    // wait(t) has not come yet, nor a global gradient of t with this worker in it
    in_global,  // g_t with this worker in it came first: wait(t) adds nothing of its own
    stood_in,   // wait(t) applied a stand-in (kept in stand_ins_); g_t, if it has this worker in it, takes it back
    settled,    // stood in, and then taken back
  };
  struct OwnEntry {
    std::int64_t iteration = -1;
    Own state = Own::waiting;
  };

  int n() const noexcept { return m_.group().size(); }
  std::span<float> flat_part(int p) { return std::span(flat_).subspan(parts_[p].begin, parts_[p].size()); }
  std::span<float> pending_part(int p) { return std::span(pending_flat_).subspan(parts_[p].begin, parts_[p].size()); }
  std::size_t own_ring() const { return static_cast<std::size_t>(staleness_) + 1; }
  OwnEntry& own_entry(std::uint64_t t, int p) {
    return own_[(t % own_ring()) * static_cast<std::size_t>(n()) + static_cast<std::size_t>(p)];
  }
  std::span<float> stand_in_part(std::uint64_t t, int p) {
    return std::span(stand_ins_).subspan((t % own_ring()) * flat_.size() + parts_[p].begin, parts_[p].size());
  }

  // Part p of what wait(t) leaves (flat_ holds l_t): the pending global gradients, summed, and the
  // stand-in l_t for g_t unless g_t with this worker in it came first; a dead server's part adds
  // l_t too, never taken back, with nobody else to average with.
  void apply_part(int p, std::uint64_t t, StepReport& report) {
    const std::span<float> out = flat_part(p);
    const std::span<const float> pending = pending_part(p);
    const bool has_pending = pending_newest_[p] >= 0;
    report.applied[p] = pending_newest_[p];
    report.contributors[p] = has_pending ? pending_contributors_[p] : 0;
    if (has_pending) applied_[p] = pending_newest_[p];
    pending_newest_[p] = -1;
    if (m_.dead(p)) {
      ++report.local_parts;
      if (has_pending)
        for (std::size_t e = 0; e < out.size(); ++e) out[e] += pending[e];
      return;
    }
    OwnEntry& own = own_entry(t, p);
    if (own.iteration == static_cast<std::int64_t>(t) && own.state == Own::in_global) {
      if (has_pending)
        std::copy(pending.begin(), pending.end(), out.begin());  // exactly the global gradients' bits
      else
        std::fill(out.begin(), out.end(), 0.0f);
      return;
    }
    ++report.local_parts;
    const std::span<float> stand_in = stand_in_part(t, p);
    std::copy(out.begin(), out.end(), stand_in.begin());
    own = {.iteration = static_cast<std::int64_t>(t), .state = Own::stood_in};
    if (has_pending)
      for (std::size_t e = 0; e < out.size(); ++e) out[e] += pending[e];
  }

  Messages<X>& m_;
  C codec_;
  int staleness_;
  std::vector<float> flat_;  // the gradients, one after another
  std::vector<ElemRange> parts_;
  bool copied_ = false;
  std::uint64_t pushed_ = 0;  // iterations whose pushes have all been encoded
  std::vector<gradsync::detail::TransportBuffer<X>> push_bytes_;
  std::vector<typename C::State> push_states_;
  std::vector<std::uint64_t> pushes_encoded_;
  std::vector<std::uint64_t> pushes_sent_;  // per part: push messages sent (their sequence numbers)
  std::vector<gradsync::detail::TransportBuffer<X>> reply_bytes_;  // per part: where the pulled global gradient lands
  std::vector<std::uint64_t> pull_min_, pulls_sent_;
  std::vector<std::uint8_t> pull_outstanding_;
  std::vector<std::int64_t> arrived_newest_;  // per part: the newest global gradient come, -1 none
  std::vector<float> pending_flat_;  // per part: the global gradients come since the last wait(), summed
  std::vector<std::int64_t> pending_newest_;  // per part: the newest of those, -1 none
  std::vector<std::uint64_t> pending_contributors_;  // per part: its contributors
  std::vector<std::int64_t> applied_;  // per part: the newest global gradient applied, -1 none
  std::vector<OwnEntry> own_;     // (staleness + 1) x N
  std::vector<float> stand_ins_;  // (staleness + 1) x the flat gradient: the stand-ins applied
  std::uint64_t skipped_ = 0;
  std::uint64_t summed_received_ = 0;  // replies that brought several global gradients
};

}  // namespace gradsync::async::detail
