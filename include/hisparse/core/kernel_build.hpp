#pragma once
// Which machine code the current device runs for a kernel, asked once per
// device: the launches that rely on sm_90 features (thread-block clusters,
// griddepcontrol) fall back to plain launches where the loaded build lacks
// them. Both the PTX and the binary version count: a build for compute_80
// JIT-compiled on an sm_90 part reports binaryVersion 90 but holds no sm_90
// instruction.

#include <atomic>
#include <mutex>

#include <cuda_runtime_api.h>

#include "hisparse/core/macros.hpp"
#include "hisparse/core/status.hpp"

namespace hisparse::detail {

/// Whether the device runs a build of `kernel` compiled from sm_90+ PTX.
inline bool kernel_built_for_sm90(const void* kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
}

/// A yes/no answer per device, computed by `query` the first time a device
/// asks (devices past the cache's size ask every time).
class per_device_flag {
 public:
  template <class Query>
  bool get(Query query) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (device >= kDevices) return query();
    signed char k = known_[device].load(std::memory_order_relaxed);
    if (k == 0) known_[device].store(k = query() ? 2 : 1, std::memory_order_relaxed);
    return k == 2;
  }

 private:
  static constexpr int kDevices = 64;
  std::atomic<signed char> known_[kDevices]{};  // 0 unknown, 1 no, 2 yes
};

/// Raises `Kernel`'s dynamic shared-memory limit to `bytes` whenever a
/// launch needs more than it was last set to on this device. Not only past
/// 48 KB: the static shared memory counts toward the 48 KB default too (a
/// 48 KB ring at head_dim 64 failed to launch without this). One record per
/// kernel (the template argument) and device; the driver call and the
/// record change together under a lock, so threads asking for different
/// sizes leave the largest set, never a record above the driver's limit.
template <auto Kernel>
[[nodiscard]] status raise_dynamic_smem(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> raised[kMaxDevices];
  static std::mutex lock;
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  if (device >= kMaxDevices) {
    HISPARSE_CUDA_TRY(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return status::success;
  }
  if (raised[device].load(std::memory_order_acquire) >= bytes) return status::success;
  const std::lock_guard guard(lock);
  if (raised[device].load(std::memory_order_relaxed) >= bytes) return status::success;
  HISPARSE_CUDA_TRY(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  raised[device].store(bytes, std::memory_order_release);
  return status::success;
}

/// Sets `Kernel`'s preferred shared-memory carveout (cudaSharedmemCarveout*
/// or a percentage) on this device where it differs from the last one set
/// here, so a launch costs no driver call for it. Under a lock like
/// raise_dynamic_smem's: the record always names the carveout last set.
template <auto Kernel>
[[nodiscard]] status prefer_carveout(int carveout) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> last[kMaxDevices];  // carveout + 2; 0: never set
  static std::mutex lock;
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  if (device < kMaxDevices && last[device].load(std::memory_order_acquire) == carveout + 2) return status::success;
  const std::lock_guard guard(lock);
  HISPARSE_CUDA_TRY(cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  if (device < kMaxDevices) last[device].store(carveout + 2, std::memory_order_release);
  return status::success;
}

#if defined(__CUDACC__)
/// 16 bytes of static shared memory only in a build for sm_90a, so the host
/// can tell without a launch whether the build this device loads for this
/// program's kernels holds wgmma (an sm_90 build without the `a` does not).
template <int = 0>
__global__ void sm90a_probe_kernel() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ int marker[4];
  reinterpret_cast<volatile int*>(marker)[threadIdx.x & 3] = 0;
#endif
}

/// Whether the current device runs an sm_90a build (asked once per device).
/// A template, so that only a call compiles the probe kernel into a file.
template <int = 0>
bool built_for_sm90a() {
  static per_device_flag flag;
  return flag.get([] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, sm90a_probe_kernel<0>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.sharedSizeBytes > 0;
  });
}
#endif

}  // namespace hisparse::detail
