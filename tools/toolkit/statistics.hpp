#pragma once
// Summaries of repeated measurements.

#include <vector>

namespace gradsync::toolkit {

// The middle value; for an even count, the mean of the two middle ones. NaN when there are none.
double median(std::vector<double> values);

// The arithmetic mean. NaN when there are no values.
double mean(const std::vector<double>& values);

// nccl-tests' bus bandwidth factor for an allreduce among `ranks`: 2(n-1)/n, what each rank moves
// through its link in a ring allreduce, so busbw = algbw x this compares across rank counts
// (1 for a single rank).
constexpr double bus_factor(int ranks) { return ranks > 1 ? 2.0 * (ranks - 1) / ranks : 1.0; }

}  // namespace gradsync::toolkit
