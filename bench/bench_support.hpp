#pragma once
// Helpers shared by the GPU benchmarks: CUDA-event timing, the median, an
// owning device array and a device-side normal fill. (Benchmarks, unlike the
// library, may allocate with cudaMalloc directly.)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#ifdef __CUDACC__
#include "hisparse/kv/paged_kv_cache.cuh"
#endif

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

#ifdef __CUDACC__
/// Keeps one SM busy for about `ns` nanoseconds (a template: a header's
/// kernel would otherwise be compiled into every translation unit).
template <int = 0>
__global__ void busy_kernel(long long ns) {
  for (long long t = 0; t < ns; t += 1000) __nanosleep(1000);
}

/// Host seconds per call of `f` (which enqueues work on `stream`) with the
/// GPU kept busy, so no call waits on the device: the CPU cost of a launch
/// sequence, as torch_ops_bench.py measures the ops'.
template <class F>
double host_seconds_per_call(F&& f, cudaStream_t stream, int calls = 200) {
  f();
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> samples;
  for (int i = 0; i < 5; ++i) {
    busy_kernel<<<1, 1, 0, stream>>>(50'000'000);
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) f();
    samples.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return median(samples);
}
#endif

/// An owning device allocation of n elements (at least one, so a zero-size
/// request still gets a valid pointer), optionally filled from the host.
template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n) {
    HISPARSE_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit device_array(const std::vector<T>& h) : device_array(h.size()) {
    HISPARSE_CUDA_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
};

/// A CUDA graph of `launches` back-to-back calls of `enqueue(stream, i)`,
/// launched once to warm up; step_seconds times one replay per launch.
struct replay_graph {
  cudaGraphExec_t exec = nullptr;
  int launches;
  template <class F>
  replay_graph(cudaStream_t stream, int launches_, F&& enqueue) : launches(launches_) {
    cudaGraph_t graph = nullptr;
    HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < launches; ++i) enqueue(stream, i);
    HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
    HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  ~replay_graph() { cudaGraphExecDestroy(exec); }
  replay_graph(const replay_graph&) = delete;
  replay_graph& operator=(const replay_graph&) = delete;
  double step_seconds(event_timer& timer, cudaStream_t stream) const {
    return timer.seconds([&] { HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, stream) / launches;
  }
};

/// How many disjoint copies of a working set a benchmark cycles through so
/// that every launch reads from HBM, not from the L2 the previous launches
/// filled: enough copies to touch twice the L2 between two reads of one
/// copy, at least 1, and no more than fit in half the free device memory
/// (each copy holds `footprint` bytes; `touched` of them are read per
/// launch). A decode step reads each layer's cache once; replaying one
/// small batch over the same cache would time L2 hits instead.
inline int cold_copies(double touched, double footprint) {
  int device = 0, l2 = 0;
  HISPARSE_CUDA_CHECK(cudaGetDevice(&device));
  HISPARSE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  std::size_t free = 0, total = 0;
  HISPARSE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const double want = std::ceil(2.0 * l2 / std::max(touched, 1.0));
  const double fit = std::floor(0.5 * static_cast<double>(free) / std::max(footprint, 1.0));
  return static_cast<int>(std::max(1.0, std::min(want, fit)));
}

#ifdef __CUDACC__
/// x[i] = mean + a standard normal sample drawn from (seed, i): a
/// splitmix64 hash of both, through Box-Muller.
template <class T>
__global__ void fill_normal_kernel(T* x, std::size_t n, std::uint64_t seed, float mean) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t z = seed * 0xD1B54A32D192ED03ull + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u1 = (static_cast<float>(z & 0xFFFFFF) + 0.5f) * 0x1p-24f;
    const float u2 = static_cast<float>((z >> 24) & 0xFFFFFF) * 0x1p-24f;
    x[i] = from_float<T>(mean + sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

/// Fills a device array with normal samples (variance 1) on the device:
/// inputs as large as a 256K-token KV cache, all distinct, without host
/// generation.
template <class T>
void fill_normal(T* x, std::size_t n, std::uint64_t seed, float mean = 0.0f, cudaStream_t stream = nullptr) {
  fill_normal_kernel<<<1024, 256, 0, stream>>>(x, n, seed, mean);
  HISPARSE_CUDA_CHECK(cudaGetLastError());
}

/// Adds `batch` sequences of `context` tokens of random keys and values
/// (every element N(key_mean, 1)) to a paged cache, appended in 16K-token
/// chunks drawn afresh on the device, and returns their slots. Every block
/// and slice sum differs: one chunk appended again and again repeats each
/// block score 16 times at 256K, and such ties double the selection's
/// survivors.
template <class Cache, class Rng>
std::vector<std::int32_t> fill_cache(Cache& cache, int batch, std::int32_t context, Rng& rng, float key_mean = 0.0f) {
  using T = typename Cache::value_type;
  constexpr std::int32_t kChunk = 16384;
  const std::size_t chunk_elems =
      static_cast<std::size_t>(kChunk) * cache.options().num_kv_heads * cache.options().head_dim;
  device_array<T> chunk(chunk_elems);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(batch));
  for (auto& s : slots) {
    int slot = 0;
    throw_if_error(cache.add_sequence(context, slot));
    s = slot;
    for (std::int32_t done = 0; done < context; done += kChunk) {
      const std::int32_t n = std::min(kChunk, context - done);
      fill_normal(chunk.ptr, chunk_elems, rng.next(), key_mean);
      throw_if_error(cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, n}}, chunk.ptr, chunk.ptr, nullptr));
    }
  }
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  return slots;
}
#endif

}  // namespace hisparse::bench
