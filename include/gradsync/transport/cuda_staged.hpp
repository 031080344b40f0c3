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
// or wait), its copy to the device is queued on a third stream, behind only the kernels queued
// before the receive was posted (which may still use its range), and cuda_stream() waits for it
// from then on (the decode that reads it): kernels queued meanwhile, other buckets' encodes,
// neither delay the copy nor wait for it. Any other buffer (the control messages, in host
// memory) passes through to X untouched; device memory that allocate() did not hand out is
// refused.
//
// With CudaStagedOptions::ipc, peers in another process on the same GPU that X reaches without holding
// messages behind an unmatched one (SharedMemory, Routed within the machine; cuda_ipc.hpp says
// why) and whose memory CUDA lets both sides map (probed at construction; ipc_fallback() names
// the others) skip the host. X carries only a descriptor of where the bytes lie in the sender's block
// (its CUDA IPC handle, an offset, a length), posted once the encode that wrote them is done. The
// receiver maps that block once, copies out of it device to device as it would from its mirror,
// waits for that copy and acknowledges it over X, on the message's tag with bit 31 set
// (engine/tag.hpp keeps data message ids below it). A send through IPC completes with its
// acknowledgement, since the peer reads the sender's memory until then; so while one of its
// wait()s is pending, a rank also takes the messages its peers on the GPU have sent it and
// acknowledges them (a peer may need that before it sends what this rank waits for). Where every
// peer shares the GPU, blocks have no host mirrors.
//
// A send's device bytes must stay as they are until it completes (test or wait), as any
// transport's; the schedules' `after` orders every write to a range behind the sends of it.
//
// Messages match by tag as X's do, so every topology runs over it, on either executor: the
// serial one sees completions in test() and wait(), the task graph hears of them from X and calls
// post_deferred() for the sends held back (DeferredSender, concepts.hpp). Failures, timeouts and a
// dead peer are X's; a send whose deferred post fails (its copy, or X refusing it after an abort)
// throws that Error from its own test() or wait(). abort() may come from any thread, as X's may:
// it only aborts X, and the posting thread meets it.
//
//   using Staged = gradsync::transport::CudaStaged<gradsync::transport::SharedMemory>;
//   Staged transport(gradsync::transport::SharedMemory::from_env(), local_rank % device_count,
//                    {.ipc = true});

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/cuda/memory.hpp"
#include "gradsync/error.hpp"
#include "gradsync/transport/cuda_ipc.hpp"
#include "gradsync/transport/tcp.hpp"

namespace gradsync::transport {

// CudaStaged's settings, whatever transport it wraps; a transport's settings are <Name>Options.
struct CudaStagedOptions {
  // Peers in other processes on the same GPU, reached over SharedMemory (or Routed within the
  // machine; not Tcp), exchange device bytes through CUDA IPC, device to device, instead of
  // through the host mirrors. Every rank must set it alike: construction waits for each peer's
  // identity. Off by default: it pays only where the processes run under MPS (1.3x the mirrors
  // in 8 MiB pieces on an H100); without MPS, each a CUDA context the GPU switches between, every
  // piece waits for another process's copy, and it was 1.7-5.8x slower (docs/design.md).
  bool ipc = false;
  // For the identities at construction; at the end, also the longest (5 s at most) it waits for
  // peers to let go of its blocks.
  std::chrono::milliseconds setup_timeout = std::chrono::seconds(60);
};

template <TransportPolicy X>
class CudaStaged {
 public:
  class Request {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    ~Request() {
      if (waiting_in_ || landing_in_) (waiting_in_ ? waiting_in_ : landing_in_)->forget(*this);
    }
    void report_to(CompletionSink* sink, std::uint64_t id) noexcept {
      (ipc_ && !device_ ? ack_ : inner_).report_to(sink, id);
      sink_ = sink;
      sink_id_ = id;
    }

   private:
    friend class CudaStaged;
    typename X::Request inner_;
    std::byte* device_ = nullptr;  // a receive's destination in a block; null otherwise
    const std::byte* payload_ = nullptr;  // what X sends or receives into: the mirror, or descriptor_
    std::size_t size_ = 0;
    bool landed_ = false;  // its copy to the device is queued
    // A held send: recorded after what must finish before X may take it (the copy to the mirror,
    // or the encode that wrote the bytes a peer on the same GPU reads). A receive into a block:
    // recorded when posted (the kernels that may still use its range), then after its copy.
    cuda::Event copied_;
    // Through CUDA IPC: X carries descriptor_; a send completes with the peer's acknowledgement.
    bool ipc_ = false;
    detail::IpcDescriptor descriptor_;
    typename X::Request ack_;
    std::uint64_t ack_bytes_ = 0;
    CudaStaged* waiting_in_ = nullptr;  // while its copy is not done or its X send not posted
    CudaStaged* landing_in_ = nullptr;  // a receive through CUDA IPC, until it lands
    int peer_ = -1;
    std::uint64_t tag_ = 0;
    std::optional<Error> failure_;  // its deferred post or its landing failed: what test() and wait() throw
    CompletionSink* sink_ = nullptr;  // told of a failed deferred post, as X would be of X's own
    std::uint64_t sink_id_ = 0;
  };

  // Device memory on CUDA device `device`; messages through `inner`. With options.ipc, first
  // learns from every peer which of them share the GPU (each must answer within setup_timeout).
  CudaStaged(X inner, int device, CudaStagedOptions options = {})
      : inner_(std::move(inner)),
        device_(device),
        options_(options),
        stream_(std::make_unique<cuda::Stream>(device)),
        copies_(std::make_unique<cuda::Stream>(device)),
        landings_(std::make_unique<cuda::Stream>(device)) {
    if (options_.ipc) ipc_.connect(inner_, device_, options_.setup_timeout);
  }
  CudaStaged(CudaStaged&& o) noexcept : inner_(std::move(o.inner_)) { take(o); }
  CudaStaged& operator=(CudaStaged&& o) noexcept {
    if (this != &o) {
      tear_down();
      inner_ = std::move(o.inner_);
      take(o);
    }
    return *this;
  }
  ~CudaStaged() { tear_down(); }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  // The same on every rank that agrees on the options (the Synchronizer compares it).
  std::string describe() const { return fmt::format("cuda-staged({}{})", inner_.describe(), options_.ipc ? ", ipc" : ""); }
  cuda::Stream& cuda_stream() noexcept { return *stream_; }
  X& inner() noexcept { return inner_; }
  // How many peers this rank exchanges device bytes with through CUDA IPC.
  int ipc_peers() const noexcept { return ipc_.peers(); }
  // With CudaStagedOptions::ipc: why some peers on this GPU go through host mirrors after all
  // (CUDA refused to map memory between the processes); empty where none do.
  const std::string& ipc_fallback() const noexcept { return ipc_.fallback(); }

  void send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
    if (r.waiting_in_)
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = "send"},
                  "request reused while its send still waits for its copy");
    if (r.landing_in_) forget(r);  // a receive through IPC that never landed
    r.device_ = nullptr;
    r.ipc_ = false;
    r.failure_.reset();
    r.inner_.report_to(r.sink_, r.sink_id_);
    const Block* block = block_of(bytes, "send", peer);
    if (!block) return inner_.send(r.inner_, peer, tag, bytes);
    progress();
    r.copied_.record(*stream_);  // the encode that wrote the bytes
    if (ipc_.reaches(peer)) {
      check_tag(tag, "send", peer);
      r.ipc_ = true;
      r.descriptor_ = {.generation = block->generation,
                       .block_bytes = block->bytes,
                       .offset = static_cast<std::uint64_t>(bytes.data() - block->device),
                       .bytes = bytes.size(),
                       .handle = block->handle};
      r.inner_.report_to(nullptr, 0);  // the acknowledgement completes it
      r.ack_.report_to(r.sink_, r.sink_id_);
      inner_.recv(r.ack_, peer, ack_tag(tag), std::as_writable_bytes(std::span(&r.ack_bytes_, 1)));
      return hold(r, peer, tag, std::as_bytes(std::span(&r.descriptor_, 1)));
    }
    std::byte* mirror = mirror_of(*block, bytes.data(), "send", peer);
    r.copied_.order_before(*copies_);
    cuda::copy(mirror, bytes.data(), bytes.size(), *copies_);
    r.copied_.record(*copies_);
    hold(r, peer, tag, {mirror, bytes.size()});
  }

  void recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
    if (r.landing_in_) forget(r);  // a receive through IPC that never landed
    r.ipc_ = false;
    r.failure_.reset();
    r.inner_.report_to(r.sink_, r.sink_id_);
    const Block* block = block_of(bytes, "recv", peer);
    r.device_ = block ? bytes.data() : nullptr;
    if (!block) return inner_.recv(r.inner_, peer, tag, bytes);
    r.size_ = bytes.size();
    r.peer_ = peer;
    r.tag_ = tag;
    r.landed_ = false;
    r.copied_.record(*stream_);  // what its copy must wait for
    if (ipc_.reaches(peer)) {
      check_tag(tag, "recv", peer);
      r.ipc_ = true;
      r.descriptor_.version = 0;  // what arrives must say its own
      inner_.recv(r.inner_, peer, tag, std::as_writable_bytes(std::span(&r.descriptor_, 1)));
      if (!r.landing_in_) ipc_receives_.push_back(&r);
      r.landing_in_ = this;
      return;
    }
    r.payload_ = mirror_of(*block, bytes.data(), "recv", peer);
    inner_.recv(r.inner_, peer, tag, {const_cast<std::byte*>(r.payload_), bytes.size()});
  }

  bool test(Request& r) {
    progress();
    if (r.failure_) throw *r.failure_;
    if (!complete(r)) return false;
    land(r, std::nullopt);
    return true;
  }

  // Unless `r` is already complete, first posts every send still waiting for its copy: the peer
  // may need one of them before it sends what `r` waits for. The task graph waits only for what
  // it has heard is complete, and should not stall on copies meanwhile; but a transport may tell
  // its sink just before test() sees the completion (SharedMemory does, completion.hpp allows
  // it), so it looks again a few times before it blocks on them. With peers on this GPU it then
  // looks after them until `r` is done rather than block in X: a peer's send through IPC
  // completes only once this rank has taken the message and acknowledged it, and the peer may
  // need that before it sends what `r` waits for.
  std::size_t wait(Request& r, std::chrono::steady_clock::time_point deadline) {
    progress();
    if (r.failure_) throw *r.failure_;
    for (int look = 0; look < 64 && !r.failure_ && !complete(r); ++look) {
      post_held(/*block=*/false);
      std::this_thread::yield();
    }
    if (r.failure_) throw *r.failure_;
    if (!complete(r)) {
      post_held(/*block=*/true);
      while (ipc_.peers() > 0 && !r.failure_ && !complete(r) && std::chrono::steady_clock::now() < deadline) {
        land_arrived();
        progress();
        std::this_thread::sleep_for(std::chrono::microseconds(10));
      }
      if (r.failure_) throw *r.failure_;
    }
    std::size_t bytes = 0;
    try {
      bytes = inner_.wait(r.inner_, deadline);
    } catch (const Error&) {
      if (r.ipc_ && !r.device_) detail::CudaIpc<X>::withdraw(inner_, r.ack_);  // nothing waits for it now
      throw;
    }
    if (r.ipc_ && !r.device_) {
      try {
        inner_.wait(r.ack_, deadline);
      } catch (const Error& e) {
        throw acknowledgement_failure(e);
      }
      return r.descriptor_.bytes;
    }
    return land(r, bytes);
  }

  // From any thread (X's abort is): the sends still waiting for their copies are left to the
  // thread that posts, which meets the abort when it hands them to X.
  void abort(const Error& cause) { inner_.abort(cause); }

  // DeferredSender (concepts.hpp): hands X the sends whose copies are done; true while some are
  // still held.
  bool post_deferred() {
    progress();
    return !unposted_.empty();
  }

  // With peers through IPC, the device block is a whole number of 2 MiB: cudaMalloc may carve a
  // smaller allocation out of a larger block, and CUDA IPC then shares that whole block, the other
  // allocations in it included (the CUDA Programming Guide, "Interprocess Communication", advises
  // sharing 2 MiB-aligned sizes only); two of this rank's blocks in one of CUDA's would also be
  // opened twice by a peer.
  std::span<std::byte> allocate(std::size_t bytes) {
    constexpr std::size_t ipc_granule = detail::CudaIpc<X>::ipc_granule;
    const std::size_t device_bytes =
        ipc_.peers() > 0 ? std::max<std::size_t>(1, (bytes + ipc_granule - 1) / ipc_granule) * ipc_granule : bytes;
    Block b{static_cast<std::byte*>(cuda::allocate_on_device(device_bytes, device_)), nullptr, bytes, false, 0, {}};
    try {
      if (ipc_.peers() > 0) {
        b.generation = ipc_.next_generation();
        b.handle = cuda::ipc_handle(b.device, device_);
      }
      if (ipc_.peers() < size() - 1) {  // some peer needs the mirrors
        if constexpr (TransportAllocator<X>) {
          b.host = inner_.allocate(bytes).data();
        } else {
          b.host = static_cast<std::byte*>(::operator new(std::max<std::size_t>(bytes, 1), std::align_val_t{64}));
        }
        b.pinned = cuda::pin(b.host, bytes);
      }
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
    std::byte* host;  // the mirror; null where every peer shares the GPU
    std::size_t bytes;
    bool pinned;
    std::uint64_t generation;  // with peers through IPC: which block it is to them, and its handle
    cuda::IpcHandle handle;
  };

  static constexpr std::uint64_t ack_bit = std::uint64_t{1} << 31;
  static constexpr std::uint64_t ack_tag(std::uint64_t tag) noexcept { return tag | ack_bit; }

  void check_tag(std::uint64_t tag, const char* operation, int peer) const {
    if (tag & ack_bit)
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = operation},
                  fmt::format("{}: tag {:#x} has bit 31 set, which is kept for the acknowledgements of messages "
                              "through CUDA IPC",
                              describe(), tag));
  }

  // Whether `r` is done: its held send posted, X done with it, a send through IPC acknowledged.
  bool complete(Request& r) {
    if (r.waiting_in_ || !inner_.test(r.inner_)) return false;
    if (!r.ipc_ || r.device_) return true;
    try {
      return inner_.test(r.ack_);
    } catch (const Error& e) {
      throw acknowledgement_failure(e);
    }
  }

  // X names the acknowledgement's receive; the caller posted a send.
  static Error acknowledgement_failure(const Error& e) {
    ErrorContext context = e.context();
    context.operation = "send (its acknowledgement through cuda ipc)";
    return Error(e.kind(), context, e.detail());
  }

  // The block `bytes` lie in, if allocate() handed it out; null for memory that is not the
  // device's (passed through); an Error for device memory that is not a block's.
  const Block* block_of(std::span<const std::byte> bytes, const char* operation, int peer) const {
    if (bytes.empty()) return nullptr;
    const std::byte* p = bytes.data();
    const auto it = std::upper_bound(blocks_.begin(), blocks_.end(), p,
                                     [](const std::byte* q, const Block& b) { return q < b.device; });
    if (it != blocks_.begin()) {
      const Block& b = *std::prev(it);
      if (p >= b.device && p + bytes.size() <= b.device + b.bytes) return &b;
    }
    if (cuda::on_device(p, device_))
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = operation},
                  fmt::format("{}: a message of {} bytes in device memory that allocate() did not hand out; only "
                              "its blocks can travel",
                              describe(), bytes.size()));
    return nullptr;
  }

  std::byte* mirror_of(const Block& b, const std::byte* p, const char* operation, int peer) const {
    if (!b.host)  // only a message to itself could want one, and no schedule sends one
      throw Error(ErrorKind::internal, {.rank = rank(), .peer = peer, .operation = operation},
                  fmt::format("{}: a message to a rank this transport made no mirrors for", describe()));
    return b.host + (p - b.device);
  }

  // Queues a send for X, which gets `payload` once r.copied_ is done.
  void hold(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> payload) {
    r.payload_ = payload.data();
    r.size_ = payload.size();
    r.peer_ = peer;
    r.tag_ = tag;
    r.waiting_in_ = this;
    unposted_.push_back(&r);
  }

  void progress() {
    post_held(/*block=*/false);
    ipc_.progress(inner_);
  }

  // Gives X, in the order they were posted, the held sends whose copies (or encodes) are done;
  // with `block`, all of them, each as soon as it may go. A send that fails here (its copy, or X
  // refusing it: after an abort, say) keeps its Error for its own test() or wait(), and
  // completes: its CompletionSink is told, as X would tell it, unless its acknowledgement's
  // receive had already reported its own failure.
  void post_held(bool block) {
    std::size_t posted = 0;
    while (posted < unposted_.size()) {
      Request& r = *unposted_[posted];
      try {
        if (block) r.copied_.synchronize();
        else if (!r.copied_.done()) break;
        ++posted;
        r.waiting_in_ = nullptr;
        inner_.send(r.inner_, r.peer_, r.tag_, {r.payload_, r.size_});
      } catch (const Error& e) {
        if (r.waiting_in_) ++posted;  // its copy failed
        r.waiting_in_ = nullptr;
        r.failure_ = e.filled({.rank = rank(), .peer = r.peer_, .operation = "send"});
        bool report = true;
        if (r.ipc_) {  // its acknowledgement will not come
          r.ack_.report_to(nullptr, 0);
          report = detail::CudaIpc<X>::withdraw(inner_, r.ack_);
        }
        if (report && r.sink_) r.sink_->completed(r.sink_id_);
      }
    }
    unposted_.erase(unposted_.begin(), unposted_.begin() + static_cast<std::ptrdiff_t>(posted));
  }

  // A request this transport keeps a pointer to is going away (an exchange dropped after an
  // error): a held send is never posted, a receive never landed.
  void forget(Request& r) noexcept {
    if (r.waiting_in_ && r.ipc_) detail::CudaIpc<X>::withdraw(inner_, r.ack_);
    r.waiting_in_ = nullptr;
    r.landing_in_ = nullptr;
    std::erase(unposted_, &r);
    std::erase(ipc_receives_, &r);
  }

  // Lands the receives through IPC whose descriptors have arrived: copies them in and
  // acknowledges them. X's failure of one is left to its own test() or wait(); a landing that
  // fails (the copy, the peer's block that cannot be mapped) throws here too, at once, since the
  // peer waits for its acknowledgement.
  void land_arrived() {
    for (std::size_t i = 0; i < ipc_receives_.size();) {
      Request& r = *ipc_receives_[i];
      try {
        if (!inner_.test(r.inner_)) {
          ++i;
          continue;
        }
      } catch (const Error& e) {
        forget(r);
        r.failure_ = e;
        continue;
      }
      land(r, std::nullopt);  // takes it off the list; a failure stays in r.failure_ too
    }
  }

  // A finished receive into a block: its bytes to the device, queued once; returns the
  // message's length. `arrived`: what X received, where known (wait() says, test() does not).
  std::size_t land(Request& r, std::optional<std::size_t> arrived) {
    if (!r.device_) return arrived.value_or(0);
    if (r.ipc_) {
      if (!r.landed_) {
        r.landing_in_ = nullptr;
        std::erase(ipc_receives_, &r);
        try {
          copy_from_peer(r, arrived);
        } catch (const Error& e) {  // for every later test() or wait() of it, too
          r.failure_ = e;
          throw;
        }
        r.landed_ = true;
      }
      return r.descriptor_.bytes;
    }
    if (!r.landed_) copy_in(r, r.payload_, arrived.value_or(r.size_));
    r.landed_ = true;
    return arrived.value_or(r.size_);
  }

  // A receive's bytes into its range, on the landing stream behind the kernels queued before the
  // receive was posted; the compute stream waits for the copy, r.copied_ marks it.
  void copy_in(Request& r, const std::byte* from, std::size_t bytes) {
    r.copied_.order_before(*landings_);
    cuda::copy(r.device_, from, bytes, *landings_);
    r.copied_.record(*landings_);
    r.copied_.order_before(*stream_);
  }

  // A descriptor arrived: the bytes it names, device to device out of the peer's block, then,
  // once copied, the acknowledgement that frees the peer's send. Waiting for the copy here keeps
  // no acknowledgement for later, when nothing may call this transport (the end of an
  // iteration); the copy waits for nothing but kernels of this rank.
  void copy_from_peer(Request& r, std::optional<std::size_t> arrived) {
    const detail::IpcDescriptor& d = r.descriptor_;
    const ErrorContext here{.rank = rank(), .peer = r.peer_, .operation = "recv through cuda ipc"};
    if (arrived.value_or(sizeof d) != sizeof d || d.version != detail::IpcDescriptor::current_version)
      throw Error(ErrorKind::protocol, here,
                  fmt::format("{}: a descriptor of {} bytes, version {}; expected {} bytes, version {}", describe(),
                              arrived.value_or(sizeof d), d.version, sizeof d, detail::IpcDescriptor::current_version));
    if (d.bytes > r.size_ || d.offset > d.block_bytes || d.bytes > d.block_bytes - d.offset)
      throw Error(ErrorKind::protocol, here,
                  fmt::format("{}: a message of {} bytes at {} of a block of {}, for a receive of {} bytes", describe(),
                              d.bytes, d.offset, d.block_bytes, r.size_));
    try {
      copy_in(r, ipc_.mapped(r.peer_, d) + d.offset, d.bytes);
      r.copied_.synchronize();
      ipc_.signal(inner_, r.peer_, ack_tag(r.tag_), std::as_bytes(std::span(&d.bytes, 1)));
    } catch (const Error& e) {
      throw e.filled(here);
    }
  }

  // Waits for everything queued on its three streams, whatever became of it (after a failure, the
  // sends held back and the receives landing may still be copying).
  void finish_streams() noexcept {
    for (cuda::Stream* s : {stream_.get(), copies_.get(), landings_.get()}) {
      if (!s) continue;
      try {
        s->synchronize();
      } catch (const Error&) {  // a failed copy or decode: nothing left to wait for
      }
    }
  }

  // At the end: held sends are never posted (nor their acknowledgements awaited), receives never
  // landed, the copies on the streams finish before the mirrors may go, and the blocks are freed,
  // those peers may have mapped once they have let go of them (detail::CudaIpc::close).
  void tear_down() noexcept {
    for (Request* r : unposted_) {
      r->waiting_in_ = nullptr;
      if (r->ipc_) detail::CudaIpc<X>::withdraw(inner_, r->ack_);
    }
    unposted_.clear();
    for (Request* r : ipc_receives_) r->landing_in_ = nullptr;
    ipc_receives_.clear();
    finish_streams();
    for (const Block& b : blocks_) release(b);
    blocks_.clear();
    ipc_.close(inner_, std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(options_.setup_timeout,
                                                                                               std::chrono::seconds(5)));
  }

  // Everything but X from a transport being moved.
  void take(CudaStaged& o) noexcept {
    device_ = o.device_;
    options_ = o.options_;
    stream_ = std::move(o.stream_);
    copies_ = std::move(o.copies_);
    landings_ = std::move(o.landings_);
    blocks_ = std::exchange(o.blocks_, {});
    unposted_ = std::exchange(o.unposted_, {});
    ipc_receives_ = std::exchange(o.ipc_receives_, {});
    ipc_ = std::exchange(o.ipc_, {});
    for (Request* r : unposted_) r->waiting_in_ = this;
    for (Request* r : ipc_receives_) r->landing_in_ = this;
  }

  // Frees a block's mirror, and its device memory, or hands that to ipc_ to free once the peers
  // that may have mapped it have let go.
  void release(const Block& b) noexcept {
    if (b.host) {
      if (b.pinned) cuda::unpin(b.host);
      if constexpr (TransportAllocator<X>) inner_.deallocate({b.host, b.bytes});
      else ::operator delete(b.host, std::align_val_t{64});
    }
    if (b.generation == 0) return cuda::free_on_device(b.device, device_);
    try {
      ipc_.retire(inner_, b.device, b.generation);
    } catch (...) {  // its notices could not go: left allocated, as for a peer that never answers
    }
  }

  X inner_;
  int device_;
  CudaStagedOptions options_;
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<cuda::Stream> copies_;  // sends' copies to their mirrors
  std::unique_ptr<cuda::Stream> landings_;  // receives' copies to their ranges
  std::vector<Block> blocks_;  // by device address
  std::vector<Request*> unposted_;  // held sends not yet given to X, in the order they were posted
  std::vector<Request*> ipc_receives_;  // receives through IPC not yet landed
  detail::CudaIpc<X> ipc_;
};

static_assert(DeviceTransport<CudaStaged<Tcp>> && DeferredSender<CudaStaged<Tcp>>);

}  // namespace gradsync::transport
