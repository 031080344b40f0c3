// hybrid — a VGG-style CNN on Fashion-MNIST, its convolutional layers data-parallel on one ring
// of ranks and its fully connected layers on another, each conv rank paired with an fc rank (the
// third source document); or plain data parallelism of the same model, to compare.
//
//   gradsync-run -n 4 hybrid [--mode hybrid|data-parallel] [--updates background|after-wait]
//                            [--epochs E] [--batch B] [--lr R] [--momentum M] [--channels 8,16]
//                            [--hidden 1024,512] [--steps S] [--data DIR] [--json PATH] [--seed N]
//
// --batch is the global batch, the same in both modes. One process per rank over TCP (shared
// memory within a machine), placed by the launcher's variables; hybrid mode needs an even number
// of ranks. Rank 0 prints progress and the test accuracy; the JSON has the job's bytes per step.

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "toolkit/connect.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/progress.hpp"
#include "trainer.hpp"

namespace {

namespace tk = gradsync::toolkit;

struct Options {
  hybrid::Config train{.evaluate = true};
  std::string mode = "hybrid";
  std::string updates = "background";
  std::vector<std::size_t> channels{8, 16};
  std::vector<std::size_t> hidden{1024, 512};
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string json;
};

void declare_options(CLI::App& app, Options& o) {
  tk::add_choice(app, "--mode", o.mode, "which ranks train which layers", {"hybrid", "data-parallel"});
  tk::add_choice(app, "--updates", o.updates, "where each layer's SGD step runs: as soon as its average is in, "
                 "or after wait()", {"background", "after-wait"});
  tk::add_number(app, "--epochs", o.train.epochs, "passes over the training set", {.low = 1});
  tk::add_number(app, "--batch", o.train.batch, "samples per step, over the whole job", {.low = 1});
  tk::add_number(app, "--lr", o.train.learning_rate, "learning rate", {.low = 0, .low_open = true});
  tk::add_number(app, "--momentum", o.train.momentum, "momentum", {.low = 0, .high = 1, .high_open = true});
  tk::add_sizes(app, "--channels", o.channels,
                "per VGG block (two 3x3 convolutions, then 2x2 pooling), its channels");
  tk::add_sizes(app, "--hidden", o.hidden, "the fully connected hidden layers' sizes");
  tk::add_number(app, "--steps", o.train.max_steps, "steps per epoch (0: the whole training set)");
  app.add_option("--data", o.data, "the directory of the Fashion-MNIST files")->capture_default_str();
  app.add_option("--json", o.json, "also write the results as JSON to this file");
  tk::add_number(app, "--seed", o.train.seed, "seeds the model and the shuffling");
  app.footer("Start it with gradsync-run (or torchrun, mpirun, srun) for several ranks.");
}

std::vector<double> rounded(const std::vector<double>& values, int decimals) {
  std::vector<double> out;
  for (double v : values) out.push_back(tk::rounded(v, decimals));
  return out;
}

int run(Options& o) {
  o.train.mode = o.mode == "hybrid" ? hybrid::Mode::hybrid : hybrid::Mode::data_parallel;
  o.train.updates = o.updates == "background" ? hybrid::Updates::background : hybrid::Updates::after_wait;
  tk::JobTransport world = tk::connect_or_alone();
  const bool leader = world.rank() == 0;
  const fmnist::Dataset train_set = fmnist::load_split(o.data, true);
  const fmnist::Dataset test_set = fmnist::load_split(o.data, false);
  hybrid::Model model(28, o.channels, o.hidden, o.train.seed);
  const std::size_t fc_parameters = model.fc.parameters();
  if (leader)
    fmt::print("hybrid: {} ranks, {} | global batch {} | conv blocks {} -> {} features, fc {} | {} parameters "
               "({} in fc) | updates {} | lr {} momentum {}\n",
               world.size(), o.mode, o.train.batch, fmt::join(o.channels, ","), model.conv.features(),
               fmt::join(o.hidden, ","), model.parameters(), fc_parameters, o.updates, o.train.learning_rate,
               o.train.momentum);
  const auto reports = hybrid::train(world, model, train_set, leader ? &test_set : nullptr, o.train,
                                     leader ? tk::progress_printer() : hybrid::Progress{});
  if (!leader) return 0;
  tk::Json epochs = tk::Json::array();
  for (const auto& r : reports) {
    fmt::print("epoch {}: test accuracy {:.4f} | {:.1f} s, {:.0f} samples/s, {:.1f} ms a step | rank 0 waited on "
               "synchronization {:.1f} s | updates after wait, by rank: {:.2f} s | {:.2f} MB on the wire a step "
               "(all ranks)\n",
               r.epoch, r.test_accuracy, r.seconds, r.samples_per_second, 1e3 * r.seconds / static_cast<double>(r.steps),
               r.exposed_seconds, fmt::join(r.rank_update_seconds, " "), r.job_bytes_per_step / 1e6);
    epochs.push_back({{"epoch", r.epoch},
                      {"steps", r.steps},
                      {"seconds", tk::rounded(r.seconds, 3)},
                      {"step_ms", tk::rounded(1e3 * r.seconds / static_cast<double>(r.steps), 3)},
                      {"samples_per_second", tk::rounded(r.samples_per_second, 1)},
                      {"loss", tk::rounded(r.loss, 5)},
                      {"test_accuracy", tk::rounded(r.test_accuracy, 4)},
                      {"exposed_seconds", tk::rounded(r.exposed_seconds, 3)},
                      {"rank0_pair_bytes", r.pair_bytes},
                      {"rank_bytes_sent", r.rank_bytes_sent},
                      {"rank_update_seconds", rounded(r.rank_update_seconds, 4)},
                      {"job_bytes_per_step", tk::rounded(r.job_bytes_per_step, 1)}});
  }
  if (!o.json.empty())
    tk::write_json(o.json, {{"ranks", world.size()},
                            {"mode", o.mode},
                            {"updates", o.updates},
                            {"global_batch", o.train.batch},
                            {"channels", o.channels},
                            {"hidden", o.hidden},
                            {"parameters", model.parameters()},
                            {"fc_parameters", fc_parameters},
                            {"learning_rate", tk::as_written(o.train.learning_rate)},
                            {"momentum", tk::as_written(o.train.momentum)},
                            {"seed", o.train.seed},
                            {"epochs", epochs}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  CLI::App app("A VGG-style CNN on Fashion-MNIST: hybrid data/model parallelism on two rings, or data parallelism",
               "hybrid");
  declare_options(app, o);
  if (!tk::parse_options(app, argc, argv)) return 0;
  return run(o);
} catch (const std::exception& e) {
  std::fprintf(stderr, "hybrid: %s\n", e.what());
  return 1;
}
