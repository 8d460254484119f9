// The decode step over a paged cache: the sparse step (selection +
// attention, two launches), its attention alone, its selection alone, and
// the dense baseline (the same attention kernel over every token), all timed
// in the same run on the same cache. Steps are timed as CUDA-graph replays
// of back-to-back steps (how a serving engine runs them) that cycle through
// enough copies of the batch that every step reads HBM, as each layer of a
// real step does (step_warm_us replays one batch, partly from L2); the dense
// baseline, 0.3-9 ms per step, eagerly. An in-run device-to-device copy
// gives the bandwidth ceiling the attention is quoted against.
// BM_decode_stream: the step on a stream of turning queries with a TopK
// cache, against the same stream selecting afresh (decode_stream).
// BM_decode_offload: that stream with half of the cache in pinned host
// memory (decode_offload). BM_layer_pipeline: two stages of layers, each a
// model_decode graph over its own cache, as layer_pipeline runs them on two
// streams of one GPU against the same pieces in turn on one stream.
//
// Axes from the command line (bench_main.hpp): --batch, --context,
// --preset, --head_dim, --dtype; the defaults are the 7B GQA model's
// (32 query heads, 8 KV heads, head_dim 128, bf16) at B = 1, 8, 32 and
// T = 32K, 128K, 256K with the standard preset. An iteration is one replay
// of the step graph; step_us is the median step.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numbers>
#include <numeric>
#include <string>
#include <vector>

#include "bench_main.hpp"
#include "bench_support.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "hisparse/runtime/layer_pipeline.cuh"
#include "hisparse/runtime/residency.hpp"
#include "workload/synthetic.hpp"

namespace {

using namespace hisparse;
constexpr int kQHeads = 32, kKvHeads = 8;
constexpr int kReplays = 20;
constexpr int kSideRuns = 30;  ///< replays of the attention-only, selection-only and warm graphs

using bench::device_array;
using bench::replay_graph;

/// `copies` batches of `batch` sequences of `context` random tokens in a
/// paged cache built for `cfg` (its slice and block sizes and fine summary),
/// filled in 16K-token chunks of fresh device-drawn normal samples (one
/// chunk appended again and again would repeat every block score and
/// inflate the ranking with ties); arguments(r) is batch r. KV: the pages'
/// element type (T, or fp8 e4m3 quantized from the same T samples).
template <class T, class KV = T>
struct decode_fixture {
  int batch, dim;
  mr::device_pool_resource device;
  kv::paged_kv_cache<KV, mr::device_pool_resource> cache;
  std::vector<std::int32_t> slots;
  device_array<T> queries, out;
  device_array<float> lse;
  std::unique_ptr<device_array<std::int32_t>> d_slots;

  static kv::paged_kv_cache_options options(const SparseAttentionConfig& cfg, int sequences, std::int32_t context,
                                            int dim, int topk_slices, std::size_t host_bytes, int layers) {
    kv::paged_kv_cache_options o;
    o.num_layers = layers;
    o.num_kv_heads = kKvHeads;
    o.head_dim = dim;
    o.fine_slice = cfg.fine_slice;
    o.coarse_block = cfg.coarse_block;
    o.max_sequences = sequences;
    o.max_context = context;
    o.fine_summary = cfg.fine_summary;
    o.coarse_summary = cfg.coarse_summary;
    o.topk_cache_slices = topk_slices;
    o.max_host_bytes = host_bytes;
    return o;
  }

  decode_fixture(const SparseAttentionConfig& cfg, int batch_, std::int32_t context, int dim_, int copies = 1,
                 int topk_slices = 0, std::size_t host_bytes = 0, int layers = 1)
      : batch(batch_),
        dim(dim_),
        cache(device, options(cfg, batch_ * copies, context, dim_, topk_slices, host_bytes, layers)),
        queries(static_cast<std::size_t>(batch_) * kQHeads * dim_),
        out(static_cast<std::size_t>(batch_) * kQHeads * dim_),
        lse(static_cast<std::size_t>(batch_) * kQHeads) {
    constexpr std::int32_t kChunk = 16384;
    workload::splitmix64 rng(3);
    device_array<T> chunk(static_cast<std::size_t>(kChunk) * kKvHeads * dim);
    for (int b = 0; b < batch * copies; ++b) {
      int slot = 0;
      throw_if_error(cache.add_sequence(context, slot));
      slots.push_back(slot);
      for (int l = 0; l < layers; ++l)
        for (std::int32_t done = 0; done < context; done += kChunk) {
          const std::int32_t n = std::min(kChunk, context - done);
          bench::fill_normal(chunk.ptr, static_cast<std::size_t>(kChunk) * kKvHeads * dim, rng.next());
          throw_if_error(cache.append_async(l, std::vector<kv::append_segment>{{slot, 0, n}}, chunk.ptr, chunk.ptr,
                                            nullptr));
        }
    }
    // The queries from their own stream: the same for every `copies` (the
    // fp8 rows compare against a one-copy bf16 fixture).
    workload::splitmix64 qrng(7);
    std::vector<T> q(static_cast<std::size_t>(batch) * kQHeads * dim);
    for (auto& x : q) x = from_float<T>(static_cast<float>(qrng.normal()));
    HISPARSE_CUDA_CHECK(cudaMemcpy(queries.ptr, q.data(), q.size() * sizeof(T), cudaMemcpyHostToDevice));
    d_slots = std::make_unique<device_array<std::int32_t>>(slots);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  }

  decode_step_arguments<T, KV> arguments(int copy = 0) const {
    decode_step_arguments<T, KV> a;
    a.queries = queries.ptr;
    a.slots = d_slots->ptr + static_cast<std::size_t>(copy) * batch;
    a.batch = batch;
    a.num_q_heads = kQHeads;
    a.cache = cache.ref();
    a.out = out.ptr;
    a.lse = lse.ptr;
    return a;
  }
};

/// Copies of the batch a cold replay cycles through: the step reads the
/// selection's summaries and the attended K/V per copy.
int step_copies(const SparseAttentionConfig& cfg, int batch, std::int32_t context, int dim, int elem_bytes) {
  const double blocks = std::ceil(static_cast<double>(context) / cfg.coarse_block);
  const double per_head =
      (std::min<double>(blocks, cfg.top_k_coarse) * cfg.slices_per_block() + blocks) * dim * 4.0 +  // summaries
      std::min<double>(context, static_cast<double>(cfg.top_k_fine) * cfg.fine_slice + cfg.window) * 2.0 * dim * elem_bytes;
  return bench::cold_copies(batch * kKvHeads * per_head, 2.0 * kKvHeads * dim * elem_bytes * batch * context);
}

/// One planned step per copy of the batch, each with its own workspace.
template <class T, tile_policy Tile = attention::kDecodeTile, class KV = T>
struct planned_steps {
  std::vector<std::unique_ptr<hierarchical_decode<T, Tile, KV>>> steps;
  std::vector<std::unique_ptr<device_array<char>>> workspaces;
  planned_steps(const SparseAttentionConfig& cfg, const decode_fixture<T, KV>& fx, int copies, cudaStream_t stream) {
    for (int r = 0; r < copies; ++r) {
      steps.push_back(std::make_unique<hierarchical_decode<T, Tile, KV>>(cfg));
      std::size_t bytes = 0;
      throw_if_error(steps.back()->workspace_bytes(fx.arguments(r), bytes));
      workspaces.push_back(std::make_unique<device_array<char>>(bytes));
      throw_if_error(steps.back()->plan(fx.arguments(r), workspaces.back()->ptr, bytes, stream));
    }
  }
  int copies() const { return static_cast<int>(steps.size()); }
  int launches() const { return std::max(kReplays, copies()); }
  hierarchical_decode<T, Tile, KV>& operator[](int i) { return *steps[static_cast<std::size_t>(i % copies())]; }
};

/// Replays `graph` once per benchmark iteration (the iteration's time: the
/// whole replay, so --benchmark_min_time means what it says) and returns
/// the per-step times.
std::vector<double> time_replays(benchmark::State& state, const replay_graph& graph, bench::event_timer& timer,
                                 cudaStream_t stream) {
  std::vector<double> per_step;
  for (auto _ : state) {
    per_step.push_back(graph.step_seconds(timer, stream));
    state.SetIterationTime(per_step.back() * graph.launches);
  }
  return per_step;
}

/// In-run copy ceiling: bytes moved (read + written) per second by a 1 GiB
/// device-to-device copy.
double copy_bandwidth(bench::event_timer& timer, cudaStream_t stream) {
  constexpr std::size_t kBytes = std::size_t{1} << 30;
  device_array<char> a(kBytes), b(kBytes);
  HISPARSE_CUDA_CHECK(cudaMemsetAsync(a.ptr, 1, kBytes, stream));
  std::vector<double> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(timer.seconds(
        [&] { HISPARSE_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, kBytes, cudaMemcpyDeviceToDevice, stream)); },
        stream));
  return 2.0 * kBytes / bench::median(t);
}

/// The output and kept slices of one step of `step` (planned on batch 0).
template <class Step>
void download_step(Step& step, int batch, int dim, std::vector<float>& out,
                   std::vector<std::int32_t>& kept, std::vector<std::int32_t>& num, const __nv_bfloat16* d_out,
                   int top_k_fine) {
  std::vector<__nv_bfloat16> o(static_cast<std::size_t>(batch) * kQHeads * dim);
  HISPARSE_CUDA_CHECK(cudaMemcpy(o.data(), d_out, o.size() * sizeof(o[0]), cudaMemcpyDeviceToHost));
  out.clear();
  for (const auto x : o) out.push_back(to_float(x));
  kept.resize(static_cast<std::size_t>(batch) * kKvHeads * top_k_fine);
  num.resize(static_cast<std::size_t>(batch) * kKvHeads);
  HISPARSE_CUDA_CHECK(cudaMemcpy(kept.data(), step.kept_slices(), kept.size() * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(num.data(), step.num_slices(), num.size() * 4, cudaMemcpyDeviceToHost));
}

/// FP8 pages against bf16 pages of the same samples (one step on batch 0):
/// the share of the bf16 step's kept slices the fp8 step keeps too, and the
/// output's relative L2 difference.
void compare_fp8_with_bf16(benchmark::State& state, const SparseAttentionConfig& cfg, int batch, std::int32_t context,
                           int dim, hierarchical_decode<__nv_bfloat16, attention::kDecodeTile, kv::fp8_e4m3>& fp8,
                           const __nv_bfloat16* fp8_out) {
  std::vector<float> o8, o16;
  std::vector<std::int32_t> k8, n8, k16, n16;
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  throw_if_error(fp8.run());
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  download_step(fp8, batch, dim, o8, k8, n8, fp8_out, cfg.top_k_fine);
  decode_fixture<__nv_bfloat16> ref(cfg, batch, context, dim, 1);
  hierarchical_decode<__nv_bfloat16> step(cfg);
  std::size_t bytes = 0;
  throw_if_error(step.workspace_bytes(ref.arguments(), bytes));
  device_array<char> ws(bytes);
  throw_if_error(step.plan(ref.arguments(), ws.ptr, bytes));
  throw_if_error(step.run());
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  download_step(step, batch, dim, o16, k16, n16, ref.out.ptr, cfg.top_k_fine);
  double both = 0, total = 0, diff = 0, norm = 0;
  for (std::size_t r = 0; r < n16.size(); ++r) {
    const auto* a = k16.data() + r * cfg.top_k_fine;
    const auto* b = k8.data() + r * cfg.top_k_fine;
    for (int i = 0; i < n16[r]; ++i) both += std::find(b, b + n8[r], a[i]) != b + n8[r] ? 1 : 0;
    total += n16[r];
  }
  for (std::size_t i = 0; i < o16.size(); ++i) {
    diff += (static_cast<double>(o8[i]) - o16[i]) * (static_cast<double>(o8[i]) - o16[i]);
    norm += static_cast<double>(o16[i]) * o16[i];
  }
  state.counters["fp8_kept_of_bf16"] = total > 0 ? both / total : 1.0;
  state.counters["fp8_out_rel_l2"] = std::sqrt(diff / norm);
}

template <class T, class KV = T>
void decode_step(benchmark::State& state, const SparseAttentionConfig& cfg, int batch, std::int32_t context,
                 int dim) {
  const int elem = static_cast<int>(sizeof(KV));
  const int copies = step_copies(cfg, batch, context, dim, elem);
  decode_fixture<T, KV> fx(cfg, batch, context, dim, copies);
  const auto args = fx.arguments();
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;

  planned_steps<T, attention::kDecodeTile, KV> steps(cfg, fx, copies, stream);
  hierarchical_decode<T, attention::kDecodeTile, KV>& sparse = steps[0];
  dense_decode<T, attention::kDecodeTile, KV> dense;
  std::size_t dense_bytes = 0;
  throw_if_error(dense.workspace_bytes(args, dense_bytes));
  device_array<char> dense_ws(dense_bytes);
  throw_if_error(dense.plan(args, dense_ws.ptr, dense_bytes, stream));

  const int launches = steps.launches();
  const replay_graph step(stream, launches, [&](cudaStream_t s, int i) { throw_if_error(steps[i].run(s)); });
  const replay_graph step_warm(stream, kReplays, [&](cudaStream_t s, int) { throw_if_error(sparse.run(s)); });
  const replay_graph attention_only(stream, launches,
                                    [&](cudaStream_t s, int i) { throw_if_error(steps[i].run_attention(s)); });
  const replay_graph selection_only(stream, launches,
                                    [&](cudaStream_t s, int i) { throw_if_error(steps[i].run_selection(s)); });

  const std::vector<double> t_step = time_replays(state, step, timer, stream);
  std::vector<double> t_warm, t_attn, t_sel, t_eager, t_dense;
  for (int i = 0; i < kSideRuns; ++i) {
    t_warm.push_back(step_warm.step_seconds(timer, stream));
    t_attn.push_back(attention_only.step_seconds(timer, stream));
    t_sel.push_back(selection_only.step_seconds(timer, stream));
    t_eager.push_back(timer.seconds([&] { throw_if_error(sparse.run(stream)); }, stream));
  }
  for (int i = 0; i < 5; ++i) t_dense.push_back(timer.seconds([&] { throw_if_error(dense.run(stream)); }, stream));
  const double copy = copy_bandwidth(timer, stream);
  // The CPU cost of an eager step as a serving engine issues it: rebind to
  // the step's arguments, then both launches.
  const double host_s = bench::host_seconds_per_call(
      [&] {
        throw_if_error(sparse.rebind(args));
        throw_if_error(sparse.run(stream));
      },
      stream);
  const double rebind_s = bench::host_seconds_per_call([&] { throw_if_error(sparse.rebind(args)); }, stream);

  // Bytes each stage must read. Selection: every candidate block's sum and
  // the kept blocks' fine summaries; attention: K and V of the kept slices
  // and the window; dense: K and V of every token.
  std::vector<std::int32_t> num(static_cast<std::size_t>(batch) * kKvHeads), window(static_cast<std::size_t>(batch));
  HISPARSE_CUDA_CHECK(cudaMemcpy(num.data(), sparse.num_slices(), num.size() * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(window.data(), sparse.window_begin(), window.size() * 4, cudaMemcpyDeviceToHost));
  double attended = 0;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < kKvHeads; ++h)
      attended += static_cast<double>(num[static_cast<std::size_t>(b * kKvHeads + h)]) * cfg.fine_slice +
                  (context - window[static_cast<std::size_t>(b)]);
  const double kv_row = 2.0 * dim * elem + (elem == 1 ? 8.0 : 0.0);  // K and V of one token of one head (and fp8 scales)
  const double attn_bytes = attended * kv_row;
  const double ws_before = window[0];
  const double blocks = std::ceil(ws_before / cfg.coarse_block);
  const double slice_bytes = cfg.fine_summary == fine_summary::mean_bf16 ? 2.0 : 4.0;
  const double sel_bytes =
      batch * kKvHeads *
      (blocks * 4.0 + std::min<double>(cfg.top_k_coarse, blocks) * cfg.slices_per_block() * slice_bytes) * dim;
  const double dense_bytes_read = static_cast<double>(batch) * kKvHeads * context * kv_row;

  const double step_s = bench::median(t_step), attn_s = bench::median(t_attn), sel_s = bench::median(t_sel);
  const double dense_s = bench::median(t_dense);
  state.counters["step_us"] = step_s * 1e6;
  state.counters["step_warm_us"] = bench::median(t_warm) * 1e6;
  state.counters["copies"] = copies;
  state.counters["eager_step_us"] = bench::median(t_eager) * 1e6;
  state.counters["host_us"] = host_s * 1e6;
  state.counters["host_rebind_us"] = rebind_s * 1e6;
  state.counters["attention_us"] = attn_s * 1e6;
  state.counters["selection_us"] = sel_s * 1e6;
  state.counters["dense_us"] = dense_s * 1e6;
  state.counters["speedup_vs_dense"] = dense_s / step_s;
  state.counters["tokens_per_query"] = attended / (batch * kKvHeads);
  state.counters["step_MB"] = (attn_bytes + sel_bytes) * 1e-6;
  state.counters["step_GBps"] = (attn_bytes + sel_bytes) / step_s * 1e-9;
  state.counters["attention_GBps"] = attn_bytes / attn_s * 1e-9;
  state.counters["dense_GBps"] = dense_bytes_read / dense_s * 1e-9;
  state.counters["copy_GBps"] = copy * 1e-9;
  state.counters["attention_of_copy"] = attn_bytes / attn_s / copy;
  state.counters["dense_of_copy"] = dense_bytes_read / dense_s / copy;
  state.counters["splits"] = sparse.attention_plan().splits;
  state.counters["cluster_merge"] = sparse.attention_plan().cluster_merge ? 1 : 0;
  if constexpr (kv::is_fp8_v<KV>) compare_fp8_with_bf16(state, cfg, batch, context, dim, sparse, fx.out.ptr);
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

/// A decode stream with a TopK cache (config.hpp, refresh_rule). Every
/// query head's query turns on a circle, q_s = sqrt(3) c + a cos(phi_s) +
/// b sin(phi_s) with phi_s = 2 pi s / kStreamSteps (a, b, c independent
/// normals), so two queries k steps apart have cosine ~(3 + cos(2 pi k /
/// kStreamSteps)) / 4 and the stream closes on itself: a graph of its
/// steps replays as one endless stream. The context is held (no token is
/// appended), so the rules' period never falls due and the cosine test
/// decides. Each step runs every copy of the batch (as a model's layers,
/// each with its own entries). Timed, per step and copy: the rule
/// `refresh` (step_us; at 0.9 the stream reuses ~90% of selections, the
/// middle of the CPU study's 86-97%, bench/results/2026-12-02-cpu-topk-
/// cache-reuse), the config without a cache (fresh_step_us), a rule that
/// refreshes every step through the cache (min_cosine 1: refresh_step_us,
/// the cache's cost on a refreshing step), and one that always reuses
/// (reuse_step_us); then the three a step late (late_*: the step attends
/// the entry as it stood, its selection serves the next step).
constexpr int kStreamSteps = 64;

/// The stream's queries, [kStreamSteps][q_elems] (see decode_stream).
template <class T>
std::vector<T> turning_queries(std::size_t q_elems) {
  std::vector<T> q(q_elems * kStreamSteps);
  workload::splitmix64 rng(11);
  std::vector<double> a(q_elems), b(q_elems), c(q_elems);
  for (std::size_t i = 0; i < q_elems; ++i) a[i] = rng.normal(), b[i] = rng.normal(), c[i] = rng.normal();
  for (int st = 0; st < kStreamSteps; ++st) {
    const double phi = 2.0 * std::numbers::pi * st / kStreamSteps;
    for (std::size_t i = 0; i < q_elems; ++i)
      q[st * q_elems + i] =
          from_float<T>(static_cast<float>(std::sqrt(3.0) * c[i] + a[i] * std::cos(phi) + b[i] * std::sin(phi)));
  }
  return q;
}

template <class T>
void decode_stream(benchmark::State& state, const SparseAttentionConfig& base, int batch, std::int32_t context,
                   int dim) {
  const int elem = static_cast<int>(sizeof(T));
  // Copies by the attention's bytes alone (a reusing step reads little else).
  const double attended = std::min<double>(context, static_cast<double>(base.top_k_fine) * base.fine_slice + base.window);
  const int copies = bench::cold_copies(batch * kKvHeads * attended * 2.0 * dim * elem,
                                        2.0 * kKvHeads * dim * elem * batch * context);
  decode_fixture<T> fx(base, batch, context, dim, copies, base.top_k_fine);
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * dim;
  const device_array<T> queries(turning_queries<T>(q_elems));
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;
  auto arguments = [&](int st, int r) {
    auto a = fx.arguments(r);
    a.queries = queries.ptr + st * q_elems;
    return a;
  };
  // One workspace per copy, shared by that copy's steps (they run in turn).
  std::size_t bytes = 0;
  throw_if_error(hierarchical_decode<T>(base).workspace_bytes(arguments(0, 0), bytes));
  std::vector<std::unique_ptr<device_array<char>>> workspaces;
  for (int r = 0; r < copies; ++r) workspaces.push_back(std::make_unique<device_array<char>>(bytes));
  const int launches = kStreamSteps * copies;
  auto plan = [&](const refresh_rule& rule) {
    SparseAttentionConfig cfg = base;
    cfg.refresh = rule;
    std::vector<std::unique_ptr<hierarchical_decode<T>>> ops;
    for (int i = 0; i < launches; ++i) {
      ops.push_back(std::make_unique<hierarchical_decode<T>>(cfg));
      throw_if_error(ops.back()->plan(arguments(i / copies, i % copies), workspaces[i % copies]->ptr, bytes, stream));
    }
    return ops;
  };
  const std::size_t rows = static_cast<std::size_t>(batch) * kKvHeads;
  auto download = [&](const std::int32_t* p, std::size_t n) {
    std::vector<std::int32_t> h(n);
    HISPARSE_CUDA_CHECK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
    return h;
  };
  const auto fresh = plan(refresh_rule{});
  // Times a rule's stream; `refreshed` gets the share of (step, copy,
  // sequence, KV head) selections made afresh over the second of two eager
  // passes (the first fills the entries), and `overlap` (optional) the
  // share of the fresh selection's slices a reused one attends.
  auto time_rule = [&](const refresh_rule& rule, double& refreshed, double* overlap) {
    const auto ops = plan(rule);
    double fresh_rows = 0, reused_rows = 0, shared = 0, fresh_slices = 0;
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < launches; ++i) {
        throw_if_error(ops[i]->run(stream));
        if (pass == 0) continue;
        HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto got = download(ops[i]->refreshed(), rows);
        for (const auto x : got) (x == 1 ? fresh_rows : reused_rows) += 1;
        if (overlap == nullptr) continue;
        const auto used = download(ops[i]->kept_slices(), rows * base.top_k_fine);
        throw_if_error(fresh[i]->run(stream));  // the default rule leaves the entries alone
        HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto best = download(fresh[i]->kept_slices(), rows * base.top_k_fine);
        for (std::size_t row = 0; row < rows; ++row) {
          if (got[row] == 1) continue;
          const auto u = used.begin() + row * base.top_k_fine, f = best.begin() + row * base.top_k_fine;
          for (int k = 0; k < base.top_k_fine; ++k)
            if (f[k] >= 0) fresh_slices += 1, shared += std::find(u, u + base.top_k_fine, f[k]) != u + base.top_k_fine;
        }
      }
    refreshed = fresh_rows / (fresh_rows + reused_rows);
    if (overlap != nullptr) *overlap = fresh_slices > 0 ? shared / fresh_slices : 1.0;
    const replay_graph graph(stream, launches, [&](cudaStream_t s, int i) { throw_if_error(ops[i]->run(s)); });
    std::vector<double> t;
    for (int i = 0; i < kSideRuns; ++i) t.push_back(graph.step_seconds(timer, stream));
    return bench::median(t);
  };
  const refresh_rule rule{kMaxWindow, 0.9f};
  double refreshed = 0, overlap = 0, all = 0, none = 0;
  const double mixed_s = time_rule(rule, refreshed, &overlap);
  const double refresh_s = time_rule({kMaxWindow, 1.0f}, all, nullptr);
  const double reuse_s = time_rule({kMaxWindow, -1.0f}, none, nullptr);
  // The same three a step late (refresh_rule::late).
  double late_refreshed = 0, late_all = 0, late_none = 0;
  const double late_s = time_rule({kMaxWindow, 0.9f, true}, late_refreshed, nullptr);
  const double late_refresh_s = time_rule({kMaxWindow, 1.0f, true}, late_all, nullptr);
  const double late_reuse_s = time_rule({kMaxWindow, -1.0f, true}, late_none, nullptr);
  const replay_graph fresh_graph(stream, launches, [&](cudaStream_t s, int i) { throw_if_error(fresh[i]->run(s)); });
  std::vector<double> t_fresh;
  for (auto _ : state) {
    t_fresh.push_back(fresh_graph.step_seconds(timer, stream));
    state.SetIterationTime(t_fresh.back() * launches);
  }
  const double fresh_s = bench::median(t_fresh);
  state.counters["step_us"] = mixed_s * 1e6;
  state.counters["fresh_step_us"] = fresh_s * 1e6;
  state.counters["refresh_step_us"] = refresh_s * 1e6;
  state.counters["reuse_step_us"] = reuse_s * 1e6;
  state.counters["refresh_overhead_us"] = (refresh_s - fresh_s) * 1e6;
  state.counters["speedup_vs_fresh"] = fresh_s / mixed_s;
  state.counters["refreshed_share"] = refreshed;
  state.counters["refreshed_share_min_cos_1"] = all;
  state.counters["refreshed_share_reuse_all"] = none;
  state.counters["kept_overlap_reused"] = overlap;
  state.counters["late_step_us"] = late_s * 1e6;
  state.counters["late_refresh_step_us"] = late_refresh_s * 1e6;
  state.counters["late_reuse_step_us"] = late_reuse_s * 1e6;
  state.counters["late_refreshed_share"] = late_refreshed;
  state.counters["late_speedup_vs_fresh"] = fresh_s / late_s;
  state.counters["copies"] = copies;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

/// Host offload on the decode stream (fresh selection every step): half of
/// every sequence's complete slices live in pinned host memory, read by
/// the step through their mapped addresses (paged_kv_cache::offload_async),
/// against the same steps all resident, in one run. Two halves, neither
/// touching the window: `cold`, slices no step of the stream's first half
/// kept (an offload policy that keeps recently kept slices resident; the
/// misses are what the second half's drift brings in), and `random`
/// (about half of every kept set misses). A miss is a kept slice read from
/// the host; miss_share is misses / kept over every step and copy. Then
/// `promoted`: from the cold half, the stream one step at a time, each
/// step's misses fetched back after it (so a slice misses once), against
/// the same stepwise timing all resident; and `policy`: residency_policy
/// at the same half, rebalancing after every step (the host keeps half).
template <class T>
void decode_offload(benchmark::State& state, const SparseAttentionConfig& cfg, int batch, std::int32_t context,
                    int dim) {
  const int elem = static_cast<int>(sizeof(T));
  const double attended = std::min<double>(context, static_cast<double>(cfg.top_k_fine) * cfg.fine_slice + cfg.window);
  const double per_copy = 2.0 * kKvHeads * dim * elem * batch * static_cast<double>(context);
  const int copies = bench::cold_copies(batch * kKvHeads * attended * 2.0 * dim * elem, per_copy);
  const auto host_bytes = static_cast<std::size_t>(0.5 * per_copy * copies * 1.05) + (std::size_t{256} << 20);
  decode_fixture<T> fx(cfg, batch, context, dim, copies, 0, host_bytes);
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * dim;
  const device_array<T> queries(turning_queries<T>(q_elems));
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;
  auto arguments = [&](int st, int r) {
    auto a = fx.arguments(r);
    a.queries = queries.ptr + st * q_elems;
    return a;
  };
  std::size_t bytes = 0;
  throw_if_error(hierarchical_decode<T>(cfg).workspace_bytes(arguments(0, 0), bytes));
  std::vector<std::unique_ptr<device_array<char>>> workspaces;
  for (int r = 0; r < copies; ++r) workspaces.push_back(std::make_unique<device_array<char>>(bytes));
  const int launches = kStreamSteps * copies;
  std::vector<std::unique_ptr<hierarchical_decode<T>>> ops;
  for (int i = 0; i < launches; ++i) {
    ops.push_back(std::make_unique<hierarchical_decode<T>>(cfg));
    throw_if_error(ops.back()->plan(arguments(i / copies, i % copies), workspaces[i % copies]->ptr, bytes, stream));
  }
  // Each step's kept slices per (sequence, KV head) row, from an eager pass
  // (a replay keeps the same: the same inputs).
  const std::size_t rows = static_cast<std::size_t>(batch) * kKvHeads;
  std::vector<std::vector<std::vector<std::int32_t>>> kept(static_cast<std::size_t>(launches),
                                                           std::vector<std::vector<std::int32_t>>(rows));
  {
    std::vector<std::int32_t> h_kept(rows * cfg.top_k_fine), h_num(rows);
    for (int i = 0; i < launches; ++i) {
      throw_if_error(ops[i]->run(stream));
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(h_kept.data(), ops[i]->kept_slices(), h_kept.size() * 4,
                                          cudaMemcpyDeviceToHost, stream));
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(h_num.data(), ops[i]->num_slices(), h_num.size() * 4,
                                          cudaMemcpyDeviceToHost, stream));
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (std::size_t row = 0; row < rows; ++row)
        kept[static_cast<std::size_t>(i)][row].assign(h_kept.begin() + row * cfg.top_k_fine,
                                                      h_kept.begin() + row * cfg.top_k_fine + h_num[row]);
    }
  }
  const replay_graph graph(stream, launches, [&](cudaStream_t s, int i) { throw_if_error(ops[i]->run(s)); });
  auto time_steps = [&] {
    std::vector<double> t;
    for (int i = 0; i < kSideRuns; ++i) t.push_back(graph.step_seconds(timer, stream));
    return bench::median(t);
  };
  // Slices [0, movable) may move: complete, and before the window.
  const std::int32_t movable = std::max<std::int32_t>(0, (context - cfg.window) / cfg.fine_slice - 1);
  const std::int32_t half = std::min(movable, context / cfg.fine_slice / 2);
  auto slot_of = [&](int copy, int b) { return fx.slots[static_cast<std::size_t>(copy * batch + b)]; };
  // Offloads pick(copy, b) of every sequence; returns the miss share.
  auto place = [&](auto&& pick) {
    for (int r = 0; r < copies; ++r)
      for (int b = 0; b < batch; ++b) throw_if_error(fx.cache.offload_async(slot_of(r, b), 0, pick(r, b), stream));
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::int64_t misses = 0, total = 0;
    for (int i = 0; i < launches; ++i)
      for (std::size_t row = 0; row < rows; ++row)
        for (const std::int32_t s : kept[static_cast<std::size_t>(i)][row]) {
          const int slot = slot_of(i % copies, static_cast<int>(row / kKvHeads));
          misses += fx.cache.residency(slot, 0, s) == kv::page_residency::host;
          ++total;
        }
    return total > 0 ? static_cast<double>(misses) / static_cast<double>(total) : 0.0;
  };
  auto bring_back = [&] {
    std::vector<std::int32_t> all(static_cast<std::size_t>(movable));
    std::iota(all.begin(), all.end(), 0);
    for (const int slot : fx.slots) throw_if_error(fx.cache.fetch_async(slot, 0, all, stream));
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  };

  // The stream one step at a time (a graph of the step's copies, timed
  // alone); with `promote`, the slices a step read from the host are
  // fetched after it, off the timed path (a copy stream's work in an
  // engine), so a slice misses once. Returns the mean step; `miss_share`
  // gets the misses' share of the kept slices.
  std::vector<std::unique_ptr<replay_graph>> step_graphs;
  for (int st = 0; st < kStreamSteps; ++st)
    step_graphs.push_back(std::make_unique<replay_graph>(
        stream, copies, [&](cudaStream_t s, int r) { throw_if_error(ops[st * copies + r]->run(s)); }));
  auto stepwise = [&](auto&& after_step, double& miss_share) {
    double t = 0;
    std::int64_t misses = 0, total = 0;
    for (int st = 0; st < kStreamSteps; ++st) {
      std::vector<std::vector<std::int32_t>> missed(static_cast<std::size_t>(copies * batch));
      for (int r = 0; r < copies; ++r)
        for (std::size_t row = 0; row < rows; ++row) {
          const int b = static_cast<int>(row / kKvHeads);
          for (const std::int32_t sl : kept[static_cast<std::size_t>(st * copies + r)][row]) {
            ++total;
            if (fx.cache.residency(slot_of(r, b), 0, sl) != kv::page_residency::host) continue;
            ++misses;
            missed[static_cast<std::size_t>(r * batch + b)].push_back(sl);
          }
        }
      t += step_graphs[static_cast<std::size_t>(st)]->step_seconds(timer, stream);
      after_step(st, missed);
    }
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    miss_share = total > 0 ? static_cast<double>(misses) / static_cast<double>(total) : 0.0;
    return t / kStreamSteps;
  };

  std::vector<double> t_resident;
  for (auto _ : state) {
    t_resident.push_back(graph.step_seconds(timer, stream));
    state.SetIterationTime(t_resident.back() * launches);
  }
  const double resident_s = bench::median(t_resident);
  double no_misses = 0;
  const double resident_stepwise_s = stepwise([](int, const auto&) {}, no_misses);

  // cold: per sequence, the slices the first half's steps kept stay.
  const double cold_miss = place([&](int r, int b) {
    std::vector<bool> hot(static_cast<std::size_t>(movable), false);
    for (int st = 0; st < kStreamSteps / 2; ++st)
      for (int h = 0; h < kKvHeads; ++h)
        for (const std::int32_t s :
             kept[static_cast<std::size_t>(st * copies + r)][static_cast<std::size_t>(b * kKvHeads + h)])
          if (s < movable) hot[static_cast<std::size_t>(s)] = true;
    std::vector<std::int32_t> out;
    for (std::int32_t s = 0; s < movable && static_cast<std::int32_t>(out.size()) < half; ++s)
      if (!hot[static_cast<std::size_t>(s)]) out.push_back(s);
    return out;
  });
  const double cold_s = time_steps();
  double promoted_miss = 0;
  const double promoted_s = stepwise(
      [&](int, const std::vector<std::vector<std::int32_t>>& missed) {
        for (int r = 0; r < copies; ++r)
          for (int b = 0; b < batch; ++b)
            throw_if_error(
                fx.cache.fetch_async(slot_of(r, b), 0, missed[static_cast<std::size_t>(r * batch + b)], stream));
      },
      promoted_miss);
  const std::int64_t host_after_promotion = fx.cache.host_pages_used();
  bring_back();
  workload::splitmix64 rng(5);
  const double random_miss = place([&](int, int) {
    std::vector<std::int32_t> all(static_cast<std::size_t>(movable));
    std::iota(all.begin(), all.end(), 0);
    for (std::size_t i = all.size(); i > 1; --i)
      std::swap(all[i - 1], all[static_cast<std::size_t>(rng.below(static_cast<std::int64_t>(i)))]);
    all.resize(static_cast<std::size_t>(half));
    return all;
  });
  const double random_s = time_steps();
  bring_back();
  const double back_s = time_steps();
  // policy: residency_policy at the same half, planned first after the
  // stream's first half, then fed each step's kept slices and rebalanced
  // after it (misses come back, the least recently kept leave: the host
  // keeps half throughout).
  residency_policy policy({half, cfg.window / cfg.fine_slice + 1, 1});
  auto observe = [&](int st, std::int64_t number) {
    for (int r = 0; r < copies; ++r)
      for (int b = 0; b < batch; ++b) {
        std::vector<std::int32_t> any_head;
        for (int h = 0; h < kKvHeads; ++h) {
          const auto& k = kept[static_cast<std::size_t>(st * copies + r)][static_cast<std::size_t>(b * kKvHeads + h)];
          any_head.insert(any_head.end(), k.begin(), k.end());
        }
        throw_if_error(policy.observe(slot_of(r, b), 0, number, any_head));
      }
  };
  for (int st = 0; st < kStreamSteps / 2; ++st) observe(st, st);
  for (const int slot : fx.slots) throw_if_error(rebalance(policy, fx.cache, slot, 0, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::int64_t host_under_policy = fx.cache.host_pages_used();
  double policy_miss = 0;
  const double policy_s = stepwise(
      [&](int st, const auto&) {
        observe(st, kStreamSteps / 2 + st);
        for (const int slot : fx.slots) throw_if_error(rebalance(policy, fx.cache, slot, 0, stream));
      },
      policy_miss);
  const std::int64_t host_after_policy = fx.cache.host_pages_used();
  bring_back();
  state.counters["step_us"] = resident_s * 1e6;
  state.counters["cold_half_step_us"] = cold_s * 1e6;
  state.counters["cold_half_ratio"] = cold_s / resident_s;
  state.counters["cold_half_miss_share"] = cold_miss;
  state.counters["random_half_step_us"] = random_s * 1e6;
  state.counters["random_half_ratio"] = random_s / resident_s;
  state.counters["random_half_miss_share"] = random_miss;
  state.counters["fetched_back_step_us"] = back_s * 1e6;
  state.counters["stepwise_resident_step_us"] = resident_stepwise_s * 1e6;
  state.counters["promoted_step_us"] = promoted_s * 1e6;
  state.counters["promoted_ratio"] = promoted_s / resident_stepwise_s;
  state.counters["promoted_miss_share"] = promoted_miss;
  state.counters["host_pages_after_promotion"] = static_cast<double>(host_after_promotion);
  state.counters["policy_step_us"] = policy_s * 1e6;
  state.counters["policy_ratio"] = policy_s / resident_stepwise_s;
  state.counters["policy_miss_share"] = policy_miss;
  state.counters["policy_host_pages_first"] = static_cast<double>(host_under_policy);
  state.counters["policy_host_pages_last"] = static_cast<double>(host_after_policy);
  state.counters["copies"] = copies;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

/// The composed step with another attention tile policy (rows per stage,
/// warps, stages): the sweep that picks kDecodeTile (standard preset, bf16,
/// head_dim 128).
template <tile_policy Tile>
void BM_step_tile(benchmark::State& state) {
  using T = __nv_bfloat16;
  const int batch = static_cast<int>(state.range(0));
  const auto context = static_cast<std::int32_t>(state.range(1));
  const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::standard);
  const int copies = step_copies(cfg, batch, context, 128, 2);
  decode_fixture<T> fx(cfg, batch, context, 128, copies);
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;
  planned_steps<T, Tile> steps(cfg, fx, copies, stream);
  const replay_graph step(stream, steps.launches(), [&](cudaStream_t s, int i) { throw_if_error(steps[i].run(s)); });
  const std::vector<double> t = time_replays(state, step, timer, stream);
  const auto& plan = steps[0].attention_plan();
  state.counters["step_us"] = bench::median(t) * 1e6;
  state.counters["splits"] = plan.splits;
  state.counters["stages"] = plan.stages;
  state.counters["ctas_per_sm"] = plan.ctas_per_sm;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

/// The step with the selection's numbers (top-k widths, slice and block
/// sizes) compiled into its kernel (hierarchical_attention<Policy>) against
/// the same config read at run time (hierarchical_decode), on the same
/// cache, replays alternating in one run (bf16, head_dim 128): what the
/// compile-time shape buys. same_kept: 1 where both kept the same slices.
template <class Policy>
void BM_step_shape(benchmark::State& state) {
  using T = __nv_bfloat16;
  constexpr SparseAttentionConfig cfg = Policy::config;
  const int batch = static_cast<int>(state.range(0));
  const auto context = static_cast<std::int32_t>(state.range(1));
  const int copies = step_copies(cfg, batch, context, 128, 2);
  decode_fixture<T> fx(cfg, batch, context, 128, copies);
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;
  std::vector<std::unique_ptr<hierarchical_decode<T>>> runtime;
  std::vector<std::unique_ptr<hierarchical_attention<Policy>>> fixed;
  std::vector<std::unique_ptr<device_array<char>>> workspaces;
  auto plan = [&](auto& op, int r) {
    std::size_t bytes = 0;
    throw_if_error(op.workspace_bytes(fx.arguments(r), bytes));
    workspaces.push_back(std::make_unique<device_array<char>>(bytes));
    throw_if_error(op.plan(fx.arguments(r), workspaces.back()->ptr, bytes, stream));
  };
  for (int r = 0; r < copies; ++r) {
    runtime.push_back(std::make_unique<hierarchical_decode<T>>(cfg));
    plan(*runtime.back(), r);
    fixed.push_back(std::make_unique<hierarchical_attention<Policy>>());
    plan(*fixed.back(), r);
  }
  const int launches = std::max(kReplays, copies);
  auto graph = [&](auto& ops, bool selection_only) {
    return std::make_unique<replay_graph>(stream, launches, [&](cudaStream_t s, int i) {
      auto& op = *ops[static_cast<std::size_t>(i % copies)];
      throw_if_error(selection_only ? op.run_selection(s) : op.run(s));
    });
  };
  const auto step_runtime = graph(runtime, false), step_fixed = graph(fixed, false);
  const auto sel_runtime = graph(runtime, true), sel_fixed = graph(fixed, true);
  std::vector<double> t_fixed, t_runtime, s_fixed, s_runtime;
  for (auto _ : state) {
    t_fixed.push_back(step_fixed->step_seconds(timer, stream));
    t_runtime.push_back(step_runtime->step_seconds(timer, stream));
    s_fixed.push_back(sel_fixed->step_seconds(timer, stream));
    s_runtime.push_back(sel_runtime->step_seconds(timer, stream));
    state.SetIterationTime(t_fixed.back() * launches);
  }
  // The kept slices of copy 0 from one more step of each.
  throw_if_error(fixed[0]->run(stream));
  throw_if_error(runtime[0]->run(stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::size_t n = static_cast<std::size_t>(batch) * kKvHeads * cfg.top_k_fine;
  std::vector<std::int32_t> kept_fixed(n), kept_runtime(n);
  HISPARSE_CUDA_CHECK(cudaMemcpy(kept_fixed.data(), fixed[0]->kept_slices(), n * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(kept_runtime.data(), runtime[0]->kept_slices(), n * 4, cudaMemcpyDeviceToHost));
  state.counters["step_us"] = bench::median(t_fixed) * 1e6;
  state.counters["runtime_step_us"] = bench::median(t_runtime) * 1e6;
  state.counters["selection_us"] = bench::median(s_fixed) * 1e6;
  state.counters["runtime_selection_us"] = bench::median(s_runtime) * 1e6;
  state.counters["step_gain"] = bench::median(t_runtime) / bench::median(t_fixed);
  state.counters["same_kept"] = kept_fixed == kept_runtime ? 1 : 0;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

/// The two-stage layer pipeline on one GPU (two streams standing in for two
/// devices): stage 0's last output is stage 1's first query and stage 1's
/// last output stage 0's next one, as a decode step's hidden state goes.
/// Wall time of kPipelineSteps steps enqueued back to back and waited for
/// once: serial_us, the stages and copies in turn on one stream; direct_us
/// and staged_us, layer_pipeline with device copies or copies staged
/// through pinned host memory (a PCIe pair without peer access); stage_us,
/// one stage's graph alone. Standard preset, bf16, head_dim 128.
void BM_layer_pipeline(benchmark::State& state) {
  using T = __nv_bfloat16;
  constexpr int kPipelineSteps = 50;
  const SparseAttentionConfig cfg = kBuiltinPresets[0].config;
  const int batch = static_cast<int>(state.range(0)), layers = static_cast<int>(state.range(2));
  const auto context = static_cast<std::int32_t>(state.range(1));
  decode_fixture<T> fx0(cfg, batch, context, 128, 1, 0, 0, layers), fx1(cfg, batch, context, 128, 1, 0, 0, layers);
  const std::size_t per_layer = static_cast<std::size_t>(batch) * kQHeads * 128;
  const std::size_t hidden = per_layer * sizeof(T);
  std::vector<T> q(per_layer * layers);
  workload::splitmix64 rng(5);
  for (auto& x : q) x = from_float<T>(static_cast<float>(rng.normal()));
  device_array<T> q0(q), q1(q), out0(per_layer * layers), out1(per_layer * layers);
  cudaStream_t streams[5] = {};
  for (auto& s : streams) HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto arguments = [&](const decode_fixture<T>& fx, T* queries, T* out) {
    model_decode_arguments<T> a;
    a.queries = queries;
    a.slots = fx.d_slots->ptr;
    a.batch = batch;
    a.layers = layers;
    a.num_q_heads = kQHeads;
    a.cache = fx.cache.ref();
    a.out = out;
    return a;
  };
  const auto a0 = arguments(fx0, q0.ptr, out0.ptr), a1 = arguments(fx1, q1.ptr, out1.ptr);
  model_decode<T> stage0(cfg), stage1(cfg);
  std::size_t bytes = 0;
  throw_if_error(stage0.workspace_bytes(a0, bytes));
  device_array<char> w0(bytes), w1(bytes);
  throw_if_error(stage0.warm_up(a0, w0.ptr, bytes, streams[0]));
  throw_if_error(stage1.warm_up(a1, w1.ptr, bytes, streams[2]));
  mr::pinned_host_resource pinned;
  void* host_f = pinned.allocate(hidden, nullptr);
  void* host_b = pinned.allocate(hidden, nullptr);
  const pipeline_transfer forward{out0.ptr + per_layer * (layers - 1), q1.ptr, hidden, nullptr};
  const pipeline_transfer feedback{out1.ptr + per_layer * (layers - 1), q0.ptr, hidden, nullptr};
  layer_pipeline<T> direct, staged;
  const layer_pipeline<T>::stage s0{0, &stage0, streams[0], streams[1]}, s1{0, &stage1, streams[2], streams[3]};
  throw_if_error(direct.plan(s0, s1, forward, feedback));
  throw_if_error(staged.plan(s0, s1, {forward.src, forward.dst, hidden, host_f},
                             {feedback.src, feedback.dst, hidden, host_b}));
  const cudaStream_t serial = streams[4];
  auto wall = [&](auto&& enqueue, auto&& wait) {
    const auto begin = std::chrono::steady_clock::now();
    for (int t = 0; t < kPipelineSteps; ++t) enqueue();
    wait();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count() / kPipelineSteps;
  };
  auto sync_serial = [&] { HISPARSE_CUDA_CHECK(cudaStreamSynchronize(serial)); };
  std::vector<double> t_serial, t_direct, t_staged, t_stage;
  for (auto _ : state) {
    t_serial.push_back(wall(
        [&] {
          throw_if_error(stage0.replay(serial));
          HISPARSE_CUDA_CHECK(cudaMemcpyAsync(q1.ptr, forward.src, hidden, cudaMemcpyDeviceToDevice, serial));
          throw_if_error(stage1.replay(serial));
          HISPARSE_CUDA_CHECK(cudaMemcpyAsync(q0.ptr, feedback.src, hidden, cudaMemcpyDeviceToDevice, serial));
        },
        sync_serial));
    t_direct.push_back(wall([&] { throw_if_error(direct.step()); }, [&] { throw_if_error(direct.synchronize()); }));
    t_staged.push_back(wall([&] { throw_if_error(staged.step()); }, [&] { throw_if_error(staged.synchronize()); }));
    t_stage.push_back(wall([&] { throw_if_error(stage0.replay(serial)); }, sync_serial));
    state.SetIterationTime(t_direct.back() * kPipelineSteps);
  }
  state.counters["serial_us"] = bench::median(t_serial) * 1e6;
  state.counters["direct_us"] = bench::median(t_direct) * 1e6;
  state.counters["staged_us"] = bench::median(t_staged) * 1e6;
  state.counters["stage_us"] = bench::median(t_stage) * 1e6;
  pinned.deallocate(host_f, hidden, nullptr);
  pinned.deallocate(host_b, hidden, nullptr);
  for (auto& s : streams) HISPARSE_CUDA_CHECK(cudaStreamDestroy(s));
}

using standard_policy = selection_policy<kBuiltinPresets[0].config>;
using key_bounds_both_policy = selection_policy<kBuiltinPresets[5].config>;
static_assert(kBuiltinPresets[0].id == preset_id::standard && kBuiltinPresets[5].id == preset_id::key_bounds_both);

inline constexpr tile_policy kTile64x4x2{1, 64, 4, 2};
inline constexpr tile_policy kTile64x4x3{1, 64, 4, 3};
inline constexpr tile_policy kTile64x4x4{1, 64, 4, 4};
inline constexpr tile_policy kTile32x2x4{1, 32, 2, 4};
inline constexpr tile_policy kTile128x8x2{1, 128, 8, 2};

/// BM_decode_step/preset:P/dtype:E/D:d/B:b/T:t and BM_decode_stream/(the
/// same) for every point of the sweep.
void register_decode_steps(const bench::sweep& axes) {
  for (const auto& dtype : axes.dtype)
    if (dtype != "bf16" && dtype != "fp16" && dtype != "fp8")
      throw error(status::invalid_argument, "--dtype: bf16, fp16 or fp8 (bf16 queries, e4m3 pages: decode steps only)");
  for (const auto d : axes.head_dim)
    if (d != 64 && d != 128 && d != 256) throw error(status::invalid_argument, "--head_dim: 64, 128 or 256");
  for (const auto t : axes.context)
    if (t > (std::int64_t{1} << 30)) throw error(status::invalid_argument, "--context: at most 2^30");
  const preset_registry presets;
  for (const auto& name : axes.preset) {
    const SparseAttentionConfig cfg = presets.get(presets.find(name));
    for (const auto& dtype : axes.dtype)
      for (const auto d : axes.head_dim)
        for (const auto b : axes.batch)
          for (const auto t : axes.context) {
            const std::string id = "BM_decode_step/preset:" + name + "/dtype:" + dtype + "/D:" + std::to_string(d) +
                                   "/B:" + std::to_string(b) + "/T:" + std::to_string(t);
            const int batch = static_cast<int>(b), dim = static_cast<int>(d);
            const auto context = static_cast<std::int32_t>(t);
            auto run = [=](benchmark::State& state) {
              if (dtype == "bf16") {
                decode_step<__nv_bfloat16>(state, cfg, batch, context, dim);
              } else if (dtype == "fp8") {
                decode_step<__nv_bfloat16, kv::fp8_e4m3>(state, cfg, batch, context, dim);
              } else {
                decode_step<__half>(state, cfg, batch, context, dim);
              }
            };
            benchmark::RegisterBenchmark(id.c_str(), run)->UseManualTime()->Unit(benchmark::kMicrosecond);
            if (dtype == "fp8") continue;  // the stream and offload rows: bf16 and fp16
            auto stream = [=](benchmark::State& state) {
              if (dtype == "bf16") {
                decode_stream<__nv_bfloat16>(state, cfg, batch, context, dim);
              } else {
                decode_stream<__half>(state, cfg, batch, context, dim);
              }
            };
            const std::string stream_id = "BM_decode_stream" + id.substr(std::string("BM_decode_step").size());
            benchmark::RegisterBenchmark(stream_id.c_str(), stream)->UseManualTime()->Unit(benchmark::kMicrosecond);
            auto offload = [=](benchmark::State& state) {
              if (dtype == "bf16") {
                decode_offload<__nv_bfloat16>(state, cfg, batch, context, dim);
              } else {
                decode_offload<__half>(state, cfg, batch, context, dim);
              }
            };
            const std::string offload_id = "BM_decode_offload" + id.substr(std::string("BM_decode_step").size());
            benchmark::RegisterBenchmark(offload_id.c_str(), offload)->UseManualTime()->Unit(benchmark::kMicrosecond);
          }
  }
}

}  // namespace

#define HISPARSE_TILE_SWEEP(tile)                                                                          \
  BENCHMARK_TEMPLATE(BM_step_tile, tile)->ArgNames({"B", "T"})->ArgsProduct({{8, 32}, {262144}})->UseManualTime() \
      ->Unit(benchmark::kMicrosecond)
HISPARSE_TILE_SWEEP(kTile64x4x2);
HISPARSE_TILE_SWEEP(kTile64x4x3);
HISPARSE_TILE_SWEEP(kTile64x4x4);
HISPARSE_TILE_SWEEP(kTile32x2x4);
HISPARSE_TILE_SWEEP(kTile128x8x2);
BENCHMARK_TEMPLATE(BM_step_shape, standard_policy)->ArgNames({"B", "T"})->ArgsProduct({{1, 8, 32}, {32768, 262144}})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_layer_pipeline)->ArgNames({"B", "T", "layers"})->Args({8, 32768, 4})->Args({8, 262144, 2})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(BM_step_shape, key_bounds_both_policy)->ArgNames({"B", "T"})->ArgsProduct({{8}, {262144}})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  bench::sweep defaults;
  defaults.batch = {1, 8, 32};
  defaults.context = {32768, 131072, 262144};
  defaults.preset = {"standard"};
  defaults.head_dim = {128};
  defaults.dtype = {"bf16"};
  return bench::run_main(argc, argv, defaults, register_decode_steps);
}
