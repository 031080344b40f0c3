// Fuzz target: the IDX reader of the Fashion-MNIST examples (examples/fmnist/idx.cpp). The first
// two bytes say how much of the rest is the images file; the remainder is the labels file. A
// malformed pair must be an fmnist::DataError.

#include <cstddef>
#include <cstdint>
#include <span>

#include "idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t images = std::min<std::size_t>(std::size_t{data[0]} << 8 | data[1], size - 2);
  try {
    (void)fmnist::parse_idx(std::span(data + 2, images), std::span(data + 2 + images, size - 2 - images), "images",
                            "labels");
  } catch (const fmnist::DataError&) {
  }
  return 0;
}
