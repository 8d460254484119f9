#pragma once
// Helpers shared by the GPU benchmarks: CUDA-event timing and the median.
// (Benchmarks, unlike the library, may allocate with cudaMalloc directly.)

#include <algorithm>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"

namespace hisparse::bench {

/// Times device work on the legacy default stream with two CUDA events.
struct event_timer {
  cudaEvent_t a{}, b{};
  event_timer() {
    HISPARSE_CUDA_CHECK(cudaEventCreate(&a));
    HISPARSE_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~event_timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  event_timer(const event_timer&) = delete;
  event_timer& operator=(const event_timer&) = delete;

  /// Seconds between events recorded on `stream` around `f()` (which
  /// enqueues work on it).
  template <class F>
  double seconds(F&& f, cudaStream_t stream = nullptr) {
    HISPARSE_CUDA_CHECK(cudaEventRecord(a, stream));
    f();
    HISPARSE_CUDA_CHECK(cudaEventRecord(b, stream));
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e-3;
  }
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace hisparse::bench
