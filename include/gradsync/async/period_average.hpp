#pragma once
// async::detail::PeriodAverage — the period averages of the asynchronous parameter server: every
// `period` iterations each worker pushes its registered parameters, part p to server p; each
// server averages its part over the live workers, accumulated in f64 in group order (so that equal
// parameters come back unchanged), and sends the same bits back to all, so every worker starts the
// next period from the same parameters. A dead server's part keeps the worker's own parameters.
// The trainer's side (begin(), averaged(), end()) and the communication thread's (the rest) both
// run under the synchronizer's lock.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gradsync/async/messages.hpp"
#include "gradsync/concepts.hpp"
#include "gradsync/topology/ring.hpp"

namespace gradsync::async::detail {

template <TransportPolicy X>
class PeriodAverage {
 public:
  explicit PeriodAverage(Messages<X>& messages) : m_(messages) {}

  // Registers parameters (the same sizes in the same order on every rank), before start().
  void add(std::span<float> parameters) { parameters_.push_back(parameters); }
  // Their sizes, for the ranks' layout check.
  std::string describe() const {
    std::string sizes;
    for (auto q : parameters_) sizes += fmt::format("{}{}", sizes.empty() ? "" : ",", q.size());
    return fmt::format("parameters=[{}]", sizes);
  }

  // Sizes the parts and posts the first period's receives.
  void start() {
    std::size_t total = 0;
    for (auto q : parameters_) total += q.size();
    const auto workers = static_cast<std::size_t>(n());
    flat_.assign(total, 0.0f);
    for (int p = 0; p < n(); ++p) parts_.push_back(topology::Ring::segment(total, n(), p));
    const std::size_t own = parts_[static_cast<std::size_t>(m_.group().rank)].size();
    contributions_.assign(workers * own, 0.0f);
    average_.assign(own, 0.0f);
    parameters_from_.assign(workers, 0);
    averages_sent_.assign(workers, 0);
    averages_arrived_.assign(workers, 0);
    post_parameter_receives();
  }

  // The trainer's side: the period has ended; its parameters go out with the next progress().
  void begin() {
    auto at = flat_.begin();
    for (auto q : parameters_) at = std::copy(q.begin(), q.end(), at);
    averaging_ = true;
  }
  bool averaged() const noexcept { return !averaging_; }
  // The average, into the registered parameters.
  void end() {
    auto at = flat_.cbegin();
    for (auto q : parameters_) {
      std::copy_n(at, q.size(), q.begin());
      at += static_cast<std::ptrdiff_t>(q.size());
    }
  }
  // The servers whose averages have not come, for a timeout's Error.
  std::string missing() const {
    std::string out;
    for (int p = 0; p < n(); ++p)
      if (!averages_arrived_[p]) out += fmt::format("{}rank {}", out.empty() ? "" : ", ", m_.group().members[p]);
    return out;
  }

  // The communication thread's side.
  void progress() {
    if (averaging_ && !parameters_pushed_) push_parameters();
    send_averages();
  }
  void parameters_arrived(int w, std::size_t bytes) {
    m_.expect_bytes(w, "parameters", bytes, parts_[static_cast<std::size_t>(m_.group().rank)].size() * sizeof(float));
    parameters_from_[w] = 1;
    ++parameters_arrived_;
    check_parameters();
  }
  void average_arrived(int p, std::size_t bytes) {
    m_.expect_bytes(p, "parameter average", bytes, parts_[static_cast<std::size_t>(p)].size() * sizeof(float));
    averages_arrived_[p] = 1;
    check_averages();
  }
  // Rank `peer` is dead: its part stays local, and as its server this rank no longer waits for it.
  void forget(int peer) {
    averages_arrived_[peer] = 1;
    check_averages();
    check_parameters();
  }

 private:
  int n() const noexcept { return m_.group().size(); }
  std::span<float> part(int p) {
    return std::span(flat_).subspan(parts_[static_cast<std::size_t>(p)].begin, parts_[static_cast<std::size_t>(p)].size());
  }

  void post_parameter_receives() {
    const std::size_t own = parts_[static_cast<std::size_t>(m_.group().rank)].size();
    parameters_arrived_ = 0;
    period_averaged_ = false;
    std::fill(parameters_from_.begin(), parameters_from_.end(), 0);
    for (int w = 0; w < n(); ++w)
      m_.post(parameters_received, w, false, parameters, period_,
           std::as_writable_bytes(std::span(contributions_).subspan(static_cast<std::size_t>(w) * own, own)));
  }

  // The worker's part: its parameters to every server, and a receive for each average. The
  // average lands where the part was sent from: it cannot come before that send has completed.
  void push_parameters() {
    for (int p = 0; p < n(); ++p)
      if (m_.posted(parameters_sent, p) || m_.posted(average_received, p)) return;
    parameters_pushed_ = true;
    for (int p = 0; p < n(); ++p) {
      averages_arrived_[p] = m_.dead(p) ? 1 : 0;  // a dead server's part keeps this worker's own parameters
      m_.post(average_received, p, false, average, period_, std::as_writable_bytes(part(p)));
      m_.post(parameters_sent, p, true, parameters, period_, std::as_writable_bytes(part(p)));
    }
    check_averages();
  }

  // The server's part: once every live worker's parameters are here, the average of those that
  // came, accumulated in f64 in group order (so that equal parameters come back unchanged), goes
  // to all of them.
  void check_parameters() {
    if (period_averaged_ || parameters_arrived_ == 0) return;
    for (int w = 0; w < n(); ++w)
      if (!parameters_from_[w] && !m_.dead(w)) return;
    period_averaged_ = true;
    const std::size_t own = parts_[static_cast<std::size_t>(m_.group().rank)].size();
    for (std::size_t e = 0; e < own; ++e) {
      double sum = 0;
      for (int w = 0; w < n(); ++w)
        if (parameters_from_[w]) sum += contributions_[static_cast<std::size_t>(w) * own + e];
      average_[e] = static_cast<float>(sum / parameters_arrived_);
    }
    std::fill(averages_sent_.begin(), averages_sent_.end(), 0);
    average_ready_ = true;
    average_period_ = period_;
  }

  void send_averages() {
    if (!average_ready_) return;
    bool all = true;
    for (int w = 0; w < n(); ++w) {
      if (averages_sent_[w]) continue;
      if (m_.posted(average_sent, w)) {
        all = false;
        continue;
      }
      averages_sent_[w] = 1;
      m_.post(average_sent, w, true, average, average_period_, std::as_writable_bytes(std::span(average_)));
      if (!m_.posted(average_sent, w)) continue;  // dead
    }
    if (all) average_ready_ = false;
  }

  void check_averages() {
    if (!averaging_ || !parameters_pushed_ ||
        std::count(averages_arrived_.begin(), averages_arrived_.end(), 1) < n())
      return;
    // The whole period is done here; every worker's parameters of the next one go to new receives.
    ++period_;
    parameters_pushed_ = false;
    averaging_ = false;
    post_parameter_receives();
  }

  Messages<X>& m_;
  std::vector<std::span<float>> parameters_;
  std::vector<float> flat_;  // the parameters one after another
  std::vector<ElemRange> parts_;
  std::vector<float> contributions_, average_;  // as server: N x the served part, and their average
  int parameters_arrived_ = 0;
  std::vector<std::uint8_t> parameters_from_;  // per worker: its parameters of this period are here
  std::vector<std::uint8_t> averages_sent_, averages_arrived_;
  bool averaging_ = false;  // the trainer ended a period; cleared once every part's average is here
  bool parameters_pushed_ = false, average_ready_ = false;
  bool period_averaged_ = false;  // this period's average of the served part has been formed
  std::uint64_t period_ = 0, average_period_ = 0;
};

}  // namespace gradsync::async::detail
