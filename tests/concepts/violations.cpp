// Each CASE names a Synchronizer with one policy that breaks its concept; the build must stop
// with the concept's name in the message (tests/concepts/check.sh). CASE 5 names an asynchronous
// parameter server over a transport it cannot take, which must stop with its reason. CASE 0 is
// the control that must compile.

#include "gradsync/gradsync.hpp"

namespace gs = gradsync;

struct CodecWithoutDecode {  // has everything but decode()
  struct State {};
  static constexpr bool identity = false, lossless = true;
  std::string describe() const { return "broken"; }
  State make_state(std::size_t, gs::DType) const { return {}; }
  std::size_t max_encoded_bytes(std::size_t n, gs::DType) const { return n; }
  template <class T>
  std::size_t encode(std::span<const T>, State&, std::span<std::byte>) const { return 0; }
};

struct TransportWithoutAbort {
  struct Request {};
  int rank() const { return 0; }
  int size() const { return 1; }
  std::string describe() const { return "broken"; }
  void send(Request&, int, std::uint64_t, std::span<const std::byte>) {}
  void recv(Request&, int, std::uint64_t, std::span<std::byte>) {}
  bool test(Request&) { return true; }
  std::size_t wait(Request&, std::chrono::steady_clock::time_point) { return 0; }
};

struct BucketingWithoutPlan {
  std::string describe() const { return "broken"; }
};

struct TopologyWithWrongSchedule {
  std::string describe() const { return "broken"; }
  int schedule(const gs::Group&, std::size_t, gs::CodecTraits) const { return 0; }
};

// InProcess, claiming to match messages in posting order as transport::Nccl does.
struct OrderMatchedInProcess : gs::transport::InProcess {
  static constexpr bool matches_by_order = true;
};

using gs::bucketing::PerTensor;
using gs::compression::None;
using gs::topology::Ring;
using gs::transport::InProcess;

#if CASE == 0
using Sync = gs::Synchronizer<PerTensor, None, Ring, InProcess>;
#elif CASE == 1
using Sync = gs::Synchronizer<PerTensor, CodecWithoutDecode, Ring, InProcess>;
#elif CASE == 2
using Sync = gs::Synchronizer<PerTensor, None, Ring, TransportWithoutAbort>;
#elif CASE == 3
using Sync = gs::Synchronizer<BucketingWithoutPlan, None, Ring, InProcess>;
#elif CASE == 4
using Sync = gs::Synchronizer<PerTensor, None, TopologyWithWrongSchedule, InProcess>;
#elif CASE == 5
using Sync = gs::async::Synchronizer<PerTensor, None, OrderMatchedInProcess>;
#endif

int main() { return sizeof(Sync) > 0 ? 0 : 1; }
