#pragma once
// engine::TaskJob — one bucket of the task graph (task_graph.hpp): its exchange, its dependency
// graph and the per-step state of the iteration it is running. Tasks are named by one id, the
// bucket in the high half and the step in the low; step steps() is the bucket's epilogue and
// steps() + 1 its prologue (the pack of its values, where the caller did not do it).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "gradsync/engine/dependencies.hpp"
#include "gradsync/engine/exchange.hpp"

namespace gradsync::engine {

constexpr std::uint64_t task_id(std::uint32_t bucket, std::uint32_t step) noexcept {
  return (std::uint64_t{bucket} << 32) | step;
}
constexpr std::uint32_t bucket_of(std::uint64_t task) noexcept { return static_cast<std::uint32_t>(task >> 32); }
constexpr std::uint32_t step_of(std::uint64_t task) noexcept { return static_cast<std::uint32_t>(task); }

template <class Exchange>
struct TaskJob {
  using Clock = std::chrono::steady_clock;

  Exchange* exchange = nullptr;
  Dependencies graph;
  std::vector<std::uint32_t> waiting;       // per step: dependencies not yet done
  std::vector<Clock::time_point> ready_at;  // per task (and the epilogue, the prologue): when it was queued;
                                            // per coordinated send: when it was reported
  std::vector<std::thread::id> queued_by;   // ... and by which thread
  std::vector<std::uint8_t> settled;        // per transfer: its completion has been taken
  std::vector<std::uint8_t> held;           // per send: waiting for the coordinator's grant
  std::uint32_t left = 0;                   // steps not yet done
  bool walked = false;                      // this iteration it is walked in list order by the caller
  BucketValues values;
  std::uint64_t iteration = 0;

  std::uint32_t steps() const noexcept { return static_cast<std::uint32_t>(waiting.size()); }
  std::uint32_t prologue() const noexcept { return steps() + 1; }

  // Takes bucket `bucket`'s exchange of a new plan: its graph, per-step state sized, and each of its
  // transfers reporting its completion to `sink` under its task id. Returns how many transfers it has.
  std::size_t install(Exchange* e, std::uint32_t bucket, transport::CompletionSink* sink) {
    exchange = e;
    const auto& list = exchange->schedule().steps;
    graph = dependencies_of(exchange->schedule());
    waiting.resize(list.size());
    ready_at.resize(list.size() + 2);
    queued_by.resize(list.size() + 2);
    settled.resize(list.size());
    held.assign(list.size(), 0);
    std::size_t transfers = 0;
    for (std::size_t s = 0; s < list.size(); ++s)
      if (is_transfer(list[s].op)) {
        ++transfers;
        exchange->request(s).report_to(sink, task_id(bucket, static_cast<std::uint32_t>(s)));
      }
    return transfers;
  }

  // An iteration on `v`: every step waits for its dependencies again.
  void restart(BucketValues v, std::uint64_t i) {
    values = v;
    iteration = i;
    std::copy(graph.count.begin(), graph.count.end(), waiting.begin());
    std::fill(settled.begin(), settled.end(), std::uint8_t{0});
    left = static_cast<std::uint32_t>(waiting.size());
  }
};

}  // namespace gradsync::engine
