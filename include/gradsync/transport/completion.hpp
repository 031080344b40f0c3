#pragma once
// CompletionSink — where a transport reports each finished request, for callers that keep many
// requests in flight and cannot block on one at a time (the task-graph engine). A request reports
// to the sink given with report_to() once per posting, when it completes or fails, before wait()
// or test() can observe the outcome.
//
// The report says only which request finished. Its bytes or its Error come from wait(), which then
// returns at once; that wait is also how the caller learns that the transport has let go of the
// request (InProcess, SharedMemory and Mpi report before their last write to it, so that the sink
// hears while the request is certainly alive), and only then may the request be posted again.

#include <cstdint>

namespace gradsync::transport {

class CompletionSink {
 public:
  // Called from the transport's own threads (or another rank's, in process), possibly under the
  // transport's locks: it must return quickly and must not call back into the transport.
  virtual void completed(std::uint64_t id) noexcept = 0;

 protected:
  ~CompletionSink() = default;
};

}  // namespace gradsync::transport
