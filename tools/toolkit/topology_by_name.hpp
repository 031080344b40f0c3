#pragma once
// For command-line programs and the Python module: the topology a name picks, as a
// shipped::Topology (shipped.hpp). "auto" is the default everywhere: topology::Auto chooses per
// bucket, with the hierarchical schedules among its candidates on several machines of
// ranks_per_machine ranks; "ring", "recursive-doubling" and "halving-doubling" pin its choice to
// one candidate (the same schedule, the same bits as that topology alone).

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/shipped.hpp"

namespace gradsync::toolkit {

// Every name topology_named knows, the default first.
inline const std::vector<std::string> topology_names{"auto",           "ring",         "recursive-doubling",
                                                     "halving-doubling", "parameter-server", "hierarchical"};

// What the topologies that have settings read; 0 leaves a topology's own.
struct TopologySettings {
  int ranks_per_machine = 1;      // auto and hierarchical: the launcher's LOCAL_WORLD_SIZE
  std::size_t chunk_elements = 0;  // the ring's (also Auto's), the parameter server's and hierarchical's pieces
  std::size_t partitions = 0;      // parameter-server
  std::size_t servers = 0;         // parameter-server: ranks that only aggregate, or 0
  bool dedicated = false;          // parameter-server
};

// The topology `name` picks, built from the settings.
inline gradsync::shipped::Topology topology_named(std::string_view name, const TopologySettings& s) {
  namespace t = gradsync::topology;
  const auto chunk = [&](std::size_t own) { return s.chunk_elements ? s.chunk_elements : own; };
  t::Auto<> chooser{.large = {.chunk_elements = chunk(t::Ring{}.chunk_elements)},
                    .machines = {.ranks_per_machine = s.ranks_per_machine,
                                 .chunk_elements = chunk(t::Hierarchical{}.chunk_elements)}};
  const auto pinned = [&](t::Auto<>::Choice candidate) {
    chooser.pinned = candidate;
    return chooser;
  };
  if (name == "auto") return chooser;
  if (name == "ring") return pinned(t::Auto<>::Choice::large);
  if (name == "recursive-doubling") return pinned(t::Auto<>::Choice::small);
  if (name == "halving-doubling") return pinned(t::Auto<>::Choice::middle);
  if (name == "parameter-server")
    return t::ParameterServer{.partitions = s.partitions,
                              .servers = s.servers,
                              .dedicated = s.dedicated,
                              .chunk_elements = chunk(t::ParameterServer{}.chunk_elements)};
  if (name == "hierarchical")
    return t::Hierarchical{.ranks_per_machine = s.ranks_per_machine,
                           .chunk_elements = chunk(t::Hierarchical{}.chunk_elements)};
  throw std::invalid_argument(
      fmt::format("unknown topology '{}'; choose one of {}", name, fmt::join(topology_names, ", ")));
}

}  // namespace gradsync::toolkit
