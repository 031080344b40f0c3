#pragma once
// transport::Mpi's engine: matching headers to receives, the progress thread that owns every
// MPI request the transport has in flight, and failure (include/gradsync/transport/mpi.hpp).
//
// Locking. One mutex guards the engine's state. The array of MPI requests that MPI_Testsome reads
// is the progress thread's alone (MPI writes into it during the call, which runs without the
// lock); what each entry stands for sits beside it under the lock, and requests posted by other
// threads (MPI_THREAD_MULTIPLE) wait in `fresh_` until the progress thread takes them in. Only
// the progress thread tests or cancels an MPI request: MPI forbids two threads to work on one.
// The lock is taken before MPI's own and never the other way round.

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "detail/intrusive_queue.hpp"
#include "gradsync/transport/mpi.hpp"
#include "transport/mpi/wire.hpp"

namespace gradsync::transport::detail {

// What Mpi's constructor settled with the other ranks before the engine starts.
struct MpiSetup {
  MPI_Comm communicator = MPI_COMM_NULL;  // the transport's own (a duplicate), owned by the engine
  int rank = 0;
  int size = 1;
  int tag_ub = 32767;
  int thread_level = MPI_THREAD_MULTIPLE;
  std::uint64_t max_message_bytes = 0;
};

class MpiEngine {
 public:
  using Request = Mpi::Request;
  using Clock = std::chrono::steady_clock;

  explicit MpiEngine(const MpiSetup& setup);
  ~MpiEngine();
  MpiEngine(const MpiEngine&) = delete;
  MpiEngine& operator=(const MpiEngine&) = delete;

  int rank() const noexcept { return setup_.rank; }
  int size() const noexcept { return setup_.size; }
  int thread_level() const noexcept { return setup_.thread_level; }

  void send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes);
  void recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes);
  bool test(Request& r);
  std::size_t wait(Request& r, Clock::time_point deadline);
  void abort(const Error& cause);

 private:
  // What one MPI request of the progress thread stands for.
  struct InFlight {
    enum class Kind : std::uint8_t {
      header_in,   // the receive each peer's next header lands in (Peer::incoming)
      notice_in,   // the receive a notice from any rank lands in
      part,        // a send's header, or a payload piece of a send or a receive
      notice_out,  // a notice of ours (notices_out_)
      discard,     // the payload of a message that did not fit its receive, read to be dropped
    };
    Kind kind = Kind::part;
    int peer = -1;
    Request* request = nullptr;  // a part's; nullptr once given up to MPI (see fail_transport)
    bool cancel = false;         // wanted; the progress thread asks MPI
    bool cancel_asked = false;
    std::shared_ptr<std::vector<std::byte>> discarded{};  // a discard's buffer
  };

  struct Peer {
    gradsync::detail::IntrusiveQueue<Request> receives;  // posted, no header for them yet
    std::vector<mpi_wire::Header> parked;                 // headers no receive wanted yet, oldest first
    mpi_wire::HeaderWords incoming{};                     // where the next header lands
    std::uint64_t next_send = 0;                          // sequence numbers, per direction
    std::uint64_t next_receive = 0;
  };

  static const char* operation_of(const Request& r) { return r.is_send_ ? "send" : "recv"; }

  // Everything below requires the lock.
  void check_postable(Request& r, int peer, const char* operation, std::size_t sent_bytes);
  void hand_to_mpi(Request& r);  // now (MULTIPLE) or through the progress thread (SERIALIZED)
  void start_send(Request& r);
  void bind(Request& r, const mpi_wire::Header& h);
  void add_in_flight(MPI_Request handle, InFlight what);
  // Posts a payload of `length` bytes, its first piece numbered `sequence`: sends from `out`, or
  // receives into `in`, one MPI operation per piece, each standing for `what` (and counted in its
  // request). MPI's code for the first that failed (none after it posted), else MPI_SUCCESS.
  int post_payload(const std::byte* out, std::byte* in, std::uint64_t length, std::uint64_t sequence,
                   const InFlight& what);
  void finish(Request& r, Request::State state);
  void settle(Request& r);  // its last MPI part is done: done, failed or withdrawn
  void fail_now(Request& r, const Error& e);
  void fail_posting(Request& r, const Error& e);  // MPI refused to start one of r's operations
  Error failure_seen_by(const Request& r) const;
  // The transport cannot go on: every request fails, and with `tell_peers` every rank hears why.
  // `protocol_peer`: a rank told it was the protocol's (a message of its that did not fit).
  void fail_transport(const Error& e, bool tell_peers, int protocol_peer = -1);
  Error mpi_error(int code, int peer, const char* operation, const char* what) const;

  // The progress thread and what it does under the lock.
  void progress();
  void take_in_fresh();
  void post_deferred();
  void post_notices();
  void ask_cancels();
  bool retire();
  void completed(std::size_t index, const MPI_Status& status);
  void on_header(int peer, const MPI_Status& status, std::size_t index);
  void on_notice(const MPI_Status& status);
  bool busy() const noexcept;

  const MpiSetup setup_;
  const bool direct_;  // MPI_THREAD_MULTIPLE: callers post to MPI themselves

  mutable std::mutex mutex_;
  std::condition_variable settled_;  // a request settled, or the transport failed
  std::condition_variable work_;     // something for the progress thread
  std::vector<Peer> peers_;
  gradsync::detail::IntrusiveQueue<Request> deferred_;  // SERIALIZED: waiting for the progress thread
  std::size_t pending_ = 0;                             // requests posted and not settled
  std::vector<std::pair<MPI_Request, InFlight>> fresh_;
  std::vector<InFlight> what_;  // beside in_flight_
  mpi_wire::Notice notice_in_{};
  std::vector<mpi_wire::Notice> notices_out_;  // one per rank, filled when this rank fails
  bool notices_due_ = false;
  std::optional<Error> failure_;
  Clock::time_point failed_at_{};
  bool gave_up_ = false;  // MPI holds buffers of requests already handed back: no MPI call again
  bool stopping_ = false;

  std::vector<MPI_Request> in_flight_;  // the progress thread's (and setup's and teardown's)
  std::thread thread_;
};

}  // namespace gradsync::transport::detail
