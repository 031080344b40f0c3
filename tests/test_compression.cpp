// The codecs: round trips, value sets, error bounds, selection rules, malformed input, error
// feedback and the compression-aware ring.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gradsync/compression/bf16.hpp"
#include "gradsync/compression/error_feedback.hpp"
#include "gradsync/compression/fp16.hpp"
#include "gradsync/compression/none.hpp"
#include "gradsync/compression/one_bit.hpp"
#include "gradsync/compression/random_k.hpp"
#include "gradsync/compression/terngrad.hpp"
#include "gradsync/compression/top_k.hpp"
#include "gradsync/compression/two_bit.hpp"
#include "gradsync/engine/exchange.hpp"
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
                     compression::Bf16, compression::TwoBit, compression::OneBit, compression::TernGrad<>,
                     compression::TopK, compression::RandomK) {
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

  TEST_CASE("TernGrad rounds each value to a neighbouring level, without bias, reproducibly") {
    const compression::TernGrad<2> codec{.seed = 5};
    auto in = test::random_values(1001, 8);
    for (float& v : in) v = std::clamp(v, -2.9f, 2.9f);
    in[3] = -3.0f;  // the largest magnitude: the scale
    auto state = codec.make_state(in.size(), DType::f32);
    std::vector<std::byte> encoded(codec.max_encoded_bytes(in.size(), DType::f32));
    CHECK(encoded.size() == 8 + 4 + 63 * 4);  // 2 bits a value, plus header and scale
    std::vector<double> mean(in.size());
    std::vector<float> out(in.size());
    constexpr int draws = 400;
    for (int d = 0; d < draws; ++d) {
      const std::size_t used = codec.encode(std::span<const float>(in), state, encoded);
      codec.decode(std::span<const std::byte>(encoded).first(used), std::span<float>(out), DecodeMode::overwrite);
      for (std::size_t i = 0; i < in.size(); ++i) {
        // Ternary: -3, 0 or +3, and never the opposite sign.
        REQUIRE((out[i] == 0.0f || out[i] == (in[i] < 0 ? -3.0f : 3.0f)));
        mean[i] += out[i] / draws;
      }
    }
    CHECK(out[3] == -3.0f);
    // Unbiased: over 400 draws the mean sits near the value (standard error <= 3/40).
    for (std::size_t i = 0; i < in.size(); ++i) REQUIRE(std::fabs(mean[i] - in[i]) < 0.4);

    // The same seed and history give the same bytes; another seed or the next encode do not.
    auto fresh = codec.make_state(in.size(), DType::f32), other_state = fresh;
    std::vector<std::byte> a(encoded.size()), b(encoded.size()), c(encoded.size()), next(encoded.size());
    codec.encode(std::span<const float>(in), fresh, a);
    codec.encode(std::span<const float>(in), fresh, next);
    codec.encode(std::span<const float>(in), other_state, b);
    const compression::TernGrad<2> reseeded{.seed = 6};
    auto reseeded_state = reseeded.make_state(in.size(), DType::f32);
    reseeded.encode(std::span<const float>(in), reseeded_state, c);
    CHECK(a == b);
    CHECK(a != next);
    CHECK(a != c);
  }

  TEST_CASE("TernGrad with more bits lands on the levels either side of each value") {
    const compression::TernGrad<4> codec{.seed = 2};  // 7 levels a side
    auto in = test::random_values(999, 13);
    for (float& v : in) v = std::clamp(v, -7.0f, 7.0f);
    in[0] = 7.0f;
    const auto out = round_trip(codec, in);
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(out[i] == std::round(out[i]));  // a whole level (the step is 1)
      REQUIRE(std::fabs(out[i] - in[i]) < 1.0f);
    }
    CHECK(round_trip(codec, std::vector<float>(40, 0.0f)) == std::vector<float>(40, 0.0f));
  }

  TEST_CASE("Keep counts a run's kept values from a count or a fraction") {
    CHECK(compression::Keep{.fraction = 0.01}.of(1000) == 10);
    CHECK(compression::Keep{.fraction = 0.01}.of(1001) == 11);  // rounded up
    CHECK(compression::Keep{.fraction = 0.01}.of(5) == 1);      // at least one
    CHECK(compression::Keep{.fraction = 0.01}.of(0) == 0);
    CHECK(compression::Keep{.count = 7}.of(1000) == 7);
    CHECK(compression::Keep{.count = 7}.of(3) == 3);  // at most all
  }

  TEST_CASE("TopK keeps the k largest magnitudes, the lower index first among equals") {
    for (std::size_t n : {1u, 10u, 1000u, 4099u}) {
      for (std::size_t k : {1u, 3u, 64u}) {
        CAPTURE(n);
        CAPTURE(k);
        // Few distinct magnitudes, both signs, zeros: many ties at the cut.
        std::mt19937_64 gen(n * 31 + k);
        std::vector<float> in(n);
        for (float& v : in) v = static_cast<float>(static_cast<int>(gen() % 9) - 4) * 0.125f;
        const compression::TopK codec{.keep = {.count = k}};
        const auto out = round_trip(codec, in);
        // Reference: sort indices by (magnitude descending, index ascending), keep the first k.
        std::vector<std::size_t> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](std::size_t a, std::size_t b) { return std::fabs(in[a]) > std::fabs(in[b]); });
        std::vector<float> expected(n, 0.0f);
        for (std::size_t j = 0; j < std::min(k, n); ++j) expected[order[j]] = in[order[j]];
        REQUIRE(out == expected);
      }
    }
  }

  TEST_CASE("TopK on random data keeps exactly the values above the k-th magnitude") {
    const auto in = test::random_values(100000, 9);
    const compression::TopK codec{.keep = {.fraction = 0.003}};
    const auto out = round_trip(codec, in);
    std::vector<float> magnitudes(in.size());
    std::transform(in.begin(), in.end(), magnitudes.begin(), [](float v) { return std::fabs(v); });
    std::nth_element(magnitudes.begin(), magnitudes.begin() + 299, magnitudes.end(), std::greater<>());
    const float cut = magnitudes[299];
    std::size_t kept = 0;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (out[i] != 0.0f) REQUIRE(out[i] == in[i]);
      REQUIRE((out[i] != 0.0f) == (std::fabs(in[i]) >= cut));
      kept += out[i] != 0.0f;
    }
    CHECK(kept == 300);
  }

  TEST_CASE("TopK rejects indices out of range or out of order, and a foreign k") {
    const compression::TopK codec{.keep = {.count = 4}};
    const auto in = test::random_values(100, 10);
    compression::TopK::State state;
    std::vector<std::byte> encoded(codec.max_encoded_bytes(100, DType::f32));
    codec.encode(std::span<const float>(in), state, encoded);
    std::vector<float> out(100, 1.0f);
    const auto index_at = [&](std::size_t j) { return reinterpret_cast<std::uint32_t*>(encoded.data() + 12) + j; };
    auto forged = encoded;
    const auto decode = [&](const std::vector<std::byte>& bytes) {
      codec.decode(std::span<const std::byte>(bytes), std::span<float>(out), DecodeMode::add);
    };
    *index_at(3) = 100;
    std::swap(forged, encoded);
    CHECK_THROWS_WITH_AS(decode(forged), doctest::Contains("index 100 at position 3"), Error);
    std::swap(forged, encoded);
    *index_at(3) = *index_at(2);
    CHECK_THROWS_WITH_AS(decode(encoded), doctest::Contains("out of range or order"), Error);
    CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 1.0f; }));  // nothing written
    const compression::TopK other{.keep = {.count = 5}};
    std::vector<std::byte> five(other.max_encoded_bytes(100, DType::f32));
    other.encode(std::span<const float>(in), state, five);
    CHECK_THROWS_WITH_AS(codec.decode(std::span<const std::byte>(five), std::span<float>(out), DecodeMode::add),
                         doctest::Contains("top-k codec"), Error);
  }

  TEST_CASE("RandomK keeps k values at positions drawn from the seed, one per stratum") {
    const auto in = test::random_values(1000, 12);
    const compression::RandomK codec{.keep = {.count = 50}, .seed = 3};
    auto state = codec.make_state(in.size(), DType::f32);
    std::vector<std::byte> encoded(codec.max_encoded_bytes(in.size(), DType::f32));
    CHECK(encoded.size() == 8 + 8 + 50 * 4);  // no indices travel
    std::vector<float> out(in.size());
    std::vector<int> hits(in.size());
    for (int step = 0; step < 200; ++step) {
      const std::size_t used = codec.encode(std::span<const float>(in), state, encoded);
      codec.decode(std::span<const std::byte>(encoded).first(used), std::span<float>(out), DecodeMode::overwrite);
      std::size_t kept = 0;
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (out[i] != 0.0f) {
          REQUIRE(out[i] == in[i]);
          REQUIRE(i / 20 == kept);  // the kept-th position lies in the kept-th stratum of 20
          ++kept;
          ++hits[i];
        }
      }
      REQUIRE(kept == 50);
    }
    // Over 200 encodes (10,000 draws of 1 in 20) every position came up.
    CHECK(*std::min_element(hits.begin(), hits.end()) > 0);
    // Same seed and history: same positions, on any rank.
    auto again = codec.make_state(in.size(), DType::f32);
    std::vector<std::byte> first(encoded.size()), replay(encoded.size());
    auto first_state = codec.make_state(in.size(), DType::f32);
    codec.encode(std::span<const float>(in), first_state, first);
    codec.encode(std::span<const float>(in), again, replay);
    CHECK(first == replay);
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
                     compression::TwoBit, compression::OneBit, compression::TernGrad<>, compression::TopK,
                     compression::RandomK) {
    // Sparsifiers keep a quarter here: with the default 1% of 257 values, a value would wait
    // ~90 steps for its turn and the bound below would measure the wait, not the feedback.
    const compression::ErrorFeedback<C> codec{[] {
      if constexpr (requires(C c) { c.keep; }) return C{.keep = {.fraction = 0.25}};
      else return C{};
    }()};
    constexpr std::size_t n = 257;
    auto state = codec.make_state(n, DType::f32);
    std::vector<std::byte> encoded(codec.max_encoded_bytes(n, DType::f32));
    std::vector<double> given(n), received(n);
    std::vector<float> decoded(n);
    float worst_residual = 0;
    std::mt19937_64 gen(17);
    std::normal_distribution<float> gradient(0.0f, 0.1f);  // well inside TwoBit's default threshold
    std::vector<float> g(n);
    for (int step = 0; step < 1000; ++step) {
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
    // Bounded: without feedback the held-back sums would be random walks, ~3.2 apart from the
    // inputs after 1000 such steps (one standard deviation), the worst of 257 near 9. TernGrad's
    // residual is its rounding of the whole p, up to the run's largest magnitude, hence more room.
    CHECK(worst_residual < (std::is_same_v<C, compression::TernGrad<>> ? 3.0f : 1.5f));
    CHECK(worst_residual > 0.0f);
  }

  // C with every member but encode_keeping_error, so that ErrorFeedback takes its generic steps.
  template <class C>
  struct GenericSteps {
    C codec;
    using State = typename C::State;
    static constexpr bool identity = C::identity;
    static constexpr bool lossless = C::lossless;
    std::string describe() const { return codec.describe(); }
    State make_state(std::size_t n, DType dtype) const { return codec.make_state(n, dtype); }
    std::size_t max_encoded_bytes(std::size_t n, DType dtype) const { return codec.max_encoded_bytes(n, dtype); }
    template <class T>
    std::size_t encode(std::span<const T> values, State& state, std::span<std::byte> out) const {
      return codec.encode(values, state, out);
    }
    template <class T>
    void decode(std::span<const std::byte> in, std::span<T> out, DecodeMode mode) const {
      codec.decode(in, out, mode);
    }
  };

  template <class T, class C>
  void check_keeping_error_matches_generic_steps() {
    static_assert(requires(const C c, typename C::State s, std::span<const T> in, std::span<T> residual,
                           std::span<std::byte> out) { c.encode_keeping_error(in, residual, s, out); });
    const compression::ErrorFeedback<C> fused{};
    const compression::ErrorFeedback<GenericSteps<C>> generic{};
    // Whole blocks (256 values for TwoBit, 512 for OneBit), partial words, nothing at all.
    for (std::size_t n : {0u, 1u, 17u, 256u, 512u, 1000u, 4099u}) {
      CAPTURE(n);
      auto fused_state = fused.make_state(n, dtype_of<T>());
      auto generic_state = generic.make_state(n, dtype_of<T>());
      std::vector<std::byte> fused_out(fused.max_encoded_bytes(n, dtype_of<T>()));
      std::vector<std::byte> generic_out(fused_out.size());
      for (unsigned step = 0; step < 5; ++step) {  // the residual carries over
        const auto values = test::random_values(n, 31u * n + step);  // magnitudes on both sides of 0.5
        std::vector<T> g(values.begin(), values.end());
        // Values where the two ways could part: signed zeros and TwoBit's threshold exactly, at a
        // different place each step. Not NaN, nor infinities (inf - inf): g++ may rewrite
        // -(-p + v) as -(v - p), which x86 answers with the other sign of a NaN p.
        const T specials[] = {T(0), -T(0), T(0.5), -T(0.5)};
        for (std::size_t j = 0; j < std::size(specials) && n > 0; ++j) g[(7 * step + 13 * j) % n] = specials[j];
        const std::size_t fused_bytes = fused.encode(std::span<const T>(g), fused_state, fused_out);
        const std::size_t generic_bytes = generic.encode(std::span<const T>(g), generic_state, generic_out);
        REQUIRE(fused_bytes == generic_bytes);
        REQUIRE(std::memcmp(fused_out.data(), generic_out.data(), fused_bytes) == 0);
        const auto residual = [](const auto& state) -> const std::vector<T>& {
          if constexpr (std::is_same_v<T, double>) return state.residual_f64;
          else return state.residual_f32;
        };
        REQUIRE(std::memcmp(residual(fused_state).data(), residual(generic_state).data(), n * sizeof(T)) == 0);
      }
    }
  }

  TEST_CASE_TEMPLATE("error feedback: a codec's encode_keeping_error leaves the bits of the generic steps", C,
                     compression::TwoBit, compression::OneBit, compression::TopK, compression::RandomK) {
    check_keeping_error_matches_generic_steps<float, C>();
    check_keeping_error_matches_generic_steps<double, C>();
  }

  TEST_CASE_TEMPLATE("ring allreduce with lossy codecs leaves every rank the same bits", C, compression::TwoBit,
                     compression::OneBit, compression::TernGrad<>, compression::TopK, compression::RandomK,
                     compression::ErrorFeedback<compression::TwoBit>, compression::ErrorFeedback<compression::OneBit>,
                     compression::ErrorFeedback<compression::TernGrad<>>, compression::ErrorFeedback<compression::TopK>,
                     compression::ErrorFeedback<compression::RandomK>) {
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
