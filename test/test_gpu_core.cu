// core/ and mr/ on the device: tensor views and dtype conversions agree with
// the host; a device pool is destroyed only after the device's queued work.
#include <catch2/catch.hpp>

#include <vector>

#include "gpu_test.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/tensor_view.hpp"
#include "hisparse/mr/device_pool_resource.hpp"
#include "test_support.hpp"

using namespace hisparse;

namespace {
// Transposes a strided [rows, cols] view into a contiguous [cols, rows] one,
// converting bf16 to float on the way.
__global__ void transpose_convert(tensor_view<const __nv_bfloat16, 2> in, tensor_view<float, 2> out) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= in.size()) return;
  const std::int64_t r = i / in.extent(1), c = i % in.extent(1);
  out(c, r) = to_float(in(r, c));
}

/// Keeps its stream busy for about `cycles` SM clocks.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
}  // namespace

TEST_CASE("tensor views and bf16 conversion behave the same on the device", "[gpu][core]") {
  HISPARSE_REQUIRE_GPU();
  const int rows = 37, cols = 53;
  std::vector<__nv_bfloat16> host(rows * cols);
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  for (auto& x : host) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  __nv_bfloat16* d_in = nullptr;
  float* d_out = nullptr;
  HISPARSE_CUDA_CHECK(cudaMalloc(&d_in, host.size() * sizeof(__nv_bfloat16)));
  HISPARSE_CUDA_CHECK(cudaMalloc(&d_out, host.size() * sizeof(float)));
  HISPARSE_CUDA_CHECK(cudaMemcpy(d_in, host.data(), host.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  HISPARSE_CUDA_CHECK(cudaMemset(d_out, 0xFF, host.size() * sizeof(float)));  // poison: NaN
  const auto in = tensor_view<const __nv_bfloat16, 2>::contiguous(d_in, rows, cols);
  const auto out = tensor_view<float, 2>::contiguous(d_out, cols, rows);
  transpose_convert<<<(rows * cols + 127) / 128, 128>>>(in, out);
  HISPARSE_CUDA_CHECK(cudaGetLastError());
  std::vector<float> result(host.size());
  HISPARSE_CUDA_CHECK(cudaMemcpy(result.data(), d_out, result.size() * sizeof(float), cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaFree(d_in));
  HISPARSE_CUDA_CHECK(cudaFree(d_out));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) REQUIRE(result[c * rows + r] == to_float(host[r * cols + c]));
}

TEST_CASE("a device pool is destroyed only after the device's queued work, frees included", "[gpu][mr]") {
  HISPARSE_REQUIRE_GPU();
  // Destroying a pool with frees still queued is legal CUDA, but with driver
  // 580.159.04 synchronising their stream afterwards crashes in libcuda
  // (git show 83d1d59:bench/results/2026-12-01-h200-select-concurrent-crash/README.md); the resource
  // waits instead. Here the free queues behind ~0.2 s of work, so without
  // the wait the stream would still be busy after the destructor.
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    mr::device_pool_resource pool;
    void* p = pool.allocate(std::size_t{1} << 20, stream);
    spin<<<1, 1, 0, stream>>>(400'000'000);
    HISPARSE_CUDA_CHECK(cudaGetLastError());
    HISPARSE_CUDA_CHECK(cudaMemsetAsync(p, 0, std::size_t{1} << 20, stream));
    pool.deallocate(p, std::size_t{1} << 20, stream);
    REQUIRE(cudaStreamQuery(stream) == cudaErrorNotReady);  // the spin is still running
  }
  CHECK(cudaStreamQuery(stream) == cudaSuccess);
  const cudaError_t last = cudaGetLastError();  // the query's NotReady above is not an error
  CHECK((last == cudaSuccess || last == cudaErrorNotReady));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
