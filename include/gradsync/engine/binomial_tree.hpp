#pragma once
// engine::binomial_tree — who talks to whom in the control collectives (engine/control.hpp,
// bench/allreduce's coordination), so that no rank talks to every other: each talks to at most
// about log2(n) ranks, and a message crosses at most ceil(log2 n) of them on its way to or from
// the root.
//
// Positions 0..n-1, rooted at 0. Position r's parent is r with its lowest set bit cleared; its
// children are r + 2^k for every 2^k below r's lowest set bit (every 2^k for the root) with
// r + 2^k < n. Child r + 2^k roots the positions r + 2^k .. r + 2^(k+1) - 1 that are below n, so a
// subtree is a run of consecutive positions, and r followed by its children's subtrees in order of
// k is r's own run in order: a gather up the tree arrives at the root in position order.

#include <algorithm>
#include <bit>

namespace gradsync::engine::binomial_tree {

// Position r's parent (r > 0).
constexpr int parent(int r) noexcept { return r & (r - 1); }

// How many children position r has in a tree of n positions: children(r, n) - 1 is the largest
// index `child` takes.
constexpr int children(int r, int n) noexcept {
  const int below_n = std::bit_width(static_cast<unsigned>(n - 1 - r));  // k with r + 2^k <= n - 1
  return r == 0 ? below_n : std::min(std::countr_zero(static_cast<unsigned>(r)), below_n);
}

// Position r's child number i (0 <= i < children(r, n)): the root of a subtree of at most 2^i
// positions.
constexpr int child(int r, int i) noexcept { return r + (1 << i); }

// One past the last position of the subtree rooted at r, in a tree of n positions.
constexpr int subtree_end(int r, int n) noexcept {
  if (r == 0) return n;
  const int span = 1 << std::countr_zero(static_cast<unsigned>(r));
  return n - r <= span ? n : r + span;
}

}  // namespace gradsync::engine::binomial_tree
