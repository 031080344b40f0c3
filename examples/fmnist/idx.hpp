#pragma once
// Reading Fashion-MNIST (or MNIST) from IDX files, gzipped or not: the format of
// /usr/share/datasets/fashion-mnist from Debian's dataset-fashion-mnist package.

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace fmnist {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Dataset {
  std::size_t count = 0;
  std::size_t pixels = 0;       // per image (rows x cols)
  std::vector<float> images;    // count x pixels, scaled to [0, 1]
  std::vector<std::uint8_t> labels;
};

// Reads an images file (magic 0x00000803) and its labels file (0x00000801). Throws DataError
// saying which file is missing, truncated, of the wrong kind, or inconsistent with the other.
Dataset load_idx(const std::string& images_path, const std::string& labels_path);

// The same from the two files' (decompressed) bytes; the names are what errors call them.
Dataset parse_idx(std::span<const std::uint8_t> images, std::span<const std::uint8_t> labels,
                  const std::string& images_name, const std::string& labels_name);

// The train or test split under `directory` (train-images-idx3-ubyte[.gz] and so on); a missing
// directory or file names the Debian package that provides them.
Dataset load_split(const std::string& directory, bool train);

// The order in which every rank walks a training set of order.size() samples in epoch `epoch`:
// a permutation drawn from `seed` and the epoch, the same on every rank.
void epoch_order(std::vector<std::size_t>& order, std::uint64_t seed, int epoch);

}  // namespace fmnist
