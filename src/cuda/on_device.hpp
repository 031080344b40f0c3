#pragma once
// cuda::detail::OnDevice — the compiled CUDA sources' way to make a device current: for one call
// of the library's, putting back the calling thread's own device afterwards. A trainer's thread may
// drive several GPUs (a Synchronizer each), and a ready() that left another device current would
// send the trainer's next kernels there. Private to the library.
//
// A device is put back only where it is in use (its primary context is active; the driver says
// so for the process, not per thread): a thread that never set one reads device 0, and since
// CUDA 12 setting a device creates its context, which would take hundreds of MiB of a GPU the
// process may never use. A caller's own (non-primary) context comes back as that device's primary
// one. The driver is asked through cudaGetDriverEntryPointByVersion (CUDA 12.5 and later); where
// it cannot say, the caller's device is put back. gradsync's own threads make their transport's
// device current once, at their start (cuda::Stream::make_current), so their calls find it
// current and change nothing.

namespace gradsync::cuda::detail {

class OnDevice {
 public:
  // Makes `device` current (throws Error naming `operation` where CUDA refuses), first clearing
  // the error an earlier call left as the thread's last (check.hpp: a launch check reads it).
  OnDevice(int device, const char* operation);
  ~OnDevice();
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int restore_ = -1;  // the caller's device, where it is to be put back
};

}  // namespace gradsync::cuda::detail
