#pragma once
// Where a process learns its place in the job: the variables launchers already set.
//
//   torchrun, gradsync-run, netcluster   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   mpirun (Open MPI)                    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   mpirun (MPICH/Hydra, PMI)            PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   srun (Slurm)                         SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE
//
// The first family present (in that order) gives rank and size; a family is used whole, so that
// `srun torchrun ...` (where SLURM_PROCID is the node) reads torchrun's global ranks. Every launcher
// also needs MASTER_ADDR (rank 0's host), MASTER_PORT (default 29500) and GRADSYNC_TOKEN, a
// secret shared by the job's ranks (gradsync-run makes one). A missing, malformed or inconsistent
// variable is an Error that names it.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace gradsync::launch {

struct Launch {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr{};
  std::uint16_t master_port = 29500;
  std::string token{};
  std::string launcher{};  // which family of variables was used, for messages
};

// Looks a variable up; std::getenv for the process, a map in tests.
using Environment = std::function<std::optional<std::string>(std::string_view name)>;

std::optional<std::string> process_environment(std::string_view name);

Launch from_environment(const Environment& env = process_environment);

}  // namespace gradsync::launch
