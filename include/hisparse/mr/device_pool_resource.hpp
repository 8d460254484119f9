#pragma once
// A stream-ordered device resource on a memory pool of its own.
//
// Why its own cudaMemPool_t rather than the device's default pool: the
// release threshold and trimming are per pool, so HiSparse's caching policy
// cannot change the behaviour of the engine's other cudaMallocAsync users,
// and destroying the resource hands everything back at once.
//
// Only CUDA runtime API calls, so host-only translation units (g++) can use it.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::mr {

class device_pool_resource {
 public:
  static constexpr bool device_accessible = true;
  static constexpr bool host_accessible = false;

  /// Default release threshold: keep everything. Memory freed to the pool
  /// stays mapped for the next allocation instead of being unmapped at every
  /// synchronization point; a serving engine's working set (KV chunks,
  /// workspaces) is steady, so unmapping and remapping it would only add
  /// latency and synchronization. Call `trim()` or pass a lower threshold
  /// when other users of the device need the memory back.
  static constexpr std::uint64_t kKeepAll = std::numeric_limits<std::uint64_t>::max();

  /// A pool on the current device.
  device_pool_resource() : device_pool_resource(current_device()) {}

  /// A pool on `device`. Throws hisparse::error(cuda_error) when the device
  /// does not exist, and error(unsupported) when it has no memory pools.
  explicit device_pool_resource(int device, std::uint64_t release_threshold = kKeepAll)
      : device_(device) {
    int supported = 0;
    HISPARSE_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    if (supported == 0)
      throw error(status::unsupported, "device " + std::to_string(device) +
                                           " does not support stream-ordered memory pools");
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    HISPARSE_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    const cudaError_t e =
        cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &release_threshold);
    if (e != cudaSuccess) {
      (void)cudaMemPoolDestroy(pool_);  // the threshold error is the one to report
      pool_ = nullptr;
      HISPARSE_CUDA_CHECK(e);
    }
  }

  // Move-only: the pool has one owner, which destroys it.
  device_pool_resource(const device_pool_resource&) = delete;
  device_pool_resource& operator=(const device_pool_resource&) = delete;
  device_pool_resource(device_pool_resource&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), device_(other.device_) {}
  device_pool_resource& operator=(device_pool_resource&& other) noexcept {
    if (this != &other) {
      destroy();
      pool_ = std::exchange(other.pool_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }

  /// Waits for the pool's device, then destroys the pool. Free every
  /// allocation first: CUDA would release the pool when the last one is
  /// freed, the deferred release that the driver gets wrong below (that
  /// case itself has not been tried).
  ///
  /// The wait (cudaDeviceSynchronize on the pool's device) is there because
  /// CUDA allows destroying a pool whose frees are still queued, and with
  /// driver 580.159.04 synchronising their stream afterwards crashes inside
  /// libcuda (SIGSEGV) every time; until then the pool's memory is not given
  /// back. Under load the frees were often still queued, so the crash showed
  /// up as test binaries dying beside other GPU processes (reproducer:
  /// `git show 83d1d59:bench/results/2026-12-01-h200-select-concurrent-crash/README.md`).
  /// Destroying a pool is not on a hot path, but it does block until this
  /// process's work on the device is done, and it must not run while another
  /// thread captures a CUDA graph in global mode (the wait would invalidate
  /// that capture).
  ///
  /// A failure here is not reported: a destructor has no caller to report
  /// to, and at process exit the runtime may already be unloading.
  ~device_pool_resource() { destroy(); }

  [[nodiscard]] void* allocate(std::size_t bytes, cudaStream_t stream) {
    if (pool_ == nullptr)
      throw error(status::invalid_argument, "device_pool_resource: allocate on a moved-from resource");
    void* p = nullptr;
    // A 0-byte request still gets a unique, freeable pointer (the contract).
    const std::size_t request = bytes == 0 ? 1 : bytes;
    const cudaError_t e = cudaMallocFromPoolAsync(&p, request, pool_, stream);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it so later checks do not see it
      throw error(status::out_of_memory, "device_pool_resource: cannot allocate " +
                                             std::to_string(bytes) + " bytes on device " +
                                             std::to_string(device_));
    }
    HISPARSE_CUDA_CHECK(e);
    return p;
  }

  void deallocate(void* p, std::size_t /*bytes*/, cudaStream_t stream) {
    if (p == nullptr) return;
    HISPARSE_CUDA_CHECK(cudaFreeAsync(p, stream));
  }

  /// Returns cached memory above `keep_bytes` to the system (when another
  /// process or pool needs it). Unmaps only memory no allocation is using.
  void trim(std::size_t keep_bytes = 0) { HISPARSE_CUDA_CHECK(cudaMemPoolTrimTo(pool_, keep_bytes)); }

  [[nodiscard]] cudaMemPool_t pool() const noexcept { return pool_; }
  [[nodiscard]] int device() const noexcept { return device_; }

  /// Memory from one pool can be freed only into that pool.
  friend bool operator==(const device_pool_resource& a, const device_pool_resource& b) noexcept {
    return a.pool_ == b.pool_;
  }

 private:
  static int current_device() {
    int d = 0;
    HISPARSE_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  void destroy() noexcept {
    if (pool_ == nullptr) return;
    int current = -1;
    const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != device_;
    if (switch_device) (void)cudaSetDevice(device_);
    (void)cudaDeviceSynchronize();  // no frees queued when the pool goes (see the destructor)
    (void)cudaMemPoolDestroy(pool_);
    if (switch_device) (void)cudaSetDevice(current);
    pool_ = nullptr;
  }

  cudaMemPool_t pool_ = nullptr;
  int device_ = 0;
};

static_assert(device_resource<device_pool_resource>);

}  // namespace hisparse::mr
