#pragma once
// Counts what passes through to an upstream resource: bytes in use now, the
// peak, the total ever allocated, and the number of calls. Benchmarks report
// peak memory from it; tests use it to prove a container returned everything.

#include <cstddef>
#include <cstdint>
#include <mutex>

#include <cuda_runtime_api.h>

#include "hisparse/mr/resource.hpp"

namespace hisparse::mr {

/// A snapshot of a statistics_adaptor's counters.
struct allocation_statistics {
  std::size_t current_bytes = 0;      ///< allocated and not yet deallocated
  std::size_t peak_bytes = 0;         ///< the most current_bytes has ever been
  std::size_t total_bytes = 0;        ///< sum over every successful allocate
  std::int64_t allocations = 0;       ///< successful allocate calls
  std::int64_t deallocations = 0;     ///< deallocate calls
  std::int64_t current_allocations = 0;  ///< allocations - deallocations
};

/// Non-owning: keeps a reference to `upstream`, which must outlive the
/// adaptor (and the adaptor must outlive everything allocated through it).
/// Thread-safe: the counters are guarded by a mutex that is not held while
/// the upstream works. Failed upstream allocations are not counted.
template <resource Upstream>
class statistics_adaptor {
 public:
  static constexpr bool device_accessible = Upstream::device_accessible;
  static constexpr bool host_accessible = Upstream::host_accessible;

  explicit statistics_adaptor(Upstream& upstream) noexcept : upstream_(&upstream) {}

  // Counters describe one stream of calls: copying or moving would split it.
  statistics_adaptor(const statistics_adaptor&) = delete;
  statistics_adaptor& operator=(const statistics_adaptor&) = delete;

  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t stream) {
    void* p = upstream_->allocate(bytes, stream);  // throws: nothing counted
    const std::lock_guard<std::mutex> lock(mutex_);
    s_.current_bytes += bytes;
    s_.total_bytes += bytes;
    if (s_.current_bytes > s_.peak_bytes) s_.peak_bytes = s_.current_bytes;
    ++s_.allocations;
    ++s_.current_allocations;
    return p;
  }

  void deallocate(void* p, std::size_t bytes, cudaStream_t stream) {
    upstream_->deallocate(p, bytes, stream);
    const std::lock_guard<std::mutex> lock(mutex_);
    s_.current_bytes -= bytes;
    ++s_.deallocations;
    --s_.current_allocations;
  }

  [[nodiscard]] allocation_statistics stats() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return s_;
  }

  [[nodiscard]] Upstream& upstream() const noexcept { return *upstream_; }

  /// Only the adaptor that counted an allocation may count its release:
  /// equality is identity.
  friend bool operator==(const statistics_adaptor& a, const statistics_adaptor& b) noexcept {
    return &a == &b;
  }

 private:
  Upstream* upstream_;
  mutable std::mutex mutex_;
  allocation_statistics s_;
};

}  // namespace hisparse::mr
