#pragma once
// The shipped combinations: every Synchronizer a launched job can pick at run time, compiled once
// in the companion library gradsync_shipped (dependency 'gradsync-shipped'), behind one interface.
//
// For programs whose policies are options (a command line, a Python call): they pass a bucketing
// policy, a codec and a topology as values of the variants below to make_synchronizer() and link
// the library, instead of compiling every combination themselves (3 x 12 x 3 Synchronizers, the
// larger part of what such a program costs to build). A program that names its policies in its
// source uses Synchronizer<...> directly, as before; one combination compiles in seconds.

#include <functional>
#include <memory>
#include <string>
#include <variant>

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/bucketing/per_tensor.hpp"
#include "gradsync/bucketing/time_clustered.hpp"
#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/random_k.hpp"
#include "gradsync/compression/terngrad.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/options.hpp"
#include "gradsync/plan.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/topology/auto.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/parameter_server.hpp"
#include "gradsync/transport/routed.hpp"
#include "gradsync/transport/shared_memory.hpp"
#include "gradsync/transport/tcp.hpp"
#include "gradsync/types.hpp"

namespace gradsync {

// The ranks of a launched job: shared memory between the ranks of one machine, TCP across machines.
using JobTransport = transport::Routed<transport::SharedMemory, transport::Tcp>;

namespace shipped {

// The first alternative of each is the default, as Synchronizer's defaults are.
using Bucketing = std::variant<bucketing::FixedSize, bucketing::PerTensor, bucketing::TimeClustered>;
using Codec = std::variant<compression::None, compression::Fp16, compression::Bf16, compression::TwoBit,
                           compression::OneBit, compression::TernGrad<>, compression::TopK, compression::RandomK,
                           compression::ErrorFeedback<compression::TwoBit>, compression::ErrorFeedback<compression::OneBit>,
                           compression::ErrorFeedback<compression::TopK>, compression::ErrorFeedback<compression::RandomK>>;
// Auto first: a program that picks no topology gets the per-bucket choice; the ring, recursive
// doubling and halving-doubling are Auto pinned to them (auto.hpp), so each costs no build of its own.
using Topology = std::variant<topology::Auto<>, topology::ParameterServer, topology::Hierarchical>;

}  // namespace shipped

// A Synchronizer whose policies were picked at run time: the same calls, with the same meaning
// (synchronizer.hpp), made through a virtual table.
class AnySynchronizer {
 public:
  virtual ~AnySynchronizer() = default;

  virtual GradId add(std::string name, TensorView gradient) = 0;
  virtual void on_averaged(std::function<void(GradId)> update) = 0;
  virtual void ready(GradId id) = 0;
  virtual void wait() = 0;
  virtual bool try_wait() = 0;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual const Group& group() const noexcept = 0;
  virtual const Layout& layout() const noexcept = 0;
  virtual const BucketPlan& plan() const noexcept = 0;
  virtual const IterationStats& last_iteration() const noexcept = 0;
};

// Synchronizer<B, C, T, JobTransport> for the policies the three values hold, averaging over every
// rank of `transport`.
std::unique_ptr<AnySynchronizer> make_synchronizer(JobTransport transport, Options options = {},
                                                   shipped::Bucketing bucketing = {}, shipped::Codec codec = {},
                                                   shipped::Topology topology = {});

}  // namespace gradsync
