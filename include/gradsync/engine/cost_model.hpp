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

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include <fmt/format.h>

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

struct CostModel {
  Linear encode, decode, transfer;

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

}  // namespace gradsync::engine
