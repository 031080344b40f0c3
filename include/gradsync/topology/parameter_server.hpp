#pragma once
// topology::ParameterServer — synchronous parameter-server aggregation, the form BytePS and
// HiPress's PS mode use: each bucket is cut into `partitions` parts, each with an aggregation root
// (a server); every other rank sends its part to the root, the root adds the contributions,
// averages, and sends the result back.
//
// Placement. `servers` 0 makes every rank a root (co-located: part p's root is rank p mod n).
// With servers = s, the last s ranks of the group are the roots, taking the parts in turn; rank 0
// stays a worker, so the plan it proposes comes from a rank that trains. Co-located servers train
// too: their own values enter the average, which is over all n ranks. With `dedicated`, the s
// servers only aggregate: their values do not enter, the average is over the n - s workers, and
// results go to the workers only. A dedicated server still registers the same gradients and calls
// ready() and wait() each iteration (its buffers are where it aggregates); afterwards they hold
// the average of the parts it serves and are otherwise unspecified. Co-located, each rank's uplink
// and downlink carry (n-1)/n of a bucket each way, as in a ring, in one hop instead of 2(n-1);
// dedicated, a worker sends and receives the whole bucket and the servers' links carry the rest.
//
// With a codec that is not the identity, a contribution travels encoded and the root decodes and
// adds it; the root encodes the average once, decodes its own encoding (so it ends with the bits
// everyone else receives) and sends the same bytes to all. Only the root sums a part, in group
// order with its own values (raw, co-located) at their place, so every rank ends with the same
// bits, and an element's sum does not depend on which rank serves it.
//
// A bucket smaller than the partition count leaves some parts empty; they send nothing. Parts are
// further cut into pieces of at most `chunk_elements`, each its own message, so that a root adds
// one piece while the next arrives.

#include <algorithm>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/error.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::topology {

struct ParameterServer {
  std::size_t partitions = 0;                         // 0: one per rank
  std::size_t servers = 0;                            // 0: every rank (co-located)
  bool dedicated = false;                             // the servers only aggregate; needs 1 <= servers < group size
  std::size_t chunk_elements = std::size_t{1} << 18;  // 1 MiB of f32
  // Between two ranks a and b, a sends b its contributions to b's parts, then the results of its
  // own parts; b posts its receives from a in that order too (all contributions before any
  // result), so both ends of a pair post its messages in one order (PairOrderedTopology). The
  // result receives come after this rank's own result sends in the list: a transport that starts
  // what is posted as one group and completes it as one (NCCL) must not hold a contribution back
  // behind a result that cannot come before it.
  static constexpr bool posts_pairs_in_order = true;

  std::string describe() const {
    return fmt::format("parameter-server(partitions={}, servers={}{}, chunk={})", partitions, servers,
                       dedicated ? " dedicated" : "", chunk_elements);
  }

  // How many ranks aggregate; throws if the placement does not fit the group.
  int server_count(const Group& group) const {
    const int n = group.size();
    if (dedicated && (servers < 1 || servers >= static_cast<std::size_t>(n)))
      throw Error(
          ErrorKind::invalid_argument, {.operation = "parameter-server placement"},
          fmt::format("{} dedicated servers in a group of {}: need at least one server and one worker", servers, n));
    return servers == 0 ? n : static_cast<int>(std::min<std::size_t>(servers, static_cast<std::size_t>(n)));
  }

  // The group index of part p's root.
  int root(const Group& group, std::size_t part) const {
    const int s = server_count(group);
    return group.size() - s + static_cast<int>(part % static_cast<std::size_t>(s));
  }

  // True on a dedicated server: this rank's own values do not enter the average.
  bool aggregates_only(const Group& group) const {
    return dedicated && group.rank >= group.size() - server_count(group);
  }

  // Ranks whose values the average covers.
  int contributors(const Group& group) const { return dedicated ? group.size() - server_count(group) : group.size(); }

  PipelineShape shape(const Group& group, std::size_t elements) const {
    const std::size_t parts = partitions == 0 ? static_cast<std::size_t>(group.size()) : partitions;
    return {.hops = group.size() > 1 ? 2 : 0,
            .fan_in = std::max(1, dedicated ? contributors(group) : group.size() - 1),
            .segment_elements = Ring::segment(elements, static_cast<int>(parts), 0).size()};
  }

  Schedule schedule(const Group& group, std::size_t elements, CodecTraits codec) const {
    Schedule out;
    const int n = group.size();
    const int first_server = n - server_count(group);
    out.contributors = contributors(group);
    const auto contributes = [&](int r) { return !dedicated || r < first_server; };
    const std::size_t parts = partitions == 0 ? static_cast<std::size_t>(n) : partitions;
    const std::size_t chunk = std::max<std::size_t>(1, chunk_elements);
    const bool identity = codec.identity;
    const auto add = [&](Step step) {
      out.steps.push_back(step);
      return static_cast<std::uint32_t>(out.steps.size() - 1);
    };
    const auto new_slot = [&](ElemRange piece, bool raw = false) {
      out.slot_elements.push_back(piece.size());
      out.slot_raw.push_back(raw);
      return static_cast<std::uint32_t>(out.slot_elements.size() - 1);
    };
    const std::size_t max_pieces = (Ring::segment(elements, static_cast<int>(parts), 0).size() + chunk - 1) / chunk;
    // Message ids: (phase 0 = contribution, 1 = result; part; piece), equal on both ends.
    const auto message = [&](int phase, std::size_t part, std::size_t piece) {
      return static_cast<std::uint32_t>((static_cast<std::size_t>(phase) * parts + part) * max_pieces + piece);
    };
    const auto for_pieces = [&](std::size_t part, auto&& f) {
      const ElemRange range = Ring::segment(elements, static_cast<int>(parts), static_cast<int>(part));
      for (std::size_t j = 0, count = (range.size() + chunk - 1) / chunk; j < count; ++j) {
        const std::size_t begin = range.begin + j * chunk;
        f(j, ElemRange{begin, std::min(range.end, begin + chunk)});
      }
    };
    if (n == 1) {  // alone: the average is the value
      for (std::size_t p = 0; p < parts; ++p)
        for_pieces(p, [&](std::size_t, ElemRange piece) { add({.op = Step::Op::average, .range = piece}); });
      return out;
    }
    // This rank's role in part p: its root, a contributor to it, or neither (another part's
    // dedicated server).
    const auto roots = [&](std::size_t p) { return group.rank == root(group, p); };
    const auto feeds = [&](std::size_t p) { return !roots(p) && contributes(group.rank); };

    // Contributions are received first, into fresh slots at the roots; encoded results after the
    // roots' own sends, below (every contribution's receive before any result's, the order each
    // peer sends in).
    std::vector<std::vector<std::uint32_t>> incoming(parts);  // per part: receive steps, in order
    for (std::size_t p = 0; p < parts; ++p) {
      if (!roots(p)) continue;
      const int root_p = root(group, p);
      for_pieces(p, [&](std::size_t j, ElemRange piece) {
        for (int s = 0; s < n; ++s)
          if (s != root_p && contributes(s))
            incoming[p].push_back(add(
                {.op = Step::Op::recv, .peer = s, .message = message(0, p, j), .range = piece, .slot = new_slot(piece)}));
      });
    }
    // Contributions leave for the roots.
    std::vector<std::vector<std::uint32_t>> sent(parts);
    for (std::size_t p = 0; p < parts; ++p) {
      if (!feeds(p)) continue;
      const int root_p = root(group, p);
      for_pieces(p, [&](std::size_t j, ElemRange piece) {
        std::uint32_t slot = no_slot;
        if (!identity) {
          slot = new_slot(piece);
          add({.op = Step::Op::encode, .range = piece, .slot = slot});
        }
        sent[p].push_back(
            add({.op = Step::Op::send, .peer = root_p, .message = message(0, p, j), .range = piece, .slot = slot}));
      });
    }
    // Roots: sum the contributions in group order, their own values (co-located) at their place
    // in it, average, and send the result to every contributor. A root other than group rank 0
    // first sets its own values aside in a raw slot. The order does not depend on which rank
    // serves a part, so an element's average has the same bits however the parts are cut (another
    // bucketing's buckets, async::Synchronizer's parts of the whole gradient).
    for (std::size_t p = 0; p < parts; ++p) {
      if (!roots(p)) continue;
      const int root_p = root(group, p);
      std::size_t next = 0;
      for_pieces(p, [&](std::size_t j, ElemRange piece) {
        bool first = true;
        std::uint32_t own = no_slot;
        if (contributes(root_p) && root_p > 0) {
          own = new_slot(piece, true);
          add({.op = Step::Op::encode, .range = piece, .slot = own});
        }
        for (int s = 0; s < n; ++s) {
          if (!contributes(s)) continue;
          if (s == root_p) {
            if (!std::exchange(first, false))  // at the start, the values are already in place
              add({.op = Step::Op::decode_add, .range = piece, .slot = own});
            continue;
          }
          const std::uint32_t recv = incoming[p][next++];
          add({.op = std::exchange(first, false) ? Step::Op::decode_copy : Step::Op::decode_add,
               .range = piece,
               .slot = out.steps[recv].slot,
               .after = recv});
        }
        add({.op = Step::Op::average, .range = piece});
        std::uint32_t slot = no_slot;
        if (!identity) {
          slot = new_slot(piece);
          add({.op = Step::Op::encode, .range = piece, .slot = slot});
          add({.op = Step::Op::decode_copy, .range = piece, .slot = slot});
        }
        for (int s = 0; s < n; ++s)
          if (s != root_p && contributes(s))
            add({.op = Step::Op::send, .peer = s, .message = message(1, p, j), .range = piece, .slot = slot});
      });
    }
    // Encoded results are received into fresh slots.
    for (std::size_t p = 0; p < parts; ++p) {
      if (!feeds(p) || identity) continue;
      for_pieces(p, [&](std::size_t j, ElemRange piece) {
        incoming[p].push_back(add({.op = Step::Op::recv,
                                   .peer = root(group, p),
                                   .message = message(1, p, j),
                                   .range = piece,
                                   .slot = new_slot(piece)}));
      });
    }
    // Contributors take the result: decoded from its slot, or received in place once their own
    // contribution has left (the identity case, where the values are the send buffer).
    for (std::size_t p = 0; p < parts; ++p) {
      if (!feeds(p)) continue;
      const int root_p = root(group, p);
      for_pieces(p, [&](std::size_t j, ElemRange piece) {
        if (identity)
          add({.op = Step::Op::recv, .peer = root_p, .message = message(1, p, j), .range = piece, .after = sent[p][j]});
        else
          add({.op = Step::Op::decode_copy,
               .range = piece,
               .slot = out.steps[incoming[p][j]].slot,
               .after = incoming[p][j]});
      });
    }
    return out;
  }
};

static_assert(PipelineTopology<ParameterServer>);

}  // namespace gradsync::topology
