#pragma once
// transport::InProcess — ranks are threads of one process. A message is copied once, straight from
// the sender's buffer into the receiver's, by whichever side posts second; nothing is buffered and
// nothing is allocated per message. It is the real transport for single-process multi-rank use,
// and what the tests run the whole library on.
//
//   auto ranks = gradsync::transport::InProcess::create_world(4);
//   // hand ranks[i] to the thread that plays rank i

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gradsync/concepts.hpp"
#include "gradsync/transport/operation.hpp"

namespace gradsync::detail {
template <class Request>
class IntrusiveQueue;
}

namespace gradsync::transport {

namespace detail {
struct InProcessWorld;
template <class Request>
class Matcher;
}

class InProcess {
 public:
  // One pending send or receive. Lives wherever the caller keeps it; must not move while pending.
  class Request : private detail::Operation<Request> {
   public:
    Request() = default;
    Request(const Request&) = delete;
    Request& operator=(const Request&) = delete;
    using detail::Operation<Request>::report_to;

   private:
    friend struct detail::InProcessWorld;
    template <class>
    friend class gradsync::detail::IntrusiveQueue;
    template <class>
    friend class detail::Matcher;
    friend class InProcess;
    std::atomic<State> state_{State::idle};  // completions come from other ranks' threads
    int owner_ = -1;                         // the rank that posted it
  };

  // `size` connected endpoints; endpoint i is rank i.
  static std::vector<InProcess> create_world(int size);

  int rank() const noexcept { return rank_; }
  int size() const noexcept;
  std::string describe() const;

  void send(Request& request, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& request, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  // A receive that adds the message to `values` (TransportAdder, concepts.hpp): every rank
  // addresses every buffer, so any receive can.
  void recv_add(Request& request, int peer, std::uint64_t tag, std::span<float> values);
  void recv_add(Request& request, int peer, std::uint64_t tag, std::span<double> values);
  bool adds_into(int peer, std::span<const std::byte>) const noexcept { return peer >= 0 && peer < size(); }
  bool test(Request& request);
  std::size_t wait(Request& request, std::chrono::steady_clock::time_point deadline);
  void abort(const Error& cause);

 private:
  InProcess(std::shared_ptr<detail::InProcessWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}
  void post(Request& request, bool is_send, int peer, std::uint64_t tag, const std::byte* source,
            std::byte* destination, std::size_t size, detail::Delivery delivery = detail::Delivery::copy);

  std::shared_ptr<detail::InProcessWorld> world_;
  int rank_ = 0;
};

static_assert(TransportPolicy<InProcess>);
static_assert(TransportAdder<InProcess>);

}  // namespace gradsync::transport
