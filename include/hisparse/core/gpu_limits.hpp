#pragma once
// What a launch plan needs to know of the GPU: multiprocessors, shared
// memory and whether it has thread-block clusters. Host calls only (no
// stream work), so planning stays capturable.

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

/// The current device's multiprocessors and shared memory.
[[nodiscard]] inline status current_gpu_limits(gpu_limits& gpu) {
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.sms, cudaDevAttrMultiProcessorCount, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  return status::success;
}

}  // namespace hisparse
