// Call 12a/12c's probe (ruled out): the uploads test_gpu_select's fill was
// waiting on when the driver crashed, alone. Pageable 138 MB host -> device
// copies (cudaMemcpyAsync on the legacy stream + cudaStreamSynchronize),
// between allocations from a cudaMemPool that is never destroyed. It did
// not crash (252 iterations, up to six copies at once); the trigger was a
// pool destroyed with frees queued (README.md).
// Build: nvcc -O2 -arch=sm_90 pageable_upload_repro.cu; run: ./a.out 12 [pool]
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdint>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { std::printf("%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)
int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool use_pool = argc > 2 && std::strcmp(argv[2], "pool") == 0;
  const std::size_t bytes = 270000ull * 2 * 128 * 2;  // 138,240,000: the crash address was this + 0x28
  cudaMemPool_t pool{};
  if (use_pool) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    CK(cudaMemPoolCreate(&pool, &props));
    std::uint64_t keep = UINT64_MAX;
    CK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  std::uint64_t s = 12345;
  for (int it = 0; it < iters; ++it) {
    void* cache = nullptr;
    if (use_pool) CK(cudaMallocFromPoolAsync(&cache, 420000000, pool, nullptr));
    std::vector<std::uint16_t> k, v;
    for (int part = 0; part < 2; ++part) {  // built like fill: two sequences appended
      std::vector<std::uint16_t> a(bytes / 2 / (part ? 1 : 1) * (part ? 200000 : 70000) / 270000);
      for (auto& x : a) { s = s * 6364136223846793005ull + 1442695040888963407ull; x = static_cast<std::uint16_t>(s >> 48); }
      k.insert(k.end(), a.begin(), a.end());
      v.insert(v.end(), a.rbegin(), a.rend());
    }
    void *dk = nullptr, *dv = nullptr;
    CK(cudaMalloc(&dk, k.size() * 2));
    CK(cudaMemcpyAsync(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice, nullptr));
    CK(cudaStreamSynchronize(nullptr));
    CK(cudaMalloc(&dv, v.size() * 2));
    CK(cudaMemcpyAsync(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice, nullptr));
    CK(cudaStreamSynchronize(nullptr));
    CK(cudaDeviceSynchronize());
    CK(cudaFree(dk));
    CK(cudaFree(dv));
    if (use_pool) CK(cudaFreeAsync(cache, nullptr));
    std::printf("iteration %d ok (%zu bytes each)\n", it, k.size() * 2);
    std::fflush(stdout);
  }
  if (use_pool) CK(cudaMemPoolDestroy(pool));
  std::printf("done\n");
  return 0;
}
