#pragma once
// Counts the program's heap allocations, on every thread, between start() and stop(): the tests of
// the Synchronizer's promise that its per-step path allocates nothing. Linking
// allocation_count.cpp into a test program replaces its global operator new (one definition per
// program, so it is a source of the program rather than of a library).

#include <cstddef>

namespace gradsync::test::allocation_count {

void start() noexcept;
// The allocations since start(); counting ends.
std::size_t stop() noexcept;

}  // namespace gradsync::test::allocation_count
