#pragma once
// For programs that run as one rank of a job or alone: a TCP transport placed by the launcher's
// variables (gradsync-run, torchrun, mpirun, srun) when there are any, else a world of one.

#include "gradsync/launch/environment.hpp"
#include "gradsync/transport/tcp.hpp"

namespace gradsync::toolkit {

inline gradsync::transport::Tcp connect_or_alone() {
  namespace gs = gradsync;
  if (gs::launch::process_environment("RANK") || gs::launch::process_environment("OMPI_COMM_WORLD_RANK") ||
      gs::launch::process_environment("PMI_RANK") || gs::launch::process_environment("SLURM_PROCID"))
    return gs::transport::Tcp::from_env();
  return gs::transport::Tcp(gs::transport::TcpOptions{.rank = 0, .world_size = 1, .token = "single-process"});
}

}  // namespace gradsync::toolkit
