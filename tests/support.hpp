#pragma once
// Helpers shared by the test suites: run a function as N in-process ranks, deterministic data.

#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/compression/round_trip.hpp"
#include "gradsync/topology/ring.hpp"
#include "gradsync/transport/in_process.hpp"

namespace gradsync::test {

// Runs body(transport) on `n` threads, one per rank; returns each rank's Error (or nothing).
// Any exception other than gradsync::Error fails the calling test.
inline std::vector<std::optional<Error>> run_ranks(int n, const std::function<void(transport::InProcess&)>& body) {
  auto world = transport::InProcess::create_world(n);
  std::vector<std::optional<Error>> errors(static_cast<std::size_t>(n));
  std::vector<std::exception_ptr> other(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(world[static_cast<std::size_t>(r)]);
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(r)] = e;
      } catch (...) {
        other[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : other)
    if (e) std::rethrow_exception(e);
  return errors;
}

// Values with a spread of magnitudes and signs, so that summation order shows in the low bits.
inline std::vector<float> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> v(n);
  for (auto& x : v) x = std::ldexp(normal(gen), exponent(gen));
  return v;
}

// The ring's arithmetic, written out: segment s starts at rank s, each next rank adds its own
// value to what arrived (after a trip through the codec, compression::round_trip), the owner
// (rank s-1) divides by n, and everyone receives the owner's value after one more trip.
template <class C>
std::vector<float> ring_reference(const C& codec, const std::vector<std::vector<float>>& inputs) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t elements = inputs[0].size();
  std::vector<float> out(elements);
  for (int s = 0; s < n; ++s) {
    const ElemRange seg = topology::Ring::segment(elements, n, s);
    for (std::size_t e = seg.begin; e < seg.end; ++e) {
      float partial = inputs[static_cast<std::size_t>(s)][e];
      for (int k = 1; k < n; ++k) {
        const float arrived = C::identity ? partial : compression::round_trip(codec, partial);
        partial = inputs[static_cast<std::size_t>((s + k) % n)][e] + arrived;
      }
      const float average = partial / static_cast<float>(n);
      out[e] = C::identity ? average : compression::round_trip(codec, average);
    }
  }
  return out;
}

}  // namespace gradsync::test
