#pragma once
// async::detail::PartServer — the server role of the asynchronous parameter server: rank p serves
// part p of every worker's gradient (async/parts.hpp says how the gradient is cut).
//
// A worker's push of iteration t comes chunk by chunk, one message per bucket of the plan in plan
// order; once all its chunks are in, it counts as a push of t. The server closes iteration t of
// its part when M = quorum pushes of t have arrived: it sums them in group
// order (as topology::ParameterServer's roots do: an element's sum does not depend on which rank
// serves it), divides by M, encodes the result once and keeps that encoding, with which workers it
// used, for the pulls. It keeps the last kept_globals(N, staleness) for workers that pull behind the
// others; a worker that falls further behind than that gets the oldest one kept (and counts what it
// skipped). A pull that finds several global gradients it asks for gets them in one reply:
// decoded in iteration order, summed, and encoded for that worker (with a lossy codec, under an
// error-feedback state of its own per worker, so what the re-encoding loses reaches the worker in
// its next summed reply), with every iteration's contributors. A push that arrives after its
// iteration closed is counted and dropped. Pushes of one worker arrive in order and a worker cannot
// push iteration t before it has applied a global gradient of iteration t - 1 - staleness or later,
// so iterations close in order and at most staleness + 1 are open at once: the buffers are sized
// for that. Everything here runs on the communication thread.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "gradsync/async/messages.hpp"
#include "gradsync/async/parts.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/detail/transport_buffer.hpp"
#include "gradsync/error.hpp"

namespace gradsync::async::detail {

template <CompressionPolicy C, TransportPolicy X>
class PartServer {
 public:
  // Buffers for any plan of `gradients` gradients holding `elements` values (Parts' bounds); the
  // plan itself comes with install().
  PartServer(Messages<X>& messages, const C& codec, int quorum, int staleness, std::size_t elements,
             std::size_t gradients)
      : m_(messages),
        codec_(codec),
        quorum_(quorum),
        staleness_(staleness),
        part_bound_(Parts::part_bound(elements, gradients, n())),
        window_(static_cast<std::size_t>(staleness) + 2),
        kept_globals_(kept_globals(n(), staleness)) {
    X& transport = m_.transport();
    const auto workers = static_cast<std::size_t>(n());
    const std::size_t pushed = codec_.max_encoded_bytes(Parts::chunk_bound(elements, n()), DType::f32);
    const std::size_t encoded = codec_.max_encoded_bytes(part_bound_, DType::f32);
    for (std::size_t w = 0; w < workers; ++w) {
      received_pushes_.emplace_back(&transport, header_bytes + pushed);
      summed_bytes_.emplace_back(&transport, reply_header_bytes(static_cast<std::size_t>(kept_globals_)) + encoded);
    }
    for (int g = 0; g < kept_globals_; ++g)
      globals_.emplace_back().bytes = gradsync::detail::TransportBuffer<X>(&transport, reply_header_bytes(1) + encoded);
    reply_slots_.reserve(static_cast<std::size_t>(kept_globals_));
    contributions_.assign(window_ * workers * part_bound_, 0.0f);
    arrived_.assign(window_ * workers, 0);
    chunks_arrived_.assign(window_ * workers, 0);
    arrivals_.assign(window_, 0);
    received_pull_.assign(workers, 0);
    pushes_received_.assign(workers, 0);
    pulls_received_.assign(workers, 0);
    replies_sent_.assign(workers, 0);
    parked_.assign(workers, nothing);
    held_.assign(workers, nothing);
    reply_from_.assign(workers, -1);
  }

  // The plan's cut, for pushes of iterations after the last closed one: at the start, and where
  // every worker has every global gradient of the old cut it will ever need (none is kept). The
  // codec's states start afresh.
  void install(const Parts& parts) {
    parts_ = parts;
    own_ = parts_.part_size(m_.group().rank);
    own_buckets_.clear();
    for (std::size_t b = 0; b < parts_.buckets(); ++b)
      if (parts_.chunk(b, m_.group().rank).size > 0) own_buckets_.push_back(b);
    summed_.assign(own_, 0.0f);
    sum_.assign(own_, 0.0f);
    global_state_ = codec_.make_state(own_, DType::f32);
    summed_states_.clear();
    for (int w = 0; w < n(); ++w) summed_states_.push_back(codec_.make_state(own_, DType::f32));
    for (GlobalSlot& g : globals_) g.filled = false;
    hold_.reset();
    for (int w = 0; w < n(); ++w)
      if (held_[w] != nothing) pushed(w, std::exchange(held_[w], nothing));
  }

  // Posts the standing receives of every worker's pushes and pulls.
  void start() {
    for (int w = 0; w < n(); ++w) {
      m_.post(push_received, w, false, push, 0, whole(received_pushes_[w]));
      m_.post(pull_received, w, false, pull, 0, std::as_writable_bytes(std::span(&received_pull_[w], 1)));
    }
  }

  // Worker w's push has arrived: its contribution counts, and the next one is awaited; while a new
  // plan is on its way (hold), a push of a later iteration than the last of the old plan waits,
  // in its buffer, for install().
  void pushed(int w, std::size_t bytes) {
    std::uint64_t t = 0;
    if (bytes >= 8) std::memcpy(&t, received_pushes_[w].data(), 8);
    if (hold_ && t > *hold_) {
      held_[w] = bytes;
      return;
    }
    contribute(w, whole(received_pushes_[w]).first(bytes));
    m_.post(push_received, w, false, push, ++pushes_received_[w], whole(received_pushes_[w]));
  }

  // Iteration t is the old plan's last: pushes of later ones wait for install().
  void hold(std::uint64_t t) { hold_ = t; }

  // Worker w's pull has arrived: parked until answer_pull() can answer it.
  void pulled(int w, std::size_t bytes) {
    m_.expect_bytes(w, "pull", bytes, sizeof received_pull_[w]);
    parked_[w] = received_pull_[w];
    m_.post(pull_received, w, false, pull, ++pulls_received_[w], std::as_writable_bytes(std::span(&received_pull_[w], 1)));
  }

  // Worker w is dead: nothing is answered to it any more.
  void forget(int w) { parked_[w] = nothing; }

  std::uint64_t dropped_pushes() const noexcept { return dropped_; }

  // Answers worker w's parked pull, once there is a global gradient kept of the iterations it asks
  // for and no earlier reply to w is still on its way: with that one's encoding if it is the only
  // one, else with all of them summed (the top of this file).
  void answer_pull(int w) {
    if (m_.dead(w) || parked_[w] == nothing || reply_from_[w] != -1 || m_.posted(reply_sent, w)) return;
    reply_slots_.clear();
    for (auto& g : globals_)
      if (g.filled && g.iteration >= parked_[w]) reply_slots_.push_back(&g);
    if (reply_slots_.empty()) return;
    parked_[w] = nothing;
    // The newest run of consecutive iterations: a slot a slow reply still read was kept while a
    // newer one was reused, and what lies before that gap the worker counts as skipped.
    std::sort(reply_slots_.begin(), reply_slots_.end(),
              [](const GlobalSlot* a, const GlobalSlot* b) { return a->iteration < b->iteration; });
    auto first = reply_slots_.end() - 1;
    while (first != reply_slots_.begin() && (*(first - 1))->iteration + 1 == (*first)->iteration) --first;
    reply_slots_.erase(reply_slots_.begin(), first);
    if (reply_slots_.size() == 1) {
      GlobalSlot& g = *reply_slots_.front();
      m_.post(reply_sent, w, true, reply, replies_sent_[w]++, whole(g.bytes).first(g.size));
      if (!m_.posted(reply_sent, w)) return;  // w was found dead: nothing reads the slot
      ++g.readers;
      reply_from_[w] = static_cast<int>(&g - globals_.data());
      return;
    }
    const std::span<std::byte> out = whole(summed_bytes_[w]);
    const std::uint64_t newest = reply_slots_.back()->iteration, count = reply_slots_.size();
    std::memcpy(out.data(), &newest, 8);
    std::memcpy(out.data() + 8, &count, 8);
    const std::int64_t summing = m_.trace_start();
    for (std::size_t i = 0; i < reply_slots_.size(); ++i) {
      const GlobalSlot& g = *reply_slots_[i];
      std::memcpy(out.data() + 16 + 8 * i, whole(g.bytes).data() + 16, 8);  // its contributors
      codec_.decode(whole(g.bytes).first(g.size).subspan(reply_header_bytes(1)), std::span(summed_),
                    i == 0 ? DecodeMode::overwrite : DecodeMode::add);
    }
    m_.trace_compute(Timeline::Kind::decode, summing, m_.group().rank, summed_.size() * count);
    const std::int64_t encoding = m_.trace_start();
    const std::size_t size =
        reply_header_bytes(count) + codec_.encode(std::span<const float>(summed_), summed_states_[w],
                                                  out.subspan(reply_header_bytes(count)));
    m_.trace_compute(Timeline::Kind::encode, encoding, m_.group().rank, summed_.size());
    m_.post(reply_sent, w, true, reply, replies_sent_[w]++, out.first(size));
    if (m_.posted(reply_sent, w)) reply_from_[w] = summed_reply;
  }

  // Worker w's reply has left (or failed): what it read is free again.
  void reply_left(int w) {
    if (reply_from_[w] >= 0) --globals_[static_cast<std::size_t>(reply_from_[w])].readers;
    reply_from_[w] = -1;
  }

 private:
  void contribute(int worker, std::span<const std::byte> message) {
    const ErrorContext from{.rank = m_.transport().rank(), .peer = m_.group().members[static_cast<std::size_t>(worker)], .operation = "push"};
    if (message.size() < header_bytes)
      throw Error(ErrorKind::protocol, from, fmt::format("a push of {} bytes has no header", message.size()));
    std::uint64_t t, bucket;
    std::memcpy(&t, message.data(), 8);
    std::memcpy(&bucket, message.data() + 8, 8);
    const auto next = static_cast<std::uint64_t>(closed_ + 1);
    if (t < next) {
      ++dropped_;  // its iteration closed without it
      return;
    }
    if (t >= next + window_)
      throw Error(ErrorKind::protocol, from,
                  fmt::format("iteration {} pushed while the oldest open one is {}: beyond staleness {}", t, next,
                              staleness_));
    const std::size_t at = (t % window_) * static_cast<std::size_t>(n()) + static_cast<std::size_t>(worker);
    const std::uint32_t have = chunks_arrived_[at];
    // A worker's chunks of one iteration come in plan order, the empty ones left out.
    if (have >= own_buckets_.size() || bucket != own_buckets_[have])
      throw Error(ErrorKind::protocol, {.rank = from.rank, .peer = from.peer, .bucket = static_cast<std::uint32_t>(bucket), .operation = "push"},
                  fmt::format("iteration {}: a chunk of bucket {} where bucket {} was due", t, bucket,
                              have < own_buckets_.size() ? fmt::format("{}", own_buckets_[have]) : "none"));
    const Chunk& chunk = parts_.chunk(bucket, m_.group().rank);
    const std::int64_t decoding = m_.trace_start();
    codec_.decode(message.subspan(header_bytes), std::span(contributions_).subspan(at * part_bound_ + chunk.in_part, chunk.size),
                  DecodeMode::overwrite);
    m_.trace_compute(Timeline::Kind::decode, decoding, m_.group().rank, chunk.size);
    if (++chunks_arrived_[at] < own_buckets_.size()) return;
    arrived_[at] = 1;
    ++arrivals_[t % window_];
    // Iterations close in order: a worker's pushes arrive in order, so a later iteration never
    // reaches the quorum before an earlier one.
    while (arrivals_[static_cast<std::size_t>(closed_ + 1) % window_] >= static_cast<std::uint32_t>(quorum_))
      close(static_cast<std::uint64_t>(closed_ + 1));
  }

  // Iteration t's global gradient of the served part: the first `quorum` pushes to arrive, summed
  // in group order (as topology::ParameterServer's roots do), divided by the quorum, encoded once.
  void close(std::uint64_t t) {
    const std::size_t own = own_;
    const std::size_t base = (t % window_) * static_cast<std::size_t>(n());
    std::uint64_t used = 0;
    int taken = 0;
    const auto take = [&](int w) {
      const std::size_t at = base + static_cast<std::size_t>(w);
      if (!arrived_[at] || taken == quorum_) return;
      const float* values = contributions_.data() + at * part_bound_;
      if (taken == 0)
        std::copy_n(values, own, sum_.begin());
      else
        for (std::size_t e = 0; e < own; ++e) sum_[e] += values[e];
      used |= std::uint64_t{1} << w;
      ++taken;
    };
    for (int w = 0; w < n(); ++w) take(w);
    const auto divisor = static_cast<float>(quorum_);
    for (float& v : sum_) v /= divisor;
    // The oldest slot no reply reads: at most N replies are in flight, and there are more slots.
    GlobalSlot* global = nullptr;
    for (auto& g : globals_)
      if (g.readers == 0 && (!global || (global->filled && (!g.filled || g.iteration < global->iteration)))) global = &g;
    const std::span<std::byte> out = whole(global->bytes);
    const std::uint64_t one = 1;
    std::memcpy(out.data(), &t, 8);
    std::memcpy(out.data() + 8, &one, 8);
    std::memcpy(out.data() + 16, &used, 8);
    const std::int64_t encoding = m_.trace_start();
    global->size = reply_header_bytes(1) +
                   codec_.encode(std::span<const float>(sum_), global_state_, out.subspan(reply_header_bytes(1)));
    m_.trace_compute(Timeline::Kind::encode, encoding, m_.group().rank, own);
    global->iteration = t;
    global->filled = true;
    std::fill_n(arrived_.begin() + static_cast<std::ptrdiff_t>(base), n(), std::uint8_t{0});
    std::fill_n(chunks_arrived_.begin() + static_cast<std::ptrdiff_t>(base), n(), std::uint32_t{0});
    arrivals_[t % window_] = 0;
    closed_ = static_cast<std::int64_t>(t);
  }

  static constexpr int summed_reply = -2;  // reply_from_: the reply in flight reads summed_bytes_

  // A closed iteration's global gradient of the served part, with the replies still reading it.
  struct GlobalSlot {
    gradsync::detail::TransportBuffer<X> bytes;
    std::size_t size = 0;
    std::uint64_t iteration = 0;
    bool filled = false;
    int readers = 0;
  };

  int n() const noexcept { return m_.group().size(); }

  Messages<X>& m_;
  C codec_;
  int quorum_;
  int staleness_;
  std::size_t part_bound_;  // the most values a served part can hold (Parts::part_bound)
  std::size_t window_;      // iterations that can be open at once, and one more
  Parts parts_;
  std::size_t own_ = 0;                  // values of the served part
  std::vector<std::size_t> own_buckets_;  // the buckets whose chunk here is not empty, in plan order
  int kept_globals_;
  std::vector<gradsync::detail::TransportBuffer<X>> received_pushes_;  // per worker
  std::vector<std::uint64_t> received_pull_, pushes_received_, pulls_received_, replies_sent_;
  std::vector<std::uint64_t> parked_;  // per worker: the oldest iteration its unanswered pull takes
  std::optional<std::uint64_t> hold_;  // the old plan's last iteration, while a new one is on its way
  std::vector<std::size_t> held_;      // per worker: the bytes of its push held for install(), or nothing
  std::vector<int> reply_from_;        // per worker: the global slot its reply in flight reads
  std::vector<float> contributions_;   // window x N pushes, decoded (part_bound_ values each)
  std::vector<std::uint32_t> chunks_arrived_;  // window x N: chunks of that push in so far
  std::vector<std::uint8_t> arrived_;          // window x N: all of them
  std::vector<std::uint32_t> arrivals_;
  std::vector<float> sum_;
  typename C::State global_state_{};
  std::vector<GlobalSlot> globals_;
  std::vector<GlobalSlot*> reply_slots_;  // answer_pull()'s: the kept global gradients a pull asks for
  std::vector<gradsync::detail::TransportBuffer<X>> summed_bytes_;  // per worker: its summed reply
  std::vector<typename C::State> summed_states_;                    // per worker: the encoding of its summed replies
  std::vector<float> summed_;
  std::int64_t closed_ = -1;
  std::uint64_t dropped_ = 0;
};

}  // namespace gradsync::async::detail
