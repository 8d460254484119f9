// The paged KV cache on the GPU: appended K/V read back exactly, summaries
// against fp64 sums, slice key bounds bit for bit, decode and ragged prefill
// appends interleaved, freeing and reuse, and bad input rejected with nothing
// changed.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>
#include <vector>

#include "cache_download.hpp"
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

/// Keys spread wide (3 sigma) and never zero: the signed zeros are planted
/// where a test wants them.
template <class T>
std::vector<T> nonzero_keys(std::int64_t rows, int heads, int dim, workload::splitmix64& rng) {
  std::vector<T> v(static_cast<std::size_t>(rows * heads * dim));
  for (auto& x : v) {
    do {
      x = from_float<T>(static_cast<float>(3 * rng.normal()));
    } while (to_float(x) == 0.0f);
  }
  return v;
}

/// The slice key bounds the cache should hold for keys [t][heads][dim]:
/// [ceil(t/F)][heads][dim] words of each dimension's minimum and maximum over
/// the slice's stored keys, NaN where one of them is NaN.
template <class T>
std::vector<std::uint32_t> expected_bounds(const std::vector<T>& keys, int heads, int dim, int F) {
  const auto vec = static_cast<std::size_t>(heads) * dim;
  const std::size_t len = keys.size() / vec, slices = (len + F - 1) / F;
  std::vector<std::uint32_t> words(slices * vec);
  for (std::size_t s = 0; s < slices; ++s)
    for (std::size_t i = 0; i < vec; ++i) {
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
      bool nan = false;
      for (std::size_t t = s * F; t < std::min(len, (s + 1) * F); ++t) {
        const float x = to_float(keys[t * vec + i]);
        nan = nan || std::isnan(x);
        lo = std::min(lo, x), hi = std::max(hi, x);
      }
      words[s * vec + i] = key_bounds_word(nan ? std::numeric_limits<float>::quiet_NaN() : lo, hi);
    }
  return words;
}

/// Everything the cache holds for (slot, layer) equals the mirror: K/V bit
/// for bit, slice and block sums within fp32 rounding of fp64 sums.
template <class T, class Cache>
void verify(const Cache& cache, const mirror<T>& m, int slot, int seq, int layer) {
  std::vector<T> k, v;
  test::download_kv(cache.ref(), slot, layer, k, v);
  const auto& ek = m.keys[seq][layer];
  const auto& ev = m.values[seq][layer];
  REQUIRE(k.size() == ek.size());
  REQUIRE(std::memcmp(k.data(), ek.data(), k.size() * sizeof(T)) == 0);
  REQUIRE(std::memcmp(v.data(), ev.data(), v.size() * sizeof(T)) == 0);
  std::vector<float> slice_sums, block_sums;
  std::int32_t device_len = -1;
  test::download_summaries(cache.ref(), slot, layer, slice_sums, block_sums, device_len);
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

TEMPLATE_TEST_CASE("the cache keeps every slice's and block's key bounds exactly", "[gpu][kv]", __nv_bfloat16,
                   __half, float) {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  constexpr int kSeqs = 3, kLayers = 2, H = 4, F = 64;
  constexpr float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  constexpr std::uint32_t kNaNWord = 0x7fc07fc0u;
  for (const int D : {64, 128}) {  // 16 and 8 row groups per CTA
    INFO("head_dim " << D);
    mr::device_pool_resource device;
    kv::paged_kv_cache_options o;
    o.num_layers = kLayers;
    o.num_kv_heads = H;
    o.head_dim = D;
    o.fine_slice = F;
    o.coarse_block = 256;
    o.max_sequences = kSeqs;
    o.max_context = 2048;
    o.fine_summary = fine_summary::key_bounds;
    o.coarse_summary = coarse_summary::key_bounds;
    kv::paged_kv_cache<TestType, mr::device_pool_resource> cache(device, o);
    REQUIRE(cache.ref().keeps(fine_summary::key_bounds));
    REQUIRE(cache.ref().keeps(coarse_summary::key_bounds));
    mirror<TestType> m(kSeqs, kLayers, H, D);
    std::vector<int> slot(kSeqs);
    for (auto& s : slot) REQUIRE(cache.add_sequence(2048, s) == status::success);

    // A special key on layer 0: sequence, token within the appended chunk, head, dim.
    struct plant {
      int seq;
      std::int32_t token;
      int h, d;
      float x;
    };
    std::set<std::tuple<int, std::int64_t, int, int>> nan_words;  // (sequence, slice, head, dim)
    // Appends counts[s] new tokens to sequence s on every layer (one batch per layer).
    auto append = [&](const std::array<std::int32_t, kSeqs>& counts, const std::vector<plant>& plants) {
      for (int layer = 0; layer < kLayers; ++layer) {
        std::vector<kv::append_segment> segs;
        std::array<std::int32_t, kSeqs> first_row{};
        std::int32_t rows = 0;
        for (int s = 0; s < kSeqs; ++s)
          if (counts[s] > 0) {
            segs.push_back({slot[s], rows, counts[s]});
            first_row[s] = rows;
            rows += counts[s];
          }
        auto k = nonzero_keys<TestType>(rows, H, D, rng);
        const auto v = nonzero_keys<TestType>(rows, H, D, rng);
        if (layer == 0)
          for (const auto& p : plants) {
            k[static_cast<std::size_t>(((first_row[p.seq] + p.token) * H + p.h) * D + p.d)] = from_float<TestType>(p.x);
            if (std::isnan(p.x))
              nan_words.insert({p.seq, (cache.length(slot[p.seq], 0) + p.token) / F, p.h, p.d});
          }
        device_buffer<TestType> dk(k), dv(v);
        REQUIRE(cache.append_async(layer, segs, dk.ptr, dv.ptr, nullptr) == status::success);
        HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());  // before dk and dv go
        for (int s = 0; s < kSeqs; ++s) {
          const auto b = static_cast<std::size_t>(first_row[s]) * H * D;
          const auto e = b + static_cast<std::size_t>(counts[s]) * H * D;
          m.keys[s][layer].insert(m.keys[s][layer].end(), k.begin() + b, k.begin() + e);
          m.values[s][layer].insert(m.values[s][layer].end(), v.begin() + b, v.begin() + e);
        }
      }
    };
    // Every word of every (sequence, layer) bit for bit; NaN exactly where planted.
    auto check = [&](const char* phase) {
      INFO(phase);
      std::size_t nan_seen = 0, nan_expected = 0;
      for (int s = 0; s < kSeqs; ++s)
        for (int layer = 0; layer < kLayers; ++layer) {
          const auto got = test::download_fine_rows<fine_summary::key_bounds>(cache.ref(), slot[s], layer);
          const auto want = expected_bounds(m.keys[s][layer], H, D, F);
          REQUIRE(got.size() == want.size());
          std::size_t bad = 0, first = 0;
          for (std::size_t i = 0; i < got.size(); ++i)
            if (got[i] != want[i] && bad++ == 0) first = i;
          std::ostringstream where;
          if (bad != 0)
            where << "sequence " << s << " layer " << layer << ": " << bad << " words differ, first slice "
                  << first / (H * D) << " head " << first / D % H << " dim " << first % D << ": got 0x" << std::hex
                  << got[first] << ", want 0x" << want[first];
          INFO(where.str());
          CHECK(bad == 0);
          // Each block's words: the union of its slices' (decode appends
          // widen it in place, prefill batches rebuild it).
          const auto blocks = test::download_block_bounds(cache.ref(), slot[s], layer);
          const int spb = o.coarse_block / F;
          std::size_t block_bad = 0;
          for (std::size_t i = 0; i < blocks.size(); ++i) {
            const std::size_t vec = static_cast<std::size_t>(H) * D, blk = i / vec, e = i % vec;
            std::uint32_t w = key_bounds_word(kInf, -kInf);
            for (std::size_t sl = blk * spb; sl < std::min(want.size() / vec, (blk + 1) * spb); ++sl)
              w = widened_bounds(w, want[sl * vec + e]);
            block_bad += blocks[i] != w;
          }
          INFO("sequence " << s << " layer " << layer << ": block words that differ");
          CHECK(block_bad == 0);
          nan_seen += static_cast<std::size_t>(std::count(got.begin(), got.end(), kNaNWord));
          nan_expected += static_cast<std::size_t>(std::count(want.begin(), want.end(), kNaNWord));
          if (layer == 1) verify(cache, m, slot[s], s, layer);  // no inf or NaN there: sums still right
        }
      CHECK(nan_expected == nan_words.size());  // the plants landed where the test means them to
      CHECK(nan_seen == nan_words.size());
    };

    // A prefill batch: 1000 tokens (15 slices and 40 tokens), 37, and 130.
    // Infinities and NaNs in whole and partial slices, the last token
    // included; one dimension gets both infinities.
    append({1000, 37, 130}, {{0, 5, 1, 3, kNaN},
                             {0, 70, 2, 7, kInf},
                             {0, 72, 2, 7, -kInf},
                             {0, 71, 2, 8, -kInf},
                             {0, 999, 0, 0, kNaN},
                             {1, 36, 3, D - 1, kInf},
                             {2, 0, 1, 1, -kInf},
                             {2, 129, 0, 5, kNaN}});
    check("prefill");
    // Decode: 30 single tokens each. Sequence 0 crosses 1024, sequence 1
    // crosses 64 (stored words combined until then, overwritten after).
    for (std::int32_t step = 0; step < 30; ++step) {
      std::vector<plant> plants;
      if (step == 10) plants.push_back({0, 0, 3, 4, kNaN});  // a stored partial slice, NaN already in another dim
      if (step == 24) plants.push_back({0, 0, 0, 9, kInf});  // token 1024: a fresh slice's first
      if (step == 27) plants.push_back({1, 0, 2, 2, -kInf});  // token 64
      append({1, 1, 1}, plants);
    }
    check("decode");
    // Chunks that start mid-slice: 1030 + 300 and 67 + 5.
    append({300, 5, 0}, {{0, 0, 1, 2, kNaN}, {1, 4, 0, 0, -kInf}});
    check("mid-slice chunk");
    // A freed slot's next sequence overwrites the old bounds (its NaN in
    // slice 2, the -inf in slice 0) rather than combining with them.
    REQUIRE(cache.free_sequence(slot[2]) == status::success);
    REQUIRE(cache.add_sequence(2048, slot[2]) == status::success);
    for (auto& layer_keys : m.keys[2]) layer_keys.clear();
    for (auto& layer_values : m.values[2]) layer_values.clear();
    std::erase_if(nan_words, [](const auto& w) { return std::get<0>(w) == 2; });
    // Its slice 1, head 1, dimension 3: +0 and -0 alternating. Whichever
    // zero a minimum or maximum meets first, the word is -0 below and +0
    // above (key_bounds_word).
    std::vector<plant> zeros;
    for (std::int32_t t = 64; t < 128; ++t) zeros.push_back({2, t, 1, 3, t % 2 == 0 ? 0.0f : -0.0f});
    append({1, 1, 150}, zeros);
    check("slot reuse");
    const auto words = test::download_fine_rows<fine_summary::key_bounds>(cache.ref(), slot[2], 0);
    CHECK(words[static_cast<std::size_t>((1 * H + 1) * D + 3)] == 0x00008000u);
  }
}

TEST_CASE("slice key bounds need summaries and are kept only on request", "[gpu][kv][errors]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  using cache_t = kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource>;
  kv::paged_kv_cache_options o;
  o.max_sequences = 1;
  o.max_context = 256;
  cache_t plain(device, o);
  CHECK(plain.ref().keeps(fine_summary::mean));
  CHECK_FALSE(plain.ref().keeps(fine_summary::key_bounds));
  CHECK_FALSE(plain.ref().keeps(fine_summary::mean_bf16));
  int a = 0;
  REQUIRE(plain.add_sequence(256, a) == status::success);
  CHECK_THROWS_WITH(test::download_fine_rows<fine_summary::key_bounds>(plain.ref(), a, 0),
                    Catch::Contains("keeps no key_bounds rows"));
  o.fine_summary = fine_summary::key_bounds;
  o.maintain_summaries = false;
  CHECK_THROWS_WITH(cache_t(device, o), Catch::Contains("fine_summary key_bounds needs maintain_summaries"));
  o.fine_summary = static_cast<fine_summary>(7);
  o.maintain_summaries = true;
  CHECK_THROWS_WITH(cache_t(device, o), Catch::Contains("fine_summary must be mean, mean_bf16 or key_bounds"));
  // Block bounds are their slices' bounds' union: they need those.
  o.fine_summary = fine_summary::mean;
  o.coarse_summary = coarse_summary::key_bounds;
  CHECK_THROWS_WITH(cache_t(device, o), Catch::Contains("coarse_summary key_bounds needs fine_summary key_bounds"));
  CHECK_FALSE(plain.ref().keeps(coarse_summary::key_bounds));
  CHECK_THROWS_WITH(test::download_block_bounds(plain.ref(), a, 0), Catch::Contains("keeps no block bounds"));
}

TEST_CASE("a cache allocates exactly its footprint", "[gpu][kv][budget]") {
  HISPARSE_REQUIRE_GPU();
  for (int variant = 0; variant < 4; ++variant) {
    // Each fine summary, then key bounds at both levels.
    const auto kind = std::array{fine_summary::mean, fine_summary::mean_bf16, fine_summary::key_bounds,
                                 fine_summary::key_bounds}[static_cast<std::size_t>(variant)];
    const auto coarse = variant == 3 ? coarse_summary::key_bounds : coarse_summary::mean;
    INFO("fine summary " << name_of(kind) << ", coarse summary " << name_of(coarse));
    mr::device_pool_resource device;
    mr::statistics_adaptor<mr::device_pool_resource> stats(device);
    kv::paged_kv_cache_options o;
    o.num_layers = 3;
    o.num_kv_heads = 2;
    o.head_dim = 64;
    o.max_sequences = 3;
    o.max_context = 9000;
    o.fine_summary = kind;
    o.coarse_summary = coarse;
    const kv::cache_footprint f = kv::footprint_of(o, sizeof(__nv_bfloat16));
    std::int64_t pages = 0;
    {
      kv::paged_kv_cache<__nv_bfloat16, mr::statistics_adaptor<mr::device_pool_resource>> cache(stats, o);
      REQUIRE(stats.stats().current_bytes == f.metadata_bytes());
      std::vector<kv::append_segment> segs;
      const std::vector<std::int32_t> lens{9000, 65, 1};
      std::int32_t rows = 0;
      for (const auto n : lens) {
        int slot = -1;
        REQUIRE(cache.add_sequence(o.max_context, slot) == status::success);
        segs.push_back({slot, rows, n});
        rows += n;
        pages += f.sequence_pages(n);
      }
      std::vector<__nv_bfloat16> kvh(static_cast<std::size_t>(rows) * o.num_kv_heads * o.head_dim, from_float<__nv_bfloat16>(0.5f));
      test::device_buffer<__nv_bfloat16> k(kvh), v(kvh);
      for (int layer = 0; layer < o.num_layers; ++layer)  // sequence_pages counts every layer's
        REQUIRE(cache.append_async(layer, segs, k.ptr, v.ptr, nullptr) == status::success);
      HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
      REQUIRE(stats.stats().current_bytes == f.metadata_bytes() + f.page_memory(pages));
    }
    REQUIRE(stats.stats().current_bytes == 0);
  }
}
