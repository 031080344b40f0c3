#include <algorithm>
#include <stdexcept>
#include <string>

#include "trainer.hpp"

namespace hybrid {

namespace {

std::vector<ConvStack::LayerSpec> vgg_blocks(const std::vector<std::size_t>& channels) {
  std::vector<ConvStack::LayerSpec> layers;
  for (std::size_t c : channels) {
    layers.push_back({.channels = c, .pool = false});
    layers.push_back({.channels = c, .pool = true});
  }
  return layers;
}

std::vector<std::size_t> fc_sizes(std::size_t features, const std::vector<std::size_t>& hidden) {
  std::vector<std::size_t> sizes{features};
  sizes.insert(sizes.end(), hidden.begin(), hidden.end());
  sizes.push_back(10);
  return sizes;
}

}  // namespace

Model::Model(std::size_t side, const std::vector<std::size_t>& channels, const std::vector<std::size_t>& hidden,
             std::uint64_t seed)
    : conv(1, side, side, vgg_blocks(channels), seed), fc(fc_sizes(conv.features(), hidden), seed + 1) {}

std::size_t Model::correct(const fmnist::Dataset& data) {
  constexpr std::size_t chunk = 256;
  std::size_t right = 0;
  for (std::size_t start = 0; start < data.count; start += chunk) {
    const std::size_t count = std::min(chunk, data.count - start);
    const float* f = conv.forward(data.images.data() + start * data.pixels, count);
    right += fc.correct(f, data.labels.data() + start, count);
  }
  return right;
}

Role Role::of(Mode mode, int rank, int size) {
  Role role;
  if (mode == Mode::data_parallel) {
    role.conv = role.fc = true;
    role.group = gradsync::Group::world(rank, size);
    role.shard = static_cast<std::size_t>(rank);
    role.shards = static_cast<std::size_t>(size);
    return role;
  }
  if (size < 2 || size % 2)
    throw std::invalid_argument("hybrid mode pairs a conv rank with an fc rank: it needs an even number of ranks, not " +
                                std::to_string(size));
  const int half = size / 2;
  role.conv = rank < half;
  role.fc = !role.conv;
  role.pair = role.conv ? rank + half : rank - half;
  std::vector<int> ring(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i) ring[static_cast<std::size_t>(i)] = role.conv ? i : half + i;
  role.group = gradsync::Group::of(ring, rank, role.conv ? "conv ring" : "fc ring");
  role.shard = static_cast<std::size_t>(rank % half);
  role.shards = static_cast<std::size_t>(half);
  return role;
}

}  // namespace hybrid
