#pragma once
// For command-line programs: the codec a name picks, built from the settings the program's options
// gave, as a shipped::Codec (shipped.hpp) or handed to f as its own type, so a --codec option
// reaches a compile-time policy. The library itself never dispatches on names.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/gradsync.hpp"
#include "gradsync/shipped.hpp"

namespace gradsync::toolkit {

// Every name with_codec knows; the ef- ones add error feedback to the codec they name.
inline const std::vector<std::string> codec_names{"none",     "fp16",       "bf16",       "two-bit",  "one-bit",
                                                  "terngrad", "top-k",      "random-k",   "ef-two-bit", "ef-one-bit",
                                                  "ef-top-k", "ef-random-k"};

// The knobs of the codecs that have them; each codec reads its own.
struct CodecSettings {
  float threshold = gradsync::compression::TwoBit{}.threshold;  // two-bit
  double keep = 0.01;                                            // top-k, random-k: fraction kept
  std::uint64_t seed = 0;                                        // random-k (same on every rank), terngrad
  int rank = 0;  // terngrad draws its rounding from seed and rank, so ranks round independently
};

// The codec `name` picks, built from the settings.
inline gradsync::shipped::Codec codec_named(std::string_view name, const CodecSettings& s) {
  namespace c = gradsync::compression;
  const c::TwoBit two_bit{.threshold = s.threshold};
  const c::TopK top_k{.keep = {.fraction = s.keep}};
  const c::RandomK random_k{.keep = {.fraction = s.keep}, .seed = s.seed};
  if (name == "none") return c::None{};
  if (name == "fp16") return c::Fp16{};
  if (name == "bf16") return c::Bf16{};
  if (name == "two-bit") return two_bit;
  if (name == "one-bit") return c::OneBit{};
  if (name == "terngrad")
    return c::TernGrad<>{.seed = c::quantize::stream_key(s.seed, static_cast<std::uint64_t>(s.rank))};
  if (name == "top-k") return top_k;
  if (name == "random-k") return random_k;
  if (name == "ef-two-bit") return c::ErrorFeedback<c::TwoBit>{two_bit};
  if (name == "ef-one-bit") return c::ErrorFeedback<c::OneBit>{};
  if (name == "ef-top-k") return c::ErrorFeedback<c::TopK>{top_k};
  if (name == "ef-random-k") return c::ErrorFeedback<c::RandomK>{random_k};
  throw std::invalid_argument(fmt::format("unknown codec '{}'; choose one of {}", name, fmt::join(codec_names, ", ")));
}

// Calls f(codec) with the codec `name` picks, as its own type.
template <class F>
decltype(auto) with_codec(std::string_view name, const CodecSettings& s, F&& f) {
  return std::visit(std::forward<F>(f), codec_named(name, s));
}

}  // namespace gradsync::toolkit
