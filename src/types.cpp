#include "gradsync/types.hpp"

#include <fmt/format.h>

#include "gradsync/error.hpp"

namespace gradsync {

std::string to_string(Device d) {
  return d.kind == Device::Kind::cpu ? std::string("cpu") : fmt::format("cuda:{}", d.index);
}

TensorView view(std::span<std::uint16_t> s, DType dtype, Device d) {
  if (size_of(dtype) != sizeof(std::uint16_t))
    throw Error(ErrorKind::invalid_argument, {.operation = "view"},
                fmt::format("16-bit storage cannot hold {} values", to_string(dtype)));
  return {s.data(), s.size(), dtype, d};
}

}  // namespace gradsync
