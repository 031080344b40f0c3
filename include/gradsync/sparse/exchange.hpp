#pragma once
// sparse::SparseExchange — one step's sparse gradients, from every trainer to every machine's
// shared table (sparse::EmbeddingTable), averaged per row over the trainers whose batch held the
// row (the fifth source document).
//
// A step, for a group of M machines of L trainers (group ranks machine-major, as every launcher
// numbers them):
//   1. Each trainer sums its duplicate keys (key order, then the order given) into a sorted set of
//      (key, gradient row).
//   2. Within each machine the sets go to local rank 0, over the world transport (shared memory,
//      under transport::Routed), which merges them in local rank order into the machine's partial
//      set: per key the sum and the number of trainers that sent it.
//   3. The M local ranks 0 send their partial sets to each other (an allgatherv among them, over
//      TCP), and each merges all M in machine order: per key, sum = ((P_0 + P_1) + ..) + P_{M-1}
//      and count = the trainers that held it. Every machine computes those same bits.
//   4. Divided by the Averaging rule, local rank 0 applies the rows to its machine's table
//      (EmbeddingTable::apply, new keys in key order, so every machine's table stays identical),
//      then releases the machine's other trainers, who were waiting for it: a machine barrier.
// Only local ranks 0 need the other machines' rows, since only they write; so the within-machine
// step is a gather, not an allgather, and no row crosses a machine boundary more than once.
//
// The dense gradients of the same step go through an ordinary Synchronizer on the same world
// transport (transport::Borrowed): call its ready()s, then step() here, then its wait(); the dense
// buckets travel on the Synchronizer's threads while this one runs. Messages are told apart by
// tag: this exchange uses control messages of its own (engine/tag.hpp, ControlMessage::sparse).
//
// Every wait has the options' timeout and ends in an Error naming this rank, the peer and the
// operation; a dead peer fails the transport, and with it this step, at once.

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gradsync/concepts.hpp"
#include "gradsync/sparse/embedding_table.hpp"

namespace gradsync::sparse {

// What a row's summed gradient is divided by.
enum class Averaging : std::uint8_t {
  occurrence,  // the number of trainers whose batch held the row (the source document's rule)
  world_size,  // the number of trainers (Horovod's and TorchRec's): rare rows learn slower
  none,        // the sum
};

struct SparseOptions {
  Averaging averaging = Averaging::occurrence;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
};

// What one step moved, for logs and benchmarks.
struct SparseStepReport {
  std::size_t keys = 0;          // this trainer's distinct keys
  std::size_t machine_keys = 0;  // distinct keys of this machine's trainers (local rank 0; else 0)
  std::size_t step_keys = 0;     // distinct keys of the whole step (local rank 0; else 0)
  std::size_t bytes_sent = 0;    // by this rank
};

template <TransportPolicy X>
class SparseExchange {
 public:
  // `world`: the job's transport, which must outlive this; `group`: all trainers, numbered
  // machine-major, `ranks_per_machine` (L) on each; `table`: this machine's.
  SparseExchange(X& world, Group group, int ranks_per_machine, EmbeddingTable& table, SparseOptions options = {});

  // One step, collective over the group: this trainer's keys and their gradient rows
  // (keys.size() * dim values; keys may repeat). Returns once this machine's table holds the
  // step's update.
  SparseStepReport step(std::span<const std::uint64_t> keys, std::span<const float> gradients);
};

}  // namespace gradsync::sparse
