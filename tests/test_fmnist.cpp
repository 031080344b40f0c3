// The Fashion-MNIST example trainer: its IDX reader, the equivalence of N ranks with batch B and
// one rank with batch N*B, and a short run that learns.

#include <doctest/doctest.h>

#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "gradsync/gradsync.hpp"
#include "fmnist_data.hpp"
#include "idx.hpp"
#include "support.hpp"
#include "trainer.hpp"

using namespace gradsync;
using test::synthetic;

namespace {

namespace fs = std::filesystem;

// An IDX file: big-endian magic, dimensions, then `data_bytes` bytes of `fill`.
std::vector<std::uint8_t> idx_bytes(std::uint32_t magic, const std::vector<std::uint32_t>& dims, std::size_t data_bytes,
                                    std::uint8_t fill = 7) {
  std::vector<std::uint8_t> b;
  const auto put = [&](std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<std::uint8_t>(v >> shift));
  };
  put(magic);
  for (std::uint32_t d : dims) put(d);
  b.insert(b.end(), data_bytes, fill);
  return b;
}

void write(const fs::path& path, const std::vector<std::uint8_t>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("gradsync-fmnist-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::string load_error(const fs::path& images, const fs::path& labels) {
  try {
    fmnist::load_idx(images.string(), labels.string());
  } catch (const fmnist::DataError& e) {
    return e.what();
  }
  return "no error";
}

using Sync = Synchronizer<bucketing::FixedSize, compression::None, topology::Ring, transport::InProcess>;

// Workers with batch 32 / workers each take the same steps as one rank with batch 32; dedicated
// servers (the ranks past the workers) do not train.
template <class S>
void same_steps_as_one_rank(int ranks, std::size_t workers, typename S::Topology topology) {
  const fmnist::Dataset data = synthetic(640, 5);
  fmnist::TrainConfig cfg{
      .epochs = 1, .batch = 32 / workers, .learning_rate = 0.05f, .seed = 3, .max_steps = 6, .workers = workers};
  std::vector<fmnist::Mlp> models(static_cast<std::size_t>(ranks), fmnist::Mlp({64, 32, 10}, 11));
  const auto errors = test::run_ranks(ranks, [&](transport::InProcess& t) {
    const int r = t.rank();
    S sync(std::move(t), {}, {}, {}, topology);
    fmnist::train(sync, models[static_cast<std::size_t>(r)], data, nullptr, cfg);
  });
  for (const auto& e : errors) REQUIRE_FALSE(e);
  fmnist::Mlp alone({64, 32, 10}, 11);
  auto world = transport::InProcess::create_world(1);
  Sync sync(std::move(world[0]));
  cfg.batch = 32;
  cfg.workers = 0;
  fmnist::train(sync, alone, data, nullptr, cfg);
  // Workers agree bit for bit; against one rank, only the order of the float sums differs
  // (mean of per-worker means vs one mean): |a - b| <= 1e-5 + 1e-4 |b| after 6 steps.
  const fmnist::Mlp untrained({64, 32, 10}, 11);
  for (std::size_t l = 0; l < alone.layers().size(); ++l) {
    const auto& a = alone.layers()[l].w;
    const auto& b = models[0].layers()[l].w;
    for (std::size_t r = 1; r < models.size(); ++r)
      CHECK(models[r].layers()[l].w == (r < workers ? b : untrained.layers()[l].w));
    for (std::size_t k = 0; k < a.size(); ++k) REQUIRE(std::fabs(a[k] - b[k]) <= 1e-5f + 1e-4f * std::fabs(a[k]));
    CHECK(b != untrained.layers()[l].w);  // the steps really moved the weights
  }
}

}  // namespace

TEST_SUITE("fmnist") {
  TEST_CASE("the IDX reader takes plain and gzipped files and rejects broken ones by name") {
    TempDir dir;
    const auto images = dir.path / "train-images-idx3-ubyte";
    const auto labels = dir.path / "train-labels-idx1-ubyte.gz";
    write(images, idx_bytes(0x803, {3, 2, 2}, 12, 255), false);
    write(labels, idx_bytes(0x801, {3}, 3, 4), true);
    const fmnist::Dataset d = fmnist::load_split(dir.path.string(), true);
    CHECK(d.count == 3);
    CHECK(d.pixels == 4);
    CHECK(d.images[5] == 1.0f);
    CHECK(d.labels[2] == 4);

    write(images, idx_bytes(0x801, {3, 2, 2}, 12), false);
    CHECK(load_error(images, labels).find("is not an IDX images file: magic number 0x00000801, expected 0x00000803") !=
          std::string::npos);
    write(images, idx_bytes(0x803, {3, 2, 2}, 11), false);
    CHECK(load_error(images, labels).find("is truncated or padded: its header promises 12 bytes of data, it holds 11") !=
          std::string::npos);
    write(images, {0, 0, 8}, false);
    CHECK(load_error(images, labels).find("is truncated: 3 bytes is too short") != std::string::npos);
    write(images, idx_bytes(0x803, {2147483648u, 2147483648u, 4}, 0), false);  // 2^64 wraps to the 0 bytes it holds
    CHECK(load_error(images, labels).find("dimensions multiply past 2^64") != std::string::npos);
    write(images, idx_bytes(0x803, {2, 2, 2}, 8), false);
    CHECK(load_error(images, labels).find("holds 2 images but") != std::string::npos);
    write(images, idx_bytes(0x803, {3, 2, 2}, 12), false);
    write(labels, idx_bytes(0x801, {3}, 3, 12), true);
    CHECK(load_error(images, labels).find("label 12 of sample 0 is not a class 0-9") != std::string::npos);
    try {
      fmnist::load_split((dir.path / "nowhere").string(), false);
      FAIL("no error");
    } catch (const fmnist::DataError& e) {
      CHECK(std::string(e.what()).find("apt-get install dataset-fashion-mnist") != std::string::npos);
    }
  }

  TEST_CASE("4 ranks with batch 8 take the same steps as 1 rank with batch 32") {
    same_steps_as_one_rank<Sync>(4, 4, {});
  }

  TEST_CASE("2 workers and a dedicated server with batch 16 take the same steps as 1 rank with batch 32") {
    using PsSync = Synchronizer<bucketing::FixedSize, compression::None, topology::ParameterServer, transport::InProcess>;
    same_steps_as_one_rank<PsSync>(3, 2, {.servers = 1, .dedicated = true});
  }

  TEST_CASE("a short run on 2 ranks learns: the loss falls well below its start") {
    const fmnist::Dataset data = synthetic(800, 8);
    std::vector<double> first(2), last(2);
    const auto errors = test::run_ranks(2, [&](transport::InProcess& t) {
      const auto r = static_cast<std::size_t>(t.rank());
      Sync sync(std::move(t));
      fmnist::Mlp model({64, 32, 10}, 21);
      fmnist::train(sync, model, data, nullptr, {.epochs = 3, .batch = 20, .learning_rate = 0.05f},
                    [&](int epoch, std::size_t step, std::size_t, double, double loss) {
                      if (epoch == 1 && step == 1) first[r] = loss;
                      last[r] = loss;
                    });
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
    CAPTURE(first[0]);
    CAPTURE(last[0]);
    CHECK(first[0] > 1.5);           // about ln 10 for an untrained model
    CHECK(last[0] < 0.25 * first[0]);
  }
}
