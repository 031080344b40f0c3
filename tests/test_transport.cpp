// transport::InProcess: matching, sizes, timeouts and failure propagation, on real threads.

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "support.hpp"

using namespace gradsync;
using namespace std::chrono_literals;
using gradsync::transport::InProcess;

namespace {

auto soon(std::chrono::milliseconds d = 5s) { return std::chrono::steady_clock::now() + d; }

std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

}  // namespace

TEST_SUITE("transport") {
  TEST_CASE("messages are matched by peer and tag, whichever side posts first") {
    auto errors = test::run_ranks(2, [](InProcess& t) {
      if (t.rank() == 0) {
        const std::string a = "first", b = "second";
        InProcess::Request ra, rb;
        t.send(ra, 1, 10, bytes_of(a));
        t.send(rb, 1, 20, bytes_of(b));
        CHECK(t.wait(ra, soon()) == a.size());
        CHECK(t.wait(rb, soon()) == b.size());
      } else {
        std::string a(16, '\0'), b(16, '\0');
        InProcess::Request ra, rb;
        // Tag 20 is received first although it was sent second.
        t.recv(rb, 0, 20, std::as_writable_bytes(std::span(b.data(), b.size())));
        CHECK(t.wait(rb, soon()) == 6);
        t.recv(ra, 0, 10, std::as_writable_bytes(std::span(a.data(), a.size())));
        CHECK(t.wait(ra, soon()) == 5);
        CHECK(t.test(ra));
        CHECK(a.substr(0, 5) == "first");
        CHECK(b.substr(0, 6) == "second");
      }
    });
    CHECK_FALSE(errors[0]);
    CHECK_FALSE(errors[1]);
  }

  TEST_CASE("a rank can send to itself and both directions run at once") {
    auto errors = test::run_ranks(2, [](InProcess& t) {
      const int peer = 1 - t.rank();
      std::uint64_t out = 100u + static_cast<std::uint64_t>(t.rank()), in = 0, self = 0;
      InProcess::Request s, r, ss, sr;
      t.send(s, peer, 1, std::as_bytes(std::span(&out, 1)));
      t.recv(r, peer, 1, std::as_writable_bytes(std::span(&in, 1)));
      t.send(ss, t.rank(), 2, std::as_bytes(std::span(&out, 1)));
      t.recv(sr, t.rank(), 2, std::as_writable_bytes(std::span(&self, 1)));
      t.wait(s, soon());
      t.wait(r, soon());
      t.wait(sr, soon());
      CHECK(in == 100u + static_cast<std::uint64_t>(peer));
      CHECK(self == out);
    });
    CHECK_FALSE(errors[0]);
    CHECK_FALSE(errors[1]);
  }

  TEST_CASE("a message larger than the receive buffer fails on both sides") {
    auto errors = test::run_ranks(2, [](InProcess& t) {
      std::array<std::byte, 8> big{}, small{};
      InProcess::Request r;
      if (t.rank() == 0)
        t.send(r, 1, 5, big);
      else
        t.recv(r, 0, 5, std::span(small).first(4));
      t.wait(r, soon());
    });
    REQUIRE(errors[0]);
    REQUIRE(errors[1]);
    CHECK(errors[0]->kind() == ErrorKind::protocol);
    CHECK(errors[1]->kind() == ErrorKind::protocol);
    CHECK(std::string(errors[1]->what()).find("8 bytes") != std::string::npos);
  }

  TEST_CASE("recv_add adds the message to the values there, whichever side posts first; partial values fail both sides") {
    for (const bool sender_first : {true, false}) {
      CAPTURE(sender_first);
      auto errors = test::run_ranks(2, [&](InProcess& t) {
        std::vector<double> values{1.5, -2.0, 1e300, 0.25};
        const std::vector<double> sent{0.5, 2.0, 1e300, -0.125};
        InProcess::Request r, barrier;
        const auto post = [&] {
          if (t.rank() == 0)
            t.send(r, 1, 7, std::as_bytes(std::span(sent)));
          else
            t.recv_add(r, 0, 7, std::span(values));
        };
        // The side that posts second waits for the other's signal first.
        const bool first = (t.rank() == 0) == sender_first;
        if (first) post();
        if (first) t.send(barrier, 1 - t.rank(), 8, {});
        else t.recv(barrier, 1 - t.rank(), 8, {});
        t.wait(barrier, soon());
        if (!first) post();
        CHECK(t.wait(r, soon()) == sent.size() * sizeof(double));
        if (t.rank() == 1) CHECK(values == std::vector<double>{2.0, 0.0, 2e300, 0.125});
        CHECK(t.adds_into(1 - t.rank(), std::as_bytes(std::span(values))));
      });
      CHECK_FALSE(errors[0]);
      CHECK_FALSE(errors[1]);
    }
    auto errors = test::run_ranks(2, [](InProcess& t) {
      std::array<std::byte, 6> odd{};
      std::array<float, 4> values{};
      InProcess::Request r;
      if (t.rank() == 0)
        t.send(r, 1, 5, odd);
      else
        t.recv_add(r, 0, 5, std::span(values));
      t.wait(r, soon());
    });
    REQUIRE(errors[0]);
    REQUIRE(errors[1]);
    CHECK(errors[0]->kind() == ErrorKind::protocol);
    CHECK(std::string(errors[1]->what()).find("not a whole number of f32 values") != std::string::npos);
  }

  TEST_CASE("a wait past its deadline throws timeout and withdraws the request") {
    auto world = InProcess::create_world(2);
    std::uint32_t value = 0;
    InProcess::Request r;
    world[0].recv(r, 1, 3, std::as_writable_bytes(std::span(&value, 1)));
    try {
      world[0].wait(r, soon(20ms));
      FAIL("wait returned");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::timeout);
      CHECK(e.context().rank == 0);
      CHECK(e.context().peer == 1);
      CHECK(e.context().operation == "recv");
    }
    // Withdrawn: a later send with the same tag does not land in the old buffer.
    std::uint32_t sent = 7;
    InProcess::Request s;
    world[1].send(s, 0, 3, std::as_bytes(std::span(&sent, 1)));
    CHECK_FALSE(world[1].test(s));
    CHECK(value == 0);
    world[0].recv(r, 1, 3, std::as_writable_bytes(std::span(&value, 1)));
    CHECK(world[0].wait(r, soon()) == 4);
    CHECK(value == 7);
  }

  TEST_CASE("abort fails the other ranks' pending and future operations, naming the failed rank") {
    std::atomic<bool> posted{false};
    auto errors = test::run_ranks(3, [&](InProcess& t) {
      std::uint32_t value = 0;
      InProcess::Request r;
      if (t.rank() == 1) {
        t.recv(r, 2, 1, std::as_writable_bytes(std::span(&value, 1)));  // rank 2 never sends
        posted = true;
        t.wait(r, soon(10s));
      } else if (t.rank() == 2) {
        while (!posted) std::this_thread::yield();
        t.abort(Error(ErrorKind::invalid_argument, {.rank = 2, .operation = "backward"}, "user code threw"));
      } else {
        while (!posted) std::this_thread::yield();
        std::this_thread::sleep_for(50ms);
        t.send(r, 1, 9, std::as_bytes(std::span(&value, 1)));
      }
    });
    REQUIRE(errors[0]);
    REQUIRE(errors[1]);
    CHECK_FALSE(errors[2]);
    for (int r : {0, 1}) {
      CHECK(errors[r]->kind() == ErrorKind::peer_failed);
      CHECK(errors[r]->context().peer == 2);
      CHECK(std::string(errors[r]->what()).find("user code threw") != std::string::npos);
    }
  }

  TEST_CASE("bad peers and unposted requests are rejected") {
    auto world = InProcess::create_world(2);
    InProcess::Request r;
    std::byte b{};
    CHECK_THROWS_AS(world[0].send(r, 2, 0, std::span(&b, 1)), Error);
    CHECK_THROWS_AS(world[0].wait(r, soon()), Error);
    CHECK_THROWS_AS(InProcess::create_world(0), Error);
  }
}
