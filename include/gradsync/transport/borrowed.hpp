#pragma once
// transport::Borrowed<X> — a transport owned elsewhere, lent to a Synchronizer, so that several
// Synchronizers run on one set of connections: one per group (schedule.hpp), e.g. a machine-local
// group and the cross-machine group, or the two rings of a hybrid data/model-parallel trainer.
//
// Messages are told apart by tag, and two Synchronizers use the same tags, so their groups must
// not share a pair of ranks (the machine-local and cross-machine groups never do). The owner must
// outlive every borrower; an abort through any borrower aborts the transport for all of them.
//
//   auto world = transport::Tcp::from_env();
//   const auto launch = launch::from_environment();
//   Synchronizer<..., transport::Borrowed<transport::Tcp>> local(transport::Borrowed(world), Group::machine(launch));
//   Synchronizer<..., transport::Borrowed<transport::Tcp>> across(transport::Borrowed(world), Group::across_machines(launch));

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "gradsync/concepts.hpp"

namespace gradsync::transport {

template <TransportPolicy X>
class Borrowed {
  // A device transport's stream and its codecs' scratch are one Synchronizer's (cuda::Stream),
  // and a borrower that did not pass them on would hand host code device buckets.
  static_assert(!DeviceTransport<X>, "a device transport (Nccl, CudaStaged) cannot be borrowed: give each "
                                     "Synchronizer its own");

 public:
  using Request = typename X::Request;

  explicit Borrowed(X& owner) noexcept : x_(&owner) {}

  int rank() const noexcept { return x_->rank(); }
  int size() const noexcept { return x_->size(); }
  std::string describe() const { return x_->describe(); }

  void send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) { x_->send(r, peer, tag, bytes); }
  void recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) { x_->recv(r, peer, tag, bytes); }
  std::span<std::byte> allocate(std::size_t bytes)
    requires TransportAllocator<X>
  {
    return x_->allocate(bytes);
  }
  void deallocate(std::span<std::byte> block)
    requires TransportAllocator<X>
  {
    x_->deallocate(block);
  }
  bool adds_into(int peer, std::span<const std::byte> bytes) const noexcept
    requires TransportAdder<X>
  {
    return x_->adds_into(peer, bytes);
  }
  void recv_add(Request& r, int peer, std::uint64_t tag, std::span<float> values)
    requires TransportAdder<X>
  {
    x_->recv_add(r, peer, tag, values);
  }
  void recv_add(Request& r, int peer, std::uint64_t tag, std::span<double> values)
    requires TransportAdder<X>
  {
    x_->recv_add(r, peer, tag, values);
  }
  bool test(Request& r) { return x_->test(r); }
  std::size_t wait(Request& r, std::chrono::steady_clock::time_point deadline) { return x_->wait(r, deadline); }
  void abort(const Error& cause) { x_->abort(cause); }

 private:
  X* x_;
};

}  // namespace gradsync::transport
