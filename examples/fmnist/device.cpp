// fmnist --device cuda: the model on this rank's GPU (device_mlp.hpp), its gradients averaged
// where they are. Over transport::CudaStaged the ranks are fmnist's usual job (shared memory on
// one machine, TCP between machines) and the codecs run as kernels; ranks sharing one GPU (under
// MPS, say) exchange through host mirrors, or through CUDA IPC with --ipc. With --nccl the
// exchange is NCCL's, one GPU a rank, on the serial executor (transport/nccl.hpp), uncompressed.

#include <unistd.h>

#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "device_mlp.hpp"
#include "gradsync/cuda/codecs.hpp"
#include "gradsync/launch/environment.hpp"
#include "gradsync/transport/cuda_staged.hpp"
#include "gradsync/version.hpp"  // GRADSYNC_HAS_NCCL
#if GRADSYNC_HAS_NCCL
#include "gradsync/transport/nccl.hpp"
#endif
#include "program.hpp"
#include "toolkit/connect.hpp"

namespace fmnist::program {

namespace {

template <class Transport, class Codec>
int train_over(const Options& o, Transport transport, const Codec& codec, int device) {
  const std::string transport_name = transport.describe();
  gs::Synchronizer<gs::bucketing::FixedSize, Codec, gs::topology::Ring, Transport> sync(
      std::move(transport), sync_options(o), {}, codec, gs::topology::Ring{});
  return train_and_report(o, sync, static_cast<std::size_t>(sync.size()), codec.describe(),
                          fmt::format("ring over {} on cuda:{}", transport_name, device), [](auto&) {},
                          [device](Mlp& host) { return DeviceMlp(host, device); });
}

}  // namespace

int train_on_device(const Options& o) {
  const int devices = gs::cuda::device_count();
  if (devices == 0) throw std::runtime_error("--device cuda: this process sees no CUDA device");
  const int device = gs::launch::from_environment().local_rank % devices;
  auto settings = o.codec_settings;
  settings.seed = o.train.seed;
  if (o.nccl) {
#if GRADSYNC_HAS_NCCL
    if (o.ipc) throw std::invalid_argument("--ipc goes with CudaStaged, not --nccl");
    gs::transport::NcclOptions options;
    if (tk::launched()) {
      options = gs::transport::Nccl::options_from_env();
    } else {
      const std::string job = fmt::format("single-process-{}", ::getpid());
      options.setup = {.rank = 0, .world_size = 1, .token = job};
    }
    options.device = device;
    // Uncompressed only: every codec over NCCL too would double this file's compile (CI's budget),
    // and tests/test_nccl runs the device codecs over NCCL already.
    if (o.codec != "none") throw std::invalid_argument("--nccl trains with --codec none");
    gs::transport::Nccl nccl(options);
    return train_over(o, std::move(nccl), gs::compression::None{}, device);
#else
    throw std::invalid_argument("--nccl: this gradsync was built without NCCL");
#endif
  }
  tk::JobTransport transport = tk::connect_or_alone();
  settings.rank = transport.rank();
  gs::transport::CudaStaged<tk::JobTransport> staged(std::move(transport), device, {.ipc = o.ipc});
  if (!staged.ipc_fallback().empty()) fmt::print(stderr, "fmnist: rank {}: {}\n", settings.rank, staged.ipc_fallback());
  return tk::with_codec(o.codec, settings,
                        [&](const auto& codec) { return train_over(o, std::move(staged), codec, device); });
}

}  // namespace fmnist::program
