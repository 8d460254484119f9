// Decode attention and the composed decode step on the GPU against the fp64
// CPU reference, with the FlashAttention tolerance rule of DESIGN.md
// section 6: max|out - ref64| <= 2 * max|naive - ref64| + atol, where naive is
// the same attention in fp32 with the output rounded to the KV type. Also:
// the split-KV merge against the unsplit kernel, graph capture and replay,
// the operator adapter, and bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "attention_oracle.hpp"
#include "gpu_problem.hpp"
#include "gpu_test.hpp"
#include "hisparse/attention/decode.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "hisparse/runtime/sparse_attention_op.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

template <class T>
using dev = test::device_buffer<T>;

constexpr double kAtol = 1e-5;

/// The positions batch row b attends given a selection (kept slices of KV
/// head h, then the window up to length - 1).
std::vector<std::int64_t> positions_of(const std::vector<std::int32_t>& kept, int n_kept, std::int64_t ws,
                                       std::int64_t len, int F) {
  std::vector<std::int64_t> pos;
  for (int i = 0; i < n_kept; ++i)
    for (std::int64_t t = std::int64_t{kept[i]} * F; t < (std::int64_t{kept[i]} + 1) * F; ++t) pos.push_back(t);
  for (std::int64_t t = ws; t < len; ++t) pos.push_back(t);
  return pos;
}

/// fp64 attention of query head qh of batch row b over `pos`, and the naive
/// fp32 one rounded to T (test/attention_oracle.hpp).
template <class T>
void attend(const test::problem<T>& p, int b, int qh, const std::vector<std::int64_t>& pos, std::vector<double>& ref,
            std::vector<double>& naive, double& lse) {
  const int D = p.shape.head_dim;
  const T* q = p.queries.data() + (static_cast<std::size_t>(b) * p.shape.num_q_heads + qh) * D;
  lse = test::attend_fp64(q, p.keys[b].data(), p.values[b].data(), p.shape.num_kv_heads, qh / p.shape.group_size(),
                          D, pos, ref, naive);
}

struct step_output {
  std::vector<double> out;  // [b][hq][d]
  std::vector<float> lse;   // [b][hq]
  std::vector<std::int32_t> kept, num, window;
  std::vector<std::int32_t> refreshed;  // run_step, select_only: [b][kv_heads]
  int splits = 0;              // the attention's plan
  bool cluster_merge = false;
  int attention_launch = -1;   // run_step: hierarchical_decode::attention_launch()
};

/// Checks a GPU output against fp64 attention over the given selection (or
/// every token when `kept` is empty): the FlashAttention rule per head, and
/// the log-sum-exp within fp32 accumulation. Where the fp64 output is NaN
/// (non-finite keys or values) the GPU's must be NaN, where it is infinite
/// non-finite, and the LSE non-finite where the fp64 one is; returns the
/// number of query heads with a NaN in fp64.
template <class T>
int check_against_fp64(const test::problem<T>& p, const step_output& g, bool dense) {
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads;
  const int D = p.shape.head_dim, G = p.shape.group_size(), F = p.cfg.fine_slice, kf = p.cfg.top_k_fine;
  double worst = 0, worst_naive = 0;
  int nan_heads = 0;
  for (int b = 0; b < B; ++b) {
    const std::int64_t len = p.lengths[static_cast<std::size_t>(b)];
    for (int h = 0; h < Hkv; ++h) {
      std::vector<std::int64_t> pos;
      if (dense) {
        for (std::int64_t t = 0; t < len; ++t) pos.push_back(t);
      } else {
        const auto at = static_cast<std::size_t>(b * Hkv + h);
        std::vector<std::int32_t> kept(g.kept.begin() + at * kf, g.kept.begin() + (at + 1) * kf);
        pos = positions_of(kept, g.num[at], g.window[static_cast<std::size_t>(b)], len, F);
      }
      for (int gq = 0; gq < G; ++gq) {
        const int qh = h * G + gq;
        std::vector<double> ref, naive;
        double lse = 0;
        attend(p, b, qh, pos, ref, naive, lse);
        const std::size_t row = static_cast<std::size_t>(b) * Hq + qh;
        // Non-finite inputs: NaN exactly where fp64 gives NaN (a NaN value
        // reaches its dimension, a NaN or +inf logit every dimension).
        bool nan_head = false;
        double err = 0, err_naive = 0;
        for (int d = 0; d < D; ++d) {
          const double o = g.out[row * D + static_cast<std::size_t>(d)];
          if (std::isnan(ref[d])) {
            INFO("batch row " << b << ", query head " << qh << ", dimension " << d << ": NaN in fp64");
            REQUIRE(std::isnan(o));
            nan_head = true;
            continue;
          }
          if (std::isinf(ref[d])) {
            // An infinite value: the same infinity. P V runs as (P_hi +
            // P_lo) V; P_hi is truncated and P_lo kept above 0 where P is,
            // so neither half makes inf - inf or 0 * inf.
            INFO("batch row " << b << ", query head " << qh << ", dimension " << d << ": " << ref[d] << " in fp64");
            REQUIRE(o == ref[d]);
            continue;
          }
          REQUIRE(std::isfinite(o));
          err = std::max(err, std::abs(o - ref[d]));
          err_naive = std::max(err_naive, std::abs(naive[d] - ref[d]));
        }
        nan_heads += nan_head ? 1 : 0;
        INFO("batch row " << b << " (length " << len << "), query head " << qh << ": error " << err
                          << ", naive fp32 error " << err_naive);
        REQUIRE(err <= 2 * err_naive + kAtol);
        if (std::isfinite(lse)) REQUIRE(g.lse[row] == Approx(lse).epsilon(1e-5).margin(1e-5));
        else REQUIRE(!std::isfinite(g.lse[row]));
        worst = std::max(worst, err);
        worst_naive = std::max(worst_naive, err_naive);
      }
    }
  }
  UNSCOPED_INFO("worst error " << worst << " (naive fp32 " << worst_naive << ")");
  return nan_heads;
}

/// Runs the composed step (selection + attention) on the problem.
template <class T, tile_policy Tile = attention::kDecodeTile, class Cache>
step_output run_step(const test::problem<T>& p, Cache& cache, const std::vector<int>& slots) {
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, D = p.shape.head_dim;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<T> d_q(p.queries), out(static_cast<std::size_t>(B) * Hq * D);
  dev<float> lse(static_cast<std::size_t>(B) * Hq);
  out.poison(nullptr);
  lse.poison(nullptr);
  hierarchical_decode<T, Tile> op(p.cfg);
  const decode_step_arguments<T> a{.queries = d_q.ptr, .slots = d_slots.ptr, .batch = B, .num_q_heads = Hq,
                                    .cache = cache.ref(), .out = out.ptr, .lse = lse.ptr};
  std::size_t bytes = 0;
  REQUIRE(op.workspace_bytes(a, bytes) == status::success);
  dev<char> ws(bytes);
  REQUIRE(op.plan(a, ws.ptr, bytes) == status::success);
  REQUIRE(op.run() == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  step_output g;
  for (const T x : out.download()) g.out.push_back(to_double(x));
  g.lse = lse.download();
  const std::size_t rows = static_cast<std::size_t>(B) * p.shape.num_kv_heads;
  g.kept.resize(rows * p.cfg.top_k_fine);
  g.num.resize(rows);
  g.window.resize(static_cast<std::size_t>(B));
  HISPARSE_CUDA_CHECK(cudaMemcpy(g.kept.data(), op.kept_slices(), g.kept.size() * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(g.num.data(), op.num_slices(), g.num.size() * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(g.window.data(), op.window_begin(), g.window.size() * 4, cudaMemcpyDeviceToHost));
  g.refreshed.resize(rows);
  HISPARSE_CUDA_CHECK(cudaMemcpy(g.refreshed.data(), op.refreshed(), rows * 4, cudaMemcpyDeviceToHost));
  g.attention_launch = static_cast<int>(op.attention_launch());
  return g;
}

/// A selection on the device for the attention kernel alone: kept lists
/// [batch][kv_heads][top_k_fine] and their counts.
struct device_selection {
  const std::int32_t* kept = nullptr;
  const std::int32_t* num = nullptr;
  int top_k_fine = 0;
  int window = 0;
  bool late_topk = false;  ///< attend the cache's valid TopK entries (a late rule)
  std::int32_t fingerprint = 0;
};

/// Runs the attention kernel alone -- dense (every slice), or sparse over
/// `sel` -- with a given number of SMs to plan for (1 forces a single split
/// per (sequence, KV head)); max_items 0: the cache's max_slices;
/// `no_clusters`: plan as for a GPU without clusters (the splits merge
/// through the workspace).
template <class T, class Cache>
step_output run_attention(const test::problem<T>& p, Cache& cache, const std::vector<int>& slots, int plan_sms,
                          std::int32_t max_items, const device_selection* sel = nullptr, bool no_clusters = false) {
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, D = p.shape.head_dim;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<T> d_q(p.queries), out(static_cast<std::size_t>(B) * Hq * D);
  dev<float> lse(static_cast<std::size_t>(B) * Hq);
  out.poison(nullptr);
  lse.poison(nullptr);
  attention::decode_attention_arguments<T> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = B;
  a.num_q_heads = Hq;
  a.cache = cache.ref();
  if (sel != nullptr) {
    a.kept_slices = sel->kept;
    a.num_slices = sel->num;
    a.top_k_fine = sel->top_k_fine;
    a.window = sel->window;
    a.late_topk = sel->late_topk;
    a.topk_fingerprint = sel->fingerprint;
  }
  a.max_items = max_items > 0 ? max_items : cache.ref().max_slices;
  a.out = out.ptr;
  a.lse = lse.ptr;
  attention::gpu_limits gpu;
  REQUIRE(attention::current_gpu_limits(gpu) == status::success);
  if (plan_sms != 0) gpu.sms = plan_sms;
  if (no_clusters) gpu.cc_major = 8;
  attention::decode_attention_plan plan;
  REQUIRE(attention::plan_decode_attention(a, gpu, plan) == status::success);
  if (plan_sms == 1) REQUIRE(plan.splits == (a.max_items + plan.slices_per_split - 1) / plan.slices_per_split);
  dev<char> ws(std::max<std::size_t>(plan.workspace_bytes, 1));
  REQUIRE(attention::initialize_decode_attention_workspace(plan, ws.ptr) == status::success);
  REQUIRE(attention::decode_attention_async(plan, a, ws.ptr) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  step_output g;
  for (const T x : out.download()) g.out.push_back(to_double(x));
  g.lse = lse.download();
  g.splits = plan.splits;
  g.cluster_merge = plan.cluster_merge;
  return g;
}

/// The dense baseline alone (see run_attention).
template <class T, class Cache>
step_output run_dense(const test::problem<T>& p, Cache& cache, const std::vector<int>& slots, int plan_sms = 0,
                      std::int32_t max_items = 0) {
  return run_attention(p, cache, slots, plan_sms, max_items);
}

/// Whether the current GPU runs thread-block clusters (sm_90+).
inline bool gpu_has_clusters() {
  attention::gpu_limits gpu;
  REQUIRE(attention::current_gpu_limits(gpu) == status::success);
  return gpu.cc_major >= 9;
}

/// Whether fp32 scoring may order a stage's boundary differently from the
/// fp64 reference: the last kept and the best left-out score are within
/// fp32 accumulation error of each other (scores are fp32 dot products of
/// head_dim terms; 1e-4 of the stage's largest score covers them, and the
/// mean_bf16 summaries' one-ulp rounding differences).
inline bool near_tie(const reference::scored_selection& s) {
  if (s.kept.empty() || !std::isfinite(s.best_rejected)) return false;
  double last = std::numeric_limits<double>::infinity(), scale = std::abs(s.best_rejected);
  for (const double x : s.kept_scores)
    if (std::isfinite(x)) last = std::min(last, x), scale = std::max(scale, std::abs(x));
  return std::isfinite(last) && last - s.best_rejected <= 1e-4 * std::max(scale, 1e-30);
}

/// Selected sets equal the reference's wherever no near-tie decides them;
/// the selection tests pin that down in detail, here it is a guard that the
/// step attends what the contract says. A (sequence, KV head) may differ
/// only where the reference's block or slice boundary is a near-tie (two
/// such ties in one call are rare, not impossible: a count of differences
/// allowed would fail then).
/// `evicted`: per sequence, the blocks a retention dropped (ascending).
template <class T>
void check_selection_matches_reference(const test::problem<T>& p, const step_output& g,
                                       const std::vector<std::vector<std::int32_t>>* evicted = nullptr) {
  const int Hkv = p.shape.num_kv_heads, kf = p.cfg.top_k_fine;
  for (int b = 0; b < static_cast<int>(p.lengths.size()); ++b) {
    const auto r = evicted != nullptr ? reference::decode(p.cfg, p.shape, p.sequence(b), (*evicted)[b])
                                      : reference::decode(p.cfg, p.shape, p.sequence(b));
    REQUIRE(g.window[static_cast<std::size_t>(b)] == r.tiles.at(0).window_begin);
    for (int h = 0; h < Hkv; ++h) {
      const auto at = static_cast<std::size_t>(b * Hkv + h);
      std::vector<std::int32_t> kept(g.kept.begin() + at * kf, g.kept.begin() + at * kf + g.num[at]);
      if (kept == r.tiles[0].slices[h].kept) continue;
      INFO("sequence " << b << ", KV head " << h << ": kept " << ::Catch::Detail::stringify(kept) << ", reference "
                       << ::Catch::Detail::stringify(r.tiles[0].slices[h].kept));
      CHECK((near_tie(r.tiles[0].blocks[h]) || near_tie(r.tiles[0].slices[h])));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("sparse decode step matches fp64 attention over its selection", "[gpu][attention]", __nv_bfloat16,
                   __half) {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // T = 1, T < W, non-multiples of F and C, fewer blocks than k, long.
  const std::vector<std::int64_t> lengths{1, 300, 575, 576, 1600, 5000, 33 * 1024 + 17, 100003};
  const auto p = test::make_problem<TestType>({32, 8, 128}, SparseAttentionConfig{}, lengths, seed);
  kv::paged_kv_cache<TestType, mr::device_pool_resource> cache(device, test::cache_options(p, 100003));
  const auto slots = test::fill(p, cache);
  const auto g = run_step(p, cache, slots);
  check_against_fp64(p, g, /*dense=*/false);
  check_selection_matches_reference(p, g);
}

namespace {
/// The step on a preset that reads more than the cache's fp32 sums, from a
/// cache that keeps them: against fp64 and the reference's selection, and
/// through the adapter (which serves the preset from this cache, not from
/// one without them: the tests below) with the same result.
template <class T>
void check_preset_step(preset_id id) {
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg = preset_registry{}.get(id);
  const std::vector<std::int64_t> lengths{1, 575, 5000, 33 * 1024 + 17, 100003};
  const auto p = test::make_problem<T>({32, 8, 128}, cfg, lengths, seed);
  kv::paged_kv_cache<T, mr::device_pool_resource> cache(device, test::cache_options(p, 100003));
  const auto slots = test::fill(p, cache);
  const auto g = run_step(p, cache, slots);
  check_against_fp64(p, g, /*dense=*/false);
  check_selection_matches_reference(p, g);
  sparse_attention_op<T, mr::device_pool_resource> op;
  typename decltype(op)::init_arguments in;
  in.resource = &device;
  in.cache = cache.ref();
  in.max_batch = static_cast<int>(lengths.size());
  in.num_q_heads = 32;
  REQUIRE(op.init(in) == status::success);
  REQUIRE(op.serves(id));
  const int B = static_cast<int>(lengths.size());
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<T> d_q(p.queries), out(B * 32 * 128);
  typename decltype(op)::forward_arguments f;
  f.queries = d_q.ptr;
  f.slots = d_slots.ptr;
  f.batch = B;
  f.out = out.ptr;
  f.preset = id;
  out.poison(nullptr);
  REQUIRE(op.forward(f, nullptr) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> got;
  for (const auto x : out.download()) got.push_back(to_double(x));
  REQUIRE(got == g.out);
}
}  // namespace

TEMPLATE_TEST_CASE("sparse decode step on bf16 slice summaries (standard_bf16_summaries)", "[gpu][attention]",
                   __nv_bfloat16, __half) {
  HISPARSE_REQUIRE_GPU();
  check_preset_step<TestType>(preset_id::standard_bf16_summaries);
}

TEMPLATE_TEST_CASE("sparse decode step on slice key bounds (standard_key_bounds)", "[gpu][attention][bounds]",
                   __nv_bfloat16, __half) {
  HISPARSE_REQUIRE_GPU();
  check_preset_step<TestType>(preset_id::standard_key_bounds);
}

TEST_CASE("sparse decode step across GQA 1/4/8, head_dim 64/128, batches 1/3/8", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const SparseAttentionConfig small{128, 256, 32, 4, 6, 1};
  const std::vector<std::vector<std::int64_t>> batches{{9000}, {1, 4097, 20000}, {64, 65, 127, 1000, 1024, 1025, 3333, 12345}};
  for (const int group : {1, 4, 8})
    for (const int dim : {64, 128})
      for (const auto& lengths : batches) {
        INFO("group " << group << ", head_dim " << dim << ", batch " << lengths.size());
        const auto p = test::make_problem<__nv_bfloat16>({2 * group, 2, dim}, small, lengths,
                                                         seed + static_cast<std::uint64_t>(group * dim + lengths.size()));
        kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 20000));
        const auto slots = test::fill(p, cache);
        const auto g = run_step(p, cache, slots);
        REQUIRE(g.attention_launch ==
                static_cast<int>(hierarchical_decode<__nv_bfloat16>::dependents_launch::after_blocks));
        check_against_fp64(p, g, false);
        check_selection_matches_reference(p, g);
      }
}

TEST_CASE("sparse decode step with the attention let in at each point of the selection", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // hierarchical_decode lets the attention's CTAs start once the blocks are
  // ranked (the tests above: the fine stage ranked on one warp), once the
  // fine candidates are scored (a fine stage the whole CTA ranks), or with
  // the selection (a selection of more than two CTAs per SM). What the
  // attention reads must not depend on it.
  using launch = hierarchical_decode<__nv_bfloat16>::dependents_launch;
  SECTION("top_k_fine 40: the whole CTA ranks 512 fine candidates") {
    const SparseAttentionConfig wide_fine{512, 1024, 64, 32, 40, 1};
    const auto p = test::make_problem<__nv_bfloat16>({8, 2, 128}, wide_fine, {40000, 70001, 3000}, seed);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 70001));
    const auto slots = test::fill(p, cache);
    const auto g = run_step(p, cache, slots);
    REQUIRE(g.attention_launch == static_cast<int>(launch::after_fine_scores));
    check_against_fp64(p, g, false);
    check_selection_matches_reference(p, g);
  }
  SECTION("more selection CTAs than two per SM") {
    attention::gpu_limits gpu;
    REQUIRE(attention::current_gpu_limits(gpu) == status::success);
    const int kv_heads = 8;
    const int batch = 2 * gpu.sms / (kv_heads * select::detail::kSelectCluster) + 1;
    std::vector<std::int64_t> lengths;
    for (int b = 0; b < batch; ++b) lengths.push_back(2000 + 977 * b);
    const auto p = test::make_problem<__nv_bfloat16>({kv_heads, kv_heads, 64}, SparseAttentionConfig{}, lengths, seed + 1);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, lengths.back()));
    const auto slots = test::fill(p, cache);
    const auto g = run_step(p, cache, slots);
    REQUIRE(g.attention_launch == static_cast<int>(launch::at_start));
    check_against_fp64(p, g, false);
    check_selection_matches_reference(p, g);
  }
}

TEST_CASE("sparse decode step at 300K tokens", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const auto p = test::make_problem<__nv_bfloat16>({8, 2, 64}, SparseAttentionConfig{}, {300000, 262144 + 5}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 300000));
  const auto slots = test::fill(p, cache);
  const auto g = run_step(p, cache, slots);
  check_against_fp64(p, g, false);
  check_selection_matches_reference(p, g);
}

TEST_CASE("NaN and infinite keys and values give NaN where fp64 does and exact results elsewhere", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  auto p = test::make_problem<__nv_bfloat16>({8, 2, 128}, SparseAttentionConfig{}, {5000, 5000, 40000}, seed);
  const int Hkv = 2, D = 128, G = 4;
  auto key = [&](int b, std::int64_t t, int h, int d) -> auto& {
    return p.keys[static_cast<std::size_t>(b)][static_cast<std::size_t>((t * Hkv + h) * D + d)];
  };
  auto summed_query = [&](int b, int h, int d) {
    double q = 0;
    for (int g = 0; g < G; ++g) q += to_double(p.queries[static_cast<std::size_t>((b * 8 + h * G + g) * D + d)]);
    return q;
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Row 0: a NaN value in the window of KV head 0 (its four heads NaN).
  p.values[0][static_cast<std::size_t>((4990 * Hkv + 0) * D + 7)] = from_float<__nv_bfloat16>(nan);
  // Row 0, KV head 1: +inf and -inf values in the window (those dimensions
  // of its four heads are non-finite, the rest exact).
  p.values[0][static_cast<std::size_t>((4991 * Hkv + 1) * D + 9)] = from_float<__nv_bfloat16>(inf);
  p.values[0][static_cast<std::size_t>((4700 * Hkv + 1) * D + 20)] = from_float<__nv_bfloat16>(-inf);
  // And +inf in dimension 11 of the window token with query head 4's largest
  // logit: its P is exactly 1 (P_lo would be 0, and 0 * inf NaN).
  {
    std::int64_t best = 4480;  // ws for 5000 tokens
    double top = -HUGE_VAL;
    for (std::int64_t t = 4480; t < 5000; ++t) {
      double logit = 0;
      for (int d = 0; d < D; ++d)
        logit += to_double(p.queries[static_cast<std::size_t>(4 * D + d)]) *
                 to_double(p.keys[0][static_cast<std::size_t>((t * Hkv + 1) * D + d)]);
      if (logit > top) top = logit, best = t;
    }
    p.values[0][static_cast<std::size_t>((best * Hkv + 1) * D + 11)] = from_float<__nv_bfloat16>(inf);
  }
  // Row 1: +inf in one key dimension in the window of KV head 1: +inf logits
  // (NaN output) for its heads whose query is positive there, -inf (the
  // token weighs nothing) for the others.
  key(1, 4800, 1, 3) = from_float<__nv_bfloat16>(inf);
  // Row 2, KV head 0: an infinite key in the dimension of the largest
  // summed query (never 0, which would make 0 * inf), signed so that its
  // slice and block score +inf and are kept; KV head 1: a NaN key far back,
  // whose block (NaN mean) is ranked last and left out.
  int dim = 0;
  for (int d = 1; d < D; ++d)
    if (std::abs(summed_query(2, 0, d)) > std::abs(summed_query(2, 0, dim))) dim = d;
  REQUIRE(summed_query(2, 0, dim) != 0);
  key(2, 20005, 0, dim) = from_float<__nv_bfloat16>(summed_query(2, 0, dim) > 0 ? inf : -inf);
  key(2, 10000, 1, 5) = from_float<__nv_bfloat16>(nan);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 40000));
  const auto slots = test::fill(p, cache);

  const auto g = run_step(p, cache, slots);
  check_selection_matches_reference(p, g);
  const int kf = p.cfg.top_k_fine, F = p.cfg.fine_slice, spb = p.cfg.slices_per_block();
  const auto kept = [&](int b, int h) {
    const auto at = static_cast<std::size_t>(b * Hkv + h);
    return std::vector<std::int32_t>(g.kept.begin() + at * kf, g.kept.begin() + at * kf + g.num[at]);
  };
  const auto row2 = kept(2, 0);
  CHECK(std::find(row2.begin(), row2.end(), 20005 / F) != row2.end());  // the +inf slice is kept
  const auto row2h1 = kept(2, 1);
  CHECK(std::none_of(row2h1.begin(), row2h1.end(), [&](int s) { return s / spb == 10000 / p.cfg.coarse_block; }));
  // Row 0's first group (4 heads), and in row 2's first group at least one
  // head (the summed query's sign there is some head's). Which of rows 1
  // and 2's heads come out NaN depends on the query signs; the per-dimension
  // check above pins each one.
  const int sparse_nan = check_against_fp64(p, g, /*dense=*/false);
  CHECK(sparse_nan >= G + 1);
  // Dense: the far NaN key reaches KV head 1 of row 2 as well.
  const int dense_nan = check_against_fp64(p, run_dense(p, cache, slots), /*dense=*/true);
  CHECK(dense_nan == sparse_nan + G);
}

TEST_CASE("a NaN or an infinite query gives NaN where fp64 does and exact results elsewhere", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  auto p = test::make_problem<__nv_bfloat16>({8, 2, 128}, SparseAttentionConfig{}, {40000, 40000}, seed);
  const int D = 128;
  // Row 0, query head 1 (KV head 0): a NaN. Its group's summed query is NaN,
  // every block and slice scores NaN and the lowest are kept (ties to the
  // lower index); head 1 comes out NaN, heads 0, 2 and 3 attend those
  // slices exactly. Row 1, query head 6 (KV head 1): +inf in one dimension.
  // Slices score +inf where their mean is positive there (the lowest of
  // those are kept); head 6 meets +inf logits (NaN), heads 4, 5 and 7 are
  // exact.
  p.queries[static_cast<std::size_t>((0 * 8 + 1) * D + 5)] =
      from_float<__nv_bfloat16>(std::numeric_limits<float>::quiet_NaN());
  p.queries[static_cast<std::size_t>((1 * 8 + 6) * D + 2)] =
      from_float<__nv_bfloat16>(std::numeric_limits<float>::infinity());
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 40000));
  const auto slots = test::fill(p, cache);
  const auto g = run_step(p, cache, slots);
  check_selection_matches_reference(p, g);
  const int kf = p.cfg.top_k_fine;
  std::vector<std::int32_t> lowest(static_cast<std::size_t>(kf));
  std::iota(lowest.begin(), lowest.end(), 0);
  CHECK(std::vector<std::int32_t>(g.kept.begin(), g.kept.begin() + kf) == lowest);  // row 0, KV head 0
  CHECK(check_against_fp64(p, g, /*dense=*/false) == 2);
  CHECK(check_against_fp64(p, run_dense(p, cache, slots), /*dense=*/true) == 2);
}

TEMPLATE_TEST_CASE("dense decode baseline matches fp64 attention", "[gpu][attention]", __nv_bfloat16, __half) {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const auto p = test::make_problem<TestType>({16, 4, 128}, SparseAttentionConfig{}, {1, 63, 64, 65, 3000, 40000}, seed);
  kv::paged_kv_cache<TestType, mr::device_pool_resource> cache(device, test::cache_options(p, 40000));
  const auto slots = test::fill(p, cache);
  check_against_fp64(p, run_dense(p, cache, slots), /*dense=*/true);
  // Against the reference's dense attention too (its own code path).
  const auto g = run_dense(p, cache, slots);
  for (int b = 0; b < static_cast<int>(p.lengths.size()); ++b) {
    const auto r = reference::dense_attention(p.shape, p.sequence(b));
    for (int qh = 0; qh < p.shape.num_q_heads; ++qh)
      REQUIRE(g.lse[static_cast<std::size_t>(b) * 16 + qh] == Approx(r.lse_of(0, qh)).epsilon(1e-5).margin(1e-5));
  }
}

TEST_CASE("split-KV merge agrees with the unsplit kernel", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {5000, 70000, 129}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 70000));
  const auto slots = test::fill(p, cache);
  // One SM to plan for: one split. 24, 48 and 96 SMs: 2, 4 and 8 splits
  // (B x KV heads = 24 per split, two CTAs per SM); the real SM count: 11.
  // A dense run merges through the workspace (the sparse cluster merge is
  // tested on hand-made kept lists below). The 129-token row has 3 slices:
  // splits without items.
  const auto few = run_dense(p, cache, slots, 1);
  REQUIRE(few.splits == 1);
  for (const int sms : {24, 48, 96, 0}) {
    INFO("planned for " << sms << " SMs");
    const auto many = run_dense(p, cache, slots, sms);
    REQUIRE(many.splits > 1);
    REQUIRE_FALSE(many.cluster_merge);
    REQUIRE(few.out.size() == many.out.size());
    for (std::size_t i = 0; i < few.out.size(); ++i) {
      INFO("element " << i);
      // Both round an fp32 result to bf16: at most one bf16 ulp apart.
      REQUIRE(std::abs(few.out[i] - many.out[i]) <= std::ldexp(std::max(std::abs(few.out[i]), 1e-3), -7));
    }
    for (std::size_t i = 0; i < few.lse.size(); ++i) REQUIRE(few.lse[i] == Approx(many.lse[i]).epsilon(1e-6));
  }
}

TEST_CASE("user tile policies: 1, 2 and 8 warps, 1 to 4 stages", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // F = 64 with 16-row tiles (four per slice), 32-row tiles (two) and
  // 128-row tiles (two slices each); lengths end mid-slice and mid-tile.
  const auto p = test::make_problem<__nv_bfloat16>({16, 2, 128}, SparseAttentionConfig{}, {1, 77, 3001, 40000}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 40000));
  const auto slots = test::fill(p, cache);
  {
    INFO("1 warp, 1 stage");
    check_against_fp64(p, run_step<__nv_bfloat16, tile_policy{1, 16, 1, 1}>(p, cache, slots), false);
  }
  {
    INFO("2 warps, 4 stages");
    check_against_fp64(p, run_step<__nv_bfloat16, tile_policy{1, 32, 2, 4}>(p, cache, slots), false);
  }
  {
    INFO("8 warps, 2 stages");
    check_against_fp64(p, run_step<__nv_bfloat16, tile_policy{1, 128, 8, 2}>(p, cache, slots), false);
  }
}

TEST_CASE("GQA 16 (two head splits), head_dim 256, and a slice of 48 tokens", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  {
    INFO("group 16: two CTAs across the group");
    const auto p = test::make_problem<__nv_bfloat16>({32, 2, 128}, SparseAttentionConfig{}, {3000, 70000}, seed);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 70000));
    const auto slots = test::fill(p, cache);
    const auto g = run_step(p, cache, slots);
    check_against_fp64(p, g, false);
    check_selection_matches_reference(p, g);
  }
  {
    INFO("head_dim 256");
    const auto p = test::make_problem<__half>({8, 2, 256}, SparseAttentionConfig{}, {777, 5000}, seed + 1);
    kv::paged_kv_cache<__half, mr::device_pool_resource> cache(device, test::cache_options(p, 5000));
    const auto slots = test::fill(p, cache);
    check_against_fp64(p, run_step(p, cache, slots), false);
    check_against_fp64(p, run_dense(p, cache, slots), true);
  }
  {
    INFO("F = 48, C = 96: tiles span slices, item = row / F by division");
    const SparseAttentionConfig odd{200, 96, 48, 8, 6, 1};
    const auto p = test::make_problem<__nv_bfloat16>({8, 2, 64}, odd, {1, 47, 48, 4000, 20001}, seed + 2);
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 20001));
    const auto slots = test::fill(p, cache);
    const auto g = run_step(p, cache, slots);
    check_against_fp64(p, g, false);
    check_selection_matches_reference(p, g);
    check_against_fp64(p, run_dense(p, cache, slots), true);
  }
}

TEST_CASE("a sequence longer than the plan's max_items gets NaN output and LSE, the others exact results",
          "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const auto p = test::make_problem<__nv_bfloat16>({8, 2, 64}, SparseAttentionConfig{}, {640, 9000}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 9000));
  const auto slots = test::fill(p, cache);
  // Plan for 10 slices per row: row 0 (640 tokens) fits, row 1 does not.
  const auto g = run_dense(p, cache, slots, 0, 10);
  const int Hq = 8, D = 64;
  for (int qh = 0; qh < Hq; ++qh) {
    CHECK(std::isnan(g.lse[static_cast<std::size_t>(Hq + qh)]));
    for (int d = 0; d < D; ++d) CHECK(std::isnan(g.out[static_cast<std::size_t>((Hq + qh) * D + d)]));
  }
  auto first = p;
  first.lengths = {640};
  first.keys.resize(1);
  first.values.resize(1);
  first.queries.resize(static_cast<std::size_t>(Hq * D));
  step_output head;
  head.out.assign(g.out.begin(), g.out.begin() + Hq * D);
  head.lse.assign(g.lse.begin(), g.lse.begin() + Hq);
  check_against_fp64(first, head, /*dense=*/true);
}

TEST_CASE("sparse attention over any kept list: a kept count past top_k_fine gives NaN, never a silent answer",
          "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const SparseAttentionConfig cfg{};
  // Lengths that leave a partial last slice and 8 or 9 window slices.
  const auto p = test::make_problem<__nv_bfloat16>({8, 2, 64}, cfg, {20000, 33333, 4097}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 33333));
  const auto slots = test::fill(p, cache);
  const int B = 3, Hkv = 2, Hq = 8, D = 64, G = 4, F = cfg.fine_slice, kf = cfg.top_k_fine;
  // Per (row, KV head): 0 to kf distinct slices before the window, ascending,
  // -1 padded; (row 1, head 0) claims kf + 1.
  workload::splitmix64 rng(seed + 3);
  step_output g;
  g.kept.assign(static_cast<std::size_t>(B * Hkv * kf), -1);
  g.num.resize(static_cast<std::size_t>(B * Hkv));
  for (int b = 0; b < B; ++b) {
    const std::int64_t len = p.lengths[static_cast<std::size_t>(b)];
    const std::int64_t ws = std::max<std::int64_t>(0, (len - cfg.window) / F * F);
    g.window.push_back(static_cast<std::int32_t>(ws));
    for (int h = 0; h < Hkv; ++h) {
      std::vector<std::int32_t> pick;
      const int want = static_cast<int>(rng.below(kf + 1));
      while (static_cast<int>(pick.size()) < want) {
        const auto s = static_cast<std::int32_t>(rng.below(ws / F));
        if (std::find(pick.begin(), pick.end(), s) == pick.end()) pick.push_back(s);
      }
      std::sort(pick.begin(), pick.end());
      const auto at = static_cast<std::size_t>(b * Hkv + h);
      std::copy(pick.begin(), pick.end(), g.kept.begin() + static_cast<std::ptrdiff_t>(at * kf));
      g.num[at] = want;
    }
  }
  g.num[static_cast<std::size_t>(1 * Hkv + 0)] = kf + 1;
  dev<std::int32_t> d_kept(g.kept), d_num(g.num);
  const device_selection sel{d_kept.ptr, d_num.ptr, kf, cfg.window};
  // The GPU's split count (7 in a cluster on sm_90; without clusters 25,
  // one a slice, through the workspace), one split per row, and 5 splits (12
  // SMs, three CTAs each) merged in a cluster (sm_90) and through the
  // workspace.
  for (const auto& [plan_sms, no_clusters] :
       {std::pair{0, false}, {0, true}, {1, false}, {12, false}, {12, true}}) {
    INFO("planned for " << (plan_sms == 0 ? std::string("this GPU") : std::to_string(plan_sms) + " SMs")
                        << (no_clusters ? ", no clusters" : ""));
    const auto run = run_attention(p, cache, slots, plan_sms, attention::sparse_max_items(cfg), &sel, no_clusters);
    if (plan_sms != 1) REQUIRE((run.splits >= 2 && run.splits <= (no_clusters ? 25 : 8)));
    if (plan_sms != 1) REQUIRE(run.cluster_merge == (!no_clusters && gpu_has_clusters()));
    const auto& o = run.out;
    const auto& l = run.lse;
    double worst = 0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h) {
        const auto at = static_cast<std::size_t>(b * Hkv + h);
        for (int gq = 0; gq < G; ++gq) {
          const int qh = h * G + gq;
          const auto row = static_cast<std::size_t>(b) * Hq + qh;
          if (g.num[at] > kf) {
            CHECK(std::isnan(l[row]));
            for (int d = 0; d < D; ++d) CHECK(std::isnan(o[row * D + d]));
            continue;
          }
          std::vector<std::int32_t> kept(g.kept.begin() + static_cast<std::ptrdiff_t>(at * kf),
                                         g.kept.begin() + static_cast<std::ptrdiff_t>((at + 1) * kf));
          std::vector<double> ref, naive;
          double ref_lse = 0;
          attend(p, b, qh, positions_of(kept, g.num[at], g.window[static_cast<std::size_t>(b)],
                                        p.lengths[static_cast<std::size_t>(b)], F),
                 ref, naive, ref_lse);
          double err = 0, err_naive = 0;
          for (int d = 0; d < D; ++d) {
            REQUIRE(std::isfinite(o[row * D + d]));
            err = std::max(err, std::abs(o[row * D + d] - ref[d]));
            err_naive = std::max(err_naive, std::abs(naive[d] - ref[d]));
          }
          INFO("row " << b << ", query head " << qh << ", " << g.num[at] << " kept: error " << err << ", naive "
                      << err_naive);
          REQUIRE(err <= 2 * err_naive + kAtol);
          REQUIRE(l[row] == Approx(ref_lse).epsilon(1e-5).margin(1e-5));
          worst = std::max(worst, err);
        }
      }
    UNSCOPED_INFO("worst error " << worst);
  }
}

namespace {
/// The selection alone, with or without clusters, and the attention over
/// what it kept: the TopK stream below alternates this with run_step, so
/// entries written by one kernel are read by the other.
template <class T, class Cache>
step_output run_unclustered_step(const test::problem<T>& p, Cache& cache, const std::vector<int>& slots) {
  const int B = static_cast<int>(p.lengths.size()), Hkv = p.shape.num_kv_heads, kf = p.cfg.top_k_fine;
  const std::size_t rows = static_cast<std::size_t>(B) * Hkv;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<T> d_q(p.queries);
  dev<std::int32_t> kept(rows * kf), num(rows), window(B), refreshed(rows);
  kept.poison(nullptr);
  num.poison(nullptr);
  window.poison(nullptr);
  refreshed.poison(nullptr);
  select::decode_selection_arguments<T> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = B;
  a.num_q_heads = p.shape.num_q_heads;
  a.set_cache(cache.ref());
  a.use_clusters = false;
  select::decode_selection_output o{kept.ptr, num.ptr, window.ptr};
  o.refreshed = refreshed.ptr;
  REQUIRE(select::select_decode_async(p.cfg, a, o) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  const device_selection sel{kept.ptr, num.ptr, kf, p.cfg.window, p.cfg.refresh.late,
                             select::detail::selection_fingerprint(p.cfg)};
  auto g = run_attention(p, cache, slots, 0, std::min(attention::sparse_max_items(p.cfg), cache.ref().max_slices),
                         &sel);
  g.kept = kept.download();
  g.num = num.download();
  g.window = window.download();
  g.refreshed = refreshed.download();
  return g;
}
/// The TopK cache tests' stream: three sequences of 5000, 33 809 and
/// 100 003 tokens (32 / 8 heads, d 128) in a cache that keeps TopK entries
/// of top_k_fine slices with room for `steps` more tokens, whose queries
/// drift by their own step: slowly (0.05: a period refreshes), fast (0.3:
/// the cosine test does), between (0.15: both).
struct drifting_stream {
  static constexpr int B = 3;
  static constexpr double drift[B] = {0.05, 0.3, 0.15};
  test::problem<__nv_bfloat16> p;
  kv::paged_kv_cache_options opt;
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache;
  std::vector<int> slots;
  workload::splitmix64 rng;
  std::vector<double> q;  ///< the queries in fp64, before rounding

  drifting_stream(mr::device_pool_resource& device, const SparseAttentionConfig& cfg, int steps, std::uint64_t seed)
      : p(test::make_problem<__nv_bfloat16>({32, 8, 128}, cfg, {5000, 33 * 1024 + 17, 100003}, seed)),
        opt(options(p, steps)),
        cache(device, opt),
        slots(test::fill(p, cache)),
        rng(seed + 7),
        q(p.queries.size()) {
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = to_double(p.queries[i]);
  }

  /// Step `step`'s input: one random token appended to every sequence (on
  /// the host and in the cache) where `append`, then each sequence's
  /// queries moved by its drift * N(0, 1) a coordinate (not at step 0).
  void next(int step, bool append = true) {
    const int row = p.shape.num_kv_heads * p.shape.head_dim;
    if (append) {
      std::vector<__nv_bfloat16> k(static_cast<std::size_t>(B) * row), v(k.size());
      for (auto& x : k) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
      for (auto& x : v) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
      for (int b = 0; b < B; ++b) {
        p.keys[b].insert(p.keys[b].end(), k.begin() + b * row, k.begin() + (b + 1) * row);
        p.values[b].insert(p.values[b].end(), v.begin() + b * row, v.begin() + (b + 1) * row);
        ++p.lengths[b];
      }
      dev<__nv_bfloat16> dk(k), dv(v);
      REQUIRE(cache.append_decode_async(0, slots, dk.ptr, dv.ptr, nullptr) == status::success);
    }
    const std::size_t per_sequence = static_cast<std::size_t>(p.shape.num_q_heads) * p.shape.head_dim;
    for (int b = 0; b < B; ++b)
      for (std::size_t i = 0; i < per_sequence; ++i) {
        const std::size_t at = b * per_sequence + i;
        if (step > 0) q[at] += drift[b] * rng.normal();
        p.queries[at] = from_float<__nv_bfloat16>(static_cast<float>(q[at]));
      }
  }

 private:
  static kv::paged_kv_cache_options options(const test::problem<__nv_bfloat16>& p, int steps) {
    auto o = test::cache_options(p, 100003 + steps);
    o.topk_cache_slices = p.cfg.top_k_fine;
    return o;
  }
};

/// The group-summed query of sequence b's KV head h (G query heads a KV
/// head), in fp64: what a TopK entry keeps beside its selection.
std::vector<double> group_query_sum(const test::problem<__nv_bfloat16>& p, int b, int h, int G) {
  const int D = p.shape.head_dim;
  std::vector<double> qsum(static_cast<std::size_t>(D), 0.0);
  for (int gq = 0; gq < G; ++gq)
    for (int d = 0; d < D; ++d)
      qsum[d] += to_double(p.queries[(static_cast<std::size_t>(b) * p.shape.num_q_heads + h * G + gq) * D + d]);
  return qsum;
}

/// The GPU's refresh verdict (`refreshed`: 0 or 1) checked against the
/// reference's rule on entry `e`: fp32 against fp64, only a cosine within
/// rounding of the threshold may decide differently (counted in
/// `at_threshold`). Returns the GPU's verdict.
bool checked_verdict(const refresh_rule& rule, const reference::topk_cache_entry& e, const std::vector<double>& qsum,
                     std::int64_t pos, std::int32_t refreshed, int& at_threshold) {
  REQUIRE((refreshed == 0 || refreshed == 1));
  const bool gpu = refreshed == 1;
  if (reference::refresh_due(rule, e, qsum, pos) == gpu) return gpu;
  REQUIRE(e.position >= 0);
  REQUIRE(pos - e.position < rule.every);
  double dot = 0, aa = 0, bb = 0;
  for (std::size_t d = 0; d < qsum.size(); ++d)
    dot += qsum[d] * e.qsum[d], aa += qsum[d] * qsum[d], bb += e.qsum[d] * e.qsum[d];
  REQUIRE(std::abs(dot / std::sqrt(aa * bb) - rule.min_cosine) < 1e-5);
  ++at_threshold;
  return gpu;
}
}  // namespace

TEST_CASE("TopK cache: a drifting decode stream reuses and refreshes as the reference's rule says",
          "[gpu][attention][topk_cache]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  SparseAttentionConfig cfg;
  cfg.refresh = {4, 0.9f};
  const int B = drifting_stream::B, Hkv = 8, G = 4, kf = cfg.top_k_fine, steps = 12;
  drifting_stream stream(device, cfg, steps, seed);
  auto& p = stream.p;
  auto& cache = stream.cache;
  const auto& slots = stream.slots;
  const auto& opt = stream.opt;
  // The host's entries: what the GPU kept when it last refreshed, and the
  // query and position the rule compares against.
  std::vector<reference::topk_cache_entry> entries(static_cast<std::size_t>(B) * Hkv);
  std::vector<std::vector<std::int32_t>> entry_kept(entries.size());
  int reused = 0, refreshed = 0, at_threshold = 0;
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    stream.next(step);
    const auto g = step % 2 == 0 ? run_step(p, cache, slots) : run_unclustered_step(p, cache, slots);
    check_against_fp64(p, g, /*dense=*/false);
    for (int b = 0; b < B; ++b) {
      const std::int64_t pos = p.lengths[b] - 1;
      const auto fresh = reference::decode(p.cfg, p.shape, p.sequence(b));
      REQUIRE(g.window[b] == fresh.tiles[0].window_begin);
      for (int h = 0; h < Hkv; ++h) {
        INFO("sequence " << b << ", KV head " << h);
        const auto at = static_cast<std::size_t>(b * Hkv + h);
        auto& e = entries[at];
        std::vector<double> qsum = group_query_sum(p, b, h, G);
        const bool due = checked_verdict(cfg.refresh, e, qsum, pos, g.refreshed[at], at_threshold);
        std::vector<std::int32_t> kept(g.kept.begin() + at * kf, g.kept.begin() + at * kf + g.num[at]);
        for (int i = g.num[at]; i < kf; ++i) REQUIRE(g.kept[at * kf + i] == -1);
        if (due) {
          ++refreshed;
          if (kept != fresh.tiles[0].slices[h].kept)
            CHECK((near_tie(fresh.tiles[0].blocks[h]) || near_tie(fresh.tiles[0].slices[h])));
          e.position = pos;
          e.qsum = qsum;
          entry_kept[at] = kept;
        } else {
          ++reused;
          REQUIRE(kept == entry_kept[at]);
        }
      }
    }
  }
  INFO("reused " << reused << ", refreshed " << refreshed << ", decided at the threshold " << at_threshold);
  // The drifts above make both happen (the first step refreshes every entry).
  CHECK(refreshed > B * Hkv);
  CHECK(reused > 0);
  CHECK(at_threshold <= 2);

  // Another config on the same cache never reuses this one's entries (their
  // fingerprint differs), and the default rule leaves the entries alone.
  auto other = p;
  other.cfg.window = 1024;
  auto g = run_step(other, cache, slots);
  check_against_fp64(other, g, false);
  CHECK(g.refreshed == std::vector<std::int32_t>(static_cast<std::size_t>(B) * Hkv, 1));
  const auto words = [&] {
    std::vector<std::int32_t> w(kv::footprint_of(opt, sizeof(__nv_bfloat16)).topk_cache_bytes / 4);
    HISPARSE_CUDA_CHECK(cudaMemcpy(w.data(), cache.ref().topk.entries, w.size() * 4, cudaMemcpyDeviceToHost));
    return w;
  };
  const auto before = words();
  other.cfg.refresh = {};
  g = run_step(other, cache, slots);
  CHECK(g.refreshed == std::vector<std::int32_t>(static_cast<std::size_t>(B) * Hkv, 1));
  CHECK(words() == before);
  g = run_step(p, cache, slots);  // entries of the window-1024 config: refresh
  CHECK(g.refreshed == std::vector<std::int32_t>(static_cast<std::size_t>(B) * Hkv, 1));

  // Freeing a sequence empties its entries (the slot's next sequence selects
  // afresh); the others' stay.
  REQUIRE(cache.free_sequence(slots[1]) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto after = words();
  const auto ref = cache.ref();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      std::int32_t* control = ref.topk_entry(ref.seq_layer(slots[b], 0), h);
      const auto at = [&](const std::int32_t* w) { return static_cast<std::size_t>(w - ref.topk.entries); };
      const auto entry = at(ref.topk.entry(control, after[at(control)] & 1));
      if (b == 1) CHECK(after[entry] == -1);
      else CHECK(after[entry] == p.lengths[b] - 1);
    }
}

TEST_CASE("TopK cache, a step late: each step attends the entry the step before left", "[gpu][attention][topk_cache]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const int B = drifting_stream::B, Hkv = 8, G = 4, steps = 10, held = 2;
  // The cosine rule a step late, and every step a step late (the step
  // attends the selection of the step before).
  for (const refresh_rule rule : {refresh_rule{4, 0.9f, true}, refresh_rule{1, -1.0f, true}}) {
    INFO("every " << rule.every << ", min_cosine " << rule.min_cosine << ", a step late");
    SparseAttentionConfig cfg;
    cfg.refresh = rule;
    const int kf = cfg.top_k_fine;
    drifting_stream stream(device, cfg, steps, seed);
    auto& p = stream.p;
    auto& cache = stream.cache;
    const auto& slots = stream.slots;
    const auto& opt = stream.opt;
    // The host's mirror of every (sequence, KV head)'s two entries
    // (reference::topk_cache_slot) and their kept lists as the GPU made them.
    std::vector<reference::topk_cache_slot> slot(static_cast<std::size_t>(B) * Hkv);
    std::vector<std::array<std::vector<std::int32_t>, 2>> slot_kept(slot.size());
    int late = 0, on_time = 0, refreshed = 0, stale_attended = 0, at_threshold = 0;
    // `steps` steps that append a token each, then `held` more at the same
    // positions (a repeated step attends what the one before it left).
    for (int step = 0; step < steps + held; ++step) {
      INFO("step " << step);
      stream.next(step, /*append=*/step < steps);
      const auto g = step % 2 == 0 ? run_step(p, cache, slots) : run_unclustered_step(p, cache, slots);
      // What each (sequence, KV head) attended: its current entry where that
      // was made at or before the query, else the fresh selection.
      step_output attended = g;
      for (int b = 0; b < B; ++b) {
        const std::int64_t pos = p.lengths[b] - 1;
        const auto fresh = reference::decode(p.cfg, p.shape, p.sequence(b));
        REQUIRE(g.window[b] == fresh.tiles[0].window_begin);
        for (int h = 0; h < Hkv; ++h) {
          INFO("sequence " << b << ", KV head " << h);
          const auto at = static_cast<std::size_t>(b * Hkv + h);
          auto& m = slot[at];
          std::vector<double> qsum = group_query_sum(p, b, h, G);
          const auto& e = m.entry();
          const bool due = checked_verdict(rule, e, qsum, pos, g.refreshed[at], at_threshold);
          std::vector<std::int32_t> kept(g.kept.begin() + at * kf, g.kept.begin() + at * kf + g.num[at]);
          const bool from_entry = e.position >= 0 && e.position <= pos;
          if (from_entry) {
            ++late;
            const auto& used = slot_kept[at][m.current];
            std::copy(used.begin(), used.end(), attended.kept.begin() + at * kf);
            std::fill(attended.kept.begin() + at * kf + used.size(), attended.kept.begin() + (at + 1) * kf, -1);
            attended.num[at] = static_cast<std::int32_t>(used.size());
            if (due && used != kept) ++stale_attended;
          } else {
            ++on_time;
            REQUIRE(due);  // an empty entry always refreshes
          }
          if (due) {
            ++refreshed;
            if (kept != fresh.tiles[0].slices[h].kept)
              CHECK((near_tie(fresh.tiles[0].blocks[h]) || near_tie(fresh.tiles[0].slices[h])));
            m.entries[m.current ^ 1] = {{}, qsum, pos};
            slot_kept[at][m.current ^ 1] = kept;
            m.current ^= 1;
          } else {
            REQUIRE(kept == slot_kept[at][m.current]);
          }
        }
      }
      check_against_fp64(p, attended, /*dense=*/false);
    }
    INFO("late " << late << ", on time " << on_time << ", refreshed " << refreshed << ", attended a selection "
                 << "older than the step's own " << stale_attended << ", decided at the threshold " << at_threshold);
    CHECK(at_threshold <= 2);
    CHECK(on_time == B * Hkv);  // the first step only
    CHECK(late == (steps + held - 1) * B * Hkv);
    CHECK(stale_attended > 0);
    if (rule.every == 1) CHECK(refreshed == (steps + held) * B * Hkv);

    // The GPU's current entries are the mirror's, nothing left pending.
    std::vector<std::int32_t> words(kv::footprint_of(opt, sizeof(__nv_bfloat16)).topk_cache_bytes / 4);
    HISPARSE_CUDA_CHECK(cudaMemcpy(words.data(), cache.ref().topk.entries, words.size() * 4, cudaMemcpyDeviceToHost));
    const auto ref = cache.ref();
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h) {
        const auto at = static_cast<std::size_t>(b * Hkv + h);
        std::int32_t* control = ref.topk_entry(ref.seq_layer(slots[b], 0), h);
        const auto word = [&](const std::int32_t* w) { return words[static_cast<std::size_t>(w - ref.topk.entries)]; };
        CHECK(word(control + 1) == 0);
        const std::int32_t* e = ref.topk.entry(control, word(control) & 1);
        CHECK(word(e) == slot[at].entry().position);
        REQUIRE(word(e + 1) == static_cast<std::int32_t>(slot_kept[at][slot[at].current].size()));
        for (int i = 0; i < word(e + 1); ++i)
          CHECK(word(e + kv::topk_cache_ref::kept_offset() + i) == slot_kept[at][slot[at].current][i]);
      }
  }
}

TEST_CASE("decode step replays from a CUDA graph with new queries and tokens", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {40000, 70001, 300}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 80000));
  // Destroyed below, before the cache that appended on it: the cache must not
  // touch the handle afterwards.
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  const auto slots = test::fill(p, cache);
  const int B = 3, Hq = 32, D = 128;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries), out(B * Hq * D);
  dev<float> lse(B * Hq);
  hierarchical_attention<> op;
  const decode_step_arguments<__nv_bfloat16> a{.queries = d_q.ptr, .slots = d_slots.ptr, .batch = B,
                                                .num_q_heads = Hq, .cache = cache.ref(), .out = out.ptr,
                                                .lse = lse.ptr};
  std::size_t bytes = 0;
  REQUIRE(op.workspace_bytes(a, bytes) == status::success);
  dev<char> ws(bytes);
  REQUIRE(op.plan(a, ws.ptr, bytes, stream) == status::success);
  // A rebind keeps the planned shape: the merge counters plan zeroed are
  // laid out for its heads.
  auto other = a;
  other.num_q_heads = 16;
  CHECK(op.rebind(other) == status::invalid_argument);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE(op.run(stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // Two decode steps: each appends one token per sequence, draws new
  // queries, replays the graph, and checks it against an eager run.
  workload::splitmix64 rng(seed + 1);
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    std::vector<__nv_bfloat16> k(static_cast<std::size_t>(B) * 8 * D), v(k.size());
    for (auto& x : k) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
    for (auto& x : v) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
    for (auto& x : p.queries) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
    d_q.upload(p.queries, stream);
    dev<__nv_bfloat16> dk(k), dv(v);
    std::vector<kv::append_segment> segs;
    for (int b = 0; b < B; ++b) {
      segs.push_back({slots[b], b, 1});
      p.keys[b].insert(p.keys[b].end(), k.begin() + b * 8 * D, k.begin() + (b + 1) * 8 * D);
      p.values[b].insert(p.values[b].end(), v.begin() + b * 8 * D, v.begin() + (b + 1) * 8 * D);
      ++p.lengths[b];
    }
    REQUIRE(cache.append_async(0, segs, dk.ptr, dv.ptr, stream) == status::success);
    out.poison(stream);
    HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto replayed = out.download();
    const auto replayed_lse = lse.download();
    out.poison(stream);
    REQUIRE(op.run(stream) == status::success);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto eager = out.download();
    REQUIRE(std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(__nv_bfloat16)) == 0);
    REQUIRE(replayed_lse == lse.download());
    const auto g = run_step(p, cache, slots);
    check_against_fp64(p, g, false);
    std::vector<double> as_double;
    for (const auto x : eager) as_double.push_back(to_double(x));
    REQUIRE(as_double == g.out);
  }
  HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("offloaded slices: the step reads them from pinned host memory and gives the same bits",
          "[gpu][attention][offload]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {575, 5000, 33 * 1024 + 17, 100003},
                                             seed);
  auto o = test::cache_options(p, 100003 + 1024);  // room for the appends below
  o.max_host_bytes = std::size_t{1} << 30;
  o.host_chunk_bytes = std::size_t{16} << 20;
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, o);
  const auto slots = test::fill(p, cache);
  const int B = 4;
  const auto resident = run_step(p, cache, slots);
  const auto dense = run_dense(p, cache, slots);

  // A graph captured before anything moves: it reads the page table when replayed.
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries), out(B * 32 * 128);
  dev<float> lse(B * 32);
  hierarchical_attention<> op;
  const decode_step_arguments<__nv_bfloat16> a{.queries = d_q.ptr, .slots = d_slots.ptr, .batch = B, .num_q_heads = 32,
                                                .cache = cache.ref(), .out = out.ptr, .lse = lse.ptr};
  std::size_t bytes = 0;
  REQUIRE(op.workspace_bytes(a, bytes) == status::success);
  dev<char> ws(bytes);
  REQUIRE(op.plan(a, ws.ptr, bytes, stream) == status::success);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE(op.run(stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  // Offload every kept slice and every third other complete slice.
  const std::int64_t device_pages = cache.pool().pages_used();
  std::vector<std::vector<std::int32_t>> moved(B);
  std::int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    const auto complete = static_cast<std::int32_t>(p.lengths[static_cast<std::size_t>(b)] / 64);
    std::vector<bool> take(static_cast<std::size_t>(complete), false);
    for (std::int32_t s = 0; s < complete; s += 3) take[static_cast<std::size_t>(s)] = true;
    for (int h = 0; h < 8; ++h) {
      const auto at = static_cast<std::size_t>(b * 8 + h);
      for (int k = 0; k < resident.num[at]; ++k) {
        const std::int32_t s = resident.kept[at * 16 + static_cast<std::size_t>(k)];
        if (s < complete) take[static_cast<std::size_t>(s)] = true;
      }
    }
    for (std::int32_t s = 0; s < complete; ++s)
      if (take[static_cast<std::size_t>(s)]) moved[b].push_back(s);
    moved[b].push_back(moved[b].front());  // listed twice: moved once
  }
  // Every sequence in one batched call; first two bad batches that move nothing.
  std::vector<kv::slice_list> lists;
  for (int b = 0; b < B; ++b) lists.push_back({slots[b], 0, moved[b]});
  auto twice = lists;
  twice.push_back(lists[1]);
  REQUIRE(cache.offload_async(twice, stream) == status::invalid_argument);
  const std::vector<std::int32_t> partial{static_cast<std::int32_t>(p.lengths[0] / 64)};
  auto bad = lists;
  bad[0].slices = partial;
  REQUIRE(cache.offload_async(bad, stream) == status::invalid_argument);
  REQUIRE(cache.host_pages_used() == 0);
  REQUIRE(cache.pool().pages_used() == device_pages);
  REQUIRE(cache.offload_async(lists, stream) == status::success);
  for (int b = 0; b < B; ++b) {
    moved[b].pop_back();
    total += static_cast<std::int64_t>(moved[b].size());
  }
  REQUIRE(total > 400);
  REQUIRE(cache.host_pages_used() == total);
  REQUIRE(cache.pool().pages_used() == device_pages - total);
  REQUIRE(cache.residency(slots[3], 0, moved[3][1]) == kv::page_residency::host);
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(p.lengths[3] / 64); ++s) {
    const bool listed = std::binary_search(moved[3].begin(), moved[3].end(), s);
    REQUIRE(cache.residency(slots[3], 0, s) == (listed ? kv::page_residency::host : kv::page_residency::device));
    REQUIRE(cache.residency_of(slots[3], 0).on_host(s) == listed);
  }
  for (int b = 0; b < B; ++b)
    REQUIRE(cache.residency_of(slots[b], 0).host_slices() == static_cast<std::int32_t>(moved[b].size()));

  auto same = [](const step_output& x, const step_output& y) {
    REQUIRE(x.out == y.out);
    REQUIRE(std::memcmp(x.lse.data(), y.lse.data(), x.lse.size() * sizeof(float)) == 0);
  };
  const auto offloaded = run_step(p, cache, slots);
  same(offloaded, resident);
  REQUIRE(offloaded.kept == resident.kept);
  same(run_dense(p, cache, slots), dense);
  out.poison(stream);
  HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> replayed;
  for (const auto x : out.download()) replayed.push_back(to_double(x));
  REQUIRE(replayed == resident.out);

  // Bad requests move nothing: an incomplete slice, one past the end, and a
  // host tier too small.
  const auto last = static_cast<std::int32_t>(p.lengths[0] / 64);  // 575 tokens: slice 8 is partial
  const auto where1 = cache.residency(slots[0], 0, 1), where2 = cache.residency(slots[0], 0, 2);
  REQUIRE(cache.offload_async(slots[0], 0, std::vector<std::int32_t>{1, 2, last}, stream) == status::invalid_argument);
  REQUIRE(cache.fetch_async(slots[0], 0, std::vector<std::int32_t>{1, 2, -1}, stream) == status::invalid_argument);
  REQUIRE(cache.fetch_async(slots[0], 1, std::vector<std::int32_t>{1}, stream) == status::invalid_argument);
  REQUIRE(cache.residency(slots[0], 0, 1) == where1);
  REQUIRE(cache.residency(slots[0], 0, 2) == where2);
  REQUIRE(cache.host_pages_used() == total);
  {
    auto small = o;
    small.max_host_bytes = 3 * cache.pool().page_bytes();
    small.host_chunk_bytes = cache.pool().page_bytes();
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> tight(device, small);
    const auto tight_slots = test::fill(p, tight);
    REQUIRE(tight.reserve_host_pages(4) == status::out_of_memory);
    REQUIRE(tight.reserve_host_pages(3) == status::success);  // pinned, nothing moved
    REQUIRE(tight.host_pages_used() == 0);
    REQUIRE(tight.offload_async(tight_slots[1], 0, std::vector<std::int32_t>{0, 1, 2, 3}) == status::out_of_memory);
    REQUIRE(tight.host_pages_used() == 0);
    REQUIRE(tight.residency(tight_slots[1], 0, 0) == kv::page_residency::device);
    REQUIRE(tight.offload_async(tight_slots[1], 0, std::vector<std::int32_t>{0, 1, 2}) == status::success);
    REQUIRE(tight.host_pages_used() == 3);
    auto none = o;
    none.max_host_bytes = 0;
    kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> no_tier(device, none);
    const auto none_slots = test::fill(p, no_tier);
    REQUIRE(no_tier.offload_async(none_slots[1], 0, std::vector<std::int32_t>{0}) == status::invalid_argument);
  }

  // Half of them back: still the same bits; then appends after an offload.
  for (int b = 0; b < B; ++b) {
    std::vector<std::int32_t> back;
    for (std::size_t i = 0; i < moved[b].size(); i += 2) back.push_back(moved[b][i]);
    REQUIRE(cache.fetch_async(slots[b], 0, back, stream) == status::success);
    total -= static_cast<std::int64_t>(back.size());
    REQUIRE(cache.residency_of(slots[b], 0).host_slices() ==
            static_cast<std::int32_t>(moved[b].size() - back.size()));
  }
  REQUIRE(cache.host_pages_used() == total);
  same(run_step(p, cache, slots), resident);
  workload::splitmix64 rng(seed + 7);
  const std::int32_t extra = 700;  // crosses slice and block ends
  std::vector<__nv_bfloat16> k(static_cast<std::size_t>(B) * extra * 8 * 128), v(k.size());
  for (auto& x : k) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  for (auto& x : v) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  std::vector<kv::append_segment> segs;
  const std::size_t per = static_cast<std::size_t>(extra) * 8 * 128;
  for (int b = 0; b < B; ++b) {
    segs.push_back({slots[b], b * extra, extra});
    p.keys[b].insert(p.keys[b].end(), k.begin() + static_cast<std::ptrdiff_t>(b * per),
                     k.begin() + static_cast<std::ptrdiff_t>((b + 1) * per));
    p.values[b].insert(p.values[b].end(), v.begin() + static_cast<std::ptrdiff_t>(b * per),
                       v.begin() + static_cast<std::ptrdiff_t>((b + 1) * per));
    p.lengths[static_cast<std::size_t>(b)] += extra;
  }
  dev<__nv_bfloat16> dk(k), dv(v);
  REQUIRE(cache.append_async(0, segs, dk.ptr, dv.ptr, stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto grown = run_step(p, cache, slots);
  check_against_fp64(p, grown, false);
  check_selection_matches_reference(p, grown);

  // Freeing a sequence returns its host pages too.
  const std::int64_t before = cache.host_pages_used();
  std::int64_t on_host = 0;
  for (std::int32_t s = 0; s < static_cast<std::int32_t>(p.lengths[3] / 64); ++s)
    on_host += cache.residency(slots[3], 0, s) == kv::page_residency::host;
  REQUIRE(on_host > 0);
  REQUIRE(cache.free_sequence(slots[3], stream) == status::success);
  REQUIRE(cache.host_pages_used() == before - on_host);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("retention: evicted far blocks leave the pool, and a step keeps only resident slices, as the reference says",
          "[gpu][attention][retention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // 67, 97 and 38 far blocks (ws 69440, 99456, 39488); the last keeps
  // exactly top_k_coarse once six go.
  auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {70001, 100003, 40000}, seed);
  const SparseAttentionConfig cfg = p.cfg;
  const int B = 3, spb = cfg.slices_per_block();
  auto o = test::cache_options(p, 100003);
  o.topk_cache_slices = cfg.top_k_fine;  // evict_async must empty a pair's entries
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, o);
  const auto slots = test::fill(p, cache);
  const auto full = run_step(p, cache, slots);

  // A step with a TopK cache writes the entries; the same query reuses them.
  auto cached = p;
  cached.cfg.refresh = refresh_rule{64, -1.0f};
  (void)run_step(cached, cache, slots);
  for (const auto r : run_step(cached, cache, slots).refreshed) REQUIRE(r == 0);

  // What goes: every far block holding a slice KV head 0 kept (so the
  // selection must change; the block holding the window's start may hold
  // one too, and is not evictable), then random far blocks, down to
  // top_k_coarse + 3 far blocks resident (sequence 2: exactly top_k_coarse).
  workload::splitmix64 rng(seed + 3);
  std::vector<std::vector<std::int32_t>> evicted(B);
  for (int b = 0; b < B; ++b) {
    const auto far = contract::evictable_blocks<std::int64_t>(p.lengths[b], cfg.window, cfg.fine_slice, cfg.coarse_block);
    const std::int64_t go = b == 2 ? far - cfg.top_k_coarse : far - cfg.top_k_coarse - 3;
    std::set<std::int32_t> pick;
    const std::size_t row = static_cast<std::size_t>(b) * 8 * cfg.top_k_fine;
    for (int i = 0; i < full.num[static_cast<std::size_t>(b) * 8]; ++i)
      if (const std::int32_t block = full.kept[row + i] / spb; block < far && static_cast<std::int64_t>(pick.size()) < go)
        pick.insert(block);
    while (static_cast<std::int64_t>(pick.size()) < go) pick.insert(static_cast<std::int32_t>(rng.next() % far));
    evicted[b].assign(pick.begin(), pick.end());
  }
  std::vector<kv::block_list> lists;
  for (int b = 0; b < B; ++b) lists.push_back({slots[b], 0, evicted[b]});
  const std::int64_t pages = cache.pool().pages_used();

  SECTION("refused, and nothing changes") {
    auto refused = [&](std::vector<kv::block_list> l, const SparseAttentionConfig& c, const char* why) {
      INFO(why);
      REQUIRE(cache.evict_async(l, c, nullptr) == status::invalid_argument);
      CHECK_THAT(last_error(), Catch::Contains(why));
      REQUIRE(cache.pool().pages_used() == pages);
    };
    const std::vector<std::int32_t> partial{67}, one_more{0, 1, 2, 3, 4, 5, 6};
    refused({lists[0], {slots[0], 0, partial}}, cfg, "listed twice");
    refused({{slots[0], 0, partial}}, cfg, "not far from its decode window");  // holds ws's block
    refused({{slots[2], 0, one_more}}, cfg, "fewer than top_k_coarse");
    auto other = cfg;
    other.fine_slice = 32;
    refused({lists[0]}, other, "slice/block sizes");
    for (int b = 0; b < B; ++b) REQUIRE(cache.residency_of(slots[b], 0).evicted_slices() == 0);
  }

  SECTION("the step attends resident slices only, as the reference with those blocks dropped") {
    REQUIRE(cache.evict_async(lists, cfg, nullptr) == status::success);
    std::int64_t dropped = 0;
    for (int b = 0; b < B; ++b) {
      dropped += static_cast<std::int64_t>(evicted[b].size()) * spb;
      REQUIRE(cache.residency_of(slots[b], 0).evicted_slices() == static_cast<std::int32_t>(evicted[b].size()) * spb);
      for (const std::int32_t blk : evicted[b]) {
        REQUIRE(cache.residency(slots[b], 0, blk * spb) == kv::page_residency::evicted);
        REQUIRE(cache.residency(slots[b], 0, blk * spb + spb - 1) == kv::page_residency::evicted);
      }
    }
    REQUIRE(cache.pool().pages_used() == pages - dropped);
    // Listing them again changes nothing.
    REQUIRE(cache.evict_async(lists, cfg, nullptr) == status::success);
    REQUIRE(cache.pool().pages_used() == pages - dropped);

    const auto g = run_step(p, cache, slots);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < 8; ++h) {
        const auto at = static_cast<std::size_t>(b * 8 + h);
        REQUIRE(g.num[at] == cfg.top_k_fine);
        for (int i = 0; i < g.num[at]; ++i) {
          const std::int32_t s = g.kept[at * cfg.top_k_fine + i];
          REQUIRE_FALSE(std::binary_search(evicted[b].begin(), evicted[b].end(), s / spb));
        }
      }
    REQUIRE(g.kept != full.kept);  // head 0's slices went
    check_against_fp64(p, g, false);
    check_selection_matches_reference(p, g, &evicted);
    // The cached config's entries were emptied: every pair selects afresh,
    // and keeps resident slices.
    const auto again = run_step(cached, cache, slots);
    for (const auto r : again.refreshed) REQUIRE(r == 1);
    REQUIRE(again.kept == g.kept);

    // Freeing returns every page (evicted ones are already back).
    REQUIRE(cache.free_sequence(slots[1]) == status::success);
    REQUIRE(cache.free_sequence(slots[0]) == status::success);
    REQUIRE(cache.free_sequence(slots[2]) == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    REQUIRE(cache.pool().pages_used() == 0);
  }
}

TEST_CASE("operator adapter: init, forward by preset id, release", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  const auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {50000, 3000, 90000, 1}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 90000));
  const auto slots = test::fill(p, cache);
  const int B = 4, Hq = 32, D = 128;
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries), out(B * Hq * D);
  sparse_attention_op<__nv_bfloat16, mr::device_pool_resource> op;
  decltype(op)::forward_arguments f;
  f.queries = d_q.ptr;
  f.slots = d_slots.ptr;
  f.batch = B;
  f.out = out.ptr;
  CHECK(op.forward(f, nullptr) == status::invalid_argument);  // before init
  decltype(op)::init_arguments in;
  in.resource = &device;
  in.cache = cache.ref();
  in.max_batch = 8;
  in.num_q_heads = Hq;
  REQUIRE(op.init(in) == status::success);
  CHECK(op.serves(preset_id::standard));
  CHECK(op.serves(preset_id::high_recall));
  CHECK_FALSE(op.serves(preset_id::short_context));  // F = 32: not this cache's slices
  CHECK_FALSE(op.serves(preset_id::standard_bf16_summaries));  // the cache keeps no bf16 sums
  CHECK_FALSE(op.serves(preset_id::standard_key_bounds));  // nor key bounds
  const preset_registry presets;
  for (const preset_id id : {preset_id::standard, preset_id::high_recall}) {
    INFO("preset " << static_cast<int>(id));
    f.preset = id;
    out.poison(nullptr);
    REQUIRE(op.forward(f, nullptr) == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    auto q = p;
    q.cfg = presets.get(id);
    const auto direct = run_step(q, cache, slots);
    std::vector<double> got;
    for (const auto x : out.download()) got.push_back(to_double(x));
    REQUIRE(got == direct.out);
    check_against_fp64(q, direct, false);
  }
  f.preset = preset_id::short_context;
  CHECK(op.forward(f, nullptr) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("slice/block sizes"));
  f.preset = preset_id::standard;
  f.batch = 9;
  CHECK(op.forward(f, nullptr) == status::invalid_argument);
  op.release();
  op.release();
  f.batch = B;
  CHECK(op.forward(f, nullptr) == status::invalid_argument);
}

TEST_CASE("operator adapter serves batches of every size up to the planned one, in any order", "[gpu][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  mr::device_pool_resource device;
  // Four sequences; batch rows point at them cyclically (rows may share a slot).
  const auto base = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {5000, 3000, 9000, 1}, seed);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(base, 9000));
  const auto slots4 = test::fill(base, cache);
  constexpr int kMax = 16, Hq = 32, D = 128;
  test::problem<__nv_bfloat16> rows{base.shape, base.cfg, {}, {}, {}, {}};
  std::vector<int> slots;
  workload::splitmix64 rng(seed + 7);
  for (int r = 0; r < kMax; ++r) {
    rows.lengths.push_back(base.lengths[r % 4]);
    rows.keys.push_back(base.keys[r % 4]);
    rows.values.push_back(base.values[r % 4]);
    slots.push_back(slots4[r % 4]);
  }
  rows.queries.resize(static_cast<std::size_t>(kMax) * Hq * D);
  for (auto& x : rows.queries) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(rows.queries), out(static_cast<std::size_t>(kMax) * Hq * D);
  sparse_attention_op<__nv_bfloat16, mr::device_pool_resource> op;
  decltype(op)::init_arguments in;
  in.resource = &device;
  in.cache = cache.ref();
  in.max_batch = kMax;
  in.num_q_heads = Hq;
  REQUIRE(op.init(in) == status::success);
  decltype(op)::forward_arguments f;
  f.queries = d_q.ptr;
  f.slots = d_slots.ptr;
  f.out = out.ptr;
  // Large -> small -> large: a smaller batch's partials must never land on
  // the counters a larger one uses.
  for (const int batch : {16, 8, 1, 16, 3, 16}) {
    INFO("batch " << batch);
    f.batch = batch;
    out.poison(nullptr);
    REQUIRE(op.forward(f, nullptr) == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = out.download();
    test::problem<__nv_bfloat16> sub{rows.shape, rows.cfg, {}, {}, {}, {}};
    sub.lengths.assign(rows.lengths.begin(), rows.lengths.begin() + batch);
    sub.keys.assign(rows.keys.begin(), rows.keys.begin() + batch);
    sub.values.assign(rows.values.begin(), rows.values.begin() + batch);
    sub.queries.assign(rows.queries.begin(), rows.queries.begin() + static_cast<std::size_t>(batch) * Hq * D);
    const auto direct = run_step(sub, cache, std::vector<int>(slots.begin(), slots.begin() + batch));
    for (std::size_t i = 0; i < direct.out.size(); ++i) REQUIRE(to_double(got[i]) == direct.out[i]);
    if (batch == 3) check_against_fp64(sub, direct, false);
  }
}

TEST_CASE("decode attention rejects bad input before launching", "[gpu][attention][errors]") {
  HISPARSE_REQUIRE_GPU();
  mr::device_pool_resource device;
  const auto p = test::make_problem<__nv_bfloat16>({32, 8, 128}, SparseAttentionConfig{}, {100}, 1);
  kv::paged_kv_cache<__nv_bfloat16, mr::device_pool_resource> cache(device, test::cache_options(p, 1000));
  const auto slots = test::fill(p, cache);
  dev<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  dev<__nv_bfloat16> d_q(p.queries), out(32 * 128);
  attention::decode_attention_arguments<__nv_bfloat16> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = 1;
  a.num_q_heads = 32;
  a.cache = cache.ref();
  a.max_items = cache.ref().max_slices;
  a.out = out.ptr;
  attention::decode_attention_plan plan;
  CHECK(attention::plan_decode_attention(a, 132, plan) == status::success);
  auto bad = a;
  bad.num_q_heads = 30;
  CHECK(attention::plan_decode_attention(bad, 132, plan) == status::invalid_argument);
  bad = a;
  bad.max_items = cache.ref().max_slices + 1;
  CHECK(attention::plan_decode_attention(bad, 132, plan) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("max_items"));
  bad = a;
  bad.out = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(out.ptr) + 2);
  CHECK(attention::plan_decode_attention(bad, 132, plan) == status::invalid_argument);
  bad = a;
  bad.top_k_fine = 16;  // sparse without a window
  CHECK(attention::plan_decode_attention(bad, 132, plan) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("window"));
  bad.window = 512;  // a sparse plan: launching it needs the selection's outputs
  REQUIRE(attention::plan_decode_attention(bad, 132, plan) == status::success);
  dev<char> ws(plan.workspace_bytes);
  CHECK(attention::decode_attention_async(plan, bad, ws.ptr) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("kept_slices"));
  CHECK(attention::decode_attention_async(plan, a, ws.ptr) == status::invalid_argument);  // a dense run, sparse plan
  REQUIRE(attention::plan_decode_attention(a, 132, plan) == status::success);
  bad = a;
  bad.layer = 1;
  CHECK(attention::plan_decode_attention(bad, 132, plan) == status::invalid_argument);
  hierarchical_decode<__nv_bfloat16> op(SparseAttentionConfig{});
  CHECK(op.run() == status::invalid_argument);  // run before plan
  const decode_step_arguments<__nv_bfloat16> s{.queries = d_q.ptr, .slots = d_slots.ptr, .batch = 1,
                                                .num_q_heads = 32, .cache = cache.ref(), .out = out.ptr};
  char small[16];
  CHECK(op.plan(s, small, sizeof small) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("workspace"));
  SparseAttentionConfig other;
  other.coarse_block = 2048;
  hierarchical_decode<__nv_bfloat16> mismatched(other);
  CHECK(mismatched.can_implement(s) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("slice/block sizes"));
}
