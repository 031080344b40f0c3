// A rank for gradsync-run's tests: joins the job from the launcher's variables, averages one
// gradient over TCP, checks the result and says so. `--fail-rank K` makes rank K exit with status 3
// right after connecting while the others sleep, so that only the launcher can stop them.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"

int main(int argc, char** argv) try {
  namespace gs = gradsync;
  const int fail_rank = argc == 3 && std::string(argv[1]) == "--fail-rank" ? std::atoi(argv[2]) : -1;
  gs::Synchronizer<gs::bucketing::FixedSize, gs::compression::None, gs::topology::Ring, gs::transport::Tcp> sync(
      gs::transport::Tcp::from_env(), {.timeout = std::chrono::seconds(120)});
  if (fail_rank >= 0) {
    if (sync.rank() == fail_rank) return 3;
    std::this_thread::sleep_for(std::chrono::minutes(10));
  }
  std::vector<float> grad(1000, static_cast<float>(sync.rank()));
  sync.add("grad", gs::view(grad));
  sync.ready(0);
  sync.wait();
  const float expected = static_cast<float>(sync.size() - 1) / 2.0f;
  for (float v : grad)
    if (v != expected) {
      std::printf("rank %d of %d: wrong average %g, expected %g\n", sync.rank(), sync.size(), v, expected);
      return 1;
    }
  std::printf("rank %d of %d: average ok\n", sync.rank(), sync.size());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
