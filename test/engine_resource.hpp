#pragma once
// How a serving engine plugs its own memory into HiSparse. This file is the
// template for engines: copy `engine_resource`, replace the two upstream
// calls with calls into the engine's allocator (the caching pool that already
// owns most of the GPU), and keep the rest. What matters:
//  * the signatures the mr::resource concept checks (allocate, deallocate,
//    ==, and the two compile-time accessibility flags, which must tell the
//    truth: a device_accessible resource's memory is handed to kernels);
//  * the contract in include/hisparse/mr/resource.hpp: allocate never
//    returns null (throw hisparse::error(status::out_of_memory, reason)
//    instead), pointers are 256-byte aligned, and deallocate on stream s may
//    run while work on s still uses the memory;
//  * no base class and no registration: a page_pool<engine_resource<...>>
//    takes a reference to it, and it must outlive the pool.
// In the tests the upstream is new_delete_resource, and the counters let
// them prove that the pool returns everything it took.

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "hisparse/mr/resource.hpp"

namespace hisparse::test {

template <mr::resource Upstream>
class engine_resource {
 public:
  static constexpr bool device_accessible = Upstream::device_accessible;
  static constexpr bool host_accessible = Upstream::host_accessible;

  explicit engine_resource(Upstream& upstream) noexcept : upstream_(&upstream) {}

  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t stream) {
    void* p = upstream_->allocate(bytes, stream);  // an engine: its own pool's malloc
    ++allocate_calls;
    bytes_in_use += bytes;
    return p;
  }

  void deallocate(void* p, std::size_t bytes, cudaStream_t stream) {
    upstream_->deallocate(p, bytes, stream);  // an engine: its own pool's free
    ++deallocate_calls;
    bytes_in_use -= bytes;
  }

  // Two instances are interchangeable when they forward to the same pool.
  friend bool operator==(const engine_resource& a, const engine_resource& b) noexcept {
    return a.upstream_ == b.upstream_;
  }

  std::int64_t allocate_calls = 0;
  std::int64_t deallocate_calls = 0;
  std::size_t bytes_in_use = 0;

 private:
  Upstream* upstream_;
};

/// A misbehaving resource: returns null instead of throwing. The page pool
/// must turn that into a clear out_of_memory and stay consistent.
class null_resource {
 public:
  static constexpr bool device_accessible = false;
  static constexpr bool host_accessible = true;

  [[nodiscard]] void* allocate(std::size_t, cudaStream_t) {
    ++allocate_calls;
    return nullptr;
  }
  void deallocate(void*, std::size_t, cudaStream_t) { ++deallocate_calls; }
  friend bool operator==(const null_resource&, const null_resource&) noexcept { return true; }

  std::int64_t allocate_calls = 0;
  std::int64_t deallocate_calls = 0;
};

}  // namespace hisparse::test
