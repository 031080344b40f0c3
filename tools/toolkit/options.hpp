#pragma once
// The programs' command-line options, declared with CLI11. Numbers are checked here rather than
// by CLI11 alone, which falls short three ways: its conversion reads "010" as octal and "-1" into
// an unsigned option as 2^64 - 1, and CLI::Range lets NaN through (every comparison with NaN is
// false). A refused value fails parse_options with a message that names the option.

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "toolkit/codec_by_name.hpp"
#include "toolkit/topology_by_name.hpp"

namespace gradsync::toolkit {

// The values a numeric option takes: from low to high, each end included unless it is open.
template <class T>
struct Bounds {
  T low = std::numeric_limits<T>::lowest();
  T high = std::numeric_limits<T>::max();
  bool low_open = false;
  bool high_open = false;

  bool contain(T v) const { return (low_open ? v > low : v >= low) && (high_open ? v < high : v <= high); }

  // ">= 1", "> 0", "[0, 1)"; empty when every value of T is allowed.
  std::string describe() const {
    const bool bounded_below = low != std::numeric_limits<T>::lowest();
    const bool bounded_above = high != std::numeric_limits<T>::max();
    if (bounded_below && bounded_above)
      return fmt::format("{}{}, {}{}", low_open ? '(' : '[', low, high, high_open ? ')' : ']');
    if (bounded_below) return fmt::format("{} {}", low_open ? ">" : ">=", low);
    if (bounded_above) return fmt::format("{} {}", high_open ? "<" : "<=", high);
    return "";
  }
};

// Accepts a decimal number of type T within `bounds`: a whole number for integer T, a finite one
// otherwise. A whole number is handed on rewritten plainly ("010" as "10"), so that CLI11's own
// conversion reads it the same.
template <class T>
  requires std::integral<T> || std::floating_point<T>
CLI::Validator number(Bounds<T> bounds = {}) {
  const auto check = [bounds](std::string& text) -> std::string {
    const std::string need = bounds.describe();
    const std::string out_of_range = fmt::format("{} is out of range{}{}", text, need.empty() ? "" : ": need ", need);
    T value{};
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, value);
    if (error == std::errc::result_out_of_range) return out_of_range;
    if (error != std::errc{} || stop != end) {
      if constexpr (std::unsigned_integral<T>) {
        long long negative = 0;
        const auto [signed_stop, signed_error] = std::from_chars(text.data(), end, negative);
        if (signed_error == std::errc{} && signed_stop == end) return out_of_range;  // "-1" for a count
      }
      return fmt::format("'{}' is not {}", text, std::integral<T> ? "a whole number" : "a number");
    }
    if constexpr (std::floating_point<T>)
      if (!std::isfinite(value)) return fmt::format("{} is not a finite number", text);
    if (!bounds.contain(value)) return out_of_range;
    if constexpr (std::integral<T>) text = fmt::format("{}", value);
    return "";
  };
  return CLI::Validator(check, bounds.describe());
}

// --name, a number stored in `value` and checked against `bounds`; --help shows the default.
template <class T>
CLI::Option* add_number(CLI::App& app, const std::string& name, T& value, const std::string& description,
                        std::type_identity_t<Bounds<T>> bounds = {}) {
  return app.add_option(name, value, description)->capture_default_str()->transform(number(bounds));
}

// Accepts a byte count, a whole number with an optional binary unit: K or KiB, M or MiB, G or
// GiB. Hands on the plain count, for number() to check.
CLI::Validator byte_size();

// --name, a byte count stored in `value` and checked against `bounds`.
CLI::Option* add_byte_size(CLI::App& app, const std::string& name, std::size_t& value, const std::string& description,
                           Bounds<std::size_t> bounds);

// --name, a comma-separated list of sizes of at least 1 (layer widths, channel counts).
CLI::Option* add_sizes(CLI::App& app, const std::string& name, std::vector<std::size_t>& values,
                       const std::string& description);

// --name, one of `choices`.
CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& value, const std::string& description,
                        const std::vector<std::string>& choices);

inline const std::vector<std::string> bucketing_names{"fixed-size", "per-tensor", "time-clustered"};

// --codec NAME, one of codec_names.
CLI::Option* add_codec_option(CLI::App& app, std::string& codec);

// --codec NAME and the settings of the codecs that have some: --threshold (two-bit's) and --keep
// (the fraction top-k and random-k keep).
void add_codec_options(CLI::App& app, std::string& codec, CodecSettings& settings);

// --servers S and --dedicated, the parameter server's placement, which only
// --topology parameter-server takes; checked when parsing ends, through the app's callback.
void add_server_placement(CLI::App& app, std::size_t& servers, bool& dedicated, const std::string& topology);

// Reads argv into the options `app` declares; an option given twice takes its last value.
// Returns false when --help was asked for, after printing the help. A malformed or out-of-range value, an unknown option or a missing one throws
// std::invalid_argument with a message that names the option.
[[nodiscard]] bool parse_options(CLI::App& app, int argc, char** argv);

}  // namespace gradsync::toolkit
