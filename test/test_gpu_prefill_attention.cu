// Prefill attention on the GPU against fp64 attention over the same tokens
// (test/attention_oracle.hpp, DESIGN.md section 6's tolerance rule): sparse
// (a prefill selection's kept slices of the query's tile, then the window
// [ws, p]) and dense (every key up to p), across dtypes, GQA ratios, head
// dims, query tiles narrower than the CTA's, prompts shorter than the window,
// chunks cut mid-tile and scores that jump from tile to tile (the softmax's
// lagging max); chunking does not change a bit of the output; bad
// input gives NaN rows or an error, never a silent answer.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_oracle.hpp"
#include "gpu_problem.hpp"
#include "gpu_test.hpp"
#include "hisparse/attention/prefill.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/runtime/hierarchical_prefill.cuh"
#include "hisparse/runtime/sparse_attention_op.cuh"
#include "hisparse/select/prefill_selection.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

template <class T>
using dev = test::device_buffer<T>;
using bf16 = __nv_bfloat16;

constexpr double kAtol = 1e-5;

/// What one prefill (selection, when sparse, then attention) produced.
template <class T>
struct prefill_result {
  std::vector<select::prefill_segment> segs;
  std::vector<T> queries;  // [row][Hq][D]
  std::vector<std::int32_t> kept, num;
  std::vector<T> out;
  std::vector<float> lse;
};

/// How a run is made: the positions per sequence (from the tile boundary at
/// or before len - n[b] to len), sparse or dense, and an optional hook that
/// edits the selection on the device before the attention reads it.
enum class path { stages, composed_graph, op };

struct run_options {
  bool sparse = true;
  std::vector<std::int32_t> chunk_starts;  ///< if set: q_begin per sequence (a multiple of M), to len
  int heads_per_cta = 0;
  /// stages: the selection and the attention called one by one; composed:
  /// hierarchical_prefill captured in a CUDA graph and replayed twice;
  /// op: sparse_attention_op::forward (sparse only).
  path via = path::stages;
  bool expect_dense_plan = false;  ///< composed/op: the plan must pick the dense attention
  attention::prefill_kernel kernel = attention::prefill_kernel::automatic;
};

/// The attention kernels this device runs: the portable one, and the Hopper
/// one on an sm_90 part where the build targets sm_90a (then `automatic`
/// picks it for head_dim 64 and 128).
std::vector<attention::prefill_kernel> kernels_here() {
  gpu_limits gpu{};
  REQUIRE(current_gpu_limits(gpu) == status::success);
  if (gpu.cc_major == 9 && hisparse::detail::built_for_sm90a())
    return {attention::prefill_kernel::portable, attention::prefill_kernel::hopper};
  return {attention::prefill_kernel::portable};
}

template <class T, attention::pv_precision P = attention::kPrefillPv>
prefill_result<T> run_prefill(const test::problem<T>& p, const std::vector<std::int32_t>& n, std::uint64_t seed,
                              const run_options& how = {}) {
  mr::device_pool_resource device;
  std::int64_t longest = 1;
  for (const auto len : p.lengths) longest = std::max(longest, len);
  kv::paged_kv_cache<T, mr::device_pool_resource> cache(device, test::cache_options(p, longest));
  const auto slots = test::fill(p, cache);
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads;
  const int D = p.shape.head_dim, M = p.cfg.query_tile, kf = p.cfg.top_k_fine;

  prefill_result<T> r;
  for (int b = 0; b < B; ++b) {
    select::prefill_segment s;
    const auto len = static_cast<std::int32_t>(p.lengths[static_cast<std::size_t>(b)]);
    s.slot = slots[static_cast<std::size_t>(b)];
    s.q_begin = how.chunk_starts.empty() ? (len - n[static_cast<std::size_t>(b)]) / M * M
                                         : how.chunk_starts[static_cast<std::size_t>(b)];
    s.num_queries = len - s.q_begin;
    r.segs.push_back(s);
  }
  // Queries by position, so two chunkings of one prompt see the same ones.
  for (int b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < std::int64_t{r.segs[static_cast<std::size_t>(b)].num_queries} * Hq * D; ++i) {
      workload::splitmix64 at(seed ^ (static_cast<std::uint64_t>(b) << 48) ^
                              static_cast<std::uint64_t>(std::int64_t{r.segs[static_cast<std::size_t>(b)].q_begin} * Hq * D + i));
      r.queries.push_back(from_float<T>(static_cast<float>(at.normal())));
    }
  int tiles = 0;
  REQUIRE(select::layout_prefill_segments(r.segs.data(), B, M, tiles) == status::success);
  const std::size_t rows = r.queries.size() / (static_cast<std::size_t>(Hq) * D);
  dev<T> d_q(r.queries), d_out(rows * Hq * D);
  dev<float> d_lse(rows * Hq);
  dev<select::prefill_segment> d_segs(r.segs);
  dev<std::int32_t> kept(std::max<std::size_t>(1, static_cast<std::size_t>(tiles) * Hkv * kf)),
      num(std::max<std::size_t>(1, static_cast<std::size_t>(tiles) * Hkv)),
      window(std::max<std::size_t>(1, static_cast<std::size_t>(tiles)));
  d_out.poison(nullptr);
  d_lse.poison(nullptr);
  kept.poison(nullptr);
  num.poison(nullptr);
  std::int32_t max_end = 0;
  for (const auto& sg : r.segs) max_end = std::max(max_end, sg.q_begin + sg.num_queries);
  if (how.via != path::stages) {
    REQUIRE(how.sparse);
    prefill_step_arguments<T> st;
    st.queries = d_q.ptr;
    st.segments = d_segs.ptr;
    st.num_segments = B;
    st.num_tiles = tiles;
    st.max_end = max_end;
    st.num_q_heads = Hq;
    st.cache = cache.ref();
    st.out = d_out.ptr;
    st.lse = d_lse.ptr;
    if (how.via == path::composed_graph) {
      hierarchical_prefill<T> op(p.cfg);
      std::size_t bytes = 0;
      REQUIRE(op.workspace_bytes(st, bytes) == status::success);
      dev<char> ws(bytes);
      REQUIRE(op.plan(st, ws.ptr, bytes) == status::success);
      REQUIRE(op.runs_dense() == how.expect_dense_plan);
      cudaStream_t stream = nullptr;
      HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      REQUIRE(op.run(stream) == status::success);
      HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        d_out.poison(stream);
        d_lse.poison(stream);
        HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      }
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
      HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
      HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
      if (!op.runs_dense()) {
        r.kept = std::vector<std::int32_t>(static_cast<std::size_t>(tiles) * Hkv * kf);
        r.num = std::vector<std::int32_t>(static_cast<std::size_t>(tiles) * Hkv);
        HISPARSE_CUDA_CHECK(cudaMemcpy(r.kept.data(), op.kept_slices(), r.kept.size() * 4, cudaMemcpyDeviceToHost));
        HISPARSE_CUDA_CHECK(cudaMemcpy(r.num.data(), op.num_slices(), r.num.size() * 4, cudaMemcpyDeviceToHost));
      }
    } else {
      mr::device_pool_resource workspace_resource;
      sparse_attention_op<T, mr::device_pool_resource> op;
      typename sparse_attention_op<T, mr::device_pool_resource>::init_arguments in;
      in.resource = &workspace_resource;
      in.cache = cache.ref();
      in.max_batch = 1;
      in.max_prefill_tiles = tiles + 3;
      in.num_q_heads = Hq;
      REQUIRE(op.init(in) == status::success);
      typename sparse_attention_op<T, mr::device_pool_resource>::prefill_forward_arguments f;
      f.queries = d_q.ptr;
      f.segments = d_segs.ptr;
      f.num_segments = B;
      f.num_tiles = tiles;
      f.max_end = max_end;
      f.out = d_out.ptr;
      f.lse = d_lse.ptr;
      REQUIRE(op.forward(f, nullptr) == status::success);
      f.num_tiles = tiles + 4;  // more than init planned for
      REQUIRE(op.forward(f, nullptr) == status::invalid_argument);
      HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    }
    r.out = d_out.download();
    r.lse = d_lse.download();
    return r;
  }
  if (how.sparse) {
    select::prefill_selection_arguments<T> s;
    s.queries = d_q.ptr;
    s.segments = d_segs.ptr;
    s.num_segments = B;
    s.num_tiles = tiles;
    s.num_q_heads = Hq;
    s.set_cache(cache.ref());
    REQUIRE(select::select_prefill_async(p.cfg, s, select::prefill_selection_output{kept.ptr, num.ptr, window.ptr}) ==
            status::success);
  }
  attention::prefill_attention_arguments<T> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = B;
  a.num_tiles = tiles;
  a.query_tile = M;
  a.num_q_heads = Hq;
  a.cache = cache.ref();
  if (how.sparse) {
    a.kept_slices = kept.ptr;
    a.num_slices = num.ptr;
    a.top_k_fine = kf;
    a.window = p.cfg.window;
  }
  a.heads_per_cta = how.heads_per_cta;
  a.kernel = how.kernel;
  a.out = d_out.ptr;
  a.lse = d_lse.ptr;
  REQUIRE((attention::prefill_attention_async<T, attention::kPrefillTile, P>(a)) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  r.out = d_out.download();
  r.lse = d_lse.download();
  if (how.sparse) {
    r.kept = kept.download();
    r.num = num.download();
  }
  return r;
}

/// Checks sampled query rows (every tile's first and last, every `stride`-th
/// row, the segment's last) of every head against fp64 attention over the
/// tokens the contract gives them with the run's selection. `rounded_p`:
/// the naive baseline rounds its weights as the kernel's pv_precision::rounded
/// does (FlashAttention's rule).
template <class T>
void check_prefill(const test::problem<T>& p, const prefill_result<T>& r, bool sparse, int stride = 7,
                   bool rounded_p = false) {
  const int Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads, D = p.shape.head_dim, G = p.shape.group_size();
  const int M = p.cfg.query_tile, F = p.cfg.fine_slice, kf = p.cfg.top_k_fine;
  double worst = 0, worst_naive = 0;
  int checked = 0;
  for (std::size_t b = 0; b < r.segs.size(); ++b) {
    const auto& s = r.segs[b];
    for (std::int32_t i = 0; i < s.num_queries; ++i) {
      const std::int64_t pos = s.q_begin + i;
      if (!(i % stride == 0 || pos % M == 0 || pos % M == M - 1 || i == s.num_queries - 1)) continue;
      const std::int64_t tile = s.tile_offset + (pos / M - s.q_begin / M);
      const std::int64_t ws = sparse ? reference::window_begin(pos / M * M, p.cfg) : 0;
      for (int h = 0; h < Hkv; ++h) {
        std::vector<std::int64_t> toks;
        if (sparse) {
          const std::size_t at = static_cast<std::size_t>(tile * Hkv + h);
          REQUIRE(r.num[at] >= 0);
          REQUIRE(r.num[at] <= kf);
          for (int j = 0; j < r.num[at]; ++j)
            for (std::int64_t t = std::int64_t{r.kept[at * kf + j]} * F; t < std::int64_t{r.kept[at * kf + j] + 1} * F; ++t)
              toks.push_back(t);
        }
        for (std::int64_t t = ws; t <= pos; ++t) toks.push_back(t);
        for (int g = 0; g < G; ++g) {
          const int qh = h * G + g;
          const std::size_t row = (static_cast<std::size_t>(s.query_offset) + i) * Hq + qh;
          std::vector<double> ref, naive;
          const double lse = test::attend_fp64(r.queries.data() + row * D, p.keys[b].data(), p.values[b].data(), Hkv, h,
                                               D, toks, ref, naive, rounded_p);
          double err = 0, err_naive = 0;
          for (int d = 0; d < D; ++d) {
            const double o = to_double(r.out[row * D + d]);
            REQUIRE(std::isfinite(o));
            err = std::max(err, std::abs(o - ref[d]));
            err_naive = std::max(err_naive, std::abs(naive[d] - ref[d]));
          }
          INFO("sequence " << b << ", position " << pos << ", query head " << qh << ", " << toks.size()
                           << " tokens: error " << err << ", naive fp32 error " << err_naive);
          REQUIRE(err <= 2 * err_naive + kAtol);
          REQUIRE(r.lse[row] == Approx(lse).epsilon(1e-5).margin(1e-5));
          worst = std::max(worst, err);
          worst_naive = std::max(worst_naive, err_naive);
          ++checked;
        }
      }
    }
  }
  UNSCOPED_INFO(checked << " (query, head) rows checked; worst error " << worst << " (naive fp32 " << worst_naive
                        << ")");
  REQUIRE(checked > 0);
}

/// The tokens a sparse run attended are the contract's: ascending kept
/// slices of the far region only.
template <class T>
void check_selection_shape(const test::problem<T>& p, const prefill_result<T>& r) {
  const int Hkv = p.shape.num_kv_heads, M = p.cfg.query_tile, kf = p.cfg.top_k_fine, F = p.cfg.fine_slice;
  for (const auto& s : r.segs)
    for (std::int32_t t = 0; t < select::prefill_tiles(s.q_begin, s.num_queries, M); ++t) {
      const std::int64_t ws = reference::window_begin(std::int64_t{s.q_begin} + std::int64_t{t} * M, p.cfg);
      for (int h = 0; h < Hkv; ++h) {
        const std::size_t at = static_cast<std::size_t>(s.tile_offset + t) * Hkv + h;
        REQUIRE(r.num[at] == std::min<std::int64_t>(kf, ws / F));
        for (int j = 1; j < r.num[at]; ++j) REQUIRE(r.kept[at * kf + j - 1] < r.kept[at * kf + j]);
      }
    }
}

}  // namespace

TEST_CASE("sparse prefill attention matches fp64 over the kept slices and the window", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // A whole prompt shorter than the window, one ending mid-tile, a long one
  // (the far region holds more than top_k_fine slices).
  const auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 5000, 70001}, seed);
  const auto r = run_prefill(p, {300, 200, 130}, seed + 1);
  check_selection_shape(p, r);
  check_prefill(p, r, true);
}

TEST_CASE("prefill attention across dtypes, GQA 1/4/8, head_dim 64/128/256, query tiles 16/48/64",
          "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  for (const auto kernel : kernels_here())
    for (const int group : {1, 4, 8})
      for (const int dim : {64, 128, 256})
        for (const int m : {16, 48, 64}) {
          if (group == 8 && dim != 128) continue;
          if (kernel == attention::prefill_kernel::hopper && dim == 256) continue;
          INFO("kernel " << static_cast<int>(kernel) << ", group " << group << ", head_dim " << dim << ", query tile "
                         << m);
          const SparseAttentionConfig small{128, 256, 32, 4, 6, m};
          run_options how;
          how.kernel = kernel;
          const auto p = test::make_problem<bf16>({2 * group, 2, dim}, small, {33, 1000, 9001}, seed + group * dim + m);
          check_prefill(p, run_prefill(p, {33, 150, 100}, seed + 7, how), true, 5);
          const auto h = test::make_problem<__half>({2 * group, 2, dim}, small, {700, 4001}, seed + group * dim + m + 1);
          check_prefill(h, run_prefill(h, {130, 100}, seed + 8, how), true, 5);
        }
}

TEST_CASE("dense prefill attention is causal attention over every key", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  for (const auto kernel : kernels_here())
    for (const int dim : {64, 128}) {
      INFO("kernel " << static_cast<int>(kernel) << ", head_dim " << dim);
      run_options how;
      how.sparse = false;
      how.kernel = kernel;
      const auto p = test::make_problem<bf16>({8, 2, dim}, SparseAttentionConfig{}, {100, 3001, 9000}, seed + dim);
      check_prefill(p, run_prefill(p, {100, 300, 129}, seed + 1, how), false, 11);
      const auto h = test::make_problem<__half>({8, 2, dim}, SparseAttentionConfig{}, {777}, seed + dim + 1);
      check_prefill(h, run_prefill(h, {777}, seed + 2, how), false, 11);
    }
}

TEST_CASE("prefill attention with P rounded once meets FlashAttention's rule", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  constexpr auto kRounded = attention::pv_precision::rounded;
  const auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 20000}, seed);
  const auto h = test::make_problem<__half>({8, 2, 64}, SparseAttentionConfig{}, {3000}, seed + 3);
  for (const auto kernel : kernels_here()) {
    INFO("kernel " << static_cast<int>(kernel));
    run_options how;
    how.kernel = kernel;
    check_prefill(p, run_prefill<bf16, kRounded>(p, {300, 200}, seed + 1, how), true, 7, true);
    check_prefill(h, run_prefill<__half, kRounded>(h, {200}, seed + 4, how), true, 7, true);
    how.sparse = false;
    check_prefill(p, run_prefill<bf16, kRounded>(p, {300, 130}, seed + 2, how), false, 13, true);
  }
}

TEST_CASE("prefill attention with P split or in fp16 meets the fp32 naive's rule, large values included",
          "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // The first tile's rows (1-64 keys) are where P rounded to bf16 fails.
  auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 20000}, seed);
  const auto h = test::make_problem<__half>({8, 2, 64}, SparseAttentionConfig{}, {3000}, seed + 3);
  auto each_p = [&](auto run) {
    run(std::integral_constant<attention::pv_precision, attention::pv_precision::split>{});
    run(std::integral_constant<attention::pv_precision, attention::pv_precision::fp16>{});
  };
  each_p([&](auto pv) {
    for (const auto kernel : kernels_here()) {
      INFO("kernel " << static_cast<int>(kernel) << ", pv " << static_cast<int>(pv()));
      run_options how;
      how.kernel = kernel;
      check_prefill(p, run_prefill<bf16, pv()>(p, {300, 200}, seed + 1, how), true);
      check_prefill(h, run_prefill<__half, pv()>(h, {200}, seed + 4, how), true);
      how.sparse = false;
      check_prefill(p, run_prefill<bf16, pv()>(p, {300, 130}, seed + 2, how), false, 13);
    }
  });
  // Values fp16 cannot carry (|v| >= 65536) in the window of the last
  // queries and early in the prompt (kept or not): those tiles take P split;
  // 65280 (the largest bf16 below) and values in fp16's subnormal range stay
  // on the fp16 path.
  const int Hkv = p.shape.num_kv_heads, D = p.shape.head_dim;
  workload::splitmix64 rng(seed + 5);
  auto plant = [&](std::int64_t t0, std::int64_t t1, float v) {
    for (std::int64_t t = t0; t < t1; ++t)
      for (int hh = 0; hh < Hkv; ++hh)
        p.values[1][static_cast<std::size_t>((t * Hkv + hh) * D + rng.next() % D)] = from_float<bf16>(
            rng.next() % 2 ? v : -v);
  };
  plant(19900, 19910, 3.0e5f);
  plant(100, 2000, 1.5e6f);
  plant(4000, 9000, 65280.0f);
  plant(9000, 15000, 3.0e-7f);
  each_p([&](auto pv) {
    for (const auto kernel : kernels_here()) {
      INFO("kernel " << static_cast<int>(kernel) << ", pv " << static_cast<int>(pv()) << ", large values");
      run_options how;
      how.kernel = kernel;
      check_prefill(p, run_prefill<bf16, pv()>(p, {300, 200}, seed + 6, how), true, 3);
    }
  });
}

TEST_CASE("the running max may lag a row's true max by 2^8, and catches up past that", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // Keys scaled slice by slice (x1.5, x2.5, x6, x0.25 in turn): a row's
  // scores jump up and down from tile to tile, by less than the lag and by
  // far more (x6: a log2 score's spread ~9), in the kept slices and the
  // window alike. P rounded once keeps the exact max (its check rounds the
  // naive's weights the same way).
  auto scale_keys = [](auto& p) {
    const std::int64_t row = std::int64_t{p.shape.num_kv_heads} * p.shape.head_dim;
    for (std::size_t b = 0; b < p.keys.size(); ++b)
      for (std::int64_t i = 0; i < static_cast<std::int64_t>(p.keys[b].size()); ++i) {
        constexpr float kScale[4] = {1.5f, 2.5f, 6.0f, 0.25f};
        auto& k = p.keys[b][static_cast<std::size_t>(i)];
        k = from_float<std::decay_t<decltype(k)>>(to_float(k) * kScale[i / row / 64 % 4]);
      }
  };
  auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 20000}, seed);
  auto h = test::make_problem<__half>({8, 2, 64}, SparseAttentionConfig{}, {3000}, seed + 3);
  scale_keys(p);
  scale_keys(h);
  auto each_p = [&](auto run) {
    run(std::integral_constant<attention::pv_precision, attention::pv_precision::split>{});
    run(std::integral_constant<attention::pv_precision, attention::pv_precision::fp16>{});
    run(std::integral_constant<attention::pv_precision, attention::pv_precision::rounded>{});
  };
  each_p([&](auto pv) {
    constexpr bool kRounded = pv() == attention::pv_precision::rounded;
    for (const auto kernel : kernels_here()) {
      INFO("kernel " << static_cast<int>(kernel) << ", pv " << static_cast<int>(pv()));
      run_options how;
      how.kernel = kernel;
      check_prefill(p, run_prefill<bf16, pv()>(p, {300, 200}, seed + 1, how), true, 5, kRounded);
      check_prefill(h, run_prefill<__half, pv()>(h, {200}, seed + 4, how), true, 5, kRounded);
      how.sparse = false;
      check_prefill(p, run_prefill<bf16, pv()>(p, {300, 130}, seed + 2, how), false, 11, kRounded);
    }
  });
}

TEST_CASE("the warp-specialised Hopper kernel meets the same rules", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  gpu_limits gpu{};
  REQUIRE(current_gpu_limits(gpu) == status::success);
  if (gpu.cc_major != 9 || !hisparse::detail::built_for_sm90a()) {
    std::printf("HISPARSE_TEST_SKIPPED: the warp-specialised kernel needs an sm_90 device and an sm_90a build\n");
    WARN("skipped: needs an sm_90 device and an sm_90a build");
    return;
  }
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  run_options how;
  how.kernel = attention::prefill_kernel::hopper_ws;
  for (const int dim : {64, 128}) {
    INFO("head_dim " << dim);
    const SparseAttentionConfig small{128, 256, 32, 4, 6, 64};
    const auto p = test::make_problem<bf16>({8, 2, dim}, small, {33, 1000, 9001}, seed + dim);
    check_prefill(p, run_prefill(p, {33, 150, 100}, seed + 7, how), true, 5);
    const auto h = test::make_problem<__half>({8, 2, dim}, small, {700, 4001}, seed + dim + 1);
    check_prefill(h, run_prefill(h, {130, 100}, seed + 8, how), true, 5);
  }
  auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 20000}, seed);
  check_prefill(p, run_prefill(p, {300, 200}, seed + 1, how), true);
  check_prefill(p, run_prefill<bf16, attention::pv_precision::rounded>(p, {300, 200}, seed + 2, how), true, 7, true);
  how.sparse = false;
  check_prefill(p, run_prefill(p, {300, 130}, seed + 3, how), false, 13);
  // Values fp16 cannot carry: those tiles take P split over bf16 V.
  workload::splitmix64 rng(seed + 5);
  for (std::int64_t t = 19900; t < 19910; ++t)
    p.values[1][static_cast<std::size_t>((t * 8 + static_cast<std::int64_t>(rng.next() % 8)) * 128 + rng.next() % 128)] =
        from_float<bf16>(3.0e5f);
  how.sparse = true;
  check_prefill(p, run_prefill(p, {300, 200}, seed + 6, how), true, 3);
}

TEST_CASE("one or two query heads a CTA give the same bits", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  for (const auto kernel : kernels_here())
    for (const int dim : {64, 128}) {
      const auto p = test::make_problem<bf16>({8, 2, dim}, SparseAttentionConfig{}, {9000}, seed + dim);
      for (const bool sparse : {true, false}) {
        INFO("kernel " << static_cast<int>(kernel) << ", head_dim " << dim << (sparse ? ", sparse" : ", dense"));
        run_options how;
        how.sparse = sparse;
        how.kernel = kernel;
        how.heads_per_cta = 1;
        const auto one = run_prefill(p, {300}, seed + 1, how);
        how.heads_per_cta = 2;
        const auto two = run_prefill(p, {300}, seed + 1, how);
        REQUIRE(one.lse == two.lse);
        for (std::size_t i = 0; i < one.out.size(); ++i) REQUIRE(to_float(one.out[i]) == to_float(two.out[i]));
      }
    }
}

TEST_CASE("the composed prefill and the operator give the stages' bits, from a graph too",
          "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  auto same = [](const auto& x, const auto& y) {
    REQUIRE(x.lse == y.lse);
    for (std::size_t i = 0; i < x.out.size(); ++i) REQUIRE(to_float(x.out[i]) == to_float(y.out[i]));
  };
  const auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {20000, 5000}, seed);
  const auto stages = run_prefill(p, {300, 200}, seed + 1);
  {
    INFO("hierarchical_prefill, captured and replayed");
    const auto composed = run_prefill(p, {300, 200}, seed + 1, {true, {}, 0, path::composed_graph});
    same(stages, composed);
    REQUIRE(stages.kept == composed.kept);
    REQUIRE(stages.num == composed.num);
  }
  {
    INFO("sparse_attention_op::forward");
    same(stages, run_prefill(p, {300, 200}, seed + 1, {true, {}, 0, path::op}));
  }
  {
    INFO("a prompt whose far region never exceeds top_k_fine slices: the plan runs the dense attention alone");
    const auto s = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {1500}, seed + 2);
    const auto sparse = run_prefill(s, {1500}, seed + 3);
    same(sparse, run_prefill(s, {1500}, seed + 3, {true, {}, 0, path::composed_graph, true}));
    same(sparse, run_prefill(s, {1500}, seed + 3, {false, {}}));
  }
}

TEST_CASE("chunking a prefill does not change a bit of its output", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  const auto p = test::make_problem<bf16>({8, 2, 128}, SparseAttentionConfig{}, {20000}, seed);
  const int Hq = p.shape.num_q_heads, D = p.shape.head_dim;
  for (const bool sparse : {true, false}) {
    INFO((sparse ? "sparse" : "dense"));
    // One chunk from 19200, and the same positions as the chunk from 19584.
    const auto whole = run_prefill(p, {}, seed + 1, {sparse, {19200}});
    const auto tail = run_prefill(p, {}, seed + 1, {sparse, {19584}});
    const std::size_t skip = static_cast<std::size_t>(19584 - 19200) * Hq;
    REQUIRE(tail.out.size() + skip * D == whole.out.size());
    REQUIRE(std::equal(tail.queries.begin(), tail.queries.end(), whole.queries.begin() + skip * D,
                       [](bf16 x, bf16 y) { return to_float(x) == to_float(y); }));
    for (std::size_t i = 0; i < tail.out.size(); ++i) {
      INFO("element " << i);
      REQUIRE(to_float(tail.out[i]) == to_float(whole.out[skip * D + i]));
    }
    for (std::size_t i = 0; i < tail.lse.size(); ++i) REQUIRE(tail.lse[i] == whole.lse[skip + i]);
  }
}

TEST_CASE("prefill attention rejects bad arguments and marks bad selections NaN", "[gpu][prefill][attention]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  const auto p = test::make_problem<bf16>({8, 2, 64}, SparseAttentionConfig{}, {5000}, seed);
  mr::device_pool_resource device;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, test::cache_options(p, 5000));
  const auto slots = test::fill(p, cache);
  const int Hq = 8, Hkv = 2, D = 64, kf = p.cfg.top_k_fine;
  std::vector<select::prefill_segment> segs{{slots[0], 4096, 904, 0, 0}};
  int tiles = 0;
  REQUIRE(select::layout_prefill_segments(segs.data(), 1, 64, tiles) == status::success);
  std::vector<bf16> q(904 * Hq * D);
  workload::splitmix64 rng(seed);
  for (auto& x : q) x = from_float<bf16>(static_cast<float>(rng.normal()));
  dev<bf16> d_q(q), out(q.size());
  dev<float> lse(904 * Hq);
  dev<select::prefill_segment> d_segs(segs);
  dev<std::int32_t> kept(static_cast<std::size_t>(tiles) * Hkv * kf), num(static_cast<std::size_t>(tiles) * Hkv),
      window(static_cast<std::size_t>(tiles));
  select::prefill_selection_arguments<bf16> s;
  s.queries = d_q.ptr;
  s.segments = d_segs.ptr;
  s.num_segments = 1;
  s.num_tiles = tiles;
  s.num_q_heads = Hq;
  s.set_cache(cache.ref());
  REQUIRE(select::select_prefill_async(p.cfg, s, select::prefill_selection_output{kept.ptr, num.ptr, window.ptr}) ==
          status::success);
  attention::prefill_attention_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = 1;
  a.num_tiles = tiles;
  a.query_tile = 64;
  a.num_q_heads = Hq;
  a.cache = cache.ref();
  a.kept_slices = kept.ptr;
  a.num_slices = num.ptr;
  a.top_k_fine = kf;
  a.window = p.cfg.window;
  a.out = out.ptr;
  a.lse = lse.ptr;

  SECTION("host-side checks") {
    auto b = a;
    b.query_tile = 128;  // wider than the tile's block_q
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.num_q_heads = 7;
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.kept_slices = nullptr;
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.out = nullptr;
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.layer = 1;
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.heads_per_cta = 3;
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
    b = a;
    b.top_k_fine = 0;  // dense, but handed a selection
    REQUIRE(attention::prefill_attention_async(b) == status::invalid_argument);
  }
  SECTION("a kept count or slice the selection cannot have written: NaN rows of that tile only") {
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    auto n = num.download();
    auto k = kept.download();
    n[0] = kf + 1;              // tile 0, KV head 0: too many
    k[(3 * Hkv + 1) * kf] = 4096 / 64;  // tile 3, KV head 1: a slice of the window, not the far region
    num.upload(n, nullptr);
    kept.upload(k, nullptr);
    out.poison(nullptr);
    REQUIRE(attention::prefill_attention_async(a) == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = out.download();
    const auto l = lse.download();
    for (int i = 0; i < 904; ++i)
      for (int qh = 0; qh < Hq; ++qh) {
        const int tile = i / 64, h = qh / (Hq / Hkv);
        const bool broken = (tile == 0 && h == 0) || (tile == 3 && h == 1);
        const std::size_t row = static_cast<std::size_t>(i) * Hq + qh;
        INFO("query " << i << ", head " << qh);
        REQUIRE(std::isnan(to_float(o[row * D])) == broken);
        REQUIRE(std::isnan(l[row]) == broken);
      }
  }
  SECTION("a segment off a tile boundary: NaN rows") {
    std::vector<select::prefill_segment> off{{slots[0], 4100, 900, 0, 0}};
    dev<select::prefill_segment> d_off(off);
    auto b = a;
    b.segments = d_off.ptr;
    b.num_tiles = select::prefill_tiles(4100, 900, 64);
    out.poison(nullptr);
    REQUIRE(attention::prefill_attention_async(b) == status::success);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto o = out.download();
    for (int i = 0; i < 900; ++i) REQUIRE(std::isnan(to_float(o[static_cast<std::size_t>(i) * Hq * D])));
  }
}
