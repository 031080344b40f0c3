#pragma once
// A training loop's progress: a bar redrawn in place on a terminal; on anything else (gradsync-run,
// logs) a line every tenth of the epoch.

#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>

#include <fmt/format.h>

namespace gradsync::toolkit {

// progress(epoch, step, steps, samples_per_second, loss), as the example trainers call it.
inline std::function<void(int, std::size_t, std::size_t, double, double)> progress_printer() {
  const bool terminal = ::isatty(STDOUT_FILENO);
  return [terminal, last_tenth = std::size_t{0}](int epoch, std::size_t step, std::size_t steps, double rate,
                                                 double loss) mutable {
    const std::size_t tenth = step * 10 / steps;
    if (!terminal && tenth == last_tenth && step != steps) return;
    last_tenth = step == steps ? 0 : tenth;
    constexpr int width = 30;
    const int filled = static_cast<int>(width * step / steps);
    fmt::print("{}epoch {} [{}{}] {:>5}/{} steps  {:>7.0f} samples/s  loss {:.4f}{}", terminal ? "\r" : "", epoch,
               std::string(static_cast<std::size_t>(filled), '#'), std::string(static_cast<std::size_t>(width - filled), '.'),
               step, steps, rate, loss, terminal && step != steps ? "" : "\n");
    std::fflush(stdout);
  };
}

}  // namespace gradsync::toolkit
