#pragma once
// The arithmetic of bench/scale_model, apart from its options and printing so that
// tests/test_scale_model.cpp can check it.
//
// An allreduce's time comes from the library's own cost model: predicted_seconds of topology::Ring,
// RecursiveDoubling and HalvingDoubling (what topology::Auto chooses with), never a copy of their
// formulas. What the library does not model is written here, each piece small and with its
// reasoning: where the ranks sit on machines (several ranks share one machine's network link), a
// codec's compute on the ring, transport::Tcp's rendezvous, and a traced model's buckets
// overlapped with its backward pass. topology::Hierarchical predicts its own phases.

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/bucketing/fixed_size.hpp"
#include "gradsync/schedule.hpp"
#include "gradsync/topology/halving_doubling.hpp"
#include "gradsync/topology/hierarchical.hpp"
#include "gradsync/topology/recursive_doubling.hpp"
#include "gradsync/topology/ring.hpp"
#include "trace.hpp"

namespace gradsync_bench::scale {

using gradsync::Group;
using gradsync::LinkModel;
namespace topology = gradsync::topology;

// "25Gbit/s", "800Mbit/s", "3.125GB/s", "100MB/s" (the "/s" may be left out; G and M are 1e9 and
// 1e6): the seconds one byte takes. Throws std::invalid_argument for anything else.
inline double seconds_per_byte(std::string_view bandwidth) {
  double value = 0;
  const auto [end, error] = std::from_chars(bandwidth.data(), bandwidth.data() + bandwidth.size(), value);
  std::string_view unit(end, static_cast<std::size_t>(bandwidth.data() + bandwidth.size() - end));
  if (unit.ends_with("/s")) unit.remove_suffix(2);
  const double bytes_per_unit = unit == "Gbit" ? 1e9 / 8 : unit == "Mbit" ? 1e6 / 8 : unit == "GB" ? 1e9 : unit == "MB" ? 1e6 : 0;
  if (error != std::errc{} || !std::isfinite(value) || value <= 0 || bytes_per_unit == 0)
    throw std::invalid_argument("'" + std::string(bandwidth) + "' is not a bandwidth such as 25Gbit/s or 3.1GB/s");
  return 1 / (value * bytes_per_unit);
}

// The machines: `link` between two ranks on different machines, `intra` between two on one
// (shared memory), each one message's cost as LinkModel has it; `ranks_per_machine` ranks share a
// machine's network link. Ranks are numbered machine-major, as every launcher numbers them.
struct Cluster {
  LinkModel link{};
  LinkModel intra{};
  int ranks_per_machine = 1;

  int machines(int ranks) const { return ranks / ranks_per_machine; }
};

// A link that `sharing` ranks of a machine cross at the same time: each gets 1/sharing of it.
inline LinkModel shared(LinkModel link, int sharing) {
  link.seconds_per_byte *= sharing;
  return link;
}

inline constexpr std::size_t value_bytes = sizeof(float);

// The largest of `parts` near-equal parts of `elements` (Ring::segment's split).
inline std::size_t ceil_div(std::size_t elements, int parts) {
  return (elements + static_cast<std::size_t>(parts) - 1) / static_cast<std::size_t>(parts);
}

// The ring's time: in each of its 2(n-1) steps one rank per machine sends to the next machine
// (ranks are machine-major), the others within their machine, and the step lasts as long as its
// slowest hop, the one between machines: Ring's own prediction over that link.
inline double ring_seconds(const Cluster& c, int ranks, std::size_t elements) {
  const LinkModel& slowest = c.machines(ranks) > 1 ? c.link : c.intra;
  return topology::Ring{}.predicted_seconds(Group::world(0, ranks), elements, value_bytes, slowest);
}

// Recursive doubling's rounds at distances below ranks_per_machine stay within a machine; those at
// and above it cross machines, all of a machine's ranks at once, each exchanging the whole bucket:
// the library's prediction over the machine's ranks and the shared-memory link, plus its prediction
// over the machines and the network link shared by all the machine's ranks. Exact in rounds and
// bytes where both counts are powers of two; otherwise each level folds on its own, which the
// schedule, folding once over the whole group, does not quite do.
inline double recursive_doubling_seconds(const Cluster& c, int ranks, std::size_t elements) {
  const topology::RecursiveDoubling rd;
  return rd.predicted_seconds(Group::world(0, c.ranks_per_machine), elements, value_bytes, c.intra) +
         rd.predicted_seconds(Group::world(0, c.machines(ranks)), elements, value_bytes,
                              shared(c.link, c.ranks_per_machine));
}

// Halving-doubling halves with the nearest partners first (halving_doubling.hpp): its first
// log2(ranks_per_machine) rounds run within the machine on the whole bucket, the rest cross
// machines (all of a machine's ranks at once) on the 1/ranks_per_machine of it each rank still
// reduces; the allgather mirrors them.
inline double halving_doubling_seconds(const Cluster& c, int ranks, std::size_t elements) {
  const topology::HalvingDoubling hd;
  return hd.predicted_seconds(Group::world(0, c.ranks_per_machine), elements, value_bytes, c.intra) +
         hd.predicted_seconds(Group::world(0, c.machines(ranks)), ceil_div(elements, c.ranks_per_machine), value_bytes,
                              shared(c.link, c.ranks_per_machine));
}

// topology::Hierarchical's own prediction (Hierarchical::predicted) with the schedule across
// machines it would choose: its phases within a machine over the machine's link, those across over
// the network link shared by the machine's ranks (local rank i carries shard i across, all of them
// at once).
inline double hierarchical_seconds(const Cluster& c, int ranks, std::size_t elements) {
  const topology::Hierarchical hierarchical{.ranks_per_machine = c.ranks_per_machine,
                                            .link = c.intra,
                                            .link_across = shared(c.link, c.ranks_per_machine),
                                            .measure_link = false};
  const Group group = Group::world(0, ranks);
  return hierarchical.predicted(group, elements, hierarchical.choice_for(group, elements));
}

// A codec as the model needs it: its wire size for a piece of n f32 values (the codec's own
// max_encoded_bytes) and its measured throughput, seconds per byte of f32 values.
struct CodecCost {
  std::string name;
  std::function<std::size_t(std::size_t)> encoded_bytes;
  double encode_seconds_per_byte = 0;
  double decode_seconds_per_byte = 0;
};

// The ring carrying a codec (ring.hpp): every hop moves a segment's encoded pieces. The transfers
// are Ring's prediction with bytes counted as its elements: a segment of pieces' encodings, cut at
// one encoded piece. Each rank also encodes n segments (its own, n - 2 partial sums, its finished
// one) and decodes 2n - 1 (n - 1 arrivals to add, its own encoding, n - 1 finished segments), all
// on the ring's critical path. With K pieces a segment, transfers and compute overlap as a
// two-stage pipeline: the slower of them plus 1/K of the other; with one piece nothing overlaps.
inline double compressed_ring_seconds(const Cluster& c, int ranks, std::size_t elements, const CodecCost& codec) {
  if (ranks == 1 || elements == 0) return 0;
  const std::size_t segment = (elements + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
  const std::size_t chunk = topology::Ring{}.chunk_elements;
  const std::size_t pieces = (segment + chunk - 1) / chunk, piece = (segment + pieces - 1) / pieces;
  const std::size_t piece_wire = codec.encoded_bytes(piece);
  const LinkModel& slowest = c.machines(ranks) > 1 ? c.link : c.intra;
  const double transfers = topology::Ring{.chunk_elements = piece_wire}.predicted_seconds(
      Group::world(0, ranks), static_cast<std::size_t>(ranks) * pieces * piece_wire, 1, slowest);
  const double segment_bytes = static_cast<double>(segment * value_bytes);
  const double compute = segment_bytes * (ranks * codec.encode_seconds_per_byte + (2.0 * ranks - 1) * codec.decode_seconds_per_byte);
  return std::max(transfers, compute) + std::min(transfers, compute) / static_cast<double>(pieces);
}

// The schedules the model compares, by the names bench/allreduce's JSON gives them.
inline const std::vector<std::string> schedule_names{"ring", "recursive-doubling", "halving-doubling", "auto",
                                                      "hierarchical", "compressed"};

// Seconds for one allreduce of `elements` f32 values at `ranks` ranks by `schedule`. "auto" is
// topology::Auto's choice, the fastest of the three flat schedules (with one rank a machine, or all
// on one machine, exactly Auto::predicted_seconds); "compressed" is the ring carrying `codec`.
inline double allreduce_seconds(const std::string& schedule, const Cluster& c, int ranks, std::size_t elements,
                                const CodecCost& codec) {
  if (schedule == "ring") return ring_seconds(c, ranks, elements);
  if (schedule == "recursive-doubling") return recursive_doubling_seconds(c, ranks, elements);
  if (schedule == "halving-doubling") return halving_doubling_seconds(c, ranks, elements);
  if (schedule == "auto")
    return std::min({ring_seconds(c, ranks, elements), recursive_doubling_seconds(c, ranks, elements),
                     halving_doubling_seconds(c, ranks, elements)});
  if (schedule == "hierarchical") return hierarchical_seconds(c, ranks, elements);
  if (schedule == "compressed") return compressed_ring_seconds(c, ranks, elements, codec);
  throw std::invalid_argument("no model for the schedule '" + schedule + "'");
}

// ---- fitting a link to measurements --------------------------------------------------------------

// A flat schedule's predicted time is latency * latency_terms + seconds_per_byte * byte_terms
// (each library formula is linear in the two); `measured` is what a run took, in seconds.
struct LinkTerms {
  double latency_terms = 0;
  double byte_terms = 0;
  double measured = 0;
};

// The link that predicts `rows` best in relative terms: least squares of predicted / measured - 1
// over (latency, seconds per byte), both kept at 0 or above (where the pair would take one below,
// the better of either alone). Needs two rows or more.
inline std::optional<LinkModel> fit_link(const std::vector<LinkTerms>& rows) {
  if (rows.size() < 2) return std::nullopt;
  double uu = 0, uv = 0, vv = 0, u1 = 0, v1 = 0;
  for (const LinkTerms& r : rows) {
    const double u = r.latency_terms / r.measured, v = r.byte_terms / r.measured;
    uu += u * u, uv += u * v, vv += v * v, u1 += u, v1 += v;
  }
  const double det = uu * vv - uv * uv;
  if (det > 1e-12 * uu * vv) {
    const double latency = (u1 * vv - v1 * uv) / det, per_byte = (v1 * uu - u1 * uv) / det;
    if (latency >= 0 && per_byte >= 0) return LinkModel{.latency = latency, .seconds_per_byte = per_byte};
  }
  const double latency = uu > 0 ? u1 / uu : 0, per_byte = vv > 0 ? v1 / vv : 0;
  const auto n = static_cast<double>(rows.size());
  const double residual_latency = n - latency * u1, residual_bytes = n - per_byte * v1;  // at each optimum
  return residual_latency <= residual_bytes ? LinkModel{.latency = latency, .seconds_per_byte = 0}
                                            : LinkModel{.latency = 0, .seconds_per_byte = per_byte};
}

// Which of the three Auto would take: the name of the fastest.
inline std::string auto_choice(const Cluster& c, int ranks, std::size_t elements) {
  const double rd = recursive_doubling_seconds(c, ranks, elements), hd = halving_doubling_seconds(c, ranks, elements);
  const double ring = ring_seconds(c, ranks, elements);
  if (rd <= hd && rd <= ring) return "recursive-doubling";
  return hd <= ring ? "halving-doubling" : "ring";
}

// ---- transport::Tcp's rendezvous (src/transport/tcp/connector.cpp) -------------------------------

// What the rendezvous costs beyond the link. `report_cpu` is rank 0's CPU for one report on its
// one thread (accept, about ten small socket calls, two HMAC-SHA-256, a hello's 16 random bytes,
// the address checks and the acknowledgement); an estimate until bench/setup's JSONs calibrate it.
// `local_report_cpu` is a parent's within a machine (accept on a local socket, a peer-credential
// check, one frame and its acknowledgement: no handshake); an estimate too.
// `max_handshakes` is connector.cpp's limit on handshakes side by side; `listen_backlog` the
// kernel's accept queue (asio's max_listen_connections, SOMAXCONN: 4096 since Linux 5.4 and glibc
// 2.35): a rank whose SYN finds it full waits for the SYN's retransmission, `syn_retry` (Linux's
// initial RTO) later. A table line is "host port\n", at most 22 bytes for IPv4; a report's line has
// the rank before it.
struct SetupCosts {
  double report_cpu = 50e-6;
  double local_report_cpu = 10e-6;
  int max_handshakes = 64;
  int listen_backlog = 4096;
  double syn_retry = 1.0;
  std::size_t table_line_bytes = 22;
};

struct SetupTime {
  double machine = 0;     // seconds until each machine's local rank 0 holds its machine's addresses
  double reports = 0;     // seconds until rank 0 holds every address (from the start)
  double tree = 0;        // seconds for the table to reach the deepest rank of the tree
  double rank0_cpu = 0;   // of `reports`, rank 0's CPU alone
  std::size_t table_bytes = 0;  // the table's frame, which every rank receives and keeps
  int levels = 0;               // of the tree
  int machine_levels = 0;       // of the tree within a machine

  double total() const { return reports + tree; }
};

// One connection's handshake: the connect's round trip, then hellos crossing and proofs crossing
// (each side writes before it reads, so each pair crosses in one latency): four latencies.
inline double handshake_seconds(const LinkModel& link) { return 4 * link.latency; }

// The rendezvous of `ranks` ranks on c's machines: each machine's ranks gather their lines up a
// binomial tree within it, then its local rank 0 reports to rank 0 (rank 0's machine needs no
// report), then the table goes down a binomial tree over all ranks.
inline SetupTime setup_seconds(int ranks, const Cluster& c, const SetupCosts& costs) {
  const LinkModel& link = c.link;
  SetupTime t;
  t.table_bytes = 24 + static_cast<std::size_t>(ranks) * costs.table_line_bytes;  // frame header + lines
  if (ranks == 1) return t;
  // Within a machine: per level a local connect's round trip, the frame and its acknowledgement,
  // the frame growing to half the machine's lines at the last level.
  const int local = std::min(c.ranks_per_machine, ranks);
  const double line_bytes = static_cast<double>(costs.table_line_bytes + 6);
  t.machine_levels = std::bit_width(static_cast<unsigned>(local - 1));
  t.machine = t.machine_levels * (3 * c.intra.latency + costs.local_report_cpu) +
              line_bytes * local * c.intra.seconds_per_byte;
  const int reporters = ranks / local - 1;
  if (reporters == 0) {
    t.reports = t.machine;
  } else {
    // A report: a handshake, the address frame (the machine's lines) and its acknowledgement (one
    // more round trip).
    const double report = handshake_seconds(link) + 2 * link.latency + line_bytes * local * link.seconds_per_byte;
    // Rank 0 serves the reports on one thread, each its report_cpu, at most max_handshakes in the
    // network at once; those that found the accept queue full come back after a SYN retransmission.
    t.rank0_cpu = reporters * costs.report_cpu;
    const double side_by_side = std::ceil(static_cast<double>(reporters) / costs.max_handshakes) * report;
    // Dialing at once, the machines fill the accept queue long before rank 0 drains it: the kernel
    // drops the SYNs beyond it, and their senders retry after 1, 2, 4... x syn_retry (exponential
    // backoff), each retry wave meeting a queue rank 0 has emptied meanwhile (it takes
    // listen_backlog x report_cpu). The last wave starts at (2^w - 1) x syn_retry and rank 0 serves
    // it after that.
    const int last_wave = (reporters - 1) / costs.listen_backlog;
    const double last_served = costs.syn_retry * (std::exp2(last_wave) - 1) +
                               (reporters - last_wave * costs.listen_backlog) * costs.report_cpu;
    t.reports = t.machine + report + std::max({t.rank0_cpu, side_by_side, last_served});
  }
  // The binomial tree: ceil(log2 n) levels, each a handshake, the CPU of one, and the table frame,
  // which a parent sends to all its children at once over its one link: on the deepest path the
  // parent at level d has levels - d children, so the link carries the table levels(levels+1)/2
  // times along it.
  t.levels = std::bit_width(static_cast<unsigned>(ranks - 1));
  const double table = static_cast<double>(t.table_bytes) * link.seconds_per_byte;
  t.tree = t.levels * (handshake_seconds(link) + link.latency + costs.report_cpu) +
           table * t.levels * (t.levels + 1) / 2.0;
  return t;
}

// ---- a traced model's iteration ----------------------------------------------------------------

// A bucket of a traced backward pass: its f32 elements and when its last gradient is ready.
struct TracedBucket {
  std::size_t elements = 0;
  double ready = 0;  // seconds from the start of backward
};

// The trace's tensors packed as bucketing::FixedSize packs them (PyTorch DDP's caps: the first
// bucket 1 MiB, the others `cap_bytes`) in backward order, the trace's order; a bucket is ready
// when its last tensor is.
inline std::vector<TracedBucket> trace_buckets(const std::vector<TraceEntry>& trace, std::size_t cap_bytes) {
  gradsync::Layout layout;
  std::vector<gradsync::GradId> order;
  std::vector<double> ready;
  double clock = 0;
  for (const TraceEntry& e : trace) {
    clock += e.compute_us * 1e-6;
    order.push_back(static_cast<gradsync::GradId>(layout.size()));
    layout.push_back({.name = e.name, .count = e.count});
    ready.push_back(clock);
  }
  const gradsync::bucketing::FixedSize policy{.cap_bytes = cap_bytes,
                                              .first_cap_bytes = std::min(cap_bytes, gradsync::bucketing::FixedSize{}.first_cap_bytes)};
  std::vector<TracedBucket> buckets;
  for (const auto& ids : policy.pack(layout, order).buckets) {
    TracedBucket b;
    for (const gradsync::GradId id : ids) {
      b.elements += layout[id].count;
      b.ready = std::max(b.ready, ready[id]);
    }
    buckets.push_back(b);
  }
  return buckets;
}

struct Iteration {
  double backward = 0;  // seconds of backward compute
  double total = 0;     // backward plus the communication left after it
  double exposed() const { return total - backward; }
};

// Buckets go onto the network one at a time, in the order they become ready, each as soon as it
// is ready and the one before has finished (a bucket's allreduce uses every rank's link); backward
// goes on meanwhile. The iteration ends when backward and the last bucket are both done.
inline Iteration overlap(const std::vector<TracedBucket>& buckets, double backward,
                         const std::function<double(std::size_t)>& allreduce) {
  double link_free = 0;
  for (const TracedBucket& b : buckets) link_free = std::max(b.ready, link_free) + allreduce(b.elements);
  return {.backward = backward, .total = std::max(backward, link_free)};
}

}  // namespace gradsync_bench::scale
