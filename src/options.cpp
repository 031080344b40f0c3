#include "gradsync/options.hpp"

#include "gradsync/async/options.hpp"

#include <fmt/format.h>

#include "gradsync/detail/settings.hpp"
#include "gradsync/error.hpp"
#include "gradsync/timeline.hpp"

namespace gradsync {

void check(const Options& options, const PolicyAbilities& policies) {
  const ErrorContext where{.rank = policies.rank, .operation = "options"};
  const auto invalid = [&](std::string why) { return Error(ErrorKind::invalid_argument, where, std::move(why)); };
  const auto unsupported = [&](std::string why) { return Error(ErrorKind::unsupported, where, std::move(why)); };
  if (options.timeout <= std::chrono::milliseconds::zero())
    throw invalid(fmt::format("timeout is {} ms; it must be above 0", options.timeout.count()));
  if (options.compute_threads < 1)
    throw invalid(fmt::format("compute_threads is {}; the task graph needs at least 1", options.compute_threads));
  if (options.selective_compression && !policies.pipeline_topology)
    throw unsupported(fmt::format("selective compression needs a topology with shape() and chunk_elements (a "
                                  "PipelineTopology, concepts.hpp); {} has not",
                                  policies.topology));
  if (options.coordination.enabled && options.executor != Executor::task_graph)
    throw invalid("coordinated sends need the task-graph executor");
  if (policies.device_transport) {
    // Coordination's reports and grants are host messages timed against host-memory sends.
    if (options.coordination.enabled)
      throw unsupported(fmt::format("coordinated sends are not supported over {}: buckets there travel from device "
                                    "memory",
                                    policies.transport));
    // Encodes share the stream's scratch (one-bit's sums, a scale) in launch order, which several
    // threads launching would interleave.
    if (options.compute_threads != 1)
      throw unsupported(fmt::format("compute_threads is {}; over {} the task graph's compute runs on one thread, "
                                    "queueing kernels on one stream",
                                    options.compute_threads, policies.transport));
    // Calibration times transfers of host memory, which is not what buckets take over it.
    if (options.selective_compression)
      throw unsupported(fmt::format("selective compression cannot calibrate over {}: it times host-memory "
                                    "transfers, and buckets there travel from device memory",
                                    policies.transport));
  }
  if (options.coordination.enabled && options.coordination.window < 1)
    throw invalid(fmt::format("coordination window is {}; at least one batch per link must be allowed",
                              options.coordination.window));
  if (options.spin_before_sleep < std::chrono::microseconds::zero() ||
      options.spin_before_sleep > std::chrono::milliseconds(10))
    throw invalid(fmt::format("spin_before_sleep is {} us; it must be between 0 and 10000",
                              options.spin_before_sleep.count()));
  if (options.spin_before_sleep.count() > 0 && options.executor != Executor::task_graph)
    throw invalid("spin_before_sleep is how the task graph's threads wait; the serial executor has none");
  if (options.timeline_events < 1 || options.timeline_events > Timeline::max_capacity)
    throw invalid(fmt::format("timeline_events is {}; it must be between 1 and {}", options.timeline_events,
                              Timeline::max_capacity));
}

}  // namespace gradsync

namespace gradsync::async {

void check(const Options& options, int workers, int rank) {
  const ErrorContext where{.rank = rank, .operation = "options"};
  const int quorum = options.quorum == 0 ? workers : options.quorum;
  if (options.staleness < 0 || quorum < 1 || quorum > workers || options.period < 0)
    throw Error(ErrorKind::invalid_argument, where,
                fmt::format("staleness {} (>= 0), quorum {} (0 or 1..{}) and period {} (>= 0) do not fit",
                            options.staleness, options.quorum, workers, options.period));
  if (workers > 64)
    throw Error(ErrorKind::unsupported, where, fmt::format("{} workers; contributor masks hold 64", workers));
  gradsync::detail::check_setting(options.timeout.count() > 0, "async::Options", "timeout",
                                  fmt::format("{} ms", options.timeout.count()), "more than 0 ms");
  gradsync::detail::check_setting(options.timeline_events >= 1 && options.timeline_events <= Timeline::max_capacity,
                                  "async::Options", "timeline_events", options.timeline_events,
                                  fmt::format("between 1 and {}", Timeline::max_capacity));
}

void check_gradient(const std::string& name, DType dtype, int rank) {
  if (accumulation_dtype(dtype) != DType::f32)
    throw Error(ErrorKind::unsupported, {.rank = rank, .operation = "add"},
                fmt::format("gradient {:?} is {}; the asynchronous parameter server averages f32, f16 and bf16 "
                            "gradients (in f32)",
                            name, to_string(dtype)));
}

}  // namespace gradsync::async
