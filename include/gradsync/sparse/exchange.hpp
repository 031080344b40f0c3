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

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/compression/none.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/engine/exchange.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/engine/transfer.hpp"
#include "gradsync/error.hpp"
#include "gradsync/log.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/sparse/embedding_table.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::sparse {

// What a row's summed gradient is divided by.
enum class Averaging : std::uint8_t {
  occurrence,  // the number of trainers whose batch held the row (the source document's rule)
  world_size,  // the number of trainers (Horovod's and TorchRec's): rare rows learn slower
  none,        // the sum
};

// How the machines' rows travel between machines.
enum class Density : std::uint8_t {
  automatic,  // per step, whichever the cost model (below) predicts moves fewer bytes
  sparse,     // always the sets of (key, count, row)
  dense,      // always a dense allreduce of every key's row and count (needs key_space)
};

struct SparseOptions {
  Averaging averaging = Averaging::occurrence;
  // Keys are below this (hashed features usually are), which makes the dense path possible: a
  // ring allreduce among the machines of key_space x (dim + 1) values. 0: keys are any u64, and
  // every step is sparse.
  std::uint64_t key_space = 0;
  Density density = Density::automatic;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  LogSink log = log_to_stderr;  // the density choice, when it changes (group rank 0 only)
};

// What one step moved, for logs and benchmarks.
struct SparseStepReport {
  std::size_t keys = 0;          // this trainer's distinct keys
  std::size_t machine_keys = 0;  // distinct keys of this machine's trainers (local rank 0; else 0)
  std::size_t step_keys = 0;     // distinct keys of the whole step (local rank 0; else 0)
  std::size_t bytes_sent = 0;    // by this rank
  bool dense = false;            // the machines exchanged rows densely this step
};

// A sorted set of distinct keys with their rows and, once merged, how many trainers held each.
struct RowSet {
  std::vector<std::uint64_t> keys;
  std::vector<std::uint32_t> counts;  // per key: trainers whose batch held it
  std::vector<float> values;          // keys.size() x dim

  void clear() {
    keys.clear();
    counts.clear();
    values.clear();
  }
};

namespace detail {

// Sums `sets` into `out`: per key, the rows added in the order of `sets` (the first contributor
// taken as it is, then ((a + b) + c) ..), and the counts added. Every input is sorted by key.
// `order` is scratch.
inline void merge_sets(std::span<const RowSet* const> sets, std::size_t dim, RowSet& out,
                       std::vector<std::pair<std::uint64_t, std::uint64_t>>& order) {
  order.clear();
  for (std::size_t s = 0; s < sets.size(); ++s)
    for (std::size_t i = 0; i < sets[s]->keys.size(); ++i) order.emplace_back(sets[s]->keys[i], (std::uint64_t{s} << 32) | i);
  std::sort(order.begin(), order.end());  // by key, then set, then position: the summation order
  out.clear();
  for (const auto& [key, where] : order) {
    const RowSet& from = *sets[where >> 32];
    const std::size_t i = where & 0xffffffffu;
    const float* row = from.values.data() + i * dim;
    if (out.keys.empty() || out.keys.back() != key) {
      out.keys.push_back(key);
      out.counts.push_back(from.counts[i]);
      out.values.insert(out.values.end(), row, row + dim);
    } else {
      out.counts.back() += from.counts[i];
      float* sum = out.values.data() + out.values.size() - dim;
      for (std::size_t j = 0; j < dim; ++j) sum[j] += row[j];
    }
  }
}

}  // namespace detail

template <TransportPolicy X>
class SparseExchange {
 public:
  // `world`: the job's transport, which must outlive this; `group`: all trainers, numbered
  // machine-major, `ranks_per_machine` (L) on each; `table`: this machine's.
  SparseExchange(X& world, Group group, int ranks_per_machine, EmbeddingTable& table, SparseOptions options = {})
      : world_(world), group_(std::move(group)), local_count_(ranks_per_machine), table_(table), options_(options) {
    if (local_count_ < 1 || group_.size() % local_count_ != 0)
      throw Error(ErrorKind::invalid_argument, {.rank = group_.rank, .operation = "sparse exchange"},
                  fmt::format("a group of {} ranks is not whole machines of {} ranks each", group_.size(), local_count_));
    machine_count_ = group_.size() / local_count_;
    machine_ = group_.rank / local_count_;
    local_ = group_.rank % local_count_;
    if ((local_ == 0) != table_.writer())
      throw Error(ErrorKind::invalid_argument, {.rank = group_.rank, .operation = "sparse exchange"},
                  fmt::format("group rank {} is local rank {} of its machine, but its embedding table says it is{} "
                              "the machine's writer: the group's machines and the shared-memory transport's differ",
                              group_.rank, local_, table_.writer() ? "" : " not"));
    const auto most = static_cast<std::size_t>(std::max(local_count_, machine_count_));
    sends_ = std::vector<engine::Transfer<X>>(2 * most);
    send_posted_.assign(2 * most, 0);
    received_.resize(most);
    sizes_.resize(most);
    if (options_.density == Density::dense && options_.key_space == 0)
      throw Error(ErrorKind::invalid_argument, {.rank = group_.rank, .operation = "sparse exchange"},
                  "Density::dense needs SparseOptions::key_space, the bound below which every key lies");
    if (options_.key_space > 0 && local_ == 0 && machine_count_ > 1) {
      std::vector<int> leaders;
      for (int m = 0; m < machine_count_; ++m) leaders.push_back(member(m, 0));
      leaders_ = Group::of(std::move(leaders), member(machine_, 0), "local ranks 0 across machines");
      const std::size_t elements = options_.key_space * (static_cast<std::size_t>(table_.dim()) + 1);
      Schedule schedule = topology::Ring{}.schedule(leaders_, elements, codec_traits<compression::None>());
      schedule.contributors = 1;  // the sums: rows are divided per key afterwards, as on the sparse path
      dense_exchange_ = engine::BucketExchange<compression::None, X>(std::move(schedule), compression::None{}, DType::f32);
      dense_.resize(elements);
    }
  }

  SparseExchange(const SparseExchange&) = delete;
  SparseExchange& operator=(const SparseExchange&) = delete;

  const Group& group() const noexcept { return group_; }

  // One step, collective over the group: this trainer's keys and their gradient rows
  // (keys.size() * dim values; keys may repeat). Returns once this machine's table holds the
  // step's update.
  SparseStepReport step(std::span<const std::uint64_t> keys, std::span<const float> gradients) {
    const auto dim = static_cast<std::size_t>(table_.dim());
    if (gradients.size() != keys.size() * dim)
      throw Error(ErrorKind::invalid_argument, {.rank = group_.rank, .operation = "sparse exchange"},
                  fmt::format("{} keys of dim {} but {} gradient values", keys.size(), dim, gradients.size()));
    SparseStepReport report;
    sum_duplicates(keys, gradients, dim, own_);
    report.keys = own_.keys.size();
    const std::uint64_t step = step_++;
    if (local_ != 0) {
      pack(own_, dim);
      report.bytes_sent += post_size(0, member(machine_, 0), step) + post_payload(0, member(machine_, 0), step);
      wait_sends(1, step, "sparse gather");
      // The machine barrier: local rank 0 says when the table holds the step.
      std::uint64_t done = 0;
      receive_.recv(world_, member(machine_, 0), tag(step, release), std::as_writable_bytes(std::span(&done, 1)),
                    nullptr);
      wait(receive_, step, "sparse step barrier");
      return report;
    }
    // Local rank 0: the machine's sets, in local rank order.
    for (int l = 1; l < local_count_; ++l) {
      receive_size(static_cast<std::size_t>(l), member(machine_, l), step, dim, "sparse gather");
      receive_payload(static_cast<std::size_t>(l), member(machine_, l), step, dim, "sparse gather");
    }
    merge(local_count_, 0, own_, machine_set_, dim);
    report.machine_keys = machine_set_.keys.size();
    // The machines' partial sets, to and from every other machine's local rank 0: first their
    // sizes, which decide how the rows travel, then the rows.
    if (machine_count_ > 1) {
      pack(machine_set_, dim);
      int posted = 0;
      for (int m = 0; m < machine_count_; ++m)
        if (m != machine_) report.bytes_sent += post_size(posted++, member(m, 0), step);
      sizes_[static_cast<std::size_t>(machine_)] = machine_set_.keys.size();
      for (int m = 0; m < machine_count_; ++m)
        if (m != machine_) receive_size(static_cast<std::size_t>(m), member(m, 0), step, dim, "sparse allgather");
      wait_sends(posted, step, "sparse allgather");
      report.dense = dense_this_step(dim);
      if (report.dense) {
        report.bytes_sent += allreduce_densely(step, dim);
      } else {
        posted = 0;
        for (int m = 0; m < machine_count_; ++m)
          if (m != machine_) report.bytes_sent += post_payload(posted++, member(m, 0), step);
        for (int m = 0; m < machine_count_; ++m)
          if (m != machine_) receive_payload(static_cast<std::size_t>(m), member(m, 0), step, dim, "sparse allgather");
        wait_sends(posted, step, "sparse allgather");
        merge(machine_count_, machine_, machine_set_, step_set_, dim);
      }
    } else {
      std::swap(step_set_, machine_set_);
    }
    report.step_keys = step_set_.keys.size();
    divide(step_set_, dim);
    table_.apply(step_set_.keys, step_set_.values);
    const std::uint64_t done = step;
    for (int l = 1; l < local_count_; ++l) {
      sends_[static_cast<std::size_t>(l)].send(world_, member(machine_, l), tag(step, release),
                                               std::as_bytes(std::span(&done, 1)), nullptr);
    }
    for (int l = 1; l < local_count_; ++l) wait(sends_[static_cast<std::size_t>(l)], step, "sparse step barrier");
    return report;
  }

 private:
  // Offsets from ControlMessage::sparse: a set's size, its payload, the barrier.
  static constexpr std::uint32_t set_size = 0, set_payload = 1, release = 2;
  // A set larger than this is refused before anything is allocated for it.
  static constexpr std::uint64_t max_set_bytes = std::uint64_t{1} << 32;

  std::uint64_t tag(std::uint64_t step, std::uint32_t offset) const {
    return engine::control_tag(step, engine::ControlMessage::sparse, offset);
  }
  int member(int machine, int local) const { return group_.members[static_cast<std::size_t>(machine * local_count_ + local)]; }

  // Sums repeated keys of one trainer, in key order, each key's rows in the order given.
  void sum_duplicates(std::span<const std::uint64_t> keys, std::span<const float> gradients, std::size_t dim, RowSet& out) {
    order_.clear();
    for (std::size_t i = 0; i < keys.size(); ++i) order_.emplace_back(keys[i], i);
    std::sort(order_.begin(), order_.end());
    out.clear();
    for (const auto& [key, i] : order_) {
      const float* row = gradients.data() + i * dim;
      if (out.keys.empty() || out.keys.back() != key) {
        out.keys.push_back(key);
        out.counts.push_back(1);
        out.values.insert(out.values.end(), row, row + dim);
      } else {
        float* sum = out.values.data() + out.values.size() - dim;
        for (std::size_t j = 0; j < dim; ++j) sum[j] += row[j];
      }
    }
  }

  // A set travels as two messages: its key count, then keys, counts and values in one payload.
  // pack() fills the outgoing buffer once; post_set() sends it (as sends number `index`).
  static std::size_t payload_bytes(std::uint64_t count, std::size_t dim) {
    return count * (sizeof(std::uint64_t) + sizeof(std::uint32_t) + dim * sizeof(float));
  }

  void pack(const RowSet& set, std::size_t dim) {
    const std::size_t n = set.keys.size();
    count_out_ = n;
    outgoing_.resize(payload_bytes(n, dim));
    std::byte* p = outgoing_.data();
    std::memcpy(p, set.keys.data(), n * sizeof(std::uint64_t));
    std::memcpy(p + n * sizeof(std::uint64_t), set.counts.data(), n * sizeof(std::uint32_t));
    std::memcpy(p + n * (sizeof(std::uint64_t) + sizeof(std::uint32_t)), set.values.data(), n * dim * sizeof(float));
  }

  std::size_t post_size(int index, int peer, std::uint64_t step) {
    const auto at = static_cast<std::size_t>(2 * index);
    sends_[at].send(world_, peer, tag(step, set_size), std::as_bytes(std::span(&count_out_, 1)), nullptr);
    send_posted_[at] = 1;
    return sizeof count_out_;
  }
  std::size_t post_payload(int index, int peer, std::uint64_t step) {
    const auto at = static_cast<std::size_t>(2 * index + 1);
    sends_[at].send(world_, peer, tag(step, set_payload), std::as_bytes(std::span(outgoing_)), nullptr);
    send_posted_[at] = 1;
    return outgoing_.size();
  }

  // Waits for what was posted of the first `sets` sets (a size and, if posted, a payload each).
  void wait_sends(int sets, std::uint64_t step, const char* operation) {
    for (std::size_t i = 0; i < static_cast<std::size_t>(2 * sets); ++i) {
      if (!send_posted_[i]) continue;
      wait(sends_[i], step, operation);
      send_posted_[i] = 0;
    }
  }

  // A set from `peer` into received_[at]: its size, then its payload.
  void receive_size(std::size_t at, int peer, std::uint64_t step, std::size_t dim, const char* operation) {
    receive_.recv(world_, peer, tag(step, set_size), std::as_writable_bytes(std::span(&sizes_[at], 1)), nullptr);
    if (wait(receive_, step, operation) != sizeof(std::uint64_t) || payload_bytes(sizes_[at], dim) > max_set_bytes)
      throw Error(ErrorKind::protocol, {.rank = group_.rank, .peer = peer, .operation = operation},
                  fmt::format("step {}: a sparse set of {} keys announced (limit {} bytes)", step, sizes_[at],
                              max_set_bytes));
  }
  void receive_payload(std::size_t at, int peer, std::uint64_t step, std::size_t dim, const char* operation) {
    incoming_.resize(payload_bytes(sizes_[at], dim));
    receive_.recv(world_, peer, tag(step, set_payload), std::as_writable_bytes(std::span(incoming_)), nullptr);
    if (wait(receive_, step, operation) != incoming_.size())
      throw Error(ErrorKind::protocol, {.rank = group_.rank, .peer = peer, .operation = operation},
                  fmt::format("step {}: a sparse set shorter than the {} keys announced", step, sizes_[at]));
    unpack(sizes_[at], dim, received_[at], peer, operation);
  }

  // The cost model, on what every machine's local rank 0 knows alike (every machine's set size),
  // so that all choose the same. Both paths cross the same links, so bytes stand for time. Sparse:
  // the busiest machine sends its set to M-1 machines or receives theirs (full duplex: the larger).
  // Dense: a ring allreduce sends and receives 2(M-1)/M of key_space x (dim + 1) values each.
  bool dense_this_step(std::size_t dim) {
    if (options_.density != Density::automatic) return options_.density == Density::dense;
    if (options_.key_space == 0) return false;
    const auto m = static_cast<double>(machine_count_);
    double total = 0, busiest = 0;
    for (int i = 0; i < machine_count_; ++i) total += static_cast<double>(sizes_[static_cast<std::size_t>(i)]);
    for (int i = 0; i < machine_count_; ++i) {
      const auto own = static_cast<double>(sizes_[static_cast<std::size_t>(i)]);
      busiest = std::max({busiest, (m - 1) * own, total - own});
    }
    const double sparse_bytes = busiest * static_cast<double>(payload_bytes(1, dim));
    const double dense_bytes = 2 * (m - 1) / m * static_cast<double>(dense_.size() * sizeof(float));
    const bool dense = dense_bytes < sparse_bytes;
    if (dense != was_dense_ && group_.rank == 0)
      log_line(options_.log, fmt::format("gradsync sparse: from step {} rows cross machines {} (sparse {:.0f} bytes "
                                         "on the busiest link, dense {:.0f})",
                                         step_ - 1, dense ? "densely" : "as sparse sets", sparse_bytes, dense_bytes));
    was_dense_ = dense;
    return dense;
  }

  // Every key's summed row and count as key_space x (dim + 1) values, summed over the machines by
  // a ring; then the keys some trainer held, in key order, as the sparse path leaves them.
  std::size_t allreduce_densely(std::uint64_t step, std::size_t dim) {
    const std::size_t width = dim + 1;
    std::fill(dense_.begin(), dense_.end(), 0.0f);
    for (std::size_t i = 0; i < machine_set_.keys.size(); ++i) {
      const std::uint64_t key = machine_set_.keys[i];
      if (key >= options_.key_space)
        throw Error(ErrorKind::invalid_argument, {.rank = group_.rank, .operation = "sparse exchange"},
                    fmt::format("key {} is not below SparseOptions::key_space ({})", key, options_.key_space));
      float* row = dense_.data() + key * width;
      std::copy_n(machine_set_.values.data() + i * dim, dim, row);
      row[dim] = static_cast<float>(machine_set_.counts[i]);
    }
    const ExchangeStats stats = dense_exchange_.run(
        std::span(dense_), compression::None{}, world_,
        {.group = leaders_, .iteration = step, .bucket = engine::sparse_bucket, .timeout = options_.timeout});
    step_set_.clear();
    for (std::uint64_t key = 0; key < options_.key_space; ++key) {
      const float* row = dense_.data() + key * width;
      if (row[dim] == 0) continue;
      step_set_.keys.push_back(key);
      step_set_.counts.push_back(static_cast<std::uint32_t>(row[dim]));
      step_set_.values.insert(step_set_.values.end(), row, row + dim);
    }
    return stats.bytes_sent;
  }

  void unpack(std::uint64_t n, std::size_t dim, RowSet& set, int peer, const char* operation) {
    set.keys.resize(n);
    set.counts.resize(n);
    set.values.resize(n * dim);
    const std::byte* p = incoming_.data();
    std::memcpy(set.keys.data(), p, n * sizeof(std::uint64_t));
    std::memcpy(set.counts.data(), p + n * sizeof(std::uint64_t), n * sizeof(std::uint32_t));
    std::memcpy(set.values.data(), p + n * (sizeof(std::uint64_t) + sizeof(std::uint32_t)), n * dim * sizeof(float));
    for (std::size_t i = 0; i < n; ++i)
      if ((i > 0 && set.keys[i - 1] >= set.keys[i]) || set.counts[i] == 0 ||
          set.counts[i] > static_cast<std::uint32_t>(group_.size()))
        throw Error(ErrorKind::protocol, {.rank = group_.rank, .peer = peer, .operation = operation},
                    fmt::format("a sparse set's keys are not sorted and distinct, or key {} counts {} trainers of {}",
                                set.keys[i], set.counts[i], group_.size()));
  }

  // received_[0 .. count), with `mine` in place of received_[self], summed in index order.
  void merge(int count, int self, const RowSet& mine, RowSet& out, std::size_t dim) {
    inputs_.clear();
    for (int i = 0; i < count; ++i) inputs_.push_back(i == self ? &mine : &received_[static_cast<std::size_t>(i)]);
    detail::merge_sets(inputs_, dim, out, merge_order_);
  }

  void divide(RowSet& set, std::size_t dim) const {
    for (std::size_t i = 0; i < set.keys.size(); ++i) {
      float divisor = 1;
      if (options_.averaging == Averaging::occurrence) divisor = static_cast<float>(set.counts[i]);
      if (options_.averaging == Averaging::world_size) divisor = static_cast<float>(group_.size());
      if (divisor == 1) continue;
      for (std::size_t j = 0; j < dim; ++j) set.values[i * dim + j] /= divisor;
    }
  }

  std::size_t wait(engine::Transfer<X>& transfer, std::uint64_t step, const char* operation) {
    try {
      return transfer.wait(world_, std::chrono::steady_clock::now() + options_.timeout);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::timeout) throw;
      throw Error(ErrorKind::timeout, {.rank = group_.rank, .peer = transfer.peer(), .operation = operation},
                  fmt::format("step {}: no answer within {} ms", step, options_.timeout.count()));
    }
  }

  X& world_;
  Group group_;
  int local_count_;
  int machine_count_ = 1;
  int machine_ = 0;
  int local_ = 0;
  EmbeddingTable& table_;
  SparseOptions options_;
  std::uint64_t step_ = 0;
  std::vector<engine::Transfer<X>> sends_;  // two per set sent; the barrier's releases
  std::vector<std::uint8_t> send_posted_;    // per send: posted, not yet waited for
  engine::Transfer<X> receive_;
  std::uint64_t count_out_ = 0;
  std::vector<std::byte> outgoing_, incoming_;
  std::vector<std::uint64_t> sizes_;
  RowSet own_, machine_set_, step_set_;
  std::vector<RowSet> received_;
  std::vector<const RowSet*> inputs_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> order_, merge_order_;
  // The dense path (local ranks 0, with a key_space and several machines).
  Group leaders_;
  engine::BucketExchange<compression::None, X> dense_exchange_;
  std::vector<float> dense_;
  bool was_dense_ = false;
};

}  // namespace gradsync::sparse
