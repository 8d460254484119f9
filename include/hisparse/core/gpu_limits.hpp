#pragma once
// What a launch plan needs to know of the GPU: multiprocessors, shared
// memory and whether it has thread-block clusters. Host calls only (no
// stream work), so planning stays capturable.

#include <mutex>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"

namespace hisparse {

/// The defaults are an sm_90 part (H100/H200: 228 KB of shared memory per SM,
/// 227 KB per CTA, thread-block clusters); an RTX 4090 (sm_89) has 100 KB
/// and 99 KB and no clusters. `current_gpu_limits` reads the real ones.
struct gpu_limits {
  int sms = 0;
  int smem_per_sm = 228 * 1024;
  int smem_per_block = 227 * 1024;
  int cc_major = 9;  ///< compute capability, major: clusters from 9 on
};

/// The current device's multiprocessors and shared memory. A device's
/// limits do not change while the process runs, so each device is asked
/// once (the prefill launches call this every run).
[[nodiscard]] inline status current_gpu_limits(gpu_limits& gpu) {
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  constexpr int kDevices = 64;
  static std::mutex mutex;
  static gpu_limits known[kDevices];
  static bool asked[kDevices] = {};
  const std::lock_guard<std::mutex> lock(mutex);
  if (device < kDevices && asked[device]) {
    gpu = known[device];
    return status::success;
  }
  gpu_limits g;
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&g.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&g.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&g.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  if (device < kDevices) {
    known[device] = g;
    asked[device] = true;
  }
  gpu = g;
  return status::success;
}

}  // namespace hisparse
