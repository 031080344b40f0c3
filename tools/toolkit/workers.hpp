#pragma once
// How many ranks of a job train: all of them, unless the topology has dedicated parameter servers
// (the last ranks of the group), which only aggregate. Rank 0 always trains.

#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/parameter_server.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::toolkit {

inline int workers(const gradsync::topology::Ring&, int ranks) { return ranks; }
inline int workers(const gradsync::topology::Hierarchical&, int ranks) { return ranks; }
inline int workers(const gradsync::topology::ParameterServer& ps, int ranks) {
  return ps.contributors(gradsync::Group::world(0, ranks));
}

}  // namespace gradsync::toolkit
