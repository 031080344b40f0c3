#include "idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <random>

#include <fmt/format.h>

namespace fmnist {

namespace {

// The whole (decompressed) file; gzread passes plain files through unchanged.
std::vector<std::uint8_t> read_file(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (!file) throw DataError(fmt::format("cannot open {}", path));
  std::vector<std::uint8_t> bytes;
  std::uint8_t buffer[1 << 16];
  for (;;) {
    const int got = gzread(file, buffer, sizeof buffer);
    if (got < 0) {
      int code = 0;
      const std::string why = gzerror(file, &code);
      gzclose(file);
      throw DataError(fmt::format("{} is damaged: {}", path, why));
    }
    if (got == 0) break;
    bytes.insert(bytes.end(), buffer, buffer + got);
  }
  gzclose(file);
  return bytes;
}

std::uint32_t big_endian(std::span<const std::uint8_t> b, std::size_t at) {
  return std::uint32_t(b[at]) << 24 | std::uint32_t(b[at + 1]) << 16 | std::uint32_t(b[at + 2]) << 8 | b[at + 3];
}

// Checks the magic number and dimension count; returns the dimensions.
std::vector<std::uint32_t> header(std::span<const std::uint8_t> b, const std::string& path, std::uint32_t magic,
                                  const char* kind) {
  const std::size_t dims = magic & 0xff;
  if (b.size() < 4 + 4 * dims)
    throw DataError(fmt::format("{} is truncated: {} bytes is too short for an IDX header", path, b.size()));
  if (big_endian(b, 0) != magic)
    throw DataError(fmt::format("{} is not an IDX {} file: magic number {:#010x}, expected {:#010x}", path, kind,
                                big_endian(b, 0), magic));
  std::vector<std::uint32_t> out(dims);
  std::uint64_t elements = 1;
  for (std::size_t d = 0; d < dims; ++d) {
    out[d] = big_endian(b, 4 + 4 * d);
    // A product that wraps could match the file's size and pass for a small file.
    if (__builtin_mul_overflow(elements, std::uint64_t{out[d]}, &elements))
      throw DataError(fmt::format("{}: its header's dimensions multiply past 2^64 bytes of data", path));
  }
  if (b.size() != 4 + 4 * dims + elements)
    throw DataError(fmt::format("{} is truncated or padded: its header promises {} bytes of data, it holds {}", path,
                                elements, b.size() - 4 - 4 * dims));
  return out;
}

}  // namespace

Dataset load_idx(const std::string& images_path, const std::string& labels_path) {
  return parse_idx(read_file(images_path), read_file(labels_path), images_path, labels_path);
}

Dataset parse_idx(std::span<const std::uint8_t> image_bytes, std::span<const std::uint8_t> label_bytes,
                  const std::string& images_path, const std::string& labels_path) {
  const auto image_dims = header(image_bytes, images_path, 0x00000803, "images");
  const auto label_dims = header(label_bytes, labels_path, 0x00000801, "labels");
  if (image_dims[0] != label_dims[0])
    throw DataError(fmt::format("{} holds {} images but {} holds {} labels", images_path, image_dims[0], labels_path,
                                label_dims[0]));
  Dataset d;
  d.count = image_dims[0];
  d.pixels = std::size_t{image_dims[1]} * image_dims[2];
  d.images.resize(d.count * d.pixels);
  for (std::size_t i = 0; i < d.images.size(); ++i) d.images[i] = static_cast<float>(image_bytes[16 + i]) / 255.0f;
  d.labels.assign(label_bytes.begin() + 8, label_bytes.end());
  for (std::size_t i = 0; i < d.count; ++i)
    if (d.labels[i] > 9) throw DataError(fmt::format("{}: label {} of sample {} is not a class 0-9", labels_path, d.labels[i], i));
  return d;
}

Dataset load_split(const std::string& directory, bool train) {
  const char* prefix = train ? "train" : "t10k";
  const auto find = [&](const std::string& stem) {
    for (const std::string& name : {stem + ".gz", stem}) {
      const auto path = std::filesystem::path(directory) / name;
      if (std::filesystem::exists(path)) return path.string();
    }
    throw DataError(fmt::format("no {} or {}.gz in {}: install Debian's dataset-fashion-mnist package "
                                "(apt-get install dataset-fashion-mnist) or pass --data DIR",
                                stem, stem, directory));
  };
  return load_idx(find(fmt::format("{}-images-idx3-ubyte", prefix)), find(fmt::format("{}-labels-idx1-ubyte", prefix)));
}

void epoch_order(std::vector<std::size_t>& order, std::uint64_t seed, int epoch) {
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::mt19937_64 shuffle(seed * 1000003u + static_cast<std::uint64_t>(epoch));
  std::shuffle(order.begin(), order.end(), shuffle);
}

}  // namespace fmnist
