#pragma once
// Caps the bytes in use through an upstream resource. Its purpose is
// emulation: an H200 (141 GB) under a 48 GB limit runs out of memory where an
// RTX 4090 would, so capacity planning and out-of-memory paths can be tested
// on the larger card.
//
// The limit counts requested bytes, not the upstream's rounding, so it is
// exact for the page pool (whose chunks are multiples of kAlignment) and a
// slight overestimate of headroom for odd sizes.

#include <cstddef>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::mr {

/// Non-owning: keeps a reference to `upstream`, which must outlive the
/// adaptor (and the adaptor must outlive everything allocated through it).
/// Thread-safe: bytes are reserved under a mutex before the upstream is
/// called, so concurrent callers can never overshoot the limit together.
template <resource Upstream>
class limiting_adaptor {
 public:
  static constexpr bool device_accessible = Upstream::device_accessible;
  static constexpr bool host_accessible = Upstream::host_accessible;

  limiting_adaptor(Upstream& upstream, std::size_t limit_bytes) noexcept
      : upstream_(&upstream), limit_(limit_bytes) {}

  // The byte count belongs to one stream of calls: copying would split it.
  limiting_adaptor(const limiting_adaptor&) = delete;
  limiting_adaptor& operator=(const limiting_adaptor&) = delete;

  /// Throws error(out_of_memory) without calling the upstream when `bytes`
  /// would take the bytes in use above the limit.
  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t stream) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > limit_ - used_)  // used_ <= limit_ always, so no wrap-around
        throw error(status::out_of_memory,
                    "limiting_adaptor: requested " + std::to_string(bytes) + " bytes with " +
                        std::to_string(used_) + " bytes in use and a limit of " +
                        std::to_string(limit_) + " bytes");
      used_ += bytes;
    }
    try {
      return upstream_->allocate(bytes, stream);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(mutex_);
      used_ -= bytes;
      throw;
    }
  }

  void deallocate(void* p, std::size_t bytes, cudaStream_t stream) {
    upstream_->deallocate(p, bytes, stream);
    const std::lock_guard<std::mutex> lock(mutex_);
    used_ -= bytes;
  }

  /// Bytes allocated through this adaptor and not yet deallocated.
  [[nodiscard]] std::size_t used() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return used_;
  }
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }
  [[nodiscard]] Upstream& upstream() const noexcept { return *upstream_; }

  /// Only the adaptor that counted an allocation may count its release:
  /// equality is identity.
  friend bool operator==(const limiting_adaptor& a, const limiting_adaptor& b) noexcept {
    return &a == &b;
  }

 private:
  Upstream* upstream_;
  std::size_t limit_;
  mutable std::mutex mutex_;
  std::size_t used_ = 0;
};

}  // namespace hisparse::mr
