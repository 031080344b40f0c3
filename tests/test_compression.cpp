// Codecs None, Fp16 and Bf16: round trips, error bounds, malformed input.

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/engine/serial_executor.hpp"
#include "gradsync/topology/ring.hpp"
#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;

static_assert(CompressionPolicy<compression::ErrorFeedback<compression::TwoBit>>);
static_assert(CompressionPolicy<compression::ErrorFeedback<compression::OneBit>>);

namespace {

template <class C, class T>
std::vector<T> round_trip(const C& codec, const std::vector<T>& in) {
  auto state = codec.make_state(in.size(), dtype_of<T>());
  std::vector<std::byte> encoded(codec.max_encoded_bytes(in.size(), dtype_of<T>()));
  const std::size_t used = codec.encode(std::span<const T>(in), state, encoded);
  CHECK(used <= encoded.size());
  std::vector<T> out(in.size(), T(99));
  codec.decode(std::span<const std::byte>(encoded).first(used), std::span<T>(out), DecodeMode::overwrite);
  return out;
}

}  // namespace

TEST_SUITE("compression") {
  TEST_CASE("None is exact for f32 and f64, and decode can add") {
    const compression::None codec;
    const auto f = test::random_values(1001, 1);
    CHECK(round_trip(codec, f) == f);
    const std::vector<double> d(f.begin(), f.end());
    CHECK(round_trip(codec, d) == d);

    std::vector<std::byte> encoded(codec.max_encoded_bytes(f.size(), DType::f32));
    compression::None::State state;
    codec.encode(std::span<const float>(f), state, encoded);
    std::vector<float> acc(f.size(), 1.0f);
    codec.decode(std::span<const std::byte>(encoded), std::span<float>(acc), DecodeMode::add);
    for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(acc[i] == 1.0f + f[i]);
  }

  TEST_CASE_TEMPLATE("16-bit codecs round within half a unit in the last place", C, compression::Fp16,
                     compression::Bf16) {
    const C codec;
    // Half precision keeps 11 significant bits, bfloat16 8: relative error at most 2^-11 or 2^-8.
    const float bound = std::is_same_v<C, compression::Fp16> ? std::ldexp(1.0f, -11) : std::ldexp(1.0f, -8);
    const auto in = test::random_values(4097, 2);  // magnitudes within f16's normal range
    const auto out = round_trip(codec, in);
    std::size_t changed = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(std::fabs(out[i] - in[i]) <= bound * std::fabs(in[i]));
      changed += out[i] != in[i];
    }
    CHECK(changed > in.size() / 2);  // the data really needed rounding
    CHECK(codec.max_encoded_bytes(in.size(), DType::f32) == in.size() * 2);
    CHECK_FALSE(C::lossless);
  }

  TEST_CASE_TEMPLATE("malformed encodings are rejected, not read past", C, compression::None, compression::Fp16,
                     compression::Bf16, compression::TwoBit, compression::OneBit) {
    const C codec;
    std::vector<float> out(10);
    std::vector<std::byte> too_short(codec.max_encoded_bytes(10, DType::f32) - 2);
    std::vector<std::byte> too_long(codec.max_encoded_bytes(10, DType::f32) + 2);
    CHECK_THROWS_AS(codec.decode(std::span<const std::byte>(too_short), std::span<float>(out), DecodeMode::add), Error);
    try {
      codec.decode(std::span<const std::byte>(too_long), std::span<float>(out), DecodeMode::overwrite);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::protocol);
    }
    const std::vector<float> in(10, 1.0f);
    typename C::State state;
    std::vector<std::byte> small(4);
    CHECK_THROWS_AS(codec.encode(std::span<const float>(in), state, small), Error);
  }

  TEST_CASE("TwoBit sends +-threshold for values at or beyond it and 0 for the rest") {
    const compression::TwoBit codec{.threshold = 0.25f};
    auto in = test::random_values(1003, 4);  // not a multiple of 16: a partial last word
    in[0] = 0.25f;
    in[1] = -0.25f;
    in[2] = 0.2499f;
    const auto out = round_trip(codec, in);
    std::size_t zeros = 0, kept = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      const float expected = in[i] >= 0.25f ? 0.25f : in[i] <= -0.25f ? -0.25f : 0.0f;
      REQUIRE(out[i] == expected);
      (expected == 0.0f ? zeros : kept) += 1;
    }
    CHECK(zeros > 100);
    CHECK(kept > 100);
    CHECK(codec.max_encoded_bytes(1003, DType::f32) == 8 + 4 + 63 * 4);  // 1/16 of f32, plus 12 bytes
  }

  TEST_CASE("OneBit sends each sign with the mean magnitude") {
    const compression::OneBit codec;
    const auto in = test::random_values(1001, 5);
    double magnitude = 0;
    for (float v : in) magnitude += std::fabs(v);
    const auto scale = static_cast<float>(magnitude / in.size());
    const auto out = round_trip(codec, in);
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(std::fabs(out[i]) == doctest::Approx(scale).epsilon(1e-5));
      REQUIRE((out[i] > 0) == (in[i] >= 0));
    }
  }

  TEST_CASE("a codec's data is not decoded by another codec, nor into the wrong count") {
    const compression::TwoBit two;
    const compression::OneBit one;
    const auto in = test::random_values(64, 6);
    compression::TwoBit::State state;
    std::vector<std::byte> encoded(two.max_encoded_bytes(64, DType::f32));
    two.encode(std::span<const float>(in), state, encoded);
    std::vector<float> out(64), other(48);
    try {
      one.decode(std::span<const std::byte>(encoded), std::span<float>(out), DecodeMode::overwrite);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.detail() == "one-bit codec: the data was encoded by codec 3, not this one (4)");
    }
    try {
      two.decode(std::span<const std::byte>(encoded), std::span<float>(other), DecodeMode::overwrite);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.detail() == "two-bit codec: the data holds 64 values, the destination 48");
    }
    encoded[1] = std::byte{9};
    CHECK_THROWS_WITH_AS(two.decode(std::span<const std::byte>(encoded), std::span<float>(out), DecodeMode::overwrite),
                         doctest::Contains("format version 9"), Error);
  }

  TEST_CASE_TEMPLATE("error feedback: decoded values track the inputs, off by a bounded residual", C,
                     compression::TwoBit, compression::OneBit) {
    const compression::ErrorFeedback<C> codec;
    constexpr std::size_t n = 257;
    auto state = codec.make_state(n, DType::f32);
    std::vector<std::byte> encoded(codec.max_encoded_bytes(n, DType::f32));
    std::vector<double> given(n), received(n);
    std::vector<float> decoded(n);
    float worst_residual = 0;
    std::mt19937_64 gen(17);
    std::normal_distribution<float> gradient(0.0f, 0.1f);  // well inside TwoBit's default threshold
    std::vector<float> g(n);
    for (int step = 0; step < 300; ++step) {
      for (float& v : g) v = gradient(gen);
      const std::size_t bytes = codec.encode(std::span<const float>(g), state, encoded);
      codec.decode(std::span<const std::byte>(encoded).first(bytes), std::span<float>(decoded), DecodeMode::overwrite);
      for (std::size_t i = 0; i < n; ++i) {
        given[i] += g[i];
        received[i] += decoded[i];
        worst_residual = std::max(worst_residual, std::fabs(state.residual_f32[i]));
      }
    }
    // What was given = what was received + what is still held back.
    for (std::size_t i = 0; i < n; ++i) REQUIRE(given[i] == doctest::Approx(received[i] + state.residual_f32[i]).epsilon(1e-4));
    CAPTURE(worst_residual);
    CHECK(worst_residual < 1.5f);  // bounded: a random walk of 300 such steps would reach ~1.7
    CHECK(worst_residual > 0.0f);
  }

  TEST_CASE_TEMPLATE("ring allreduce with quantizing codecs leaves every rank the same bits", C, compression::TwoBit,
                     compression::OneBit, compression::ErrorFeedback<compression::TwoBit>,
                     compression::ErrorFeedback<compression::OneBit>) {
    for (int n : {2, 3, 4, 5}) {
      for (std::size_t elements : {1u, 17u, 1000u}) {
        CAPTURE(n);
        CAPTURE(elements);
        const C codec;
        const topology::Ring ring{.chunk_elements = 64};
        std::vector<std::vector<float>> outputs(static_cast<std::size_t>(n));
        const auto errors = test::run_ranks(n, [&](transport::InProcess& t) {
          const Group group = Group::world(t.rank(), n);
          engine::BucketExchange<C, transport::InProcess> exchange(ring.schedule(group, elements, codec_traits<C>()),
                                                                   codec, DType::f32);
          auto& values = outputs[static_cast<std::size_t>(t.rank())];
          for (int iteration = 0; iteration < 3; ++iteration) {  // error feedback state carries over
            values = test::random_values(elements, 77u * static_cast<unsigned>(t.rank()) + static_cast<unsigned>(iteration));
            exchange.run(std::span<float>(values), codec, t, {group, static_cast<std::uint64_t>(iteration), 0, 10s});
          }
        });
        for (const auto& e : errors) REQUIRE_FALSE(e);
        for (int r = 1; r < n; ++r) REQUIRE(outputs[static_cast<std::size_t>(r)] == outputs[0]);
        for (float v : outputs[0]) REQUIRE(std::isfinite(v));
      }
    }
  }
}
