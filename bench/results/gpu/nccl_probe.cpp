// Probe of the lent machine's NCCL: version, world-size-1 communicator and allreduce, send/recv to
// self, and what two ranks on one GPU are told. Not part of the library; informs transport::Nccl.
#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <vector>

#define CK(x) do { auto r_ = (x); if (r_ != 0) { std::printf("%s -> %d (%s) last: %s\n", #x, (int)r_, ncclGetErrorString((ncclResult_t)r_), ncclGetLastError(nullptr)); } } while (0)

int main() {
  int v = 0; ncclGetVersion(&v); std::printf("nccl version code %d\n", v);
  int fds[2]; pipe(fds);
  // two ranks on one GPU, children only (parent never touches CUDA before fork)
  {
    ncclUniqueId id;
    pid_t kids[2];
    for (int r = 0; r < 2; ++r) {
      kids[r] = fork();
      if (kids[r] == 0) {
        alarm(60);
        if (r == 0) { ncclGetUniqueId(&id); write(fds[1], &id, sizeof id); write(fds[1], &id, sizeof id); }
        else { usleep(200000); }
        ncclUniqueId got; read(fds[0], &got, sizeof got);
        cudaSetDevice(0);
        ncclComm_t comm;
        auto t0 = std::chrono::steady_clock::now();
        ncclResult_t res = ncclCommInitRank(&comm, 2, got, r);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        std::printf("two ranks one GPU: rank %d init -> %d (%s) after %.0f ms; last: %s\n", r, (int)res,
                    ncclGetErrorString(res), ms, ncclGetLastError(nullptr));
        std::fflush(stdout);
        _exit(0);
      }
    }
    // rank 0 writes the id twice: once for itself... simpler: rank 0 reads back its own copy
    for (pid_t k : kids) { int st; waitpid(k, &st, 0); std::printf("child exit %d sig %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0); }
  }
  cudaSetDevice(0);
  ncclUniqueId id; CK(ncclGetUniqueId(&id));
  ncclComm_t comm;
  auto t0 = std::chrono::steady_clock::now();
  CK(ncclCommInitRank(&comm, 1, id, 0));
  std::printf("world 1 init %.0f ms\n", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  cudaStream_t s; cudaStreamCreate(&s);
  const size_t n = 1 << 20;
  float *a, *b; cudaMalloc(&a, n * 4); cudaMalloc(&b, n * 4);
  std::vector<float> h(n); for (size_t i = 0; i < n; ++i) h[i] = 0.001f * (i % 977);
  cudaMemcpy(a, h.data(), n * 4, cudaMemcpyHostToDevice);
  CK(ncclAllReduce(a, b, n, ncclFloat, ncclSum, comm, s));
  cudaStreamSynchronize(s);
  std::vector<float> back(n); cudaMemcpy(back.data(), b, n * 4, cudaMemcpyDeviceToHost);
  size_t bad = 0; for (size_t i = 0; i < n; ++i) bad += back[i] != h[i];
  std::printf("allreduce world 1: %zu mismatches\n", bad);
  CK(ncclGroupStart()); CK(ncclSend(a, n, ncclFloat, 0, comm, s)); CK(ncclRecv(b, n, ncclFloat, 0, comm, s)); CK(ncclGroupEnd());
  cudaStreamSynchronize(s);
  ncclResult_t async_err; CK(ncclCommGetAsyncError(comm, &async_err)); std::printf("async err %d\n", (int)async_err);
  std::printf("send/recv self ok\n");
  int dev=-1, rank=-1, count=-1; ncclCommCuDevice(comm, &dev); ncclCommUserRank(comm, &rank); ncclCommCount(comm, &count);
  std::printf("dev %d rank %d count %d\n", dev, rank, count);
  // nonblocking config init
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER; cfg.blocking = 0;
  ncclComm_t c2; CK(ncclGetUniqueId(&id));
  ncclResult_t r2 = ncclCommInitRankConfig(&c2, 1, id, 0, &cfg);
  std::printf("nonblocking init -> %d\n", (int)r2);
  ncclResult_t st = ncclInProgress; int spins = 0; while (st == ncclInProgress && spins < 100000) { ncclCommGetAsyncError(c2, &st); ++spins; usleep(100); }
  std::printf("nonblocking init state %d after %d polls\n", (int)st, spins);
  CK(ncclCommAbort(c2));
  CK(ncclCommAbort(comm));
  std::printf("done\n");
}
