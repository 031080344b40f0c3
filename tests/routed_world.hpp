#pragma once
// One process's transport in an emulated job of several machines on this host: shared memory
// within its machine (a segment per machine, named after `job`), TCP to the other machines.

#include <chrono>
#include <cstdint>
#include <string>

#include "gradsync/transport/routed.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "gradsync/transport/tcp.hpp"

namespace gradsync::test {

using RoutedWorld = transport::Routed<transport::SharedMemory, transport::Tcp>;

// Rank `rank` of n / local machines of `local` processes each.
inline RoutedWorld routed_world(int rank, int local, int n, std::uint16_t port, const std::string& job) {
  using namespace std::chrono_literals;
  const transport::SharedMemoryOptions shm{.local_rank = rank % local, .local_size = local,
                                           .first_rank = rank - rank % local, .job = job, .token = "t",
                                           .setup_timeout = 20s};
  const transport::TcpOptions tcp{.rank = rank, .world_size = n, .master_port = port, .token = "t",
                                  .setup_timeout = 20s};
  return RoutedWorld(transport::SharedMemory(shm), transport::Tcp(tcp));
}

}  // namespace gradsync::test
