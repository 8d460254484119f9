#pragma once
// GPU tests report themselves skipped, never passed, on a machine without a
// device: the test prints the marker ctest's SKIP_REGULAR_EXPRESSION matches
// (see test/CMakeLists.txt) and returns before asserting anything.

#include <algorithm>
#include <cstdio>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"

namespace hisparse::test {
inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/// A device buffer for test inputs and outputs (tests may cudaMalloc; the
/// library may not).
template <class T>
struct device_buffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count) {
    HISPARSE_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host, nullptr); }
  ~device_buffer() { cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void upload(const std::vector<T>& host, cudaStream_t stream) {
    HISPARSE_CUDA_CHECK(cudaMemcpyAsync(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void poison(cudaStream_t stream) {  // 0xFF bytes: NaN values, index -1
    HISPARSE_CUDA_CHECK(cudaMemsetAsync(ptr, 0xFF, n * sizeof(T), stream));
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(n);
    HISPARSE_CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
};

}  // namespace hisparse::test

#define HISPARSE_REQUIRE_GPU()                                                  \
  do {                                                                          \
    if (!::hisparse::test::have_gpu()) {                                        \
      std::printf("HISPARSE_TEST_SKIPPED: no CUDA device\n");                   \
      WARN("skipped: no CUDA device");                                          \
      return;                                                                   \
    }                                                                           \
  } while (0)
