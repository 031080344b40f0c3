// The command-line programs' toolkit (tools/toolkit): options, JSON output, statistics.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace tk = gradsync::toolkit;

namespace {

// Parses `args` (after the program's name) into `app`; returns the error message, or "accepted".
std::string parse(CLI::App& app, std::vector<std::string> args) {
  std::vector<char*> argv{const_cast<char*>("program")};
  for (std::string& a : args) argv.push_back(a.data());
  try {
    if (!tk::parse_options(app, static_cast<int>(argv.size()), argv.data())) return "help";
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "accepted";
}

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();

}  // namespace

TEST_SUITE("toolkit") {
  TEST_CASE("a whole number is read in decimal, within its bounds, and refused otherwise naming the option") {
    int ranks = 4;
    std::size_t servers = 0;
    CLI::App app;
    tk::add_number(app, "--ranks", ranks, "ranks", {.low = 1});
    tk::add_number(app, "--servers", servers, "servers", {.high = 8});
    CHECK(parse(app, {"--ranks", "12"}) == "accepted");
    CHECK(ranks == 12);
    CHECK(parse(app, {"--ranks", "010"}) == "accepted");
    CHECK(ranks == 10);  // decimal, not octal
    CHECK(parse(app, {"--ranks", "4x"}) == "--ranks: '4x' is not a whole number (--help lists the options)");
    CHECK(parse(app, {"--ranks", ""}) == "--ranks: '' is not a whole number (--help lists the options)");
    CHECK(parse(app, {"--ranks", "0x10"}) == "--ranks: '0x10' is not a whole number (--help lists the options)");
    CHECK(parse(app, {"--ranks", "2.5"}) == "--ranks: '2.5' is not a whole number (--help lists the options)");
    CHECK(parse(app, {"--ranks", "0"}) == "--ranks: 0 is out of range: need >= 1 (--help lists the options)");
    CHECK(parse(app, {"--ranks", "99999999999"}) ==
          "--ranks: 99999999999 is out of range: need >= 1 (--help lists the options)");
    CHECK(parse(app, {"--servers", "-1"}) == "--servers: -1 is out of range: need <= 8 (--help lists the options)");
    CHECK(parse(app, {"--servers", "9"}) == "--servers: 9 is out of range: need <= 8 (--help lists the options)");
    CHECK(parse(app, {"--servers", "8"}) == "accepted");
    CHECK(servers == 8);
    CHECK(parse(app, {"--ranks", "3", "--ranks", "5"}) == "accepted");
    CHECK(ranks == 5);  // the last one given
  }

  TEST_CASE("a real number must be finite and inside its interval, whose ends may be open") {
    double keep = 0.01;
    float threshold = 0.5f;
    CLI::App app;
    tk::add_number(app, "--keep", keep, "fraction", {.low = 0, .high = 1, .low_open = true});
    tk::add_number(app, "--threshold", threshold, "threshold", {.low = 0, .low_open = true});
    CHECK(parse(app, {"--keep", "1", "--threshold", "2.5e-1"}) == "accepted");
    CHECK(keep == 1);
    CHECK(threshold == 0.25f);
    CHECK(parse(app, {"--keep", "nan"}) == "--keep: nan is not a finite number (--help lists the options)");
    CHECK(parse(app, {"--keep", "-inf"}) == "--keep: -inf is not a finite number (--help lists the options)");
    CHECK(parse(app, {"--keep", "0"}) == "--keep: 0 is out of range: need (0, 1] (--help lists the options)");
    CHECK(parse(app, {"--keep", "-0.5"}) == "--keep: -0.5 is out of range: need (0, 1] (--help lists the options)");
    CHECK(parse(app, {"--keep", "0.5x"}) == "--keep: '0.5x' is not a number (--help lists the options)");
    CHECK(parse(app, {"--threshold", "1e60"}) == "--threshold: 1e60 is out of range: need > 0 (--help lists the options)");
  }

  TEST_CASE("a byte count takes K, M and G (binary) and nothing else") {
    std::size_t bytes = 0;
    CLI::App app;
    tk::add_byte_size(app, "--min-bytes", bytes, "bytes", {.low = 4});
    const std::vector<std::pair<std::string, std::size_t>> accepted{
        {"1024", 1024}, {"1K", 1024}, {"4KiB", 4096}, {"4M", 4u << 20}, {"2MiB", 2u << 20}, {"1G", std::size_t{1} << 30},
        {"3GiB", std::size_t{3} << 30}};
    for (const auto& [text, value] : accepted) {
      CAPTURE(text);
      CHECK(parse(app, {"--min-bytes", text}) == "accepted");
      CHECK(bytes == value);
    }
    const std::string grammar = "(a whole number, optionally with K, M or G: KiB, MiB, GiB)";
    CHECK(parse(app, {"--min-bytes", "4x"}) == "--min-bytes: '4x' is not a byte count " + grammar + " (--help lists the options)");
    CHECK(parse(app, {"--min-bytes", "1k"}) == "--min-bytes: '1k' is not a byte count " + grammar + " (--help lists the options)");
    CHECK(parse(app, {"--min-bytes", "M"}) == "--min-bytes: 'M' is not a byte count " + grammar + " (--help lists the options)");
    CHECK(parse(app, {"--min-bytes", "-1"}) == "--min-bytes: '-1' is not a byte count " + grammar + " (--help lists the options)");
    CHECK(parse(app, {"--min-bytes", "2"}) == "--min-bytes: 2 is out of range: need >= 4 (--help lists the options)");
    CHECK(parse(app, {"--min-bytes", "99999999999G"}) == "--min-bytes: 99999999999G is too large (--help lists the options)");
  }

  TEST_CASE("choices, codecs and the parameter server's placement") {
    std::string codec = "none", topology = "auto";
    tk::CodecSettings settings;
    std::size_t servers = 0;
    bool dedicated = false;
    CLI::App app;
    tk::add_codec_options(app, codec, settings);
    tk::add_choice(app, "--topology", topology, "topology", tk::topology_names);
    tk::add_server_placement(app, servers, dedicated, topology);
    CHECK(parse(app, {"--codec", "ef-two-bit", "--keep", "0.1", "--threshold", "0.2"}) == "accepted");
    CHECK(codec == "ef-two-bit");
    CHECK(settings.keep == 0.1);
    CHECK(settings.threshold == 0.2f);
    CHECK(parse(app, {"--codec", "two_bit"}).starts_with("--codec: two_bit not in {none,fp16,"));
    CHECK(parse(app, {"--topology", "tree"}) ==
          "--topology: tree not in {auto,ring,recursive-doubling,halving-doubling,parameter-server,hierarchical} "
          "(--help lists the options)");
    CHECK(parse(app, {"--dedicated"}) ==
          "--servers and --dedicated: need --topology parameter-server (--help lists the options)");
    CHECK(parse(app, {"--servers", "2", "--dedicated", "--dedicated", "--topology", "parameter-server"}) == "accepted");
    CHECK(servers == 2);
    CHECK(dedicated);
    CHECK(parse(app, {"--frobnicate"}) ==
          "The following argument was not expected: --frobnicate (--help lists the options)");
    CHECK(parse(app, {"--help"}) == "help");
  }

  TEST_CASE("every topology name is one topology_named knows; the ring and the log-depth schedules are Auto pinned") {
    using Auto = gradsync::topology::Auto<>;
    using Choice = Auto::Choice;
    for (const std::string& name : tk::topology_names) {
      CAPTURE(name);
      CHECK_NOTHROW(tk::topology_named(name, {.ranks_per_machine = 2}));
    }
    const auto pinned = [](const char* name) { return std::get<Auto>(tk::topology_named(name, {})).pinned; };
    CHECK_FALSE(pinned("auto").has_value());
    CHECK(pinned("ring") == Choice::large);
    CHECK(pinned("recursive-doubling") == Choice::small);
    CHECK(pinned("halving-doubling") == Choice::middle);
    CHECK(std::get<Auto>(tk::topology_named("ring", {.chunk_elements = 100})).large.chunk_elements == 100);
    const auto hierarchical = tk::topology_named("hierarchical", {.ranks_per_machine = 4});
    CHECK(std::get<gradsync::topology::Hierarchical>(hierarchical).ranks_per_machine == 4);
    const auto server = tk::topology_named("parameter-server", {.servers = 2, .dedicated = true});
    CHECK(std::get<gradsync::topology::ParameterServer>(server).servers == 2);
    CHECK_THROWS_WITH_AS(tk::topology_named("star", {}),
                         "unknown topology 'star'; choose one of auto, ring, recursive-doubling, halving-doubling, "
                         "parameter-server, hierarchical",
                         std::invalid_argument);
  }

  TEST_CASE("every codec name is one with_codec knows") {
    for (const std::string& name : tk::codec_names) {
      CAPTURE(name);
      CHECK_NOTHROW(tk::with_codec(name, {}, [](const auto&) { return 0; }));
    }
  }

  TEST_CASE("JSON stays valid with odd strings, NaN and infinities") {
    const std::string odd = "quote \" backslash \\ newline \n tab \t bell \x07 nul " + std::string(1, '\0') +
                            " non-ASCII \xc3\xa9\xe2\x82\xac broken \xff end";
    const tk::Json written{{"name", odd},
                           {"not_a_number", not_a_number},
                           {"plus", infinity},
                           {"minus", -infinity},
                           {"count", 3},
                           {"time_us", tk::rounded(12.34567, 3)},
                           {"list", {1, 2}},
                           {"missing", nullptr}};
    const std::string text = tk::json_text(written);
    CHECK(text.find("nan") == std::string::npos);
    CHECK(text.find("inf") == std::string::npos);
    CHECK(text.ends_with("}\n"));
    const nlohmann::json read = nlohmann::json::parse(text);
    CHECK(read["name"] == "quote \" backslash \\ newline \n tab \t bell \x07 nul " + std::string(1, '\0') +
                              " non-ASCII \xc3\xa9\xe2\x82\xac broken \xef\xbf\xbd end");
    CHECK(read["not_a_number"].is_null());
    CHECK(read["plus"].is_null());
    CHECK(read["minus"].is_null());
    CHECK(read["count"] == 3);
    CHECK(text.find("\"time_us\":12.346,") != std::string::npos);
    CHECK(read["list"] == nlohmann::json{1, 2});
    // Keys stay in the order written.
    CHECK(text.find("\"name\"") < text.find("\"not_a_number\""));
    CHECK(text.find("\"count\"") < text.find("\"time_us\""));
  }

  TEST_CASE("a JSON array is written one element a line, and the file reads back") {
    const tk::Json rows{{{"codec", "a\"b"}, {"GBps", not_a_number}}, {{"codec", "c"}, {"GBps", 1.5}}};
    CHECK(tk::json_text(rows) == "[\n  {\"codec\":\"a\\\"b\",\"GBps\":null},\n  {\"codec\":\"c\",\"GBps\":1.5}\n]\n");
    CHECK(tk::json_text(tk::Json::array()) == "[\n]\n");
    const std::string path = "test_toolkit.json";
    tk::write_json(path, rows);
    std::ifstream in(path);
    const nlohmann::json read = nlohmann::json::parse(in);
    CHECK(read.size() == 2);
    CHECK(read[0]["codec"] == "a\"b");
    CHECK(read[0]["GBps"].is_null());
    std::remove(path.c_str());
  }

  TEST_CASE("rounded keeps the digits asked for, and non-finite values as they are") {
    CHECK(tk::rounded(1.23456, 2) == 1.23);
    CHECK(tk::rounded(-2.5, 0) == -3);
    CHECK(tk::rounded(1234.5678, 1) == 1234.6);
    CHECK(std::isnan(tk::rounded(not_a_number, 3)));
    CHECK(tk::rounded(infinity, 3) == infinity);
  }

  TEST_CASE("a float is written with its own digits") {
    CHECK(tk::as_written(0.1f) == 0.1);
    CHECK(tk::json_text({{"learning_rate", tk::as_written(0.1f)}, {"momentum", tk::as_written(0.5f)}}) ==
          "{\"learning_rate\":0.1,\"momentum\":0.5}\n");
    CHECK(std::isnan(tk::as_written(std::numeric_limits<float>::quiet_NaN())));
  }

  TEST_CASE("median: the middle value, for an even count the mean of the two middle ones") {
    CHECK(tk::median({3.0}) == 3.0);
    CHECK(tk::median({5.0, 1.0, 3.0}) == 3.0);
    CHECK(tk::median({4.0, 1.0, 3.0, 2.0}) == 2.5);
    CHECK(tk::median({7.0, 7.0, 1.0, 9.0, 9.0, 2.0}) == 7.0);
    CHECK(std::isnan(tk::median({})));
  }

  TEST_CASE("mean") {
    CHECK(tk::mean({1.0, 2.0, 6.0}) == 3.0);
    CHECK(tk::mean({-1.5}) == -1.5);
    CHECK(std::isnan(tk::mean({})));
  }
}
