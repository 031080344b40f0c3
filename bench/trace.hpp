#pragma once
// Reads the traces bench/replay runs (bench/traces/*.trace): one parameter tensor a line, in the
// order backward produces them,
//     NAME count=ELEMENTS compute_us=MICROSECONDS
// where compute_us is the backward compute that precedes the tensor. '#' starts a comment; blank
// lines are skipped. Anything else — a missing or repeated field, an unknown one, a number that
// does not parse, a negative or non-finite time, a zero count — is an error naming the line.

#include <charconv>
#include <cmath>
#include <istream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gradsync_bench {

struct TraceEntry {
  std::string name;
  std::size_t count = 0;
  double compute_us = 0;
};

inline std::vector<TraceEntry> read_trace(std::istream& in, const std::string& source) {
  std::vector<TraceEntry> entries;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    const auto fail = [&](const std::string& what) {
      throw std::runtime_error(source + ":" + std::to_string(number) + ": " + what);
    };
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream fields(line);
    TraceEntry e;
    if (!(fields >> e.name)) continue;  // blank or comment
    if (e.name.find('=') != std::string::npos) fail("the line must start with the tensor's name, not '" + e.name + "'");
    bool has_count = false, has_time = false;
    for (std::string field; fields >> field;) {
      const auto eq = field.find('=');
      if (eq == std::string::npos) fail("'" + field + "' is not key=value");
      const std::string key = field.substr(0, eq), value = field.substr(eq + 1);
      if (key == "count") {
        if (has_count) fail("count given twice");
        const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), e.count);
        if (ec != std::errc() || end != value.data() + value.size() || e.count == 0)
          fail("count '" + value + "' is not a positive whole number");
        has_count = true;
      } else if (key == "compute_us") {
        if (has_time) fail("compute_us given twice");
        std::size_t used = 0;
        try {
          e.compute_us = std::stod(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != value.size() || !std::isfinite(e.compute_us)) fail("compute_us '" + value + "' is not a number");
        if (e.compute_us < 0) fail("compute_us " + value + " is negative");
        has_time = true;
      } else {
        fail("unknown field '" + key + "' (fields: count, compute_us)");
      }
    }
    if (!has_count) fail("count is missing");
    if (!has_time) fail("compute_us is missing");
    entries.push_back(std::move(e));
  }
  if (entries.empty()) throw std::runtime_error(source + ": no tensors");
  return entries;
}

}  // namespace gradsync_bench
