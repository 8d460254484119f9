#pragma once
// GPU tests report themselves skipped, never passed, on a machine without a
// device: the test prints the marker ctest's SKIP_REGULAR_EXPRESSION matches
// (see test/CMakeLists.txt) and returns before asserting anything.

#include <cstdio>

#include <cuda_runtime_api.h>

namespace hisparse::test {
inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
}  // namespace hisparse::test

#define HISPARSE_REQUIRE_GPU()                                                  \
  do {                                                                          \
    if (!::hisparse::test::have_gpu()) {                                        \
      std::printf("HISPARSE_TEST_SKIPPED: no CUDA device\n");                   \
      WARN("skipped: no CUDA device");                                          \
      return;                                                                   \
    }                                                                           \
  } while (0)
