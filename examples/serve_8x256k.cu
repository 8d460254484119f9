// serve_8x256k: the deployment HiSparse is built for, on one GPU. The
// attention of a 7B GQA model (28 layers, 32 query / 8 KV heads, head_dim
// 128) for 8 requests of 256K tokens under a 48 GiB device limit (a
// limiting_adaptor: what a 48 GB card leaves), then 64 decode steps of the
// whole model, each one CUDA graph over every layer (model_decode).
//
//  1. Plan: plan_memory for each mode, in order of preference (bf16 pages
//     all resident, fp8 all resident, fp8 + host offload, bf16 + host
//     offload); the first that fits is chosen (or --mode).
//  2. Prefill, chunked: every request's prompt, layer by layer, appended in
//     --chunk token chunks (the cache's writes of a prefill: quantization
//     and summaries). With offload, the host tier is pinned first (its
//     size from the plan), and each chunk is followed by a rebalance of
//     a residency_policy that keeps plan_memory's per-(request, layer)
//     budget on the device (the most recent slices; the rest go to pinned
//     host memory). The prefill's attention is not run: it reads 16-bit
//     pages only (DESIGN.md section 3).
//  3. Decode: per step, one new token of every layer appended (outside the
//     graph), then the graph; with offload, each layer's kept slices are
//     read back and the policy fetches what missed and offloads the least
//     recently kept, every (request, layer) in one batched rebalance that
//     the host plans while the next step runs. Printed: the whole model's
//     step (median, max), the serving loop's iteration, the miss share and
//     the pages moved, the same layers as 28 single-layer graphs, memory by
//     kind, and plan_memory's prediction beside the measured peak.
//
// The keys carry structure (per 1024-token block, a topic vector added to
// noise) and each request's queries mix four of its blocks' topics with
// weights that drift slowly over the steps, so the selection has something
// to find and the kept set changes a little from step to step.
//
// Without a CUDA device (or with --plan-only) it prints the plan and exits 0.
//
//   serve_8x256k [--requests 8] [--context 262144] [--layers 28] [--steps 64] [--limit-gib 48]
//                [--host-gib 100] [--chunk 8192] [--keep-steps 1]
//                [--mode auto|bf16|fp8|fp8-offload|bf16-offload]
//                [--plan-only]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <hisparse/kv/paged_kv_cache.cuh>
#include <hisparse/mr/device_pool_resource.hpp>
#include <hisparse/mr/limiting_adaptor.hpp>
#include <hisparse/mr/pinned_host_resource.hpp>
#include <hisparse/mr/statistics_adaptor.hpp>
#include <hisparse/runtime/memory_budget.cuh>
#include <hisparse/runtime/model_decode.cuh>
#include <hisparse/runtime/residency.hpp>

using namespace hisparse;
using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;

namespace {
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr int kQHeads = 32, kKvHeads = 8, kDim = 128;
constexpr int kHotBlocks = 4;        ///< blocks whose topics a request's queries mix
constexpr float kTopicWeight = 0.5f; ///< a key's topic component against its unit noise
constexpr double kDriftPeriod = 256; ///< steps for the query mix to turn once

struct options {
  int requests = 8;
  std::int64_t context = 262144;
  int layers = 28;
  int steps = 64;
  double limit_gib = 48;
  double host_gib = 100;
  int chunk = 8192;
  int keep_steps = 1;  ///< residency_options::keep_steps
  std::string mode = "auto";
  bool plan_only = false;
};

struct mode {
  const char* name;
  std::size_t elem_bytes;
  bool offload;
};
constexpr mode kModes[] = {{"bf16", 2, false}, {"fp8", 1, false}, {"fp8-offload", 1, true}, {"bf16-offload", 2, true}};

// --- the synthetic model: counter-based normal samples, no state ---------

__host__ __device__ inline float normal(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0xD1B54A32D192ED03ull + b * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u1 = (static_cast<float>(z & 0xFFFFFF) + 0.5f) * 0x1p-24f;
  const float u2 = static_cast<float>((z >> 24) & 0xFFFFFF) * 0x1p-24f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}
__host__ __device__ inline std::uint64_t id(std::uint64_t r, std::uint64_t l, std::uint64_t h) {
  return (r * 131 + l) * 17 + h;
}
__device__ inline float topic(int r, int l, int h, std::int64_t block, int d) {
  return normal(id(r, l, h) * 4099 + static_cast<std::uint64_t>(block), 0x7013cull + static_cast<std::uint64_t>(d));
}

/// K and V rows [rows][kKvHeads][kDim] for `count` requests from `first`,
/// `per` positions each from `begin`: key = noise + kTopicWeight * its
/// block's topic, value = noise.
__global__ void make_kv(bf16* k, bf16* v, int first, int per, std::int64_t begin, int layer, int block) {
  const int row = blockIdx.x, h = threadIdx.x / kDim, d = threadIdx.x % kDim;
  const int r = first + row / per;
  const std::int64_t pos = begin + row % per;
  const std::uint64_t at = (static_cast<std::uint64_t>(pos) * kKvHeads + h) * kDim + d;
  const std::size_t i = (static_cast<std::size_t>(row) * kKvHeads + h) * kDim + d;
  k[i] = __float2bfloat16(normal(2 * id(r, layer, 0) + 1, at) + kTopicWeight * topic(r, layer, h, pos / block, d));
  v[i] = __float2bfloat16(normal(2 * id(r, layer, 0) + 2, at));
}

/// Queries [layers][requests][kQHeads][kDim] of step `step`: per (request,
/// layer, KV head), kHotBlocks topics mixed by weights turning with the step,
/// plus a fixed per-query-head noise.
__global__ void make_queries(bf16* q, int requests, int step, std::int64_t prompt_blocks) {
  const int layer = blockIdx.x / (requests * kQHeads), r = blockIdx.x / kQHeads % requests;
  const int qh = blockIdx.x % kQHeads, h = qh / (kQHeads / kKvHeads), d = threadIdx.x;
  float x = 0.5f * normal(id(r, layer, qh) + 77, d);
  for (int j = 0; j < kHotBlocks; ++j) {
    const auto pick = static_cast<std::uint64_t>(fabsf(normal(id(r, layer, h) + 99, j)) * 1e6f);
    const float w = 1.0f + cospif(2.0f * static_cast<float>(step / kDriftPeriod) + 0.5f * j);
    x += w * topic(r, layer, h, static_cast<std::int64_t>(pick % static_cast<std::uint64_t>(prompt_blocks)), d);
  }
  q[static_cast<std::size_t>(blockIdx.x) * kDim + d] = __float2bfloat16(x);
}

// --- the plan ---------------------------------------------------------------

SparseAttentionConfig config() { return preset_registry{}.get(preset_id::standard); }

/// Device bytes beside the cache and the decode workspace: the staging
/// buffers of this program.
std::size_t scratch_bytes(const options& o) {
  const std::size_t kv_row = std::size_t{kKvHeads} * kDim * sizeof(bf16);
  const std::size_t q_rows = static_cast<std::size_t>(o.layers) * o.requests * kQHeads;
  return 2 * static_cast<std::size_t>(o.chunk) * kv_row            // a prefill chunk's K and V
         + 2 * static_cast<std::size_t>(o.layers) * o.requests * kv_row  // a decode step's K and V
         + 2 * q_rows * kDim * sizeof(bf16) + q_rows * sizeof(float)     // queries, out, lse
         + static_cast<std::size_t>(o.requests) * sizeof(std::int32_t);
}

struct planned {
  mode m{};
  memory_budget budget{};
  bool fits = false;
  std::int64_t device_pages = 0;  ///< pages the device holds at most (offload: the budget's, plus transients)
  std::size_t predicted = 0;      ///< predicted peak of device bytes
};

/// Pages on the device beyond the policy's budget: each (request, layer)'s
/// partial slice and one prefill chunk before its rebalance.
std::int64_t transient_pages(const options& o, const SparseAttentionConfig& c) {
  return std::int64_t{o.requests} * o.layers + o.chunk / c.fine_slice;
}

status plan(const options& o, const mode& m, int num_sms, planned& p) {
  const SparseAttentionConfig c = config();
  memory_budget_inputs in;
  in.model = {o.layers, kQHeads, kKvHeads, kDim};
  in.config = c;
  in.contexts.assign(static_cast<std::size_t>(o.requests), o.context + o.steps);
  in.elem_bytes = m.elem_bytes;
  in.prefill_tokens = 0;  // no prefill attention here
  in.num_sms = num_sms;
  in.whole_model_decode = true;
  in.host_limit = m.offload ? static_cast<std::size_t>(o.host_gib * static_cast<double>(kGiB)) : 0;
  // What the pages may take: the limit less this program's buffers and the
  // pages above the policy's budget.
  memory_budget_inputs probe = in;
  probe.device_limit = SIZE_MAX / 2;
  memory_budget unbounded;
  HISPARSE_TRY(plan_memory(probe, unbounded));
  const std::size_t reserve =
      scratch_bytes(o) + unbounded.footprint.page_memory(transient_pages(o, c)) + unbounded.footprint.chunk_bytes;
  const auto limit = static_cast<std::size_t>(o.limit_gib * static_cast<double>(kGiB));
  in.device_limit = limit > reserve ? limit - reserve : 0;
  p.m = m;
  HISPARSE_TRY(plan_memory(in, p.budget));
  const memory_budget& b = p.budget;
  p.fits = m.offload ? b.fits_with_offload() : b.fits();
  p.device_pages = m.offload ? std::min<std::int64_t>(b.pages, std::int64_t{b.device_slices_each()} * b.sequences *
                                                                       b.layers + transient_pages(o, c))
                             : b.pages;
  p.predicted = b.metadata + b.decode_workspace + b.footprint.page_memory(p.device_pages) + scratch_bytes(o);
  return status::success;
}

void print_plan(const planned& p) {
  const memory_budget& b = p.budget;
  std::printf("  %-13s pages %7.1f GB  metadata %5.2f GB  decode workspace %6.1f MB  ", p.m.name,
              static_cast<double>(b.page_memory) / 1e9, static_cast<double>(b.metadata) / 1e9,
              static_cast<double>(b.decode_workspace) / 1e6);
  if (!p.m.offload)
    std::printf("%s\n", p.fits ? "fits" : "does not fit");
  else
    std::printf("%s (%.1f GB on the host, %d of %d slices a (request, layer) on the device)\n",
                p.fits ? "fits" : "does not fit", static_cast<double>(b.host_bytes()) / 1e9, b.device_slices_each(),
                b.footprint.max_slices);
}

// --- the run ------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// A buffer of this program's from `Resource` (the same limit as the cache).
template <class Resource>
struct owned {
  Resource* r;
  void* ptr;
  std::size_t bytes;
  owned(Resource& res, std::size_t b) : r(&res), ptr(res.allocate(b, nullptr)), bytes(b) {}
  ~owned() { r->deallocate(ptr, bytes, nullptr); }
  owned(const owned&) = delete;
  owned& operator=(const owned&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

template <class KV>
int serve(const options& o, const planned& p) {
  using upstream = mr::limiting_adaptor<mr::device_pool_resource>;
  using resource = mr::statistics_adaptor<upstream>;
  const SparseAttentionConfig c = config();
  mr::device_pool_resource device;
  upstream limited(device, static_cast<std::size_t>(o.limit_gib * static_cast<double>(kGiB)));
  resource stats(limited);
  kv::paged_kv_cache_options co;
  co.num_layers = o.layers;
  co.num_kv_heads = kKvHeads;
  co.head_dim = kDim;
  co.fine_slice = c.fine_slice;
  co.coarse_block = c.coarse_block;
  co.max_sequences = o.requests;
  co.max_context = o.context + o.steps;
  co.fine_summary = c.fine_summary;
  co.max_host_bytes = p.budget.host_limit;
  kv::paged_kv_cache<KV, resource> cache(stats, co);
  residency_policy policy({p.budget.device_slices_each(), c.window / c.fine_slice + 1, o.keep_steps});

  using buffer = owned<resource>;
  const std::size_t kv_row = std::size_t{kKvHeads} * kDim;
  const std::size_t q_rows = static_cast<std::size_t>(o.layers) * o.requests * kQHeads;
  const std::size_t step_rows = static_cast<std::size_t>(o.layers) * o.requests;
  buffer chunk_k(stats, o.chunk * kv_row * sizeof(bf16)), chunk_v(stats, o.chunk * kv_row * sizeof(bf16));
  buffer step_k(stats, step_rows * kv_row * sizeof(bf16)), step_v(stats, step_rows * kv_row * sizeof(bf16));
  buffer queries(stats, q_rows * kDim * sizeof(bf16)), out(stats, q_rows * kDim * sizeof(bf16));
  buffer lse(stats, q_rows * sizeof(float)), d_slots(stats, o.requests * sizeof(std::int32_t));
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The host tier pinned up front (warm-up work, not the prefill's): the
  // plan's pages off the device and room for one step's moves, which
  // offload before they fetch.
  if (p.m.offload) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t swap = std::int64_t{o.requests} * o.layers * kKvHeads * c.top_k_fine;
    throw_if_error(cache.reserve_host_pages(p.budget.pages_off_device() + swap));
    std::printf("host tier: %.2f GB pinned in %.1f s\n",
                static_cast<double>(cache.host_pages_total()) *
                    static_cast<double>(p.budget.footprint.page_bytes) / 1e9,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  // Prefill.
  std::vector<int> slots(static_cast<std::size_t>(o.requests));
  const auto prefill_begin = std::chrono::steady_clock::now();
  double rebalance_s = 0;
  for (int r = 0; r < o.requests; ++r) {
    throw_if_error(cache.add_sequence(o.context + o.steps, slots[static_cast<std::size_t>(r)]));
    const int slot = slots[static_cast<std::size_t>(r)];
    for (int l = 0; l < o.layers; ++l)
      for (std::int64_t done = 0; done < o.context; done += o.chunk) {
        const auto n = static_cast<std::int32_t>(std::min<std::int64_t>(o.chunk, o.context - done));
        make_kv<<<n, kKvHeads * kDim, 0, stream>>>(chunk_k.as<bf16>(), chunk_v.as<bf16>(), r, n, done, l,
                                                   c.coarse_block);
        HISPARSE_CUDA_CHECK(cudaGetLastError());
        throw_if_error(cache.append_async(l, std::vector<kv::append_segment>{{slot, 0, n}}, chunk_k.as<bf16>(),
                                          chunk_v.as<bf16>(), stream));
        if (p.m.offload) {
          const auto t0 = std::chrono::steady_clock::now();
          throw_if_error(rebalance(policy, cache, slot, l, stream));
          rebalance_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
      }
  }
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - prefill_begin).count();
  const double appended = static_cast<double>(o.requests) * o.layers * static_cast<double>(o.context);
  std::printf("prefill: %d x %lld tokens x %d layers appended in %.1f s (%.1f M token-layers/s; host rebalance %.1f s)\n",
              o.requests, static_cast<long long>(o.context), o.layers, prefill_s, appended / prefill_s / 1e6,
              rebalance_s);
  HISPARSE_CUDA_CHECK(cudaMemcpy(d_slots.ptr, slots.data(), slots.size() * sizeof(std::int32_t),
                                 cudaMemcpyHostToDevice));

  // The whole model's step: plan, first run, capture, first replay.
  model_decode_arguments<bf16, KV> args;
  args.queries = queries.as<bf16>();
  args.slots = d_slots.as<std::int32_t>();
  args.batch = o.requests;
  args.layers = o.layers;
  args.num_q_heads = kQHeads;
  args.cache = cache.ref();
  args.out = out.as<bf16>();
  args.lse = lse.as<float>();
  model_decode<bf16, attention::kDecodeTile, KV> step(c);
  std::size_t ws_bytes = 0;
  throw_if_error(step.workspace_bytes(args, ws_bytes));
  buffer workspace(stats, ws_bytes);
  const std::int64_t prompt_blocks = (o.context + c.coarse_block - 1) / c.coarse_block;
  make_queries<<<static_cast<int>(q_rows), kDim, 0, stream>>>(queries.as<bf16>(), o.requests, 0, prompt_blocks);
  warm_up_times warm;
  throw_if_error(step.warm_up(args, workspace.ptr, ws_bytes, stream, {}, &warm));
  std::printf("warm-up: plan %.2f ms, first run %.2f ms, capture + instantiate %.2f ms, first replay %.2f ms\n",
              warm.plan_ms, warm.first_run_ms, warm.capture_ms, warm.first_replay_ms);

  // Decode, pipelined as an engine would: step s is queued, then the host
  // reads step s-1's kept slices (copied back behind it), counts its misses,
  // observes and rebalances every (request, layer) in one batch, whose moves
  // queue behind step s. The host's policy work overlaps the GPU's step; a
  // slice newly kept is fetched one step later than a synchronous loop would.
  const std::size_t kept_rows = static_cast<std::size_t>(o.requests) * kKvHeads;
  const std::size_t kept_words = kept_rows * (c.top_k_fine + 1);  // a layer's lists, then its counts
  mr::pinned_host_resource pinned;
  owned<mr::pinned_host_resource> kept_buffer(pinned, 2 * kept_words * o.layers * 4);  // two steps in flight
  std::vector<std::pair<int, int>> pairs;  // every (request, layer), rebalanced in one batch a step
  for (int l = 0; l < o.layers; ++l)
    for (const int slot : slots) pairs.emplace_back(slot, l);
  std::vector<cudaEvent_t> ev(3 * static_cast<std::size_t>(o.steps));  // per step: begin, end, lists copied
  for (auto& e : ev) HISPARSE_CUDA_CHECK(cudaEventCreate(&e));
  auto event = [&](int step, int which) { return ev[3 * static_cast<std::size_t>(step) + which]; };
  std::int64_t misses = 0, kept_total = 0, first_misses = 0, first_kept = 0;
  std::vector<double> policy_ms, loop_ms;  // host policy work a step; wall time an iteration
  std::vector<double> fetched;             // pages fetched a step (as many offloaded: the budget is full)
  std::vector<residency_moves> last_moves(pairs.size());  // queued behind the step being read
  std::vector<std::int32_t> any_head;
  // Step `s`'s kept slices: misses against where they were when it ran
  // (now, less the moves queued after it), then observe and rebalance.
  auto read_step = [&](int s, bool rebalance_after) {
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(event(s, 2)));
    const auto t0 = std::chrono::steady_clock::now();
    const std::int32_t* lists =
        kept_buffer.as<std::int32_t>() + static_cast<std::size_t>(s % 2) * kept_words * o.layers;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto [slot, l] = pairs[i];
      const int r = static_cast<int>(i % slots.size());  // pairs run layer by layer, requests inside
      const std::int32_t* list = lists + static_cast<std::size_t>(l) * kept_words;
      const std::int32_t* num = list + kept_rows * c.top_k_fine;
      const auto where = cache.residency_of(slot, l);
      const residency_moves& after = last_moves[i];
      auto was_on_host = [&](std::int32_t sl) {
        if (std::binary_search(after.fetch.begin(), after.fetch.end(), sl)) return true;
        if (std::binary_search(after.offload.begin(), after.offload.end(), sl)) return false;
        return sl < where.size() && where.on_host(sl);
      };
      any_head.clear();
      for (int h = 0; h < kKvHeads; ++h) {
        const std::size_t row = static_cast<std::size_t>(r) * kKvHeads + h;
        for (int k = 0; k < num[row]; ++k) {
          const std::int32_t sl = list[row * c.top_k_fine + k];
          misses += was_on_host(sl);
          ++kept_total;
          any_head.push_back(sl);
        }
      }
      throw_if_error(policy.observe(slot, l, s, any_head));
    }
    if (rebalance_after) {
      throw_if_error(rebalance(policy, cache, std::span<const std::pair<int, int>>(pairs), stream, &last_moves));
      std::int64_t n = 0;
      for (const auto& m : last_moves) n += static_cast<std::int64_t>(m.fetch.size());
      fetched.push_back(static_cast<double>(n));
    }
    policy_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (s == 0) {
      first_misses = misses;
      first_kept = kept_total;
    }
  };
  for (int s = 0; s < o.steps; ++s) {
    const auto iteration = std::chrono::steady_clock::now();
    for (int l = 0; l < o.layers; ++l) {
      bf16* k = step_k.as<bf16>() + static_cast<std::size_t>(l) * o.requests * kv_row;
      bf16* v = step_v.as<bf16>() + static_cast<std::size_t>(l) * o.requests * kv_row;
      make_kv<<<o.requests, kKvHeads * kDim, 0, stream>>>(k, v, 0, 1, o.context + s, l, c.coarse_block);
      HISPARSE_CUDA_CHECK(cudaGetLastError());
      throw_if_error(cache.append_decode_async(l, slots, k, v, stream));
    }
    make_queries<<<static_cast<int>(q_rows), kDim, 0, stream>>>(queries.as<bf16>(), o.requests, s, prompt_blocks);
    HISPARSE_CUDA_CHECK(cudaEventRecord(event(s, 0), stream));
    throw_if_error(step.replay(stream));
    HISPARSE_CUDA_CHECK(cudaEventRecord(event(s, 1), stream));
    if (p.m.offload) {
      std::int32_t* lists = kept_buffer.as<std::int32_t>() + static_cast<std::size_t>(s % 2) * kept_words * o.layers;
      for (int l = 0; l < o.layers; ++l) {
        std::int32_t* at = lists + static_cast<std::size_t>(l) * kept_words;
        HISPARSE_CUDA_CHECK(cudaMemcpyAsync(at, step.layer(l).kept_slices(), kept_rows * c.top_k_fine * 4,
                                            cudaMemcpyDeviceToHost, stream));
        HISPARSE_CUDA_CHECK(cudaMemcpyAsync(at + kept_rows * c.top_k_fine, step.layer(l).num_slices(), kept_rows * 4,
                                            cudaMemcpyDeviceToHost, stream));
      }
      HISPARSE_CUDA_CHECK(cudaEventRecord(event(s, 2), stream));
      if (s > 0) read_step(s - 1, true);
    } else if (s > 0) {
      HISPARSE_CUDA_CHECK(cudaEventSynchronize(event(s - 1, 1)));  // at most two steps queued
    }
    if (s > 0)
      loop_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - iteration).count());
  }
  if (p.m.offload) read_step(o.steps - 1, false);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> step_us;
  for (int s = 0; s < o.steps; ++s) {
    float ms = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms, event(s, 0), event(s, 1)));
    step_us.push_back(ms * 1e3);
  }
  for (auto& e : ev) HISPARSE_CUDA_CHECK(cudaEventDestroy(e));
  cudaEvent_t begin = nullptr, end = nullptr;
  HISPARSE_CUDA_CHECK(cudaEventCreate(&begin));
  HISPARSE_CUDA_CHECK(cudaEventCreate(&end));

  // The same layers as one graph each, launched one after another, against
  // the whole model's graph, alternately on the same inputs.
  std::vector<cudaGraphExec_t> single(static_cast<std::size_t>(o.layers));
  for (int l = 0; l < o.layers; ++l) {
    cudaGraph_t g = nullptr;
    HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    throw_if_error(step.layer(l).run(stream));
    HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&single[static_cast<std::size_t>(l)], g, 0));
    HISPARSE_CUDA_CHECK(cudaGraphDestroy(g));
  }
  auto timed = [&](auto&& launch) {
    HISPARSE_CUDA_CHECK(cudaEventRecord(begin, stream));
    launch();
    HISPARSE_CUDA_CHECK(cudaEventRecord(end, stream));
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
    return ms * 1e3;
  };
  std::vector<double> whole_us, layers_us;
  for (int i = 0; i < 11; ++i) {
    whole_us.push_back(timed([&] { throw_if_error(step.replay(stream)); }));
    double sum = 0;
    for (const auto g : single) sum += timed([&] { HISPARSE_CUDA_CHECK(cudaGraphLaunch(g, stream)); });
    layers_us.push_back(sum);
  }
  for (const auto g : single) cudaGraphExecDestroy(g);

  std::vector<float> h_lse(q_rows);
  HISPARSE_CUDA_CHECK(cudaMemcpy(h_lse.data(), lse.ptr, q_rows * sizeof(float), cudaMemcpyDeviceToHost));
  const bool finite = std::all_of(h_lse.begin(), h_lse.end(), [](float x) { return std::isfinite(x); });

  const double whole = median(whole_us), separate = median(layers_us);
  std::printf("decode: %d steps of %d layers x %d requests, each step's appends then its graph: whole-model "
              "step median %.1f us, max %.1f us (%.2f us a layer)\n",
              o.steps, o.layers, o.requests, median(step_us), *std::max_element(step_us.begin(), step_us.end()),
              median(step_us) / o.layers);
  std::printf("        serving loop (appends, step%s; the next step queued before the host waits): median %.3f ms "
              "an iteration, max %.3f ms\n",
              p.m.offload ? ", the last step's kept slices read back, its policy and moves" : "", median(loop_ms),
              loop_ms.empty() ? 0.0 : *std::max_element(loop_ms.begin(), loop_ms.end()));
  std::printf("        back to back: one graph %.1f us vs %d single-layer graphs %.1f us (%.1f us each): ratio %.3f\n", whole,
              o.layers, separate, separate / o.layers, whole / separate);
  auto share = [](std::int64_t part, std::int64_t whole) {
    return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  if (p.m.offload)
    std::printf("        kept slices read from the host: %.2f%% (%lld of %lld; first step %.2f%%, later %.2f%%); "
                "host policy work a step (overlaps the next step): median %.2f ms, first step %.2f ms\n",
                share(misses, kept_total), static_cast<long long>(misses), static_cast<long long>(kept_total),
                share(first_misses, first_kept), share(misses - first_misses, kept_total - first_kept),
                median(policy_ms), policy_ms.empty() ? 0.0 : policy_ms.front());
  if (p.m.offload && fetched.size() > 1)
    std::printf("        pages fetched a step: median %.0f (%.1f MB; the first step %.0f), as many offloaded\n",
                median(std::vector<double>(fetched.begin() + 1, fetched.end())),
                median(std::vector<double>(fetched.begin() + 1, fetched.end())) *
                    static_cast<double>(p.budget.footprint.page_bytes) / 1e6,
                fetched.front());
  const auto st = stats.stats();
  const std::size_t page_bytes = p.budget.footprint.page_bytes;
  std::printf("memory: pages on the device %.2f GB (%lld in use of %lld in the pool), on the host %.2f GB, "
              "metadata %.2f GB, decode workspace %.1f MB, this program's buffers %.1f MB\n",
              static_cast<double>(cache.pool().pages_total()) * static_cast<double>(page_bytes) / 1e9,
              static_cast<long long>(cache.pool().pages_used()), static_cast<long long>(cache.pool().pages_total()),
              static_cast<double>(cache.host_pages_used()) * static_cast<double>(page_bytes) / 1e9,
              static_cast<double>(p.budget.metadata) / 1e9, static_cast<double>(ws_bytes) / 1e6,
              static_cast<double>(scratch_bytes(o)) / 1e6);
  const double error = (static_cast<double>(st.peak_bytes) - static_cast<double>(p.predicted)) /
                       static_cast<double>(p.predicted);
  std::printf("        device peak %.3f GB measured (statistics_adaptor) vs %.3f GB predicted (plan_memory): "
              "%+.2f%%; limit %.1f GiB\n",
              static_cast<double>(st.peak_bytes) / 1e9, static_cast<double>(p.predicted) / 1e9, 100.0 * error,
              o.limit_gib);
  HISPARSE_CUDA_CHECK(cudaEventDestroy(begin));
  HISPARSE_CUDA_CHECK(cudaEventDestroy(end));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
  if (!finite) std::printf("error: a log-sum-exp is not finite\n");
  return finite ? 0 : 1;
}

bool parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--plan-only") {
      o.plan_only = true;
      continue;
    }
    if ((v = value()) == nullptr) return false;
    if (a == "--requests") o.requests = std::atoi(v);
    else if (a == "--context") o.context = std::atoll(v);
    else if (a == "--layers") o.layers = std::atoi(v);
    else if (a == "--steps") o.steps = std::atoi(v);
    else if (a == "--limit-gib") o.limit_gib = std::atof(v);
    else if (a == "--host-gib") o.host_gib = std::atof(v);
    else if (a == "--chunk") o.chunk = std::atoi(v);
    else if (a == "--keep-steps") o.keep_steps = std::atoi(v);
    else if (a == "--mode") o.mode = v;
    else return false;
  }
  return o.requests > 0 && o.context > 0 && o.layers > 0 && o.steps > 0 && o.limit_gib > 0 && o.host_gib >= 0 &&
         o.chunk > 0 && o.keep_steps > 0;
}
}  // namespace

int main(int argc, char** argv) {
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr, "usage: serve_8x256k [--requests N] [--context T] [--layers L] [--steps S] "
                         "[--limit-gib G] [--host-gib H] [--chunk N] [--keep-steps K] "
                         "[--mode auto|bf16|fp8|fp8-offload|bf16-offload] [--plan-only]\n");
    return 2;
  }
  int devices = 0, num_sms = 132;
  const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  if (gpu) {
    cudaDeviceProp prop{};
    int driver = 0;
    HISPARSE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    HISPARSE_CUDA_CHECK(cudaDriverGetVersion(&driver));
    num_sms = prop.multiProcessorCount;
    std::printf("device: %s, %d SMs, %.1f GiB, CUDA driver %d.%d\n", prop.name, num_sms,
                static_cast<double>(prop.totalGlobalMem) / static_cast<double>(kGiB), driver / 1000,
                driver % 1000 / 10);
  }
  std::printf("serve_8x256k: %d requests x %lld tokens (+%d decode steps), %d layers, %d/%d heads, d %d, "
              "device limit %.1f GiB, host tier %.1f GiB\n",
              o.requests, static_cast<long long>(o.context), o.steps, o.layers, kQHeads, kKvHeads, kDim,
              o.limit_gib, o.host_gib);
  const planned* chosen = nullptr;
  std::vector<planned> plans(std::size(kModes));
  for (std::size_t i = 0; i < std::size(kModes); ++i) {
    if (const status s = plan(o, kModes[i], num_sms, plans[i]); s != status::success) {
      std::fprintf(stderr, "plan: %s\n", last_error().c_str());
      return 1;
    }
    print_plan(plans[i]);
    const bool wanted = o.mode == "auto" ? plans[i].fits : o.mode == kModes[i].name;
    if (chosen == nullptr && wanted) chosen = &plans[i];
  }
  if (chosen == nullptr) {
    std::printf("no mode %s under %.1f GiB\n", o.mode == "auto" ? "fits" : ("named " + o.mode).c_str(),
                o.limit_gib);
    return o.mode == "auto" ? 0 : 2;
  }
  std::printf("mode: %s%s\n", chosen->m.name, chosen->fits ? "" : " (asked for; the plan says it does not fit)");
  if (!gpu || o.plan_only) {
    std::printf("%s: plan only\n", gpu ? "--plan-only" : "no CUDA device");
    return 0;
  }
  try {
    return chosen->m.elem_bytes == 1 ? serve<fp8>(o, *chosen) : serve<bf16>(o, *chosen);
  } catch (const error& e) {
    std::fprintf(stderr, "serve_8x256k: %s\n", e.what());
    return 1;
  }
}
