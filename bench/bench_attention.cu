// The decode step of the 7B GQA model (32 query heads, 8 KV heads,
// head_dim 128, bf16 KV) over a paged cache: the sparse step (selection +
// attention, two launches), its attention alone, its selection alone, and
// the dense baseline (the same attention kernel over every token), all timed
// in the same run on the same cache. Steps are timed as CUDA-graph replays
// of back-to-back steps (how a serving engine runs them) that cycle through
// enough copies of the batch that every step reads HBM, as each layer of a
// real step does (one batch replayed over and over, as until 2026-11-30,
// times partly L2 hits: step_warm_us); the dense baseline, 0.3-9 ms per
// step, eagerly. An in-run device-to-device copy gives the bandwidth
// ceiling the attention is quoted against.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "bench_support.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "hisparse/workload/synthetic.hpp"

namespace {

using namespace hisparse;
using bf16 = __nv_bfloat16;
constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;
constexpr int kReplays = 20;

using bench::device_array;
using bench::replay_graph;

/// `copies` batches of `batch` sequences of `context` random tokens in a
/// paged cache, filled in 16K-token chunks of fresh device-drawn normal
/// samples; arguments(r) is batch r.
struct decode_fixture {
  int batch;
  mr::device_pool_resource device;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache;
  std::vector<std::int32_t> slots;
  device_array<bf16> queries, out;
  device_array<float> lse;
  std::unique_ptr<device_array<std::int32_t>> d_slots;

  static kv::paged_kv_cache_options options(int batch, std::int32_t context) {
    kv::paged_kv_cache_options o;
    o.num_kv_heads = kKvHeads;
    o.head_dim = kDim;
    o.max_sequences = batch;
    o.max_context = context;
    o.bf16_slice_sums = true;   // for BM_decode_step_bf16_sums; unread by the fp32 configs
    o.slice_key_bounds = true;  // for BM_decode_step_key_bounds; unread by the others
    return o;
  }

  decode_fixture(int batch_, std::int32_t context, int copies = 1)
      : batch(batch_),
        cache(device, options(batch_ * copies, context)),
        queries(static_cast<std::size_t>(batch) * kQHeads * kDim),
        out(static_cast<std::size_t>(batch) * kQHeads * kDim),
        lse(static_cast<std::size_t>(batch_) * kQHeads) {
    // Random keys and values in 16K-token chunks drawn afresh on the device
    // (one chunk appended again and again, as until 2026-11-30, repeats
    // every block score 16 times at 256K and inflates the selection's
    // ranking with ties).
    constexpr std::int32_t kChunk = 16384;
    workload::splitmix64 rng(3);
    device_array<bf16> chunk(static_cast<std::size_t>(kChunk) * kKvHeads * kDim);
    for (int b = 0; b < batch * copies; ++b) {
      int slot = 0;
      throw_if_error(cache.add_sequence(context, slot));
      slots.push_back(slot);
      for (std::int32_t done = 0; done < context; done += kChunk) {
        const std::int32_t n = std::min(kChunk, context - done);
        bench::fill_normal(chunk.ptr, static_cast<std::size_t>(kChunk) * kKvHeads * kDim, rng.next());
        throw_if_error(cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, n}}, chunk.ptr, chunk.ptr,
                                          nullptr));
      }
    }
    std::vector<bf16> q(static_cast<std::size_t>(batch) * kQHeads * kDim);
    for (auto& x : q) x = from_float<bf16>(static_cast<float>(rng.normal()));
    HISPARSE_CUDA_CHECK(cudaMemcpy(queries.ptr, q.data(), q.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    d_slots = std::make_unique<device_array<std::int32_t>>(slots);
    HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  }

  decode_step_arguments<bf16> arguments(int copy = 0) const {
    decode_step_arguments<bf16> a;
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
/// selection's summaries and the attended K/V (default config) per copy.
int step_copies(int batch, std::int32_t context) {
  const double blocks = std::ceil(context / 1024.0);
  const double per_head = (std::min(blocks, 32.0) * 16.0 + blocks) * kDim * 4.0 +  // summaries
                          std::min<double>(context, 16.0 * 64 + 512) * 2.0 * kDim * sizeof(bf16);
  return bench::cold_copies(batch * kKvHeads * per_head, 4096.0 * batch * context);
}

/// One planned step per copy of the batch, each with its own workspace.
template <tile_policy Tile = attention::kDecodeTile>
struct planned_steps {
  std::vector<std::unique_ptr<hierarchical_decode<bf16, Tile>>> steps;
  std::vector<std::unique_ptr<device_array<char>>> workspaces;
  planned_steps(const SparseAttentionConfig& cfg, const decode_fixture& fx, int copies, cudaStream_t stream) {
    for (int r = 0; r < copies; ++r) {
      steps.push_back(std::make_unique<hierarchical_decode<bf16, Tile>>(cfg));
      std::size_t bytes = 0;
      throw_if_error(steps.back()->workspace_bytes(fx.arguments(r), bytes));
      workspaces.push_back(std::make_unique<device_array<char>>(bytes));
      throw_if_error(steps.back()->plan(fx.arguments(r), workspaces.back()->ptr, bytes, stream));
    }
  }
  int copies() const { return static_cast<int>(steps.size()); }
  int launches() const { return std::max(kReplays, copies()); }
  hierarchical_decode<bf16, Tile>& operator[](int i) { return *steps[static_cast<std::size_t>(i % copies())]; }
};

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

void decode_step(benchmark::State& state, const SparseAttentionConfig& cfg) {
  const int batch = static_cast<int>(state.range(0));
  const auto context = static_cast<std::int32_t>(state.range(1));
  const int copies = step_copies(batch, context);
  decode_fixture fx(batch, context, copies);
  const auto args = fx.arguments();
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;

  planned_steps<> steps(cfg, fx, copies, stream);
  hierarchical_decode<bf16>& sparse = steps[0];
  dense_decode<bf16> dense;
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

  std::vector<double> t_step, t_warm, t_attn, t_sel, t_eager, t_dense;
  for (auto _ : state) {
    t_step.push_back(step.step_seconds(timer, stream));
    t_warm.push_back(step_warm.step_seconds(timer, stream));
    t_attn.push_back(attention_only.step_seconds(timer, stream));
    t_sel.push_back(selection_only.step_seconds(timer, stream));
    t_eager.push_back(timer.seconds([&] { throw_if_error(sparse.run(stream)); }, stream));
    state.SetIterationTime(t_step.back());
  }
  for (int i = 0; i < 5; ++i) t_dense.push_back(timer.seconds([&] { throw_if_error(dense.run(stream)); }, stream));
  const double copy = copy_bandwidth(timer, stream);

  // Bytes each stage must read. Selection: every candidate block's sum and
  // the kept blocks' slice sums (fp32, or bf16); attention: K and V of the kept
  // slices and the window; dense: K and V of every token.
  std::vector<std::int32_t> num(static_cast<std::size_t>(batch) * kKvHeads), window(static_cast<std::size_t>(batch));
  HISPARSE_CUDA_CHECK(cudaMemcpy(num.data(), sparse.num_slices(), num.size() * 4, cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(window.data(), sparse.window_begin(), window.size() * 4, cudaMemcpyDeviceToHost));
  double attended = 0;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < kKvHeads; ++h)
      attended += static_cast<double>(num[static_cast<std::size_t>(b * kKvHeads + h)]) * cfg.fine_slice +
                  (context - window[static_cast<std::size_t>(b)]);
  const double kv_row = 2.0 * kDim * sizeof(bf16);  // K and V of one token of one head
  const double attn_bytes = attended * kv_row;
  const double ws_before = window[0];
  const double blocks = std::ceil(ws_before / cfg.coarse_block);
  const double slice_bytes = cfg.slice_summary_type == dtype::bf16 ? 2.0 : 4.0;
  const double sel_bytes =
      batch * kKvHeads *
      (blocks * 4.0 + std::min<double>(cfg.top_k_coarse, blocks) * cfg.slices_per_block() * slice_bytes) * kDim;
  const double dense_bytes_read = static_cast<double>(batch) * kKvHeads * context * kv_row;

  const double step_s = bench::median(t_step), attn_s = bench::median(t_attn), sel_s = bench::median(t_sel);
  const double dense_s = bench::median(t_dense);
  state.counters["step_us"] = step_s * 1e6;
  state.counters["step_warm_us"] = bench::median(t_warm) * 1e6;
  state.counters["copies"] = copies;
  state.counters["eager_step_us"] = bench::median(t_eager) * 1e6;
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
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

void BM_decode_step(benchmark::State& state) {
  const preset_registry presets;
  decode_step(state, presets.get(state.range(2) == 16 ? preset_id::standard : preset_id::high_recall));
}

/// The standard step with the fine filter on bf16 slice summaries.
void BM_decode_step_bf16_sums(benchmark::State& state) {
  decode_step(state, preset_registry{}.get(preset_id::standard_bf16_summaries));
}

/// The standard step with the fine filter on slice key bounds.
void BM_decode_step_key_bounds(benchmark::State& state) {
  decode_step(state, preset_registry{}.get(preset_id::standard_key_bounds));
}

/// The composed step with another attention tile policy (rows per stage,
/// warps, stages): the sweep that picks kDecodeTile.
template <tile_policy Tile>
void BM_step_tile(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const auto context = static_cast<std::int32_t>(state.range(1));
  const SparseAttentionConfig cfg = preset_registry{}.get(preset_id::standard);
  const int copies = step_copies(batch, context);
  decode_fixture fx(batch, context, copies);
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench::event_timer timer;
  planned_steps<Tile> steps(cfg, fx, copies, stream);
  const replay_graph step(stream, steps.launches(), [&](cudaStream_t s, int i) { throw_if_error(steps[i].run(s)); });
  std::vector<double> t;
  for (auto _ : state) {
    t.push_back(step.step_seconds(timer, stream));
    state.SetIterationTime(t.back());
  }
  const auto& plan = steps[0].attention_plan();
  state.counters["step_us"] = bench::median(t) * 1e6;
  state.counters["splits"] = plan.splits;
  state.counters["stages"] = plan.stages;
  state.counters["ctas_per_sm"] = plan.ctas_per_sm;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

inline constexpr tile_policy kTile64x4x2{1, 64, 4, 2};
inline constexpr tile_policy kTile64x4x3{1, 64, 4, 3};
inline constexpr tile_policy kTile64x4x4{1, 64, 4, 4};
inline constexpr tile_policy kTile32x2x4{1, 32, 2, 4};
inline constexpr tile_policy kTile128x8x2{1, 128, 8, 2};

}  // namespace

BENCHMARK(BM_decode_step)->ArgNames({"B", "T", "topk"})
    ->ArgsProduct({{1, 8, 32}, {32768, 131072, 262144}, {16}})
    ->Args({8, 262144, 32})
    ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_bf16_sums)->ArgNames({"B", "T"})
    ->ArgsProduct({{1, 8, 32}, {32768, 131072, 262144}})
    ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_step_key_bounds)->ArgNames({"B", "T"})
    ->ArgsProduct({{1, 8, 32}, {32768, 131072, 262144}})
    ->UseManualTime()->Iterations(30)->Unit(benchmark::kMicrosecond);
#define HISPARSE_TILE_SWEEP(tile)                                                                          \
  BENCHMARK_TEMPLATE(BM_step_tile, tile)->ArgNames({"B", "T"})->ArgsProduct({{8, 32}, {262144}})->UseManualTime() \
      ->Iterations(30)->Unit(benchmark::kMicrosecond)
HISPARSE_TILE_SWEEP(kTile64x4x2);
HISPARSE_TILE_SWEEP(kTile64x4x3);
HISPARSE_TILE_SWEEP(kTile64x4x4);
HISPARSE_TILE_SWEEP(kTile32x2x4);
HISPARSE_TILE_SWEEP(kTile128x8x2);
BENCHMARK_MAIN();
