// Codecs None, Fp16 and Bf16: round trips, error bounds, malformed input.

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "support.hpp"

using namespace gradsync;

namespace {

template <class C, class T>
std::vector<T> round_trip(const C& codec, const std::vector<T>& in) {
  auto state = codec.make_state(in.size());
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
                     compression::Bf16) {
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
}
