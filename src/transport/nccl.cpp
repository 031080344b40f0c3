// transport::Nccl (include/gradsync/transport/nccl.hpp): setup over Tcp, device messages queued
// and handed to NCCL in groups, completion by CUDA events, failures as gradsync::Error.

#include "gradsync/transport/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cuda/check.hpp"
#include "cuda/on_device.hpp"
#include "gradsync/cuda/memory.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/launch/environment.hpp"

namespace gradsync::transport {

namespace {

// Nccl's own messages over its Tcp, in engine::ControlMessage::transports' range: the receive each
// rank keeps posted from every peer and nobody sends to (its failure is how a peer's death
// shows), and the setup's: each rank's GPU to rank 0, rank 0's verdict (ranks sharing a GPU, or
// the unique id) back.
enum class NcclMessage : std::uint32_t { watch = 0, uuid = 1, verdict = 2 };
constexpr std::uint64_t nccl_tag(NcclMessage m) {
  return engine::control_tag(0, engine::ControlMessage::transports, static_cast<std::uint32_t>(m));
}
constexpr std::uint64_t watch_tag = nccl_tag(NcclMessage::watch);

bool control_message(std::uint64_t tag) { return ((tag >> 32) & 0xffffu) == engine::control_bucket; }

std::string nccl_error_text(ncclResult_t result) {
  const char* last = ncclGetLastError(nullptr);
  return last && *last ? fmt::format("{} ({})", ncclGetErrorString(result), last) : std::string(ncclGetErrorString(result));
}

std::string uuid_text(const cuda::DeviceUuid& uuid) {
  std::string s = "GPU-";
  for (std::size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += fmt::format("{:02x}", static_cast<unsigned>(uuid[i]));
  }
  return s;
}

// What rank 0 sends every rank at setup: the ranks that share a GPU (-1: none) and the id.
struct Verdict {
  std::int32_t shared_a = -1;
  std::int32_t shared_b = -1;
  ncclUniqueId id{};
};

}  // namespace

namespace detail {

class NcclEngine {
 public:
  explicit NcclEngine(const NcclOptions& options) : tcp_(options.setup) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      throw Error(ErrorKind::invalid_argument, here("setup"),
                  "transport::Nccl needs a CUDA device, and this process sees none");
    }
    device_ = options.device >= 0 ? options.device : options.local_rank % devices;
    if (device_ >= devices)
      throw Error(ErrorKind::invalid_argument, here("setup"),
                  fmt::format("NcclOptions::device is {}, but this machine has {} CUDA devices", device_, devices));
    const cuda::detail::OnDevice on(device_, "setup");  // NCCL's communicator is made for the current device
    stream_.emplace(device_);
    join();
    watches_ = std::vector<Tcp::Request>(static_cast<std::size_t>(size()));
    for (int peer = 0; peer < size(); ++peer)
      if (peer != rank()) tcp_.recv(watches_[peer], peer, watch_tag, std::span<std::byte>(&watch_byte_, 1));
  }

  // Every operation was waited for or failed, so destroying the communicator waits for nothing.
  ~NcclEngine() {
    try {
      const cuda::detail::OnDevice on(device_, "close");
      if (comm_ && ncclCommDestroy(comm_) != ncclSuccess) ncclCommAbort(comm_);
    } catch (const Error&) {  // the device cannot be made current: nothing of it is left to close
    }
    if (allreduce_event_) cudaEventDestroy(allreduce_event_);
  }

  int rank() const noexcept { return tcp_.rank(); }
  int size() const noexcept { return tcp_.size(); }
  int device() const noexcept { return device_; }
  cuda::Stream& stream() noexcept { return *stream_; }

  // The same on every rank (the Synchronizer compares policies): no device index in it.
  std::string describe() const {
    int version = 0;
    ncclGetVersion(&version);
    return fmt::format("nccl {}.{}.{} ({} ranks, a GPU each)", version / 10000, version / 100 % 100, version % 100,
                       size());
  }

  void post(Nccl::Request& r, bool is_send, int peer, std::uint64_t tag, const std::byte* source,
            std::byte* destination, std::size_t bytes) {
    const char* operation = is_send ? "send" : "recv";
    if (r.sink_)
      throw Error(ErrorKind::unsupported, here(operation, peer),
                  "transport::Nccl completes requests in test() and wait() only; it cannot report them to a "
                  "CompletionSink (use the serial executor)");
    if (peer < 0 || peer >= size())
      throw Error(ErrorKind::invalid_argument, here(operation, peer), fmt::format("no rank {} of {}", peer, size()));
    std::lock_guard lock(mutex_);
    if (failure_) throw *failure_;
    r.start(is_send, peer, tag, source, destination, bytes);
    if (control_message(tag)) {
      r.way_ = Nccl::Request::Way::control;
      r.state_ = Nccl::Request::State::pending;
      if (is_send) tcp_.send(r.control_, peer, tag, {source, bytes});
      else tcp_.recv(r.control_, peer, tag, {destination, bytes});
      return;
    }
    const void* memory = is_send ? static_cast<const void*>(source) : destination;
    if (bytes != 0 && !on_this_device(memory))
      throw Error(ErrorKind::invalid_argument, here(operation, peer),
                  fmt::format("a message of {} bytes by NCCL must be in memory of cuda:{}, and this is not", bytes,
                              device_));
    if (!r.event_) {  // an event belongs to the device current when it is made: the stream's
      const cuda::detail::OnDevice on(device_, operation);
      cudaEvent_t event;
      cuda::detail::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), operation);
      r.event_ = event;
    }
    r.way_ = Nccl::Request::Way::device;
    r.state_ = Nccl::Request::State::pending;
    r.transferred_ = 0;
    queued_.push_back(&r);
    in_flight_.push_back(&r);
  }

  bool test(Nccl::Request& r) {
    std::unique_lock lock(mutex_);
    if (r.way_ == Nccl::Request::Way::control) {
      lock.unlock();
      if (!tcp_.test(r.control_)) return false;
      r.state_ = Nccl::Request::State::done;
      return true;
    }
    flush_if_queued_locked(r);
    poll_locked();
    return finished(r);
  }

  std::size_t wait(Nccl::Request& r, std::chrono::steady_clock::time_point deadline) {
    if (r.way_ == Nccl::Request::Way::control) {
      const std::size_t bytes = tcp_.wait(r.control_, deadline);
      r.state_ = Nccl::Request::State::done;
      return bytes;
    }
    std::unique_lock lock(mutex_);
    flush_if_queued_locked(r);
    for (;;) {
      poll_locked();
      if (finished(r)) return r.transferred_;
      if (std::chrono::steady_clock::now() >= deadline)
        fail_locked(Error(ErrorKind::timeout, here(r.is_send_ ? "send" : "recv", r.peer_),
                          fmt::format("no NCCL completion of {} bytes {} rank {} by the deadline; the communicator "
                                      "was aborted",
                                      r.size_, r.is_send_ ? "to" : "from", r.peer_)));
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
    }
  }

  void flush() {
    std::lock_guard lock(mutex_);
    flush_locked();
  }

  void abort(const Error& cause) {
    {
      std::lock_guard lock(mutex_);
      if (!failure_) {
        failure_ = cause;
        abort_communicator();
      }
    }
    tcp_.abort(cause);
  }

  std::span<std::byte> allocate(std::size_t bytes) {
    void* p = nullptr;
    const cuda::detail::OnDevice on(device_, "allocate");
    if (const cudaError_t status = cudaMalloc(&p, std::max<std::size_t>(bytes, 1)); status != cudaSuccess)
      throw Error(ErrorKind::internal, here("allocate"),
                  fmt::format("{} bytes on cuda:{}: {}", bytes, device_, cudaGetErrorString(status)));
    return {static_cast<std::byte*>(p), bytes};
  }

  void deallocate(std::span<std::byte> block) {
    try {
      const cuda::detail::OnDevice on(device_, "deallocate");
      if (cudaFree(block.data()) != cudaSuccess) cudaGetLastError();
    } catch (const Error&) {
    }
  }

  void allreduce(std::span<float> values, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    if (failure_) throw *failure_;
    if (!values.empty() && !on_this_device(values.data()))
      throw Error(ErrorKind::invalid_argument, here("allreduce"),
                  fmt::format("allreduce of {} values: they must be in memory of cuda:{}", values.size(), device_));
    flush_locked();
    const cuda::detail::OnDevice on(device_, "allreduce");
    auto s = static_cast<cudaStream_t>(stream_->native());
    nccl(ncclAllReduce(values.data(), values.data(), values.size(), ncclFloat, ncclSum, comm_, s), "allreduce", -1);
    if (!allreduce_event_) cuda::detail::check(cudaEventCreateWithFlags(&allreduce_event_, cudaEventDisableTiming), "allreduce");
    cuda::detail::check(cudaEventRecord(allreduce_event_, s), "allreduce");
    for (;;) {
      const cudaError_t status = cudaEventQuery(allreduce_event_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) fail_locked(cuda_failure(status, "allreduce", -1));
      cudaGetLastError();  // "not yet" is left as the thread's last error too: not for a launch to find
      check_health_locked();
      if (std::chrono::steady_clock::now() >= deadline)
        fail_locked(Error(ErrorKind::timeout, here("allreduce"),
                          fmt::format("allreduce of {} values not complete by the deadline; the communicator was aborted",
                                      values.size())));
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
    }
  }

 private:
  ErrorContext here(std::string operation, std::optional<int> peer = std::nullopt) const {
    return {.rank = rank(), .peer = peer, .operation = std::move(operation)};
  }

  bool on_this_device(const void* p) const {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) &&
           attributes.device == device_;
  }

  // Setup after TCP: UUIDs to rank 0, its verdict and the unique id back, then the communicator.
  void join() {
    const cuda::DeviceUuid uuid = cuda::device_uuid(device_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
    const std::uint64_t uuid_tag = nccl_tag(NcclMessage::uuid);
    const std::uint64_t verdict_tag = nccl_tag(NcclMessage::verdict);
    Verdict verdict;
    const auto verdict_bytes = std::as_writable_bytes(std::span(&verdict, 1));
    if (rank() == 0) {
      std::vector<cuda::DeviceUuid> uuids(static_cast<std::size_t>(size()));
      uuids[0] = uuid;
      std::vector<Tcp::Request> requests(static_cast<std::size_t>(size()));
      for (int peer = 1; peer < size(); ++peer)
        tcp_.recv(requests[peer], peer, uuid_tag, std::as_writable_bytes(std::span(uuids[peer])));
      for (int peer = 1; peer < size(); ++peer) tcp_.wait(requests[peer], deadline);
      for (int a = 0; a < size() && verdict.shared_a < 0; ++a)
        for (int b = a + 1; b < size() && verdict.shared_a < 0; ++b)
          if (uuids[a] == uuids[b]) verdict.shared_a = a, verdict.shared_b = b;
      if (verdict.shared_a < 0) nccl(ncclGetUniqueId(&verdict.id), "setup", -1);
      for (int peer = 1; peer < size(); ++peer) tcp_.send(requests[peer], peer, verdict_tag, verdict_bytes);
      for (int peer = 1; peer < size(); ++peer) tcp_.wait(requests[peer], deadline);
    } else {
      Tcp::Request request;
      tcp_.send(request, 0, uuid_tag, std::as_bytes(std::span(uuid)));
      tcp_.wait(request, deadline);
      tcp_.recv(request, 0, verdict_tag, verdict_bytes);
      tcp_.wait(request, deadline);
    }
    if (verdict.shared_a >= 0)
      throw Error(ErrorKind::invalid_argument, here("setup"),
                  fmt::format("ranks {} and {} are on the same GPU ({} is cuda:{} here): NCCL refuses two ranks on "
                              "one GPU (\"Duplicate GPU detected\"). Give each rank a GPU of its own (LOCAL_RANK "
                              "picks it), or share one GPU over transport::Tcp or SharedMemory",
                              verdict.shared_a, verdict.shared_b, uuid_text(uuid), device_));
    nccl(ncclCommInitRank(&comm_, size(), verdict.id, rank()), "setup", -1);
  }

  void nccl(ncclResult_t result, const char* operation, int peer) {
    if (result == ncclSuccess) return;
    throw Error(ErrorKind::internal, here(operation, peer >= 0 ? std::optional<int>(peer) : std::nullopt),
                fmt::format("NCCL: {}", nccl_error_text(result)));
  }

  Error cuda_failure(cudaError_t status, const char* operation, int peer) const {
    return Error(ErrorKind::internal, here(operation, peer >= 0 ? std::optional<int>(peer) : std::nullopt),
                 fmt::format("CUDA: {}", cudaGetErrorString(status)));
  }

  // A test or wait flushes only for a request still queued. NCCL completes a group as a whole and
  // runs a rank's groups in order, so a flush that split off a rank's later sends from the
  // receives that pair with its peer's sends could leave two ranks each waiting for the other's
  // next group (tests/test_topology.cpp plays the topologies' lists under these rules).
  void flush_if_queued_locked(const Nccl::Request& r) {
    if (std::find(queued_.begin(), queued_.end(), &r) != queued_.end()) flush_locked();
  }

  // Hands the queue to NCCL as one group and records each request's event after it.
  void flush_locked() {
    if (queued_.empty()) return;
    if (failure_) throw *failure_;
    const cuda::detail::OnDevice on(device_, "flush");
    auto s = static_cast<cudaStream_t>(stream_->native());
    ncclResult_t result = ncclGroupStart();
    for (Nccl::Request* r : queued_) {
      if (result != ncclSuccess) break;
      result = r->is_send_ ? ncclSend(r->source_, r->size_, ncclUint8, r->peer_, comm_, s)
                           : ncclRecv(r->destination_, r->size_, ncclUint8, r->peer_, comm_, s);
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (result == ncclSuccess) result = ended;
    if (result != ncclSuccess && result != ncclInProgress) {
      const Nccl::Request& first = *queued_.front();
      queued_.clear();
      fail_locked(Error(ErrorKind::internal, here(first.is_send_ ? "send" : "recv", first.peer_),
                        fmt::format("NCCL group of device messages: {}", nccl_error_text(result))));
    }
    for (Nccl::Request* r : queued_) cuda::detail::check(cudaEventRecord(static_cast<cudaEvent_t>(r->event_), s), "flush");
    queued_.clear();
  }

  // Marks finished what has finished; fails everything on NCCL's or a peer's failure.
  void poll_locked() {
    if (failure_) throw *failure_;
    for (std::size_t i = 0; i < in_flight_.size();) {
      Nccl::Request& r = *in_flight_[i];
      const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(r.event_));
      if (status == cudaErrorNotReady) {
        cudaGetLastError();  // left as the thread's last error too: not for a launch to find
        ++i;
        continue;
      }
      if (status != cudaSuccess) fail_locked(cuda_failure(status, r.is_send_ ? "send" : "recv", r.peer_));
      r.transferred_ = r.size_;
      r.state_ = Nccl::Request::State::done;
      in_flight_[i] = in_flight_.back();
      in_flight_.pop_back();
    }
    if (!in_flight_.empty()) check_health_locked();
  }

  // NCCL's asynchronous errors, and a peer whose TCP connection has gone.
  void check_health_locked() {
    ncclResult_t async = ncclSuccess;
    if (comm_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
      fail_locked(Error(ErrorKind::internal, here("nccl"), fmt::format("NCCL: {}", nccl_error_text(async))));
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      try {
        tcp_.test(watches_[peer]);
      } catch (const Error& e) {
        fail_locked(Error(ErrorKind::peer_failed, here("nccl", peer),
                          fmt::format("rank {} is gone ({}); the communicator was aborted", peer, e.what())));
      }
    }
  }

  bool finished(Nccl::Request& r) {
    if (r.state_ == Nccl::Request::State::failed || failure_) throw failure_ ? *failure_ : *r.error_;
    return r.state_ == Nccl::Request::State::done;
  }

  [[noreturn]] void fail_locked(Error e) {
    if (!failure_) {
      failure_ = e;
      abort_communicator();
    }
    for (Nccl::Request* r : in_flight_) {
      r->state_ = Nccl::Request::State::failed;
      r->error_ = *failure_;
    }
    in_flight_.clear();
    queued_.clear();
    throw *failure_;
  }

  void abort_communicator() {
    if (!comm_) return;
    try {
      const cuda::detail::OnDevice on(device_, "abort");
      ncclCommAbort(comm_);
    } catch (const Error&) {
    }
    comm_ = nullptr;
  }

  std::vector<Tcp::Request> watches_;  // per peer: the receive whose failure says it is gone
  std::byte watch_byte_{};
  Tcp tcp_;  // after the requests it may hold, so that it is gone before they are
  int device_ = 0;
  std::optional<cuda::Stream> stream_;
  ncclComm_t comm_ = nullptr;
  std::mutex mutex_;
  std::vector<Nccl::Request*> queued_;     // posted, not yet handed to NCCL
  std::vector<Nccl::Request*> in_flight_;  // handed to NCCL (or queued), not seen finished
  cudaEvent_t allreduce_event_ = nullptr;
  std::optional<Error> failure_;
};

}  // namespace detail

Nccl::Request::~Request() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

Nccl::Nccl(const NcclOptions& options) : engine_(std::make_unique<detail::NcclEngine>(options)) {}

NcclOptions Nccl::options_from_env() {
  NcclOptions options;
  options.setup = Tcp::options_from_env();
  options.local_rank = launch::from_environment().local_rank;
  return options;
}

Nccl::Nccl(Nccl&&) noexcept = default;
Nccl& Nccl::operator=(Nccl&&) noexcept = default;
Nccl::~Nccl() = default;

int Nccl::rank() const noexcept { return engine_->rank(); }
int Nccl::size() const noexcept { return engine_->size(); }
int Nccl::device() const noexcept { return engine_->device(); }
std::string Nccl::describe() const { return engine_->describe(); }
cuda::Stream& Nccl::cuda_stream() noexcept { return engine_->stream(); }

void Nccl::send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  engine_->post(request, true, peer, tag, bytes.data(), nullptr, bytes.size());
}
void Nccl::recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  engine_->post(request, false, peer, tag, nullptr, bytes.data(), bytes.size());
}
bool Nccl::test(Request& request) { return engine_->test(request); }
std::size_t Nccl::wait(Request& request, std::chrono::steady_clock::time_point deadline) {
  return engine_->wait(request, deadline);
}
void Nccl::abort(const Error& cause) { engine_->abort(cause); }
void Nccl::flush() { engine_->flush(); }
std::span<std::byte> Nccl::allocate(std::size_t bytes) { return engine_->allocate(bytes); }
void Nccl::deallocate(std::span<std::byte> block) { engine_->deallocate(block); }
void Nccl::allreduce(std::span<float> values, std::chrono::steady_clock::time_point deadline) {
  engine_->allreduce(values, deadline);
}

}  // namespace gradsync::transport
