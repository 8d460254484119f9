// Candidate minimal reproducer of the driver fault (twenty-third session):
// destroy a cudaMemPool_t while cudaFreeAsync calls on it are still queued
// behind work on a non-blocking stream, then start the next cycle with a new
// pool and synchronise the legacy stream, as test_gpu_select's test cases did
// before c242f09. Run several copies at once so the GPU is busy.
//   nvcc -O2 -arch=sm_90 pool_destroy_repro.cu -o pool_destroy_repro
//   ./pool_destroy_repro SECONDS [wait|late]
//     (none): the legacy stream synchronised after each destroy;
//     wait:   cudaDeviceSynchronize before each destroy (the fix);
//     late:   the work stream synchronised after each destroy.
// Exit 0 after SECONDS of cycles; a crash is the driver's.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

__global__ void busy(float* p, std::size_t n, long long cycles) {
  const long long t0 = clock64();
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = 1.0f;
  while (clock64() - t0 < cycles) {
  }
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 30.0;
  const char* mode = argc > 2 ? argv[2] : "none";
  const bool wait = std::strcmp(mode, "wait") == 0, late = std::strcmp(mode, "late") == 0;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto start = std::chrono::steady_clock::now();
  long cycles = 0;
  unsigned rng = 12345;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    cudaMemPool_t pool;
    CHECK(cudaMemPoolCreate(&pool, &props));
    for (int j = 0; j < 16; ++j) {
      rng = rng * 1664525u + 1013904223u;
      const std::size_t n = (std::size_t{1} << 18) + (rng >> 8) % (std::size_t{1} << 22);
      void* p = nullptr;
      CHECK(cudaMallocFromPoolAsync(&p, n * sizeof(float), pool, s));
      busy<<<132, 256, 0, s>>>(static_cast<float*>(p), n, 200000);
      CHECK(cudaGetLastError());
      CHECK(cudaFreeAsync(p, s));
    }
    if (wait) CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemPoolDestroy(pool));  // frees possibly still queued
    CHECK(cudaStreamSynchronize(late ? s : nullptr));
    ++cycles;
  }
  CHECK(cudaStreamSynchronize(s));
  std::printf("%ld cycles, mode %s\n", cycles, mode);
  return 0;
}
