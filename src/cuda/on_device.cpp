// cuda::detail::OnDevice (on_device.hpp).

#include "on_device.hpp"

#include <cuda.h>  // the driver's types only: its functions are looked up through the runtime
#include <cuda_runtime.h>

#include <fmt/format.h>

#include "check.hpp"

namespace gradsync::cuda::detail {

namespace {

// Whether `device`'s primary context is active, asked of the driver through the runtime's
// entry-point lookup (linking libcuda would keep the library from loading where there is no
// driver, as in CI). True where the driver cannot say: then the caller's device is put back.
bool in_use(int device) {
  struct Driver {
    CUresult (*get)(CUdevice*, int) = nullptr;
    CUresult (*get_state)(CUdevice, unsigned*, int*) = nullptr;
  };
  static const Driver driver = [] {
    Driver d;
    void* get = nullptr;
    void* get_state = nullptr;
    cudaDriverEntryPointQueryResult found_get{}, found_state{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 12000, cudaEnableDefault, &found_get) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &get_state, 12000, cudaEnableDefault,
                                         &found_state) == cudaSuccess &&
        found_get == cudaDriverEntryPointSuccess && found_state == cudaDriverEntryPointSuccess) {
      d.get = reinterpret_cast<CUresult (*)(CUdevice*, int)>(get);
      d.get_state = reinterpret_cast<CUresult (*)(CUdevice, unsigned*, int*)>(get_state);
    }
    cudaGetLastError();
    return d;
  }();
  if (!driver.get) return true;
  CUdevice handle{};
  unsigned flags = 0;
  int active = 0;
  if (driver.get(&handle, device) != CUDA_SUCCESS || driver.get_state(handle, &flags, &active) != CUDA_SUCCESS)
    return true;
  return active != 0;
}

}  // namespace

OnDevice::OnDevice(int device, const char* operation) {
  cudaGetLastError();
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  if (current == device) return;
  check(cudaSetDevice(device), operation, fmt::format("CUDA device {}", device));
  if (current >= 0 && in_use(current)) restore_ = current;
}

OnDevice::~OnDevice() {
  if (restore_ >= 0 && cudaSetDevice(restore_) != cudaSuccess) cudaGetLastError();
}

}  // namespace gradsync::cuda::detail
