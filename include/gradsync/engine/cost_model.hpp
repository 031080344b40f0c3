#pragma once
// engine::CostModel — selective compression (HiPress's SeCoPa, seed 001): whether compressing a
// bucket pays on this job's hardware, and into how many pieces to cut it.
//
// A short calibration at start-up fits seconds = a + b * bytes for encode and decode (by bytes of
// values) and for one transfer (by bytes on the wire); the ranks agree on the slowest rank's
// coefficients, so every rank makes the same decisions. A topology describes its pipeline by a
// PipelineShape (schedule.hpp): a piece of a segment crosses `hops` transfers in sequence, and at each a link carries
// `fan_in` pieces at once (a ring: 2(n-1) hops, fan-in 1; a parameter server: 2 hops, fan-in
// n-1). With K pieces per segment the time is a pipeline's, (hops + K - 1) stages, a stage
// taking the slower of its transfers and its compute:
//
//   uncompressed  (hops + K - 1) * fan_in * transfer(piece)
//   compressed    encode(piece) + (hops + K - 1) * max(fan_in * transfer(encoded piece),
//                                                      fan_in * decode(piece) + encode(piece))
//
// Compression is chosen when its best K beats the uncompressed best K. Small buckets, where the
// fixed costs dominate, go uncompressed.
//
// calibrate() measures the coefficients at the first synchronization; choose_schedule() makes a
// bucket's decision whenever a plan is installed.

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/concepts.hpp"
#include "gradsync/engine/control.hpp"
#include "gradsync/schedule.hpp"

namespace gradsync::engine {

struct Linear {
  double fixed = 0;     // seconds
  double per_byte = 0;  // seconds per byte

  double at(double bytes) const { return fixed + per_byte * bytes; }
};

// Least squares through (bytes, seconds) points; a negative fit is clamped to zero.
inline Linear fit(std::span<const std::pair<double, double>> points) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    n += 1;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double denominator = n * sxx - sx * sx;
  if (n == 0) return {};
  if (denominator <= 0) return {std::max(0.0, sy / n), 0};
  const double per_byte = std::max(0.0, (n * sxy - sx * sy) / denominator);
  return {std::max(0.0, (sy - per_byte * sx) / n), per_byte};
}

// Seconds `once` takes, the median of five runs.
template <class Clock, class Once>
double median_of_five(Once&& once) {
  std::array<double, 5> t{};
  for (double& s : t) {
    const auto started = Clock::now();
    once();
    s = std::chrono::duration<double>(Clock::now() - started).count();
  }
  std::sort(t.begin(), t.end());
  return t[2];
}

struct CostModel {
  Linear encode{}, decode{}, transfer{};

  std::string describe() const {
    const auto show = [](const Linear& l) {
      return fmt::format("{:.1f} us + {:.3f} GB/s", l.fixed * 1e6, l.per_byte > 0 ? 1e-9 / l.per_byte : 0.0);
    };
    return fmt::format("encode {}, decode {}, transfer {}", show(encode), show(decode), show(transfer));
  }
};

struct Decision {
  bool compress = false;
  std::size_t pieces = 1;  // per segment
  double predicted = 0;    // seconds, for the choice made
  double uncompressed = 0; // seconds, for the best uncompressed K
};

// `encoded_bytes(elements)` is the codec's size for that many values; `value_bytes` the size of
// one value in the accumulation dtype; at most `max_pieces` pieces per segment.
template <class EncodedBytes>
Decision decide(const CostModel& model, const PipelineShape& shape, std::size_t value_bytes, EncodedBytes encoded_bytes,
                std::size_t max_pieces = 64) {
  Decision best{.compress = false, .pieces = 1, .predicted = 0, .uncompressed = 0};
  if (shape.hops == 0 || shape.segment_elements == 0) return best;
  const double fan = shape.fan_in;
  double best_plain = -1, best_compressed = -1;
  std::size_t plain_pieces = 1, compressed_pieces = 1;
  for (std::size_t k = 1; k <= max_pieces && k <= shape.segment_elements; k *= 2) {
    const std::size_t piece = (shape.segment_elements + k - 1) / k;
    const double stages = static_cast<double>(shape.hops) + static_cast<double>(k) - 1;
    const double bytes = static_cast<double>(piece * value_bytes);
    const double plain = stages * fan * model.transfer.at(bytes);
    const double encode = model.encode.at(bytes);
    const double stage = std::max(fan * model.transfer.at(static_cast<double>(encoded_bytes(piece))),
                                  fan * model.decode.at(bytes) + encode);
    const double compressed = encode + stages * stage;
    if (best_plain < 0 || plain < best_plain) best_plain = plain, plain_pieces = k;
    if (best_compressed < 0 || compressed < best_compressed) best_compressed = compressed, compressed_pieces = k;
  }
  best.uncompressed = best_plain;
  if (best_compressed < best_plain) {
    best.compress = true;
    best.pieces = compressed_pieces;
    best.predicted = best_compressed;
  } else {
    best.pieces = plain_pieces;
    best.predicted = best_plain;
  }
  return best;
}

// Times a transfer to the right neighbour of the ring (receiving from the left) at three sizes,
// five times each (the median counts), probe k as control message `probes` + k, and fits
// a + b * bytes: this rank's figures, not yet agreed.
template <TransportPolicy X>
Linear measure_transfer(ControlChannel<X>& control, ControlMessage probes) {
  using Clock = std::chrono::steady_clock;
  const Group& group = control.group();
  const int left = (group.rank + group.size() - 1) % group.size(), right = (group.rank + 1) % group.size();
  std::uint32_t probe = 0;
  std::vector<std::pair<double, double>> points;
  for (std::size_t bytes : {std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 21})
    points.emplace_back(static_cast<double>(bytes), median_of_five<Clock>([&] {
      control.probe(right, left, control_tag(0, probes, probe++), bytes);
    }));
  return fit(points);
}

// Every rank's figures to group rank 0, which sends back the largest of each: the slowest rank's
// figures, the same on every rank, in `mine`. `iteration` numbers the agreement where one kind
// is made more than once (engine::ScheduleTuner's).
template <TransportPolicy X>
void agree_on_slowest(ControlChannel<X>& control, std::uint64_t iteration, ControlMessage m, std::span<double> mine,
                      const char* operation) {
  const Group& group = control.group();
  const std::size_t bytes = mine.size_bytes();
  const auto as_text = [&] { return std::string_view(reinterpret_cast<const char*>(mine.data()), bytes); };
  const auto check = [&](std::string_view text, int peer) {
    if (text.size() != bytes)
      throw Error(ErrorKind::protocol,
                  {.rank = group.members[group.rank], .peer = group.members[peer], .operation = operation},
                  fmt::format("{} message of {} bytes, expected {}", operation, text.size(), bytes));
  };
  control.gather(iteration, m, as_text(), [&](int peer, std::string_view text) {
    check(text, peer);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      double theirs;
      std::memcpy(&theirs, text.data() + i * sizeof(double), sizeof theirs);
      mine[i] = std::max(mine[i], theirs);
    }
  });
  const std::string_view agreed = control.broadcast(iteration, m, as_text());
  check(agreed, 0);
  std::memcpy(mine.data(), agreed.data(), bytes);
}

template <TransportPolicy X, std::size_t N>
std::array<double, N> agree_on_slowest(ControlChannel<X>& control, ControlMessage m, std::array<double, N> mine,
                                       const char* operation) {
  agree_on_slowest(control, 0, m, std::span<double>(mine), operation);
  return mine;
}

// Times encode and decode here at three sizes, five times each, and a transfer
// (measure_transfer); fits a + b * bytes; and returns the slowest rank's coefficients, the same on
// every rank. Takes a few hundred milliseconds, once.
template <CompressionPolicy C, TransportPolicy X>
CostModel calibrate(const C& codec, ControlChannel<X>& control) {
  using Clock = std::chrono::steady_clock;
  constexpr std::array<std::size_t, 3> value_counts{std::size_t{1} << 14, std::size_t{1} << 17, std::size_t{1} << 20};
  std::vector<float> values(value_counts.back()), out(value_counts.back());
  for (std::size_t i = 0; i < values.size(); ++i)
    values[i] = static_cast<float>(static_cast<int>((i * 2654435761u) % 2001u) - 1000) * 1e-3f;
  std::vector<std::byte> encoded(codec.max_encoded_bytes(values.size(), DType::f32));
  std::vector<std::pair<double, double>> encode_points, decode_points;
  for (std::size_t n : value_counts) {
    auto state = codec.make_state(n, DType::f32);
    const std::span<const float> in(values.data(), n);
    std::size_t used = 0;
    const double bytes = static_cast<double>(n * sizeof(float));
    encode_points.emplace_back(bytes, median_of_five<Clock>([&] { used = codec.encode(in, state, encoded); }));
    decode_points.emplace_back(bytes, median_of_five<Clock>([&] {
      codec.decode(std::span<const std::byte>(encoded.data(), used), std::span<float>(out.data(), n), DecodeMode::add);
    }));
  }
  const Linear fitted[3] = {fit(encode_points), fit(decode_points),
                            measure_transfer(control, ControlMessage::calibration_probe)};
  std::array<double, 6> agreed{};
  for (int i = 0; i < 3; ++i) agreed[2 * i] = fitted[i].fixed, agreed[2 * i + 1] = fitted[i].per_byte;
  agreed = agree_on_slowest(control, ControlMessage::calibration, agreed, "calibration");
  return {{agreed[0], agreed[1]}, {agreed[2], agreed[3]}, {agreed[4], agreed[5]}};
}

// Who a rank exchanges with in one round of a timed series: it sends to group rank `to` while
// receiving as much from group rank `from`; a rank with no part in the round has none.
struct RoundPartners {
  int to = -1, from = -1;
  bool none() const noexcept { return to < 0; }
};

// `rounds` rounds of exchanges of `bytes`, round k with partners(k), timed as a schedule meets its
// rounds: one after another, every rank at once, so that each rank's time holds the waits for the
// others a schedule also holds. Seconds a round, the median of five runs; 0 for a rank with no
// part. Run r of the series takes tags sequence `first_run` + r, id link_probe + round.
template <TransportPolicy X, class Partners>
double time_rounds(ControlChannel<X>& control, std::size_t bytes, int rounds, std::uint32_t first_run, Partners&& partners) {
  using Clock = std::chrono::steady_clock;
  if (rounds == 0 || partners(0).none()) return 0;
  std::uint32_t run = 0;
  return median_of_five<Clock>([&] {
    for (int k = 0; k < rounds; ++k) {
      const RoundPartners p = partners(k);
      control.probe(p.to, p.from, control_tag(first_run + run, ControlMessage::link_probe, static_cast<std::uint32_t>(k)), bytes);
    }
    ++run;
  }) / rounds;
}

// A link fitted to `rounds` rounds with `partners` timed at 4 KiB, 64 KiB and 1 MiB: this rank's
// figures, not yet agreed. Its runs take tag sequences `first_run` .. `first_run` + 14.
template <TransportPolicy X, class Partners>
Linear fit_rounds(ControlChannel<X>& control, int rounds, std::uint32_t first_run, Partners&& partners) {
  std::vector<std::pair<double, double>> points;
  for (std::size_t bytes : {std::size_t{1} << 12, std::size_t{1} << 16, std::size_t{1} << 20}) {
    points.emplace_back(static_cast<double>(bytes), time_rounds(control, bytes, rounds, first_run, partners));
    first_run += 5;
  }
  return fit(points);
}

// The butterfly's rounds (recursive doubling's partners: v ^ 2^k) over `count` participants
// numbered by `index(v)`, this rank being participant `v`; the first 2^floor(log2 count) take part.
inline int butterfly_rounds(int count) { return std::countr_zero(std::bit_floor(static_cast<unsigned>(count))); }
template <class Index>
auto butterfly(int count, int v, Index index) {
  const int participants = static_cast<int>(std::bit_floor(static_cast<unsigned>(count)));
  return [=](int k) {
    if (v >= participants) return RoundPartners{};
    const int partner = index(v ^ (1 << k));
    return RoundPartners{partner, partner};
  };
}

// The link between this group's ranks, as topology::Auto predicts with it (LinkModel): a round of
// the butterfly timed (time_rounds) and agreed on the slowest rank's figures. Once, at the first
// synchronization: 15 runs of log2(n) rounds. Rounds, not one exchange at a time: on a machine
// whose ranks wait for cores, a single exchange with the ring neighbour measured 5-7x the latency
// a round of a schedule paid (bench/README.md, "many ranks"), and Auto took recursive doubling
// where halving-doubling was twice as fast.
template <TransportPolicy X>
LinkModel calibrate_link(ControlChannel<X>& control) {
  const Group& group = control.group();
  const Linear measured =
      fit_rounds(control, butterfly_rounds(group.size()), 0, butterfly(group.size(), group.rank, [](int v) { return v; }));
  const auto agreed = agree_on_slowest(control, ControlMessage::link, std::array<double, 2>{measured.fixed, measured.per_byte},
                                       "link calibration");
  return {.latency = agreed[0], .seconds_per_byte = agreed[1]};
}

// The two links of a group of whole machines (topology::Hierarchical): between ranks of one
// machine, and between machines.
struct MachineLinks {
  LinkModel within, across;
};

// calibrate_link per level, for a group numbered machine-major in machines of `ranks_per_machine`
// (a whole number of them: the topology has checked), each level timed as its schedules run:
// within a machine the ring's hops (L - 1 of them, to the next local rank while receiving from
// the one before), across machines the butterfly's rounds among the ranks of one local rank, every
// rank at once, so that the figures across are those of a machine's link shared by its L ranks.
// A level the group lacks (one machine, or one rank a machine) is not timed and takes the other's
// figures. The slowest rank's figures of each level, the same on every rank.
template <TransportPolicy X>
MachineLinks calibrate_machine_links(ControlChannel<X>& control, int ranks_per_machine) {
  const Group& group = control.group();
  const int local_count = ranks_per_machine, machine_count = group.size() / ranks_per_machine;
  const int machine = group.rank / local_count, local = group.rank % local_count;
  const auto at = [=](int m, int l) { return m * local_count + (l + local_count) % local_count; };
  Linear within{}, across{};
  if (local_count > 1)
    within = fit_rounds(control, local_count - 1, 0, [&](int) { return RoundPartners{at(machine, local + 1), at(machine, local - 1)}; });
  if (machine_count > 1)
    across = fit_rounds(control, butterfly_rounds(machine_count), 15,
                        butterfly(machine_count, machine, [&](int m) { return at(m, local); }));
  if (local_count == 1) within = across;
  if (machine_count == 1) across = within;
  const auto agreed = agree_on_slowest(control, ControlMessage::link,
                                       std::array<double, 4>{within.fixed, within.per_byte, across.fixed, across.per_byte},
                                       "link calibration");
  return {.within = {.latency = agreed[0], .seconds_per_byte = agreed[1]},
          .across = {.latency = agreed[2], .seconds_per_byte = agreed[3]}};
}

// topology::Auto and its kind choose per bucket by the link's costs: measures them (per level for
// a topology of machines) into `topology`, the same on every rank, and says what it measured, for
// the log. Call from every rank of the control channel's group at once.
template <LinkAwareTopology T, TransportPolicy X>
std::string measure_links(T& topology, ControlChannel<X>& control) {
  const auto describe = [](const LinkModel& link) {
    return fmt::format("{:.1f} us + {:.3f} GB/s", link.latency * 1e6,
                       link.seconds_per_byte > 0 ? 1e-9 / link.seconds_per_byte : 0.0);
  };
  if constexpr (MachineLinkTopology<T>) {
    // A group that is not whole machines is told so here, before any probe.
    if (const int per_machine = topology.measured_ranks_per_machine(control.group()); per_machine > 0) {
      const MachineLinks measured = calibrate_machine_links(control, per_machine);
      topology.take_links(measured.within, measured.across);
      return fmt::format("links {} within a machine, {} across", describe(measured.within), describe(measured.across));
    }
  }
  topology.link = calibrate_link(control);
  return fmt::format("link {}", describe(topology.link));
}

// A bucket's schedule as selective compression chooses it: compressed or not, its segments cut
// into the predicted best number of pieces; `explanation` says what was chosen and why, for the log.
struct ChosenSchedule {
  Schedule schedule{};
  bool compressed = false;
  std::string explanation{};
};

template <CompressionPolicy C, PipelineTopology T>
ChosenSchedule choose_schedule(const CostModel& costs, const C& codec, T topology, const Group& group,
                               std::size_t elements, DType dtype) {
  const PipelineShape shape = topology.shape(group, elements);
  const Decision d = decide(costs, shape, size_of(dtype), [&](std::size_t e) { return codec.max_encoded_bytes(e, dtype); });
  topology.chunk_elements = std::max<std::size_t>(1, (shape.segment_elements + d.pieces - 1) / d.pieces);
  return {topology.schedule(group, elements, d.compress ? codec_traits<C>() : CodecTraits{.identity = true}),
          d.compress,
          fmt::format("{:.2f} MB {}, {} piece{} per segment, predicted {:.2f} ms ({:.2f} ms uncompressed)",
                      static_cast<double>(elements * size_of(dtype)) / 1e6, d.compress ? "compressed" : "uncompressed",
                      d.pieces, d.pieces == 1 ? "" : "s", d.predicted * 1e3, d.uncompressed * 1e3)};
}

}  // namespace gradsync::engine
