#pragma once
// ReadInterrupt — how one thread tells another, reading a transport's sockets for itself, that it
// has other work (transport::Tcp::read_until). An eventfd: raising it is one write(2), safe from
// any thread, under any lock, and it stays raised until the reader looks at it.

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync::transport {

class ReadInterrupt {
 public:
  ReadInterrupt() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0)
      throw Error(ErrorKind::internal, {.operation = "setup"}, fmt::format("eventfd failed: {}", std::strerror(errno)));
  }
  ReadInterrupt(const ReadInterrupt&) = delete;
  ReadInterrupt& operator=(const ReadInterrupt&) = delete;
  ~ReadInterrupt() { ::close(fd_); }

  // Wakes the reader now, or makes its next read return at once. A counter that is full wakes as well.
  void raise() const noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto written = ::write(fd_, &one, sizeof one);
  }

  // What the reader polls beside its sockets.
  int fd() const noexcept { return fd_; }

 private:
  int fd_;
};

}  // namespace gradsync::transport
