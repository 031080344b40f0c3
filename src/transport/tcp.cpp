// transport::Tcp: the public class hands every call to its engine (tcp/engine.hpp), which keeps
// Asio out of the public header.

#include "gradsync/transport/tcp.hpp"

#include "transport/tcp/engine.hpp"

namespace gradsync::transport {

Tcp::Tcp(const TcpOptions& options) : engine_(std::make_unique<detail::TcpEngine>(options)) {}
Tcp::Tcp(Tcp&&) noexcept = default;
Tcp& Tcp::operator=(Tcp&&) noexcept = default;
Tcp::~Tcp() = default;

int Tcp::rank() const noexcept { return engine_->rank(); }
int Tcp::size() const noexcept { return engine_->size(); }
TcpTraffic Tcp::traffic() const { return engine_->traffic(); }
std::string Tcp::describe() const { return engine_->describe(); }

void Tcp::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) {
  engine_->post(r, true, peer, tag, bytes.data(), nullptr, bytes.size());
}
void Tcp::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) {
  engine_->post(r, false, peer, tag, nullptr, bytes.data(), bytes.size());
}
bool Tcp::test(Request& r) { return engine_->test(r); }
std::size_t Tcp::wait(Request& r, std::chrono::steady_clock::time_point deadline) { return engine_->wait(r, deadline); }
bool Tcp::read_until(Request& r, std::chrono::steady_clock::time_point until, const ReadInterrupt& interrupt) {
  return engine_->read_until(r, until, interrupt.fd());
}
void Tcp::abort(const Error& cause) { engine_->abort(cause); }

}  // namespace gradsync::transport
