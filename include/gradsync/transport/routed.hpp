#pragma once
// transport::Routed<Local, Remote> — one world over two transports: a message to a rank on this
// machine travels over `Local` (SharedMemory), one to a rank elsewhere over `Remote` (Tcp).
//
// Ranks are the remote transport's (the launch's): `remote` spans the whole job, `local` this
// machine's ranks, which the launchers number consecutively (machine m holds ranks m*L..m*L+L-1),
// so world rank p is local rank p - first_rank when it falls on this machine. A topology sees one
// flat world and never needs to know which way a message goes; topology::Hierarchical's schedule
// is what keeps most of its bytes on the local side.
//
// Memory comes from `Local` when it hands out its own (TransportAllocator: SharedMemory's arena), so
// a message between two ranks of this machine is one memcpy between arena buffers, not a
// cross-memory-attach copy; TCP reads and writes those same buffers as it would any others.
//
//   auto world = transport::Routed(transport::SharedMemory::from_env(), transport::Tcp::from_env());

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/error.hpp"
#include "gradsync/transport/read_interrupt.hpp"

namespace gradsync::transport {

template <TransportPolicy Local, TransportPolicy Remote>
class Routed {
 public:
  // Holds one request of each kind; a posting uses the one its peer's route needs.
  class Request {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    void report_to(CompletionSink* sink, std::uint64_t id) {
      local_.report_to(sink, id);
      remote_.report_to(sink, id);
    }

   private:
    friend class Routed;
    typename Local::Request local_;
    typename Remote::Request remote_;
    bool is_local_ = false;
  };

  Routed(Local local, Remote remote)
      : local_(std::move(local)), remote_(std::move(remote)), first_rank_(remote_.rank() - local_.rank()) {
    if (first_rank_ < 0 || first_rank_ + local_.size() > remote_.size())
      throw Error(ErrorKind::invalid_argument, {.rank = remote_.rank(), .operation = "routed transport"},
                  fmt::format("local rank {} of {} does not fit rank {} of {}: launchers must number a machine's "
                              "ranks consecutively",
                              local_.rank(), local_.size(), remote_.rank(), remote_.size()));
  }

  int rank() const noexcept { return remote_.rank(); }
  int size() const noexcept { return remote_.size(); }
  std::string describe() const {
    return fmt::format("routed({} within the machine, {} across)", local_.describe(), remote_.describe());
  }
  // This machine's ranks: [first_rank, first_rank + local_size).
  int first_rank() const noexcept { return first_rank_; }
  // The machine's own transport, for what only it offers (SharedMemory's shared blocks).
  Local& local() noexcept { return local_; }
  int local_size() const noexcept { return local_.size(); }

  void send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
    if ((r.is_local_ = on_this_machine(peer)))
      local_.send(r.local_, peer - first_rank_, tag, bytes);
    else
      remote_.send(r.remote_, peer, tag, bytes);
  }
  void recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
    if ((r.is_local_ = on_this_machine(peer)))
      local_.recv(r.local_, peer - first_rank_, tag, bytes);
    else
      remote_.recv(r.remote_, peer, tag, bytes);
  }
  // Receives that add (TransportAdder), from this machine's ranks only, where `Local` has them.
  bool adds_into(int peer, std::span<const std::byte> bytes) const noexcept
    requires TransportAdder<Local>
  {
    return on_this_machine(peer) && local_.adds_into(peer - first_rank_, bytes);
  }
  void recv_add(Request& r, int peer, std::uint64_t tag, std::span<float> values)
    requires TransportAdder<Local>
  {
    recv_add_locally(r, peer, tag, values);
  }
  void recv_add(Request& r, int peer, std::uint64_t tag, std::span<double> values)
    requires TransportAdder<Local>
  {
    recv_add_locally(r, peer, tag, values);
  }
  // Where `Local` says so, for this machine's ranks (concepts.hpp).
  bool passes_unmatched(int peer) const noexcept
    requires requires(const Local& l) { { l.passes_unmatched(0) } -> std::convertible_to<bool>; }
  {
    return on_this_machine(peer) && local_.passes_unmatched(peer - first_rank_);
  }
  bool test(Request& r) { return r.is_local_ ? local_.test(r.local_) : remote_.test(r.remote_); }
  std::size_t wait(Request& r, std::chrono::steady_clock::time_point deadline) {
    return r.is_local_ ? local_.wait(r.local_, deadline) : remote_.wait(r.remote_, deadline);
  }
  // Where `Remote` has it (CallerReader), for other machines' ranks; a local receive is never read so.
  bool read_until(Request& r, std::chrono::steady_clock::time_point until, const ReadInterrupt& interrupt)
    requires CallerReader<Remote>
  {
    return !r.is_local_ && remote_.read_until(r.remote_, until, interrupt);
  }
  // The local transport's memory, where it has its own (see the top of this file).
  std::span<std::byte> allocate(std::size_t bytes)
    requires TransportAllocator<Local>
  {
    return local_.allocate(bytes);
  }
  void deallocate(std::span<std::byte> block)
    requires TransportAllocator<Local>
  {
    local_.deallocate(block);
  }

  // Both sides: the machine's ranks hear it through shared memory, the others through their sockets.
  void abort(const Error& cause) {
    local_.abort(cause);
    remote_.abort(cause);
  }

 private:
  bool on_this_machine(int peer) const noexcept { return peer >= first_rank_ && peer < first_rank_ + local_.size(); }

  template <class T>
  void recv_add_locally(Request& r, int peer, std::uint64_t tag, std::span<T> values) {
    if (!on_this_machine(peer))
      throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = "recv_add"},
                  fmt::format("rank {} is on another machine: only receives from this machine's ranks can add "
                              "(adds_into() says which)",
                              peer));
    r.is_local_ = true;
    local_.recv_add(r.local_, peer - first_rank_, tag, values);
  }

  Local local_;
  Remote remote_;
  int first_rank_;
};

}  // namespace gradsync::transport
