// bench/allreduce — nccl-tests style: time one allreduce of each size (the topology's schedule,
// run by the engine with a codec over a transport), beside a memcpy of the same bytes.
//
//   allreduce [--transport in-process|shm|tcp|mpi] [--local-transport shm|tcp] [--executor task-graph|serial] [--ranks N] [--min-bytes B] [--max-bytes B]
//             [--step-factor F] [--iters I] [--warmup W] [--codec NAME] [--threshold T] [--keep F]
//             [--topology auto|ring|recursive-doubling|halving-doubling|parameter-server|hierarchical]
//             [--partitions P] [--ranks-per-machine L] [--across auto|ring|recursive-doubling|halving-doubling]
//             [--within auto|ring|leader]
//             [--chunk-bytes B] [--data gradient|constant] [--json PATH]
//
// in-process: N ranks as threads of this process. shm: one rank per process, all on one machine,
// over shared memory (gradsync-run -n N). tcp: one rank per process, placed by the launcher's
// variables (gradsync-run, torchrun, mpirun, srun, netcluster run); --ranks is ignored. With
// several ranks per machine (LOCAL_WORLD_SIZE > 1) those of one machine talk over shared memory
// and only the others over TCP (transport::Routed), unless --local-transport tcp. mpi: one rank per
// process of an MPI job (mpirun, srun; where gradsync was built with MPI): transport::Mpi, with
// the ranks of one machine (as MPI tells them) over shared memory; hierarchical's
// --ranks-per-machine defaults to the ranks MPI puts on a machine.
//
// --topology auto (the default): each size takes recursive doubling, halving-doubling or the ring,
// or on several machines of several ranks (--ranks-per-machine, LOCAL_WORLD_SIZE by default) one
// of the hierarchical schedules, whichever ran fastest, as a Synchronizer chooses: the links
// measured first (engine::measure_links) order the candidates and rule out the hopeless, then each
// runs a few untimed iterations and the ranks agree on the one whose slowest rank was fastest
// (engine::ScheduleTuner); only that one is timed. The table's last column and the JSON say which.
// --topology hierarchical with --across or --within auto chooses its arrangement the same way.
//
// Every iteration starts and ends at a barrier; an iteration's time is the slowest rank's; the table shows
// the median over --iters iterations after --warmup. algbw = bytes / time; busbw = algbw *
// 2(n-1)/n, what each rank moves through its link in a ring allreduce, so busbw compares across
// world sizes and against the link's bandwidth. GB = 1e9 bytes.
//
// --data gradient (the default): each rank's values are drawn from N(0, 0.01), differently on
// every rank, as gradients are, so every codec is timed on what it meets (a sparsifier's choice,
// a quantizer's scale); the first iteration of each size is checked for what the library promises
// whatever the codec: every rank ends with the same bits (#wrong counts the ranks whose result
// differs from rank 0's). --data constant: rank r contributes r + 1 everywhere, and every rank
// checks its result against the topology's arithmetic done by hand, with the codec's rounding at
// every hop (#wrong counts elements that differ); the sparsifiers (top-k, random-k) keep some
// elements of a uniform run and not others, which a per-value replay cannot follow: "-".

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <numeric>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gradsync/engine/binomial_tree.hpp"
#include "gradsync/engine/schedule_tuner.hpp"
#include "gradsync/gradsync.hpp"
#include "gradsync/transport/tcp.hpp"
#include "gradsync/version.hpp"  // GRADSYNC_HAS_MPI
#if GRADSYNC_HAS_MPI
#include "gradsync/transport/mpi.hpp"
#endif
#include "toolkit/codec_by_name.hpp"
#include "toolkit/gradient_data.hpp"
#include "toolkit/json.hpp"
#include "toolkit/options.hpp"
#include "toolkit/statistics.hpp"

namespace {

using namespace gradsync;
namespace tk = gradsync::toolkit;
using Clock = std::chrono::steady_clock;

struct Config {
  std::string transport = "in-process";
  std::string local_transport = "shm";
  std::string executor = "task-graph";  // what the Synchronizer runs by default
  int ranks = 4;
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t step_factor = 4;
  int iters = 20;
  int warmup = 3;
  std::string codec = "none";
  gradsync::toolkit::CodecSettings codec_settings;
  std::string topology = "auto";
  std::size_t partitions = 0;  // parameter server: 0 = one per rank
  int ranks_per_machine = 0;   // hierarchical: L; 0 until parsed, then LOCAL_WORLD_SIZE, else 1
  std::string across = "auto";  // hierarchical: its schedule across machines
  std::string within = "auto";  // hierarchical: the rings within machines, or a leader
  std::size_t chunk_bytes = 0;  // 0: the topology's own
  std::string data = "gradient";
  std::string json;
  int machine_ranks = 1;  // mpi: the ranks MPI puts on this rank's machine (for the transport's name)
  std::string collective = "gradsync";  // or mpi-allreduce: MPI's own, timed the same way
};

struct Row {
  std::size_t bytes = 0;
  double time_us = 0;
  double memcpy_us = 0;
  std::uint64_t wrong = 0;
  bool checked = true;
  std::string topology;  // the schedule this size ran: --topology auto chooses per size
  std::string across;    // hierarchical: the schedule across machines this size ran (--across auto chooses)
  std::string within;    // hierarchical: ring or leader (--within auto chooses)
  std::optional<LinkModel> link;         // what auto measured before choosing (hierarchical: within a machine)
  std::optional<LinkModel> link_across;  // hierarchical: what --across auto measured between machines
  // auto: the tuner's account of its trials (agreed times per candidate), how many iterations it
  // ran before the kept schedule was timed, and their time (the slowest rank's, summed)
  std::string trials;
  std::size_t trial_iterations = 0;
  double trials_us = 0;
};

// Whether expected_average can replay the codec one value at a time.
template <class Codec>
constexpr bool elementwise = true;
template <>
constexpr bool elementwise<compression::TopK> = false;
template <>
constexpr bool elementwise<compression::RandomK> = false;
template <class C>
constexpr bool elementwise<compression::ErrorFeedback<C>> = elementwise<C>;

double memcpy_us(std::size_t bytes, int iters) {
  std::vector<std::byte> from(bytes, std::byte{1}), to(bytes);
  std::vector<double> times;
  for (int i = 0; i < iters + 1; ++i) {
    const auto start = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    if (i > 0) times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return tk::median(times);
}

// --chunk-bytes in elements, or the topology's own piece size where it is not given.
std::size_t chunk_elements(const Config& cfg, std::size_t topology_default) {
  return cfg.chunk_bytes ? std::max<std::size_t>(1, cfg.chunk_bytes / sizeof(float)) : topology_default;
}

topology::Ring ring_topology(const Config& cfg) { return {.chunk_elements = chunk_elements(cfg, topology::Ring{}.chunk_elements)}; }

topology::ParameterServer parameter_server(const Config& cfg) {
  return {.partitions = cfg.partitions, .chunk_elements = chunk_elements(cfg, topology::ParameterServer{}.chunk_elements)};
}

// --across's and --within's names, in Hierarchical::Across's and Within's orders.
const std::vector<std::string> across_names{"auto", "ring", "recursive-doubling", "halving-doubling"};
const std::vector<std::string> within_names{"auto", "ring", "leader"};

topology::Hierarchical hierarchical(const Config& cfg) {
  const auto named = [](const std::vector<std::string>& names, const std::string& name) {
    return static_cast<std::uint8_t>(std::find(names.begin(), names.end(), name) - names.begin());
  };
  return {.ranks_per_machine = cfg.ranks_per_machine,
          .chunk_elements = chunk_elements(cfg, topology::Hierarchical{}.chunk_elements),
          .across = static_cast<topology::Hierarchical::Across>(named(across_names, cfg.across)),
          .within = static_cast<topology::Hierarchical::Within>(named(within_names, cfg.within))};
}

// --topology auto: its candidates with the pieces asked for, the hierarchical ones over machines of
// --ranks-per-machine (LOCAL_WORLD_SIZE by default).
topology::Auto<> auto_topology(const Config& cfg) {
  return {.large = ring_topology(cfg),
          .machines = {.ranks_per_machine = std::max(1, cfg.ranks_per_machine),
                       .chunk_elements = chunk_elements(cfg, topology::Hierarchical{}.chunk_elements)}};
}

// --ranks-per-machine's default: LOCAL_WORLD_SIZE (set by torchrun, gradsync-run and netcluster), else 1.
int local_world_size() {
  const char* text = std::getenv("LOCAL_WORLD_SIZE");
  if (!text) return 1;
  int value = 0;
  const auto [end, ec] = std::from_chars(text, text + std::strlen(text), value);
  if (ec != std::errc{} || *end != '\0' || value < 1)
    throw std::invalid_argument(fmt::format("LOCAL_WORLD_SIZE is '{}', not a positive integer", text));
  return value;
}

// Recursive doubling's or halving-doubling's arithmetic (`halving`) on constant buckets, one value
// per participant in group order, the sum divided by `divisor`, written into `out`: the fold, then
// by recursive doubling each pair of a round adds the two partial sums, each through the codec,
// lower rank first; by halving-doubling each segment's keeper adds its partner's partial through
// the codec to its own, and the owner's average goes through it once.
template <class Codec>
void log_depth_average(const Codec& codec, std::vector<float> value, int divisor, bool halving, std::span<float> out) {
  const int n = static_cast<int>(value.size());
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n))), folded = n - p;
  const auto sent = [&](float v) { return Codec::identity ? v : compression::round_trip(codec, v); };
  const auto rank_of = [&](int v) { return static_cast<std::size_t>(v < folded ? 2 * v + 1 : v + folded); };
  if (n == 1) return std::fill(out.begin(), out.end(), value[0] / static_cast<float>(divisor));
  for (int i = 0; i < folded; ++i) value[rank_of(i)] += sent(value[static_cast<std::size_t>(2 * i)]);
  if (!halving) {
    for (int k = 1; k < p; k *= 2)
      for (int v = 0; v < p; ++v)
        if ((v & k) == 0) value[rank_of(v)] = value[rank_of(v | k)] = sent(value[rank_of(v)]) + sent(value[rank_of(v | k)]);
    return std::fill(out.begin(), out.end(), value[rank_of(0)] / static_cast<float>(divisor));
  }
  // Every participant adds its partner's partial (through the codec) to its own, distance p/2
  // first; participant s ends with segment s, averages it and sends it through the codec once.
  for (int distance = p / 2; distance >= 1; distance /= 2) {
    std::vector<float> before = value;
    for (int v = 0; v < p; ++v) value[rank_of(v)] = before[rank_of(v)] + sent(before[rank_of(v ^ distance)]);
  }
  for (int s = 0; s < p; ++s) {
    const ElemRange segment = topology::Ring::segment(out.size(), p, s);
    std::fill(out.begin() + static_cast<std::ptrdiff_t>(segment.begin), out.begin() + static_cast<std::ptrdiff_t>(segment.end),
              sent(value[rank_of(s)] / static_cast<float>(divisor)));
  }
}

// What every element must hold after the first allreduce when rank r contributes r + 1 everywhere:
// on a ring each segment's partial sum passes through the codec once per hop, in the ring's order;
// on a parameter server each part's root adds the others' values (each through the codec) to its
// own, in group order; by recursive doubling or halving-doubling as log_depth_average has it;
// hierarchically each machine sums its ranks' values as they are, in ring order round the machine
// (through a leader: from local rank 0, over the whole bucket), and the machines' sums go round a
// ring through the codec, or through the log-depth schedule across (hierarchical.hpp).
template <class Codec>
std::vector<float> expected_average(const Codec& codec, int n, std::size_t count, const Config& cfg,
                                    const std::string& schedule, const std::string& across, const std::string& within) {
  const auto through = [&](float v) { return compression::round_trip(codec, v); };
  std::vector<float> expected(count);
  const auto fill = [&](ElemRange range, float value) {
    std::fill(expected.begin() + static_cast<std::ptrdiff_t>(range.begin),
              expected.begin() + static_cast<std::ptrdiff_t>(range.end), value);
  };
  if (schedule == "hierarchical") {
    const int per_machine = cfg.ranks_per_machine, machines = hierarchical(cfg).machines(Group::world(0, n));
    const int shards = within == "leader" ? 1 : per_machine;
    for (int s = 0; s < shards; ++s) {
      const auto machine_sum = [&](int m) {  // rank m*L + l contributes m*L + l + 1
        float sum = static_cast<float>(m * per_machine + s + 1);
        for (int k = 1; k < per_machine; ++k) sum = static_cast<float>(m * per_machine + (s + k) % per_machine + 1) + sum;
        return sum;
      };
      const ElemRange shard = topology::Ring::segment(count, shards, s);
      if (across != "ring") {
        std::vector<float> sums;
        for (int m = 0; m < machines; ++m) sums.push_back(machine_sum(m));
        log_depth_average(codec, sums, n, across == "halving-doubling",
                          std::span<float>(expected).subspan(shard.begin, shard.size()));
        continue;
      }
      for (int t = 0; t < machines; ++t) {
        float partial = machine_sum(t);
        for (int k = 1; k < machines; ++k) partial = machine_sum((t + k) % machines) + (Codec::identity ? partial : through(partial));
        const float average = partial / static_cast<float>(n);
        const ElemRange segment = topology::Ring::segment(shard.size(), machines, t);
        fill({shard.begin + segment.begin, shard.begin + segment.end}, Codec::identity ? average : through(average));
      }
    }
    return expected;
  }
  if (schedule == "recursive-doubling" || schedule == "halving-doubling") {
    std::vector<float> value(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) value[static_cast<std::size_t>(r)] = static_cast<float>(r + 1);
    log_depth_average(codec, value, n, schedule == "halving-doubling", std::span<float>(expected));
    return expected;
  }
  if (cfg.topology == "parameter-server") {
    const topology::ParameterServer ps = parameter_server(cfg);
    const std::size_t parts = ps.partitions ? ps.partitions : static_cast<std::size_t>(n);
    for (std::size_t p = 0; p < parts; ++p) {
      const int root = ps.root(Group::world(0, n), p);
      float sum = static_cast<float>(root + 1);
      for (int s = 0; s < n; ++s)
        if (s != root) sum += Codec::identity ? static_cast<float>(s + 1) : through(static_cast<float>(s + 1));
      const float average = sum / static_cast<float>(n);
      const ElemRange part = topology::Ring::segment(count, static_cast<int>(parts), static_cast<int>(p));
      std::fill(expected.begin() + static_cast<std::ptrdiff_t>(part.begin), expected.begin() + static_cast<std::ptrdiff_t>(part.end),
                Codec::identity || n == 1 ? average : through(average));
    }
    return expected;
  }
  for (int s = 0; s < n; ++s) {
    float partial = static_cast<float>(s + 1);
    for (int k = 1; k < n; ++k) partial = static_cast<float>((s + k) % n + 1) + (Codec::identity ? partial : through(partial));
    const float average = partial / static_cast<float>(n);
    const ElemRange segment = topology::Ring::segment(count, n, s);
    std::fill(expected.begin() + static_cast<std::ptrdiff_t>(segment.begin), expected.begin() + static_cast<std::ptrdiff_t>(segment.end),
              Codec::identity ? average : through(average));
  }
  return expected;
}

// Small collectives the benchmark needs besides the one it measures, on their own tags: binomial
// trees rooted at rank 0 (engine/binomial_tree.hpp), so that no rank talks to every other and rank
// 0 waits for log2(n) messages, not n - 1.
template <class X>
class Coordination {
 public:
  explicit Coordination(X& t) : t_(t) {}

  // Rank 0 hears up the tree that every rank has arrived, and the word goes back down.
  void barrier() {
    std::byte token{};
    reduce(std::span(&token, 1), token_up, [](std::span<std::byte>, std::span<const std::byte>) {});
    broadcast(std::span(&token, 1), token_down);
    ++round_;
  }

  // Rank 0 learns how many ranks' digests differ from its own (0 elsewhere): its digest goes down
  // the tree, and the ranks that differ are counted on the way back up.
  std::uint64_t ranks_differing_from_root(std::uint64_t digest) {
    std::uint64_t root_digest = digest;
    broadcast(std::span(&root_digest, 1), root_digest_down);
    std::uint64_t differing = digest != root_digest;
    reduce(std::span(&differing, 1), differing_up, add<std::uint64_t>);
    ++round_;
    return t_.rank() == 0 ? differing : 0;
  }

  // Rank 0 ends with every rank's values folded into its own: element-wise maximum (times) and
  // sum (counts).
  void reduce_to_root(std::vector<double>& slowest, std::uint64_t& wrong) {
    reduce(std::span(slowest), times_up, [](std::span<double> mine, std::span<const double> theirs) {
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = std::max(mine[i], theirs[i]);
    });
    reduce(std::span(&wrong, 1), wrong_up, add<std::uint64_t>);
    ++round_;
  }

 private:
  // Message ids within a round.
  enum Message : std::uint32_t { token_up, times_up, wrong_up, root_digest_down, differing_up, token_down };

  template <class T>
  static void add(std::span<T> mine, std::span<const T> theirs) {
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] += theirs[i];
  }

  // Rank 0's `values` end as fold(values, theirs) over every rank's: each rank folds in its
  // children's, smallest subtree first, and sends the result to its parent.
  template <class T, class Fold>
  void reduce(std::span<T> values, Message message, Fold fold) {
    const int rank = t_.rank();
    std::vector<T> theirs(values.size());
    for (int i = 0; i < engine::binomial_tree::children(rank, t_.size()); ++i) {
      recv_wait(engine::binomial_tree::child(rank, i), message, std::as_writable_bytes(std::span(theirs)));
      fold(values, std::span<const T>(theirs));
    }
    if (rank != 0) send_wait(engine::binomial_tree::parent(rank), message, std::as_bytes(values));
  }

  // Rank 0's `values` on every rank: each rank takes them from its parent and passes them to its
  // children, the largest subtree first.
  template <class T>
  void broadcast(std::span<T> values, Message message) {
    const int rank = t_.rank();
    if (rank != 0) recv_wait(engine::binomial_tree::parent(rank), message, std::as_writable_bytes(values));
    for (int i = engine::binomial_tree::children(rank, t_.size()); i-- > 0;)
      send_wait(engine::binomial_tree::child(rank, i), message, std::as_bytes(values));
  }

  std::uint64_t tag(Message message) { return engine::make_tag(round_, 0xfffe, message); }
  void send_wait(int peer, Message message, std::span<const std::byte> bytes) {
    typename X::Request r;
    t_.send(r, peer, tag(message), bytes);
    t_.wait(r, Clock::now() + std::chrono::minutes(2));
  }
  void recv_wait(int peer, Message message, std::span<std::byte> bytes) {
    typename X::Request r;
    t_.recv(r, peer, tag(message), bytes);
    t_.wait(r, Clock::now() + std::chrono::minutes(2));
  }

  X& t_;
  std::uint64_t round_ = 0;
};

// FNV-1a over the values' bytes: what ranks compare to know they hold the same bits.
std::uint64_t digest(std::span<const float> values) {
  std::uint64_t h = 1469598103934665603ull;
  for (const std::byte b : std::as_bytes(values)) h = (h ^ static_cast<std::uint8_t>(b)) * 1099511628211ull;
  return h;
}

// Runs every size on this rank; rank 0 returns the rows.
template <class Codec, class X>
std::vector<Row> run_rank(X& transport, const Config& cfg, const Codec& codec) {
  const int n = transport.size();
  const Group group = Group::world(transport.rank(), n);
  const topology::Ring ring = ring_topology(cfg);
  const topology::ParameterServer ps = parameter_server(cfg);
  topology::Hierarchical hier = hierarchical(cfg);
  topology::Auto<> chooser = auto_topology(cfg);
  // Auto, and Hierarchical's arrangement, are measured and tuned as a Synchronizer does.
  const bool hierarchical_chooses = cfg.topology == "hierarchical" && hier.chooses() && hier.machines(group) > 1;
  const bool tuned = n > 1 && (cfg.topology == "auto" || hierarchical_chooses);
  engine::ControlChannel<X> control(transport, group, std::chrono::minutes(2));
  if (tuned) {
    const std::string measured =
        cfg.topology == "auto" ? engine::measure_links(chooser, control) : engine::measure_links(hier, control);
    if (transport.rank() == 0) fmt::print("# {} measured\n", measured);
  }
  // The schedule a size runs, by name (auto: its candidate now, the prior's until the tuner has
  // one), and for a hierarchical one, its schedule across machines.
  const auto chosen = [&](std::size_t count) -> std::string {
    if (cfg.topology != "auto") return cfg.topology;
    switch (chooser.choose(group, count)) {
      case topology::Auto<>::Choice::small: return "recursive-doubling";
      case topology::Auto<>::Choice::middle: return "halving-doubling";
      case topology::Auto<>::Choice::large: return "ring";
      default: break;
    }
    return "hierarchical";
  };
  const auto arrangement = [&](std::size_t count) -> std::optional<topology::Hierarchical::Arrangement> {
    if (cfg.topology == "hierarchical") return hier.choice_for(group, count);
    if (chosen(count) != "hierarchical") return std::nullopt;
    return topology::Hierarchical::candidate(static_cast<std::size_t>(chooser.choose(group, count)) -
                                             topology::Auto<>::flat_candidates);
  };
  const auto across = [&](std::size_t count) -> std::string {
    const auto a = arrangement(count);
    return a ? topology::Hierarchical::name(a->across) : "";
  };
  const auto within = [&](std::size_t count) -> std::string {
    const auto a = arrangement(count);
    return a ? topology::Hierarchical::name(a->within) : "";
  };
  const auto schedule = [&](std::size_t count) {
    const std::string name = chosen(count);
    const CodecTraits traits = codec_traits<Codec>();
    return cfg.topology == "auto"         ? chooser.schedule(group, count, traits)
           : name == "ring"               ? ring.schedule(group, count, traits)
           : name == "hierarchical"       ? hier.schedule(group, count, traits)
           : name == "recursive-doubling" ? topology::RecursiveDoubling{}.schedule(group, count, traits)
           : name == "halving-doubling"   ? topology::HalvingDoubling{}.schedule(group, count, traits)
                                          : ps.schedule(group, count, traits);
  };
  Coordination<X> coordination(transport);
  // The task graph runs a schedule's steps as their data allows (pieces of one phase overlap the
  // next); the serial executor in list order.
  std::optional<engine::TaskGraph<Codec, X>> graph;
  if (cfg.executor == "task-graph")
    graph.emplace(transport, codec, group, 1, std::chrono::minutes(2),
                  typename engine::TaskGraph<Codec, X>::BucketTasks{.pack = [](std::uint32_t) {},
                                                                    .copy_back = [](std::uint32_t) {}});
  std::vector<Row> rows;
  std::uint64_t iteration = 0, agreement = 0;
  for (std::size_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= cfg.step_factor) {
    const std::size_t count = bytes / sizeof(float);
    chooser.pinned.reset();  // the prior's choice, until the tuner has one
    hier.across = hierarchical(cfg).across;
    hier.within = hierarchical(cfg).within;
    engine::BucketExchange<Codec, X> exchange(schedule(count), codec, DType::f32, false, &transport);
    // From the transport's own memory where it has some (SharedMemory: one memcpy per message).
    const gradsync::detail::TransportBuffer<X> storage(&transport, count * sizeof(float));
    const std::span<float> values = storage.template as<float>(count);
    const bool gradient = cfg.data == "gradient";
    const bool checked = gradient || elementwise<Codec>;
    const std::vector<float> mine = gradient ? tk::gradient_values(count, transport.rank()) : std::vector<float>{};
    engine::BucketExchange<Codec, X>* const installed[] = {&exchange};
    if (graph) graph->install(installed);
    // One allreduce of this size, timed on this rank, in microseconds.
    const auto allreduce = [&] {
      if (gradient) std::copy(mine.begin(), mine.end(), values.begin());
      else std::fill(values.begin(), values.end(), static_cast<float>(transport.rank() + 1));
      coordination.barrier();
      const auto start = Clock::now();
      if (graph) {
        graph->start(0, std::span<float>(values), iteration++, /*packed=*/true, /*awaits_next=*/true);
        graph->await_iteration();
      } else {
        exchange.run(std::span<float>(values), codec, transport, {group, iteration++, 0, std::chrono::minutes(2)});
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      // Nobody refills (or checks) its values while another rank is still in the timed allreduce:
      // on a machine shared by several ranks that work would slow the slowest one.
      coordination.barrier();
      return us;
    };
    std::vector<double> trial_times;
    std::string trials;
    // The tuner's trials (untimed), `pin` making candidate k the schedule this size runs.
    const auto explore = [&](const auto& tuned_topology, auto&& pin) {
      engine::ScheduleTuner tuner({.warmup = cfg.warmup}, std::remove_cvref_t<decltype(tuned_topology)>::candidates);
      tuner.candidate_name = [&](std::size_t k) { return tuned_topology.candidate_name(k); };
      tuner.plan(
          std::span(&count, 1),
          [&](std::size_t, std::size_t k) { return tuned_topology.candidate_seconds(k, group, count, sizeof(float)); },
          [&](std::size_t, std::size_t k) {
            return engine::candidate_scratch(tuned_topology, k, group, count, codec_traits<Codec>());
          });
      for (;;) {
        pin(tuner.choice(0));
        exchange = engine::BucketExchange<Codec, X>(schedule(count), codec, DType::f32, false, &transport);
        if (graph) graph->install(installed);
        if (tuner.settled()) break;
        const std::size_t running = tuner.choice(0);
        while (tuner.choice(0) == running && !tuner.settled()) {
          trial_times.push_back(allreduce());
          tuner.record(0, trial_times.back() * 1e-6);
          if (tuner.end_iteration()) tuner.agree(control, ++agreement, &trials);
        }
      }
    };
    if (tuned && cfg.topology == "auto")
      explore(chooser, [&](std::size_t k) { chooser.pinned = static_cast<topology::Auto<>::Choice>(k); });
    else if (tuned)
      explore(hier, [&](std::size_t k) {
        hier.across = topology::Hierarchical::candidate(k).across;
        hier.within = topology::Hierarchical::candidate(k).within;
      });
    const std::vector<float> expected =
        !gradient && elementwise<Codec> ? expected_average(codec, n, count, cfg, chosen(count), across(count), within(count))
                                        : std::vector<float>{};
    std::vector<double> times;
    std::uint64_t wrong = 0;
    for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
      const double us = allreduce();
      if (i >= cfg.warmup) times.push_back(us);
      if (i == 0 && gradient) wrong += coordination.ranks_differing_from_root(digest(values));
      if (i == 0 && !gradient && elementwise<Codec>)
        for (std::size_t e = 0; e < count; ++e) wrong += values[e] != expected[e];
    }
    // The tuner's account is lines for a log ("\n  buckets of ..."); here it is one line.
    for (std::size_t at; (at = trials.find("\n  ")) != std::string::npos;) trials.replace(at, 3, " ");
    coordination.reduce_to_root(times, wrong);
    if (tuned) {
      std::uint64_t none = 0;
      coordination.reduce_to_root(trial_times, none);
    }
    if (transport.rank() == 0)
      rows.push_back({count * sizeof(float), tk::median(times), 0, wrong, checked, chosen(count), across(count), within(count),
                      cfg.topology == "auto" && tuned ? std::optional(chooser.link)
                      : hierarchical_chooses          ? std::optional(hier.link)
                                                      : std::nullopt,
                      hierarchical_chooses ? std::optional(hier.link_across) : std::nullopt, trials,
                      trial_times.size(), std::accumulate(trial_times.begin(), trial_times.end(), 0.0)});
  }
  return rows;
}

#if GRADSYNC_HAS_MPI
// The baseline gradsync is measured against on an MPI job: MPI_Allreduce of the same values on
// MPI_COMM_WORLD (whatever collective component MPI picks: tuned, HAN, UCC...), then the division
// by the world size gradsync's average makes, timed and checked as run_rank does.
// No transport::Mpi lives meanwhile: the baseline is MPI alone, as a program of its own.
std::vector<Row> run_mpi_allreduce(const Config& cfg, int& ranks) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(nullptr, nullptr);
  int n = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ranks = n;
  std::vector<Row> rows;
  for (std::size_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= cfg.step_factor) {
    const std::size_t count = bytes / sizeof(float);
    const std::vector<float> mine = tk::gradient_values(count, rank);
    std::vector<float> values(count);
    std::vector<double> times;
    std::uint64_t wrong = 0;
    for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = Clock::now();
      // Out of place: Open MPI 4.1's HAN crashes on MPI_IN_PLACE (seen here).
      MPI_Allreduce(mine.data(), values.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      for (float& v : values) v /= static_cast<float>(n);
      double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // the slowest rank's
      if (i >= cfg.warmup) times.push_back(us);
      if (i == 0) {
        std::uint64_t mine_digest = digest(values), root_digest = mine_digest;
        MPI_Bcast(&root_digest, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
        std::uint64_t differs = mine_digest != root_digest ? 1 : 0;
        MPI_Allreduce(MPI_IN_PLACE, &differs, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        wrong = differs;
      }
    }
    if (rank == 0) rows.push_back({.bytes = bytes, .time_us = tk::median(times), .wrong = wrong, .topology = "MPI_Allreduce"});
  }
  if (!initialized) MPI_Finalize();
  return rows;
}
#endif

template <class Codec>
std::vector<Row> run(Config& cfg, int& ranks, const Codec& codec) {
#if GRADSYNC_HAS_MPI
  if (cfg.collective == "mpi-allreduce") return run_mpi_allreduce(cfg, ranks);
  if (cfg.transport == "mpi") {
    transport::Mpi mpi;
    ranks = mpi.size();
    const transport::SharedMemoryOptions machine = mpi.machine_options();
    cfg.machine_ranks = machine.local_size;
    if (cfg.ranks_per_machine == 0) cfg.ranks_per_machine = cfg.topology == "hierarchical" || cfg.topology == "auto" ? machine.local_size : 1;
    // Always routed (a machine of one rank has a shared-memory world of one): one more transport
    // type would compile every codec's run_rank again, for what MPI's own shared memory does.
    transport::Routed routed(transport::SharedMemory(machine), std::move(mpi));
    return run_rank(routed, cfg, codec);
  }
#endif
  if (cfg.transport == "shm") {
    transport::SharedMemory shm = transport::SharedMemory::from_env();
    ranks = shm.size();
    return run_rank(shm, cfg, codec);
  }
  if (cfg.transport == "tcp" && cfg.local_transport == "shm" && launch::from_environment().local_world_size > 1) {
    transport::Routed routed(transport::SharedMemory::from_env(), transport::Tcp::from_env());
    ranks = routed.size();
    return run_rank(routed, cfg, codec);
  }
  if (cfg.transport == "tcp") {
    transport::Tcp tcp = transport::Tcp::from_env();
    ranks = tcp.size();
    return run_rank(tcp, cfg, codec);
  }
  ranks = cfg.ranks;
  if (cfg.topology == "hierarchical") (void)hierarchical(cfg).machines(Group::world(0, ranks));  // here, not in a rank's thread
  auto world = transport::InProcess::create_world(cfg.ranks);
  std::vector<Row> rows;
  std::vector<std::thread> threads;
  for (int r = 0; r < cfg.ranks; ++r)
    threads.emplace_back([&, r] {
      auto result = run_rank(world[static_cast<std::size_t>(r)], cfg, codec);
      if (r == 0) rows = std::move(result);
    });
  for (auto& t : threads) t.join();
  return rows;
}

void declare_options(CLI::App& app, Config& cfg) {
  tk::add_choice(app, "--transport", cfg.transport,
                 "in-process: the ranks are threads of this process; shm: one rank per process, all on this "
                 "machine (shared memory); tcp: one rank per process, placed by the launcher's variables (--ranks "
                 "is ignored); mpi: one rank per process of an MPI job (mpirun, srun)",
                 GRADSYNC_HAS_MPI ? std::vector<std::string>{"in-process", "shm", "tcp", "mpi"}
                                  : std::vector<std::string>{"in-process", "shm", "tcp"});
  tk::add_choice(app, "--executor", cfg.executor,
                 "task-graph (the default, the Synchronizer's): steps run as their data allows; serial: one "
                 "thread walks the schedule in list order",
                 {"serial", "task-graph"});
  tk::add_choice(app, "--local-transport", cfg.local_transport,
                 "with tcp and several ranks per machine (LOCAL_WORLD_SIZE > 1): how ranks of one machine talk",
                 {"shm", "tcp"});
  tk::add_number(app, "--ranks", cfg.ranks, "ranks (in-process)", {.low = 1});
  tk::add_byte_size(app, "--min-bytes", cfg.min_bytes, "the first size", {.low = sizeof(float)});
  tk::add_byte_size(app, "--max-bytes", cfg.max_bytes, "no size beyond this", {.low = sizeof(float)});
  tk::add_number(app, "--step-factor", cfg.step_factor, "each size is the one before times this", {.low = 2});
  tk::add_number(app, "--iters", cfg.iters, "timed iterations of each size", {.low = 1});
  tk::add_number(app, "--warmup", cfg.warmup, "iterations before them, not timed", {.low = 1});
  tk::add_codec_options(app, cfg.codec, cfg.codec_settings);
  tk::add_choice(app, "--topology", cfg.topology,
                 "the schedule; auto: recursive doubling, halving-doubling or the ring per size, by the link it "
                 "measures",
                 tk::topology_names);
  tk::add_number(app, "--partitions", cfg.partitions, "the parameter server's parts (0: one per rank)");
  tk::add_number(app, "--ranks-per-machine", cfg.ranks_per_machine,
                 "auto and hierarchical: ranks on each machine, numbered machine-major (default: LOCAL_WORLD_SIZE, else 1)",
                 {.low = 1});
  tk::add_choice(app, "--across", cfg.across,
                 "hierarchical: the schedule across machines; auto: per size, by the links it measures within and "
                 "across machines",
                 across_names);
  tk::add_choice(app, "--within", cfg.within,
                 "hierarchical: the rings among a machine's ranks, or each machine's buckets through one rank "
                 "(leader); auto: per size, as --across",
                 within_names);
  tk::add_byte_size(app, "--chunk-bytes", cfg.chunk_bytes,
                    "the topology's piece size (default: its own, 1 MiB for ring and parameter server, 256 KiB for "
                    "hierarchical)",
                    {.low = sizeof(float)});
  tk::add_choice(app, "--data", cfg.data,
                 "gradient: N(0, 0.01) values, different on every rank, checked for the same bits on every rank; "
                 "constant: rank r gives r + 1, checked element by element against the arithmetic",
                 {"gradient", "constant"});
  if (GRADSYNC_HAS_MPI)
    tk::add_choice(app, "--collective", cfg.collective,
                   "gradsync: the topology's schedule over the transport; mpi-allreduce: MPI's own MPI_Allreduce "
                   "of the same values, timed the same way (--transport mpi, --codec none)",
                   {"gradsync", "mpi-allreduce"});
  app.add_option("--json", cfg.json, "also write the rows as JSON to this file");
  app.footer("Sizes take K, M or G suffixes (binary). GB = 1e9 bytes.");
}

// What carried the messages: tcp alone, or shared memory within each machine and tcp across.
std::string transport_name(const Config& cfg) {
  if (cfg.transport == "mpi") return cfg.machine_ranks > 1 ? "shm+mpi" : "mpi";
  if (cfg.transport != "tcp" || cfg.local_transport != "shm") return cfg.transport;
  const auto local = launch::process_environment("LOCAL_WORLD_SIZE");
  return local && *local != "1" ? "shm+tcp" : "tcp";
}

void report(const Config& cfg, int ranks, const std::vector<Row>& rows) {
  if (cfg.collective == "mpi-allreduce") {
    fmt::print("# MPI_Allreduce beside gradsync's: {} ranks, MPI's own collective (not gradsync's schedule)\n", ranks);
  } else {
    fmt::print("# gradsync allreduce: {} ranks, transport {}, topology {}, codec {}\n", ranks, transport_name(cfg),
               cfg.topology == "ring"                 ? ring_topology(cfg).describe()
               : cfg.topology == "hierarchical"       ? hierarchical(cfg).describe()
               : cfg.topology == "recursive-doubling" ? topology::RecursiveDoubling{}.describe()
               : cfg.topology == "halving-doubling"   ? topology::HalvingDoubling{}.describe()
               : cfg.topology == "auto"               ? auto_topology(cfg).describe()
                                                      : parameter_server(cfg).describe(),
               cfg.codec);
  }
  fmt::print("# {} executor; median of {} iterations after {} warm-up, slowest rank per iteration; memcpy: rank 0, "
             "one thread\n",
             cfg.executor, cfg.iters, cfg.warmup);
  fmt::print("# data {}; #wrong: {}\n", cfg.data,
             cfg.data == "gradient" ? "ranks whose result differs from rank 0's" : "elements off the arithmetic");
  fmt::print("#\n# {:>12} {:>11} {:>5} {:>11} {:>8} {:>8} {:>11} {:>9} {:>6}  {}\n", "size", "count", "type", "time",
             "algbw", "busbw", "memcpy", "time/cpy", "#wrong", "topology");
  fmt::print("# {:>12} {:>11} {:>5} {:>11} {:>8} {:>8} {:>11} {:>9} {:>6}\n", "(B)", "(elements)", "", "(us)",
             "(GB/s)", "(GB/s)", "(us)", "", "");
  std::uint64_t wrong = 0;
  for (const Row& row : rows) {
    const double algbw = static_cast<double>(row.bytes) / row.time_us / 1e3;
    fmt::print("  {:>12} {:>11} {:>5} {:>11.1f} {:>8.3f} {:>8.3f} {:>11.1f} {:>9.2f} {:>6}  {}\n", row.bytes,
               row.bytes / sizeof(float), "float", row.time_us, algbw, algbw * tk::bus_factor(ranks), row.memcpy_us,
               row.time_us / row.memcpy_us, row.checked ? fmt::to_string(row.wrong) : "-",
               row.across.empty()         ? row.topology
               : row.within == "leader" ? fmt::format("{} (leader, {} across)", row.topology, row.across)
                                        : fmt::format("{} ({} across)", row.topology, row.across));
    wrong += row.wrong;
  }
  fmt::print("# {}: {} {}\n", cfg.data == "gradient" ? "ranks differing" : "out of bounds values", wrong,
             wrong ? "ERROR" : "OK");
  for (const Row& row : rows)
    if (row.trial_iterations > 0)
      fmt::print("# auto at {} B: {} iterations before the timed ones, {:.1f} ms, {:.1f} ms beyond as many of the "
                 "kept schedule;{}\n",
                 row.bytes, row.trial_iterations, row.trials_us / 1e3,
                 (row.trials_us - static_cast<double>(row.trial_iterations) * row.time_us) / 1e3, row.trials);
  if (cfg.json.empty()) return;
  tk::Json json = tk::Json::array();
  for (const Row& r : rows) {
    const double algbw = static_cast<double>(r.bytes) / r.time_us / 1e3;
    json.push_back({{"bytes", r.bytes},
                    {"ranks", ranks},
                    {"topology", cfg.collective == "mpi-allreduce" ? std::string("MPI_Allreduce") : cfg.topology},
                    {"schedule", r.topology},
                    {"codec", cfg.codec},
                    {"transport", cfg.collective == "mpi-allreduce" ? std::string("mpi") : transport_name(cfg)},
                    {"collective", cfg.collective},
                    {"executor", cfg.executor},
                    {"data", cfg.data},
                    {"time_us", tk::rounded(r.time_us, 3)},
                    {"algbw_GBps", tk::rounded(algbw, 5)},
                    {"busbw_GBps", tk::rounded(algbw * tk::bus_factor(ranks), 5)},
                    {"memcpy_us", tk::rounded(r.memcpy_us, 3)},
                    {"wrong", r.checked ? tk::Json(r.wrong) : tk::Json()}});
    if (cfg.topology == "hierarchical" || cfg.topology == "auto") json.back()["ranks_per_machine"] = cfg.ranks_per_machine;
    if (!r.across.empty()) json.back()["across"] = r.across;
    if (!r.within.empty()) json.back()["within"] = r.within;
    // The link the run measured (# link measured), which bench/scale_model --validate predicts with.
    if (r.link) {
      json.back()["link_latency_us"] = tk::rounded(r.link->latency * 1e6, 3);
      json.back()["link_GBps"] = tk::rounded(r.link->seconds_per_byte > 0 ? 1e-9 / r.link->seconds_per_byte : 0.0, 6);
    }
    if (r.trial_iterations > 0) {
      json.back()["trials"] = r.trials;
      json.back()["trial_iterations"] = r.trial_iterations;
      json.back()["trials_us"] = tk::rounded(r.trials_us, 3);
    }
    if (r.link_across) {
      json.back()["link_across_latency_us"] = tk::rounded(r.link_across->latency * 1e6, 3);
      json.back()["link_across_GBps"] =
          tk::rounded(r.link_across->seconds_per_byte > 0 ? 1e-9 / r.link_across->seconds_per_byte : 0.0, 6);
    }
  }
  tk::write_json(cfg.json, json);
}

}  // namespace

int main(int argc, char** argv) try {
  Config cfg;
  CLI::App app("nccl-tests style: the time of one allreduce of each size, beside a memcpy of the same bytes",
               "allreduce");
  declare_options(app, cfg);
  if (!tk::parse_options(app, argc, argv)) return 0;
  if (cfg.min_bytes > cfg.max_bytes) throw std::invalid_argument("--min-bytes must not exceed --max-bytes");
  if (cfg.collective == "mpi-allreduce" && (cfg.transport != "mpi" || cfg.codec != "none"))
    throw std::invalid_argument("--collective mpi-allreduce times MPI's own allreduce: it takes --transport mpi and "
                                "--codec none");
  // Under MPI, run() takes the machine's ranks from MPI.
  if (cfg.ranks_per_machine == 0 && cfg.transport != "mpi")
    cfg.ranks_per_machine = cfg.topology == "hierarchical" || cfg.topology == "auto" ? local_world_size() : 1;
  int ranks = 0;
  const std::vector<Row> rows =
      tk::with_codec(cfg.codec, cfg.codec_settings, [&](const auto& codec) { return run(cfg, ranks, codec); });
  if (rows.empty()) return 0;  // not rank 0
  // Measured once the other ranks are done, so that nothing else competes for memory bandwidth.
  std::vector<Row> measured = rows;
  for (Row& r : measured) r.memcpy_us = memcpy_us(r.bytes, cfg.iters);
  report(cfg, ranks, measured);
  for (const Row& r : measured)
    if (r.wrong) return 1;
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "allreduce: %s\n", e.what());
  return 2;
}
