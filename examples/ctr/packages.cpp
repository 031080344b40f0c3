#include "packages.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_set>

#include <sys/wait.h>

#include <fmt/format.h>

namespace ctr {

std::uint64_t feature_key(std::string_view token) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a offset basis and prime
  for (const char c : token) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  h ^= h >> 30;  // splitmix64's finalizer
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h == ~std::uint64_t{0} ? h - 1 : h;
}

bool held_out(std::string_view package_name) noexcept { return feature_key(package_name) % 10 == 0; }

namespace {

constexpr bool is_blank(char c) noexcept { return c == ' ' || c == '\t' || c == '\r'; }

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

char lower(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }
bool alphanumeric(char c) noexcept { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

// The fields the features and label come from, each with its continuation lines joined by '\n'.
struct Stanza {
  std::string package, section, priority, maintainer, depends, recommends, tag, description, architecture;

  std::string* field(std::string_view name) {
    if (name == "Package") return &package;
    if (name == "Section") return &section;
    if (name == "Priority") return &priority;
    if (name == "Maintainer") return &maintainer;
    if (name == "Depends") return &depends;
    if (name == "Recommends") return &recommends;
    if (name == "Tag") return &tag;
    if (name == "Description") return &description;
    if (name == "Architecture") return &architecture;
    return nullptr;
  }
};

// Calls f(piece) for every piece of `list` between separators, trimmed, empty ones skipped.
template <class F>
void for_each_piece(std::string_view list, std::string_view separators, F&& f) {
  while (!list.empty()) {
    const std::size_t end = std::min(list.find_first_of(separators), list.size());
    if (const std::string_view piece = trim(list.substr(0, end)); !piece.empty()) f(piece);
    list.remove_prefix(std::min(end + 1, list.size()));
  }
}

class Features {
 public:
  void add(std::string_view prefix, std::string_view value) {
    token_.assign(prefix);
    for (const char c : value) token_.push_back(lower(c));
    keys_.push_back(feature_key(token_));
  }
  // Sorted and distinct: a token said twice (a dependency in Depends and Recommends) counts once.
  std::vector<std::uint64_t> take() {
    std::sort(keys_.begin(), keys_.end());
    keys_.erase(std::unique(keys_.begin(), keys_.end()), keys_.end());
    return std::move(keys_);
  }

 private:
  std::string token_;
  std::vector<std::uint64_t> keys_;
};

// Depends and Recommends: "a (>= 1), b | c:any [amd64] <!nocheck>" names a, b and c; each
// alternative counts as a dependency of its own.
void add_dependencies(Features& features, std::string_view field) {
  for_each_piece(field, ",|\n", [&](std::string_view relation) {
    const std::size_t end = relation.find_first_of(" \t:([<");
    features.add("dep:", relation.substr(0, end));
  });
}

// "Name <address>": the address says who more reliably than the name's spelling; a bare name
// where there is no address.
void add_maintainer(Features& features, std::string_view field) {
  const std::size_t open = field.find('<');
  const std::size_t close = field.find('>', open);
  if (open != std::string_view::npos && close != std::string_view::npos && close > open + 1)
    features.add("maint:", field.substr(open + 1, close - open - 1));
  else if (!trim(field).empty())
    features.add("maint:", trim(field));
}

// Debtags: "facet::value" each. No facet names the Section, so none is dropped; the tags that
// follow a section most closely describe the package as its description does (on this index,
// role::debug-symbols: 99% of its packages in debug, devel::lang:perl: 97% in perl), and that
// is what the model should learn from.
void add_tags(Features& features, std::string_view field) {
  for_each_piece(field, ",\n", [&](std::string_view tag) { features.add("tag:", tag); });
}

// The synopsis and the long description's lines (a lone "." is a paragraph break), as lowercased
// ASCII alphanumeric words, the first `max_words` of them.
void add_words(Features& features, std::string_view text, std::size_t max_words) {
  std::size_t words = 0;
  std::size_t i = 0;
  while (i < text.size() && words < max_words) {
    if (!alphanumeric(text[i])) {
      ++i;
      continue;
    }
    const std::size_t start = i;
    while (i < text.size() && alphanumeric(text[i])) ++i;
    features.add("word:", text.substr(start, i - start));
    ++words;
  }
}

Package to_package(const Stanza& s, const ParseOptions& options) {
  Features features;
  add_dependencies(features, s.depends);
  add_dependencies(features, s.recommends);
  add_maintainer(features, s.maintainer);
  if (!s.priority.empty()) features.add("prio:", s.priority);
  add_tags(features, s.tag);
  add_words(features, s.description, options.max_words);
  if (!s.architecture.empty()) features.add("arch:", s.architecture);
  const std::string_view section = s.section;
  const std::size_t slash = section.rfind('/');
  return {.name = s.package,
          .section = std::string(slash == std::string_view::npos ? section : section.substr(slash + 1)),
          .keys = features.take()};
}

}  // namespace

std::vector<Package> parse_packages(std::string_view text, const ParseOptions& options) {
  std::vector<Package> packages;
  std::unordered_set<std::string> seen;
  Stanza stanza;
  std::string* current = nullptr;  // the field continuation lines extend
  const auto finish = [&] {
    if (!stanza.package.empty() && seen.insert(stanza.package).second) packages.push_back(to_package(stanza, options));
    stanza = {};
    current = nullptr;
  };
  while (!text.empty()) {
    const std::size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    if (trim(line).empty()) {
      finish();
    } else if (is_blank(line.front())) {
      if (current) {
        current->push_back('\n');
        current->append(trim(line));
      }
    } else {
      const std::size_t colon = line.find(':');
      current = colon == std::string_view::npos ? nullptr : stanza.field(line.substr(0, colon));
      if (current) current->assign(trim(line.substr(colon + 1)));
    }
  }
  finish();
  return packages;
}

std::string read_dumpavail(const std::string& path) {
  if (!path.empty()) {
    std::ifstream file(path, std::ios::binary);
    if (!file) throw DataError(fmt::format("cannot read the package index {}", path));
    std::ostringstream text;
    text << file.rdbuf();
    return std::move(text).str();
  }
  FILE* const pipe = ::popen("apt-cache dumpavail", "r");
  if (!pipe) throw DataError("cannot run apt-cache dumpavail");
  std::string text;
  char buffer[1 << 16];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) text.append(buffer, n);
  const int status = ::pclose(pipe);
  if (status != 0 || text.empty())
    throw DataError(fmt::format("apt-cache dumpavail {} (give an index with --data FILE)",
                                status == -1 || !WIFEXITED(status) ? std::string("did not finish")
                                                                   : fmt::format("exited with status {}{}",
                                                                                 WEXITSTATUS(status),
                                                                                 text.empty() ? " and printed nothing" : "")));
  return text;
}

Dataset make_dataset(const std::vector<Package>& packages, std::size_t min_class) {
  std::map<std::string, std::size_t> sizes;  // ordered: the classes' numbering
  for (const Package& p : packages)
    if (!p.section.empty()) ++sizes[p.section];
  Dataset d;
  std::map<std::string, std::uint8_t> label_of;
  for (const auto& [section, size] : sizes) {
    if (size < min_class) continue;
    if (d.classes.size() == 255)
      throw DataError(fmt::format("more than 255 sections hold {} packages or more; raise --min-class", min_class));
    label_of.emplace(section, static_cast<std::uint8_t>(d.classes.size()));
    d.classes.push_back(section);
  }
  // The keys first, then the examples as indexes into them, every array sized exactly: grown by
  // doubling, they could hold twice what they use.
  std::size_t examples[2] = {0, 0}, features[2] = {0, 0};
  std::unordered_set<std::uint64_t> train_keys;
  for (const Package& p : packages) {
    if (!label_of.contains(p.section)) continue;
    const bool test = held_out(p.name);
    ++examples[test];
    features[test] += p.keys.size();
    d.keys.insert(d.keys.end(), p.keys.begin(), p.keys.end());
    if (!test) train_keys.insert(p.keys.begin(), p.keys.end());
  }
  std::sort(d.keys.begin(), d.keys.end());
  d.keys.erase(std::unique(d.keys.begin(), d.keys.end()), d.keys.end());
  d.keys.shrink_to_fit();
  if (d.keys.size() > std::numeric_limits<std::uint32_t>::max() ||
      std::max(features[0], features[1]) > std::numeric_limits<std::uint32_t>::max())
    throw DataError(fmt::format("{} distinct keys in {} features: more than 32-bit indexes reach", d.keys.size(),
                                features[0] + features[1]));
  d.distinct_keys = train_keys.size();
  for (const bool test : {false, true}) {
    Examples& e = test ? d.test : d.train;
    e.features.reserve(features[test]);
    e.offsets.reserve(examples[test] + 1);
    e.labels.reserve(examples[test]);
  }
  for (const Package& p : packages) {
    const auto label = label_of.find(p.section);
    if (label == label_of.end()) {
      ++d.dropped;
      continue;
    }
    Examples& e = held_out(p.name) ? d.test : d.train;
    for (const std::uint64_t key : p.keys)
      e.features.push_back(static_cast<std::uint32_t>(std::lower_bound(d.keys.begin(), d.keys.end(), key) - d.keys.begin()));
    e.offsets.push_back(static_cast<std::uint32_t>(e.features.size()));
    e.labels.push_back(label->second);
    d.max_keys = std::max(d.max_keys, p.keys.size());
  }
  return d;
}

}  // namespace ctr
