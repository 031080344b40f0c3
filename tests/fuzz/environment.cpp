// Fuzz target: the launcher-environment parser (launch::from_environment), fed NAME=VALUE lines
// as the environment. Unusable settings must be a gradsync::Error naming them.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "gradsync/error.hpp"
#include "gradsync/launch/environment.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string, std::less<>> variables;
  for (std::size_t at = 0; at < text.size();) {
    const auto end = std::min(text.find('\n', at), text.size());
    const std::string_view line = text.substr(at, end - at);
    if (const auto eq = line.find('='); eq != std::string_view::npos)
      variables[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    at = end + 1;
  }
  const auto lookup = [&](std::string_view name) -> std::optional<std::string> {
    const auto it = variables.find(name);
    return it == variables.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  try {
    (void)gradsync::launch::from_environment(lookup);
  } catch (const gradsync::Error&) {
  }
  return 0;
}
