#pragma once
// The text every rank sends at the first synchronization, and the comparison that turns two of
// them into a sentence saying what differs. Compiled in src/layout_check.cpp.

#include <string>
#include <string_view>

#include "gradsync/types.hpp"

namespace gradsync::detail {

// One line of header, one of policies, one per gradient.
std::string describe_layout(const Layout& layout, std::string_view policies);

// Empty when equal; otherwise what `other_rank` has that rank 0 does not, e.g.
// "rank 2 differs from rank 0: gradient 1: rank 0 has "fc.bias" f32[10] cpu, rank 2 has "fc.bias" f32[11] cpu".
std::string layout_differences(std::string_view rank0, std::string_view other, int other_rank);

}  // namespace gradsync::detail
