// Fuzz target: transport::Tcp's frame header and hello decoders (src/transport/tcp/wire.cpp), the
// first bytes anyone who reaches a rank's port can make it read.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "transport/tcp/wire.hpp"

namespace wire = gradsync::transport::tcp_wire;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  std::string why;
  if (bytes.size() >= wire::header_bytes) {
    const auto header = wire::decode_header(bytes.first<wire::header_bytes>(), why);
    if (!header && why.empty()) __builtin_trap();  // a refusal must say why
  }
  if (bytes.size() >= wire::hello_bytes) {
    why.clear();
    const auto hello = wire::decode_hello(bytes.first<wire::hello_bytes>(), why);
    if (!hello && why.empty()) __builtin_trap();
  }
  return 0;
}
