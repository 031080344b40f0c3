#include "gradsync/schedule.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/error.hpp"

namespace gradsync {

namespace {

Error bad_group(int self, std::string detail) {
  return Error(ErrorKind::invalid_argument, {.rank = self, .operation = "group"}, std::move(detail));
}

// Machines are numbered from the launch: L consecutive ranks each, the same L everywhere.
int machines_of(const launch::Launch& launch) {
  if (launch.local_world_size < 1 || launch.world_size % launch.local_world_size != 0 ||
      launch.rank / launch.local_world_size != (launch.rank - launch.local_rank) / launch.local_world_size)
    throw bad_group(launch.rank, fmt::format("rank {} is local rank {} of {} in a world of {}: machine groups need "
                                             "the same number of ranks on every machine, numbered machine by machine",
                                             launch.rank, launch.local_rank, launch.local_world_size, launch.world_size));
  return launch.world_size / launch.local_world_size;
}

}  // namespace

std::string Group::describe() const { return fmt::format("{}: ranks {}", name, fmt::join(members, ", ")); }

Group Group::world(int rank, int size) {
  Group g{.rank = rank, .members = std::vector<int>(static_cast<std::size_t>(size)), .name = "world"};
  for (int i = 0; i < size; ++i) g.members[static_cast<std::size_t>(i)] = i;
  return g;
}

Group Group::of(std::vector<int> members, int self, std::string name) {
  const auto at = std::find(members.begin(), members.end(), self);
  if (at == members.end())
    throw bad_group(self, fmt::format("group {:?} ({}) does not include this rank", name, fmt::join(members, ", ")));
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0 || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    throw bad_group(self, fmt::format("group {:?} ({}) names a rank twice or a negative rank", name,
                                      fmt::join(members, ", ")));
  const int rank = static_cast<int>(at - members.begin());
  return Group{.rank = rank, .members = std::move(members), .name = std::move(name)};
}

void Group::check_fits(int self, int transport_size) const {
  if (rank < 0 || rank >= size() || members[static_cast<std::size_t>(rank)] != self)
    throw bad_group(self, fmt::format("group {:?} does not place this rank (transport rank {}) at its rank {}", name,
                                      self, rank));
  for (int member : members)
    if (member < 0 || member >= transport_size)
      throw bad_group(self, fmt::format("group {:?} names rank {}, which the transport ({} ranks) does not have",
                                        name, member, transport_size));
}

Group Group::machine(const launch::Launch& launch) {
  const int machine = (machines_of(launch), launch.rank / launch.local_world_size);
  std::vector<int> members(static_cast<std::size_t>(launch.local_world_size));
  for (int l = 0; l < launch.local_world_size; ++l) members[static_cast<std::size_t>(l)] = machine * launch.local_world_size + l;
  return of(std::move(members), launch.rank, fmt::format("machine {}", machine));
}

Group Group::across_machines(const launch::Launch& launch) {
  const int machines = machines_of(launch);
  std::vector<int> members(static_cast<std::size_t>(machines));
  for (int m = 0; m < machines; ++m) members[static_cast<std::size_t>(m)] = m * launch.local_world_size + launch.local_rank;
  return of(std::move(members), launch.rank, fmt::format("local rank {} across machines", launch.local_rank));
}

}  // namespace gradsync
