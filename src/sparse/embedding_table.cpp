#include "gradsync/sparse/embedding_table.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "detail/hmac.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/error.hpp"

namespace gradsync::sparse {

namespace {

constexpr std::uint32_t table_magic = 0x62746d65;  // "emtb"
constexpr std::uint32_t table_version = 1;
constexpr std::uint64_t empty_key = ~std::uint64_t{0};
constexpr std::size_t alignment = 64;

std::size_t align_up(std::size_t n) { return (n + alignment - 1) / alignment * alignment; }

// splitmix64's finaliser: spreads keys over the index, and makes initial values from (seed, key).
constexpr std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

const char* name(Optimizer o) { return o == Optimizer::sgd ? "sgd" : "adagrad"; }

// A checkpoint file (EmbeddingTable::save): the header below, then per row its key, values and
// accumulator, then a SHA-256 of all that. Written and read as this machine's bytes, which the
// format fixes as little-endian.
static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian");
constexpr char checkpoint_magic[8] = {'g', 's', '-', 'e', 'm', 'b', 'e', 'd'};
constexpr std::uint32_t checkpoint_version = 1;
struct CheckpointHeader {
  char magic[8];
  std::uint32_t version;
  std::int32_t dim;
  std::uint32_t optimizer;
  float init_scale;
  std::uint64_t seed;
  std::uint64_t rows;  // records that follow
};
constexpr std::size_t digest_bytes = 32;

template <class T>
void put(std::vector<std::byte>& out, const T& value) {
  const auto bytes = std::as_bytes(std::span(&value, 1));
  out.insert(out.end(), bytes.begin(), bytes.end());
}

}  // namespace

// At the start of the block, written by local rank 0 before any other rank learns where it is.
struct EmbeddingTable::Header {
  std::uint32_t magic = table_magic;
  std::uint32_t version = table_version;
  std::uint64_t rows = 0;
  std::uint64_t slots = 0;  // a power of two, at least 2 * rows
  std::int32_t dim = 0;
  std::uint32_t optimizer = 0;
  float init_scale = 0;
  float learning_rate = 0;
  float epsilon = 0;
  std::uint64_t seed = 0;
  std::uint64_t used = 0;  // rows handed out; written by local rank 0 in apply()
  // Offsets in the block.
  std::uint64_t slot_keys_at = 0, slot_rows_at = 0, rows_at = 0, accumulators_at = 0;
};

std::string EmbeddingOptions::describe() const {
  return fmt::format("embedding(rows={}, dim={}, init-scale={}, seed={}, optimizer={}, lr={}, eps={})", rows, dim,
                     init_scale, seed, name(optimizer), learning_rate, epsilon);
}

EmbeddingTable::EmbeddingTable(transport::SharedMemory& machine, const EmbeddingOptions& options)
    : machine_(&machine), options_(options), writer_(machine.rank() == 0) {
  const ErrorContext context{.rank = machine.rank(), .operation = "embedding table setup"};
  if (options.rows == 0 || options.rows >= std::uint64_t{1} << 32 || options.dim < 1)
    throw Error(ErrorKind::invalid_argument, context,
                fmt::format("{}: rows must be 1 .. 2^32-1 and dim at least 1", options.describe()));
  slots_ = std::bit_ceil(2 * options.rows);
  Header layout;
  layout.rows = options.rows;
  layout.slots = slots_;
  layout.dim = options.dim;
  layout.optimizer = static_cast<std::uint32_t>(options.optimizer);
  layout.init_scale = options.init_scale;
  layout.learning_rate = options.learning_rate;
  layout.epsilon = options.epsilon;
  layout.seed = options.seed;
  layout.slot_keys_at = align_up(sizeof(Header));
  layout.slot_rows_at = layout.slot_keys_at + align_up(slots_ * sizeof(std::uint64_t));
  layout.rows_at = layout.slot_rows_at + align_up(slots_ * sizeof(std::uint32_t));
  layout.accumulators_at = layout.rows_at + align_up(options.rows * static_cast<std::size_t>(options.dim) * sizeof(float));
  const std::size_t total = layout.accumulators_at + align_up(options.rows * sizeof(float));

  // Where the table lies, from local rank 0 to each other local rank: offset and size.
  const auto tag = engine::control_tag(0, engine::ControlMessage::embedding_table);
  std::uint64_t where[2] = {0, 0};
  const auto deadline = [&] { return std::chrono::steady_clock::now() + options.timeout; };
  if (writer_) {
    block_ = machine.allocate(total);
    if (!machine.shared(block_)) {
      machine.deallocate(block_);
      block_ = {};
      throw Error(ErrorKind::invalid_argument, context,
                  fmt::format("the embedding table ({} bytes) does not fit local rank 0's shared-memory arena: raise "
                              "GRADSYNC_SHM_ARENA_BYTES (SharedMemoryOptions::arena_bytes), or check /dev/shm's size",
                              total));
    }
    header_ = new (block_.data()) Header(layout);
    std::memset(slot_keys(), 0xff, slots_ * sizeof(std::uint64_t));  // every slot empty (empty_key)
    where[0] = machine.offset_of(block_);
    where[1] = total;
    std::vector<transport::SharedMemory::Request> sent(static_cast<std::size_t>(machine.size()));
    for (int peer = 1; peer < machine.size(); ++peer)
      machine.send(sent[static_cast<std::size_t>(peer)], peer, tag, std::as_bytes(std::span(where)));
    const auto until = deadline();
    for (int peer = 1; peer < machine.size(); ++peer) machine.wait(sent[static_cast<std::size_t>(peer)], until);
  } else {
    transport::SharedMemory::Request received;
    machine.recv(received, 0, tag, std::as_writable_bytes(std::span(where)));
    if (machine.wait(received, deadline()) != sizeof where)
      throw Error(ErrorKind::protocol, {.rank = machine.rank(), .peer = 0, .operation = "embedding table setup"},
                  "local rank 0 sent a malformed table location");
    block_ = machine.at_offset(where[0], where[1]);
    header_ = reinterpret_cast<Header*>(block_.data());
    const Header& h = *header_;
    std::string differences;
    const auto differ = [&](std::string_view what, auto mine, auto theirs) {
      if (mine != theirs) differences += fmt::format("{}{} {} here, {} on local rank 0", differences.empty() ? "" : "; ", what, mine, theirs);
    };
    if (h.magic != table_magic || h.version != table_version)
      throw Error(ErrorKind::protocol, {.rank = machine.rank(), .peer = 0, .operation = "embedding table setup"},
                  fmt::format("no embedding table of version {} at the location local rank 0 sent", table_version));
    differ("rows", layout.rows, h.rows);
    differ("dim", layout.dim, h.dim);
    differ("optimizer", name(options.optimizer), name(static_cast<Optimizer>(h.optimizer)));
    differ("init scale", layout.init_scale, h.init_scale);
    differ("learning rate", layout.learning_rate, h.learning_rate);
    differ("epsilon", layout.epsilon, h.epsilon);
    differ("seed", layout.seed, h.seed);
    if (differences.empty() && where[1] != total)
      differences = fmt::format("the table takes {} bytes here, {} on local rank 0", total, where[1]);
    if (!differences.empty())
      throw Error(ErrorKind::mismatch, {.rank = machine.rank(), .peer = 0, .operation = "embedding table setup"},
                  fmt::format("the local ranks' embedding tables differ: {}", differences));
  }
  initial_.reserve(static_cast<std::size_t>(options.dim) * 256);
}

EmbeddingTable::~EmbeddingTable() {
  if (writer_ && !block_.empty()) machine_->deallocate(block_);
}

std::size_t EmbeddingTable::size() const noexcept { return header_->used; }

std::uint64_t* EmbeddingTable::slot_keys() const noexcept {
  return reinterpret_cast<std::uint64_t*>(block_.data() + header_->slot_keys_at);
}
std::uint32_t* EmbeddingTable::slot_rows() const noexcept {
  return reinterpret_cast<std::uint32_t*>(block_.data() + header_->slot_rows_at);
}
float* EmbeddingTable::row(std::uint32_t index) const noexcept {
  return reinterpret_cast<float*>(block_.data() + header_->rows_at) + static_cast<std::size_t>(index) * options_.dim;
}
float* EmbeddingTable::accumulator(std::uint32_t index) const noexcept {
  return reinterpret_cast<float*>(block_.data() + header_->accumulators_at) + index;
}

std::size_t EmbeddingTable::probe(std::uint64_t key) const noexcept {
  const std::uint64_t* keys = slot_keys();
  std::size_t slot = mix(key) & (slots_ - 1);
  while (keys[slot] != key && keys[slot] != empty_key) slot = (slot + 1) & (slots_ - 1);
  return slot;
}

const float* EmbeddingTable::find(std::uint64_t key) const noexcept {
  const std::size_t slot = probe(key);
  return slot_keys()[slot] == key && key != empty_key ? row(slot_rows()[slot]) : nullptr;
}

void EmbeddingTable::initial_values(std::uint64_t key, std::span<float> out) const noexcept {
  const std::uint64_t base = mix(options_.seed ^ mix(key));
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double unit = static_cast<double>(mix(base + i) >> 11) * 0x1.0p-53;  // [0, 1)
    out[i] = static_cast<float>((2 * unit - 1) * options_.init_scale);
  }
}

void EmbeddingTable::lookup(std::span<const std::uint64_t> keys, std::span<const float*> rows) {
  if (rows.size() != keys.size())
    throw Error(ErrorKind::invalid_argument, {.rank = machine_->rank(), .operation = "embedding lookup"},
                fmt::format("{} keys but room for {} rows", keys.size(), rows.size()));
  const auto dim = static_cast<std::size_t>(options_.dim);
  std::size_t missing = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    rows[i] = find(keys[i]);
    missing += rows[i] == nullptr;
  }
  if (missing == 0) return;
  // Sized before any pointer into it is taken, so none moves.
  initial_.resize(missing * dim);
  std::size_t next = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (rows[i] != nullptr) continue;
    const std::span<float> values(initial_.data() + next * dim, dim);
    initial_values(keys[i], values);
    rows[i] = values.data();
    ++next;
  }
}

void EmbeddingTable::apply(std::span<const std::uint64_t> keys, std::span<const float> gradients) {
  const ErrorContext context{.rank = machine_->rank(), .operation = "embedding update"};
  const auto dim = static_cast<std::size_t>(options_.dim);
  if (!writer_)
    throw Error(ErrorKind::invalid_argument, context, "only local rank 0 updates the machine's embedding table");
  if (gradients.size() != keys.size() * dim)
    throw Error(ErrorKind::invalid_argument, context,
                fmt::format("{} keys of dim {} but {} gradient values", keys.size(), dim, gradients.size()));
  std::uint64_t* slot_key = slot_keys();
  std::uint32_t* slot_row = slot_rows();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint64_t key = keys[i];
    if (key == empty_key)
      throw Error(ErrorKind::invalid_argument, context, "key 2^64-1 is reserved (it marks an empty index slot)");
    const std::size_t slot = probe(key);
    if (slot_key[slot] == empty_key) {
      if (header_->used == header_->rows)
        throw Error(ErrorKind::invalid_argument, context,
                    fmt::format("the embedding table is full: all {} rows hold keys (EmbeddingOptions::rows)",
                                header_->rows));
      const auto index = static_cast<std::uint32_t>(header_->used++);
      initial_values(key, {row(index), dim});
      *accumulator(index) = 0;
      slot_row[slot] = index;
      slot_key[slot] = key;
    }
    const std::uint32_t index = slot_row[slot];
    float* values = row(index);
    const float* g = gradients.data() + i * dim;
    if (options_.optimizer == Optimizer::sgd) {
      for (std::size_t j = 0; j < dim; ++j) values[j] -= options_.learning_rate * g[j];
    } else {
      float squares = 0;
      for (std::size_t j = 0; j < dim; ++j) squares += g[j] * g[j];
      float& a = *accumulator(index);
      a += squares / static_cast<float>(dim);
      const float step = options_.learning_rate / (std::sqrt(a) + options_.epsilon);
      for (std::size_t j = 0; j < dim; ++j) values[j] -= step * g[j];
    }
  }
}

void EmbeddingTable::save(const std::filesystem::path& path) const {
  const ErrorContext context{.rank = machine_->rank(), .operation = "embedding table save"};
  const auto dim = static_cast<std::size_t>(options_.dim);
  const std::size_t used = header_->used;
  std::vector<std::uint64_t> key_of(used, empty_key);  // by row index
  const std::uint64_t* keys = slot_keys();
  const std::uint32_t* rows = slot_rows();
  for (std::size_t slot = 0; slot < slots_; ++slot)
    if (keys[slot] != empty_key && rows[slot] < used) key_of[rows[slot]] = keys[slot];
  std::vector<std::byte> out;
  out.reserve(sizeof(CheckpointHeader) + used * (8 + 4 * dim + 4) + digest_bytes);
  CheckpointHeader header{.version = checkpoint_version,
                          .dim = options_.dim,
                          .optimizer = static_cast<std::uint32_t>(options_.optimizer),
                          .init_scale = options_.init_scale,
                          .seed = options_.seed,
                          .rows = used};
  std::memcpy(header.magic, checkpoint_magic, sizeof header.magic);
  put(out, header);
  for (std::size_t r = 0; r < used; ++r) {
    put(out, key_of[r]);
    const auto values = std::as_bytes(std::span<const float>(row(static_cast<std::uint32_t>(r)), dim));
    out.insert(out.end(), values.begin(), values.end());
    put(out, *accumulator(static_cast<std::uint32_t>(r)));
  }
  const gradsync::detail::Digest digest = gradsync::detail::sha256(out);
  out.insert(out.end(), reinterpret_cast<const std::byte*>(digest.data()),
             reinterpret_cast<const std::byte*>(digest.data()) + digest.size());
  // A file of its own, renamed over `path` once written: a reader never sees half a checkpoint.
  std::filesystem::path partial = path;
  partial += fmt::format(".partial-{}", ::getpid());
  {
    std::ofstream file(partial, std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
    file.close();
    if (!file)
      throw Error(ErrorKind::invalid_argument, context, fmt::format("cannot write {}", partial.string()));
  }
  std::error_code error;
  std::filesystem::rename(partial, path, error);
  if (error) {
    std::filesystem::remove(partial, error);
    throw Error(ErrorKind::invalid_argument, context, fmt::format("cannot write {}", path.string()));
  }
}

void EmbeddingTable::load(const std::filesystem::path& path) {
  const ErrorContext context{.rank = machine_->rank(), .operation = "embedding table load"};
  const auto refuse = [&](std::string why) {
    return Error(ErrorKind::invalid_argument, context, fmt::format("{}: {}", path.string(), why));
  };
  if (!writer_) throw refuse("only local rank 0 loads the machine's embedding table");
  std::ifstream file(path, std::ios::binary);
  if (!file) throw refuse("cannot be read");
  const std::vector<char> text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto bytes = std::as_bytes(std::span(text));
  if (bytes.size() < sizeof(CheckpointHeader) + digest_bytes) throw refuse("too short to be an embedding checkpoint");
  CheckpointHeader header;
  std::memcpy(&header, bytes.data(), sizeof header);
  if (std::memcmp(header.magic, checkpoint_magic, sizeof header.magic) != 0) throw refuse("not an embedding checkpoint");
  if (header.version != checkpoint_version)
    throw refuse(fmt::format("checkpoint version {}; this gradsync reads version {}", header.version, checkpoint_version));
  const std::span<const std::byte> body = bytes.first(bytes.size() - digest_bytes);
  gradsync::detail::Digest stored;
  std::memcpy(stored.data(), bytes.data() + body.size(), digest_bytes);
  if (!gradsync::detail::equal_digests(gradsync::detail::sha256(body), stored))
    throw refuse("damaged: its SHA-256 does not match its contents");
  if (header.dim != options_.dim)
    throw refuse(fmt::format("rows of dim {}; this table's are of dim {}", header.dim, options_.dim));
  if (header.rows > header_->rows)
    throw refuse(fmt::format("{} rows; this table holds {} (EmbeddingOptions::rows)", header.rows, header_->rows));
  const auto dim = static_cast<std::size_t>(options_.dim);
  const std::size_t record = 8 + 4 * dim + 4;
  if (body.size() != sizeof header + header.rows * record)
    throw refuse(fmt::format("{} bytes of rows where {} rows of dim {} take {}", body.size() - sizeof header,
                             header.rows, dim, header.rows * record));
  // The keys are checked before the table changes, so that a refused file leaves it as it was.
  const std::byte* rows = body.data() + sizeof header;
  std::vector<std::uint64_t> keys(header.rows);
  for (std::uint64_t r = 0; r < header.rows; ++r) {
    std::memcpy(&keys[r], rows + r * record, 8);
    if (keys[r] == empty_key) throw refuse(fmt::format("row {} has the reserved key {:#x}", r, keys[r]));
  }
  std::vector<std::uint64_t> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  if (const auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    const auto first = std::find(keys.begin(), keys.end(), *twice);
    const auto second = std::find(first + 1, keys.end(), *twice);
    throw refuse(fmt::format("rows {} and {} both have key {:#x}", first - keys.begin(), second - keys.begin(), *twice));
  }
  std::uint64_t* slot_key = slot_keys();
  std::uint32_t* slot_row = slot_rows();
  std::memset(slot_key, 0xff, slots_ * sizeof(std::uint64_t));
  header_->used = 0;
  const std::byte* at = rows;
  for (std::uint64_t r = 0; r < header.rows; ++r, at += record) {
    const std::size_t slot = probe(keys[r]);
    const auto index = static_cast<std::uint32_t>(header_->used++);
    std::memcpy(row(index), at + 8, 4 * dim);
    std::memcpy(accumulator(index), at + 8 + 4 * dim, 4);
    slot_row[slot] = index;
    slot_key[slot] = keys[r];
  }
}

}  // namespace gradsync::sparse
