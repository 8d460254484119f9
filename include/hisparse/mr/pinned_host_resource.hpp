#pragma once
// Page-locked host memory (cudaMallocHost): readable by host code and by
// kernels, and the only host memory asynchronous copies overlap with compute
// for. Used for staging buffers and host-side index lists.

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::mr {

class pinned_host_resource {
 public:
  static constexpr bool device_accessible = true;
  static constexpr bool host_accessible = true;

  /// Synchronous: the stream is ignored and the memory is usable anywhere at
  /// once.
  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t /*stream*/) {
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, bytes == 0 ? 1 : bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it so later checks do not see it
      throw error(status::out_of_memory,
                  "pinned_host_resource: cannot allocate " + std::to_string(bytes) + " pinned bytes");
    }
    HISPARSE_CUDA_CHECK(e);
    return p;
  }

  /// Kernels can reach this memory, so work still queued on `stream` may use
  /// it: wait for that work before freeing (the contract in resource.hpp).
  void deallocate(void* p, std::size_t /*bytes*/, cudaStream_t stream) {
    if (p == nullptr) return;
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    HISPARSE_CUDA_CHECK(cudaFreeHost(p));
  }

  /// Stateless: any instance frees any other's memory.
  friend bool operator==(const pinned_host_resource&, const pinned_host_resource&) noexcept {
    return true;
  }
};

static_assert(host_resource<pinned_host_resource> && device_resource<pinned_host_resource>);

}  // namespace hisparse::mr
