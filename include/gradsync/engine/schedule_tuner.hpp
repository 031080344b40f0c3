#pragma once
// engine::ScheduleTuner — which of a choosing topology's candidates (topology::Auto: recursive
// doubling, halving-doubling, the ring) each bucket takes, decided by the times the exchanges
// themselves take rather than by a model fitted to a probe.
//
// Why. The link model (engine::calibrate_link) misses: on a loaded machine its latency is off by
// several times, and the choice it makes flips with the probe's noise from run to run. What a
// schedule costs is best learned by running it, as NCCL's tuner plugins and Open MPI's
// decision files do offline; here it is done online, in the first iterations of training.
//
// Size classes. Buckets are grouped by the power of two of their value count; each class learns on
// its own, from the sum of its buckets' times in an iteration (the same buckets for every
// candidate).
//
// A class's life, the same on every rank:
//   warm-up    the first `warmup` iterations after a plan is installed run the prior's choice (the
//              model's: Auto with its measured link) and are not timed: the first exchanges with a
//              peer also set up its connection.
//   exploring  each candidate the prior does not rule out runs `trials` iterations in turn, in the
//              order the prior predicts fastest first. Ruled out: a candidate whose scratch
//              exceeds `trial_scratch_elements` and the leanest candidate's (recursive doubling
//              holds 2 log2(p) whole buckets: 224 MiB a rank for 16 MiB at 128 ranks), then one
//              predicted beyond `explore_within` times the best of the rest. The order follows
//              from the agreed link alone, so no message is needed to switch. After the first
//              trial of each candidate but the first, the ranks agree on it (below): one beyond
//              `give_up` times the best median so far runs no more trials.
//   agreeing   at the iteration boundary that ends the exploration, every rank's median time per
//              class and candidate goes to group rank 0, which takes the largest (the slowest
//              rank's) and sends the table back; every rank keeps, per class, the candidate with
//              the smallest agreed time, installed by all from the next iteration.
//   settled    the kept candidate runs and its times go on being recorded. Every `check_every`
//              iterations the ranks agree again on its recent median; if it has grown beyond
//              `drift_margin` times another candidate's agreed time, the class explores again.
//
// Cost. Exploration runs at most (candidates - 1) x trials iterations on a slower schedule than the
// best, and one iteration of a candidate that is hopeless (recursive doubling's whole buckets at
// 1 MiB and 64 ranks took 2.8x halving-doubling's time); the prior's filter keeps the ring out where it is hopeless (a 4 KiB bucket at 64 ranks) and
// recursive doubling where its whole buckets are. Each agreement is one gather and one broadcast of
// classes x candidates numbers over the control channel's tree: at the end of an exploration and
// once every `check_every` iterations.
//
// Allocation: the tables are sized when a plan is installed (plan()); recording and choosing
// allocate nothing. The caller builds a bucket's exchange anew when its candidate changes, which
// happens only at the boundaries above: a few times early in training, and after a drift.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "gradsync/engine/control.hpp"
#include "gradsync/error.hpp"
#include "gradsync/engine/cost_model.hpp"

namespace gradsync::engine {

// The values a schedule's slots hold in all (its scratch, beside the bucket).
inline std::size_t scratch_elements(const Schedule& schedule) {
  return std::accumulate(schedule.slot_elements.begin(), schedule.slot_elements.end(), std::size_t{0});
}

// The scratch the tuner weighs candidate k of `topology` by, for a bucket of `elements` values: the
// most of group ranks 0, 1 and n-1 hold, the same on every rank. Not this rank's own: ranks'
// scratch differs (a hierarchical leader holds its machine's buckets and the others none; a rank
// the butterfly's fold hands on holds one slot, a participant 2 log2(p)), and the scratch decides
// which candidates are tried, so ranks weighing their own would try different schedules and wait
// for messages that never come. The three are a leader, the fold's first participant with its
// partner's slot, and a participant the fold leaves alone; some rank elsewhere may hold more (a
// leader the fold pairs with another machine's: twice as much on 3 machines of 4), which the
// filter, a guard against the hopeless rather than a memory limit, accepts for not building every
// rank's schedule.
template <class Topology>
std::size_t candidate_scratch(const Topology& topology, std::size_t k, const Group& group, std::size_t elements,
                              CodecTraits codec) {
  std::size_t most = 0;
  Group as = group;
  for (int rank : {0, std::min(1, group.size() - 1), group.size() - 1}) {
    as.rank = rank;
    most = std::max(most, scratch_elements(topology.candidate_schedule(k, as, elements, codec)));
  }
  return most;
}

struct TunerSettings {
  int warmup = 2;               // iterations after a plan's install that are neither timed nor explored
  int trials = 3;               // iterations each candidate runs while exploring (1 to 15); its median counts
  double explore_within = 4.0;  // candidates predicted slower than this times the best are not tried
  double give_up = 2.0;         // a candidate whose first trial took this times the best median: no more trials
  std::size_t trial_scratch_elements = std::size_t{16} << 20;  // ... nor those needing more scratch (above)
  int check_every = 64;         // settled: iterations between drift checks
  double drift_margin = 1.3;    // a kept candidate this much slower than another's agreed time: explore again
};

class ScheduleTuner {
 public:
  // `candidates`: how many the topology offers (topology::Auto: 8, of which 3 where a group is one level).
  ScheduleTuner(TunerSettings settings, std::size_t candidates) : settings_(settings), candidates_(candidates) {}

  // A new plan of buckets with these value counts; `predicted(bucket, candidate)` is the prior's
  // time for that bucket on that candidate (the same on every rank; infinite: not offered for this
  // group, never tried), `scratch(bucket, candidate)` the values its schedule's slots hold (the
  // same on every rank: candidate_scratch; asked only of candidates offered). Every class starts
  // over.
  void plan(std::span<const std::size_t> bucket_elements,
            const std::function<double(std::size_t bucket, std::size_t candidate)>& predicted,
            const std::function<std::size_t(std::size_t bucket, std::size_t candidate)>& scratch) {
    bucket_class_.assign(bucket_elements.size(), 0);
    std::vector<std::uint32_t> powers;
    for (std::size_t e : bucket_elements) powers.push_back(static_cast<std::uint32_t>(std::bit_width(e)));
    std::vector<std::uint32_t> distinct = powers;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    classes_.assign(distinct.size(), Class{});
    for (std::size_t c = 0; c < distinct.size(); ++c) classes_[c].power = distinct[c];
    for (std::size_t b = 0; b < powers.size(); ++b)
      bucket_class_[b] = static_cast<std::uint32_t>(std::lower_bound(distinct.begin(), distinct.end(), powers[b]) - distinct.begin());
    // Each class's prior: its buckets' predictions added up, per candidate.
    for (Class& c : classes_) {
      c.predicted.assign(candidates_, 0.0);
      c.scratch.assign(candidates_, 0);
      c.agreed.assign(candidates_, 0.0);
      c.samples.assign(candidates_ * static_cast<std::size_t>(settings_.trials), 0.0);
      c.sampled.assign(candidates_, 0);
      c.this_iteration = 0.0;
    }
    scratch_.assign(static_cast<std::size_t>(settings_.trials), 0.0);
    for (std::size_t b = 0; b < bucket_elements.size(); ++b)
      for (std::size_t k = 0; k < candidates_; ++k) {
        Class& c = classes_[bucket_class_[b]];
        c.predicted[k] += predicted(b, k);
        if (std::isfinite(c.predicted[k])) c.scratch[k] = std::max(c.scratch[k], scratch(b, k));
      }
    for (Class& c : classes_) {
      // Candidates offered here (a finite prediction), then those within the scratch allowed.
      const auto offered = [&](std::size_t k) { return std::isfinite(c.predicted[k]); };
      std::size_t leanest = std::numeric_limits<std::size_t>::max();
      for (std::size_t k = 0; k < candidates_; ++k)
        if (offered(k)) leanest = std::min(leanest, c.scratch[k]);
      const std::size_t allowed = std::max(settings_.trial_scratch_elements, leanest);
      c.order.clear();
      for (std::size_t k = 0; k < candidates_; ++k)
        if (offered(k) && c.scratch[k] <= allowed) c.order.push_back(k);
      if (c.order.empty()) {
        const auto index = static_cast<std::uint32_t>(&c - classes_.data());
        const auto first = static_cast<std::size_t>(std::find(bucket_class_.begin(), bucket_class_.end(), index) -
                                                    bucket_class_.begin());
        throw Error(ErrorKind::invalid_argument, {.bucket = static_cast<std::uint32_t>(first), .operation = "schedule tuning"},
                    fmt::format("the topology offers no candidate for a bucket of {} values (every prediction is "
                                "infinite)",
                                bucket_elements[first]));
      }
      std::stable_sort(c.order.begin(), c.order.end(), [&](std::size_t a, std::size_t b) { return c.predicted[a] < c.predicted[b]; });
      const double best = c.predicted[c.order.front()];
      while (c.order.size() > 1 && c.predicted[c.order.back()] > settings_.explore_within * best) c.order.pop_back();
      c.kept = c.order.front();
      c.phase = c.order.size() == 1 ? Phase::settled : settings_.warmup > 0 ? Phase::warming : Phase::exploring;
      c.since = 0;
    }
    samples_text_.assign(classes_.size() * candidates_, 0.0);
  }

  // The candidate bucket `b` runs this iteration.
  std::size_t choice(std::size_t b) const {
    const Class& c = classes_[bucket_class_[b]];
    return c.phase == Phase::exploring ? c.order[static_cast<std::size_t>(c.since) / static_cast<std::size_t>(settings_.trials)]
                                       : c.kept;
  }

  // Bucket `b` took `seconds` this iteration (from its start to its averages written back).
  void record(std::size_t b, double seconds) { classes_[bucket_class_[b]].this_iteration += seconds; }

  // At the end of every iteration, before agree(): files this iteration's times, moves each class
  // on, and says whether the ranks must agree now (the same answer on every rank).
  bool end_iteration() {
    bool agree_now = false;
    for (Class& c : classes_) {
      const double took = std::exchange(c.this_iteration, 0.0);
      ++c.since;
      switch (c.phase) {
        case Phase::warming:
          if (c.since >= settings_.warmup) c.phase = Phase::exploring, c.since = 0;
          break;
        case Phase::exploring: {
          const std::size_t k = c.order[static_cast<std::size_t>(c.since - 1) / static_cast<std::size_t>(settings_.trials)];
          file(c, k, took);
          if (c.since == static_cast<int>(c.order.size()) * settings_.trials) {
            c.phase = Phase::agreeing, agree_now = true;
          } else if (settings_.trials > 1 && c.since > settings_.trials && c.since % settings_.trials == 1) {
            c.first_trial = true, agree_now = true;  // a later candidate's first trial: worth going on?
          }
          break;
        }
        case Phase::settled:
          file(c, c.kept, took);
          if (c.order.size() > 1 && c.since % settings_.check_every == 0) agree_now = true;
          break;
        case Phase::agreeing: break;
      }
    }
    return agree_now;
  }

  // Every rank at once, when end_iteration() said so: the slowest rank's medians decide (above).
  // `log`, if given, gets an account of each decision (the same on every rank).
  template <TransportPolicy X>
  void agree(ControlChannel<X>& control, std::uint64_t iteration, std::string* log = nullptr) {
    for (std::size_t c = 0; c < classes_.size(); ++c)
      for (std::size_t k = 0; k < candidates_; ++k) samples_text_[c * candidates_ + k] = median(classes_[c], k);
    agree_on_slowest(control, iteration, ControlMessage::schedule_times, std::span<double>(samples_text_),
                     "schedule tuning");
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      Class& cls = classes_[c];
      const std::span<const double> agreed(samples_text_.data() + c * candidates_, candidates_);
      if (cls.first_trial) {
        cls.first_trial = false;
        const auto position = static_cast<std::size_t>(cls.since - 1) / static_cast<std::size_t>(settings_.trials);
        double best = std::numeric_limits<double>::infinity();
        for (std::size_t p = 0; p < position; ++p) best = std::min(best, agreed[cls.order[p]]);
        if (agreed[cls.order[position]] > settings_.give_up * best) {  // its remaining trials skipped
          cls.since = static_cast<int>(position + 1) * settings_.trials;
          if (position + 1 == cls.order.size()) cls.phase = Phase::agreeing;
        }
      }
      if (cls.phase == Phase::agreeing) {
        for (std::size_t k : cls.order) cls.agreed[k] = agreed[k];
        cls.kept = *std::min_element(cls.order.begin(), cls.order.end(),
                                     [&](std::size_t a, std::size_t b) { return cls.agreed[a] < cls.agreed[b]; });
        cls.phase = Phase::settled;
        cls.since = 0;
        if (log) *log += describe(cls, "measured");
      } else if (cls.phase == Phase::settled && cls.order.size() > 1 && cls.since % settings_.check_every == 0) {
        cls.agreed[cls.kept] = agreed[cls.kept];
        double best_other = std::numeric_limits<double>::infinity();
        for (std::size_t k : cls.order)
          if (k != cls.kept) best_other = std::min(best_other, cls.agreed[k]);
        if (agreed[cls.kept] > settings_.drift_margin * best_other) {
          if (log) *log += describe(cls, "drifted, exploring again");
          cls.phase = Phase::exploring;
          cls.since = 0;
          std::fill(cls.sampled.begin(), cls.sampled.end(), 0);
        }
      }
    }
  }

  // Whether every class has settled (for a benchmark that times only the kept choice).
  bool settled() const {
    return std::all_of(classes_.begin(), classes_.end(), [](const Class& c) { return c.phase == Phase::settled; });
  }

  // Names the candidates for the log (topology::Auto::describe(Choice)).
  std::function<std::string(std::size_t candidate)> candidate_name = [](std::size_t k) { return fmt::format("#{}", k); };

 private:
  enum class Phase : std::uint8_t { warming, exploring, agreeing, settled };

  struct Class {
    std::uint32_t power = 0;        // buckets of 2^(power-1) .. 2^power - 1 values
    Phase phase = Phase::warming;
    int since = 0;                  // iterations since the phase began
    std::vector<std::size_t> order;  // candidates worth trying, the prior's fastest first
    std::size_t kept = 0;
    std::vector<double> predicted;  // per candidate, seconds (the prior)
    std::vector<std::size_t> scratch;  // per candidate, the most values one bucket's slots hold
    std::vector<double> agreed;     // per candidate, the slowest rank's median at the last agreement
    std::vector<double> samples;    // per candidate, its last `trials` times (a ring)
    std::vector<int> sampled;       // per candidate, how many times were filed
    double this_iteration = 0.0;
    bool first_trial = false;       // exploring: a later candidate has run its first trial
  };

  void file(Class& c, std::size_t k, double seconds) const {
    const auto trials = static_cast<std::size_t>(settings_.trials);
    c.samples[k * trials + static_cast<std::size_t>(c.sampled[k]) % trials] = seconds;
    ++c.sampled[k];
  }

  // The median of candidate k's last times here (0 if it has none).
  double median(const Class& c, std::size_t k) {
    const auto trials = static_cast<std::size_t>(settings_.trials);
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(c.sampled[k]), trials);
    if (n == 0) return 0.0;
    std::copy_n(c.samples.begin() + static_cast<std::ptrdiff_t>(k * trials), n, scratch_.begin());
    std::sort(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(n));
    return scratch_[n / 2];
  }

  std::string describe(const Class& c, const char* what) const {
    std::string times;
    for (std::size_t k : c.order)
      times += fmt::format("{}{} {:.3f} ms", times.empty() ? "" : ", ", candidate_name(k), c.agreed[k] * 1e3);
    const std::size_t low = c.power == 0 ? 0 : std::size_t{1} << (c.power - 1);
    return fmt::format("\n  buckets of {} to {} values ({}): {} -> {}", low, (std::size_t{1} << c.power) - 1, what,
                       times, candidate_name(c.kept));
  }

  TunerSettings settings_;
  std::size_t candidates_;
  std::vector<std::uint32_t> bucket_class_;  // by bucket
  std::vector<Class> classes_;
  std::vector<double> samples_text_;  // classes x candidates, what the agreement carries
  std::vector<double> scratch_;       // median()'s, `trials` long
};

}  // namespace gradsync::engine
