// FP8 (e4m3) KV pages (kv/fp8.hpp) on the GPU. The rule makes every stored
// value k~ = code * scale a bf16 value, so an fp8 cache must behave bit for
// bit like a bf16 cache holding k~: the pages hold the rule's codes and
// scales, the summaries and the decode steps (sparse and dense) equal the
// bf16 cache's, and through it the fp64 reference's. What fp8 costs against
// the original bf16 keys is measured, not asserted exact.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cache_download.hpp"
#include "gpu_problem.hpp"
#include "gpu_test.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

template <class T>
using dev = test::device_buffer<T>;
using bf16 = __nv_bfloat16;

/// The rule on the host: codes and scales of rows of `d` elements.
void quantize_rows(const std::vector<bf16>& x, int d, std::vector<kv::fp8_e4m3>& codes, std::vector<float>& scales,
                   std::vector<bf16>& stored) {
  const std::size_t rows = x.size() / static_cast<std::size_t>(d);
  codes.resize(x.size());
  scales.resize(rows);
  stored.resize(x.size());
  for (std::size_t r = 0; r < rows; ++r) {
    float m = 0.0f;
    for (int i = 0; i < d; ++i) m = std::max(m, kv::fp8_finite_magnitude(to_float(x[r * d + i])));
    const float s = kv::fp8_row_scale(m);
    scales[r] = s;
    for (int i = 0; i < d; ++i) {
      const auto q = kv::fp8_encode(to_float(x[r * d + i]), s);
      codes[r * d + i] = q;
      stored[r * d + i] = from_float<bf16>(kv::fp8_decode(q, s));
    }
  }
}

/// Appends the problem in two parts per sequence -- all but its last `tail`
/// tokens in one call, then the tail one token a call (decode appends into
/// partial slices) -- and returns the slots.
template <class Cache>
std::vector<int> fill_in_two(const test::problem<bf16>& p, Cache& cache, std::int64_t tail) {
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim;
  const auto row = static_cast<std::size_t>(H * D);
  std::vector<int> slots;
  for (std::size_t s = 0; s < p.lengths.size(); ++s) {
    int slot = -1;
    REQUIRE(cache.add_sequence(cache.options().max_context, slot) == status::success);
    slots.push_back(slot);
    const std::int64_t len = p.lengths[s], head = std::max<std::int64_t>(len - tail, 1);
    dev<bf16> k(p.keys[s]), v(p.values[s]);
    const kv::append_segment first{slot, 0, static_cast<std::int32_t>(head)};
    REQUIRE(cache.append_async(0, std::span(&first, 1), k.ptr, v.ptr) == status::success);
    for (std::int64_t t = head; t < len; ++t) {
      const int one[1] = {slot};
      REQUIRE(cache.append_decode_async(0, one, k.ptr + t * row, v.ptr + t * row, nullptr) == status::success);
    }
  }
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  return slots;
}

struct step_bits {
  std::vector<bf16> out;
  std::vector<float> lse;
  std::vector<std::int32_t> kept, num;
};

bool same_bits(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// One decode step (sparse: the composed step of p.cfg; dense: every token)
/// over a cache of element type KV.
template <class KV>
step_bits run(const test::problem<bf16>& p, const kv::paged_kv_ref<KV>& cache, const std::vector<int>& slots,
              bool dense) {
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, D = p.shape.head_dim;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<bf16> d_q(p.queries), out(static_cast<std::size_t>(B) * Hq * D);
  dev<float> lse(static_cast<std::size_t>(B) * Hq);
  out.poison(nullptr);
  lse.poison(nullptr);
  const decode_step_arguments<bf16, KV> a{.queries = d_q.ptr, .slots = d_slots.ptr, .batch = B, .num_q_heads = Hq,
                                          .cache = cache, .out = out.ptr, .lse = lse.ptr};
  step_bits g;
  if (dense) {
    dense_decode<bf16, attention::kDecodeTile, KV> op;
    std::size_t bytes = 0;
    REQUIRE(op.workspace_bytes(a, bytes) == status::success);
    dev<char> ws(std::max<std::size_t>(bytes, 1));
    REQUIRE(op.plan(a, ws.ptr, bytes) == status::success);
    REQUIRE(op.run() == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    hierarchical_decode<bf16, attention::kDecodeTile, KV> op(p.cfg);
    std::size_t bytes = 0;
    REQUIRE(op.workspace_bytes(a, bytes) == status::success);
    dev<char> ws(bytes);
    REQUIRE(op.plan(a, ws.ptr, bytes) == status::success);
    REQUIRE(op.run() == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::size_t rows = static_cast<std::size_t>(B) * p.shape.num_kv_heads;
    g.kept.resize(rows * p.cfg.top_k_fine);
    g.num.resize(rows);
    HISPARSE_CUDA_CHECK(cudaMemcpy(g.kept.data(), op.kept_slices(), g.kept.size() * 4, cudaMemcpyDeviceToHost));
    HISPARSE_CUDA_CHECK(cudaMemcpy(g.num.data(), op.num_slices(), g.num.size() * 4, cudaMemcpyDeviceToHost));
  }
  g.out = out.download();
  g.lse = lse.download();
  return g;
}

/// The problem with every key and value replaced by its stored fp8 value.
test::problem<bf16> stored_problem(const test::problem<bf16>& p) {
  test::problem<bf16> q = p;
  std::vector<kv::fp8_e4m3> codes;
  std::vector<float> scales;
  for (std::size_t s = 0; s < p.lengths.size(); ++s) {
    quantize_rows(p.keys[s], p.shape.head_dim, codes, scales, q.keys[s]);
    quantize_rows(p.values[s], p.shape.head_dim, codes, scales, q.values[s]);
  }
  return q;
}

void check_same_as_bf16_of_stored(preset_id id, bool non_finite, attention_shape shape = {32, 8, 128}) {
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed << ", preset " << static_cast<int>(id) << ", head_dim " << shape.head_dim);
  const int H = shape.num_kv_heads, D = shape.head_dim;
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg = preset_registry{}.get(id);
  // T = 1, inside one slice, partial slices, several blocks, long.
  const std::vector<std::int64_t> lengths{1, 70, 575, 5000, 33 * 1024 + 17, 100003};
  auto p = test::make_problem<bf16>(shape, cfg, lengths, seed);
  // Rows of very different magnitudes (the scale is per row), and, when
  // asked, NaN and infinite keys and values (stored as NaN).
  workload::splitmix64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  for (auto& k : p.keys)
    for (std::size_t r = 0; r < k.size() / D; r += 7) {
      const float f = std::ldexp(1.0f, static_cast<int>(rng.next() % 40) - 20);
      for (int i = 0; i < D; ++i) k[r * D + i] = from_float<bf16>(to_float(k[r * D + i]) * f);
    }
  if (non_finite) {
    p.keys[3][(4000 * H + 1) * D + 5] = from_float<bf16>(std::numeric_limits<float>::infinity());
    p.values[4][(33 * 1024 * H + 1) * D + 9] = from_float<bf16>(std::numeric_limits<float>::quiet_NaN());
    p.keys[5][(100000 * H + H - 1) * D] = from_float<bf16>(-std::numeric_limits<float>::infinity());
  }
  const auto q = stored_problem(p);
  kv::paged_kv_cache<kv::fp8_e4m3, mr::device_pool_resource> fp8(device, test::cache_options(p, 100003));
  kv::paged_kv_cache<bf16, mr::device_pool_resource> ref(device, test::cache_options(q, 100003));
  const auto slots8 = fill_in_two(p, fp8, 70);
  const auto slots16 = fill_in_two(q, ref, 70);

  // Pages: the rule's codes and scales.
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    std::vector<kv::fp8_e4m3> codes[2];
    std::vector<float> scales[2];
    test::download_fp8_kv(fp8.ref(), slots8[s], 0, codes, scales);
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<kv::fp8_e4m3> want_codes;
      std::vector<float> want_scales;
      std::vector<bf16> stored;
      quantize_rows(kv == 0 ? p.keys[s] : p.values[s], D, want_codes, want_scales, stored);
      INFO("sequence " << s << (kv == 0 ? " keys" : " values"));
      REQUIRE(std::memcmp(codes[kv].data(), want_codes.data(), want_codes.size()) == 0);
      REQUIRE(same_bits(scales[kv], want_scales));
    }
    // Summaries: those of the bf16 cache of the stored keys.
    std::vector<float> s8, b8, s16, b16;
    std::int32_t l8 = 0, l16 = 0;
    test::download_summaries(fp8.ref(), slots8[s], 0, s8, b8, l8);
    test::download_summaries(ref.ref(), slots16[s], 0, s16, b16, l16);
    REQUIRE(l8 == l16);
    REQUIRE(same_bits(s8, s16));
    REQUIRE(same_bits(b8, b16));
    if (cfg.fine_summary == fine_summary::key_bounds) {
      const auto w8 = test::download_fine_rows<fine_summary::key_bounds>(fp8.ref(), slots8[s], 0);
      const auto w16 = test::download_fine_rows<fine_summary::key_bounds>(ref.ref(), slots16[s], 0);
      REQUIRE(w8 == w16);
    }
  }
  // Steps: the same bits as the bf16 cache of the stored keys (which the
  // attention tests hold to the fp64 reference).
  for (const bool dense : {false, true}) {
    INFO((dense ? "dense" : "sparse") << " step");
    const auto g8 = run(p, fp8.ref(), slots8, dense);
    const auto g16 = run(q, ref.ref(), slots16, dense);
    REQUIRE(g8.kept == g16.kept);
    REQUIRE(g8.num == g16.num);
    REQUIRE(same_bits(g8.out, g16.out));
    REQUIRE(same_bits(g8.lse, g16.lse));
    if (non_finite && dense) REQUIRE(std::any_of(g8.out.begin(), g8.out.end(), [](bf16 x) { return std::isnan(to_float(x)); }));
  }
}

}  // namespace

TEST_CASE("fp8 pages: codes and scales of the rule; summaries and steps equal a bf16 cache of the stored values",
          "[gpu][fp8]") {
  HISPARSE_REQUIRE_GPU();
  check_same_as_bf16_of_stored(preset_id::standard, false);
  check_same_as_bf16_of_stored(preset_id::standard_key_bounds, false);
  check_same_as_bf16_of_stored(preset_id::standard, false, {16, 4, 64});
}

TEST_CASE("fp8 pages: NaN and infinite inputs are stored as NaN and reach the output as the bf16 cache's do",
          "[gpu][fp8]") {
  HISPARSE_REQUIRE_GPU();
  check_same_as_bf16_of_stored(preset_id::standard, true);
}

TEST_CASE("fp8 pages: an append of the wrong input dtype is rejected and appends nothing",
          "[gpu][fp8][errors]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.max_sequences = 1;
  o.max_context = 256;
  kv::paged_kv_cache<kv::fp8_e4m3, mr::device_pool_resource> cache(device, o);
  int slot = -1;
  REQUIRE(cache.add_sequence(256, slot) == status::success);
  dev<__half> k(std::vector<__half>(128, __float2half(1.0f)));
  const kv::append_segment seg{slot, 0, 1};
  REQUIRE(cache.append_async(0, std::span(&seg, 1), k.ptr, k.ptr, dtype::fp16, nullptr) == status::invalid_argument);
  REQUIRE(cache.length(slot, 0) == 0);
}
