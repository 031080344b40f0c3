#pragma once
// How many ranks of a job train: all of them, unless the topology has dedicated parameter servers
// (the last ranks of the group), which only aggregate. Rank 0 always trains.

#include "gradsync/topology/parameter_server.hpp"

namespace gradsync::toolkit {

template <class Topology>
int workers(const Topology&, int ranks) {
  return ranks;
}
inline int workers(const gradsync::topology::ParameterServer& ps, int ranks) {
  return ps.contributors(gradsync::Group::world(0, ranks));
}

}  // namespace gradsync::toolkit
