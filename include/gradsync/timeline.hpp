#pragma once
// Timeline — what one rank's Synchronizer did and when, as Chrome trace events: open the file in
// Perfetto (ui.perfetto.dev) or chrome://tracing to see which transfers overlapped which encodes
// and how much of backward each bucket's averaging hid under, as Horovod's timeline shows it.
//
// Turned on by Options::timeline, or by the environment variable GRADSYNC_TIMELINE=PATH; each
// rank writes PATH with ".<rank>" inserted before ".json" (trace.json: trace.0.json,
// trace.1.json, ...) when its Synchronizer is destroyed (async::Synchronizer: ".<rank>.async",
// its messages as transfers; async/synchronizer.hpp). Events, with the track they go on:
//   ready        an instant, per gradient marked ready (the caller's thread)
//   wait         wait()'s time, the iteration in args (the caller's thread)
//   bucket b     from the bucket's packing to its averages written back (async track "buckets")
//   encode, decode, average   each schedule step, with bucket and elements (the thread that ran it)
//   send to P / recv from P   from posting to completion, with bucket and bytes (async tracks)
//   allreduce    a bucket summed by the transport's own allreduce (Options::native_allreduce),
//                with its bytes (async track "transfers")
//   hand-off: Q  work one thread queued for another, from its queuing to its taking, on the taking
//                thread's track, with its bucket: Q names the way it went (Timeline::Queue). Work a
//                thread queues for itself is no hand-off and not recorded.
// Each thread's track is named by what it recorded: "trainer" (ready, wait), "gradsync compute"
// (encode, decode, average), "gradsync communication" (transfers), or both, with its number.
// Recording writes one preallocated slot (an atomic increment and a few stores); nothing is
// allocated or formatted until the file is written. Past `capacity` events the rest are counted,
// not kept, and the file says how many were dropped. Times are the machine's monotonic clock
// (steady_clock: CLOCK_MONOTONIC on Linux), so the files of ranks on one machine line up and can
// be merged into one trace (their traceEvents concatenated; each rank is its own process, pid =
// rank); ranks on different machines have different clocks.

#include <cctype>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync {

class Timeline {
 public:
  enum class Kind : std::uint8_t { ready, wait, bucket, encode, decode, average, send, recv, allreduce, handoff };
  // The ways work goes from one thread to another (Kind::handoff's detail):
  //   synchronizer    a bucket's last gradient marked ready -> the serial walk's thread packs it
  //                   (on the task graph the ready() that completes a bucket starts it itself)
  //   compute         a task -> a task graph compute thread
  //   communication   a transfer (or a task the communication thread runs) -> that thread
  //   completion      a transfer the transport's thread finished -> the communication thread
  //   waiter          the engine's last step -> the thread waiting for the iteration
  enum class Queue : std::uint8_t { synchronizer, compute, communication, completion, waiter };
  static constexpr std::size_t max_capacity = std::size_t{1} << 27;  // 5 GiB of events: a setting's bound

  Timeline(std::string path, int rank, std::size_t capacity)
      : path_(std::move(path)), rank_(rank), events_(capacity) {}

  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // The file a rank writes for PATH: ".<tag>" before a final ".json", else ".<tag>.json" appended.
  // The tag is the rank, and the group's name after it for a Synchronizer of a group other than
  // the world (two Synchronizers of one process must not write one file).
  static std::string rank_path(std::string_view path, std::string_view tag) {
    constexpr std::string_view suffix = ".json";
    if (path.ends_with(suffix)) path.remove_suffix(suffix.size());
    return fmt::format("{}.{}.json", path, tag);
  }

  // The tag of `rank`'s file: the rank, then the group's name (letters, digits and dots; anything
  // else a dash) for a group other than the world.
  static std::string rank_tag(int rank, std::string_view group) {
    std::string tag = std::to_string(rank);
    if (group != "world") {
      tag += '.';
      for (const char c : group) tag += std::isalnum(static_cast<unsigned char>(c)) || c == '.' ? c : '-';
    }
    return tag;
  }

  // Nanoseconds on the machine's monotonic clock.
  static std::int64_t now() noexcept { return at(Clock::now()); }
  static std::int64_t at(std::chrono::steady_clock::time_point t) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }

  // Work queued at `queued` for `queue`, taken now by this thread.
  void handed_off(Queue queue, std::chrono::steady_clock::time_point queued, std::uint32_t bucket) noexcept {
    record(Kind::handoff, at(queued), bucket, static_cast<std::uint64_t>(queue));
  }

  // One event from `start` (now(), taken when it began) to now. `detail`: the gradient id
  // (ready), the iteration (wait), the elements (compute steps), the bytes (transfers) or the
  // Queue (hand-offs); `peer`: the peer's transport rank for a transfer.
  void record(Kind kind, std::int64_t start, std::uint32_t bucket = 0, std::uint64_t detail = 0,
              std::int32_t peer = -1) noexcept {
    const std::size_t at = next_.fetch_add(1, std::memory_order_relaxed);
    if (at >= events_.size()) return;  // counted by next_, reported as dropped
    Event& e = events_[at];
    e.start = start;
    e.end = kind == Kind::ready ? start : now();
    e.detail = detail;
    e.bucket = bucket;
    e.peer = peer;
    e.lane = lane();
    e.kind = kind;
    e.recorded.store(true, std::memory_order_release);
  }

  // Names the gradients (by GradId) for ready events; call before any is recorded.
  void name_gradients(std::vector<std::string> names) { gradient_names_ = std::move(names); }

  std::size_t recorded() const noexcept { return std::min(next_.load(), events_.size()); }
  std::size_t dropped() const noexcept { return next_.load() - recorded(); }
  const std::string& path() const noexcept { return path_; }

  // Writes the Chrome trace (a JSON object with traceEvents). Call once no event is being recorded.
  void write() const {
    fmt::memory_buffer out;
    fmt::format_to(std::back_inserter(out), "{{\"displayTimeUnit\":\"ms\",\"otherData\":{{\"rank\":{},\"dropped\":{}}},"
                                            "\"traceEvents\":[\n",
                   rank_, dropped());
    fmt::format_to(std::back_inserter(out),
                   "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{0},\"tid\":0,\"args\":{{\"name\":\"rank {0}\"}}}}",
                   rank_);
    const std::size_t n = recorded();
    write_thread_names(out, n);
    for (std::size_t i = 0; i < n; ++i) {
      const Event& e = events_[i];
      if (!e.recorded.load(std::memory_order_acquire)) continue;
      const double ts = static_cast<double>(e.start) / 1e3, dur = static_cast<double>(e.end - e.start) / 1e3;
      switch (e.kind) {
        case Kind::ready:
          fmt::format_to(std::back_inserter(out),
                         ",\n{{\"ph\":\"i\",\"s\":\"t\",\"name\":\"ready\",\"cat\":\"gradsync\",\"pid\":{},\"tid\":{},"
                         "\"ts\":{:.3f},\"args\":{{\"gradient\":\"{}\"}}}}",
                         rank_, e.lane, ts, escaped(gradient_name(e.detail)));
          break;
        case Kind::wait:
          fmt::format_to(std::back_inserter(out),
                         ",\n{{\"ph\":\"X\",\"name\":\"wait\",\"cat\":\"gradsync\",\"pid\":{},\"tid\":{},\"ts\":{:.3f},"
                         "\"dur\":{:.3f},\"args\":{{\"iteration\":{}}}}}",
                         rank_, e.lane, ts, dur, e.detail);
          break;
        case Kind::encode:
        case Kind::decode:
        case Kind::average:
          fmt::format_to(std::back_inserter(out),
                         ",\n{{\"ph\":\"X\",\"name\":\"{}\",\"cat\":\"gradsync\",\"pid\":{},\"tid\":{},\"ts\":{:.3f},"
                         "\"dur\":{:.3f},\"args\":{{\"bucket\":{},\"elements\":{}}}}}",
                         name(e.kind), rank_, e.lane, ts, dur, e.bucket, e.detail);
          break;
        case Kind::handoff:
          fmt::format_to(std::back_inserter(out),
                         ",\n{{\"ph\":\"X\",\"name\":\"hand-off: {}\",\"cat\":\"gradsync\",\"pid\":{},\"tid\":{},"
                         "\"ts\":{:.3f},\"dur\":{:.3f},\"args\":{{\"bucket\":{},\"queue\":\"{}\"}}}}",
                         queue_name(e.detail), rank_, e.lane, ts, dur, e.bucket, queue_name(e.detail));
          break;
        case Kind::bucket:
        case Kind::send:
        case Kind::recv:
        case Kind::allreduce: {
          // Async begin/end pairs: transfers and buckets overlap one another, which slices on one
          // thread's track may not.
          const std::string label = e.kind == Kind::bucket      ? fmt::format("bucket {}", e.bucket)
                                    : e.kind == Kind::send      ? fmt::format("send to {}", e.peer)
                                    : e.kind == Kind::recv      ? fmt::format("recv from {}", e.peer)
                                                                : std::string("allreduce");
          const std::string_view category = e.kind == Kind::bucket ? "buckets" : "transfers";
          for (const auto& [phase, at] : {std::pair{'b', ts}, std::pair{'e', ts + dur}})
            fmt::format_to(std::back_inserter(out),
                           ",\n{{\"ph\":\"{}\",\"name\":\"{}\",\"cat\":\"{}\",\"id\":{},\"pid\":{},\"tid\":{},"
                           "\"ts\":{:.3f},\"args\":{{\"bucket\":{},\"bytes\":{}}}}}",
                           phase, label, category, i, rank_, e.lane, at, e.bucket,
                           e.kind == Kind::bucket ? 0 : e.detail);
          break;
        }
      }
    }
    fmt::format_to(std::back_inserter(out), "\n]}}\n");
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path_.c_str(), "wb"), &std::fclose);
    if (!file || std::fwrite(out.data(), 1, out.size(), file.get()) != out.size())
      throw Error(ErrorKind::internal, {.rank = rank_, .operation = "timeline"},
                  fmt::format("could not write the timeline to {:?}", path_));
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Event {
    std::int64_t start = 0, end = 0;  // ns on the monotonic clock
    std::uint64_t detail = 0;
    std::uint32_t bucket = 0;
    std::int32_t peer = -1;
    std::uint32_t lane = 0;
    Kind kind = Kind::ready;
    std::atomic<bool> recorded{false};
  };

  static std::string_view name(Kind kind) noexcept {
    switch (kind) {
      case Kind::ready: return "ready";
      case Kind::wait: return "wait";
      case Kind::bucket: return "bucket";
      case Kind::encode: return "encode";
      case Kind::decode: return "decode";
      case Kind::average: return "average";
      case Kind::send: return "send";
      case Kind::recv: return "recv";
      case Kind::allreduce: return "allreduce";
      case Kind::handoff: return "hand-off";
    }
    return "?";
  }

  static std::string_view queue_name(std::uint64_t queue) noexcept {
    switch (static_cast<Queue>(queue)) {
      case Queue::synchronizer: return "synchronizer";
      case Queue::compute: return "compute";
      case Queue::communication: return "communication";
      case Queue::completion: return "completion";
      case Queue::waiter: return "waiter";
    }
    return "?";
  }

  // A name for each thread's track, from what it recorded: the trainer's threads mark gradients
  // ready and wait (and, driving the task graph from wait(), may encode, decode and transfer too);
  // of gradsync's own, the task graph's compute threads encode, decode and average, its
  // communication thread completes transfers, and the serial executor's thread does both.
  void write_thread_names(fmt::memory_buffer& out, std::size_t n) const {
    std::vector<std::pair<std::uint32_t, unsigned>> kinds;  // (lane, kinds it recorded as bits)
    for (std::size_t i = 0; i < n; ++i) {
      const Event& e = events_[i];
      if (!e.recorded.load(std::memory_order_acquire)) continue;
      auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == e.lane; });
      if (it == kinds.end()) it = kinds.insert(kinds.end(), {e.lane, 0u});
      it->second |= 1u << static_cast<unsigned>(e.kind);
    }
    std::sort(kinds.begin(), kinds.end());
    const auto has = [](unsigned bits, Kind kind) { return (bits >> static_cast<unsigned>(kind) & 1u) != 0; };
    for (const auto& [lane, bits] : kinds) {
      const bool computes = has(bits, Kind::encode) || has(bits, Kind::decode) || has(bits, Kind::average);
      const bool transfers = has(bits, Kind::send) || has(bits, Kind::recv) || has(bits, Kind::allreduce);
      const std::string_view role = has(bits, Kind::ready) || has(bits, Kind::wait) ? "trainer"
                                    : computes && transfers                         ? "gradsync communication + compute"
                                    : computes                                      ? "gradsync compute"
                                                                                    : "gradsync communication";
      fmt::format_to(std::back_inserter(out),
                     ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":\"{} "
                     "(thread {})\"}}}}",
                     rank_, lane, role, lane);
    }
  }

  // A small number per thread, the same in every timeline of the process: the trace's tid.
  static std::uint32_t lane() noexcept {
    static std::atomic<std::uint32_t> lanes{0};
    thread_local const std::uint32_t mine = lanes.fetch_add(1, std::memory_order_relaxed);
    return mine;
  }

  std::string_view gradient_name(std::uint64_t id) const noexcept {
    return id < gradient_names_.size() ? std::string_view(gradient_names_[id]) : std::string_view("?");
  }

  // A JSON string's contents: quotes, backslashes and control characters escaped.
  static std::string escaped(std::string_view text) {
    std::string out;
    for (const char c : text) {
      if (c == '"' || c == '\\')
        out += {'\\', c};
      else if (static_cast<unsigned char>(c) < 0x20)
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
      else
        out += c;
    }
    return out;
  }

  std::string path_;
  int rank_;
  std::vector<Event> events_;
  std::atomic<std::size_t> next_{0};
  std::vector<std::string> gradient_names_;
};

}  // namespace gradsync
