#pragma once
// For command-line programs: calls f(codec) with the codec a name picks, built from the settings
// the program's options gave, so a --codec option reaches a compile-time policy. The library
// itself never dispatches on names.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/gradsync.hpp"

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

template <class F>
decltype(auto) with_codec(std::string_view name, const CodecSettings& s, F&& f) {
  namespace c = gradsync::compression;
  const c::TwoBit two_bit{.threshold = s.threshold};
  const c::TernGrad<> terngrad{.seed = gradsync::compression::quantize::stream_key(s.seed, static_cast<std::uint64_t>(s.rank))};
  const c::TopK top_k{.keep = {.fraction = s.keep}};
  const c::RandomK random_k{.keep = {.fraction = s.keep}, .seed = s.seed};
  if (name == "none") return f(c::None{});
  if (name == "fp16") return f(c::Fp16{});
  if (name == "bf16") return f(c::Bf16{});
  if (name == "two-bit") return f(two_bit);
  if (name == "one-bit") return f(c::OneBit{});
  if (name == "terngrad") return f(terngrad);
  if (name == "top-k") return f(top_k);
  if (name == "random-k") return f(random_k);
  if (name == "ef-two-bit") return f(c::ErrorFeedback<c::TwoBit>{two_bit});
  if (name == "ef-one-bit") return f(c::ErrorFeedback<c::OneBit>{});
  if (name == "ef-top-k") return f(c::ErrorFeedback<c::TopK>{top_k});
  if (name == "ef-random-k") return f(c::ErrorFeedback<c::RandomK>{random_k});
  throw std::invalid_argument(fmt::format("unknown codec '{}'; choose one of {}", name, fmt::join(codec_names, ", ")));
}

}  // namespace gradsync::toolkit
