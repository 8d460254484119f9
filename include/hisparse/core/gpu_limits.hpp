#pragma once
// What a launch plan needs to know of the GPU: multiprocessors and shared
// memory. Host calls only (no stream work), so planning stays capturable.

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"

namespace hisparse {

/// The defaults are an sm_90 part (H100/H200: 228 KB of shared memory per SM,
/// 227 KB per CTA); an RTX 4090 (sm_89) has 100 KB and 99 KB.
/// `current_gpu_limits` reads the real ones.
struct gpu_limits {
  int sms = 0;
  int smem_per_sm = 228 * 1024;
  int smem_per_block = 227 * 1024;
};

/// The current device's multiprocessors and shared memory.
[[nodiscard]] inline status current_gpu_limits(gpu_limits& gpu) {
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.sms, cudaDevAttrMultiProcessorCount, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&gpu.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return status::success;
}

}  // namespace hisparse
