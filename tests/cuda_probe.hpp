#pragma once
// Whether this machine has no CUDA device, asked in a child process: the test process itself
// never touches CUDA, because a forked child cannot use its parent's context and these tests run
// their ranks as forked children. Where there is none it prints that `what` is skipped, once.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "gradsync/cuda/codecs.hpp"

namespace gradsync::test {

inline bool no_cuda_device(const char* what) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(cuda::device_count() > 0 ? 0 : 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return false;
  std::printf("no CUDA device: %s skipped (they run on GPU machines)\n", what);
  return true;
}

}  // namespace gradsync::test
