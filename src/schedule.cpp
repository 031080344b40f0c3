#include "gradsync/schedule.hpp"

namespace gradsync {

Group Group::world(int rank, int size) {
  Group g{.rank = rank, .members = std::vector<int>(static_cast<std::size_t>(size))};
  for (int i = 0; i < size; ++i) g.members[static_cast<std::size_t>(i)] = i;
  return g;
}

}  // namespace gradsync
