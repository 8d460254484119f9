// Scratch driver (not built by CMake): bench_select.cu setup, then one cold selection graph replay at a
// time with the HISPARSE_SELECT_TRACE points of a patched decode_selection.cuh, printed per phase.
// Decode selection (coarse + fine filter, one launch) over a paged KV cache,
// for the 7B GQA model (32 query heads, 8 KV heads, head_dim 128, bf16) with
// the default config. Timed as CUDA-graph replays (how a serving engine runs
// a decode step) that cycle through enough copies of the batch that every
// launch reads HBM, as each layer of a real step does; the same replays over
// one copy (L2 hits, what this timed until 2026-11-30) and one eager launch
// are counters beside it.

#include <algorithm>
#include <vector>

#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/select/decode_selection.cuh"
#include "hisparse/select/prefill_selection.cuh"
#include "hisparse/workload/synthetic.hpp"

#include "bench_support.hpp"

namespace {

using namespace hisparse;
using bf16 = __nv_bfloat16;
constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;

using bench::device_array;

using cache_type = kv::paged_kv_cache<bf16, mr::device_pool_resource>;

kv::paged_kv_cache_options cache_options(int batch, std::int32_t context) {
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.max_sequences = batch;
  o.max_context = context;
  return o;
}

/// Fills `batch` sequences of `context` tokens of random keys and values,
/// appended in 16K-token chunks drawn afresh on the device, and returns
/// their slots. Every block and slice sum differs: one chunk appended again
/// and again (as this did until 2026-11-30) repeats each block score 16
/// times at 256K, and those ties doubled the ranking's survivors.
std::vector<std::int32_t> fill_cache(cache_type& cache, int batch, std::int32_t context, workload::splitmix64& rng) {
  constexpr std::int32_t kChunk = 16384;
  const std::size_t chunk_elems = static_cast<std::size_t>(kChunk) * kKvHeads * kDim;
  device_array<bf16> chunk(chunk_elems);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(batch));
  for (auto& s : slots) {
    int slot = 0;
    throw_if_error(cache.add_sequence(context, slot));
    s = slot;
    for (std::int32_t done = 0; done < context; done += kChunk) {
      const std::int32_t n = std::min(kChunk, context - done);
      bench::fill_normal(chunk.ptr, chunk_elems, rng.next());
      throw_if_error(
          cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, n}}, chunk.ptr, chunk.ptr, nullptr));
    }
  }
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  return slots;
}


void trace(int batch, std::int32_t context) {
  const SparseAttentionConfig cfg;
  const double blocks = context / 1024.0;
  const double bytes =
      batch * kKvHeads * (blocks + cfg.top_k_coarse * 16.0) * kDim * 4.0 + batch * kQHeads * kDim * 2.0;
  const int copies = bench::cold_copies(bytes, 4096.0 * batch * context);
  mr::device_pool_resource device;
  cache_type cache(device, cache_options(batch * copies, context));
  workload::splitmix64 rng(3);
  const auto slots = fill_cache(cache, batch * copies, context, rng);
  std::vector<bf16> q(static_cast<std::size_t>(batch) * kQHeads * kDim);
  for (auto& x : q) x = from_float<bf16>(static_cast<float>(rng.normal()));
  const device_array<bf16> d_q(q);
  const device_array<std::int32_t> d_slots(slots);
  device_array<std::int32_t> kept(static_cast<std::size_t>(batch) * kKvHeads * cfg.top_k_fine);
  device_array<std::int32_t> num(static_cast<std::size_t>(batch) * kKvHeads);
  device_array<std::int32_t> window(static_cast<std::size_t>(batch));
  select::decode_selection_arguments<bf16> a;
  a.queries = d_q.ptr; a.slots = d_slots.ptr; a.batch = batch; a.num_q_heads = kQHeads;
  a.set_cache(cache.ref());
  const select::decode_selection_output out{kept.ptr, num.ptr, window.ptr};
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  const int n_launch = std::max(20, copies);
  const bench::replay_graph cold(stream, n_launch, [&](cudaStream_t s, int i) {
      select::decode_selection_arguments<bf16> ai = a;
      ai.slots = d_slots.ptr + static_cast<std::size_t>(i % copies) * batch;
      throw_if_error(select::select_decode_async(cfg, ai, out, s));
  });
  bench::event_timer timer;
  const int ctas = kKvHeads * 4 * batch;
  std::vector<std::vector<double>> pts(14);
  for (int rep = 0; rep < 20; ++rep) {
    HISPARSE_CUDA_CHECK(cudaMemset(nullptr, 0, 0));
    std::vector<unsigned long long> zero(2048 * 14, 0);
    HISPARSE_CUDA_CHECK(cudaMemcpyToSymbol(select::hisparse_sel_trace, zero.data(), zero.size() * 8));
    cold.step_seconds(timer, stream);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<unsigned long long> tr(2048 * 14);
    HISPARSE_CUDA_CHECK(cudaMemcpyFromSymbol(tr.data(), select::hisparse_sel_trace, tr.size() * 8));
    unsigned long long t0 = ~0ull;
    for (int c = 0; c < ctas; ++c) if (tr[c * 14] && tr[c * 14] < t0) t0 = tr[c * 14];
    for (int c = 0; c < ctas; ++c)
      for (int i = 0; i < 14; ++i)
        if (tr[c * 14 + i]) pts[i].push_back((tr[c * 14 + i] - t0) * 1e-3);
  }
  const char* names[] = {"start", "length", "cluster running", "coarse scored+sync", "coarse ranked", "fine scored", "rank0 past wait", "rank0 filtered", "rank0 placed", "pass2 filtered", "pass2 placed", "rank0 keys built", "rank0 threshold", "-"};
  std::printf("TRACE B=%d T=%d (us from first CTA start, 20 cold launches pooled)\n", batch, context);
  for (int i = 0; i < 13; ++i) {
    auto& v = pts[i];
    if (v.empty()) { std::printf("  %-22s none\n", names[i]); continue; }
    std::sort(v.begin(), v.end());
    auto at = [&](double f) { return v[static_cast<std::size_t>(f * (v.size() - 1))]; };
    std::printf("  %-22s n=%5zu min %6.2f p10 %6.2f med %6.2f p90 %6.2f max %6.2f\n", names[i], v.size(), v[0], at(.1), at(.5), at(.9), v.back());
  }
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
}  // namespace
int main() { trace(1, 262144); trace(8, 262144); trace(32, 262144); return 0; }
