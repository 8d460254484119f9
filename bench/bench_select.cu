// Decode selection (coarse + fine filter, one launch) over a paged KV cache,
// for the 7B GQA model (32 query heads, 8 KV heads, head_dim 128, bf16).
// Timed as CUDA-graph replays (how a serving engine runs a decode step) that
// cycle through enough copies of the batch that every launch reads HBM, as
// each layer of a real step does; the same replays over one copy (L2 hits)
// and one eager launch are counters beside it. Axes from the command line
// (bench_main.hpp): --batch, --context, --preset. And prefill selection of
// whole prompts.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/select/decode_selection.cuh"
#include "hisparse/select/prefill_selection.cuh"
#include "workload/synthetic.hpp"

#include "bench_main.hpp"
#include "bench_support.hpp"

namespace {

using namespace hisparse;
using bf16 = __nv_bfloat16;
constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

using bench::device_array;

using cache_type = kv::paged_kv_cache<bf16, mr::device_pool_resource>;

kv::paged_kv_cache_options cache_options(const SparseAttentionConfig& cfg, int batch, std::int32_t context) {
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.fine_slice = cfg.fine_slice;
  o.coarse_block = cfg.coarse_block;
  o.max_sequences = batch;
  o.max_context = context;
  o.fine_summary = cfg.fine_summary;
  o.coarse_summary = cfg.coarse_summary;
  return o;
}

void decode_selection(benchmark::State& state, const SparseAttentionConfig& cfg, int batch, std::int32_t context,
                      float key_mean) {
  // Bytes a selection must read: every candidate block's sum, the kept
  // blocks' fine summaries, the queries.
  const double blocks = static_cast<double>(context) / cfg.coarse_block;
  const double slice_bytes = cfg.fine_summary == fine_summary::mean_bf16 ? 2.0 : 4.0;
  const double bytes =
      batch * kKvHeads * (blocks * 4.0 + cfg.top_k_coarse * cfg.slices_per_block() * slice_bytes) * kDim +
      batch * kQHeads * kDim * 2.0;
  // `copies` batches of sequences, launch i reads batch i % copies: every
  // launch reads HBM, as one layer of a decode step does (a cache of 4 KB of
  // K/V per token per sequence, summaries aside).
  const int copies = bench::cold_copies(bytes, 4096.0 * batch * context);
  mr::device_pool_resource device;
  cache_type cache(device, cache_options(cfg, batch * copies, context));
  workload::splitmix64 rng(3);
  const auto slots = bench::fill_cache(cache, batch * copies, context, rng, key_mean);
  std::vector<bf16> q(static_cast<std::size_t>(batch) * kQHeads * kDim);
  for (auto& x : q) x = from_float<bf16>(static_cast<float>(rng.normal()));
  const device_array<bf16> d_q(q);
  const device_array<std::int32_t> d_slots(slots);
  device_array<std::int32_t> kept(static_cast<std::size_t>(batch) * kKvHeads * cfg.top_k_fine);
  device_array<std::int32_t> num(static_cast<std::size_t>(batch) * kKvHeads);
  device_array<std::int32_t> window(static_cast<std::size_t>(batch));
  select::decode_selection_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.slots = d_slots.ptr;
  a.batch = batch;
  a.num_q_heads = kQHeads;
  a.set_cache(cache.ref());
  const select::decode_selection_output out{kept.ptr, num.ptr, window.ptr};

  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  bench::event_timer timer;
  // Graphs of back-to-back selections (the per-launch time of a replay):
  // `cold` cycles through the copies, `warm` reads copy 0 every time (what
  // this benchmark timed until 2026-11-30: L2 hits, ~3 us faster at B = 8).
  auto selections = [&](int n_copies) {
    return [&, n_copies](cudaStream_t s, int i) {
      select::decode_selection_arguments<bf16> ai = a;
      ai.slots = d_slots.ptr + static_cast<std::size_t>(i % n_copies) * batch;
      throw_if_error(select::select_decode_async(cfg, ai, out, s));
    };
  };
  const bench::replay_graph cold(stream, std::max(20, copies), selections(copies)), warm(stream, 20, selections(1));
  // An iteration is one cold replay (its whole time, so --benchmark_min_time
  // means what it says); the eager and warm figures come from 30 more runs.
  std::vector<double> eager, t_cold, t_warm;
  for (auto _ : state) {
    t_cold.push_back(cold.step_seconds(timer, stream));
    state.SetIterationTime(t_cold.back() * cold.launches);
  }
  for (int i = 0; i < 30; ++i) {
    eager.push_back(timer.seconds([&] { throw_if_error(select::select_decode_async(cfg, a, out, stream)); }, stream));
    t_warm.push_back(warm.step_seconds(timer, stream));
  }
  const double t_replay = bench::median(t_cold);
  state.counters["replay_us"] = t_replay * 1e6;
  state.counters["warm_replay_us"] = bench::median(t_warm) * 1e6;
  state.counters["eager_us"] = bench::median(eager) * 1e6;
  state.counters["copies"] = copies;
  state.counters["MB_read"] = bytes * 1e-6;
  state.counters["GBps"] = bytes / t_replay * 1e-9;
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}


/// Prefill selection of a whole prompt of T tokens (every position a query,
/// tiles of 64): one launch, CUDA events. `scoring`: 0 fp32 FMA on the CUDA
/// cores, 1 every candidate in 3xTF32, 2 plain tf32 then 3xTF32 for the
/// candidates its bound cannot settle, 3 the same with the plain pass in
/// fp16 on the rows a pre-pass copies (the composed prefill's choice; the
/// pre-pass is timed too). `stages`: the candidate
/// ring's depth (1 leaves shared memory for a third CTA per SM on an H200).
void BM_prefill_selection(benchmark::State& state) {
  const auto context = static_cast<std::int32_t>(state.range(0));
  const auto scoring = state.range(1);
  const auto stages = static_cast<int>(state.range(2));
  const SparseAttentionConfig cfg;
  mr::device_pool_resource device;
  cache_type cache(device, cache_options(cfg, 1, context));
  workload::splitmix64 rng(5);
  const auto slots = bench::fill_cache(cache, 1, context, rng);
  // Every position's queries (1G values at 256K): drawn on the device.
  const std::size_t q_elems = static_cast<std::size_t>(context) * kQHeads * kDim;
  const device_array<bf16> d_q(q_elems);
  bench::fill_normal(d_q.ptr, q_elems, rng.next());
  const std::int32_t tiles = select::prefill_tiles(0, context, cfg.query_tile);
  const std::vector<select::prefill_segment> segs{{slots[0], 0, context, 0, 0}};
  const device_array<select::prefill_segment> d_segs(segs);
  device_array<std::int32_t> kept(static_cast<std::size_t>(tiles) * kKvHeads * cfg.top_k_fine);
  device_array<std::int32_t> num(static_cast<std::size_t>(tiles) * kKvHeads);
  device_array<std::int32_t> window(static_cast<std::size_t>(tiles));
  select::prefill_selection_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = 1;
  a.num_tiles = tiles;
  a.num_q_heads = kQHeads;
  a.set_cache(cache.ref());
  a.use_tensor_cores = scoring != 0;
  a.two_pass = scoring >= 2;
  // scoring 3: the plain pass in fp16 on its rows (made in the same launch sequence, timed with it).
  const device_array<unsigned char> plain(scoring == 3 ? select::prefill_plain_rows_bytes(cache.ref(), 1, context) : 1);
  if (scoring == 3) {
    a.plain_rows = plain.ptr;
    a.plain_segments = 1;
    a.plain_positions = context;
  }
  a.max_ring_stages = stages;
  const select::prefill_selection_output out{kept.ptr, num.ptr, window.ptr};
  cudaEvent_t start, stop;
  HISPARSE_CUDA_CHECK(cudaEventCreate(&start));
  HISPARSE_CUDA_CHECK(cudaEventCreate(&stop));
  throw_if_error(select::select_prefill_async(cfg, a, out));  // warm-up
  std::vector<double> t;
  for (auto _ : state) {
    HISPARSE_CUDA_CHECK(cudaEventRecord(start));
    throw_if_error(select::select_prefill_async(cfg, a, out));
    HISPARSE_CUDA_CHECK(cudaEventRecord(stop));
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    t.push_back(ms * 1e-3);
    state.SetIterationTime(t.back());
  }
  std::sort(t.begin(), t.end());
  // Dot products the filters compute: per tile and KV head, its queries
  // against every far block and against the kept blocks' far slices.
  double fma = 0;
  for (std::int32_t tile = 0; tile < tiles; ++tile) {
    const std::int64_t p0 = std::int64_t{tile} * cfg.query_tile;
    const std::int64_t ws = contract::window_begin(p0, cfg.window, cfg.fine_slice);
    const std::int64_t blocks = contract::candidate_blocks(ws, cfg.coarse_block);
    const std::int64_t fine = std::min<std::int64_t>(ws / cfg.fine_slice, std::int64_t{cfg.top_k_coarse} * 16);
    fma += static_cast<double>(cfg.query_tile) * (blocks + fine) * kDim * kKvHeads;
  }
  state.counters["ms"] = t[t.size() / 2] * 1e3;
  state.counters["TFLOPs"] = 2 * fma / t[t.size() / 2] * 1e-12;
  HISPARSE_CUDA_CHECK(cudaEventDestroy(start));
  HISPARSE_CUDA_CHECK(cudaEventDestroy(stop));
}

/// BM_decode_selection/preset:P/B:b/T:t/key_mean:0 for every point of the
/// sweep, and the standard preset at B = 8, T = 256K with key_mean 16: keys
/// sharing a mean direction (as real keys often do) give fine scores with a
/// spread under 1% of their common offset (~360 +- 3).
void register_decode_selections(const bench::sweep& axes) {
  const preset_registry presets;
  auto add = [&](const std::string& name, std::int64_t b, std::int64_t t, int key_mean) {
    const SparseAttentionConfig cfg = presets.get(presets.find(name));
    const std::string id = "BM_decode_selection/preset:" + name + "/B:" + std::to_string(b) +
                           "/T:" + std::to_string(t) + "/key_mean:" + std::to_string(key_mean);
    benchmark::RegisterBenchmark(id.c_str(),
                                 [=](benchmark::State& state) {
                                   decode_selection(state, cfg, static_cast<int>(b), static_cast<std::int32_t>(t),
                                                    static_cast<float>(key_mean));
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  };
  for (const auto& name : axes.preset)
    for (const auto b : axes.batch)
      for (const auto t : axes.context) add(name, b, t, 0);
  add("standard", 8, 262144, 16);
}

}  // namespace

// Prefill selection: T:32768 and 262144, every scoring mode and ring depth.
BENCHMARK(BM_prefill_selection)->ArgNames({"T", "scoring", "stages"})
    ->ArgsProduct({{32768, 262144}, {3, 2, 1, 0}, {1, 2}})
    ->UseManualTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  bench::sweep defaults;
  defaults.batch = {1, 8, 32};
  defaults.context = {32768, 131072, 262144};
  defaults.preset = {"standard"};
  return bench::run_main(argc, argv, defaults, register_decode_selections);
}
