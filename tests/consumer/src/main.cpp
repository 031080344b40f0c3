// Two in-process ranks average one gradient through the installed headers and library.
#include <cstdio>
#include <thread>
#include <vector>

#include <gradsync/gradsync.hpp>

int main() {
  namespace gs = gradsync;
  using Sync = gs::Synchronizer<gs::bucketing::FixedSize, gs::compression::None, gs::topology::Ring,
                                gs::transport::InProcess>;
  auto world = gs::transport::InProcess::create_world(2);
  std::vector<std::vector<float>> grads{{1, 2, 3}, {3, 4, 5}};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      Sync sync(std::move(world[static_cast<std::size_t>(r)]));
      sync.add("w", gs::view(grads[static_cast<std::size_t>(r)]));
      sync.ready(0);
      sync.wait();
    });
  for (auto& t : ranks) t.join();
  std::printf("gradsync %s: %g %g %g\n", GRADSYNC_VERSION, grads[0][0], grads[0][1], grads[0][2]);
  return grads[0] == std::vector<float>{2, 3, 4} && grads[1] == grads[0] ? 0 : 1;
}
