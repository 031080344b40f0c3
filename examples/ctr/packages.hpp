#pragma once
// The ctr example's data: Debian's package index as `apt-cache dumpavail` prints it, one example
// per binary package. The label is the package's Section (without its "contrib/" or "non-free/"
// area); the features are hashed tokens of its other fields, in the manner of click-through-rate
// models' categorical features: what it depends on, who maintains it, its priority, its debtags,
// its architecture and the words of its description. The Package and Section fields themselves are
// never features (the label would leak into them).

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ctr {

struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The key of a feature token ("dep:libc6", "word:game"): 64-bit FNV-1a of its bytes, then
// splitmix64's finalizer so that every bit depends on every byte (FNV's low bits are weak, and
// the held-out split takes the key mod 10). Fixed here, unlike std::hash, so every rank, machine
// and build computes the same keys. Never ~0, the one key the embedding table refuses.
std::uint64_t feature_key(std::string_view token) noexcept;

// A package is held out for testing when feature_key(name) % 10 == 0: about one in ten, the
// same on every rank and in every run.
bool held_out(std::string_view package_name) noexcept;

struct Package {
  std::string name;
  std::string section;              // the label: the Section field without its area; empty if none
  std::vector<std::uint64_t> keys;  // its distinct feature keys, sorted
};

struct ParseOptions {
  std::size_t max_words = 64;  // description words taken per package
};

// Every binary package in a dumpavail text, the first stanza of each name (an index lists a
// package once per version it offers).
std::vector<Package> parse_packages(std::string_view dumpavail, const ParseOptions& options = {});

// The text of `path`, or of `apt-cache dumpavail` when `path` is empty. A DataError names the
// file that cannot be read, or says how apt-cache failed.
std::string read_dumpavail(const std::string& path);

// Examples as flat arrays: example i's features are features[offsets[i] .. offsets[i+1]), each
// an index into its Dataset's `keys`. Indexes of 32 bits, not the keys' 64, because every trainer
// holds the whole set: it is each trainer's biggest own allocation beside the machine's table.
struct Examples {
  std::vector<std::uint32_t> features;
  std::vector<std::uint32_t> offsets{0};
  std::vector<std::uint8_t> labels;  // indexes into Dataset::classes

  std::size_t count() const noexcept { return labels.size(); }
  std::span<const std::uint32_t> features_of(std::size_t i) const noexcept {
    return std::span(features).subspan(offsets[i], offsets[i + 1] - offsets[i]);
  }
};

struct Dataset {
  std::vector<std::string> classes;  // sorted by name, so every rank numbers them alike
  std::vector<std::uint64_t> keys;   // every feature key of the kept packages, sorted: feature f's is keys[f]
  Examples train, test;
  std::size_t dropped = 0;        // packages of sections too small to be a class, or of none
  std::size_t distinct_keys = 0;  // over the training examples: rows the table will need
  std::size_t max_keys = 0;       // of one example, train or test

  // Example i of `examples`' keys, written to `out` (room for max_keys); returns how many.
  std::size_t keys_of(const Examples& examples, std::size_t i, std::span<std::uint64_t> out) const noexcept {
    const auto features = examples.features_of(i);
    for (std::size_t k = 0; k < features.size(); ++k) out[k] = keys[features[k]];
    return features.size();
  }
};

// The classes are the sections of at least `min_class` packages (at most 255 of them, the
// labels being bytes); packages of the other sections are dropped. The split is held_out's.
Dataset make_dataset(const std::vector<Package>& packages, std::size_t min_class);

}  // namespace ctr
