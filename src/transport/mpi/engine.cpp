#include "transport/mpi/engine.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "transport/delivery.hpp"
#include "transport/errors.hpp"

namespace gradsync::transport::detail {

namespace {

using namespace std::chrono_literals;

// How long MPI may take to let go of the requests of a failed transport, or of one withdrawn at
// its deadline, before gradsync gives them up to it (mpi.hpp, "Failure").
constexpr auto cancel_grace = 500ms;
// Polling: empty tests yield the core this many times before sleeping between tests, this long
// (a post wakes the thread at once). With nothing posted the thread sleeps at most `idle_sleep`.
constexpr int yielding_tests = 200;
constexpr auto polling_sleep = 50us;
constexpr auto idle_sleep = 10ms;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(length));
}

}  // namespace

MpiEngine::MpiEngine(const MpiSetup& setup)
    : setup_(setup), direct_(setup.thread_level == MPI_THREAD_MULTIPLE), peers_(static_cast<std::size_t>(setup.size)) {
  // A header receive from every rank and one notice receive stay posted for the transport's life.
  for (int p = 0; p < setup_.size; ++p) {
    MPI_Request handle;
    const int code = MPI_Irecv(peers_[static_cast<std::size_t>(p)].incoming, sizeof(mpi_wire::HeaderWords), MPI_BYTE, p,
                               mpi_wire::header_tag, setup_.communicator, &handle);
    if (code != MPI_SUCCESS) throw mpi_error(code, p, "setup", "MPI_Irecv of the header receive");
    in_flight_.push_back(handle);
    what_.push_back({.kind = InFlight::Kind::header_in, .peer = p});
  }
  MPI_Request handle;
  const int code = MPI_Irecv(&notice_in_, sizeof(notice_in_), MPI_BYTE, MPI_ANY_SOURCE, mpi_wire::notice_tag,
                             setup_.communicator, &handle);
  if (code != MPI_SUCCESS) throw mpi_error(code, -1, "setup", "MPI_Irecv of the notice receive");
  in_flight_.push_back(handle);
  what_.push_back({.kind = InFlight::Kind::notice_in});
  thread_ = std::thread([this] { progress(); });
}

MpiEngine::~MpiEngine() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  thread_.join();
  take_in_fresh();
  if (gave_up_) {
    // MPI may still write into or read from buffers their owners were told they could free.
    std::fprintf(stderr, "gradsync: rank %d: transport::Mpi ends the job (MPI_Abort): MPI still holds buffers of "
                 "operations it could not withdraw after: %s\n", setup_.rank, failure_ ? failure_->what() : "a timeout");
    MPI_Abort(setup_.communicator, 1);
  }
  // What stays posted is withdrawn: the header and notice receives (a message that did arrive
  // completes them instead), and our notices, which complete once sent.
  for (std::size_t i = 0; i < in_flight_.size(); ++i)
    if (in_flight_[i] != MPI_REQUEST_NULL && what_[i].kind != InFlight::Kind::notice_out && !what_[i].cancel_asked)
      MPI_Cancel(&in_flight_[i]);  // (Open MPI's ob1 crashes on a second cancel)
  const auto until = Clock::now() + 2s;
  int all = 0;
  while (MPI_Testall(static_cast<int>(in_flight_.size()), in_flight_.data(), &all, MPI_STATUSES_IGNORE) == MPI_SUCCESS &&
         !all && Clock::now() < until)
    std::this_thread::yield();
  if (!all) {
    std::fprintf(stderr, "gradsync: rank %d: transport::Mpi ends the job (MPI_Abort): MPI did not let go of its "
                 "requests within 2 s of the transport's end\n", setup_.rank);
    MPI_Abort(setup_.communicator, 1);
  }
  // MPI_Comm_free is collective: only a transport that did not fail can count on its peers.
  MPI_Comm communicator = setup_.communicator;
  if (!failure_) MPI_Comm_free(&communicator);
}

// ---------------------------------------------------------------------------------------------
// Posting

void MpiEngine::check_postable(Request& r, int peer, const char* operation, std::size_t sent_bytes) {
  if (peer < 0 || peer >= setup_.size)
    throw Error(ErrorKind::invalid_argument, error_context(setup_.rank, peer, operation),
                fmt::format("no rank {} in a world of {}", peer, setup_.size));
  if (r.state_ == Request::State::pending)
    throw Error(ErrorKind::invalid_argument, error_context(setup_.rank, peer, operation),
                "request reused while still pending");
  if (sent_bytes > setup_.max_message_bytes)
    throw Error(ErrorKind::invalid_argument, error_context(setup_.rank, peer, operation),
                fmt::format("{} bytes exceed the transport's {}-byte message limit (MpiOptions::max_message_bytes)",
                            sent_bytes, setup_.max_message_bytes));
  if (failure_) throw failure_->filled(error_context(setup_.rank, peer, operation));
}

void MpiEngine::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  std::lock_guard lock(mutex_);
  check_postable(r, peer, "send", bytes.size());
  r.start(true, peer, tag, bytes.data(), nullptr, bytes.size());
  r.state_ = Request::State::pending;
  r.withdrawn_ = false;
  ++pending_;
  hand_to_mpi(r);
  work_.notify_one();
}

void MpiEngine::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  std::lock_guard lock(mutex_);
  check_postable(r, peer, "recv", 0);  // a receive may have room beyond the limit
  r.start(false, peer, tag, nullptr, bytes.data(), bytes.size());
  r.state_ = Request::State::pending;
  r.withdrawn_ = false;
  ++pending_;
  Peer& p = peers_[static_cast<std::size_t>(peer)];
  const auto parked = std::find_if(p.parked.begin(), p.parked.end(), [&](const auto& h) { return h.tag == tag; });
  if (parked == p.parked.end()) {
    p.receives.push(&r);
  } else {
    r.sequence_ = parked->sequence;
    r.length_ = parked->length;
    p.parked.erase(parked);
    hand_to_mpi(r);
  }
  work_.notify_one();
}

void MpiEngine::hand_to_mpi(Request& r) {
  if (!direct_) {
    deferred_.push(&r);
    return;
  }
  if (r.is_send_)
    start_send(r);
  else
    bind(r, {.tag = r.tag_, .length = r.length_, .sequence = r.sequence_});
}

void MpiEngine::add_in_flight(MPI_Request handle, InFlight what) { fresh_.emplace_back(handle, std::move(what)); }

int MpiEngine::post_payload(const std::byte* out, std::byte* in, std::uint64_t length, std::uint64_t sequence,
                            const InFlight& what) {
  for (std::uint64_t k = 0, offset = 0; offset < length; ++k, offset += mpi_wire::max_piece_bytes) {
    const auto bytes = static_cast<int>(std::min<std::uint64_t>(mpi_wire::max_piece_bytes, length - offset));
    const int tag = mpi_wire::payload_tag(sequence + k, setup_.tag_ub);
    MPI_Request handle;
    const int code = out ? MPI_Isend(out + offset, bytes, MPI_BYTE, what.peer, tag, setup_.communicator, &handle)
                         : MPI_Irecv(in + offset, bytes, MPI_BYTE, what.peer, tag, setup_.communicator, &handle);
    if (code != MPI_SUCCESS) return code;
    if (what.request) ++what.request->in_mpi_;
    add_in_flight(handle, what);
  }
  return MPI_SUCCESS;
}

// The header, then the payload's pieces. Sequence numbers are drawn here, in the order sends reach
// MPI, which is the order their headers travel in.
void MpiEngine::start_send(Request& r) {
  Peer& p = peers_[static_cast<std::size_t>(r.peer_)];
  r.sequence_ = p.next_send;
  r.transferred_ = r.size_;
  p.next_send += mpi_wire::pieces(r.size_);
  mpi_wire::encode({.tag = r.tag_, .length = r.size_, .sequence = r.sequence_}, r.header_);
  MPI_Request handle;
  int code = MPI_Isend(r.header_, sizeof(r.header_), MPI_BYTE, r.peer_, mpi_wire::header_tag, setup_.communicator, &handle);
  if (code != MPI_SUCCESS) return fail_posting(r, mpi_error(code, r.peer_, "send", "MPI_Isend of a header"));
  ++r.in_mpi_;
  add_in_flight(handle, {.kind = InFlight::Kind::part, .peer = r.peer_, .request = &r});
  code = post_payload(r.source_, nullptr, r.size_, r.sequence_, {.kind = InFlight::Kind::part, .peer = r.peer_, .request = &r});
  if (code != MPI_SUCCESS) return fail_posting(r, mpi_error(code, r.peer_, "send", "MPI_Isend of a payload"));
}

// A receive met its header: its payload's pieces are posted into its buffer.
void MpiEngine::bind(Request& r, const mpi_wire::Header& h) {
  if (h.length > r.size_) {
    const std::string why = misfit(h.length, r.size_, Delivery::copy, h.tag);
    const Error e(ErrorKind::protocol, error_context(setup_.rank, r.peer_, "recv"), fmt::format("from rank {}: {}", r.peer_, why));
    // The payload is read somewhere and dropped, so that the sender's MPI request can finish.
    auto discarded = std::make_shared<std::vector<std::byte>>(h.length);
    post_payload(nullptr, discarded->data(), h.length, h.sequence,
                 {.kind = InFlight::Kind::discard, .peer = r.peer_, .discarded = discarded});
    fail_transport(e, true, r.peer_);
    fail_now(r, e);
    return;
  }
  r.transferred_ = h.length;
  const int code = post_payload(nullptr, r.destination_, h.length, h.sequence,
                                {.kind = InFlight::Kind::part, .peer = r.peer_, .request = &r});
  if (code != MPI_SUCCESS) return fail_posting(r, mpi_error(code, r.peer_, "recv", "MPI_Irecv of a payload"));
  if (r.in_mpi_ == 0) settle(r);
}

// ---------------------------------------------------------------------------------------------
// Completion

void MpiEngine::finish(Request& r, Request::State state) {
  // Once the state is stored the owner may return and free `r`: the sink hears first.
  if (state != Request::State::idle) r.report();
  r.state_ = state;
  --pending_;
  settled_.notify_all();
}

void MpiEngine::settle(Request& r) {
  if (r.error_)
    finish(r, Request::State::failed);
  else
    finish(r, r.withdrawn_ ? Request::State::idle : Request::State::done);
}

void MpiEngine::fail_posting(Request& r, const Error& e) {
  fail_transport(e, true);
  fail_now(r, e);
}

void MpiEngine::fail_now(Request& r, const Error& e) {
  r.error_ = e;
  if (r.in_mpi_ == 0) finish(r, Request::State::failed);
}

Error MpiEngine::failure_seen_by(const Request& r) const {
  return failure_->filled(error_context(setup_.rank, r.peer_, operation_of(r)));
}

Error MpiEngine::mpi_error(int code, int peer, const char* operation, const char* what) const {
  return Error(ErrorKind::peer_failed, error_context(setup_.rank, peer, operation),
               fmt::format("{}{} failed: {}", what, peer >= 0 ? fmt::format(" with rank {}", peer) : std::string(),
                           mpi_error_text(code)));
}

bool MpiEngine::test(Request& r) {
  std::lock_guard lock(mutex_);
  switch (r.state_) {
    case Request::State::done: return true;
    case Request::State::failed: throw *r.error_;
    case Request::State::pending: return false;
    case Request::State::idle: break;
  }
  throw Error(ErrorKind::invalid_argument, {.rank = setup_.rank, .operation = "test"}, "request was never posted");
}

std::size_t MpiEngine::wait(Request& r, Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  if (r.state_ == Request::State::idle)
    throw Error(ErrorKind::invalid_argument, {.rank = setup_.rank, .operation = "wait"}, "request was never posted");
  const auto settled = [&] { return r.state_ != Request::State::pending; };
  if (!settled_.wait_until(lock, deadline, settled)) {
    const Error timeout(ErrorKind::timeout, error_context(setup_.rank, r.peer_, operation_of(r)),
                        fmt::format("no matching {} of rank {} (tag {:#x}) came before the deadline",
                                    r.is_send_ ? "receive" : "send", r.peer_, r.tag_));
    if (r.in_mpi_ == 0) {
      // Not in MPI's hands: a receive with no header yet, or a posting the progress thread has
      // not made. A receive that had taken its header leaves it for the next receive.
      Peer& p = peers_[static_cast<std::size_t>(r.peer_)];
      if (!p.receives.remove(&r) && deferred_.remove(&r) && !r.is_send_)
        p.parked.insert(p.parked.begin(), {.tag = r.tag_, .length = r.length_, .sequence = r.sequence_});
      finish(r, Request::State::idle);
      throw timeout;
    }
    for (auto& [handle, what] : fresh_)
      if (what.request == &r) what.cancel = true;
    for (auto& what : what_)
      if (what.request == &r) what.cancel = true;
    work_.notify_one();
    if (!settled_.wait_for(lock, cancel_grace, settled)) {
      // MPI keeps the buffer (Open MPI cannot cancel a send its receiver has not taken): the
      // transport gives up, and tells every rank.
      fail_transport(timeout, true);
      settled_.wait(lock, settled);  // fail_transport gives up what MPI holds within the grace
    }
    if (r.state_ == Request::State::idle) throw timeout;
  }
  if (r.state_ == Request::State::failed) throw *r.error_;
  return r.transferred_;
}

// ---------------------------------------------------------------------------------------------
// Failure

void MpiEngine::abort(const Error& cause) {
  std::unique_lock lock(mutex_);
  fail_transport(cause, true);
  // Returns once the notices are on their way, or the transport gave up on MPI.
  settled_.wait_for(lock, cancel_grace, [&] { return !notices_due_ || gave_up_; });
}

void MpiEngine::fail_transport(const Error& e, bool tell_peers, int protocol_peer) {
  if (failure_) return;
  failure_ = e;
  failed_at_ = Clock::now();
  const auto fail_queued = [&](Request* r) { fail_now(*r, failure_seen_by(*r)); };
  for (Peer& p : peers_) {
    p.receives.drain(fail_queued);
    p.parked.clear();
  }
  deferred_.drain(fail_queued);
  // What MPI has of ours is withdrawn where it lets us, given up after cancel_grace where not.
  const auto withdraw = [&](InFlight& what) {
    // A notice goes on; so does a dropped payload, which its sender's request waits for.
    what.cancel = what.kind != InFlight::Kind::notice_out && what.kind != InFlight::Kind::discard;
    if (what.request && !what.request->error_) what.request->error_ = failure_seen_by(*what.request);
  };
  for (auto& [handle, what] : fresh_) withdraw(what);
  for (auto& what : what_) withdraw(what);
  if (tell_peers) {
    const int origin = e.origin() ? e.origin()->rank : setup_.rank;
    const std::string reason = e.origin() ? e.origin()->cause : e.what();
    notices_out_.resize(static_cast<std::size_t>(setup_.size));
    for (int p = 0; p < setup_.size; ++p) {
      auto& notice = notices_out_[static_cast<std::size_t>(p)];
      notice.words[0] = mpi_wire::first_word;
      notice.words[1] = static_cast<std::uint64_t>(p == protocol_peer ? ErrorKind::protocol : ErrorKind::peer_failed);
      notice.words[2] = static_cast<std::uint64_t>(origin);
      const std::size_t n = std::min(reason.size(), mpi_wire::max_reason_bytes);
      std::memcpy(notice.reason, reason.data(), n);
      std::memset(notice.reason + n, 0, mpi_wire::max_reason_bytes - n);
    }
    notices_due_ = setup_.size > 1;
  }
  settled_.notify_all();
  work_.notify_one();
}

// ---------------------------------------------------------------------------------------------
// The progress thread

bool MpiEngine::busy() const noexcept { return pending_ > 0 || notices_due_ || !fresh_.empty() || failure_; }

void MpiEngine::progress() {
  std::vector<int> indices;
  std::vector<MPI_Status> statuses;
  int idle_tests = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (idle_tests >= yielding_tests || !busy())
        work_.wait_for(lock, busy() ? std::chrono::duration_cast<std::chrono::microseconds>(polling_sleep) : idle_sleep);
      post_notices();  // even when stopping: a failure's notices must go before the transport does
      if (stopping_) return;
      post_deferred();
      take_in_fresh();
      ask_cancels();
      if (failure_ && retire()) return;
    }
    indices.resize(in_flight_.size());
    statuses.resize(in_flight_.size());
    int count = 0;
    const int code =
        MPI_Testsome(static_cast<int>(in_flight_.size()), in_flight_.data(), &count, indices.data(), statuses.data());
    if (code != MPI_SUCCESS && code != MPI_ERR_IN_STATUS) {
      std::lock_guard lock(mutex_);
      fail_transport(mpi_error(code, -1, "progress", "MPI_Testsome"), true);
      continue;
    }
    // Without MPI_ERR_IN_STATUS the statuses' error fields are not set: every one succeeded.
    if (code == MPI_SUCCESS && count != MPI_UNDEFINED)
      for (int k = 0; k < count; ++k) statuses[static_cast<std::size_t>(k)].MPI_ERROR = MPI_SUCCESS;
    if (count == MPI_UNDEFINED || count == 0) {
      ++idle_tests;
      if (idle_tests < yielding_tests) std::this_thread::yield();
      continue;
    }
    idle_tests = 0;
    std::lock_guard lock(mutex_);
    for (int k = 0; k < count; ++k) completed(static_cast<std::size_t>(indices[static_cast<std::size_t>(k)]), statuses[static_cast<std::size_t>(k)]);
    // Drop what MPI finished (a re-posted header receive took its slot back).
    std::size_t kept = 0;
    for (std::size_t i = 0; i < in_flight_.size(); ++i) {
      if (in_flight_[i] == MPI_REQUEST_NULL) continue;
      in_flight_[kept] = in_flight_[i];
      what_[kept] = std::move(what_[i]);
      ++kept;
    }
    in_flight_.resize(kept);
    what_.resize(kept);
  }
}

void MpiEngine::take_in_fresh() {
  for (auto& [handle, what] : fresh_) {
    in_flight_.push_back(handle);
    what_.push_back(std::move(what));
  }
  fresh_.clear();
}

void MpiEngine::post_deferred() {
  while (Request* r = deferred_.pop()) {
    if (r->is_send_)
      start_send(*r);
    else
      bind(*r, {.tag = r->tag_, .length = r->length_, .sequence = r->sequence_});
  }
}

void MpiEngine::post_notices() {
  if (!notices_due_) return;
  notices_due_ = false;
  for (int p = 0; p < setup_.size; ++p) {
    if (p == setup_.rank) continue;
    MPI_Request handle;
    if (MPI_Isend(&notices_out_[static_cast<std::size_t>(p)], sizeof(mpi_wire::Notice), MPI_BYTE, p, mpi_wire::notice_tag,
                  setup_.communicator, &handle) == MPI_SUCCESS)
      add_in_flight(handle, {.kind = InFlight::Kind::notice_out, .peer = p});
  }
  take_in_fresh();
  settled_.notify_all();
}

void MpiEngine::ask_cancels() {
  for (std::size_t i = 0; i < in_flight_.size(); ++i) {
    InFlight& what = what_[i];
    if (!what.cancel || what.cancel_asked || in_flight_[i] == MPI_REQUEST_NULL) continue;
    what.cancel_asked = true;
    MPI_Cancel(&in_flight_[i]);
  }
}

// A failed transport's progress thread stops once MPI holds nothing of a request any more (its
// notices are on their way: every later posting fails without MPI). Requests MPI still holds after
// the grace are handed back failed, and gradsync makes no MPI call again: the destructor ends the
// job (mpi.hpp, "Failure").
bool MpiEngine::retire() {
  const auto held = [](const InFlight& what) { return what.kind == InFlight::Kind::part && what.request; };
  if (std::none_of(what_.begin(), what_.end(), held)) return true;
  if (Clock::now() - failed_at_ < cancel_grace) return false;
  for (InFlight& what : what_) {
    if (!held(what)) continue;
    Request& r = *what.request;
    what.request = nullptr;
    gave_up_ = true;
    if (r.state_ == Request::State::pending) {
      r.in_mpi_ = 0;
      if (!r.error_) r.error_ = failure_seen_by(r);
      finish(r, Request::State::failed);
    }
  }
  settled_.notify_all();
  return true;
}

void MpiEngine::completed(std::size_t index, const MPI_Status& status) {
  InFlight& what = what_[index];
  int cancelled = 0;
  MPI_Test_cancelled(&status, &cancelled);
  switch (what.kind) {
    case InFlight::Kind::header_in:
      if (!cancelled) on_header(what.peer, status, index);
      return;
    case InFlight::Kind::notice_in:
      if (!cancelled) on_notice(status);
      return;
    case InFlight::Kind::notice_out:
    case InFlight::Kind::discard: return;
    case InFlight::Kind::part: break;
  }
  if (!what.request) return;
  Request& r = *what.request;
  what.request = nullptr;
  if (cancelled) r.withdrawn_ = true;
  if (status.MPI_ERROR != MPI_SUCCESS && !cancelled && !r.error_) {
    const Error e = mpi_error(status.MPI_ERROR, r.peer_, operation_of(r), r.is_send_ ? "MPI_Isend" : "MPI_Irecv");
    r.error_ = e;
    fail_transport(e, true);
  }
  if (--r.in_mpi_ == 0) settle(r);
}

void MpiEngine::on_header(int peer, const MPI_Status& status, std::size_t index) {
  Peer& p = peers_[static_cast<std::size_t>(peer)];
  if (status.MPI_ERROR != MPI_SUCCESS) return fail_transport(mpi_error(status.MPI_ERROR, peer, "recv", "a header's MPI_Irecv"), true);
  int received = 0;
  MPI_Get_count(&status, MPI_BYTE, &received);
  std::string why;
  auto h = mpi_wire::decode(p.incoming, received, why);
  if (h && h->sequence != p.next_receive)
    why = fmt::format("a header numbered {} where {} was next", h->sequence, p.next_receive);
  else if (h && h->length > setup_.max_message_bytes)
    why = fmt::format("a message of {} bytes, over the {}-byte limit", h->length, setup_.max_message_bytes);
  if (!why.empty()) return fail_transport(protocol_error(setup_.rank, peer, why), true);
  p.next_receive += mpi_wire::pieces(h->length);
  if (failure_) return;
  const int code = MPI_Irecv(p.incoming, sizeof(mpi_wire::HeaderWords), MPI_BYTE, peer, mpi_wire::header_tag,
                             setup_.communicator, &in_flight_[index]);
  if (code != MPI_SUCCESS) return fail_transport(mpi_error(code, peer, "recv", "MPI_Irecv of the header receive"), true);
  if (Request* r = p.receives.take_if([&](const Request* q) { return q->tag_ == h->tag; }))
    bind(*r, *h);
  else
    p.parked.push_back(*h);
}

void MpiEngine::on_notice(const MPI_Status& status) {
  const int from = status.MPI_SOURCE;
  int received = 0;
  MPI_Get_count(&status, MPI_BYTE, &received);
  const auto header_bytes = static_cast<int>(sizeof(notice_in_.words));
  if (status.MPI_ERROR != MPI_SUCCESS || received < header_bytes || notice_in_.words[0] != mpi_wire::first_word)
    return fail_transport(protocol_error(setup_.rank, from, fmt::format("a notice of {} bytes that is not gradsync's", received)),
                          false);
  const auto kind = static_cast<ErrorKind>(notice_in_.words[1]);
  const int origin = static_cast<int>(notice_in_.words[2]);
  const std::string reason(notice_in_.reason, ::strnlen(notice_in_.reason, std::min<std::size_t>(
                                                  mpi_wire::max_reason_bytes, static_cast<std::size_t>(received - header_bytes))));
  std::string detail = kind == ErrorKind::protocol ? fmt::format("rank {} refused our message: {}", from, reason)
                       : origin == from            ? fmt::format("rank {} failed: {}", from, reason)
                                                   : fmt::format("rank {} failed first ({}), and rank {} stopped because of it",
                                                                 origin, reason, from);
  fail_transport(Error(kind == ErrorKind::protocol ? ErrorKind::protocol : ErrorKind::peer_failed,
                       error_context(setup_.rank, from, "recv"), std::move(detail))
                     .with_origin({origin, reason}),
                 false);
}

}  // namespace gradsync::transport::detail
