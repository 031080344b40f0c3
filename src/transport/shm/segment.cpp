#include "transport/shm/segment.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include <boost/date_time/posix_time/posix_time_types.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <boost/interprocess/sync/scoped_lock.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

namespace gradsync::transport::shm {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::string_view proof_label = "gradsync-shm";
constexpr auto retry_pause = std::chrono::milliseconds(2);
constexpr std::size_t max_arena_bytes = std::size_t{1} << 40;

std::size_t align_up(std::size_t n) { return (n + 63) & ~std::size_t{63}; }

std::size_t page_up(std::size_t n) { return (n + page_bytes - 1) / page_bytes * page_bytes; }

// Where the arenas begin: after the header, the rank areas and the records, on a page boundary.
std::size_t arenas_at(std::uint32_t local_size, std::uint32_t capacity) {
  return page_up(align_up(sizeof(Header)) + align_up(sizeof(RankArea) * local_size) +
                 sizeof(Record) * static_cast<std::size_t>(local_size) * capacity);
}

std::size_t segment_bytes(std::uint32_t local_size, std::uint32_t capacity, std::uint64_t arena_bytes) {
  return arenas_at(local_size, capacity) + static_cast<std::size_t>(arena_bytes) * local_size;
}

// /proc/<pid>/stat: the state (field 3) and start time (field 22); nullopt if the process is gone.
struct ProcStat {
  char state = '?';
  std::uint64_t start_ticks = 0;
};
// The completion thread asks this of every peer while steps run, so it reads into the stack and
// parses in place: no stream, no string.
std::optional<ProcStat> read_stat(std::int32_t pid) {
  char path[32];
  *fmt::format_to_n(path, sizeof(path) - 1, "/proc/{}/stat", pid).out = '\0';
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::array<char, 1024> text;  // pid, a name of at most 64 bytes, then numeric fields
  ssize_t length;
  do {
    length = ::read(fd, text.data(), text.size());
  } while (length < 0 && errno == EINTR);
  ::close(fd);
  if (length <= 0) return std::nullopt;
  const std::string_view line(text.data(), static_cast<std::size_t>(length));
  const auto close = line.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string_view::npos) return std::nullopt;
  // After the name: " S ppid ...": field 3 is the state, field 22 the start time.
  std::string_view rest = line.substr(close + 1);
  const auto next_field = [&rest]() -> std::string_view {
    const auto begin = rest.find_first_not_of(' ');
    if (begin == std::string_view::npos) return {};
    const auto end = rest.find(' ', begin);
    const std::string_view field = rest.substr(begin, end - begin);
    rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end);
    return field;
  };
  ProcStat stat;
  const std::string_view state = next_field();
  if (state.size() != 1) return std::nullopt;
  stat.state = state[0];
  for (int field = 4; field < 22; ++field) next_field();
  const std::string_view start = next_field();
  if (std::from_chars(start.data(), start.data() + start.size(), stat.start_ticks).ec != std::errc{} || start.empty())
    return std::nullopt;
  return stat;
}

gradsync::detail::Digest creator_proof(const std::string& token, const std::array<std::uint8_t, 16>& nonce) {
  std::vector<std::byte> message(proof_label.size() + nonce.size());
  std::memcpy(message.data(), proof_label.data(), proof_label.size());
  std::memcpy(message.data() + proof_label.size(), nonce.data(), nonce.size());
  return gradsync::detail::hmac_sha256(std::as_bytes(std::span(token)), message);
}

Error setup_error(ErrorKind kind, const SharedMemoryOptions& o, std::string detail) {
  return Error(kind, {.rank = o.first_rank + o.local_rank, .operation = "shared-memory setup"}, std::move(detail));
}

}  // namespace

ProcessIdentity ProcessIdentity::self() {
  const auto pid = static_cast<std::int32_t>(::getpid());
  const auto stat = read_stat(pid);
  return {.pid = pid, .start_ticks = stat ? stat->start_ticks : 0};
}

ProcessIdentity::State ProcessIdentity::state() const {
  const auto stat = read_stat(pid);
  if (!stat || stat->state == 'Z' || stat->state == 'X' || stat->start_ticks != start_ticks) return State::gone;
  return stat->state == 'T' || stat->state == 't' ? State::stopped : State::running;
}

boost::posix_time::ptime utc_deadline(Clock::duration from_now) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::max(from_now, Clock::duration::zero()));
  return boost::posix_time::microsec_clock::universal_time() + boost::posix_time::microseconds(us.count());
}

std::string Segment::name(const SharedMemoryOptions& o) {
  const gradsync::detail::Digest digest = gradsync::detail::sha256(std::as_bytes(std::span(o.job)));
  return fmt::format("gradsync-{:02x}-m{}", fmt::join(std::span(digest).first(8), ""), o.first_rank);
}

Segment::Segment(const SharedMemoryOptions& o) : name_(name(o)) {
  if (o.local_size < 1 || o.local_rank < 0 || o.local_rank >= o.local_size)
    throw setup_error(ErrorKind::invalid_argument, o,
                      fmt::format("local rank {} of {} is not a place on this machine", o.local_rank, o.local_size));
  if (o.max_pending < 1 || o.max_pending > std::numeric_limits<std::uint32_t>::max() / (2 * o.local_size))
    throw setup_error(ErrorKind::invalid_argument, o, fmt::format("max_pending {} is out of range", o.max_pending));
  if (o.liveness.count() < 0)
    throw setup_error(ErrorKind::invalid_argument, o,
                      fmt::format("liveness {} ms is negative (0 turns it off)", o.liveness.count()));
  if (o.arena_bytes > max_arena_bytes)
    throw setup_error(ErrorKind::invalid_argument, o,
                      fmt::format("arena_bytes {} is more than the {} a rank may have", o.arena_bytes,
                                  max_arena_bytes));
  const auto deadline = Clock::now() + o.setup_timeout;
  try {
    if (o.local_rank == 0)
      create(o, deadline);
    else
      attach(o, deadline);
    await_everyone(o, deadline);
  } catch (...) {
    if (named_) ipc::shared_memory_object::remove(name_.c_str());
    throw;
  }
}

Segment::~Segment() {
  if (named_) ipc::shared_memory_object::remove(name_.c_str());
}

bool Segment::reserve(std::size_t offset, std::size_t n) const {
  if (n == 0) return true;
  const int fd = object_->get_mapping_handle().handle;
  const int error = ::posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(n));
  errno = error;
  return error == 0;
}

void Segment::lay_out() {
  auto* base = static_cast<std::byte*>(region_->get_address());
  header_ = reinterpret_cast<Header*>(base);
  areas_ = reinterpret_cast<RankArea*>(base + align_up(sizeof(Header)));
  records_ = reinterpret_cast<Record*>(base + align_up(sizeof(Header)) + align_up(sizeof(RankArea) * header_->local_size));
}

void Segment::create(const SharedMemoryOptions& o, Clock::time_point deadline) {
  const auto size = static_cast<std::uint32_t>(o.local_size);
  const auto capacity = static_cast<std::uint32_t>(o.max_pending);
  std::optional<ipc::shared_memory_object> object;
  while (!object) {
    try {
      object.emplace(ipc::create_only, name_.c_str(), ipc::read_write, ipc::permissions(0600));
    } catch (const ipc::interprocess_exception& e) {
      if (e.get_error_code() != ipc::already_exists_error)
        throw setup_error(ErrorKind::internal, o, fmt::format("cannot create segment {}: {}", name_, e.what()));
      // Someone left a segment under this job's name. A running creator means another job claims
      // the name; anything else is a job that died during setup, whose segment is replaced.
      try {
        ipc::shared_memory_object old(ipc::open_only, name_.c_str(), ipc::read_only);
        ipc::offset_t old_size = 0;
        if (old.get_size(old_size) && old_size >= static_cast<ipc::offset_t>(sizeof(Header))) {
          ipc::mapped_region view(old, ipc::read_only, 0, sizeof(Header));
          const auto* h = static_cast<const Header*>(view.get_address());
          if (h->magic.load(std::memory_order_acquire) == segment_magic && h->creator.running())
            throw setup_error(ErrorKind::invalid_argument, o,
                              fmt::format("segment {} belongs to a running job (its creator is pid {}); "
                                          "two jobs with one token and master address?",
                                          name_, h->creator.pid));
        }
      } catch (const ipc::interprocess_exception&) {
        // gone meanwhile: create it on the next pass
      }
      ipc::shared_memory_object::remove(name_.c_str());
      if (Clock::now() > deadline)
        throw setup_error(ErrorKind::timeout, o, fmt::format("could not replace stale segment {}", name_));
    }
  }
  named_ = true;
  const std::uint64_t arena_bytes = page_up(o.arena_bytes);
  object->truncate(static_cast<ipc::offset_t>(segment_bytes(size, capacity, arena_bytes)));
  object_ = std::move(object);
  // The control part gets its memory now; the arenas stay sparse until allocations claim pages.
  if (!reserve(0, arenas_at(size, capacity)))
    throw setup_error(ErrorKind::internal, o,
                      fmt::format("/dev/shm has no room for the {} bytes of segment {}'s queues: {}",
                                  arenas_at(size, capacity), name_, std::strerror(errno)));
  region_ = std::make_unique<ipc::mapped_region>(*object_, ipc::read_write);

  auto* h = new (region_->get_address()) Header();
  h->local_size = size;
  h->capacity = capacity;
  h->arenas_at = arenas_at(size, capacity);
  h->arena_bytes = arena_bytes;
  h->creator = ProcessIdentity::self();
  std::random_device random;
  for (auto& b : h->nonce) b = static_cast<std::uint8_t>(random());
  h->proof = creator_proof(o.token, h->nonce);
  lay_out();
  for (int r = 0; r < o.local_size; ++r) new (&areas_[r]) RankArea();
  for (std::size_t i = 0, n = static_cast<std::size_t>(size) * capacity; i < n; ++i) new (&records_[i]) Record();
  areas_[0].process = h->creator;
  areas_[0].mapped_at = reinterpret_cast<std::uint64_t>(h);
  h->attached = 1;
  h->magic.store(segment_magic, std::memory_order_release);
}

void Segment::attach(const SharedMemoryOptions& o, Clock::time_point deadline) {
  std::string last_seen = "no segment yet";
  for (;; std::this_thread::sleep_for(retry_pause)) {
    if (Clock::now() > deadline)
      throw setup_error(ErrorKind::timeout, o,
                        fmt::format("local rank 0 did not provide segment {} in time ({})", name_, last_seen));
    try {
      ipc::shared_memory_object object(ipc::open_only, name_.c_str(), ipc::read_write);
      ipc::offset_t size = 0;
      if (!object.get_size(size) || size < static_cast<ipc::offset_t>(sizeof(Header))) continue;  // being made
      auto region = std::make_unique<ipc::mapped_region>(object, ipc::read_write);
      auto* h = static_cast<Header*>(region->get_address());
      if (h->magic.load(std::memory_order_acquire) != segment_magic) {
        last_seen = "the one there is not initialised";
        continue;  // being made, or its maker died making it
      }
      if (h->version != segment_version)
        throw setup_error(ErrorKind::protocol, o,
                          fmt::format("segment {} has layout version {}, this library {}", name_, h->version,
                                      segment_version));
      if (!h->creator.running()) {
        last_seen = fmt::format("the one there was left by pid {}, which has exited: not joined", h->creator.pid);
        continue;  // a killed job's: local rank 0 replaces it
      }
      if (!gradsync::detail::equal_digests(h->proof, creator_proof(o.token, h->nonce)))
        throw setup_error(ErrorKind::protocol, o,
                          fmt::format("segment {} was not made by a holder of this job's token", name_));
      if (h->local_size != static_cast<std::uint32_t>(o.local_size) ||
          static_cast<std::size_t>(size) < segment_bytes(h->local_size, h->capacity, h->arena_bytes))
        throw setup_error(ErrorKind::mismatch, o,
                          fmt::format("local rank 0 made segment {} for {} local ranks, this rank counts {}", name_,
                                      h->local_size, o.local_size));
      region_ = std::move(region);
      object_.emplace(std::move(object));
      lay_out();
      ipc::scoped_lock lock(h->setup_mutex);
      RankArea& mine = areas_[o.local_rank];
      if (mine.process.pid != 0)
        throw setup_error(ErrorKind::mismatch, o,
                          fmt::format("local rank {} is already attached (pid {}): two processes with one LOCAL_RANK",
                                      o.local_rank, mine.process.pid));
      mine.process = ProcessIdentity::self();
      mine.mapped_at = reinterpret_cast<std::uint64_t>(header_);
      ++h->attached;
      h->setup_changed.notify_all();
      return;
    } catch (const ipc::interprocess_exception& e) {
      if (e.get_error_code() != ipc::not_found_error)
        throw setup_error(ErrorKind::internal, o, fmt::format("cannot open segment {}: {}", name_, e.what()));
    }
  }
}

void Segment::await_everyone(const SharedMemoryOptions& o, Clock::time_point deadline) {
  Header& h = *header_;
  ipc::scoped_lock lock(h.setup_mutex);
  const auto all = [&] { return h.attached == h.local_size; };
  if (!h.setup_changed.timed_wait(lock, utc_deadline(deadline - Clock::now()), all)) {
    std::vector<int> missing;
    for (int r = 0; r < o.local_size; ++r)
      if (areas_[r].process.pid == 0) missing.push_back(r);
    throw setup_error(ErrorKind::timeout, o,
                      fmt::format("local ranks {} did not attach to segment {} within {} ms", missing, name_,
                                  o.setup_timeout.count()));
  }
  if (named_) {
    // Everyone has it mapped: the name is no longer needed, and without it nothing outlives the job.
    ipc::shared_memory_object::remove(name_.c_str());
    named_ = false;
  }
}

}  // namespace gradsync::transport::shm
