// The package-section example trainer (examples/ctr): its reading of the package index, the
// held-out split, the class filter, and the model's gradients against finite differences.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "model.hpp"
#include "packages.hpp"

namespace {

// A dumpavail excerpt with what the parser must get right: a Tag and a Description continued on
// indented lines, alternatives and version constraints in Depends, a package listed twice (two
// versions; the first wins), an area prefix on a Section, and a stanza without a Section.
constexpr std::string_view index_text =
    "Package: alpha\n"
    "Version: 1.0-1\n"
    "Maintainer: Jane Doe <Jane@Example.org>\n"
    "Architecture: amd64\n"
    "Depends: libc6 (>= 2.34), libfoo1 | libfoo-alt:any (>> 2) [amd64], python3:any <!nocheck>\n"
    "Recommends: beta\n"
    "Description: Fast Game of tiles\n"
    " A longer text, with words.\n"
    " .\n"
    " Second paragraph\n"
    "Tag: game::puzzle, interface::x11,\n"
    " role::program\n"
    "Section: contrib/games\n"
    "Priority: optional\n"
    "\n"
    "Package: beta\n"
    "Maintainer: Team Only\n"
    "Architecture: all\n"
    "Description: data\n"
    "Section: games\n"
    "Priority: optional\n"
    "\n"
    "Package: alpha\n"
    "Version: 0.9-1\n"
    "Description: an older version with other words\n"
    "Section: utils\n"
    "\n"
    "Package: gamma\n"
    "Description: no section\n";

bool has(const ctr::Package& p, std::string_view token) {
  return std::binary_search(p.keys.begin(), p.keys.end(), ctr::feature_key(token));
}

ctr::Package package(std::string name, std::string section) { return {.name = std::move(name), .section = std::move(section), .keys = {1, 2}}; }

}  // namespace

TEST_SUITE("ctr") {
  TEST_CASE("the index reader takes one example per package, with prefixed tokens of its fields") {
    const auto packages = ctr::parse_packages(index_text);
    REQUIRE(packages.size() == 3);
    const ctr::Package& alpha = packages[0];
    CHECK(alpha.name == "alpha");
    CHECK(alpha.section == "games");  // "contrib/" stripped; the second alpha (utils) ignored
    CHECK(packages[1].section == "games");
    CHECK(packages[2].name == "gamma");
    CHECK(packages[2].section.empty());
    for (const char* token : {"dep:libc6", "dep:libfoo1", "dep:libfoo-alt", "dep:python3", "dep:beta",
                              "maint:jane@example.org", "prio:optional", "arch:amd64", "tag:game::puzzle",
                              "tag:interface::x11", "tag:role::program", "word:fast", "word:game", "word:tiles",
                              "word:longer", "word:words", "word:second", "word:paragraph"})
      CHECK_MESSAGE(has(alpha, token), token);
    for (const char* token : {"word:older", "word:utils", "dep:2", "dep:amd64", "word:alpha", "word:games"})
      CHECK_MESSAGE(!has(alpha, token), token);
    CHECK(has(packages[1], "maint:team only"));
    CHECK(std::is_sorted(alpha.keys.begin(), alpha.keys.end()));
    CHECK(std::adjacent_find(alpha.keys.begin(), alpha.keys.end()) == alpha.keys.end());
    CHECK(ctr::parse_packages(index_text, {.max_words = 2})[0].keys.size() < alpha.keys.size());
    CHECK(has(ctr::parse_packages(index_text, {.max_words = 2})[0], "word:game"));
    CHECK(!has(ctr::parse_packages(index_text, {.max_words = 2})[0], "word:of"));
  }

  TEST_CASE("feature keys are fixed: FNV-1a then splitmix64's finalizer") {
    CHECK(ctr::feature_key("") == 0xf52a15e9a9b5e89bull);
    CHECK(ctr::feature_key("word:game") == 0x981e6512787821d7ull);  // computed independently, in Python
    CHECK(ctr::feature_key("word:game") != ctr::feature_key("word:Game"));
  }

  TEST_CASE("about one package in ten is held out, by its name alone") {
    std::size_t held = 0;
    constexpr std::size_t names = 20000;
    for (std::size_t i = 0; i < names; ++i) held += ctr::held_out("package-" + std::to_string(i));
    CHECK(held > names / 10 - 300);
    CHECK(held < names / 10 + 300);
    CHECK(ctr::held_out("package-1") == ctr::held_out(std::string("package-") + "1"));
  }

  TEST_CASE("classes are the sections with enough packages, numbered by name") {
    std::vector<ctr::Package> packages;
    for (int i = 0; i < 40; ++i) packages.push_back(package("z" + std::to_string(i), "zsh"));
    for (int i = 0; i < 30; ++i) packages.push_back(package("a" + std::to_string(i), "admin"));
    for (int i = 0; i < 29; ++i) packages.push_back(package("m" + std::to_string(i), "math"));
    packages.push_back(package("none", ""));
    const ctr::Dataset d = ctr::make_dataset(packages, 30);
    CHECK(d.classes == std::vector<std::string>{"admin", "zsh"});
    CHECK(d.dropped == 30);
    CHECK(d.train.count() + d.test.count() == 70);
    CHECK(d.distinct_keys == 2);
    CHECK(d.max_keys == 2);
    std::size_t held = 0;
    for (const auto& p : packages) held += (p.section == "admin" || p.section == "zsh") && ctr::held_out(p.name);
    CHECK(d.test.count() == held);
    const std::size_t zsh = static_cast<std::size_t>(std::count(d.train.labels.begin(), d.train.labels.end(), 1)) +
                            static_cast<std::size_t>(std::count(d.test.labels.begin(), d.test.labels.end(), 1));
    CHECK(zsh == 40);
    CHECK(d.keys == std::vector<std::uint64_t>{1, 2});
    std::uint64_t keys[2]{};
    CHECK(d.keys_of(d.train, 0, keys) == 2);
    CHECK(keys[0] == 1);
    CHECK(keys[1] == 2);
  }

  TEST_CASE("the model's gradients match finite differences: dense weights and an embedding row") {
    constexpr std::size_t dim = 3, classes = 4;
    ctr::Model model(dim, {5}, classes, 7);
    // Three examples over four distinct rows; row 1 appears twice in the first example (a key
    // given twice gets a gradient per occurrence) and once in the second.
    std::mt19937_64 gen(3);
    std::normal_distribution<float> normal(0.0f, 0.5f);
    std::vector<std::vector<float>> table(4, std::vector<float>(dim));
    for (auto& row : table)
      for (float& v : row) v = normal(gen);
    const std::vector<std::size_t> row_of{0, 1, 1, 2, 1, 3, 3};
    const std::vector<std::size_t> offsets{0, 3, 5, 7};
    const std::vector<std::uint8_t> labels{2, 0, 3};
    std::vector<const float*> rows(row_of.size());
    std::vector<float> row_gradients(row_of.size() * dim);
    const auto loss = [&] {
      for (std::size_t k = 0; k < rows.size(); ++k) rows[k] = table[row_of[k]].data();
      return static_cast<double>(model.train_step(rows, offsets, labels.data(), row_gradients, [](std::size_t) {}));
    };
    loss();
    const std::vector<float> weight_gradients = model.dense().layers()[0].gw;
    const std::vector<float> analytic_rows = row_gradients;
    constexpr float h = 1e-2f;
    const auto numeric = [&](float& value) {
      const float saved = value;
      value = saved + h;
      const double up = loss();
      value = saved - h;
      const double down = loss();
      value = saved;
      return (up - down) / (2 * h);
    };
    for (std::size_t k : {0u, 4u, 7u, 13u}) {
      CAPTURE(k);
      CHECK(numeric(model.dense().layers()[0].w[k]) == doctest::Approx(weight_gradients[k]).epsilon(2e-2));
    }
    for (std::size_t j = 0; j < dim; ++j) {
      double summed = 0;  // row 1's gradient: the sum over its three occurrences
      for (std::size_t k = 0; k < row_of.size(); ++k)
        if (row_of[k] == 1) summed += analytic_rows[k * dim + j];
      CAPTURE(j);
      CHECK(numeric(table[1][j]) == doctest::Approx(summed).epsilon(2e-2));
    }
  }
}
