#pragma once
// For command-line programs: runs f.template operator()<Codec>() for the codec a name picks, so a
// --codec option reaches a compile-time policy. The library itself never dispatches on names.

#include <stdexcept>
#include <string>
#include <string_view>

#include "gradsync/gradsync.hpp"

namespace gradsync_examples {

inline constexpr const char* codec_names = "none, fp16, bf16, two-bit, one-bit, ef-two-bit, ef-one-bit";

template <class F>
decltype(auto) with_codec(std::string_view name, F&& f) {
  namespace c = gradsync::compression;
  if (name == "none") return f.template operator()<c::None>();
  if (name == "fp16") return f.template operator()<c::Fp16>();
  if (name == "bf16") return f.template operator()<c::Bf16>();
  if (name == "two-bit") return f.template operator()<c::TwoBit>();
  if (name == "one-bit") return f.template operator()<c::OneBit>();
  if (name == "ef-two-bit") return f.template operator()<c::ErrorFeedback<c::TwoBit>>();
  if (name == "ef-one-bit") return f.template operator()<c::ErrorFeedback<c::OneBit>>();
  throw std::invalid_argument("unknown codec '" + std::string(name) + "'; choose one of " + codec_names);
}

}  // namespace gradsync_examples
