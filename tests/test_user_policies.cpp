// The policies docs/writing-policies.md walks through (tests/policies/), run in a real
// Synchronizer over in-process ranks, so that the guide's code is built and checked.

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradsync/gradsync.hpp"
#include "policies/fixed_point16.hpp"
#include "policies/reverse_groups.hpp"
#include "support.hpp"

using namespace gradsync;
using example::FixedPoint16;
using example::ReverseGroups;
using transport::InProcess;

// An f32-only codec makes an f32-only ErrorFeedback.
static_assert(!CodecFor<FixedPoint16, double>);
static_assert(CompressionPolicy<compression::ErrorFeedback<FixedPoint16>>);
static_assert(!CodecFor<compression::ErrorFeedback<FixedPoint16>, double>);

TEST_SUITE("user_policies") {
  TEST_CASE("ReverseGroups with no compression: its plan, and exact averages") {
    // Registered: f32 f32 f64 f32 f32 f32. Reversed in pairs, the f64 gradient alone, and the f32
    // gradient before it closing a bucket early, since the next one is f64.
    const std::vector<DType> dtypes{DType::f32, DType::f32, DType::f64, DType::f32, DType::f32, DType::f32};
    const std::vector<std::size_t> counts{3, 10, 7, 1, 64, 5};
    const BucketPlan expected{{{5, 4}, {3}, {2}, {1, 0}}};
    constexpr int ranks = 4;  // dividing a sum of small integers by 4 is exact
    // Rank r's element e of gradient g in iteration i: small integers, whose sums are exact in any order.
    const auto value = [](int r, std::size_t g, std::size_t e, int i) {
      return static_cast<double>((r + 1) * static_cast<int>(g + 3 * e) - 5 * i);
    };
    const auto errors = test::run_ranks(ranks, [&](InProcess& t) {
      const int r = t.rank();
      std::vector<std::vector<float>> f32(dtypes.size());
      std::vector<std::vector<double>> f64(dtypes.size());
      Synchronizer<ReverseGroups, compression::None, topology::Ring, InProcess> sync(std::move(t), {},
                                                                                    ReverseGroups{.per_bucket = 2});
      for (std::size_t g = 0; g < dtypes.size(); ++g) {
        const std::string name = "g" + std::to_string(g);
        if (dtypes[g] == DType::f64) {
          f64[g].resize(counts[g]);
          sync.add(name, view(f64[g]));
        } else {
          f32[g].resize(counts[g]);
          sync.add(name, view(f32[g]));
        }
      }
      for (int i = 0; i < 3; ++i) {
        for (std::size_t g = 0; g < dtypes.size(); ++g)
          for (std::size_t e = 0; e < counts[g]; ++e) {
            if (dtypes[g] == DType::f64) f64[g][e] = value(r, g, e, i);
            else f32[g][e] = static_cast<float>(value(r, g, e, i));
          }
        for (GradId id = 0; id < dtypes.size(); ++id) sync.ready(id);
        sync.wait();
        CHECK(sync.plan() == expected);
        for (std::size_t g = 0; g < dtypes.size(); ++g)
          for (std::size_t e = 0; e < counts[g]; ++e) {
            double sum = 0;
            for (int k = 0; k < ranks; ++k) sum += value(k, g, e, i);
            const double got = dtypes[g] == DType::f64 ? f64[g][e] : f32[g][e];
            CHECK(got == sum / ranks);
          }
      }
    });
    for (const auto& e : errors) REQUIRE_FALSE(e);
  }

  TEST_CASE("FixedPoint16 on a ring: the same bits on every rank, the ring's arithmetic through the codec") {
    const FixedPoint16 codec{.step = 1.0f / 1024};
    constexpr std::size_t count = 1000;
    for (int ranks : {2, 3, 4}) {
      CAPTURE(ranks);
      std::vector<std::vector<float>> inputs, outputs(static_cast<std::size_t>(ranks));
      for (int r = 0; r < ranks; ++r) {
        inputs.push_back(test::random_values(count, 70u + static_cast<unsigned>(r)));
        for (float& v : inputs.back()) v /= 64;  // within the codec's range (±32) even when summed
      }
      const auto errors = test::run_ranks(ranks, [&](InProcess& t) {
        const auto r = static_cast<std::size_t>(t.rank());
        std::vector<float> grad = inputs[r];
        Synchronizer<ReverseGroups, FixedPoint16, topology::Ring, InProcess> sync(std::move(t), {}, {}, codec);
        sync.add("w", view(grad));
        sync.ready(0);
        sync.wait();
        outputs[r] = grad;
      });
      for (const auto& e : errors) REQUIRE_FALSE(e);
      // Every hop's partial sum and the owner's average each take one trip through the codec.
      const std::vector<float> reference = test::ring_reference(codec, inputs);
      for (const auto& out : outputs) REQUIRE(out == reference);
      // And so, within the codec's error of step / 2 per trip (ranks - 1 sums, divided by ranks,
      // then the average's own trip): less than one step from the exact average.
      for (std::size_t e = 0; e < count; ++e) {
        double exact = 0;
        for (const auto& in : inputs) exact += in[e];
        CHECK(std::fabs(reference[e] - exact / ranks) < codec.step);
      }
    }
  }

  TEST_CASE_TEMPLATE("a codec without an f64 path refuses f64 gradients in add(), naming both", Codec, FixedPoint16,
                     compression::ErrorFeedback<FixedPoint16>) {
    auto world = InProcess::create_world(1);
    Synchronizer<ReverseGroups, Codec, topology::Ring, InProcess> sync(std::move(world[0]));
    std::vector<float> f32(4);
    std::vector<double> f64(4);
    sync.add("layer.weight", view(f32));
    try {
      sync.add("layer.bias", view(f64));
      FAIL("an f64 gradient was accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::unsupported);
      const std::string message = e.what();
      CHECK(message.find("\"layer.bias\"") != std::string::npos);
      CHECK(message.find(Codec{}.describe()) != std::string::npos);
    }
  }
}
