#pragma once
// What the Fashion-MNIST trainers (fmnist, libtorch-fmnist) print and write about their epochs:
// on rank 0 a line per epoch and a closing "done:" line, and the epochs as JSON.

#include <vector>

#include <fmt/format.h>

#include "toolkit/json.hpp"
#include "trainer.hpp"

namespace fmnist {

inline void print_epochs(const std::vector<EpochReport>& reports, int ranks) {
  double seconds = 0, exposed = 0, samples = 0;
  for (const auto& r : reports) {
    const double steps = r.steps ? static_cast<double>(r.steps) : 1.0;
    fmt::print("epoch {}: test accuracy {:.4f} | {:.1f} s, {:.0f} samples/s, {:.1f} ms a step | waiting on "
               "synchronization {:.1f} s ({:.0f}% of the time) | {:.1f} MB sent by rank 0 ({:.2f} MB a step)\n",
               r.epoch, r.test_accuracy, r.seconds, r.samples_per_second, 1e3 * r.seconds / steps, r.exposed_seconds,
               100 * r.exposed_seconds / r.seconds, static_cast<double>(r.bytes_sent) / 1e6,
               static_cast<double>(r.bytes_sent) / 1e6 / steps);
    seconds += r.seconds;
    samples += r.samples_per_second * r.seconds;
    exposed += r.exposed_seconds;
  }
  fmt::print("done: {} ranks, {} epochs, test accuracy {:.4f}, {:.0f} samples/s, {:.0f}% of step time waiting on "
             "synchronization\n",
             ranks, reports.size(), reports.back().test_accuracy, samples / seconds, 100 * exposed / seconds);
}

inline gradsync::toolkit::Json epochs_json(const std::vector<EpochReport>& reports) {
  namespace tk = gradsync::toolkit;
  tk::Json epochs = tk::Json::array();
  for (const auto& r : reports)
    epochs.push_back({{"epoch", r.epoch},
                      {"steps", r.steps},
                      {"seconds", tk::rounded(r.seconds, 3)},
                      {"step_seconds", tk::rounded(r.steps ? r.seconds / static_cast<double>(r.steps) : 0.0, 5)},
                      {"samples_per_second", tk::rounded(r.samples_per_second, 1)},
                      {"loss", tk::rounded(r.loss, 5)},
                      {"test_accuracy", tk::rounded(r.test_accuracy, 4)},
                      {"exposed_seconds", tk::rounded(r.exposed_seconds, 3)},
                      {"bytes_sent", r.bytes_sent},
                      {"max_age", r.max_age},
                      {"local_parts_per_step", tk::rounded(r.local_parts, 3)}});
  return epochs;
}

}  // namespace fmnist
