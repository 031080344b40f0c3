#pragma once
// For programs that run as one rank of a job or alone: the job's ranks placed by the launcher's
// variables (gradsync-run, torchrun, mpirun, srun, netcluster) when there are any, else a world of
// one. Ranks on one machine (LOCAL_WORLD_SIZE) talk through shared memory, the others over TCP.

#include <unistd.h>

#include <fmt/format.h>

#include "gradsync/launch/environment.hpp"
#include "gradsync/shipped.hpp"

namespace gradsync::toolkit {

using gradsync::JobTransport;

// Whether a launcher started this process as a rank of a job (it set one of the rank variables).
inline bool launched() {
  namespace launch = gradsync::launch;
  return launch::process_environment("RANK") || launch::process_environment("OMPI_COMM_WORLD_RANK") ||
         launch::process_environment("PMI_RANK") || launch::process_environment("SLURM_PROCID");
}

inline JobTransport connect_or_alone() {
  namespace gs = gradsync;
  if (launched()) return JobTransport(gs::transport::SharedMemory::from_env(), gs::transport::Tcp::from_env());
  const std::string job = fmt::format("single-process-{}", ::getpid());
  return JobTransport(gs::transport::SharedMemory({.job = job, .token = job}),
                      gs::transport::Tcp(gs::transport::TcpOptions{.rank = 0, .world_size = 1, .token = job}));
}

}  // namespace gradsync::toolkit
