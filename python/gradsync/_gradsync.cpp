// gradsync's Python module: a Synchronizer whose policies are picked by name at run time (the
// shipped combinations, shipped.hpp), over the launched job's ranks (shared memory within a
// machine, TCP across; the launcher's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
// LOCAL_WORLD_SIZE and GRADSYNC_TOKEN, or those given as `environment`), for the memory of arrays
// that export DLPack: torch tensors and numpy arrays on the CPU, contiguous, f32, f64, f16 or bf16.
//
// The module keeps a reference to every array it was given, for as long as the synchronizer
// lives: the synchronizer reads and writes their memory. wait() releases the GIL while it blocks.
// gradsync's errors arrive as Python exceptions carrying its message: a broken rule of the API or
// a bad setting as ValueError, a peer that failed as gradsync.PeerFailed, a wait past its deadline
// as gradsync.Timeout, anything else as gradsync.Error (all three RuntimeErrors).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "gradsync/shipped.hpp"
#include "toolkit/codec_by_name.hpp"
#include "toolkit/connect.hpp"
#include "toolkit/topology_by_name.hpp"

namespace py = pybind11;
namespace gs = gradsync;

namespace {

gs::DType dtype_of(const DLDataType& t, const std::string& name) {
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 32) return gs::DType::f32;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 64) return gs::DType::f64;
  if (t.lanes == 1 && t.code == kDLFloat && t.bits == 16) return gs::DType::f16;
  if (t.lanes == 1 && t.code == kDLBfloat && t.bits == 16) return gs::DType::bf16;
  const char* kind = t.code == kDLInt ? "int" : t.code == kDLUInt ? "uint" : t.code == kDLFloat ? "float"
                    : t.code == kDLBfloat ? "bfloat" : t.code == kDLComplex ? "complex" : "bool or other";
  throw py::value_error(fmt::format("gradient {:?} is {}{}{}; gradsync averages float32, float64, float16 and "
                                    "bfloat16",
                                    name, kind, t.bits, t.lanes == 1 ? "" : fmt::format(" x{}", t.lanes)));
}

// The memory `array` exports through DLPack, checked: in CPU memory, contiguous, a float type.
gs::TensorView view_of(const py::object& array, const std::string& name) {
  if (!py::hasattr(array, "__dlpack__"))
    throw py::type_error(fmt::format("gradient {:?}: a {} does not export DLPack (__dlpack__); pass a torch tensor "
                                     "or a numpy array",
                                     name, std::string(py::str(py::type::handle_of(array)))));
  const py::object capsule = array.attr("__dlpack__")();
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // The capsule stays unconsumed: its destructor frees the description; the memory is the
  // array's, which the synchronizer keeps.
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU)
    throw py::value_error(fmt::format("gradient {:?} is not in CPU memory (DLPack device type {})", name,
                                      static_cast<int>(t.device.device_type)));
  std::int64_t count = 1, expected_stride = 1;
  for (int d = t.ndim; d-- > 0;) {
    if (t.strides != nullptr && t.shape[d] > 1 && t.strides[d] != expected_stride)
      throw py::value_error(fmt::format("gradient {:?} is not contiguous", name));
    expected_stride *= t.shape[d];
    count *= t.shape[d];
  }
  return {static_cast<char*>(t.data) + t.byte_offset, static_cast<std::size_t>(count), dtype_of(t.dtype, name),
          gs::Device::cpu()};
}

gs::shipped::Bucketing bucketing_named(const std::string& name) {
  if (name == "fixed-size") return gs::bucketing::FixedSize{};
  if (name == "per-tensor") return gs::bucketing::PerTensor{};
  if (name == "time-clustered") return gs::bucketing::TimeClustered{};
  throw py::value_error(fmt::format("bucketing {:?}: choose fixed-size, per-tensor or time-clustered", name));
}

// The job's transport: the launcher's variables from the process environment, those in
// `environment` first where it is given (a job that learns its rendezvous another way: the DDP
// hook takes a port and token from torch.distributed's store).
gs::JobTransport connect(const std::optional<std::map<std::string, std::string>>& environment) {
  if (!environment) return gs::toolkit::connect_or_alone();
  const gs::launch::Environment lookup = [&](std::string_view name) -> std::optional<std::string> {
    if (const auto found = environment->find(std::string(name)); found != environment->end()) return found->second;
    return gs::launch::process_environment(name);
  };
  return gs::JobTransport(gs::transport::SharedMemory(gs::transport::SharedMemory::options_from_env(lookup)),
                          gs::transport::Tcp(gs::transport::Tcp::options_from_env(lookup)));
}

gs::Executor executor_named(const std::string& name) {
  if (name == "task-graph") return gs::Executor::task_graph;
  if (name == "serial") return gs::Executor::serial;
  throw py::value_error(fmt::format("executor {:?}: choose task-graph or serial", name));
}

// The Synchronizer the names pick, and the arrays whose memory it synchronizes.
class Synchronizer {
 public:
  Synchronizer(const std::string& bucketing, const std::string& codec, const std::string& topology,
               const std::string& executor, float threshold, double keep, std::uint64_t seed, double timeout,
               const std::string& timeline, const std::optional<std::map<std::string, std::string>>& environment) {
    if (!(timeout > 0)) throw py::value_error(fmt::format("timeout {} s: more than 0", timeout));
    gs::Options options;
    options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout * 1000.0));
    options.executor = executor_named(executor);
    options.timeline = timeline;
    gs::shipped::Bucketing chosen_bucketing = bucketing_named(bucketing);
    gs::JobTransport transport = connect(environment);
    gs::shipped::Topology chosen_topology;
    try {
      chosen_topology = gs::toolkit::topology_named(topology, {.ranks_per_machine = transport.local_size()});
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    const gs::toolkit::CodecSettings settings{.threshold = threshold, .keep = keep, .seed = seed, .rank = transport.rank()};
    gs::shipped::Codec chosen_codec;
    try {
      chosen_codec = gs::toolkit::codec_named(codec, settings);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    sync_ = gs::make_synchronizer(std::move(transport), options, chosen_bucketing, chosen_codec, chosen_topology);
  }

  gs::GradId add(const std::string& name, const py::object& array) {
    const gs::TensorView view = view_of(array, name);
    const gs::GradId id = sync_->add(name, view);
    arrays_.push_back(array);
    ids_.emplace(name, id);
    return id;
  }

  // Without the GIL: the first ready() (or wait()) waits for every rank's first, and a ready()
  // packs and starts the buckets it completes, while Python's other threads may run.
  void ready(gs::GradId id) {
    py::gil_scoped_release unlocked;
    sync_->ready(id);
  }
  void ready_named(const std::string& name) {
    const auto found = ids_.find(name);
    if (found == ids_.end()) throw py::key_error(fmt::format("no gradient is named {:?}", name));
    py::gil_scoped_release unlocked;
    sync_->ready(found->second);
  }

  void wait() {
    py::gil_scoped_release unlocked;
    sync_->wait();
  }
  bool try_wait() {
    py::gil_scoped_release unlocked;
    return sync_->try_wait();
  }

  int rank() const { return sync_->rank(); }
  int size() const { return sync_->size(); }
  py::list names() const {
    py::list out;
    for (const gs::GradientInfo& g : sync_->layout()) out.append(g.name);
    return out;
  }
  py::list plan() const {
    py::list out;
    for (const auto& bucket : sync_->plan().buckets) {
      py::list ids;
      for (const gs::GradId id : bucket) ids.append(id);
      out.append(ids);
    }
    return out;
  }
  py::dict last_iteration() const {
    const gs::IterationStats& s = sync_->last_iteration();
    py::dict out;
    out["iteration"] = s.iteration;
    out["buckets"] = s.buckets;
    out["bytes_sent"] = s.bytes_sent;
    out["bytes_uncompressed"] = s.bytes_uncompressed;
    out["exposed_seconds"] = std::chrono::duration<double>(s.exposed).count();
    out["after_last_ready_seconds"] = std::chrono::duration<double>(s.after_last_ready).count();
    py::list schedules;
    for (const gs::BucketSchedule& bucket : s.schedules) {
      py::dict one;
      one["schedule"] = bucket.schedule;
      one["predicted_seconds"] = bucket.predicted_seconds;
      one["seconds"] = bucket.seconds;
      schedules.append(one);
    }
    out["schedules"] = schedules;
    return out;
  }

 private:
  std::vector<py::object> arrays_;  // destroyed after sync_, which uses their memory until then
  std::unordered_map<std::string, gs::GradId> ids_;
  std::unique_ptr<gs::AnySynchronizer> sync_;
};

}  // namespace

PYBIND11_MODULE(_gradsync, m) {
  m.doc() = "gradsync: gradient synchronization for data-parallel training (the C++ library's Synchronizer)";
  static py::exception<gs::Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<gs::Error> peer_failed(m, "PeerFailed", error.ptr());
  static py::exception<gs::Error> timeout(m, "Timeout", error.ptr());
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const gs::Error& e) {
      switch (e.kind()) {
        case gs::ErrorKind::invalid_argument:
        case gs::ErrorKind::unsupported: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case gs::ErrorKind::peer_failed: PyErr_SetString(peer_failed.ptr(), e.what()); return;
        case gs::ErrorKind::timeout: PyErr_SetString(timeout.ptr(), e.what()); return;
        default: PyErr_SetString(error.ptr(), e.what()); return;
      }
    }
  });

  py::class_<Synchronizer>(m, "Synchronizer",
                           "Averages registered gradients over the job's ranks. Policies by name: bucketing "
                           "(fixed-size, per-tensor, time-clustered), codec (none, fp16, bf16, two-bit, one-bit, "
                           "terngrad, top-k, random-k, ef-two-bit, ef-one-bit, ef-top-k, ef-random-k), topology "
                           "(auto: per bucket, by the measured link; ring, recursive-doubling, halving-doubling, "
                           "parameter-server, hierarchical), executor (task-graph, serial).")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&, float, double,
                    std::uint64_t, double, const std::string&, const std::optional<std::map<std::string, std::string>>&>(),
           py::kw_only(), py::arg("bucketing") = "fixed-size", py::arg("codec") = "none", py::arg("topology") = "auto",
           py::arg("executor") = "task-graph", py::arg("threshold") = gs::compression::TwoBit{}.threshold,
           py::arg("keep") = 0.01, py::arg("seed") = 0, py::arg("timeout") = 300.0, py::arg("timeline") = "",
           py::arg("environment") = py::none())
      .def("add", &Synchronizer::add, py::arg("name"), py::arg("array"),
           "Registers `array` (CPU, contiguous, float32/64/16 or bfloat16) under `name`, in the same order on every "
           "rank, before the first ready() or wait(); returns its id. Its memory is read and overwritten in place.")
      .def("ready", &Synchronizer::ready, py::arg("id"), "Marks gradient `id` as holding this step's local value.")
      .def("ready", &Synchronizer::ready_named, py::arg("name"))
      .def("wait", &Synchronizer::wait, "Blocks (without the GIL) until every gradient holds the average.")
      .def("try_wait", &Synchronizer::try_wait)
      .def_property_readonly("rank", &Synchronizer::rank)
      .def_property_readonly("size", &Synchronizer::size)
      .def_property_readonly("names", &Synchronizer::names)
      .def_property_readonly("plan", &Synchronizer::plan, "The buckets in use, as lists of gradient ids.")
      .def_property_readonly("last_iteration", &Synchronizer::last_iteration);
}
