#pragma once
// sparse::EmbeddingTable — one embedding table per machine, in shared memory, read by every local
// trainer and written by local rank 0 alone (the fifth source document: sparse parameters held
// once per machine, a "local parameter server").
//
// The table lives in local rank 0's arena of transport::SharedMemory (shared_memory.hpp), so it
// has the transport's lifetime: the segment's name is gone as soon as every local rank has mapped
// it, nothing survives the job however it ends, and a segment of another or a killed job is never
// joined. Local rank 0 allocates and fills it, then sends each local rank where it lies; they map
// it and check its header. With 4 trainers a machine this holds one copy of the rows where a
// replicated table holds four.
//
// Layout: a header, a key -> row index (open addressing, linear probing, twice as many slots as
// rows), the rows (`dim` f32 each), and one Adagrad accumulator per row. Keys are u64 (any value
// but ~0). A key gets a row on its first update, in the order `apply` is given them, so machines
// that apply the same updates hold the same rows at the same places; until then a lookup returns
// the key's initial values, a function of the key and the seed alone (uniform in +-init_scale).
//
// Reads need no lock because reads and writes never overlap: trainers look rows up during their
// forward and backward passes, and local rank 0 writes only in apply(), between the step's
// synchronization and the machine barrier that ends it (sparse::SparseExchange), while the others
// wait. That is the contract: lookup() must not run concurrently with apply().

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "gradsync/transport/shared_memory.hpp"

namespace gradsync::sparse {

enum class Optimizer : std::uint8_t {
  sgd,      // row -= learning_rate * g
  adagrad,  // per row: a += mean(g^2); row -= learning_rate * g / (sqrt(a) + epsilon)
};

struct EmbeddingOptions {
  std::size_t rows = 0;   // capacity: distinct keys the table can hold
  int dim = 0;            // values per row
  float init_scale = 0.01f;
  std::uint64_t seed = 0;
  Optimizer optimizer = Optimizer::sgd;
  float learning_rate = 0.01f;
  float epsilon = 1e-8f;  // Adagrad's
  std::chrono::milliseconds timeout = std::chrono::seconds(60);  // for the setup's messages

  std::string describe() const;
};

class EmbeddingTable {
 public:
  // Collective over the machine's ranks: local rank 0 creates the table in its arena (an Error if
  // the arena cannot hold it: raise GRADSYNC_SHM_ARENA_BYTES), the others attach. The transport
  // must outlive the table; the options must agree (the others check them against the header).
  EmbeddingTable(transport::SharedMemory& machine, const EmbeddingOptions& options);
  ~EmbeddingTable();
  EmbeddingTable(const EmbeddingTable&) = delete;
  EmbeddingTable& operator=(const EmbeddingTable&) = delete;

  int dim() const noexcept { return options_.dim; }
  const EmbeddingOptions& options() const noexcept { return options_; }
  bool writer() const noexcept { return writer_; }  // local rank 0, the one that applies updates
  std::size_t size() const noexcept;                // keys holding a row
  std::size_t bytes() const noexcept { return block_.size(); }  // the whole table: index, rows, accumulators

  // The row of each key: the table's, or a key's initial values if it has none yet (those live in
  // this object and stay valid until the next lookup). rows.size() must equal keys.size().
  void lookup(std::span<const std::uint64_t> keys, std::span<const float*> rows);
  // One key's row in the table, or nullptr.
  const float* find(std::uint64_t key) const noexcept;
  // A key's initial values, into `out` (dim values).
  void initial_values(std::uint64_t key, std::span<float> out) const noexcept;

  // Local rank 0 only: row[keys[i]] follows gradients[i*dim .. (i+1)*dim) by the optimizer, a row
  // made (initial values) for a key that has none. Keys must be distinct. An Error when the
  // table is full.
  void apply(std::span<const std::uint64_t> keys, std::span<const float> gradients);

  // Checkpoints. save() writes every key holding a row, with its values and Adagrad accumulator, in
  // row order, and the options' dim, optimizer, init scale and seed, to `path` (a new file, renamed
  // over `path` once complete): little-endian, a magic and a version, a SHA-256 of it all at the
  // end. Any rank may save; no apply() may run meanwhile. load(), local rank 0 only and with no
  // lookup() running (as apply()), replaces the table's rows with the file's, at the same places:
  // an Error (naming the file) if it is not such a file, is damaged, or its dim differs or its rows
  // exceed the capacity. Keys not in the file take this table's initial values. The other local
  // ranks see the loaded rows once local rank 0 has returned, e.g. after the next exchange step.
  void save(const std::filesystem::path& path) const;
  void load(const std::filesystem::path& path);

 private:
  struct Header;
  std::uint64_t* slot_keys() const noexcept;
  std::uint32_t* slot_rows() const noexcept;
  float* row(std::uint32_t index) const noexcept;
  float* accumulator(std::uint32_t index) const noexcept;
  std::size_t probe(std::uint64_t key) const noexcept;  // the slot holding key, or the empty one where it would go

  transport::SharedMemory* machine_;
  EmbeddingOptions options_;
  bool writer_ = false;
  std::span<std::byte> block_;  // the table, in local rank 0's arena
  Header* header_ = nullptr;
  std::size_t slots_ = 0;
  std::vector<float> initial_;  // lookup()'s initial values of keys without rows
};

}  // namespace gradsync::sparse
