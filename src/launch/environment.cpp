#include "gradsync/launch/environment.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/error.hpp"
#include "launch/setting.hpp"

namespace gradsync::launch {

namespace {

struct Family {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;  // may be nullptr
  const char* local_size;
};

constexpr Family families[] = {
    {"torchrun-style (RANK/WORLD_SIZE)", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"PMI (MPICH/Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"},
};

Error bad(std::string detail) { return Error(ErrorKind::invalid_argument, {.operation = "launch"}, std::move(detail)); }

// A whole decimal number.
long long number(const Environment& env, const char* name) {
  const auto text = env(name);
  if (!text) throw bad(fmt::format("{} is not set", name));
  long long value = 0;
  const char* first = text->data();
  const char* last = first + text->size();
  const auto [end, error] = std::from_chars(first, last, value);
  if (error != std::errc() || end == first || end != last || value < 0)
    throw bad(fmt::format("{}={:?} is not a non-negative whole number", name, *text));
  return value;
}

// SLURM_TASKS_PER_NODE lists every node's task count, runs compressed: "4(x2),2" is 4, 4, 2.
// This node's entry is number SLURM_NODEID (which may be left out when all nodes agree).
long long slurm_tasks_on_this_node(const Environment& env) {
  const std::string text = env("SLURM_TASKS_PER_NODE").value_or("");
  std::vector<long long> per_node;
  std::size_t at = 0;
  while (at <= text.size()) {
    const auto comma = std::min(text.find(',', at), text.size());
    long long tasks = 0, repeat = 1;
    const std::string item = text.substr(at, comma - at);
    const bool plain = !item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
                       std::sscanf(item.c_str(), "%lld", &tasks) == 1;
    const bool run = !plain && std::sscanf(item.c_str(), "%lld(x%lld)", &tasks, &repeat) == 2 &&
                     item == fmt::format("{}(x{})", tasks, repeat);
    if ((!plain && !run) || tasks < 1 || repeat < 1 || per_node.size() + static_cast<std::size_t>(repeat) > (1u << 20))
      throw bad(fmt::format("SLURM_TASKS_PER_NODE={:?} is not a list like \"4(x2),2\"", text));
    per_node.insert(per_node.end(), static_cast<std::size_t>(repeat), tasks);
    at = comma + 1;
  }
  const bool uniform = std::all_of(per_node.begin(), per_node.end(), [&](long long t) { return t == per_node[0]; });
  if (!env("SLURM_NODEID")) {
    if (uniform) return per_node[0];
    throw bad(fmt::format("SLURM_TASKS_PER_NODE={:?} differs between nodes and SLURM_NODEID is not set", text));
  }
  const long long node = number(env, "SLURM_NODEID");
  if (node >= static_cast<long long>(per_node.size()))
    throw bad(fmt::format("SLURM_NODEID={} but SLURM_TASKS_PER_NODE={:?} lists {} nodes", node, text, per_node.size()));
  return per_node[static_cast<std::size_t>(node)];
}

}  // namespace

std::optional<long> number_setting(std::string_view name, long low, long high) {
  const auto text = process_environment(name);
  if (!text) return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(text->c_str(), &end, 10);
  if (text->empty() || *end != '\0' || value < low || value > high)
    throw Error(ErrorKind::invalid_argument, {.operation = "launch"},
                fmt::format("{}={:?} is not a whole number from {} to {}", name, *text, low, high));
  return value;
}

std::optional<std::string> process_environment(std::string_view name) {
  if (const char* value = std::getenv(std::string(name).c_str())) return std::string(value);
  return std::nullopt;
}

Launch from_environment(const Environment& env) {
  const Family* family = nullptr;
  for (const Family& f : families)
    if (env(f.rank) || env(f.size)) {
      family = &f;
      break;
    }
  if (!family)
    throw bad("no launcher variables found: set RANK and WORLD_SIZE (torchrun style), or start the program with "
              "gradsync-run, mpirun or srun");
  Launch launch;
  launch.launcher = family->launcher;
  const long long rank = number(env, family->rank);
  const long long size = number(env, family->size);
  if (size < 1 || size > 1 << 20) throw bad(fmt::format("{}={} is not a usable world size", family->size, size));
  if (rank >= size) throw bad(fmt::format("{}={} but {}={}: the rank must be below the world size", family->rank, rank, family->size, size));
  launch.rank = static_cast<int>(rank);
  launch.world_size = static_cast<int>(size);

  const bool has_local_rank = env(family->local_rank).has_value();
  const bool has_local_size = env(family->local_size).has_value();
  if (has_local_rank != has_local_size)
    throw bad(fmt::format("{} is set but {} is not", has_local_rank ? family->local_rank : family->local_size,
                          has_local_rank ? family->local_size : family->local_rank));
  if (has_local_rank) {
    const long long local_rank = number(env, family->local_rank);
    const long long local_size = std::string_view(family->local_size) == "SLURM_TASKS_PER_NODE"
                                     ? slurm_tasks_on_this_node(env)
                                     : number(env, family->local_size);
    if (local_size < 1 || local_size > size)
      throw bad(fmt::format("{}={} does not fit a world of {}", family->local_size, local_size, size));
    if (local_rank >= local_size)
      throw bad(fmt::format("{}={} but {}={}: the local rank must be below the local size", family->local_rank,
                            local_rank, family->local_size, local_size));
    launch.local_rank = static_cast<int>(local_rank);
    launch.local_world_size = static_cast<int>(local_size);
  }

  const auto master = env("MASTER_ADDR");
  if (!master || master->empty()) throw bad(fmt::format("MASTER_ADDR is not set: {} ranks need rank 0's host", launch.launcher));
  launch.master_addr = *master;
  if (env("MASTER_PORT")) {
    const long long port = number(env, "MASTER_PORT");
    if (port < 1 || port > 65535) throw bad(fmt::format("MASTER_PORT={} is not a TCP port", port));
    launch.master_port = static_cast<std::uint16_t>(port);
  }
  const auto token = env("GRADSYNC_TOKEN");
  if (!token || token->empty())
    throw bad("GRADSYNC_TOKEN is not set: give every rank of the job the same secret (gradsync-run does this)");
  launch.token = *token;
  return launch;
}

}  // namespace gradsync::launch
