#pragma once
// Copies between host and device memory for the Synchronizer's device gradients, which it stages
// through host memory (library gradsync_cuda, src/cuda/memory.cpp; declared wherever gradsync was
// built with CUDA, GRADSYNC_HAS_CUDA). Errors are gradsync::Error naming the operation.

#include <array>
#include <cstddef>

namespace gradsync::cuda {

// Blocking copies on the device's legacy default stream, so they also wait for work the caller
// queued there (a backward pass on the default stream) and are complete when they return.
void copy_to_host(void* host, const void* device, std::size_t bytes, int device_index);
void copy_to_device(void* device, const void* host, std::size_t bytes, int device_index);

// True if `p` is memory of CUDA device `device_index` (cudaMalloc'd or managed).
bool on_device(const void* p, int device_index);

// Device memory of CUDA device `device_index` (cudaMalloc: 256-byte aligned), and its release.
void* allocate_on_device(std::size_t bytes, int device_index);
void free_on_device(void* p, int device_index) noexcept;

// Page-locks host memory that copies use often (faster, and no staging inside the driver); false
// if the system refuses, which leaves the memory usable, only slower to copy.
bool pin(void* host, std::size_t bytes);
void unpin(void* host);

// The UUID of CUDA device `device_index`, which names the physical GPU whatever the process's
// CUDA_VISIBLE_DEVICES numbering: two processes see the same one exactly when they share a GPU.
using DeviceUuid = std::array<std::byte, 16>;
DeviceUuid device_uuid(int device_index);

// CUDA IPC between processes that share a GPU: the handle of a block allocate_on_device() gave
// (the whole cudaMalloc allocation), the block a peer's handle names mapped into this process
// (another process's handle only: CUDA refuses one's own), and the end of that mapping.
using IpcHandle = std::array<std::byte, 64>;
IpcHandle ipc_handle(void* block, int device_index);
void* open_ipc_handle(const IpcHandle& handle, int device_index);
void close_ipc_handle(void* mapped, int device_index) noexcept;

}  // namespace gradsync::cuda
