// ctr — issue 17's sparse-embedding trainer: predicts a Debian package's Section from hashed
// features of its entry in the package index (packages.hpp), through an embedding table of 2^20
// rows held once per machine (sparse::EmbeddingTable), mean-pooled, and a small MLP (model.hpp).
//
//   gradsync-run -n 4 ctr [--epochs E] [--batch B] [--lr R] [--sparse-lr R] [--optimizer sgd|adagrad]
//                         [--dim D] [--rows N] [--hidden 64] [--averaging occurrence|world-size|none]
//                         [--table shared|replicated] [--min-class N] [--steps S] [--data FILE] [--json PATH] [--seed N]
//                         [--bucketing fixed-size|time-clustered] [--codec none|ef-two-bit] [--threshold T]
//                         [--topology auto|ring|hierarchical] [--checkpoint DIR] [--resume DIR]
//
// One process per rank, placed by the launcher's variables; run without a launcher it trains
// alone. The MLP's gradients are averaged by a Synchronizer over the whole job, with the bucketing,
// codec and topology the options pick (the first and fourth source documents' methods beside the
// fifth's); the rows' gradients go through sparse::SparseExchange, which updates every machine's
// table. Each choice is a Synchronizer type compiled into this program, so the choices are the few
// that show the methods composed (fmnist takes every codec). Rank 0 prints progress
// and each epoch's test accuracy; --json also records one table's bytes and the memory (Pss) of
// rank 0's machine's trainers at the end, which is what holding the table once per machine saves.
// --checkpoint DIR: after every epoch rank 0 writes the table (sparse::EmbeddingTable::save) and
// the MLP's parameters there; --resume DIR: each machine's local rank 0 loads the table, every rank
// the MLP, and training goes on from the epoch after the saved one (the same samples in the same
// order as an unbroken run; with ef-two-bit, whose residuals are not saved, not the same bits).

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/sparse/embedding_table.hpp"
#include "gradsync/sparse/exchange.hpp"
#include "gradsync/transport/borrowed.hpp"
#include "model.hpp"
#include "packages.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"

namespace {

namespace gs = gradsync;
namespace tk = gradsync::toolkit;

using Exchange = gs::sparse::SparseExchange<tk::JobTransport>;

constexpr auto timeout = std::chrono::minutes(2);

struct Options {
  int epochs = 1;
  std::size_t batch = 64;  // per rank
  float learning_rate = 0.1f;
  float sparse_learning_rate = 0.05f;
  std::string optimizer = "adagrad";
  int dim = 16;
  std::size_t rows = std::size_t{1} << 20;
  std::vector<std::size_t> hidden{64};
  std::string averaging = "occurrence";
  std::string table = "shared";
  std::size_t min_class = 100;
  std::size_t max_steps = 0;  // per epoch; 0: the whole training set
  std::string data;           // empty: apt-cache dumpavail
  std::string json;
  std::uint64_t seed = 1;
  std::string bucketing = "fixed-size";
  std::string codec = "none";
  std::string topology = "auto";
  std::string checkpoint;  // a directory: written after every epoch
  std::string resume;      // a directory written by --checkpoint: training goes on from it
  float threshold = 0.1f;  // ef-two-bit's: fits this MLP's gradients (results/composed/: 0.5, TwoBit's default, loses 2.5 points)
};

void declare_options(CLI::App& app, Options& o) {
  tk::add_number(app, "--epochs", o.epochs, "passes over the training set", {.low = 1});
  tk::add_number(app, "--batch", o.batch, "packages per step, per rank", {.low = 1});
  tk::add_number(app, "--lr", o.learning_rate, "the MLP's learning rate (SGD)", {.low = 0, .low_open = true});
  tk::add_number(app, "--sparse-lr", o.sparse_learning_rate, "the embedding table's learning rate",
                 {.low = 0, .low_open = true});
  tk::add_choice(app, "--optimizer", o.optimizer, "how the table's rows follow their gradients", {"sgd", "adagrad"});
  tk::add_number(app, "--dim", o.dim, "values per embedding row", {.low = 1});
  tk::add_number(app, "--rows", o.rows, "the table's capacity in rows (distinct keys)", {.low = 1});
  tk::add_sizes(app, "--hidden", o.hidden, "the MLP's hidden layers' sizes");
  tk::add_choice(app, "--averaging", o.averaging, "what a row's summed gradient is divided by",
                 {"occurrence", "world-size", "none"});
  tk::add_choice(app, "--table", o.table,
                 "shared: one table a machine, in shared memory, written by local rank 0; replicated: every "
                 "trainer holds and updates its own copy (the baseline the shared table saves memory against)",
                 {"shared", "replicated"});
  tk::add_number(app, "--min-class", o.min_class, "packages a section needs to be a class", {.low = 1});
  tk::add_number(app, "--steps", o.max_steps, "steps per epoch (0: the whole training set)");
  tk::add_choice(app, "--bucketing", o.bucketing, "how the MLP's gradients are packed into buckets",
                 {"fixed-size", "time-clustered"});
  tk::add_choice(app, "--codec", o.codec, "the MLP's gradients' codec", {"none", "ef-two-bit"});
  tk::add_number(app, "--threshold", o.threshold, "ef-two-bit's threshold: values at or beyond it travel as it",
                 {.low = 0, .low_open = true});
  app.add_option("--checkpoint", o.checkpoint, "after every epoch, write the table and the MLP into this directory");
  app.add_option("--resume", o.resume, "go on from the last epoch a --checkpoint directory holds");
  tk::add_choice(app, "--topology", o.topology,
                 "the MLP's allreduce: auto (per bucket, by the link), one ring over every rank, or within "
                 "machines and then across them",
                 {"auto", "ring", "hierarchical"});
  app.add_option("--data", o.data, "a package index as apt-cache dumpavail prints it (default: run it)");
  app.add_option("--json", o.json, "also write the results as JSON to this file");
  tk::add_number(app, "--seed", o.seed, "seeds the model, the table's initial rows and the shuffling");
  app.footer("Start it with gradsync-run (or torchrun, mpirun, srun) for several ranks; --batch is per rank.");
}

struct EpochReport {
  int epoch = 0;
  std::size_t steps = 0;
  double seconds = 0;
  double samples_per_second = 0;  // global
  double loss = 0;                // mean of this rank's batch losses
  double test_accuracy = -1;      // -1 where not evaluated (ranks but 0)
  double keys_per_step = 0;       // distinct keys of a whole step, on average (local ranks 0)
  std::uint64_t dense_bytes_sent = 0;   // by this rank
  std::uint64_t sparse_bytes_sent = 0;  // by this rank
  double sparse_seconds = 0;            // in the sparse exchange, on this rank
};

// The MLP's parameters and the epochs done, as JSON (floats written so that they read back to
// the same bits), beside the table's own file.
void save_checkpoint(const std::filesystem::path& dir, int epochs_done, const gs::sparse::EmbeddingTable& table,
                     const ctr::Model& model) {
  std::filesystem::create_directories(dir);
  table.save(dir / "table.gsemb");
  tk::Json layers = tk::Json::array();
  for (const fmnist::Layer& layer : model.dense().layers()) layers.push_back({{"w", layer.w}, {"b", layer.b}});
  tk::write_json((dir / "mlp.json").string(), {{"epochs_done", epochs_done}, {"layers", layers}});
}

// Loads a checkpoint: the MLP on every rank, the table on each machine's local rank 0; returns the
// epochs it had done. The other local ranks see the table once the next exchange step has ended.
int load_checkpoint(const std::filesystem::path& dir, gs::sparse::EmbeddingTable& table, ctr::Model& model) {
  std::ifstream file(dir / "mlp.json");
  if (!file) throw std::invalid_argument(fmt::format("--resume: no {} to read", (dir / "mlp.json").string()));
  const tk::Json saved = tk::Json::parse(file);
  auto& layers = model.dense().layers();
  if (saved.at("layers").size() != layers.size())
    throw std::invalid_argument(fmt::format("--resume: {} holds an MLP of {} layers, this one has {}",
                                            dir.string(), saved.at("layers").size(), layers.size()));
  for (std::size_t l = 0; l < layers.size(); ++l) {
    auto w = saved["layers"][l].at("w").get<std::vector<float>>(), b = saved["layers"][l].at("b").get<std::vector<float>>();
    if (w.size() != layers[l].w.size() || b.size() != layers[l].b.size())
      throw std::invalid_argument(fmt::format("--resume: layer {} of {} has another shape than --hidden gives", l + 1,
                                              dir.string()));
    layers[l].w = std::move(w);
    layers[l].b = std::move(b);
  }
  if (table.writer()) table.load(dir / "table.gsemb");
  return saved.at("epochs_done").get<int>();
}

// Every rank walks the same shuffled order; each global batch of ranks x batch packages is cut
// into one shard per rank. A step: look the shard's rows up, forward and backward (the MLP's
// gradients handed to the Synchronizer layer by layer as they are ready), the rows' gradients
// through the exchange (which returns once this machine's table is updated), then the MLP's
// average and its SGD step. Only rank 0 evaluates: the other ranks wait for it in the next step's
// exchange, so no table is written while it reads.
template <class DenseSync>
std::vector<EpochReport> train(const Options& o, const ctr::Dataset& data, DenseSync& sync, Exchange& exchange,
                               gs::sparse::EmbeddingTable& table, ctr::Model& model, int first_epoch) {
  std::vector<std::pair<gs::GradId, gs::GradId>> ids;  // per layer: weights, bias
  for (std::size_t l = 0; l < model.dense().layers().size(); ++l) {
    fmnist::Layer& layer = model.dense().layers()[l];
    ids.emplace_back(sync.add("fc" + std::to_string(l + 1) + ".weight", gs::view(layer.gw)),
                     sync.add("fc" + std::to_string(l + 1) + ".bias", gs::view(layer.gb)));
  }
  const auto ranks = static_cast<std::size_t>(sync.size());
  const auto rank = static_cast<std::size_t>(sync.rank());
  const bool leader = rank == 0;
  const std::size_t global = o.batch * ranks;
  std::size_t steps = data.train.count() / global;
  if (o.max_steps) steps = std::min(steps, o.max_steps);
  if (steps == 0)
    throw std::invalid_argument(fmt::format("--batch {} on {} ranks takes more than the {} training packages",
                                            o.batch, ranks, data.train.count()));
  const std::size_t dim = model.dim();
  std::vector<std::size_t> order(data.train.count());
  std::vector<std::uint64_t> keys(o.batch * data.max_keys);
  std::vector<const float*> rows(keys.size());
  std::vector<float> row_gradients(keys.size() * dim);
  std::vector<std::size_t> offsets(o.batch + 1, 0);
  std::vector<std::uint8_t> labels(o.batch);
  // Rank 0's test set as keys, made once.
  std::vector<std::uint64_t> test_keys(leader ? data.test.features.size() : 0);
  std::vector<std::size_t> test_offsets(leader ? data.test.offsets.size() : 0);
  for (std::size_t i = 0; i + 1 < test_offsets.size(); ++i)
    test_offsets[i + 1] = test_offsets[i] + data.keys_of(data.test, i, std::span(test_keys).subspan(test_offsets[i]));
  std::vector<const float*> test_rows(test_keys.size());
  std::vector<EpochReport> reports;
  for (int epoch = first_epoch; epoch <= o.epochs; ++epoch) {
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::mt19937_64 shuffle(o.seed * 1000003u + static_cast<std::uint64_t>(epoch));
    std::shuffle(order.begin(), order.end(), shuffle);
    EpochReport report{.epoch = epoch, .steps = steps};
    double loss_sum = 0, step_keys = 0;
    std::size_t last_tenth = 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t step = 0; step < steps; ++step) {
      std::size_t n = 0;
      for (std::size_t s = 0; s < o.batch; ++s) {
        const std::size_t example = order[step * global + rank * o.batch + s];
        n += data.keys_of(data.train, example, std::span(keys).subspan(n));
        offsets[s + 1] = n;
        labels[s] = data.train.labels[example];
      }
      const std::span<const std::uint64_t> shard_keys(keys.data(), n);
      const std::span<const float*> shard_rows(rows.data(), n);
      const std::span<float> shard_gradients(row_gradients.data(), n * dim);
      table.lookup(shard_keys, shard_rows);
      loss_sum += model.train_step(shard_rows, offsets, labels.data(), shard_gradients, [&](std::size_t l) {
        sync.ready(ids[l].first);
        sync.ready(ids[l].second);
      });
      const auto exchange_started = std::chrono::steady_clock::now();
      const gs::sparse::SparseStepReport sparse = exchange.step(shard_keys, shard_gradients);
      report.sparse_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - exchange_started).count();
      sync.wait();
      model.dense().sgd_step(o.learning_rate, 0.0f);
      report.dense_bytes_sent += sync.last_iteration().bytes_sent;
      report.sparse_bytes_sent += sparse.bytes_sent;
      step_keys += static_cast<double>(sparse.step_keys);
      // Every tenth of the epoch as a line: the trainer runs under launchers and in logs.
      if (const std::size_t tenth = (step + 1) * 10 / steps; leader && (tenth != last_tenth || step + 1 == steps)) {
        last_tenth = tenth;
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        fmt::print("epoch {} {:>6}/{} steps  {:>7.0f} samples/s  loss {:.4f}\n", epoch, step + 1, steps,
                   static_cast<double>((step + 1) * global) / elapsed, loss_sum / static_cast<double>(step + 1));
        std::fflush(stdout);
      }
    }
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.samples_per_second = static_cast<double>(steps * global) / report.seconds;
    report.loss = loss_sum / static_cast<double>(steps);
    report.keys_per_step = step_keys / static_cast<double>(steps);
    if (leader && data.test.count()) {
      table.lookup(test_keys, test_rows);
      report.test_accuracy = static_cast<double>(model.correct(test_rows, test_offsets, data.test.labels.data())) /
                             static_cast<double>(data.test.count());
    }
    reports.push_back(report);
    // Rank 0 is its machine's table writer, and between steps: nothing writes the table meanwhile.
    if (leader && !o.checkpoint.empty()) save_checkpoint(o.checkpoint, epoch, table, model);
  }
  return reports;
}

// A process's proportional set size: its private pages, plus each shared page divided by the
// processes that map it, so that summing it over processes counts a shared table once. Also its
// part in shared memory alone (Pss_Shmem: the table, and the transport's segment), which tells
// the table's share from what each trainer holds for itself (its data, heap, code).
struct Pss {
  std::uint64_t total = 0, shmem = 0;
};

Pss pss_of(long pid) {
  const std::string path = fmt::format("/proc/{}/smaps_rollup", pid);
  std::ifstream file(path);
  Pss pss;
  bool found = false;
  for (std::string line; std::getline(file, line);) {  // "Pss:   12345 kB"
    if (line.starts_with("Pss:")) pss.total = std::stoull(line.substr(4)) * 1024, found = true;
    if (line.starts_with("Pss_Shmem:")) pss.shmem = std::stoull(line.substr(10)) * 1024;
  }
  if (!found) throw std::runtime_error(fmt::format("no Pss line in {}", path));
  return pss;
}

// One line of /proc/<pid>/maps: "start-end perms offset device inode [path]".
struct Mapping {
  std::uintptr_t start = 0, end = 0;
  std::string file;  // "device inode": the mapped file, whatever its path says (" (deleted)")
};

Mapping read_mapping(const std::string& line) {
  std::istringstream fields(line);
  std::string range, perms, offset, device, inode;
  fields >> range >> perms >> offset >> device >> inode;
  const std::size_t dash = range.find('-');
  if (dash == std::string::npos) return {};
  return {.start = std::stoull(range.substr(0, dash), nullptr, 16),
          .end = std::stoull(range.substr(dash + 1), nullptr, 16),
          .file = device + " " + inode};
}

// The file mapped at `address` in this process, or "".
std::string file_mapped_at(std::uintptr_t address) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (const Mapping m = read_mapping(line); address >= m.start && address < m.end) return m.file;
  return "";
}

// This machine's trainers: the processes that map its shared-memory segment (where the table
// lies), found by the segment's device and inode in every readable /proc/<pid>/maps. Every local
// rank maps the segment and no other process can (its name is gone once they have), so this
// needs no message of the program's own beside the library's.
std::vector<long> machine_trainers(gs::transport::SharedMemory& machine) {
  const std::string segment = file_mapped_at(reinterpret_cast<std::uintptr_t>(machine.at_offset(0, 1).data()));
  if (segment.empty()) throw std::runtime_error("the shared-memory segment is not in /proc/self/maps");
  std::vector<long> pids;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", error)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    std::ifstream maps(entry.path() / "maps");  // another user's process, or one gone: unreadable, skipped
    for (std::string line; std::getline(maps, line);)
      if (read_mapping(line).file == segment) {
        pids.push_back(std::stol(name));
        break;
      }
  }
  return pids;
}

// Calls f(sync) with the dense Synchronizer the options pick, over `world` borrowed.
template <class F>
void with_dense_sync(const Options& o, tk::JobTransport& world, F&& f) {
  using Borrowed = gs::transport::Borrowed<tk::JobTransport>;
  const auto with_topology = [&]<class Bucketing, class Codec>(Bucketing bucketing, Codec codec) {
    const gs::Options options{.timeout = timeout};
    if (o.topology == "hierarchical") {
      gs::Synchronizer<Bucketing, Codec, gs::topology::Hierarchical, Borrowed> sync(
          Borrowed(world), options, bucketing, codec, {.ranks_per_machine = world.local_size()});
      return f(sync);
    }
    gs::topology::Auto<> chooser{.machines = {.ranks_per_machine = world.local_size()}};
    if (o.topology == "ring") chooser.pinned = gs::topology::Auto<>::Choice::large;
    gs::Synchronizer<Bucketing, Codec, gs::topology::Auto<>, Borrowed> sync(Borrowed(world), options, bucketing, codec,
                                                                             chooser);
    f(sync);
  };
  const auto with_codec = [&](auto bucketing) {
    if (o.codec == "ef-two-bit")
      return with_topology(bucketing, gs::compression::ErrorFeedback<gs::compression::TwoBit>{{.threshold = o.threshold}});
    with_topology(bucketing, gs::compression::None{});
  };
  if (o.bucketing == "time-clustered") return with_codec(gs::bucketing::TimeClustered{});
  with_codec(gs::bucketing::FixedSize{});
}

gs::sparse::Averaging averaging_named(const std::string& name) {
  if (name == "world-size") return gs::sparse::Averaging::world_size;
  if (name == "none") return gs::sparse::Averaging::none;
  return gs::sparse::Averaging::occurrence;
}

int run(const Options& o) {
  const ctr::Dataset data = ctr::make_dataset(ctr::parse_packages(ctr::read_dumpavail(o.data)), o.min_class);
  // The index's text and parsed fields are gone by now, but the allocator keeps their pages; handing
  // them back keeps each trainer's own memory to what it uses, beside the machine's shared table.
  ::malloc_trim(0);
  if (data.classes.size() < 2)
    throw ctr::DataError(fmt::format("the package index has {} section(s) of --min-class {} packages or more; "
                                     "need 2", data.classes.size(), o.min_class));
  if (data.distinct_keys > o.rows)
    throw std::invalid_argument(
        fmt::format("--rows {} cannot hold the training set's {} distinct keys", o.rows, data.distinct_keys));
  tk::JobTransport world = tk::connect_or_alone();
  const bool leader = world.rank() == 0;
  const gs::sparse::EmbeddingOptions table_options{
      .rows = o.rows,
      .dim = o.dim,
      .seed = o.seed,
      .optimizer = o.optimizer == "sgd" ? gs::sparse::Optimizer::sgd : gs::sparse::Optimizer::adagrad,
      .learning_rate = o.sparse_learning_rate,
      .timeout = timeout};
  // Replicated: a shared-memory segment of this process alone holds its own table, and the
  // exchange counts every trainer as a machine of one, so every trainer applies every update.
  std::optional<gs::transport::SharedMemory> own_segment;
  if (o.table == "replicated") {
    const std::string job = fmt::format("ctr-replica-{}", ::getpid());
    own_segment.emplace(gs::transport::SharedMemoryOptions{.job = job, .token = job});
  }
  const bool replicated = own_segment.has_value();
  gs::sparse::EmbeddingTable table(replicated ? *own_segment : world.local(), table_options);
  // No key_space: the keys are whole 64-bit hashes, so the machines always exchange sparse sets.
  Exchange exchange(world, gs::Group::world(world.rank(), world.size()), replicated ? 1 : world.local_size(), table,
                    {.averaging = averaging_named(o.averaging), .timeout = timeout});
  ctr::Model model(static_cast<std::size_t>(o.dim), o.hidden, data.classes.size(), o.seed);
  if (leader)
    fmt::print("ctr: {} training and {} test packages in {} sections ({} dropped: sections under {} packages) | "
               "{} distinct keys | table {} | {:.1f} MB a machine | MLP {}-{}-{} | {} ranks x batch {} | lr {} | "
               "dense: {} bucketing, codec {}, {}\n",
               data.train.count(), data.test.count(), data.classes.size(), data.dropped, o.min_class,
               data.distinct_keys, table_options.describe(), static_cast<double>(table.bytes()) / 1e6, o.dim,
               fmt::join(o.hidden, "-"), data.classes.size(), world.size(), o.batch, o.learning_rate, o.bucketing,
               o.codec, o.topology);
  int first_epoch = 1;
  if (!o.resume.empty()) {
    first_epoch = load_checkpoint(o.resume, table, model) + 1;
    exchange.step({}, {});  // the machine barrier: the loaded table is there for every local rank
    if (leader) fmt::print("resumed from {} after epoch {}\n", o.resume, first_epoch - 1);
  }
  std::vector<EpochReport> reports;
  with_dense_sync(o, world, [&](auto& sync) { reports = train(o, data, sync, exchange, table, model, first_epoch); });
  // Measured at the end, by each machine's local rank 0, while the others wait for it in one last
  // (empty) exchange step, the machine barrier, so that all of them are still there to measure.
  Pss pss;
  std::size_t trainers = 0;
  if (world.local().rank() == 0) {
    const std::vector<long> pids = machine_trainers(world.local());
    trainers = pids.size();
    for (const long pid : pids) {
      const Pss one = pss_of(pid);
      pss.total += one.total;
      pss.shmem += one.shmem;
    }
  }
  exchange.step({}, {});
  if (!leader) return 0;
  for (const auto& r : reports)
    fmt::print("epoch {}: test accuracy {:.4f} | loss {:.4f} | {:.1f} s, {:.0f} samples/s | {:.0f} distinct keys a "
               "step | rank 0 sent {:.1f} MB dense, {:.1f} MB sparse\n",
               r.epoch, r.test_accuracy, r.loss, r.seconds, r.samples_per_second, r.keys_per_step,
               static_cast<double>(r.dense_bytes_sent) / 1e6, static_cast<double>(r.sparse_bytes_sent) / 1e6);
  fmt::print("done: {} rows in the table ({:.1f} MB), this machine's {} trainer(s) hold {:.1f} MB (Pss), {:.1f} MB of it "
             "in shared memory\n",
             table.size(), static_cast<double>(table.bytes()) / 1e6, trainers, static_cast<double>(pss.total) / 1e6,
             static_cast<double>(pss.shmem) / 1e6);
  if (!o.json.empty()) {
    tk::Json epochs = tk::Json::array();
    for (const auto& r : reports)
      epochs.push_back({{"epoch", r.epoch},
                        {"steps", r.steps},
                        {"seconds", tk::rounded(r.seconds, 3)},
                        {"samples_per_second", tk::rounded(r.samples_per_second, 1)},
                        {"loss", tk::rounded(r.loss, 5)},
                        {"test_accuracy", tk::rounded(r.test_accuracy, 4)},
                        {"keys_per_step", tk::rounded(r.keys_per_step, 1)},
                        {"dense_bytes_sent", r.dense_bytes_sent},
                        {"dense_bytes_per_step", r.steps ? r.dense_bytes_sent / r.steps : 0},
                        {"sparse_bytes_sent", r.sparse_bytes_sent},
                        {"sparse_seconds", tk::rounded(r.sparse_seconds, 4)}});
    tk::write_json(o.json, {{"ranks", world.size()},
                            {"ranks_per_machine", world.local_size()},
                            {"batch_per_rank", o.batch},
                            {"train_packages", data.train.count()},
                            {"test_packages", data.test.count()},
                            {"classes", data.classes},
                            {"distinct_keys", data.distinct_keys},
                            {"table", table_options.describe()},
                            {"rows", o.rows},
                            {"dim", o.dim},
                            {"hidden", o.hidden},
                            {"learning_rate", tk::as_written(o.learning_rate)},
                            {"sparse_learning_rate", tk::as_written(o.sparse_learning_rate)},
                            {"optimizer", o.optimizer},
                            {"averaging", o.averaging},
                            {"table_placement", o.table},
                            {"seed", o.seed},
                            {"bucketing", o.bucketing},
                            {"codec", o.codec},
                            {"threshold", o.codec == "ef-two-bit" ? tk::Json(tk::as_written(o.threshold)) : tk::Json()},
                            {"topology", o.topology},
                            {"epochs", epochs},
                            {"table_keys", table.size()},
                            {"table_bytes", table.bytes()},
                            {"machine_trainers", trainers},
                            {"machine_pss_bytes", pss.total},
                            {"machine_pss_shmem_bytes", pss.shmem}});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  CLI::App app("Predicts a Debian package's section from its index entry, through a shared embedding table", "ctr");
  declare_options(app, o);
  if (!tk::parse_options(app, argc, argv)) return 0;
  return run(o);
} catch (const std::exception& e) {
  std::fprintf(stderr, "ctr: %s\n", e.what());
  return 1;
}
