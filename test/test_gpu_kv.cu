// The paged KV cache on the GPU: appended K/V read back exactly, summaries
// against fp64 sums, decode and ragged prefill appends interleaved, freeing
// and reuse, and bad input rejected with nothing changed.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/limiting_adaptor.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/mr/statistics_adaptor.hpp"
#include "test_support.hpp"

using namespace hisparse;

namespace {

using test::device_buffer;


/// Host mirror of what each (sequence, layer) should hold.
template <class T>
struct mirror {
  int heads, dim;
  std::vector<std::vector<std::vector<T>>> keys, values;  // [seq][layer] -> [t][h][d]
  mirror(int seqs, int layers, int h, int d)
      : heads(h), dim(d), keys(seqs, std::vector<std::vector<T>>(layers)), values(keys) {}
};

template <class T>
std::vector<T> random_rows(std::int64_t rows, int heads, int dim, workload::splitmix64& rng) {
  std::vector<T> v(static_cast<std::size_t>(rows * heads * dim));
  for (auto& x : v) x = from_float<T>(static_cast<float>(rng.normal() + 0.25));
  return v;
}

/// Everything the cache holds for (slot, layer) equals the mirror: K/V bit
/// for bit, slice and block sums within fp32 rounding of fp64 sums.
template <class T, class Cache>
void verify(const Cache& cache, const mirror<T>& m, int slot, int seq, int layer) {
  std::vector<T> k, v;
  cache.download(slot, layer, k, v);
  const auto& ek = m.keys[seq][layer];
  const auto& ev = m.values[seq][layer];
  REQUIRE(k.size() == ek.size());
  REQUIRE(std::memcmp(k.data(), ek.data(), k.size() * sizeof(T)) == 0);
  REQUIRE(std::memcmp(v.data(), ev.data(), v.size() * sizeof(T)) == 0);
  std::vector<float> slice_sums, block_sums;
  std::int32_t device_len = -1;
  cache.download_summaries(slot, layer, slice_sums, block_sums, device_len);
  const std::int64_t len = cache.length(slot, layer);
  REQUIRE(device_len == len);
  const auto& o = cache.options();
  const int H = o.num_kv_heads, D = o.head_dim;
  // Complete slices: the mean (sum / F) agrees with the CPU reference's summaries.
  SparseAttentionConfig cfg;
  cfg.fine_slice = o.fine_slice;
  cfg.coarse_block = o.coarse_block;
  const auto means = reference::slice_means(tensor_view<const T, 3>::contiguous(ek.data(), len, H, D), cfg, len);
  for (std::size_t i = 0; i < means.size(); ++i)
    REQUIRE(slice_sums[i] / o.fine_slice == Approx(means[i]).margin(1e-5).epsilon(1e-5));
  for (const int unit : std::array<int, 2>{o.fine_slice, o.coarse_block}) {
    const auto& got = unit == o.fine_slice ? slice_sums : block_sums;
    for (std::int64_t u = 0; u * unit < len; ++u)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          double sum = 0, mag = 0;
          for (std::int64_t t = u * unit; t < std::min<std::int64_t>(len, (u + 1) * unit); ++t) {
            const double x = to_double(ek[static_cast<std::size_t>((t * H + h) * D + d)]);
            sum += x;
            mag += std::abs(x);
          }
          const double g = got[static_cast<std::size_t>((u * H + h) * D + d)];
          // fp32 accumulation of up to C terms: a few ulps of the magnitude per term.
          REQUIRE(std::abs(g - sum) <= 1e-6 * mag * std::log2(static_cast<double>(unit) + 2) + 1e-30);
        }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("ragged prefill and decode appends read back exactly", "[gpu][kv]", __nv_bfloat16, __half,
                   float) {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  for (const int dim : {64, 128}) {
    INFO("head_dim " << dim);
    mr::device_pool_resource device;
    mr::statistics_adaptor<mr::device_pool_resource> stats(device);
    kv::paged_kv_cache_options o;
    o.num_layers = 2;
    o.num_kv_heads = 4;
    o.head_dim = dim;
    o.fine_slice = 64;
    o.coarse_block = 256;
    o.max_sequences = 4;
    o.max_context = 4096;
    {
      kv::paged_kv_cache<TestType, decltype(stats)> cache(stats, o);
      mirror<TestType> m(4, 2, 4, dim);
      std::vector<int> slot(4);
      for (int s = 0; s < 4; ++s) REQUIRE(cache.add_sequence(3000 + 300 * s, slot[s]) == status::success);
      // Alternate ragged prefill chunks (random lengths, random subsets of
      // sequences) with decode steps, on both layers.
      for (int step = 0; step < 40; ++step) {
        const int layer = static_cast<int>(rng.below(2));
        std::vector<kv::append_segment> segs;
        std::int32_t rows = 0;
        const bool decode = step % 3 == 2;
        for (int s = 0; s < 4; ++s) {
          if (!decode && rng.below(3) == 0) continue;
          const std::int64_t room = 3000 + 300 * s - cache.length(slot[s], layer);
          const std::int64_t want = decode ? 1 : 1 + rng.below(300);
          const auto count = static_cast<std::int32_t>(std::min(room, want));
          if (count <= 0) continue;
          segs.push_back({slot[s], rows, count});
          rows += count;
        }
        if (segs.empty()) continue;
        const auto k = random_rows<TestType>(rows, 4, dim, rng);
        const auto v = random_rows<TestType>(rows, 4, dim, rng);
        device_buffer<TestType> dk(k), dv(v);
        REQUIRE(cache.append_async(layer, segs, dk.ptr, dv.ptr, nullptr) == status::success);
        HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
        for (const auto& seg : segs) {
          const int s = static_cast<int>(std::find(slot.begin(), slot.end(), seg.slot) - slot.begin());
          const auto b = static_cast<std::size_t>(seg.row) * 4 * dim;
          const auto e = b + static_cast<std::size_t>(seg.count) * 4 * dim;
          m.keys[s][layer].insert(m.keys[s][layer].end(), k.begin() + b, k.begin() + e);
          m.values[s][layer].insert(m.values[s][layer].end(), v.begin() + b, v.begin() + e);
        }
      }
      for (int s = 0; s < 4; ++s)
        for (int layer = 0; layer < 2; ++layer) verify(cache, m, slot[s], s, layer);
    }
    CHECK(stats.stats().current_bytes == 0);  // the cache returned everything
  }
}

TEST_CASE("decode appends for a batch of 40 sequences (descriptors uploaded, not inline)", "[gpu][kv]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = 8;
  o.head_dim = 128;
  o.max_sequences = 40;
  o.max_context = 2048;
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, o);
  mirror<__nv_bfloat16> m(40, 1, 8, 128);
  std::vector<int> slots(40);
  for (auto& s : slots) REQUIRE(cache.add_sequence(2048, s) == status::success);
  for (int step = 0; step < 70; ++step) {  // crosses a slice boundary
    const auto k = random_rows<__nv_bfloat16>(40, 8, 128, rng);
    const auto v = random_rows<__nv_bfloat16>(40, 8, 128, rng);
    device_buffer<__nv_bfloat16> dk(k), dv(v);
    REQUIRE(cache.append_decode_async(0, slots, dk.ptr, dv.ptr, nullptr) == status::success);
    for (int s = 0; s < 40; ++s) {
      m.keys[s][0].insert(m.keys[s][0].end(), k.begin() + s * 1024, k.begin() + (s + 1) * 1024);
      m.values[s][0].insert(m.values[s][0].end(), v.begin() + s * 1024, v.begin() + (s + 1) * 1024);
    }
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  for (int s = 0; s < 40; s += 7) verify(cache, m, slots[s], s, 0);
}

TEST_CASE("long prefill chunks fill whole blocks and their summaries", "[gpu][kv]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;  // defaults: 8 heads, 128 dim, F 64, C 1024
  o.max_sequences = 2;
  o.max_context = 40000;
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, o);
  mirror<__nv_bfloat16> m(2, 1, 8, 128);
  int a = 0, b = 0;
  REQUIRE(cache.add_sequence(40000, a) == status::success);
  REQUIRE(cache.add_sequence(40000, b) == status::success);
  for (const std::int32_t chunk : {5000, 16384, 1, 7000}) {
    const auto k = random_rows<__nv_bfloat16>(2 * chunk, 8, 128, rng);
    const auto v = random_rows<__nv_bfloat16>(2 * chunk, 8, 128, rng);
    device_buffer<__nv_bfloat16> dk(k), dv(v);
    const std::vector<kv::append_segment> segs{{a, 0, chunk}, {b, chunk, chunk}};
    REQUIRE(cache.append_async(0, segs, dk.ptr, dv.ptr, nullptr) == status::success);
    const std::size_t half = static_cast<std::size_t>(chunk) * 1024;
    m.keys[0][0].insert(m.keys[0][0].end(), k.begin(), k.begin() + half);
    m.values[0][0].insert(m.values[0][0].end(), v.begin(), v.begin() + half);
    m.keys[1][0].insert(m.keys[1][0].end(), k.begin() + half, k.end());
    m.values[1][0].insert(m.values[1][0].end(), v.begin() + half, v.end());
  }
  verify(cache, m, a, 0, 0);
  verify(cache, m, b, 1, 0);
}

TEST_CASE("freed sequences return their pages and slots for reuse", "[gpu][kv]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.max_sequences = 2;
  o.max_context = 1024;
  kv::paged_kv_cache<__half, mr::device_pool_resource> cache(device, o);
  int a = 0, b = 0, c = 0;
  REQUIRE(cache.add_sequence(1024, a) == status::success);
  REQUIRE(cache.add_sequence(1024, b) == status::success);
  CHECK(cache.add_sequence(10, c) == status::out_of_memory);  // both slots taken
  const auto k = random_rows<__half>(700, 2, 64, rng);
  device_buffer<__half> dk(k), dv(k);
  REQUIRE(cache.append_async(0, std::vector<kv::append_segment>{{a, 0, 700}}, dk.ptr, dv.ptr, nullptr) ==
          status::success);
  const std::int64_t used = cache.pool().stats().pages_used;
  CHECK(used == 11);  // ceil(700 / 64)
  REQUIRE(cache.free_sequence(a) == status::success);
  CHECK(cache.pool().stats().pages_used == 0);
  CHECK_FALSE(cache.active(a));
  REQUIRE(cache.add_sequence(512, c) == status::success);
  mirror<__half> m(1, 1, 2, 64);
  REQUIRE(cache.append_async(0, std::vector<kv::append_segment>{{c, 100, 300}}, dk.ptr, dv.ptr, nullptr) ==
          status::success);
  m.keys[0][0].assign(k.begin() + 100 * 128, k.begin() + 400 * 128);
  m.values[0][0] = m.keys[0][0];
  verify(cache, m, c, 0, 0);
}

TEST_CASE("bad appends are rejected and change nothing", "[gpu][kv][errors]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  mr::limiting_adaptor<mr::device_pool_resource> limited(device, std::size_t{64} << 20);
  kv::paged_kv_cache_options o;
  o.num_kv_heads = 8;
  o.head_dim = 128;
  o.max_sequences = 4;
  o.max_context = 65536;
  o.max_pool_bytes = std::size_t{8} << 20;  // 32 pages of 256 KB
  kv::paged_kv_cache<__nv_bfloat16, decltype(limited)> cache(limited, o);
  int a = 0, b = 0;
  REQUIRE(cache.add_sequence(100, a) == status::success);
  REQUIRE(cache.add_sequence(65536, b) == status::success);
  workload::splitmix64 rng(5);
  const auto k = random_rows<__nv_bfloat16>(4096, 8, 128, rng);
  device_buffer<__nv_bfloat16> dk(k), dv(k);
  auto unchanged = [&] {
    CHECK(cache.length(a, 0) == 0);
    CHECK(cache.length(b, 0) == 0);
    CHECK(cache.pool().stats().pages_used == 0);
  };
  using segs = std::vector<kv::append_segment>;
  CHECK(cache.append_async(0, segs{{a, 0, 101}}, dk.ptr, dv.ptr, nullptr) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("reserved"));
  CHECK(cache.append_async(0, segs{{3, 0, 1}}, dk.ptr, dv.ptr, nullptr) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("unknown sequence"));
  CHECK(cache.append_async(0, segs{{a, 0, 1}, {a, 1, 1}}, dk.ptr, dv.ptr, nullptr) == status::invalid_argument);
  CHECK(cache.append_async(1, segs{{a, 0, 1}}, dk.ptr, dv.ptr, nullptr) == status::invalid_argument);
  CHECK(cache.append_async(0, segs{{a, 0, 1}}, dk.ptr + 1, dv.ptr, nullptr) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("aligned"));
  CHECK(cache.append_async(0, segs{{a, 0, 1}}, nullptr, dv.ptr, nullptr) == status::invalid_argument);
  CHECK(cache.append_async(0, segs{{a, 0, 1}}, static_cast<const void*>(dk.ptr), dv.ptr, dtype::fp16, nullptr) ==
        status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("dtype"));
  CHECK(cache.append_async(0, segs{{a, 0, 0}}, dk.ptr, dv.ptr, nullptr) == status::invalid_argument);
  unchanged();
  // Out of pages: 4096 tokens need 64 pages; the pool may hold 32.
  CHECK(cache.append_async(0, segs{{b, 0, 4096}}, dk.ptr, dv.ptr, nullptr) == status::out_of_memory);
  unchanged();
  // Within the limit it works, and the freed pages serve the next request.
  REQUIRE(cache.append_async(0, segs{{b, 0, 2048}}, dk.ptr, dv.ptr, nullptr) == status::success);
  CHECK(cache.length(b, 0) == 2048);
  REQUIRE(cache.free_sequence(b) == status::success);
  REQUIRE(cache.append_async(0, segs{{a, 0, 100}}, dk.ptr, dv.ptr, nullptr) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(cache.free_sequence(b) == status::invalid_argument);  // already freed
}

// Tagged [expected_api_error]: its 1 PiB request fails inside the CUDA
// runtime on purpose, which compute-sanitizer reports as an API error, so
// scripts/gpu-check.sh runs it without API-error reporting.
TEST_CASE("device and pinned resources allocate usable memory", "[gpu][mr][expected_api_error]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  mr::pinned_host_resource pinned;
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  void* d = device.allocate(1 << 20, stream);
  void* h = pinned.allocate(1 << 20, stream);
  CHECK(reinterpret_cast<std::uintptr_t>(d) % mr::kAlignment == 0);
  std::memset(h, 0x5a, 1 << 20);
  HISPARSE_CUDA_CHECK(cudaMemcpyAsync(d, h, 1 << 20, cudaMemcpyHostToDevice, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::memset(h, 0, 1 << 20);
  HISPARSE_CUDA_CHECK(cudaMemcpyAsync(h, d, 1 << 20, cudaMemcpyDeviceToHost, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  CHECK(static_cast<unsigned char*>(h)[12345] == 0x5a);
  device.deallocate(d, 1 << 20, stream);
  pinned.deallocate(h, 1 << 20, stream);
  CHECK_THROWS_AS(device.allocate(std::size_t{1} << 50, stream), error);  // 1 PiB: out of memory, clearly
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
