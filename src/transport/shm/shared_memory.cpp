// transport::SharedMemory (shared_memory.hpp): the public class, which hands every call to its
// engine (engine.hpp), and its options from the launcher's environment.

#include "gradsync/transport/shared_memory.hpp"

#include <cctype>
#include <string_view>

#include <fmt/format.h>

#include "gradsync/launch/environment.hpp"
#include "launch/setting.hpp"
#include "transport/shm/engine.hpp"

namespace gradsync::transport {

SharedMemory::SharedMemory(const SharedMemoryOptions& options)
    : engine_(std::make_unique<detail::SharedMemoryEngine>(options)) {}
SharedMemory::SharedMemory(SharedMemory&&) noexcept = default;
SharedMemory& SharedMemory::operator=(SharedMemory&&) noexcept = default;
SharedMemory::~SharedMemory() = default;

int SharedMemory::rank() const noexcept { return engine_->rank(); }
int SharedMemory::size() const noexcept { return engine_->size(); }
std::string SharedMemory::describe() const { return engine_->describe(); }

void SharedMemory::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  engine_->post(r, true, peer, tag, bytes.data(), nullptr, bytes.size());
}
void SharedMemory::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  engine_->post(r, false, peer, tag, nullptr, bytes.data(), bytes.size());
}
template <class T>
void SharedMemory::post_add(Request& r, int peer, std::uint64_t tag, std::span<T> values) {
  const auto bytes = std::as_writable_bytes(values);
  if (!shared(bytes))
    throw Error(ErrorKind::invalid_argument, {.rank = rank(), .peer = peer, .operation = "recv_add"},
                fmt::format("recv_add into {} bytes outside this machine's arena: the sender may add them itself, so "
                            "they must come from allocate() and lie in the arena (adds_into() says where)",
                            bytes.size()));
  engine_->post(r, false, peer, tag, nullptr, bytes.data(), bytes.size(),
                std::is_same_v<T, float> ? detail::Delivery::add_f32 : detail::Delivery::add_f64);
}
void SharedMemory::recv_add(Request& r, int peer, std::uint64_t tag, std::span<float> values) {
  post_add(r, peer, tag, values);
}
void SharedMemory::recv_add(Request& r, int peer, std::uint64_t tag, std::span<double> values) {
  post_add(r, peer, tag, values);
}
bool SharedMemory::adds_into(int peer, std::span<const std::byte> bytes) const noexcept {
  return peer >= 0 && peer < size() && shared(bytes);
}
bool SharedMemory::test(Request& r) { return engine_->test(r); }
std::size_t SharedMemory::wait(Request& r, std::chrono::steady_clock::time_point deadline) {
  return engine_->wait(r, deadline);
}
void SharedMemory::abort(const Error& cause) { engine_->abort(cause); }
std::span<std::byte> SharedMemory::allocate(std::size_t bytes) { return engine_->allocate(bytes); }
void SharedMemory::deallocate(std::span<std::byte> block) noexcept { engine_->deallocate(block); }
bool SharedMemory::shared(std::span<const std::byte> bytes) const noexcept { return engine_->shared(bytes); }
std::uint64_t SharedMemory::offset_of(std::span<const std::byte> bytes) const { return engine_->offset_of(bytes); }
std::span<std::byte> SharedMemory::at_offset(std::uint64_t offset, std::size_t bytes) const {
  return engine_->at_offset(offset, bytes);
}

std::string SharedMemory::segment_name(const SharedMemoryOptions& options) { return shm::Segment::name(options); }

SharedMemoryOptions SharedMemory::options_from_env(const launch::Environment& env) {
  const launch::Launch launch = launch::from_environment(env);
  SharedMemoryOptions o;
  o.local_rank = launch.local_rank;
  o.local_size = launch.local_world_size;
  o.first_rank = launch.rank - launch.local_rank;
  o.token = launch.token;
  o.job = fmt::format("{}\n{}:{}", launch.token, launch.master_addr, launch.master_port);
  if (const auto t = launch::number_setting("GRADSYNC_SETUP_TIMEOUT_S", 1, 86400)) o.setup_timeout = std::chrono::seconds(*t);
  if (const auto l = launch::number_setting("GRADSYNC_LIVENESS_MS", 0, 86400000)) o.liveness = std::chrono::milliseconds(*l);
  if (const auto a = launch::process_environment("GRADSYNC_SHM_ARENA_BYTES")) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(a->c_str(), &end, 10);
    const std::string_view suffix(end);
    const int shift = suffix.empty() ? 0 : suffix == "K" ? 10 : suffix == "M" ? 20 : suffix == "G" ? 30 : -1;
    if (a->empty() || !std::isdigit(static_cast<unsigned char>(a->front())) || errno || shift < 0 ||
        n > (std::numeric_limits<std::size_t>::max() >> shift))
      throw Error(ErrorKind::invalid_argument, {.operation = "launch"},
                  fmt::format("GRADSYNC_SHM_ARENA_BYTES={:?} is not a number of bytes (with K, M or G as suffix)", *a));
    o.arena_bytes = static_cast<std::size_t>(n) << shift;
  }
  return o;
}

}  // namespace gradsync::transport
