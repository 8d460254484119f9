// Prefill of one whole prompt of T tokens for the 7B GQA model (32 query
// heads, 8 KV heads, head_dim 128, bf16, preset standard, tiles of 64
// queries), one sequence:
//  * BM_prefill/mode:sparse: the selection then the sparse attention (the
//    whole sparse prefill of one layer), with each part's time beside it;
//  * BM_prefill/mode:dense: the same attention kernel over every key up to
//    each query (the causal baseline);
//  * BM_tensor_core_peak: cuBLAS's bf16 GEMM (fp32 accumulation) at
//    8192^3, the dense tensor-core rate the attention's FLOPs are held to.
// Each counts the FLOPs it attends: 4 D per (query, query head, key) (2 D
// for Q K^T, 2 D for P V). Axes from the command line (bench_main.hpp):
// --context. With HISPARSE_DUMP_KEPT=DIR (made if missing) the sparse run
// writes its kept slices there (kept_T.i32: [tiles][kv_heads][top_k_fine],
// num_T.i32: [tiles][kv_heads]) for scripts/flex_prefill.py, which times
// FlexAttention on the same mask.
#include <benchmark/benchmark.h>

#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "hisparse/attention/prefill.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/select/prefill_selection.cuh"
#include "workload/synthetic.hpp"

#include "bench_main.hpp"
#include "bench_support.hpp"

namespace {

using namespace hisparse;
using bf16 = __nv_bfloat16;
constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

using bench::device_array;

/// How a run attends: sparse or dense, how P enters P V, heads per CTA
/// (0: the library's choice), which kernel.
struct variant {
  bool sparse = true;
  attention::pv_precision pv = attention::kPrefillPv;
  int heads_per_cta = 0;
  attention::prefill_kernel kernel = attention::prefill_kernel::automatic;
};

void prefill(benchmark::State& state, std::int32_t context, variant v) {
  const bool sparse = v.sparse;
  const SparseAttentionConfig cfg;
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.fine_slice = cfg.fine_slice;
  o.coarse_block = cfg.coarse_block;
  o.max_sequences = 1;
  o.max_context = context;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, o);
  workload::splitmix64 rng(11);
  const auto slots = bench::fill_cache(cache, 1, context, rng);
  const std::size_t q_elems = static_cast<std::size_t>(context) * kQHeads * kDim;
  const device_array<bf16> d_q(q_elems), d_out(q_elems);
  const device_array<float> d_lse(static_cast<std::size_t>(context) * kQHeads);
  bench::fill_normal(d_q.ptr, q_elems, rng.next());
  const int M = cfg.query_tile;
  const std::int32_t tiles = select::prefill_tiles(0, context, M);
  const std::vector<select::prefill_segment> segs{{slots[0], 0, context, 0, 0}};
  const device_array<select::prefill_segment> d_segs(segs);
  device_array<std::int32_t> kept(static_cast<std::size_t>(tiles) * kKvHeads * cfg.top_k_fine);
  device_array<std::int32_t> num(static_cast<std::size_t>(tiles) * kKvHeads);
  device_array<std::int32_t> window(static_cast<std::size_t>(tiles));

  select::prefill_selection_arguments<bf16> s;
  s.queries = d_q.ptr;
  s.segments = d_segs.ptr;
  s.num_segments = 1;
  s.num_tiles = tiles;
  s.num_q_heads = kQHeads;
  s.set_cache(cache.ref());
  // The fp16 plain pass, as hierarchical_prefill runs it.
  const device_array<unsigned char> plain(select::prefill_plain_rows_bytes(cache.ref(), 1, context));
  s.plain_rows = plain.ptr;
  s.plain_segments = 1;
  s.plain_positions = context;
  attention::prefill_attention_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = 1;
  a.num_tiles = tiles;
  a.query_tile = M;
  a.num_q_heads = kQHeads;
  a.cache = cache.ref();
  if (sparse) {
    a.kept_slices = kept.ptr;
    a.num_slices = num.ptr;
    a.top_k_fine = cfg.top_k_fine;
    a.window = cfg.window;
  }
  a.heads_per_cta = v.heads_per_cta;
  a.kernel = v.kernel;
  a.out = d_out.ptr;
  a.lse = d_lse.ptr;
  const select::prefill_selection_output sel{kept.ptr, num.ptr, window.ptr};

  cudaEvent_t ev[3];
  for (auto& e : ev) HISPARSE_CUDA_CHECK(cudaEventCreate(&e));
  auto run = [&] {
    HISPARSE_CUDA_CHECK(cudaEventRecord(ev[0]));
    if (sparse) throw_if_error(select::select_prefill_async(cfg, s, sel));
    HISPARSE_CUDA_CHECK(cudaEventRecord(ev[1]));
    using attention::pv_precision;
    throw_if_error(v.pv == pv_precision::rounded
                       ? attention::prefill_attention_async<bf16, attention::kPrefillTile, pv_precision::rounded>(a)
                   : v.pv == pv_precision::fp16
                       ? attention::prefill_attention_async<bf16, attention::kPrefillTile, pv_precision::fp16>(a)
                       : attention::prefill_attention_async<bf16, attention::kPrefillTile, pv_precision::split>(a));
    HISPARSE_CUDA_CHECK(cudaEventRecord(ev[2]));
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(ev[2]));
  };
  run();  // warm-up
  std::vector<double> total, select_s, attend_s;
  for (auto _ : state) {
    run();
    float ms01 = 0, ms12 = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms01, ev[0], ev[1]));
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms12, ev[1], ev[2]));
    select_s.push_back(ms01 * 1e-3);
    attend_s.push_back(ms12 * 1e-3);
    total.push_back((ms01 + ms12) * 1e-3);
    state.SetIterationTime(total.back());
  }
  // Attended keys per (query, query head): the kept slices and [ws, p]
  // (sparse), or [0, p] (dense).
  std::vector<std::int32_t> n_kept(static_cast<std::size_t>(tiles) * kKvHeads, 0);
  if (sparse)
    HISPARSE_CUDA_CHECK(cudaMemcpy(n_kept.data(), num.ptr, n_kept.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  double keys = 0;
  for (std::int32_t t = 0; t < tiles; ++t) {
    const std::int64_t p0 = std::int64_t{t} * M, p1 = std::min<std::int64_t>(p0 + M, context);
    const std::int64_t ws = sparse ? contract::window_begin(p0, cfg.window, cfg.fine_slice) : 0;
    double kept_keys = 0;
    for (int h = 0; h < kKvHeads; ++h) kept_keys += n_kept[static_cast<std::size_t>(t) * kKvHeads + h];
    kept_keys *= static_cast<double>(cfg.fine_slice) * (kQHeads / kKvHeads) * static_cast<double>(p1 - p0);
    // sum over p in [p0, p1) of (p - ws + 1), per query head
    const double window_keys = static_cast<double>(p1 - p0) * (static_cast<double>(p0 + p1 - 1) / 2.0 - ws + 1);
    keys += kept_keys + window_keys * kQHeads;
  }
  const double flops = 4.0 * kDim * keys;
  state.counters["ms"] = bench::median(total) * 1e3;
  state.counters["select_ms"] = bench::median(select_s) * 1e3;
  state.counters["attention_ms"] = bench::median(attend_s) * 1e3;
  state.counters["attended_keys_per_query"] = keys / (static_cast<double>(context) * kQHeads);
  state.counters["attention_TFLOPs"] = flops / bench::median(attend_s) * 1e-12;
  for (auto& e : ev) HISPARSE_CUDA_CHECK(cudaEventDestroy(e));
  if (const char* dir = std::getenv("HISPARSE_DUMP_KEPT"); dir != nullptr && sparse && v.pv == attention::kPrefillPv &&
      v.heads_per_cta == 0 && v.kernel == attention::prefill_kernel::automatic) {
    std::error_code made;
    std::filesystem::create_directories(dir, made);  // a failure shows as the write's
    // The run goes on where a file cannot be written; this benchmark reports the error.
    auto dump = [&](const char* name, const device_array<std::int32_t>& d, std::size_t n) {
      std::vector<std::int32_t> h(n);
      HISPARSE_CUDA_CHECK(cudaMemcpy(h.data(), d.ptr, n * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
      const std::string path = std::string(dir) + "/" + name + "_" + std::to_string(context) + ".i32";
      std::FILE* f = std::fopen(path.c_str(), "wb");
      const bool written = f != nullptr && std::fwrite(h.data(), sizeof(std::int32_t), n, f) == n;
      if (f != nullptr && std::fclose(f) == 0 && written) return true;
      state.SkipWithError(("cannot write " + path).c_str());
      return false;
    };
    if (dump("kept", kept, static_cast<std::size_t>(tiles) * kKvHeads * cfg.top_k_fine))
      dump("num", num, static_cast<std::size_t>(tiles) * kKvHeads);
  }
}

/// cuBLAS bf16 GEMM, fp32 accumulation, n^3: the in-run dense tensor-core rate.
void BM_tensor_core_peak(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::size_t elems = static_cast<std::size_t>(n) * n;
  const device_array<bf16> A(elems), B(elems), C(elems);
  bench::fill_normal(A.ptr, elems, 1);
  bench::fill_normal(B.ptr, elems, 2);
  cublasHandle_t handle = nullptr;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    state.SkipWithError("cublasCreate failed");
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    if (cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, A.ptr, CUDA_R_16BF, n, B.ptr, CUDA_R_16BF, n,
                     &beta, C.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw error(status::cuda_error, "cublasGemmEx failed");
  };
  gemm();
  bench::event_timer timer;
  std::vector<double> t;
  for (auto _ : state) {
    t.push_back(timer.seconds([&] {
      for (int i = 0; i < 10; ++i) gemm();
    }) / 10);
    state.SetIterationTime(t.back());
  }
  state.counters["TFLOPs"] = 2.0 * n * static_cast<double>(n) * n / bench::median(t) * 1e-12;
  cublasDestroy(handle);
}

/// BM_prefill/mode:M/T:t for every context of the sweep, and the kernel's
/// variants at each: P split (pv:split) or rounded once (pv:rounded) in
/// place of the default fp16, one query head per CTA (heads:1), the
/// portable mma.sync kernel where `automatic` picks the Hopper one
/// (kernel:portable, which runs fp16 as split; also with pv:rounded), the
/// warp-specialised Hopper kernel (kernel:hopper_ws).
void register_prefill(const bench::sweep& axes) {
  auto add = [](const std::string& id, std::int64_t t, variant v) {
    benchmark::RegisterBenchmark(id.c_str(), [=](benchmark::State& state) {
      prefill(state, static_cast<std::int32_t>(t), v);
    })->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  for (const auto t : axes.context)
    for (const bool sparse : {true, false}) {
      const std::string mode = std::string("mode:") + (sparse ? "sparse" : "dense");
      const std::string at = "/T:" + std::to_string(t);
      constexpr auto kPortable = attention::prefill_kernel::portable;
      constexpr auto kPv = attention::kPrefillPv, kSplit = attention::pv_precision::split,
                     kRounded = attention::pv_precision::rounded;
      add("BM_prefill/" + mode + at, t, {sparse, kPv, 0});
      add("BM_prefill_variant/" + mode + "/pv:split" + at, t, {sparse, kSplit, 0});
      add("BM_prefill_variant/" + mode + "/pv:rounded" + at, t, {sparse, kRounded, 0});
      add("BM_prefill_variant/" + mode + "/heads:1" + at, t, {sparse, kPv, 1});
      add("BM_prefill_variant/" + mode + "/kernel:portable" + at, t, {sparse, kPv, 0, kPortable});
      add("BM_prefill_variant/" + mode + "/kernel:portable/pv:rounded" + at, t, {sparse, kRounded, 0, kPortable});
      add("BM_prefill_variant/" + mode + "/kernel:hopper_ws" + at, t,
          {sparse, kPv, 0, attention::prefill_kernel::hopper_ws});
    }
}

}  // namespace

BENCHMARK(BM_tensor_core_peak)->Arg(8192)->UseManualTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  bench::sweep defaults;
  defaults.batch = {1};
  defaults.context = {8192, 16384, 32768, 262144};
  defaults.preset = {"standard"};
  return bench::run_main(argc, argv, defaults, register_prefill);
}
