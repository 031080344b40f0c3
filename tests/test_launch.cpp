// Rendezvous variables from launchers, and the HMAC behind the job-token handshake.

#include <doctest/doctest.h>

#include <map>
#include <string>

#include "detail/hmac.hpp"  // private to the library: src/
#include "gradsync/error.hpp"
#include "gradsync/launch/environment.hpp"

#include <fmt/format.h>

using namespace gradsync;

namespace {

launch::Environment env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    const auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(std::map<std::string, std::string> vars) {
  try {
    launch::from_environment(env(std::move(vars)));
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::invalid_argument);
    return e.detail();
  }
  return "no error";
}

std::string hex(const detail::Digest& d) {
  std::string s;
  for (auto b : d) s += "0123456789abcdef"[b >> 4], s += "0123456789abcdef"[b & 15];
  return s;
}

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

const std::map<std::string, std::string> torchrun{{"RANK", "3"},          {"WORLD_SIZE", "8"},
                                                  {"LOCAL_RANK", "1"},    {"LOCAL_WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                                                  {"GRADSYNC_TOKEN", "s3cret"}};

std::map<std::string, std::string> with(std::map<std::string, std::string> vars, const std::string& name,
                                        const std::optional<std::string>& value) {
  if (value)
    vars[name] = *value;
  else
    vars.erase(name);
  return vars;
}

}  // namespace

TEST_SUITE("launch") {
  TEST_CASE("torchrun-style variables") {
    const auto l = launch::from_environment(env(torchrun));
    CHECK(l.rank == 3);
    CHECK(l.world_size == 8);
    CHECK(l.local_rank == 1);
    CHECK(l.local_world_size == 2);
    CHECK(l.master_addr == "node0");
    CHECK(l.master_port == 29400);
    CHECK(l.token == "s3cret");
  }

  TEST_CASE("mpirun and srun variables, and the precedence between launchers") {
    const std::map<std::string, std::string> common{{"MASTER_ADDR", "h"}, {"GRADSYNC_TOKEN", "t"}};
    auto ompi = common;
    ompi.insert({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "6"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    auto l = launch::from_environment(env(ompi));
    CHECK(l.rank == 5);
    CHECK(l.local_world_size == 2);
    CHECK(l.launcher == "Open MPI");
    CHECK(l.master_port == 29500);

    auto pmi = common;
    pmi.insert({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}});
    l = launch::from_environment(env(pmi));
    CHECK(l.rank == 2);
    CHECK(l.local_rank == 0);
    CHECK(l.local_world_size == 1);

    auto slurm = common;
    slurm.insert({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}});
    l = launch::from_environment(env(slurm));
    CHECK(l.rank == 7);
    CHECK(l.local_rank == 3);
    CHECK(l.local_world_size == 4);

    // Uneven nodes: this node's entry of the compressed list, by SLURM_NODEID.
    slurm["SLURM_TASKS_PER_NODE"] = "4(x2),2";
    slurm["SLURM_NODEID"] = "2";
    slurm["SLURM_LOCALID"] = "1";
    CHECK(launch::from_environment(env(slurm)).local_world_size == 2);
    slurm["SLURM_NODEID"] = "1";
    CHECK(launch::from_environment(env(slurm)).local_world_size == 4);
    slurm.erase("SLURM_NODEID");
    CHECK(error_of(slurm) == R"(SLURM_TASKS_PER_NODE="4(x2),2" differs between nodes and SLURM_NODEID is not set)");
    for (const char* broken : {"4(x", "4abc", "", "4,,2", "0"}) {
      slurm["SLURM_TASKS_PER_NODE"] = broken;
      CHECK(error_of(slurm) == fmt::format(R"(SLURM_TASKS_PER_NODE={:?} is not a list like "4(x2),2")", broken));
    }

    // srun starting torchrun: SLURM_PROCID is the node, RANK the global rank; RANK wins.
    auto both = torchrun;
    both.insert({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}});
    CHECK(launch::from_environment(env(both)).rank == 3);
  }

  TEST_CASE("missing or inconsistent variables are named") {
    CHECK(error_of({}).find("no launcher variables found") != std::string::npos);
    CHECK(error_of(with(torchrun, "WORLD_SIZE", std::nullopt)) == "WORLD_SIZE is not set");
    CHECK(error_of(with(torchrun, "RANK", "8")) == "RANK=8 but WORLD_SIZE=8: the rank must be below the world size");
    CHECK(error_of(with(torchrun, "RANK", "two")) == R"(RANK="two" is not a non-negative whole number)");
    CHECK(error_of(with(torchrun, "WORLD_SIZE", "0")) == "WORLD_SIZE=0 is not a usable world size");
    CHECK(error_of(with(torchrun, "LOCAL_WORLD_SIZE", std::nullopt)) == "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not");
    CHECK(error_of(with(torchrun, "LOCAL_RANK", "2")) ==
          "LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2: the local rank must be below the local size");
    CHECK(error_of(with(torchrun, "LOCAL_WORLD_SIZE", "9")) == "LOCAL_WORLD_SIZE=9 does not fit a world of 8");
    CHECK(error_of(with(torchrun, "MASTER_ADDR", std::nullopt)).find("MASTER_ADDR is not set") == 0);
    CHECK(error_of(with(torchrun, "MASTER_PORT", "70000")) == "MASTER_PORT=70000 is not a TCP port");
    CHECK(error_of(with(torchrun, "GRADSYNC_TOKEN", std::nullopt)).find("GRADSYNC_TOKEN is not set") == 0);
  }

  TEST_CASE("SHA-256 and HMAC-SHA-256 match the published test vectors") {
    CHECK(hex(detail::sha256({})) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(hex(detail::sha256(bytes("abc"))) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const std::string thousand(1000, 'a');  // crosses block boundaries and needs two padding blocks
    CHECK(hex(detail::sha256(bytes(thousand))) == "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
    // RFC 4231 test cases 1, 2 and 6 (a key longer than the block).
    CHECK(hex(detail::hmac_sha256(bytes(std::string(20, '\x0b')), bytes("Hi There"))) ==
          "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    CHECK(hex(detail::hmac_sha256(bytes("Jefe"), bytes("what do ya want for nothing?"))) ==
          "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    CHECK(hex(detail::hmac_sha256(bytes(std::string(131, '\xaa')),
                                  bytes("Test Using Larger Than Block-Size Key - Hash Key First"))) ==
          "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    CHECK(detail::equal_digests(detail::sha256(bytes("x")), detail::sha256(bytes("x"))));
    CHECK_FALSE(detail::equal_digests(detail::sha256(bytes("x")), detail::sha256(bytes("y"))));
  }
}
