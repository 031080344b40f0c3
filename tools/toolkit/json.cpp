#include "toolkit/json.hpp"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/os.h>

namespace gradsync::toolkit {

Json schedules_json(const IterationStats& stats) {
  Json out = Json::array();
  for (std::size_t b = 0; b < stats.schedules.size(); ++b)
    out.push_back({{"bucket", b},
                   {"schedule", stats.schedules[b].schedule},
                   {"predicted_ms", rounded(stats.schedules[b].predicted_seconds * 1e3, 3)},
                   {"measured_ms", rounded(stats.schedules[b].seconds * 1e3, 3)}});
  return out;
}

double rounded(double value, int decimals) {
  const double scale = std::pow(10.0, decimals);
  return std::round(value * scale) / scale;
}

double as_written(float value) { return std::strtod(fmt::format("{}", value).c_str(), nullptr); }

std::string json_text(const Json& value) {
  const auto one_line = [](const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); };
  if (!value.is_array()) return one_line(value) + "\n";
  std::string text = "[";
  for (std::size_t i = 0; i < value.size(); ++i) text += (i ? ",\n  " : "\n  ") + one_line(value[i]);
  return text + "\n]\n";
}

void write_json(const std::string& path, const Json& value) { fmt::output_file(path).print("{}", json_text(value)); }

}  // namespace gradsync::toolkit
