// The host side of include/gradsync/cuda/memory.hpp.

#include "gradsync/cuda/memory.hpp"

#include <cuda_runtime.h>

#include <cstring>

#include <fmt/format.h>

#include "check.hpp"
#include "on_device.hpp"
#include "gradsync/error.hpp"

namespace gradsync::cuda {

namespace {
// detail::check, naming the device and the size.
void check(cudaError_t status, const char* operation, std::size_t bytes, int device) {
  if (status != cudaSuccess) detail::check(status, operation, fmt::format("CUDA device {}, {} bytes", device, bytes));
}
}  // namespace

void copy_to_host(void* host, const void* device, std::size_t bytes, int device_index) {
  if (bytes == 0) return;
  const detail::OnDevice on(device_index, "copy to host");
  check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "copy to host", bytes, device_index);
}

void copy_to_device(void* device, const void* host, std::size_t bytes, int device_index) {
  if (bytes == 0) return;
  const detail::OnDevice on(device_index, "copy to device");
  check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "copy to device", bytes, device_index);
}

void* allocate_on_device(std::size_t bytes, int device_index) {
  void* p = nullptr;
  const detail::OnDevice on(device_index, "allocate");
  check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "allocate", bytes, device_index);
  return p;
}

void free_on_device(void* p, int device_index) noexcept {
  if (!p) return;
  try {
    const detail::OnDevice on(device_index, "free");
    if (cudaFree(p) != cudaSuccess) cudaGetLastError();
  } catch (const Error&) {  // the device cannot be made current: nothing to free on it
  }
}

bool on_device(const void* p, int device_index) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return false;
  }
  return (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) &&
         attributes.device == device_index;
}

bool pin(void* host, std::size_t bytes) {
  if (bytes == 0) return false;
  if (cudaHostRegister(host, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

void unpin(void* host) {
  if (cudaHostUnregister(host) != cudaSuccess) cudaGetLastError();
}

DeviceUuid device_uuid(int device_index) {
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, device_index), "device uuid", 0, device_index);
  DeviceUuid uuid;
  static_assert(sizeof(properties.uuid.bytes) == sizeof(DeviceUuid));
  std::memcpy(uuid.data(), properties.uuid.bytes, uuid.size());
  return uuid;
}

IpcHandle ipc_handle(void* block, int device_index) {
  static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(IpcHandle));
  cudaIpcMemHandle_t handle{};
  const detail::OnDevice on(device_index, "ipc handle");
  check(cudaIpcGetMemHandle(&handle, block), "ipc handle", 0, device_index);
  IpcHandle bytes;
  std::memcpy(bytes.data(), &handle, bytes.size());
  return bytes;
}

void* open_ipc_handle(const IpcHandle& bytes, int device_index) {
  cudaIpcMemHandle_t handle{};
  std::memcpy(&handle, bytes.data(), bytes.size());
  void* mapped = nullptr;
  const detail::OnDevice on(device_index, "open ipc handle");
  check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), "open ipc handle", 0, device_index);
  return mapped;
}

void close_ipc_handle(void* mapped, int device_index) noexcept {
  if (!mapped) return;
  try {
    const detail::OnDevice on(device_index, "close ipc handle");
    if (cudaIpcCloseMemHandle(mapped) != cudaSuccess) cudaGetLastError();
  } catch (const Error&) {
  }
}

}  // namespace gradsync::cuda
