// bench/replay's trace reader: the shipped traces, and the errors a broken trace gets.

#include <doctest/doctest.h>

#include <fstream>
#include <numeric>
#include <sstream>
#include <string>

#include "trace.hpp"

using gradsync_bench::read_trace;

namespace {

std::string error_of(const std::string& text) {
  std::istringstream in(text);
  try {
    read_trace(in, "t.trace");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_SUITE("replay") {
  TEST_CASE("a trace is read in order, with comments and blank lines skipped") {
    std::istringstream in("# model\n\nfc.weight count=20 compute_us=1.5  # the head\nfc.bias compute_us=0 count=2\n");
    const auto t = read_trace(in, "t.trace");
    REQUIRE(t.size() == 2);
    CHECK(t[0].name == "fc.weight");
    CHECK(t[0].count == 20);
    CHECK(t[0].compute_us == 1.5);
    CHECK(t[1].name == "fc.bias");
    CHECK(t[1].count == 2);
  }

  TEST_CASE("a broken trace is rejected with the line and what is wrong") {
    CHECK(error_of("a count=1 compute_us=1\nb count=2 compute_us=-3\n") == "t.trace:2: compute_us -3 is negative");
    CHECK(error_of("a count=1 compute_us=1 flops=9\n") == "t.trace:1: unknown field 'flops' (fields: count, compute_us)");
    CHECK(error_of("# x\na count=1 compute_us\n") == "t.trace:2: 'compute_us' is not key=value");
    CHECK(error_of("a count=1.5 compute_us=1\n") == "t.trace:1: count '1.5' is not a positive whole number");
    CHECK(error_of("a count=0 compute_us=1\n") == "t.trace:1: count '0' is not a positive whole number");
    CHECK(error_of("a count=4 compute_us=1e\n") == "t.trace:1: compute_us '1e' is not a number");
    CHECK(error_of("a count=4 compute_us=nan\n") == "t.trace:1: compute_us 'nan' is not a number");
    CHECK(error_of("a count=4\n") == "t.trace:1: compute_us is missing");
    CHECK(error_of("a compute_us=2\n") == "t.trace:1: count is missing");
    CHECK(error_of("a count=1 count=2 compute_us=1\n") == "t.trace:1: count given twice");
    CHECK(error_of("count=1 compute_us=1\n") == "t.trace:1: the line must start with the tensor's name, not 'count=1'");
    CHECK(error_of("# only a comment\n") == "t.trace: no tensors");
  }

  TEST_CASE("the shipped traces hold the published parameter counts") {
    struct Shipped {
      const char* file;
      std::size_t parameters, tensors;
    };
    for (const auto& [file, parameters, tensors] : {Shipped{"resnet50.trace", 25557032, 161},
                                                     Shipped{"bert-base.trace", 109483778, 201},
                                                     Shipped{"vgg19.trace", 143667240, 38}}) {
      CAPTURE(file);
      std::ifstream in(std::string(GRADSYNC_TRACES) + "/" + file);
      REQUIRE(in);
      const auto t = read_trace(in, file);
      CHECK(t.size() == tensors);
      CHECK(std::accumulate(t.begin(), t.end(), std::size_t{0}, [](std::size_t s, const auto& e) { return s + e.count; }) ==
            parameters);
    }
  }
}
