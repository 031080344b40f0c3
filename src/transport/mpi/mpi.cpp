// transport::Mpi (include/gradsync/transport/mpi.hpp): MPI's initialisation where the program has
// not made it, the collective setup (a communicator of our own, the wire versions, the machines),
// and the calls handed to the engine (engine.hpp).

#include <sodium.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gradsync/transport/mpi.hpp"
#include "transport/errors.hpp"
#include "transport/mpi/engine.hpp"

namespace gradsync::transport {

namespace {

Error setup_error(int code, const char* call) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Error(ErrorKind::internal, {.operation = "mpi setup"}, fmt::format("{} failed: {}", call, std::string(text, static_cast<std::size_t>(length))));
}

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw setup_error(code, call);
}

// MPI initialised by gradsync is finalised by gradsync, once, when the process exits; a program
// that initialised MPI itself finalises it itself.
struct OwnInitialisation {
  ~OwnInitialisation() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};

void initialise_unless_done() {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized)
    throw Error(ErrorKind::unsupported, {.operation = "mpi setup"}, "MPI was finalised already: it cannot start again");
  if (initialized) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  static OwnInitialisation own;
}

const char* level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

// "Open MPI v4.1.4": the library's own words up to the first comma or line's end.
std::string library_name() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) return "MPI";
  std::string name(text, static_cast<std::size_t>(length));
  name = name.substr(0, name.find_first_of(",\n"));
  while (!name.empty() && (name.back() == ' ' || name.back() == '\0')) name.pop_back();
  return name;
}

}  // namespace

namespace detail {

// What each rank tells the others at setup, and what every rank learns about its machine.
struct MpiMachines {
  SharedMemoryOptions local{};
  std::string numbering_problem{};  // why machine_options() cannot be given, if it cannot
  int machines = 1;
};

}  // namespace detail

namespace {

// Every rank's wire version, compared: each rank names the ranks that differ from it.
void check_wire_versions(MPI_Comm communicator, int rank, int size) {
  const std::array<std::uint32_t, 2> mine{mpi_wire::magic, mpi_wire::version};
  std::vector<std::uint32_t> all(2 * static_cast<std::size_t>(size));
  check(MPI_Allgather(mine.data(), 2, MPI_UINT32_T, all.data(), 2, MPI_UINT32_T, communicator), "MPI_Allgather");
  std::vector<std::string> others;
  for (int r = 0; r < size; ++r) {
    const std::uint32_t magic = all[2 * static_cast<std::size_t>(r)], version = all[2 * static_cast<std::size_t>(r) + 1];
    if (magic != mpi_wire::magic)
      others.push_back(fmt::format("rank {} is not gradsync's transport::Mpi", r));
    else if (version != mpi_wire::version)
      others.push_back(fmt::format("rank {} speaks wire version {}", r, version));
  }
  if (!others.empty())
    throw Error(ErrorKind::protocol, {.rank = rank, .operation = "mpi setup"},
                fmt::format("this rank speaks transport::Mpi's wire version {}, but {}", mpi_wire::version,
                            fmt::join(others, "; ")));
}

// The machine as MPI sees it, and the job name and token rank 0 draws for the machines' segments.
detail::MpiMachines learn_machines(MPI_Comm communicator, int rank) {
  detail::MpiMachines m;
  MPI_Comm local;
  check(MPI_Comm_split_type(communicator, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local), "MPI_Comm_split_type");
  int local_rank = 0, local_size = 1, first = rank;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  check(MPI_Bcast(&first, 1, MPI_INT, 0, local), "MPI_Bcast");
  MPI_Comm_free(&local);
  int leader = local_rank == 0 ? 1 : 0, consecutive = rank == first + local_rank ? 1 : 0;
  check(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_SUM, communicator), "MPI_Allreduce");
  check(MPI_Allreduce(MPI_IN_PLACE, &consecutive, 1, MPI_INT, MPI_LAND, communicator), "MPI_Allreduce");
  m.machines = leader;
  if (!consecutive)
    m.numbering_problem = fmt::format(
        "MPI numbers the ranks of a machine apart (this rank {} is local rank {} of a machine whose first rank is {}): "
        "launch them consecutively (mpirun --map-by slot or core, srun --distribution=block)",
        rank, local_rank, first);
  std::array<unsigned char, 32> secret{};
  if (rank == 0) {
    if (sodium_init() < 0) throw Error(ErrorKind::internal, {.rank = rank, .operation = "mpi setup"}, "libsodium failed to start");
    randombytes_buf(secret.data(), secret.size());
  }
  check(MPI_Bcast(secret.data(), static_cast<int>(secret.size()), MPI_UNSIGNED_CHAR, 0, communicator), "MPI_Bcast");
  std::string hex(2 * secret.size() + 1, '\0');
  sodium_bin2hex(hex.data(), hex.size(), secret.data(), secret.size());
  hex.pop_back();
  m.local = {.local_rank = local_rank, .local_size = local_size, .first_rank = first, .job = "mpi-" + hex.substr(0, 32),
             .token = hex.substr(32)};
  return m;
}

}  // namespace

namespace detail {

// The engine and what setup learned, behind Mpi's one pointer.
struct MpiState {
  MpiState(const MpiSetup& setup, MpiMachines m, std::string d)
      : engine(setup), machines(std::move(m)), description(std::move(d)) {}
  MpiEngine engine;
  MpiMachines machines;
  std::string description;
};

}  // namespace detail

Mpi::Mpi(const MpiOptions& options) {
  if (options.communicator == MPI_COMM_NULL)
    throw Error(ErrorKind::invalid_argument, {.operation = "mpi setup"},
                "MpiOptions::communicator is MPI_COMM_NULL: pass a communicator this rank belongs to");
  initialise_unless_done();
  int level = MPI_THREAD_SINGLE;
  check(MPI_Query_thread(&level), "MPI_Query_thread");
  if (level < MPI_THREAD_SERIALIZED)
    throw Error(ErrorKind::unsupported, {.operation = "mpi setup"},
                fmt::format("MPI was initialised with {}: transport::Mpi's progress thread needs MPI_THREAD_SERIALIZED "
                            "or MPI_THREAD_MULTIPLE (MPI_Init_thread's `required`)",
                            level_name(level)));
  detail::MpiSetup setup{.thread_level = level, .max_message_bytes = options.max_message_bytes};
  check(MPI_Comm_dup(options.communicator, &setup.communicator), "MPI_Comm_dup");
  try {
    check(MPI_Comm_set_errhandler(setup.communicator, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(setup.communicator, &setup.rank);
    MPI_Comm_size(setup.communicator, &setup.size);
    int* tag_ub = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr(MPI_TAG_UB)");
    if (found && tag_ub) setup.tag_ub = *tag_ub;
    check_wire_versions(setup.communicator, setup.rank, setup.size);
    detail::MpiMachines machines = learn_machines(setup.communicator, setup.rank);
    std::string description = fmt::format("mpi {} ({} ranks, {} machine{})", library_name(), setup.size, machines.machines,
                                          machines.machines == 1 ? "" : "s");
    state_ = std::make_unique<detail::MpiState>(setup, std::move(machines), std::move(description));
  } catch (...) {
    MPI_Comm_free(&setup.communicator);
    throw;
  }
}

Mpi::Mpi(Mpi&&) noexcept = default;
Mpi& Mpi::operator=(Mpi&&) noexcept = default;
Mpi::~Mpi() = default;

int Mpi::rank() const noexcept { return state_->engine.rank(); }
int Mpi::size() const noexcept { return state_->engine.size(); }
int Mpi::thread_level() const noexcept { return state_->engine.thread_level(); }
std::string Mpi::describe() const { return state_->description; }

SharedMemoryOptions Mpi::machine_options() const {
  if (!state_->machines.numbering_problem.empty())
    throw Error(ErrorKind::invalid_argument, {.rank = rank(), .operation = "machine_options"}, state_->machines.numbering_problem);
  return state_->machines.local;
}

void Mpi::send(Request& r, int peer, std::uint64_t tag, std::span<const std::byte> bytes) { state_->engine.send(r, peer, tag, bytes); }
void Mpi::recv(Request& r, int peer, std::uint64_t tag, std::span<std::byte> bytes) { state_->engine.recv(r, peer, tag, bytes); }
bool Mpi::test(Request& r) { return state_->engine.test(r); }
std::size_t Mpi::wait(Request& r, std::chrono::steady_clock::time_point deadline) { return state_->engine.wait(r, deadline); }
void Mpi::abort(const Error& cause) { state_->engine.abort(cause); }

}  // namespace gradsync::transport
