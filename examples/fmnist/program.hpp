#pragma once
// What fmnist's main.cpp and device.cpp (the model on a GPU) share: the program's options, and
// training through a Synchronizer with rank 0's report.

#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/gradsync.hpp"
#include "toolkit/codec_by_name.hpp"
#include "toolkit/json.hpp"
#include "toolkit/progress.hpp"
#include "report.hpp"
#include "trainer.hpp"

namespace fmnist::program {

namespace gs = gradsync;
namespace tk = gradsync::toolkit;

struct Options {
  TrainConfig train;
  std::string bucketing = "fixed-size";
  std::string codec = "none";
  // Two-bit's threshold for this model's gradients (the library's default, MXNet's 0.5, is for
  // larger ones); see results/README.md for how it was chosen.
  tk::CodecSettings codec_settings{.threshold = 0.1f};
  std::vector<std::size_t> hidden{256, 128};
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string json;
  std::string topology = "auto";
  std::size_t servers = 0;
  bool dedicated = false;
  gs::async::Options asynchronous{.timeout = std::chrono::minutes(2)};
  bool is_asynchronous = false;  // any of --staleness, --quorum, --period given
  std::string executor = "task-graph";
  std::string device = "cpu";  // or "cuda": the model on a GPU (device.cpp)
  bool ipc = false;            // --device cuda: ranks sharing a GPU exchange through CUDA IPC
  bool nccl = false;           // --device cuda: transport::Nccl rather than CudaStaged
};

// The Synchronizer's options from the program's.
inline gs::Options sync_options(const Options& o) {
  return {.timeout = std::chrono::minutes(2),
          .executor = o.executor == "serial" ? gs::Executor::serial : gs::Executor::task_graph};
}

inline constexpr auto in_host_memory = [](Mlp& model) -> Mlp& { return model; };

// The last step's schedule per bucket (IterationStats::schedules), where the synchronizer reports
// them: the asynchronous parameter server runs no schedule of buckets.
template <class Sync>
tk::Json schedules_of(const Sync& sync) {
  if constexpr (requires { sync.last_iteration(); })
    return tk::schedules_json(sync.last_iteration());
  else
    return tk::Json();
}

// Trains through `sync`, then prints and writes what rank 0 measured. `throughput` turns the
// epochs' reports into every worker's samples per second added up (with an asynchronous
// parameter server each worker has its own pace). `place(model)` gives the model to train from the
// one built here: by default that model itself, in host memory; device.cpp's, its copy on a GPU.
template <class Sync, class Throughput, class Place = decltype(in_host_memory)>
int train_and_report(const Options& o, Sync& sync, std::size_t workers, const std::string& codec,
                     const std::string& topology, Throughput throughput, Place place = in_host_memory) {
  const bool leader = sync.rank() == 0;
  TrainConfig train = o.train;
  train.workers = workers;
  const Dataset train_set = load_split(o.data, true);
  const Dataset test_set = load_split(o.data, false);
  std::vector<std::size_t> sizes{train_set.pixels};
  sizes.insert(sizes.end(), o.hidden.begin(), o.hidden.end());
  sizes.push_back(10);
  Mlp model(sizes, o.train.seed);
  const std::size_t gradient_bytes = model.parameters() * sizeof(float);
  if (leader)
    fmt::print("fmnist: {} workers x batch {}{} | MLP {} ({} parameters, {:.2f} MB of f32 gradients a step) | "
               "bucketing {} | codec {} | {} | lr {} momentum {}\n",
               train.workers, o.train.batch,
               train.workers < static_cast<std::size_t>(sync.size())
                   ? fmt::format(" + {} dedicated server(s)", static_cast<std::size_t>(sync.size()) - train.workers)
                   : "",
               fmt::join(sizes, "-"), model.parameters(), gradient_bytes / 1e6, o.bucketing, codec, topology,
               o.train.learning_rate, o.train.momentum);
  auto&& placed = place(model);
  auto reports = fmnist::train(sync, placed, train_set, leader ? &test_set : nullptr, train,
                               leader ? tk::progress_printer() : Progress{});
  throughput(reports);
  if (!leader) return 0;
  print_epochs(reports, sync.size());
  if (!o.json.empty()) {
    tk::write_json(o.json, {{"ranks", sync.size()},
                            {"workers", train.workers},
                            {"batch_per_rank", o.train.batch},
                            {"layers", sizes},
                            {"parameters", model.parameters()},
                            {"bucketing", o.bucketing},
                            {"codec", codec},
                            {"topology", topology},
                            {"schedules", schedules_of(sync)},
                            {"device", o.device},
                            {"executor", o.executor},
                            {"staleness", o.is_asynchronous ? tk::Json(o.asynchronous.staleness) : tk::Json()},
                            {"quorum", o.is_asynchronous ? tk::Json(o.asynchronous.quorum ? o.asynchronous.quorum
                                                                                          : sync.size())
                                                         : tk::Json()},
                            {"period", o.is_asynchronous ? tk::Json(o.asynchronous.period) : tk::Json()},
                            {"slow_rank", o.train.slow_rank},
                            {"slow_factor", o.train.slow_factor},
                            {"learning_rate", tk::as_written(o.train.learning_rate)},
                            {"momentum", tk::as_written(o.train.momentum)},
                            {"epochs", epochs_json(reports)}});
  }
  return 0;
}

// fmnist --device cuda (device.cpp, built where gradsync has CUDA and cuBLAS is found): trains
// the model on this rank's GPU, LOCAL_RANK modulo the devices it sees.
int train_on_device(const Options& o);

}  // namespace fmnist::program
