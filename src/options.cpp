#include "gradsync/options.hpp"

#include <fmt/format.h>

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
  if (options.timeline_events < 1 || options.timeline_events > Timeline::max_capacity)
    throw invalid(fmt::format("timeline_events is {}; it must be between 1 and {}", options.timeline_events,
                              Timeline::max_capacity));
}

}  // namespace gradsync
