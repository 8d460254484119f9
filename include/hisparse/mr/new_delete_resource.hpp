#pragma once
// Ordinary host memory from the aligned global operator new. Kernels cannot
// use it; it exists so host-side containers (the page pool, say) can be
// tested and used without a GPU.

#include <cstddef>
#include <new>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::mr {

class new_delete_resource {
 public:
  static constexpr bool device_accessible = false;
  static constexpr bool host_accessible = true;

  /// Synchronous: the stream is ignored.
  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t /*stream*/) {
    try {
      // operator new(0) already returns a unique pointer, as the contract asks.
      return ::operator new(bytes, std::align_val_t{kAlignment});
    } catch (const std::bad_alloc&) {
      throw error(status::out_of_memory,
                  "new_delete_resource: cannot allocate " + std::to_string(bytes) + " host bytes");
    }
  }

  /// No device can reach this memory, so nothing queued can still use it.
  void deallocate(void* p, std::size_t bytes, cudaStream_t /*stream*/) noexcept {
    if (p == nullptr) return;
    ::operator delete(p, bytes, std::align_val_t{kAlignment});
  }

  /// Stateless: any instance frees any other's memory.
  friend bool operator==(const new_delete_resource&, const new_delete_resource&) noexcept {
    return true;
  }
};

static_assert(host_resource<new_delete_resource> && !device_resource<new_delete_resource>);

}  // namespace hisparse::mr
