// Decode selection on the GPU against the fp64 CPU reference: kept blocks
// and slices equal the reference's (by score threshold where two scores sit
// within fp32 rounding of each other), scores agree, every edge case of
// DESIGN.md section 6, ragged batches, ties, and graph capture.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cache_download.hpp"
#include "gpu_problem.hpp"
#include "gpu_test.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/select/decode_selection.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

template <class T>
using dev = test::device_buffer<T>;

using problem = test::problem<__nv_bfloat16>;
using test::cache_options;
using test::fill;
using test::make_problem;

struct gpu_result {
  std::vector<std::int32_t> blocks, slices, num_slices, window;
  std::vector<float> block_scores, slice_scores;
};

template <class Cache>
gpu_result run_selection(const problem& p, Cache& cache, const std::vector<int>& slots, cudaStream_t stream,
                         bool clusters = true) {
  const int B = static_cast<int>(slots.size()), H = p.shape.num_kv_heads;
  const int kc = p.cfg.top_k_coarse, kf = p.cfg.top_k_fine;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries);
  dev<std::int32_t> blocks(B * H * kc), slices(B * H * kf), num(B * H), window(B);
  dev<float> bscores(B * H * kc), sscores(B * H * kf);
  HISPARSE_CUDA_CHECK(cudaMemset(slices.ptr, 0x7f, sizeof(std::int32_t) * B * H * kf));  // poison
  HISPARSE_CUDA_CHECK(cudaMemset(num.ptr, 0x7f, sizeof(std::int32_t) * B * H));
  select::decode_selection_arguments<__nv_bfloat16> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = B;
  a.num_q_heads = p.shape.num_q_heads;
  a.set_cache(cache.ref());
  a.use_clusters = clusters;
  select::decode_selection_output out{slices.ptr, num.ptr, window.ptr, blocks.ptr, bscores.ptr, sscores.ptr};
  REQUIRE(select::select_decode_async(p.cfg, a, out, stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {blocks.download(), slices.download(), num.download(), window.download(),
          bscores.download(), sscores.download()};
}

/// Same kept set, or a difference made only of items whose reference scores
/// are within `tol` of the selection boundary (fp32 rounding).
void check_set(const std::vector<std::int32_t>& got, const reference::scored_selection& ref,
               const std::vector<double>& ref_score_of, double tol) {
  std::vector<std::int32_t> g;
  for (const auto x : got)
    if (x >= 0) g.push_back(x);
  REQUIRE(g.size() == ref.kept.size());
  if (g == ref.kept) return;
  double boundary = HUGE_VAL;  // the least kept score, in ref_score_of's terms
  for (const auto x : ref.kept) boundary = std::min(boundary, ref_score_of[static_cast<std::size_t>(x)]);
  for (const auto x : g)
    if (!std::binary_search(ref.kept.begin(), ref.kept.end(), x)) {
      INFO("selected " << x << " with reference score " << ref_score_of[x] << ", boundary " << boundary);
      REQUIRE(ref_score_of[static_cast<std::size_t>(x)] >= boundary - tol);
    }
}

/// A kept score against the reference's: within `margin`, or the same
/// non-finite value (NaN and +-inf scores are ranked, not compared).
bool same_score(double got, double ref, double margin) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  return std::abs(got - ref) <= margin;
}

/// Bit-for-bit equal (NaN included).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// `bf16_sums`: sequence b's slice sums as the cache rounded them, which a
/// bf16 config's fine stage scores (bit for bit what the kernel reads).
void compare(const problem& p, const gpu_result& g, int b, bool exact,
             const std::vector<__nv_bfloat16>* bf16_sums = nullptr) {
  const int H = p.shape.num_kv_heads, kc = p.cfg.top_k_coarse, kf = p.cfg.top_k_fine;
  const auto seq = p.sequence(b);
  const std::int64_t len = p.lengths[static_cast<std::size_t>(b)];
  const auto r = reference::decode(p.cfg, p.shape, seq);
  const auto& tile = r.tiles.at(0);
  REQUIRE(g.window[static_cast<std::size_t>(b)] == tile.window_begin);
  const auto means = reference::slice_means(seq.keys, p.cfg, tile.window_begin);
  // What the fine stage scores: the same means, or (fine_summary =
  // mean_bf16) the cache's bf16-rounded sums over F. The reference rounds the
  // exact sums, the cache its fp32 ones, so the two can sit one bf16 ulp
  // apart: the fine scores are checked against the cache's.
  const bool bf16_fine = p.cfg.fine_summary == fine_summary::mean_bf16;
  // fine_summary = key_bounds: the slices' key bounds, which for bf16 keys the
  // cache keeps exactly (test_gpu_kv checks its words bit for bit).
  const bool bounds_fine = p.cfg.fine_summary == fine_summary::key_bounds;
  const bool bounds_coarse = p.cfg.coarse_summary == coarse_summary::key_bounds;
  const std::vector<double> bounds = bounds_fine || bounds_coarse
                                         ? reference::slice_key_bounds(seq.keys, p.cfg, tile.window_begin)
                                         : std::vector<double>{};
  const int G = p.shape.group_size(), D = p.shape.head_dim;
  const std::int64_t far_slices = tile.window_begin / p.cfg.fine_slice;
  std::vector<double> fine_means = means;
  if (bf16_fine) {
    REQUIRE(bf16_sums != nullptr);
    REQUIRE(bf16_sums->size() >= fine_means.size());
    for (std::size_t i = 0; i < fine_means.size(); ++i)
      fine_means[i] = to_double((*bf16_sums)[i]) / p.cfg.fine_slice;
  }
  for (int h = 0; h < H; ++h) {
    INFO("sequence " << b << " (length " << len << "), KV head " << h);
    const auto at = static_cast<std::size_t>(b * H + h);
    std::vector<std::int32_t> gb(g.blocks.begin() + at * kc, g.blocks.begin() + (at + 1) * kc);
    std::vector<std::int32_t> gs(g.slices.begin() + at * kf, g.slices.begin() + (at + 1) * kf);
    const auto& rb = tile.blocks[h];
    const auto& rs = tile.slices[h];
    // fp32 error scale: a score's size, or the size of the terms it sums
    // (|sum_g q_g| |mean| bounds them; a score near 0 by cancellation keeps
    // the terms' rounding error). Non-finite scores and means are left out.
    double scale = 1e-30, qnorm = 0, mnorm = 0;
    for (const double s : rb.kept_scores)
      if (std::isfinite(s)) scale = std::max(scale, std::abs(s));
    for (const double s : rs.kept_scores)
      if (std::isfinite(s)) scale = std::max(scale, std::abs(s));
    std::vector<double> qs(static_cast<std::size_t>(D), 0.0);  // the group's summed query
    for (int d = 0; d < D; ++d) {
      for (int gq = 0; gq < G; ++gq) qs[static_cast<std::size_t>(d)] += to_double(seq.queries(0, h * G + gq, d));
      qnorm += qs[static_cast<std::size_t>(d)] * qs[static_cast<std::size_t>(d)];
    }
    auto bounds_of = [&](std::int64_t sl) { return &bounds[static_cast<std::size_t>((sl * H + h) * D * 2)]; };
    for (std::int64_t sl = 0; sl < far_slices; ++sl) {
      double m = 0;
      for (int d = 0; d < D; ++d) m += std::pow(means[static_cast<std::size_t>((sl * H + h) * D + d)], 2);
      if (std::isfinite(m)) mnorm = std::max(mnorm, m);
    }
    scale = std::max(scale, std::sqrt(qnorm * mnorm));
    // A bound's terms: |Q_d| max(|lo_d|, |hi_d|), of a slice's bounds or a
    // block's (the widest of its slices' in each dimension).
    auto bound_terms = [&](const double* b) {
      double terms = 0;
      for (int d = 0; d < D; ++d)
        terms += std::abs(qs[static_cast<std::size_t>(d)]) * std::max(std::abs(b[2 * d]), std::abs(b[2 * d + 1]));
      if (std::isfinite(terms)) scale = std::max(scale, terms);
    };
    if (bounds_fine)
      for (std::int64_t sl = 0; sl < far_slices; ++sl) bound_terms(bounds_of(sl));
    if (bounds_coarse)
      for (std::int64_t s0 = 0; s0 < far_slices; s0 += p.cfg.slices_per_block())
        bound_terms(
            reference::block_key_bounds(bounds, s0, std::min<std::int64_t>(s0 + p.cfg.slices_per_block(), far_slices),
                                        H, h, D)
                .data());
    REQUIRE(g.num_slices[at] == static_cast<std::int32_t>(rs.kept.size()));
    for (std::size_t i = rs.kept.size(); i < static_cast<std::size_t>(kf); ++i) REQUIRE(gs[i] == -1);
    // Kept scores match the reference's within fp32 accumulation.
    for (std::size_t i = 0; i < rb.kept.size() && gb[i] == rb.kept[i]; ++i)
      REQUIRE(same_score(g.block_scores[at * kc + i], rb.kept_scores[i], 1e-5 * scale));
    std::vector<std::int32_t> gbk(gb.begin(), std::find(gb.begin(), gb.end(), -1));
    if (exact || gbk == rb.kept) {
      REQUIRE(gbk == rb.kept);
      std::vector<std::int32_t> gsk(gs.begin(), gs.begin() + g.num_slices[at]);
      INFO("kept slices: " << ::Catch::Detail::stringify(gsk));
      for (const auto x : gsk) REQUIRE((x >= 0 && x < far_slices));
      if (exact) REQUIRE(gsk == rs.kept);
      REQUIRE(std::is_sorted(gsk.begin(), gsk.end()));
      if (!bf16_fine && !bounds_fine)
        for (std::size_t i = 0; i < rs.kept.size() && i < gsk.size() && gsk[i] == rs.kept[i]; ++i)
          REQUIRE(same_score(g.slice_scores[at * kf + i], rs.kept_scores[i], 1e-5 * scale));
      std::vector<double> slice_ref(static_cast<std::size_t>(len / p.cfg.fine_slice + 1), -1e300);
      // Scores of every fine candidate, for the threshold check.
      for (const auto blk : rb.kept)
        for (std::int64_t sl = std::int64_t{blk} * p.cfg.slices_per_block();
             sl < (std::int64_t{blk} + 1) * p.cfg.slices_per_block() && (sl + 1) * p.cfg.fine_slice <= tile.window_begin;
             ++sl) {
          double sc = 0;
          if (bounds_fine) {
            sc = reference::key_bounds_score(qs.data(), bounds_of(sl), D);
          } else {
            for (int gq = 0; gq < G; ++gq)
              for (int d = 0; d < D; ++d)
                sc += to_double(seq.queries(0, h * G + gq, d)) *
                      fine_means[static_cast<std::size_t>((sl * H + h) * D + d)];
          }
          slice_ref[static_cast<std::size_t>(sl)] = sc;
        }
      // bf16: every kept score against the cache's sums (fp32 means would
      // miss by ~2^-9 of the terms, far outside 1e-5 of the scale); key
      // bounds: against the bounds' scores.
      if (bf16_fine || bounds_fine)
        for (std::size_t i = 0; i < gsk.size(); ++i)
          REQUIRE(same_score(g.slice_scores[at * kf + i], slice_ref[static_cast<std::size_t>(gsk[i])], 1e-5 * scale));
      check_set(gsk, rs, slice_ref, 1e-4 * scale);
    }
  }
}

/// Runs the selection on every sequence of p (appended to `cache` here),
/// checks it against the reference and the single-CTA kernel, and returns
/// the cluster kernel's result.
template <class Cache>
gpu_result check_problem_on_gpu(const problem& p, Cache& cache, bool exact = false) {
  const auto slots = fill(p, cache);
  const auto g = run_selection(p, cache, slots, nullptr);
  for (int b = 0; b < static_cast<int>(p.lengths.size()); ++b) {
    std::vector<__nv_bfloat16> bf16_sums;
    if (p.cfg.fine_summary == fine_summary::mean_bf16)
      bf16_sums = test::download_fine_rows<fine_summary::mean_bf16>(cache.ref(), slots[static_cast<std::size_t>(b)], 0);
    compare(p, g, b, exact, &bf16_sums);
  }
  // The single-CTA kernel (what sm_80/sm_89 run) selects exactly the same.
  const auto single = run_selection(p, cache, slots, nullptr, /*clusters=*/false);
  CHECK(single.blocks == g.blocks);
  CHECK(single.slices == g.slices);
  CHECK(single.num_slices == g.num_slices);
  CHECK(same_bits(single.block_scores, g.block_scores));
  CHECK(same_bits(single.slice_scores, g.slice_scores));
  return g;
}

}  // namespace

TEST_CASE("decode selection matches the reference across lengths and edge cases", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // T < W, one token, non-multiples of F and C, fewer blocks than k, long.
  const std::vector<std::int64_t> lengths{1, 300, 575, 576, 1600, 5000, 33 * 1024 + 17, 100003};
  const problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, lengths, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 100003));
  check_problem_on_gpu(p, cache);
}

TEST_CASE("decode selection with GQA 1, 4, 8 and head_dim 64, 128, 256", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const SparseAttentionConfig small{64, 128, 16, 3, 4, 1};
  for (const int group : {1, 4, 8})
    for (const int dim : {64, 128, 256}) {
      INFO("group " << group << ", head_dim " << dim);
      const problem p = make_problem({2 * group, 2, dim}, small, {1, 70, 129, 700, 2047, 5001}, seed + group * dim);
      kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 5001));
      check_problem_on_gpu(p, cache);
    }
}

namespace {
SparseAttentionConfig with_bf16_summaries(SparseAttentionConfig c) {
  c.fine_summary = fine_summary::mean_bf16;
  return c;
}
}  // namespace

TEST_CASE("decode selection on bf16 slice summaries matches the reference", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  SECTION("the standard preset's config, lengths and edge cases") {
    const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::standard_bf16_summaries);
    REQUIRE(cfg.fine_summary == fine_summary::mean_bf16);
    const std::vector<std::int64_t> lengths{1, 300, 575, 576, 1600, 5000, 33 * 1024 + 17, 100003};
    const problem p = make_problem({32, 8, 128}, cfg, lengths, seed);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 100003));
    check_problem_on_gpu(p, cache);
    // The cache's bf16 sums are its fp32 sums rounded to nearest even, bit
    // for bit, complete slices and the partial last one alike: after the
    // prefill above, and after decode appends of one token at a time (a
    // partial slice's sum grows from its stored value; slices and blocks
    // complete on the way).
    auto check_rounded = [&] {
      for (int b = 0; b < static_cast<int>(lengths.size()); ++b) {
        std::vector<float> sums, blocks;
        std::int32_t len = 0;
        test::download_summaries(cache.ref(), b, 0, sums, blocks, len);
        const auto rounded = test::download_fine_rows<fine_summary::mean_bf16>(cache.ref(), b, 0);
        REQUIRE(rounded.size() == sums.size());
        for (std::size_t i = 0; i < sums.size(); ++i) {
          const __nv_bfloat16 want = __float2bfloat16_rn(sums[i]);
          REQUIRE(std::memcmp(&rounded[i], &want, sizeof(want)) == 0);
        }
      }
    };
    check_rounded();
    workload::splitmix64 rng(seed + 1);
    std::vector<__nv_bfloat16> token(static_cast<std::size_t>(p.shape.num_kv_heads) * p.shape.head_dim);
    for (auto& x : token) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
    dev<__nv_bfloat16> d_token(token);
    for (int step = 0; step < 70; ++step)  // 300 -> 370 and 1600 -> 1670: slices 4 and 25 complete
      for (const int b : {1, 4})
        REQUIRE(cache.append_async(0, std::vector<kv::append_segment>{{b, 0, 1}}, d_token.ptr, d_token.ptr, nullptr) ==
                status::success);
    check_rounded();
  }
  SECTION("head_dim 64, 128, 256 (2, 4 and 8 bf16 a lane), GQA 1 and 8") {
    // 10 blocks of 64 slices kept: 640 fine candidates, so every warp loads
    // several rows a batch and prefetches the next batch (a batch is 512,
    // 256 and 128 rows at head_dim 64, 128 and 256).
    const SparseAttentionConfig cfg = with_bf16_summaries({128, 1024, 16, 10, 8, 1});
    for (const int group : {1, 8})
      for (const int dim : {64, 128, 256}) {
        INFO("group " << group << ", head_dim " << dim);
        const problem p = make_problem({2 * group, 2, dim}, cfg, {1, 700, 5001, 20000, 40000}, seed + group * dim);
        kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 40000));
        check_problem_on_gpu(p, cache);
      }
  }
  SECTION("planted ties (exact in bf16) go to the lower index") {
    const SparseAttentionConfig c = with_bf16_summaries({512, 1024, 64, 3, 5, 1});
    const problem p = make_problem({4, 2, 64}, c, {10 * 1024 + 17, 40000}, 9, /*constant_keys=*/true);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 40000));
    check_problem_on_gpu(p, cache, /*exact=*/true);
  }
}

TEST_CASE("decode selection on bf16 slice summaries needs a cache that keeps them", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg = with_bf16_summaries({});
  const problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, {5000}, 3);  // its cache keeps no bf16 sums
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 5000));
  select::decode_selection_arguments<__nv_bfloat16> a;
  int dummy_slot = 0;
  a.queries = reinterpret_cast<const __nv_bfloat16*>(&dummy_slot);  // never read: the check fails first
  a.slots = &dummy_slot;
  a.batch = 1;
  a.num_q_heads = 32;
  a.set_cache(cache.ref());
  REQUIRE_FALSE(a.keeps(fine_summary::mean_bf16));
  const status st = select::can_implement_decode_selection(cfg, a);
  CHECK(st == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("fine_summary is mean_bf16 and the cache does not keep it"));
  a.fine = fine_summary::mean_bf16;
  a.fine_rows = a.slice_sums;  // any rows: the check reads no memory
  CHECK(select::can_implement_decode_selection(cfg, a) == status::success);
  // The plain means need nothing beyond the sums, whatever else the cache keeps.
  CHECK(select::can_implement_decode_selection(SparseAttentionConfig{}, a) == status::success);
  // And a cache cannot promise bf16 sums it would never write.
  auto o = cache_options(p, 5000);
  o.fine_summary = fine_summary::mean_bf16;
  o.maintain_summaries = false;
  using cache_t = kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource>;
  CHECK_THROWS_WITH(cache_t(device, o), Catch::Contains("fine_summary mean_bf16 needs maintain_summaries"));
  // A cache without summaries (dense use) has none to rank: refused, not
  // ranked from memory nothing wrote.
  o.fine_summary = fine_summary::mean;
  cache_t dense_only(device, o);
  a.set_cache(dense_only.ref());
  CHECK(a.slice_sums == nullptr);
  CHECK(select::can_implement_decode_selection(SparseAttentionConfig{}, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("without maintain_summaries"));
}

TEST_CASE("decode selection of keys that share a large mean", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // Keys N(16, 1): every slice score of a KV head carries the same offset,
  // 16 times its group's summed query (~360 at head_dim 128), beside a
  // spread of ~3. The one-warp ranking resolves its threshold over the lane
  // maxima's heights above the lowest (a threshold of the word's 16 top
  // bits put all 512 in one bucket), with scores of both signs across the
  // heads.
  problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, {33 * 1024 + 17, 100003}, seed);
  for (auto& seq : p.keys)
    for (auto& x : seq) x = from_float<__nv_bfloat16>(16.0f + to_float(x));
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 100003));
  check_problem_on_gpu(p, cache);
}

TEST_CASE("decode selection breaks ties toward lower indices", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const SparseAttentionConfig c{512, 1024, 64, 3, 5, 1};
  const problem p = make_problem({4, 2, 64}, c, {10 * 1024 + 17, 40000}, 9, /*constant_keys=*/true);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 40000));
  check_problem_on_gpu(p, cache, /*exact=*/true);
}

namespace {
/// The sign of KV head h's summed query (over the group and the dimensions).
float query_sign(const problem& p, int h) {
  const int D = p.shape.head_dim, G = p.shape.group_size();
  double qsum = 0;
  for (int g = 0; g < G * D; ++g) qsum += to_double(p.queries[static_cast<std::size_t>(h * G * D + g)]);
  return qsum < 0 ? -1.0f : 1.0f;
}

/// Sets every key of slices [0, slices) of sequence 0 to one value v(slice)
/// in every dimension (exact in bf16), so slice c scores v(c) times the
/// group's summed query; the value is signed per KV head so that a larger v
/// scores higher.
template <class V>
void plant_slices(problem& p, std::int64_t slices, V v) {
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim, F = p.cfg.fine_slice;
  for (int h = 0; h < H; ++h) {
    const float sign = query_sign(p, h);
    for (std::int64_t t = 0; t < slices * F; ++t) {
      const auto x = from_float<__nv_bfloat16>(sign * v(static_cast<int>(t / F)));
      for (int d = 0; d < D; ++d) p.keys[0][static_cast<std::size_t>((t * H + h) * D + d)] = x;
    }
  }
}

/// Makes slice c of sequence 0 score `value` in every KV head: NaN (every
/// key NaN), or +-inf (one key's one dimension, whose summed query is
/// positive, set to that infinity).
void poison_slice(problem& p, std::int64_t c, float value) {
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim, G = p.shape.group_size(), F = p.cfg.fine_slice;
  for (int h = 0; h < H; ++h) {
    const std::size_t first = static_cast<std::size_t>(c * F * H + h) * D;
    if (std::isnan(value)) {
      for (std::int64_t t = 0; t < F; ++t)
        for (int d = 0; d < D; ++d)
          p.keys[0][first + static_cast<std::size_t>(t * H * D + d)] = from_float<__nv_bfloat16>(value);
      continue;
    }
    int dim = 0;  // a dimension whose summed query is positive (one exists unless all are <= 0)
    double best = -1.0;
    for (int d = 0; d < D; ++d) {
      double q = 0;
      for (int g = 0; g < G; ++g) q += to_double(p.queries[static_cast<std::size_t>((h * G + g) * D + d)]);
      if (q > best) best = q, dim = d;
    }
    REQUIRE(best > 0);
    p.keys[0][first + static_cast<std::size_t>(dim)] = from_float<__nv_bfloat16>(value);
  }
}
}  // namespace

TEST_CASE("decode selection: slices that crowd the one-warp ranking go to the whole CTA", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  // ws = 32768: 32 far blocks, all kept, so the fine stage ranks 512 slices.
  // The warp ranking holds slice c in lane c % 32 and keeps what reaches
  // the 16th largest lane maximum. Here lanes 1-15 hold every slice above
  // lane 0's and the rest sit below it, so 256 slices (lanes 0-15) reach
  // that threshold, past its 64 and into the CTA's filter.
  const SparseAttentionConfig cfg;
  const std::int64_t len = 33300;
  problem p = make_problem({8, 2, 128}, cfg, {len}, 21);
  plant_slices(p, 512, [](int c) {
    const int lane = c % 32, row = c / 32;
    return lane == 0 ? 0.5f : lane < 16 ? static_cast<float>(lane * 16 + row + 1) : 0.25f;
  });
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, len));
  check_problem_on_gpu(p, cache, /*exact=*/true);
}

TEST_CASE("decode selection ranks NaN scores last and infinite ones as numbers", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg;
  // Slice scores 128-255 (one value per slice, exact), then NaN, +inf and
  // -inf planted. A NaN slice makes its block's mean NaN and an infinite
  // one its block's mean infinite.
  auto plain = [](int c) { return static_cast<float>(128 + (c * 37) % 128); };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  SECTION("the fine stage: 32 blocks, all kept, 512 slices") {
    const std::int64_t len = 33300;  // ws = 32768
    problem p = make_problem({8, 2, 128}, cfg, {len}, 23);
    plant_slices(p, 512, plain);
    poison_slice(p, 5, nan);
    poison_slice(p, 200, inf);
    poison_slice(p, 300, -inf);
    poison_slice(p, 301, nan);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, len));
    const auto g = check_problem_on_gpu(p, cache, /*exact=*/true);
    for (int h = 0; h < p.shape.num_kv_heads; ++h) {
      const auto first = g.slices.begin() + h * cfg.top_k_fine, last = first + cfg.top_k_fine;
      CHECK(std::find(first, last, 200) != last);  // +inf ranks first
      for (const int c : {5, 300, 301}) CHECK(std::find(first, last, c) == last);
    }
  }
  SECTION("the coarse stage: 68 blocks") {
    const std::int64_t len = 70000;  // ws = 69440: 67 whole blocks and a partial one
    problem p = make_problem({8, 2, 128}, cfg, {len}, 24);
    plant_slices(p, 69440 / 64, plain);
    poison_slice(p, 10 * 16 + 3, nan);   // block 10: NaN
    poison_slice(p, 40 * 16 + 7, inf);   // block 40: +inf, and its slice 647 first among slices
    poison_slice(p, 50 * 16 + 1, -inf);  // block 50: -inf
    poison_slice(p, 67 * 16 + 2, nan);   // the partial block (its far slices' sums): NaN
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, len));
    const auto g = check_problem_on_gpu(p, cache, /*exact=*/true);
    for (int h = 0; h < p.shape.num_kv_heads; ++h) {
      const auto first = g.blocks.begin() + h * cfg.top_k_coarse, last = first + cfg.top_k_coarse;
      CHECK(std::find(first, last, 40) != last);
      for (const int blk : {10, 50, 67}) CHECK(std::find(first, last, blk) == last);
      const auto s0 = g.slices.begin() + h * cfg.top_k_fine, s1 = s0 + cfg.top_k_fine;
      CHECK(std::find(s0, s1, 40 * 16 + 7) != s1);
    }
  }
}

namespace {
SparseAttentionConfig with_key_bounds(SparseAttentionConfig c) {
  c.fine_summary = fine_summary::key_bounds;
  return c;
}
SparseAttentionConfig with_block_bounds(SparseAttentionConfig c) {
  c.coarse_summary = coarse_summary::key_bounds;
  return c;
}
}  // namespace

TEST_CASE("decode selection on slice key bounds matches the reference", "[gpu][select][bounds]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  using cache_t = kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource>;
  SECTION("the standard preset's config, lengths and edge cases") {
    const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::standard_key_bounds);
    REQUIRE(cfg.fine_summary == fine_summary::key_bounds);
    const problem p = make_problem({32, 8, 128}, cfg, {1, 300, 575, 576, 1600, 5000, 33 * 1024 + 17, 100003}, seed);
    cache_t cache(device, cache_options(p, 100003));
    check_problem_on_gpu(p, cache);
  }
  SECTION("head_dim 64, 128, 256 and GQA 1 and 8, several batches a warp") {
    const SparseAttentionConfig cfg = with_key_bounds({128, 1024, 16, 10, 8, 1});  // 640 fine candidates
    for (const int group : {1, 8})
      for (const int dim : {64, 128, 256}) {
        INFO("group " << group << ", head_dim " << dim);
        const problem p = make_problem({2 * group, 2, dim}, cfg, {1, 700, 5001, 20000, 40000}, seed + group * dim);
        cache_t cache(device, cache_options(p, 40000));
        check_problem_on_gpu(p, cache);
      }
  }
  SECTION("one strong key keeps its slice, where its mean would not") {
    // Slice 77 of 512 candidates: one key at 4 sign(Q_d) in every dimension,
    // the other 63 at -4/63 sign(Q_d), so its mean scores ~0 (a middling
    // rank) and its bound ~4 sum|Q_d|, above every random slice's (~2.4).
    const std::int64_t len = 33300;  // ws = 32768: 32 blocks, all kept
    problem p = make_problem({8, 2, 128}, with_key_bounds({}), {len}, seed);
    const int H = p.shape.num_kv_heads, D = p.shape.head_dim, G = p.shape.group_size(), F = p.cfg.fine_slice;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        double q = 0;
        for (int g = 0; g < G; ++g) q += to_double(p.queries[static_cast<std::size_t>((h * G + g) * D + d)]);
        const float sign = q < 0 ? -1.0f : 1.0f;
        for (std::int64_t t = 77 * F; t < 78 * F; ++t)
          p.keys[0][static_cast<std::size_t>((t * H + h) * D + d)] =
              from_float<__nv_bfloat16>(t == 77 * F + 5 ? 4.0f * sign : -4.0f / 63.0f * sign);
      }
    auto kept_77 = [&](const gpu_result& g, int h) {
      const auto first = g.slices.begin() + h * p.cfg.top_k_fine, last = first + p.cfg.top_k_fine;
      return std::find(first, last, 77) != last;
    };
    {
      cache_t cache(device, cache_options(p, len));
      const auto g = check_problem_on_gpu(p, cache);
      for (int h = 0; h < H; ++h) CHECK(kept_77(g, h));
    }
    problem means = p;
    means.cfg.fine_summary = fine_summary::mean;
    cache_t cache(device, cache_options(means, len));
    const auto g = check_problem_on_gpu(means, cache);
    for (int h = 0; h < H; ++h) CHECK_FALSE(kept_77(g, h));
  }
  SECTION("NaN and infinite keys") {
    // Constant slices (exact bounds) scoring 128-255, then: every key of
    // slice 5 NaN (NaN bounds: ranked last); +inf in one dimension of one
    // key of slice 200 (an infinite upper bound: ranked first); -inf there
    // in slice 300 (only its lower bound moves: it keeps its number, which
    // the exact match against the reference checks). And dimension 0 of
    // every summed query is +0: +inf there in slice 339 (one of the four
    // top-scoring slices 83, 211, 339, 467) meets a zero query, 0 * inf =
    // NaN by the contract (the bound facing Q_d >= 0 is the maximum), so it
    // ranks last; -inf there in slice 467 moves only its unused minimum.
    auto plain = [](int c) { return static_cast<float>(128 + (c * 37) % 128); };
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t len = 33300;
    problem p = make_problem({8, 2, 128}, with_key_bounds({}), {len}, 23);
    const int H = p.shape.num_kv_heads, D = p.shape.head_dim, G = p.shape.group_size(), F = p.cfg.fine_slice;
    for (int hg = 0; hg < H * G; ++hg) p.queries[static_cast<std::size_t>(hg * D)] = from_float<__nv_bfloat16>(0.0f);
    plant_slices(p, 512, plain);
    poison_slice(p, 5, nan);
    poison_slice(p, 200, inf);
    poison_slice(p, 300, -inf);
    for (int h = 0; h < H; ++h) {
      p.keys[0][static_cast<std::size_t>((339 * F * H + h) * D)] = from_float<__nv_bfloat16>(inf);
      p.keys[0][static_cast<std::size_t>((467 * F * H + h) * D)] = from_float<__nv_bfloat16>(-inf);
    }
    cache_t cache(device, cache_options(p, len));
    const auto g = check_problem_on_gpu(p, cache, /*exact=*/true);
    for (int h = 0; h < H; ++h) {
      const auto first = g.slices.begin() + h * p.cfg.top_k_fine, last = first + p.cfg.top_k_fine;
      CHECK(std::find(first, last, 200) != last);
      CHECK(std::find(first, last, 5) == last);
      CHECK(std::find(first, last, 339) == last);
      CHECK(std::find(first, last, 467) != last);
    }
  }
}

TEST_CASE("decode selection on slice key bounds needs a cache that keeps them", "[gpu][select][bounds]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg = with_key_bounds({});
  const problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, {5000}, 3);  // its cache keeps no bounds
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 5000));
  select::decode_selection_arguments<__nv_bfloat16> a;
  int dummy_slot = 0;
  a.queries = reinterpret_cast<const __nv_bfloat16*>(&dummy_slot);  // never read: the check fails first
  a.slots = &dummy_slot;
  a.batch = 1;
  a.num_q_heads = 32;
  a.set_cache(cache.ref());
  REQUIRE_FALSE(a.keeps(fine_summary::key_bounds));
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("paged_kv_cache_options::fine_summary is mean"));
}

TEST_CASE("decode selection on block key bounds matches the reference", "[gpu][select][bounds]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  using cache_t = kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource>;
  SECTION("the key_bounds_both preset, lengths and edge cases") {
    const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::key_bounds_both);
    REQUIRE(cfg.coarse_summary == coarse_summary::key_bounds);
    const problem p = make_problem({32, 8, 128}, cfg, {1, 300, 575, 576, 1600, 5000, 33 * 1024 + 17, 100003}, seed);
    cache_t cache(device, cache_options(p, 100003));
    check_problem_on_gpu(p, cache);
  }
  SECTION("head_dim 64, 128, 256 and GQA 1 and 8; partial blocks of many slices") {
    // 16-token slices in 1024-token blocks: a partial block of up to 63 far slices.
    const SparseAttentionConfig cfg = with_key_bounds(with_block_bounds({128, 1024, 16, 10, 8, 1}));
    for (const int group : {1, 8})
      for (const int dim : {64, 128, 256}) {
        INFO("group " << group << ", head_dim " << dim);
        const problem p = make_problem({2 * group, 2, dim}, cfg, {1, 700, 5001, 20000, 40000}, seed + group * dim);
        cache_t cache(device, cache_options(p, 40000));
        check_problem_on_gpu(p, cache);
      }
  }
  SECTION("decode appends widen the stored block bounds") {
    // The prefill batch rebuilds a block's bounds; single-token appends
    // widen them in place (one CTA a block): the same selection either way.
    const SparseAttentionConfig cfg = with_key_bounds(with_block_bounds({128, 256, 16, 6, 8, 1}));
    problem p = make_problem({4, 2, 128}, cfg, {3000}, seed);
    const std::int64_t prefix = 2000;
    cache_t cache(device, cache_options(p, 3000));
    int slot = -1;
    REQUIRE(cache.add_sequence(3000, slot) == status::success);
    const std::size_t row = static_cast<std::size_t>(p.shape.num_kv_heads) * p.shape.head_dim;
    const test::device_buffer<__nv_bfloat16> k(p.keys[0]), v(p.values[0]);
    REQUIRE(cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, static_cast<std::int32_t>(prefix)}},
                               k.ptr, v.ptr, nullptr) == status::success);
    for (std::int64_t t = prefix; t < 3000; ++t)
      REQUIRE(cache.append_decode_async(0, std::vector<int>{slot}, k.ptr + t * row, v.ptr + t * row, nullptr) ==
              status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto g = run_selection(p, cache, {slot}, nullptr);
    compare(p, g, 0, /*exact=*/false);
  }
  SECTION("one strong key keeps its block, where its block's mean would not decide") {
    // Block 20 of 98 candidates (ws = 99456): one key at 8 sign(Q_d) in every
    // dimension; random blocks' bounds reach ~3-4 per dimension.
    const std::int64_t len = 100003;
    problem p = make_problem({8, 2, 128}, preset_registry{}.get(preset_id::key_bounds_both), {len}, seed);
    const int H = p.shape.num_kv_heads, D = p.shape.head_dim, G = p.shape.group_size();
    const std::int64_t needle = 20 * 1024 + 517;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        double q = 0;
        for (int g = 0; g < G; ++g) q += to_double(p.queries[static_cast<std::size_t>((h * G + g) * D + d)]);
        p.keys[0][static_cast<std::size_t>((needle * H + h) * D + d)] = from_float<__nv_bfloat16>(q < 0 ? -8.0f : 8.0f);
      }
    cache_t cache(device, cache_options(p, len));
    const auto g = check_problem_on_gpu(p, cache);
    for (int h = 0; h < H; ++h) {
      const auto b0 = g.blocks.begin() + h * p.cfg.top_k_coarse, b1 = b0 + p.cfg.top_k_coarse;
      CHECK(std::find(b0, b1, 20) != b1);
      const auto s0 = g.slices.begin() + h * p.cfg.top_k_fine, s1 = s0 + p.cfg.top_k_fine;
      CHECK(std::find(s0, s1, static_cast<std::int32_t>(needle / 64)) != s1);
    }
  }
  SECTION("NaN keys rank their block last") {
    const std::int64_t len = 100003;
    problem p = make_problem({8, 2, 128}, preset_registry{}.get(preset_id::key_bounds_both), {len}, seed);
    const int H = p.shape.num_kv_heads, D = p.shape.head_dim;
    // A whole block and the partial one (ws = 99456: its far slices 1552, 1553).
    for (const std::int64_t t : {std::int64_t{3 * 1024 + 9}, std::int64_t{97 * 1024 + 40}})
      for (int h = 0; h < H; ++h)
        p.keys[0][static_cast<std::size_t>((t * H + h) * D + 7)] =
            from_float<__nv_bfloat16>(std::numeric_limits<float>::quiet_NaN());
    cache_t cache(device, cache_options(p, len));
    const auto g = check_problem_on_gpu(p, cache);
    for (int h = 0; h < H; ++h) {
      const auto b0 = g.blocks.begin() + h * p.cfg.top_k_coarse, b1 = b0 + p.cfg.top_k_coarse;
      CHECK(std::find(b0, b1, 3) == b1);
      CHECK(std::find(b0, b1, 97) == b1);
    }
  }
}

TEST_CASE("decode selection on block key bounds needs a cache that keeps them", "[gpu][select][bounds]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::key_bounds_both);
  // Its cache keeps slice bounds, not block bounds.
  const problem p = make_problem({32, 8, 128}, preset_registry{}.get(preset_id::standard_key_bounds), {5000}, 3);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 5000));
  select::decode_selection_arguments<__nv_bfloat16> a;
  int dummy_slot = 0;
  a.queries = reinterpret_cast<const __nv_bfloat16*>(&dummy_slot);  // never read: the check fails first
  a.slots = &dummy_slot;
  a.batch = 1;
  a.num_q_heads = 32;
  a.set_cache(cache.ref());
  REQUIRE(a.keeps(fine_summary::key_bounds));
  REQUIRE_FALSE(a.keeps(coarse_summary::key_bounds));
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("keeps no block key bounds"));
}

TEST_CASE("wide top-k: the threshold filter up to k = 128, block_topk beyond", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // k = 64 / 48 with up to 1024 fine candidates: the filter path.
  const SparseAttentionConfig wide{512, 1024, 64, 64, 48, 1};
  // k = 160 / 200 and 2560 fine candidates: the block_topk fallback.
  const SparseAttentionConfig widest{512, 1024, 64, 160, 200, 1};
  for (const auto& cfg : {wide, widest}) {
    INFO("top_k " << cfg.top_k_coarse << " / " << cfg.top_k_fine);
    const problem p = make_problem({8, 2, 128}, cfg, {70000, 200000}, seed);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 200000));
    check_problem_on_gpu(p, cache);
  }
}

TEST_CASE("decode selection with hundreds of blocks, and a partial block of many slices", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // C = 64: 312 and 936 blocks. The cluster kernel ranks them by counting
  // across its CTAs (up to 1024); the single-CTA kernel by counting up to
  // 256 and by the threshold filter beyond. Its 128 fine candidates make
  // fewer than 2k batch groups there, so its fine stage takes the filter.
  const SparseAttentionConfig many{64, 64, 16, 32, 16, 1};
  {
    const problem p = make_problem({8, 2, 128}, many, {20000, 60000}, seed);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 60000));
    check_problem_on_gpu(p, cache);
  }
  {  // a cache of more than 1024 blocks takes the wide kernel: counting up to 1024, block_topk beyond
    const problem p = make_problem({8, 2, 128}, many, {900, 60000, 70000}, seed + 1);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 70000));
    check_problem_on_gpu(p, cache);
  }
  {  // head_dim 256: the block holding ws has 14 far slices, more than the 8 staged in shared memory
    const problem p = make_problem({8, 2, 256}, SparseAttentionConfig{}, {5000, 97 * 1024 + 512 + 900}, seed + 2);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 97 * 1024 + 512 + 900));
    check_problem_on_gpu(p, cache);
  }
}

TEST_CASE("decode selection replays from a CUDA graph with new inputs", "[gpu][select]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, {40000, 70001}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 80000));
  const auto slots = fill(p, cache);
  const int B = 2, H = 8, kf = 16;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries);
  dev<std::int32_t> slices(B * H * kf), num(B * H), window(B);
  select::decode_selection_arguments<__nv_bfloat16> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = B;
  a.num_q_heads = 32;
  a.set_cache(cache.ref());
  select::decode_selection_output out{slices.ptr, num.ptr, window.ptr};
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE(select::select_decode_async(p.cfg, a, out, stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // New inputs: fresh queries and 3000 more tokens for each sequence.
  workload::splitmix64 rng(seed + 1);
  for (auto& x : p.queries) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  HISPARSE_CUDA_CHECK(cudaMemcpy(d_q.ptr, p.queries.data(), p.queries.size() * 2, cudaMemcpyHostToDevice));
  std::vector<__nv_bfloat16> more(2 * 3000 * H * 128);
  for (auto& x : more) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  dev<__nv_bfloat16> dm(more);
  REQUIRE(cache.append_async(0, std::vector<kv::append_segment>{{slots[0], 0, 3000}, {slots[1], 3000, 3000}}, dm.ptr,
                             dm.ptr, nullptr) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  for (int s = 0; s < 2; ++s) {
    p.keys[s].insert(p.keys[s].end(), more.begin() + s * 3000 * H * 128, more.begin() + (s + 1) * 3000 * H * 128);
    p.values[s].insert(p.values[s].end(), more.begin() + s * 3000 * H * 128, more.begin() + (s + 1) * 3000 * H * 128);
    p.lengths[s] += 3000;
  }
  HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto replayed_slices = slices.download();
  const auto replayed_window = window.download();
  const auto eager = run_selection(p, cache, slots, stream);
  CHECK(replayed_slices == eager.slices);
  CHECK(replayed_window == eager.window);
  for (int b = 0; b < B; ++b) compare(p, eager, b, false);
  HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("decode selection rejects bad input before launching", "[gpu][select][errors]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const problem p = make_problem({32, 8, 128}, SparseAttentionConfig{}, {100}, 1);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, cache_options(p, 1000));
  const auto slots = fill(p, cache);
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries);
  dev<std::int32_t> slices(8 * 16), num(8), window(1);
  select::decode_selection_arguments<__nv_bfloat16> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = 1;
  a.num_q_heads = 32;
  a.set_cache(cache.ref());
  const select::decode_selection_output out{slices.ptr, num.ptr, window.ptr};
  SparseAttentionConfig other;
  other.fine_slice = 32;
  CHECK(select::select_decode_async(other, a, out) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("slice/block sizes"));
  auto bad = a;
  bad.num_q_heads = 30;
  CHECK(select::select_decode_async(SparseAttentionConfig{}, bad, out) == status::invalid_argument);
  bad = a;
  bad.batch = 0;
  CHECK(select::select_decode_async(SparseAttentionConfig{}, bad, out) == status::invalid_argument);
  CHECK(select::select_decode_async(SparseAttentionConfig{}, a, select::decode_selection_output{}) ==
        status::invalid_argument);
  CHECK(select::decode_selection<default_selection_policy, __nv_bfloat16>::run(a, out) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
}
