#pragma once
// engine::dependencies_of — a schedule's step list turned into a dependency graph.
//
// A schedule promises that running its steps in list order is correct. The graph keeps exactly
// the orderings that promise relies on: a step waits for its `after`, and for every earlier step
// that touches the same memory when at least one of the two writes it (the bucket's values over
// overlapping element ranges, or the same encoded slot). A send or receive counts as done when the
// transport has finished with its buffer. Any order of execution that respects the graph then
// computes bit for bit what list order computes, including the order in which contributions are
// added into one range.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gradsync/schedule.hpp"

namespace gradsync::engine {

struct Dependencies {
  std::vector<std::uint32_t> count;       // per step: how many steps it waits for
  std::vector<std::uint32_t> first;       // per step: its successors are successors[first[s], first[s+1])
  std::vector<std::uint32_t> successors;  // steps waiting for it, each listed once
};

// How a step uses the bucket's values and its slot.
struct StepAccess {
  bool reads_values = false;
  bool writes_values = false;
  bool reads_slot = false;
  bool writes_slot = false;
};

constexpr StepAccess access_of(const Step& step) noexcept {
  const bool in_place = step.slot == no_slot;
  switch (step.op) {
    case Step::Op::send: return {.reads_values = in_place, .reads_slot = !in_place};
    case Step::Op::recv: return {.writes_values = in_place, .writes_slot = !in_place};
    case Step::Op::encode: return {.reads_values = true, .writes_slot = true};
    case Step::Op::decode_add: return {.reads_values = true, .writes_values = true, .reads_slot = true};
    case Step::Op::decode_copy: return {.writes_values = true, .reads_slot = true};
    case Step::Op::average: return {.reads_values = true, .writes_values = true};
  }
  return {};
}

inline Dependencies dependencies_of(const Schedule& schedule) {
  const auto& steps = schedule.steps;
  const std::size_t n = steps.size();

  // The last writer of a memory region and the readers since; a writer waits for all of them, a
  // reader for the writer only.
  struct Region {
    std::uint32_t writer = no_step;
    std::vector<std::uint32_t> readers;
  };
  // Value regions are the distinct ranges the steps name, sorted, so the ranges overlapping a
  // step's range are found by binary search (they start within `longest` before its end).
  std::vector<ElemRange> ranges;
  for (const Step& step : steps)
    if (!step.range.empty()) ranges.push_back(step.range);
  const auto before = [](ElemRange a, ElemRange b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; };
  std::sort(ranges.begin(), ranges.end(), before);
  ranges.erase(std::unique(ranges.begin(), ranges.end()), ranges.end());
  std::size_t longest = 0;
  for (ElemRange r : ranges) longest = std::max(longest, r.size());
  std::vector<Region> value_regions(ranges.size());
  std::vector<Region> slot_regions(schedule.slot_elements.size());

  std::vector<std::vector<std::uint32_t>> waits_for(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const Step& step = steps[i];
    const StepAccess access = access_of(step);
    auto& mine = waits_for[i];
    if (step.after != no_step) mine.push_back(step.after);
    const auto wait_on = [&](const Region& region, bool writes) {
      if (region.writer != no_step) mine.push_back(region.writer);
      if (writes) mine.insert(mine.end(), region.readers.begin(), region.readers.end());
    };
    const auto record = [&](Region& region, bool writes) {
      if (writes) {
        region.writer = i;
        region.readers.clear();
      } else {
        region.readers.push_back(i);
      }
    };
    if ((access.reads_values || access.writes_values) && !step.range.empty()) {
      const std::size_t low = step.range.begin > longest ? step.range.begin - longest : 0;
      auto it = std::lower_bound(ranges.begin(), ranges.end(), ElemRange{low, low}, before);
      for (; it != ranges.end() && it->begin < step.range.end; ++it)
        if (it->end > step.range.begin) wait_on(value_regions[static_cast<std::size_t>(it - ranges.begin())], access.writes_values);
      const auto own = std::lower_bound(ranges.begin(), ranges.end(), step.range, before);
      record(value_regions[static_cast<std::size_t>(own - ranges.begin())], access.writes_values);
    }
    if ((access.reads_slot || access.writes_slot) && step.slot != no_slot) {
      wait_on(slot_regions[step.slot], access.writes_slot);
      record(slot_regions[step.slot], access.writes_slot);
    }
    std::sort(mine.begin(), mine.end());
    mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  }

  Dependencies graph;
  graph.count.resize(n);
  graph.first.assign(n + 1, 0);
  for (std::uint32_t i = 0; i < n; ++i) {
    graph.count[i] = static_cast<std::uint32_t>(waits_for[i].size());
    for (std::uint32_t j : waits_for[i]) ++graph.first[j + 1];
  }
  for (std::size_t i = 0; i < n; ++i) graph.first[i + 1] += graph.first[i];
  graph.successors.resize(graph.first[n]);
  std::vector<std::uint32_t> filled(graph.first.begin(), graph.first.end() - 1);
  for (std::uint32_t i = 0; i < n; ++i)
    for (std::uint32_t j : waits_for[i]) graph.successors[filled[j]++] = i;
  return graph;
}

}  // namespace gradsync::engine
