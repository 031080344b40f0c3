#include "toolkit/options.hpp"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <utility>

namespace gradsync::toolkit {

CLI::Validator byte_size() {
  const auto read = [](std::string& text) -> std::string {
    std::size_t count = 0;
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, count);
    if (error == std::errc::result_out_of_range) return fmt::format("{} is too large", text);
    const std::string_view unit(stop, end);
    constexpr std::array<std::pair<std::string_view, int>, 7> units{
        {{"", 0}, {"K", 10}, {"KiB", 10}, {"M", 20}, {"MiB", 20}, {"G", 30}, {"GiB", 30}}};
    const auto* shift = std::find_if(units.begin(), units.end(), [&](const auto& u) { return u.first == unit; });
    if (error != std::errc{} || shift == units.end())
      return fmt::format("'{}' is not a byte count (a whole number, optionally with K, M or G: KiB, MiB, GiB)", text);
    if (count > std::numeric_limits<std::size_t>::max() >> shift->second) return fmt::format("{} is too large", text);
    text = fmt::format("{}", count << shift->second);
    return "";
  };
  return CLI::Validator(read, "");
}

CLI::Option* add_byte_size(CLI::App& app, const std::string& name, std::size_t& value, const std::string& description,
                           Bounds<std::size_t> bounds) {
  // transform() puts each validator first: byte_size() runs before number().
  return app.add_option(name, value, description)
      ->type_name("BYTES")
      ->capture_default_str()
      ->transform(number(bounds))
      ->transform(byte_size());
}

CLI::Option* add_sizes(CLI::App& app, const std::string& name, std::vector<std::size_t>& values,
                       const std::string& description) {
  return app.add_option(name, values, description + ", comma-separated")
      ->capture_default_str()
      ->delimiter(',')
      ->allow_extra_args(false)
      ->transform(number<std::size_t>({.low = 1}));
}

CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& value, const std::string& description,
                        const std::vector<std::string>& choices) {
  return app.add_option(name, value, description)->capture_default_str()->check(CLI::IsMember(choices));
}

CLI::Option* add_codec_option(CLI::App& app, std::string& codec) {
  return add_choice(app, "--codec", codec, "the codec gradients travel through; ef- adds error feedback", codec_names);
}

void add_codec_options(CLI::App& app, std::string& codec, CodecSettings& settings) {
  add_codec_option(app, codec);
  add_number(app, "--threshold", settings.threshold, "two-bit's threshold", {.low = 0, .low_open = true});
  add_number(app, "--keep", settings.keep, "the fraction of values top-k and random-k keep",
             {.low = 0, .high = 1, .low_open = true});
}

void add_server_placement(CLI::App& app, std::size_t& servers, bool& dedicated, const std::string& topology) {
  add_number(app, "--servers", servers, "parameter servers (0: every rank serves a part)");
  app.add_flag("--dedicated", dedicated, "the last --servers ranks only aggregate; the others train");
  app.callback([&servers, &dedicated, &topology] {
    if ((servers > 0 || dedicated) && topology != "parameter-server")
      throw CLI::ValidationError("--servers and --dedicated", "need --topology parameter-server");
  });
}

bool parse_options(CLI::App& app, int argc, char** argv) {
  // A repeated option takes its last value, as the programs' own parsers had it (CLI11 refuses
  // the repeat); lists (--hidden) keep every value.
  for (CLI::Option* option : app.get_options())
    if (option->get_expected_max() == 1) option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  try {
    app.parse(argc, argv);
    return true;
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return false;
  } catch (const CLI::ParseError& e) {
    throw std::invalid_argument(fmt::format("{} (--help lists the options)", e.what()));
  }
}

}  // namespace gradsync::toolkit
