// Core vocabulary: number formats, errors, the layout comparison.

#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "gradsync/engine/control.hpp"
#include "gradsync/error.hpp"
#include "gradsync/numeric.hpp"
#include "gradsync/types.hpp"

using namespace gradsync;

TEST_SUITE("core") {
  TEST_CASE("every finite f16 value survives f16 -> f32 -> f16") {
    for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
      const auto h = static_cast<std::uint16_t>(bits);
      const float f = numeric::from_f16_bits(h);
      if (std::isnan(f)) {
        CHECK(std::isnan(numeric::from_f16_bits(numeric::f16_bits(f))));
        continue;
      }
      REQUIRE(numeric::f16_bits(f) == h);
    }
  }

  TEST_CASE("f16 rounds to nearest even and saturates to infinity") {
    CHECK(numeric::f16_bits(1.0f) == 0x3c00);
    CHECK(numeric::f16_bits(-2.0f) == 0xc000);
    CHECK(numeric::f16_bits(65504.0f) == 0x7bff);
    CHECK(numeric::f16_bits(65519.0f) == 0x7bff);  // below the halfway point to 65536
    CHECK(numeric::f16_bits(65520.0f) == 0x7c00);  // halfway, max is odd: rounds up to inf
    CHECK(numeric::f16_bits(1e10f) == 0x7c00);
    CHECK(numeric::f16_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
    // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): ties to even -> 1.
    CHECK(numeric::f16_bits(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
    // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9: rounds up.
    CHECK(numeric::f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
    // Subnormals: 2^-24 is the smallest; 2^-25 ties to even (zero); just above rounds up.
    CHECK(numeric::f16_bits(std::ldexp(1.0f, -24)) == 0x0001);
    CHECK(numeric::f16_bits(std::ldexp(1.0f, -25)) == 0x0000);
    CHECK(numeric::f16_bits(std::ldexp(1.5f, -25)) == 0x0001);
    CHECK(numeric::f16_bits(std::ldexp(3.0f, -25)) == 0x0002);  // 1.5 units ties to even 2
    CHECK(numeric::f16_bits(-0.0f) == 0x8000);
  }

  TEST_CASE("bf16 keeps the top half of f32 with round to nearest even") {
    CHECK(numeric::bf16_bits(1.0f) == 0x3f80);
    CHECK(numeric::bf16_bits(numeric::float_of(0x3f808000u)) == 0x3f80);  // tie, even stays
    CHECK(numeric::bf16_bits(numeric::float_of(0x3f818000u)) == 0x3f82);  // tie, odd rounds up
    CHECK(numeric::bf16_bits(numeric::float_of(0x3f808001u)) == 0x3f81);
    CHECK(numeric::bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // rounds to inf
    CHECK(std::isnan(numeric::from_bf16_bits(numeric::bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
    for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
      const float f = numeric::from_bf16_bits(static_cast<std::uint16_t>(bits));
      if (!std::isnan(f)) REQUIRE(numeric::bf16_bits(f) == bits);
    }
  }

  TEST_CASE("an Error names rank, peer, bucket and operation") {
    const Error e(ErrorKind::timeout, {.rank = 3, .peer = 1, .bucket = 7, .operation = "recv"}, "nothing arrived");
    CHECK(std::string(e.what()) == "gradsync: rank 3, peer 1, bucket 7, recv: timeout: nothing arrived");
    const Error bare(ErrorKind::protocol, {}, "short buffer");
    const Error filled = bare.filled({.rank = 2, .bucket = 4, .operation = "decode-add"});
    CHECK(std::string(filled.what()) == "gradsync: rank 2, bucket 4, decode-add: protocol error: short buffer");
    CHECK(filled.kind() == ErrorKind::protocol);
    CHECK(std::string(Error(ErrorKind::invalid_argument, {.operation = "launch"}, "RANK is not set").what()) ==
          "gradsync: launch: invalid argument: RANK is not set");
    CHECK(std::string(bare.what()) == "gradsync: protocol error: short buffer");
  }

  TEST_CASE("views and devices") {
    std::vector<std::uint16_t> bits(5);
    const TensorView v = view(bits, DType::bf16);
    CHECK(v.count == 5);
    CHECK(v.bytes() == 10);
    CHECK_THROWS_AS(view(bits, DType::f32), Error);
    CHECK(to_string(Device::cuda(2)) == "cuda:2");
    CHECK(accumulation_dtype(DType::f16) == DType::f32);
    CHECK(accumulation_dtype(DType::f64) == DType::f64);
  }

  TEST_CASE("layout comparison says what differs") {
    const Layout a{{"w", 10, DType::f32}, {"b", 3, DType::f32}};
    Layout b = a;
    const std::string ref = engine::describe_layout(a, "policies: x");
    CHECK(engine::layout_differences(ref, engine::describe_layout(b, "policies: x"), 1).empty());

    b[1].count = 4;
    const std::string size_diff = engine::layout_differences(ref, engine::describe_layout(b, "policies: x"), 2);
    CHECK(size_diff == R"(rank 2 differs from rank 0: gradient 1: rank 0 has "b" f32[3] cpu, rank 2 has "b" f32[4] cpu)");

    b.pop_back();
    const std::string count_diff = engine::layout_differences(ref, engine::describe_layout(b, "policies: y"), 1);
    CHECK(count_diff.find(R"(policies: rank 0 has "policies: x", rank 1 has "policies: y")") != std::string::npos);
    CHECK(count_diff.find("rank 0 registered 2 gradients, rank 1 registered 1") != std::string::npos);

    CHECK(engine::layout_differences(ref, "something else\n", 5).find("another layout format") != std::string::npos);
  }

  TEST_CASE("a plan survives its wire form, and malformed plan messages are refused") {
    const BucketPlan plan{{{3, 1}, {0}, {2, 4, 5}}};
    const ErrorContext where{.rank = 1, .peer = 0, .operation = "plan agreement"};
    const std::string bytes = engine::encode_plan(plan);
    CHECK(engine::decode_plan(bytes, where) == plan);
    CHECK(engine::decode_plan(engine::encode_plan(BucketPlan{}), where) == BucketPlan{});

    const auto refused = [&](std::string_view message) {
      try {
        engine::decode_plan(message, where);
      } catch (const Error& e) {
        CHECK(e.kind() == ErrorKind::protocol);
        CHECK(e.context().peer == 0);
        return std::string(e.what()).find("malformed plan message") != std::string::npos;
      }
      return false;
    };
    CHECK(refused(bytes.substr(0, bytes.size() - 1)));  // not whole words
    CHECK(refused(bytes.substr(0, bytes.size() - 4)));  // a bucket shorter than its count
    CHECK(refused(bytes + std::string(4, '\0')));       // words left over
    std::string huge = bytes;
    huge[0] = '\xff';  // a bucket count larger than the message
    CHECK(refused(huge));
    CHECK(refused(""));
  }
}
