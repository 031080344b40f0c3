#pragma once
// transport::CudaStaged<X> — device memory over a host transport (Tcp, SharedMemory, Routed):
// the device path of the exchange (buckets on the GPU, the codecs as kernels; engine/exchange.hpp)
// for ranks that have no NCCL between them, such as several processes sharing one GPU, or GPUs
// whose machines only TCP connects. Declared where gradsync was built with CUDA (GRADSYNC_HAS_CUDA).
//
// allocate() hands out device memory of the chosen GPU and keeps, for each block, a page-locked
// host mirror of the same size (from X's own allocate() where it has one, so SharedMemory's arena
// still makes a message one memcpy). A send of bytes inside such a block queues their copy to the
// mirror on a stream of its own, after the kernels queued on cuda_stream() so far (the encode that
// wrote them), and returns: the next encode runs while the copy engine copies. The mirror goes to
// X once its copy is done, in the order the sends were posted: every test() posts those whose
// copies are done, every wait() posts them all, blocking on each copy in turn (copies wait for
// nothing but queued kernels, so this cannot hang on a peer, and the first pieces travel while
// later ones are still copied). A receive lands in the mirror; once X reports it complete (test
// or wait), a copy to the device is queued on cuda_stream(), ahead of whatever the caller queues
// next (the decode that reads it). Any other buffer (the control messages, in host memory) passes
// through to X untouched; device memory that allocate() did not hand out is refused.
//
// A send's device bytes must stay as they are until it completes (test or wait), as any
// transport's; the schedules' `after` orders every write to a range behind the sends of it.
//
// Messages match by tag as X's do, so every topology runs over it, on either executor: the
// serial one sees completions in test() and wait(), the task graph hears of them from X and calls
// post_deferred() for the sends held back (DeferredSender, concepts.hpp). Failures, timeouts and a dead peer are X's; a send whose deferred post fails (its
// copy, or X refusing it after an abort) throws that Error from its own test() or wait(). abort()
// may come from any thread, as X's may: it only aborts X, and the posting thread meets it.
//
//   using Staged = gradsync::transport::CudaStaged<gradsync::transport::Tcp>;
//   Staged transport(gradsync::transport::Tcp::from_env(), local_rank % device_count);

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/cuda/memory.hpp"
#include "gradsync/error.hpp"
#include "gradsync/transport/tcp.hpp"

namespace gradsync::transport {

template <TransportPolicy X>
class CudaStaged {
 public:
  class Request {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    ~Request() {
      if (waiting_in_) waiting_in_->forget(*this);
    }
    void report_to(CompletionSink* sink, std::uint64_t id) noexcept {
      inner_.report_to(sink, id);
      sink_ = sink;
      sink_id_ = id;
    }

   private:
    friend class CudaStaged;
    typename X::Request inner_;
    std::byte* device_ = nullptr;  // a staged receive's destination; null otherwise
    const std::byte* mirror_ = nullptr;
    std::size_t size_ = 0;
    bool landed_ = false;  // its copy to the device is queued
    // A staged send: its copy to the mirror, recorded after it; X's send is posted once it is done.
    cuda::Event copied_;
    CudaStaged* waiting_in_ = nullptr;  // while its copy is not done or its X send not posted
    int peer_ = -1;
    std::uint64_t tag_ = 0;
    std::optional<Error> failure_;  // its deferred post failed: what test() and wait() throw
    CompletionSink* sink_ = nullptr;  // told of that failure, as X would be of X's own
    std::uint64_t sink_id_ = 0;
  };

  // Device memory on CUDA device `device`; messages through `inner`.
  CudaStaged(X inner, int device)
      : inner_(std::move(inner)),
        device_(device),
        stream_(std::make_unique<cuda::Stream>(device)),
        copies_(std::make_unique<cuda::Stream>(device)) {}
  CudaStaged(CudaStaged&& o) noexcept
      : inner_(std::move(o.inner_)),
        device_(o.device_),
        stream_(std::move(o.stream_)),
        copies_(std::move(o.copies_)),
        blocks_(std::exchange(o.blocks_, {})),
        unposted_(std::exchange(o.unposted_, {})) {
    for (Request* r : unposted_) r->waiting_in_ = this;
  }
  CudaStaged& operator=(CudaStaged&& o) noexcept {
    if (this != &o) {
      drop_unposted();
      for (const Block& b : blocks_) release(b);
      inner_ = std::move(o.inner_);
      device_ = o.device_;
      stream_ = std::move(o.stream_);
      copies_ = std::move(o.copies_);
      blocks_ = std::exchange(o.blocks_, {});
      unposted_ = std::exchange(o.unposted_, {});
      for (Request* r : unposted_) r->waiting_in_ = this;
    }
    return *this;
  }
  ~CudaStaged() {
    drop_unposted();
    for (const Block& b : blocks_) release(b);
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  std::string describe() const { return fmt::format("cuda-staged({})", inner_.describe()); }
  cuda::Stream& cuda_stream() noexcept { return *stream_; }
  X& inner() noexcept { return inner_; }

  void send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
    if (r.waiting_in_)
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = "send"},
                  "request reused while its send still waits for its copy");
    r.device_ = nullptr;
    r.failure_.reset();
    const std::byte* mirror = staged(bytes, "send", peer);
    if (!mirror) return inner_.send(r.inner_, peer, tag, bytes);
    post_copied();
    r.copied_.record(*stream_);  // the encode that wrote the bytes
    r.copied_.order_before(*copies_);
    cuda::copy(const_cast<std::byte*>(mirror), bytes.data(), bytes.size(), *copies_);
    r.copied_.record(*copies_);
    r.mirror_ = mirror;
    r.size_ = bytes.size();
    r.peer_ = peer;
    r.tag_ = tag;
    r.waiting_in_ = this;
    unposted_.push_back(&r);
  }

  void recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
    const std::byte* mirror = staged(bytes, "recv", peer);
    r.device_ = mirror ? bytes.data() : nullptr;
    if (!mirror) return inner_.recv(r.inner_, peer, tag, bytes);
    r.mirror_ = mirror;
    r.size_ = bytes.size();
    r.landed_ = false;
    inner_.recv(r.inner_, peer, tag, {const_cast<std::byte*>(mirror), bytes.size()});
  }

  bool test(Request& r) {
    post_copied();
    if (r.failure_) throw *r.failure_;
    if (r.waiting_in_ || !inner_.test(r.inner_)) return false;
    land(r, r.size_);
    return true;
  }

  // Unless `r` is already complete, posts every send still waiting for its copy first: the peer
  // may need one of them before it sends what `r` waits for. (The task graph waits only for what
  // it has heard is complete, and should not stall on copies meanwhile.)
  std::size_t wait(Request& r, std::chrono::steady_clock::time_point deadline) {
    post_copied();
    if (r.failure_) throw *r.failure_;
    if (r.waiting_in_ || !inner_.test(r.inner_)) {
      post_copied(/*block=*/true);
      if (r.failure_) throw *r.failure_;
    }
    const std::size_t bytes = inner_.wait(r.inner_, deadline);
    land(r, bytes);
    return bytes;
  }

  // From any thread (X's abort is): the sends still waiting for their copies are left to the
  // thread that posts, which meets the abort when it hands them to X.
  void abort(const Error& cause) { inner_.abort(cause); }

  // DeferredSender (concepts.hpp): hands X the sends whose copies are done; true while some are
  // still waiting for theirs.
  bool post_deferred() {
    post_copied();
    return !unposted_.empty();
  }

  std::span<std::byte> allocate(std::size_t bytes) {
    Block b{static_cast<std::byte*>(cuda::allocate_on_device(bytes, device_)), nullptr, bytes, {}};
    try {
      if constexpr (TransportAllocator<X>) {
        b.host = inner_.allocate(bytes).data();
      } else {
        b.host = static_cast<std::byte*>(::operator new(std::max<std::size_t>(bytes, 1), std::align_val_t{64}));
      }
      b.pinned = cuda::pin(b.host, bytes);
    } catch (...) {
      cuda::free_on_device(b.device, device_);
      throw;
    }
    blocks_.insert(std::upper_bound(blocks_.begin(), blocks_.end(), b,
                                    [](const Block& x, const Block& y) { return x.device < y.device; }),
                   b);
    return {b.device, bytes};
  }

  void deallocate(std::span<std::byte> block) {
    const auto it = std::find_if(blocks_.begin(), blocks_.end(), [&](const Block& b) { return b.device == block.data(); });
    if (it == blocks_.end()) return;
    finish_streams();  // copies queued after a failure may still use it
    release(*it);
    blocks_.erase(it);
  }

 private:
  struct Block {
    std::byte* device;
    std::byte* host;  // the mirror
    std::size_t bytes;
    bool pinned;
  };

  // The mirror of `bytes` if they lie in a block allocate() handed out; null for memory that is
  // not the device's (passed through); an Error for device memory that is not a block's.
  const std::byte* staged(std::span<const std::byte> bytes, const char* operation, int peer) const {
    if (bytes.empty()) return nullptr;
    const std::byte* p = bytes.data();
    const auto it = std::upper_bound(blocks_.begin(), blocks_.end(), p,
                                     [](const std::byte* q, const Block& b) { return q < b.device; });
    if (it != blocks_.begin()) {
      const Block& b = *std::prev(it);
      if (p >= b.device && p + bytes.size() <= b.device + b.bytes) return b.host + (p - b.device);
    }
    if (cuda::on_device(p, device_))
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = operation},
                  fmt::format("{}: a message of {} bytes in device memory that allocate() did not hand out; only "
                              "its blocks have host mirrors to travel through",
                              describe(), bytes.size()));
    return nullptr;
  }

  // Gives X, in the order they were posted, the staged sends whose copies are done (copies on
  // one stream finish in order); with `block`, all of them, each as soon as its copy is. A send
  // that fails here (its copy, or X refusing it: after an abort, say) keeps its Error for its own
  // test() or wait(), and completes: its CompletionSink is told, as X would tell it.
  void post_copied(bool block = false) {
    std::size_t posted = 0;
    while (posted < unposted_.size()) {
      Request& r = *unposted_[posted];
      try {
        if (block) r.copied_.synchronize();
        else if (!r.copied_.done()) break;
        ++posted;
        r.waiting_in_ = nullptr;
        inner_.send(r.inner_, r.peer_, r.tag_, {r.mirror_, r.size_});
      } catch (const Error& e) {
        if (r.waiting_in_) ++posted;  // its copy failed
        r.waiting_in_ = nullptr;
        r.failure_ = e.filled({.rank = rank(), .peer = r.peer_, .operation = "send"});
        if (r.sink_) r.sink_->completed(r.sink_id_);
      }
    }
    unposted_.erase(unposted_.begin(), unposted_.begin() + static_cast<std::ptrdiff_t>(posted));
  }

  // A waiting send's request is going away (an exchange dropped after an error): never post it.
  void forget(Request& r) noexcept {
    r.waiting_in_ = nullptr;
    std::erase(unposted_, &r);
  }

  // At the end: the waiting sends are never posted, and their copies finish before the mirrors
  // may go.
  void drop_unposted() noexcept {
    for (Request* r : unposted_) r->waiting_in_ = nullptr;
    unposted_.clear();
    finish_streams();
  }

  // Waits for every copy queued on either stream, whatever became of them (after a failure, the
  // sends held back and the receives landing may still be copying).
  void finish_streams() noexcept {
    for (cuda::Stream* s : {stream_.get(), copies_.get()}) {
      if (!s) continue;
      try {
        s->synchronize();
      } catch (const Error&) {  // a failed copy or decode: nothing left to wait for
      }
    }
  }

  // A finished staged receive: its bytes to the device, queued on the stream once.
  void land(Request& r, std::size_t bytes) {
    if (!r.device_ || r.landed_) return;
    cuda::copy(r.device_, r.mirror_, bytes, *stream_);
    r.landed_ = true;
  }

  void release(const Block& b) noexcept {
    if (b.pinned) cuda::unpin(b.host);
    if constexpr (TransportAllocator<X>) inner_.deallocate({b.host, b.bytes});
    else ::operator delete(b.host, std::align_val_t{64});
    cuda::free_on_device(b.device, device_);
  }

  X inner_;
  int device_;
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<cuda::Stream> copies_;  // sends' copies to their mirrors
  std::vector<Block> blocks_;  // by device address
  std::vector<Request*> unposted_;  // staged sends not yet given to X, in the order they were posted
};

static_assert(DeviceTransport<CudaStaged<Tcp>> && DeferredSender<CudaStaged<Tcp>>);

}  // namespace gradsync::transport
