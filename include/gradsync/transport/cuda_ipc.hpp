#pragma once
// transport::detail::CudaIpc<X> — what transport::CudaStaged needs to pass device bytes between
// processes on one GPU through CUDA IPC (CudaStagedOptions::ipc; cuda_staged.hpp says how messages go):
// which peers share the GPU, the peers' blocks mapped into this process, the small messages of
// its own it sends over X (acknowledgements, release notices), and the release of blocks that
// peers may have mapped.
//
// CUDA leaves undefined a cudaFree of memory another process still has open through its IPC
// handle, so a block that a peer may have mapped is retired, not freed: every peer on the GPU is
// told ("release", on a per-pair stream of notices over X), closes its mapping if it has one
// (nothing copies out of it then: every send from the block was acknowledged before the block
// could be deallocated) and answers ("released"); the block is freed once all have answered.
// Notices are read whenever CudaStaged makes progress (progress() here); answered blocks are
// freed at the next retire() or close() (cudaFree waits for the whole device: not on the
// communication thread). At the end (close()) a rank closes all its mappings and says so
// ("closing", its last notice: it maps nothing any more, so its peers need no answers from it),
// then reads its peers' notices until each peer still there has answered for its blocks or said
// "closing" itself, and has taken what this rank sent it, up to a deadline. A block some peer
// has not answered for (it died, an abort stopped the notices, it was busy past the deadline) is
// never freed: the process's exit reclaims it, where freeing it under a live peer's mapping would
// be undefined.
//
// The peers it routes through IPC are those in another process on this GPU that X reaches
// without holding a later message behind one that no receive matches yet
// (X::passes_unmatched(peer), concepts.hpp: SharedMemory, Routed within the machine), and whose
// memory CUDA lets both sides map (a probe at connect()). Tcp stops reading a socket at such a
// message, and an acknowledgement behind it could wait for ever.
//
// Not thread-safe: CudaStaged calls it from the thread that posts.

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/concepts.hpp"
#include "gradsync/cuda/memory.hpp"
#include "gradsync/engine/tag.hpp"
#include "gradsync/error.hpp"

namespace gradsync::transport::detail {

// CudaStaged's own messages over X with IPC, in engine::ControlMessage::transports' range: each
// rank's GPU and process to every peer, the answers to its probe, and notices about blocks peers
// may have mapped (numbered per pair).
inline constexpr std::uint32_t ipc_identity_message = 8, ipc_notice_message = 9, ipc_probe_message = 10;

// What X carries for a message through CUDA IPC: where its bytes lie in the sender's block.
struct IpcDescriptor {
  static constexpr std::uint32_t current_version = 1;
  std::uint32_t version = current_version;
  std::uint32_t reserved = 0;
  std::uint64_t generation = 0;  // which of the sender's blocks: the count of its allocate() calls
  std::uint64_t block_bytes = 0;
  std::uint64_t offset = 0;  // the message's bytes in the block
  std::uint64_t bytes = 0;
  cuda::IpcHandle handle{};
};

// What each rank tells every peer at setup: the GPU it uses and which process it is (a random
// number with the pid: pids repeat across containers, and a forked child keeps its parent's
// statics), whether X lets it take IPC messages from that peer, and the handle of its probe
// block, which the peers on its GPU try to map (CudaIpc::connect).
struct IpcIdentity {
  static constexpr std::uint32_t current_version = 2;
  static constexpr const char* name = "identity";
  std::uint32_t version = current_version;
  std::uint32_t passes_unmatched = 0;
  cuda::DeviceUuid device{};
  std::int64_t pid = 0;
  std::uint64_t nonce = 0;
  std::uint32_t probe_offered = 0;  // CUDA exported the probe block: `probe` is its handle
  std::uint32_t reserved = 0;
  cuda::IpcHandle probe{};
};

// A peer's answer to the probe: whether it mapped this rank's probe block (and has let it go).
struct IpcProbeAnswer {
  static constexpr std::uint32_t current_version = 1;
  static constexpr const char* name = "probe answer";
  std::uint32_t version = current_version;
  std::uint32_t mapped = 0;
};

// A notice about a block: "release" (its owner wants to free it), "released" (the peer has no
// mapping of it any more); or "closing" (the sender's last: it maps nothing and will send nothing).
struct IpcNotice {
  static constexpr std::uint32_t current_version = 1;
  enum Kind : std::uint32_t { release = 1, released = 2, closing = 3 };
  std::uint32_t version = current_version;
  std::uint32_t kind = release;
  std::uint64_t generation = 0;
};

inline std::uint64_t process_nonce() {
  static const std::uint64_t nonce = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  return nonce;
}

// Whether X passes later messages between this rank and `peer` by one no receive matches yet.
template <class X>
bool passes_unmatched(const X& x, int peer) {
  if constexpr (requires { { x.passes_unmatched(peer) } -> std::convertible_to<bool>; })
    return x.passes_unmatched(peer);
  else
    return false;
}

template <TransportPolicy X>
class CudaIpc {
 public:
  // Tells every peer which GPU and process this rank is, hears the same from each, and from then
  // on reaches through IPC those in another process on GPU `device` that X passes unmatched
  // messages to and from (both sides must say so) and whose memory both sides could map: each
  // rank's identity carries the handle of a small block of its own, which the peers on its GPU
  // map and let go of at once, and say whether they could. CUDA may refuse it where processes
  // share the GPU (containers with IPC namespaces of their own, say); such a pair goes through
  // host mirrors, as fallback() tells, rather than fail at its first message. Throws
  // Error(timeout) naming the first peer that did not answer within `timeout`.
  void connect(X& x, int device, std::chrono::milliseconds timeout) {
    device_ = device;
    const int rank = x.rank(), size = x.size();
    const auto n = static_cast<std::size_t>(size);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    IpcIdentity mine{.device = cuda::device_uuid(device), .pid = ::getpid(), .nonce = process_nonce()};
    // Left allocated if setup fails once peers have its handle: one may have it mapped. Where
    // CUDA will not export this rank's memory at all, no peer gets a probe, and all go through
    // host mirrors.
    std::string refusal;  // the first CUDA error: exporting this rank's memory, or mapping a peer's
    void* probe = nullptr;
    try {
      probe = cuda::allocate_on_device(ipc_granule, device);
      mine.probe = cuda::ipc_handle(probe, device);
      mine.probe_offered = 1;
    } catch (const Error& e) {
      cuda::free_on_device(probe, device);
      probe = nullptr;
      refusal = fmt::format("exporting this rank's memory: {}", e.detail());
    }
    std::vector<IpcIdentity> theirs(n), told(n, mine);
    for (int peer = 0; peer < size; ++peer) told[peer].passes_unmatched = peer != rank && passes_unmatched(x, peer);
    swap(x, [&](int peer) { return peer != rank; }, told, theirs, ipc_identity_message, deadline);

    // Symmetric: both sides of a pair find the same.
    const auto shares_gpu = [&](int peer) {
      const auto p = static_cast<std::size_t>(peer);
      return peer != rank && theirs[p].device == mine.device &&
             (theirs[p].pid != mine.pid || theirs[p].nonce != mine.nonce) && theirs[p].passes_unmatched &&
             told[p].passes_unmatched;
    };
    std::vector<IpcProbeAnswer> mapped(n), answers(n);
    for (int peer = 0; peer < size; ++peer) {
      if (!shares_gpu(peer) || !theirs[peer].probe_offered) continue;
      try {
        cuda::close_ipc_handle(cuda::open_ipc_handle(theirs[peer].probe, device), device);
        mapped[peer].mapped = 1;
      } catch (const Error& e) {
        if (refusal.empty()) refusal = fmt::format("mapping rank {}'s memory here: {}", peer, e.detail());
      }
    }
    swap(x, shares_gpu, mapped, answers, ipc_probe_message, deadline);
    cuda::free_on_device(probe, device);  // every peer that mapped it has answered: none maps it now

    reaches_.assign(n, false);
    std::vector<int> refused;
    for (int peer = 0; peer < size; ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      reaches_[p] = shares_gpu(peer) && mapped[p].mapped && answers[p].mapped;
      if (shares_gpu(peer) && !reaches_[p]) refused.push_back(peer);
    }
    fallback_ = refused.empty() ? std::string()
                                : fmt::format("CUDA IPC refused with rank(s) {} on this GPU, reached through host "
                                              "mirrors instead: {}",
                                              fmt::join(refused, ", "),
                                              refusal.empty() ? "they could not map this rank's memory, or export theirs"
                                                              : refusal);
    inboxes_.clear();
    inboxes_.resize(n);
    notices_sent_.assign(n, 0);
    for (int peer = 0; peer < size; ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      if (!reaches_[p]) continue;
      inboxes_[p] = std::make_unique<Inbox>();
      try {
        post_inbox(x, peer);
      } catch (const Error& e) {
        inboxes_[p].reset();
        for (std::unique_ptr<Inbox>& inbox : inboxes_)
          if (inbox) withdraw(x, inbox->request);
        inboxes_.clear();
        reaches_.clear();
        throw e.filled({.rank = rank, .peer = peer, .operation = "cuda ipc setup"});
      }
    }
    peers_ = static_cast<int>(std::count(reaches_.begin(), reaches_.end(), true));
  }

  // Why some peers on this GPU go through host mirrors after all (empty: none do).
  const std::string& fallback() const noexcept { return fallback_; }

  bool reaches(int peer) const { return !reaches_.empty() && reaches_[static_cast<std::size_t>(peer)]; }
  int peers() const noexcept { return peers_; }

  // A new block's generation, which names it in the descriptors of messages sent from it.
  std::uint64_t next_generation() noexcept { return ++generations_; }

  // The peer's block a descriptor names, mapped here once (until the peer releases it).
  const std::byte* mapped(int peer, const IpcDescriptor& d) {
    for (const Mapping& m : mappings_)
      if (m.peer == peer && m.generation == d.generation) return m.base;
    if (std::find(released_.begin(), released_.end(), std::pair(peer, d.generation)) != released_.end())
      throw Error(ErrorKind::protocol, {.peer = peer, .operation = "recv through cuda ipc"},
                  fmt::format("a message from block {} of the peer, which it has released", d.generation));
    mappings_.reserve(mappings_.size() + 1);
    mappings_.push_back({peer, d.generation, static_cast<std::byte*>(cuda::open_ipc_handle(d.handle, device_))});
    return mappings_.back().base;
  }

  // Sends `body` (at most 16 bytes) to `peer` as a message of this transport's own, which no one
  // waits for: X completes it, progress() retires it.
  void signal(X& x, int peer, std::uint64_t tag, std::span<const std::byte> body) {
    std::unique_ptr<Signal> s;
    if (spare_.empty()) {
      s = std::make_unique<Signal>();
    } else {
      s = std::move(spare_.back());
      spare_.pop_back();
    }
    std::memcpy(s->body.data(), body.data(), std::min(body.size(), s->body.size()));
    s->peer = peer;
    try {
      sent_.reserve(sent_.size() + 1);  // no failure once X has it
      x.send(s->request, peer, tag, std::span(s->body).first(std::min(body.size(), s->body.size())));
    } catch (...) {
      spare_.push_back(std::move(s));
      throw;
    }
    sent_.push_back(std::move(s));
  }

  // Retires the signals X has sent, and reads and answers the peers' notices.
  void progress(X& x) {
    std::erase_if(sent_, [&](std::unique_ptr<Signal>& s) {
      bool done = true;
      try {
        done = x.test(s->request);
      } catch (const Error&) {  // its peer failed or aborted: the peer's to meet
      }
      if (done) spare_.push_back(std::move(s));
      return done;
    });
    for (std::size_t p = 0; p < inboxes_.size(); ++p)
      if (inboxes_[p]) read_notices(x, static_cast<int>(p));
  }

  // A block this rank allocated with `generation`, to be freed once no peer has it mapped.
  void retire(X& x, void* device, std::uint64_t generation) {
    progress(x);  // a peer that has closed is told nothing
    Retiring r{device, generation, std::vector<bool>(reaches_.size(), false), 0};
    const IpcNotice notice{.kind = IpcNotice::release, .generation = generation};
    for (std::size_t p = 0; p < reaches_.size(); ++p) {
      if (!reaches_[p] || inboxes_[p]->closing) continue;  // a peer that closed maps nothing
      r.waiting_for[p] = true;  // until it answers; if the notice cannot go, for good
      ++r.count;
      if (inboxes_[p]->gone) continue;
      try {
        send_notice(x, static_cast<int>(p), notice);
      } catch (const Error&) {  // after an abort, or the peer died: no answer will come
      }
    }
    if (r.count == 0) return cuda::free_on_device(device, device_);
    retiring_.push_back(std::move(r));
    free_released();
  }

  // At the end, after the caller's streams are drained and its blocks retired: closes this
  // rank's mappings and tells every peer ("closing"), then reads the peers' notices until (or
  // `deadline`) each peer still there has answered for this rank's blocks or closed itself, and
  // has taken what this rank sent it. Frees what was answered for, and settles X's requests it
  // made.
  void close(X& x, std::chrono::steady_clock::time_point deadline) noexcept {
    for (const Mapping& m : mappings_) cuda::close_ipc_handle(m.base, device_);
    mappings_.clear();
    closing_ = true;  // releases need no answer from here on
    for (std::size_t p = 0; p < inboxes_.size(); ++p) {
      if (!inboxes_[p] || inboxes_[p]->gone) continue;
      try {
        send_notice(x, static_cast<int>(p), {.kind = IpcNotice::closing});
      } catch (...) {  // gone, or this rank aborted: it waits for nothing from this one
        peer_gone(static_cast<int>(p));
      }
    }
    // A peer that is gone reads and answers nothing; one that is closing answers nothing more
    // (its "closing" answered for every block) but reads on, up to this rank's "closing", while it
    // waits for its own answers: what was sent to it is waited for until it is taken, or the
    // peer goes.
    const auto there = [&](int p) { return inboxes_[p] && !inboxes_[p]->gone; };
    const auto waiting = [&] {
      for (const Retiring& r : retiring_)
        for (std::size_t p = 0; p < r.waiting_for.size(); ++p)
          if (r.waiting_for[p] && there(static_cast<int>(p)) && !inboxes_[p]->closing) return true;
      for (const std::unique_ptr<Signal>& s : sent_)
        if (there(s->peer)) return true;
      return false;
    };
    while (waiting() && std::chrono::steady_clock::now() < deadline) {
      try {
        progress(x);
      } catch (...) {  // a notice out of protocol: the deadline ends it
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    free_released();
    retiring_.clear();  // those still unanswered stay allocated (the top of this file)
    for (std::unique_ptr<Inbox>& inbox : inboxes_)
      if (inbox) withdraw(x, inbox->request);
    inboxes_.clear();
    for (std::unique_ptr<Signal>& s : sent_) withdraw(x, s->request);  // to peers gone, or past the deadline
    sent_.clear();
    reaches_.clear();
    peers_ = 0;
  }

  // An operation of X's that no one will wait for: withdrawn (a past deadline does that), unless
  // over. True if it was still pending.
  static bool withdraw(X& x, typename X::Request& request) noexcept {
    try {
      x.wait(request, std::chrono::steady_clock::time_point{});
    } catch (const Error& e) {
      return e.kind() == ErrorKind::timeout;
    } catch (...) {
    }
    return false;
  }

  // The IPC block size CudaStaged allocates in: the CUDA Programming Guide advises sharing only
  // 2 MiB-aligned sizes (cuda_staged.hpp: allocate).
  static constexpr std::size_t ipc_granule = std::size_t{2} << 20;

 private:
  // Sends told[p] to, and receives theirs[p] from, every peer `with(p)` picks, on transport message
  // `message`, by `deadline`. A failure names the peer, after what is still posted is withdrawn.
  template <class Message, class With>
  static void swap(X& x, With with, std::vector<Message>& told, std::vector<Message>& theirs, std::uint32_t message,
                   std::chrono::steady_clock::time_point deadline) {
    const int size = x.size();
    const std::uint64_t tag = engine::control_tag(0, engine::ControlMessage::transports, message);
    std::vector<typename X::Request> sends(static_cast<std::size_t>(size)), receives(static_cast<std::size_t>(size));
    int peer = 0;
    try {
      for (peer = 0; peer < size; ++peer) {
        if (!with(peer)) continue;
        theirs[peer].version = 0;  // what arrives must say its own
        x.recv(receives[peer], peer, tag, std::as_writable_bytes(std::span(&theirs[peer], 1)));
        x.send(sends[peer], peer, tag, std::as_bytes(std::span(&told[peer], 1)));
      }
      for (peer = 0; peer < size; ++peer) {
        if (!with(peer)) continue;
        const std::size_t got = x.wait(receives[peer], deadline);
        if (got != sizeof(Message) || theirs[peer].version != Message::current_version)
          throw Error(ErrorKind::protocol, {},
                      fmt::format("a {} of {} bytes, version {}; expected {} bytes, version {}", Message::name, got,
                                  theirs[peer].version, sizeof(Message), Message::current_version));
        x.wait(sends[peer], deadline);
      }
    } catch (const Error& e) {
      for (int p = 0; p < size; ++p)
        if (with(p)) withdraw(x, receives[p]), withdraw(x, sends[p]);
      throw Error(e.kind(), {.rank = x.rank(), .peer = peer, .operation = "cuda ipc setup"},
                  fmt::format("{} (every rank must set CudaStaged's ipc option alike and run the same gradsync)",
                              e.detail()));
    }
  }

  struct Mapping {
    int peer;
    std::uint64_t generation;
    std::byte* base;
  };

  struct Signal {
    typename X::Request request;
    int peer = -1;
    std::array<std::byte, 16> body{};
  };

  // The standing receive of a peer's notices, numbered per direction in the tag.
  struct Inbox {
    typename X::Request request;
    IpcNotice notice;
    std::uint16_t received = 0;
    bool closing = false;  // the peer said it is closing: nothing more comes
    bool gone = false;  // its receive failed: the peer is gone, or this rank aborted
  };

  struct Retiring {
    void* device;
    std::uint64_t generation;
    std::vector<bool> waiting_for;  // by peer
    int count;
  };

  // Notices to a peer are numbered in their tags, the number used up only once one has gone.
  void send_notice(X& x, int peer, const IpcNotice& notice) {
    signal(x, peer, engine::control_tag(notices_sent_[peer], engine::ControlMessage::transports, ipc_notice_message),
           std::as_bytes(std::span(&notice, 1)));
    ++notices_sent_[peer];
  }

  void post_inbox(X& x, int peer) {
    Inbox& inbox = *inboxes_[peer];
    x.recv(inbox.request, peer, engine::control_tag(inbox.received, engine::ControlMessage::transports, ipc_notice_message),
           std::as_writable_bytes(std::span(&inbox.notice, 1)));
  }

  // Reads the peer's notices that have come: answers a release (after closing the mapping;
  // not once this rank is closing: it maps nothing then, as its own closing notice says), counts
  // a release's answer, and takes "closing" as the answer for every block. The receive for the
  // next notice is posted before one is acted on, so a failure in between leaves none read twice.
  void read_notices(X& x, int peer) {
    Inbox& inbox = *inboxes_[peer];
    while (!inbox.gone && !inbox.closing) {
      try {
        if (!x.test(inbox.request)) return;
      } catch (const Error&) {
        return peer_gone(peer);
      }
      const IpcNotice notice = inbox.notice;
      ++inbox.received;
      if (notice.version != IpcNotice::current_version) {
        peer_gone(peer);  // nothing more is read from it
        throw Error(ErrorKind::protocol, {.rank = x.rank(), .peer = peer, .operation = "cuda ipc notice"},
                    fmt::format("a notice of version {}; expected {}", notice.version, IpcNotice::current_version));
      }
      if (notice.kind == IpcNotice::closing) {
        inbox.closing = true;  // nothing follows it: no receive to post
      } else {
        try {
          post_inbox(x, peer);
        } catch (const Error&) {
          peer_gone(peer);
        }
      }
      if (notice.kind == IpcNotice::release) {
        std::erase_if(mappings_, [&](const Mapping& m) {
          const bool it = m.peer == peer && m.generation == notice.generation;
          if (it) cuda::close_ipc_handle(m.base, device_);
          return it;
        });
        released_.emplace_back(peer, notice.generation);
        if (!closing_ && !inbox.gone) {
          try {
            send_notice(x, peer, {.kind = IpcNotice::released, .generation = notice.generation});
          } catch (const Error&) {  // the peer is gone or this rank aborted: it waits for no answer
          }
        }
      } else {
        const bool every_block = notice.kind == IpcNotice::closing;
        for (Retiring& r : retiring_)
          if ((every_block || r.generation == notice.generation) && r.waiting_for[peer]) {
            r.waiting_for[peer] = false;
            --r.count;
          }
      }
    }
  }

  // Its notices stop: what it has not answered for stays allocated.
  void peer_gone(int peer) { inboxes_[peer]->gone = true; }

  // Frees the retired blocks every peer has answered for. Not from read_notices(): cudaFree waits
  // for the whole device, which the communication thread should not do mid-iteration.
  void free_released() {
    std::erase_if(retiring_, [&](const Retiring& r) {
      if (r.count > 0) return false;
      cuda::free_on_device(r.device, device_);
      return true;
    });
  }

  int device_ = 0;
  std::vector<bool> reaches_;  // by peer; empty before connect()
  std::string fallback_;       // connect(): why peers on this GPU are not reached, if some are not
  int peers_ = 0;
  std::uint64_t generations_ = 0;
  std::vector<Mapping> mappings_;
  std::vector<std::pair<int, std::uint64_t>> released_;  // (peer, generation): never to be mapped again
  bool closing_ = false;
  std::vector<std::unique_ptr<Signal>> sent_;   // with X until it has sent them
  std::vector<std::unique_ptr<Signal>> spare_;  // for the next ones: no allocation per step
  std::vector<std::unique_ptr<Inbox>> inboxes_;  // by peer, for those reached
  std::vector<std::uint16_t> notices_sent_;      // by peer
  std::vector<Retiring> retiring_;
};

}  // namespace gradsync::transport::detail
