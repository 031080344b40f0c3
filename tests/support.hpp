#pragma once
// Helpers shared by the test suites: run a function as N in-process ranks, deterministic data.

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

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

}  // namespace gradsync::test
