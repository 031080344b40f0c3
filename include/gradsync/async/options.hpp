#pragma once
// async::Options and async::StepReport: the asynchronous parameter server's settings (the top of
// async/synchronizer.hpp says what each does) and what one wait() applied.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/types.hpp"

namespace gradsync::async {

struct Options {
  int staleness = 0;  // s: iterations an applied global gradient may lag the worker's own
  int quorum = 0;     // M: pushes that close an iteration; 0 means every worker (N)
  int period = 0;     // K: parameters averaged every K iterations; 0: never
  std::chrono::milliseconds timeout = std::chrono::minutes(2);  // every wait of the trainer's
  // Chrome trace events of this rank (the top of async/synchronizer.hpp), written when the
  // synchronizer is destroyed to this path with the rank inserted before ".json"; empty: the
  // environment variable GRADSYNC_TIMELINE if set, else no timeline.
  std::string timeline{};
  std::size_t timeline_events = std::size_t{1} << 18;  // kept at most (1 to 2^27); later ones are dropped
};

// What the last wait() applied, part by part, and what this rank's server did so far.
struct StepReport {
  std::uint64_t iteration = 0;
  int age = 0;               // max over parts of iteration - the newest global gradient applied so far
  int local_parts = 0;       // parts where this iteration's own gradient stood in (its global had not come)
  std::vector<std::int64_t> applied;  // per part: the newest global gradient applied now, -1 for none
  std::vector<std::uint64_t> contributors;  // per part: the workers its server used for it, bit w = worker w
  std::uint64_t skipped_globals = 0;  // so far: global gradients this worker never got (pulled too late)
  std::uint64_t summed_replies = 0;   // so far: replies that brought this worker several global gradients summed
  std::uint64_t dropped_pushes = 0;  // this rank's server, so far: pushes that came after their iteration closed
  std::chrono::nanoseconds blocked{0};  // wait() blocked for a new enough global gradient
  std::uint64_t bytes_sent = 0;         // by this rank to others since the wait() before (worker and server)
  std::uint64_t lost_workers = 0;       // ranks found dead so far (bit w = group rank w), left behind
};

// Throws Error(invalid_argument or unsupported), naming `rank`, where `options` do not fit a job of
// `workers` ranks. Compiled once, in src/options.cpp.
void check(const Options& options, int workers, int rank);
// Throws Error(unsupported), naming `rank`, for a gradient the server cannot average (f64).
void check_gradient(const std::string& name, DType dtype, int rank);

}  // namespace gradsync::async
