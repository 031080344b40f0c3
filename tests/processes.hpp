#pragma once
// Multi-process tests: fork one child per rank, let each report one line back through a pipe,
// and never wait longer than a deadline (children still running then are killed and reported).

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/error.hpp"

namespace gradsync::test {

// A port to give a test job's rank 0, free now and below the kernel's range for ports it assigns
// itself (ip_local_port_range): every rank also listens on a port of the system's choosing and
// opens connections from such ports, and a parallel test's socket could otherwise take the port
// between this pick and rank 0's bind.
inline std::uint16_t free_port() {
  int ephemeral_low = 32768;
  if (std::FILE* range = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(range, "%d", &ephemeral_low) != 1) ephemeral_low = 32768;
    std::fclose(range);
  }
  const int low = 10000, high = std::max(low + 1000, ephemeral_low);
  std::random_device entropy;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto port = static_cast<std::uint16_t>(low + static_cast<int>(entropy() % static_cast<unsigned>(high - low)));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (free) return port;
  }
  throw std::runtime_error("no free port");
}

struct ChildResult {
  std::string report;  // what the child wrote: "ok", or "error <kind>: <what()>", or its own text
  int status = 0;      // waitpid status
  bool killed_at_deadline = false;

  bool ok() const { return report == "ok"; }
  bool signalled() const { return WIFSIGNALED(status); }
};

// Runs body(rank) in `n` child processes. body returns the line to report; a gradsync::Error
// escaping it is reported as "error <kind>: <what>".
inline std::vector<ChildResult> run_processes(int n, const std::function<std::string(int rank)>& body,
                                              std::chrono::seconds deadline = std::chrono::seconds(60)) {
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int rank = 0; rank < n; ++rank) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      for (int sibling : pipes) ::close(sibling);  // the earlier ranks' read ends: not this rank's files
      std::string report;
      try {
        report = body(rank);
      } catch (const Error& e) {
        report = "error " + std::string(to_string(e.kind())) + ": " + e.what();
      } catch (const std::exception& e) {
        report = std::string("exception: ") + e.what();
      }
      (void)!::write(fds[1], report.data(), report.size());
      ::close(fds[1]);
      ::_exit(0);
    }
    ::close(fds[1]);
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    pids.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::vector<ChildResult> results(static_cast<std::size_t>(n));
  std::vector<bool> done(static_cast<std::size_t>(n));
  const auto give_up = std::chrono::steady_clock::now() + deadline;
  for (std::size_t finished = 0; finished < pids.size();) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      char buffer[4096];
      for (ssize_t got; (got = ::read(pipes[i], buffer, sizeof buffer)) > 0;) results[i].report.append(buffer, static_cast<std::size_t>(got));
      if (!done[i] && ::waitpid(pids[i], &results[i].status, WNOHANG) == pids[i]) {
        done[i] = true;
        ++finished;
      }
    }
    if (finished == pids.size()) break;
    if (std::chrono::steady_clock::now() > give_up) {
      for (std::size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) {
          ::kill(pids[i], SIGKILL);
          ::waitpid(pids[i], &results[i].status, 0);
          results[i].killed_at_deadline = true;
          done[i] = true;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (std::size_t i = 0; i < pipes.size(); ++i) {
    char buffer[4096];
    for (ssize_t got; (got = ::read(pipes[i], buffer, sizeof buffer)) > 0;) results[i].report.append(buffer, static_cast<std::size_t>(got));
    ::close(pipes[i]);
  }
  return results;
}

}  // namespace gradsync::test
