#pragma once
// Summaries of repeated measurements.

#include <vector>

namespace gradsync::toolkit {

// The middle value; for an even count, the mean of the two middle ones. NaN when there are none.
double median(std::vector<double> values);

// The arithmetic mean. NaN when there are no values.
double mean(const std::vector<double>& values);

}  // namespace gradsync::toolkit
