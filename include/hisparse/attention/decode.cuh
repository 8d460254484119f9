#pragma once
// Decode attention over a paged KV cache (DESIGN.md section 1, step 6), in
// two modes that share one kernel:
//  * sparse: per (sequence, KV head) the kept slices of a decode selection
//    (select/decode_selection.cuh) followed by the window [ws, length);
//  * dense: every slice [0, length) -- the in-library baseline.
// The unit of work is a slice (one page: F rows of K and F rows of V of one
// KV head, each contiguous). A (sequence, KV head) has up to `max_items`
// slices; they are cut into `splits` runs of `slices_per_split`, one CTA
// each (flash-decoding), and the last CTA of a (sequence, KV head) to finish
// merges the runs by log-sum-exp. All query heads of the GQA group (up to 8
// per CTA) share every K/V load.
//
// Inside a CTA, a "reader" is D / 8 lanes (16 bytes each, one K or V row per
// reader per load); every reader keeps its own fp32 online softmax
// (running max, sum, output) per head over the rows it reads, with
// `RowsInFlight` rows of K and V loaded before any is used; the readers are
// merged in shared memory at the end. Scores use exp2 with log2(e) / sqrt(D)
// folded into the query.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/tile_policy.hpp"

namespace hisparse::attention {

/// The default decode tile: 4 warps, 4 rows of K and V in flight per reader.
/// block_kv is the slice (the page), so it is not a free parameter here.
inline constexpr tile_policy kDecodeTile{1, 64, 4, 4};

/// One decode step's attention for a batch. Sparse when `kept_slices` is set
/// (with num_slices and window_begin from the selection), dense otherwise.
template <class T>
struct decode_attention_arguments {
  const T* queries = nullptr;           ///< [batch][num_q_heads][head_dim]
  const std::int32_t* slots = nullptr;  ///< [batch], device: cache slot of each row
  int batch = 0;
  int layer = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<T> cache{};
  const std::int32_t* kept_slices = nullptr;   ///< [batch][kv_heads][top_k_fine], ascending, -1 padded
  const std::int32_t* num_slices = nullptr;    ///< [batch][kv_heads]
  const std::int32_t* window_begin = nullptr;  ///< [batch]
  int top_k_fine = 0;
  /// Most slices one (sequence, KV head) attends; fixes the launch grid.
  /// Sparse: top_k_fine + window slices (sparse_max_items); dense: the
  /// cache's max_slices (or fewer, if every length in the batch is known to
  /// be shorter).
  std::int32_t max_items = 0;
  float softmax_scale = 0.0f;  ///< 0: 1 / sqrt(head_dim)
  T* out = nullptr;            ///< [batch][num_q_heads][head_dim]
  float* lse = nullptr;        ///< optional [batch][num_q_heads], natural log

  [[nodiscard]] HISPARSE_HOST_DEVICE bool sparse() const { return kept_slices != nullptr; }
};

/// Slices a sparse decode attends at most: the kept slices plus the window,
/// which holds W to W + F - 1 tokens and starts on a slice boundary.
[[nodiscard]] inline std::int32_t sparse_max_items(const SparseAttentionConfig& cfg) {
  return cfg.top_k_fine + (cfg.window + cfg.fine_slice - 1 + cfg.fine_slice - 1) / cfg.fine_slice;
}

/// Launch shape and workspace of a decode attention; `plan_decode_attention`
/// fills it on the host without touching the device's queues.
///
/// Workspace layout: [merge counters | partial outputs | partial LSEs]. The
/// counters are always there, sized for `counter_batch` (at least the batch),
/// so a workspace planned and initialized for a batch serves any smaller
/// batch planned with the same counter_batch: the counters sit at the same
/// place, zeroed once, and every run leaves them zero.
struct decode_attention_plan {
  int heads_per_cta = 0;     ///< query heads of a group one CTA serves (power of two, <= 8)
  int head_splits = 0;       ///< CTAs across one group: ceil(group / heads_per_cta)
  int splits = 0;            ///< CTAs along the slices of one (sequence, KV head)
  int slices_per_split = 0;
  // The arguments' shape the plan was made for (checked at launch).
  int batch = 0, num_q_heads = 0, kv_heads = 0, head_dim = 0, counter_batch = 0;
  std::int32_t max_items = 0;
  std::size_t counter_offset = 0, counter_bytes = 0, partial_offset = 0, lse_offset = 0;
  std::size_t workspace_bytes = 0;
};

namespace detail {

inline constexpr int kMaxHeadsPerCta = 8;
/// CTAs per SM the kernel is compiled for and planned with, by query heads
/// per CTA: registers hold heads x 8 query and output floats per lane, so
/// wider groups get fewer CTAs rather than spills (at four CTAs of 4 warps,
/// 128 registers, the 4-head kernel spilled 320 bytes, the 8-head one 2.3 KB).
/// The plan sizes the grid to one wave of these: unplanned, B = 8 ran 1.45
/// waves (Nsight Compute).
HISPARSE_HOST_DEVICE constexpr int min_blocks_per_sm(int heads_per_cta) {
  return heads_per_cta <= 2 ? 4 : heads_per_cta == 4 ? 3 : 2;
}
/// Most CTAs along one (sequence, KV head): the merge keeps one weight per
/// split and head in shared memory.
inline constexpr int kMaxSplits = 64;
/// Page pointers a CTA fetches ahead, in parallel, before walking them.
inline constexpr int kPageChunk = 64;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

template <class T>
struct decode_attention_params {
  decode_attention_arguments<T> a;
  int group, head_splits, splits, slices_per_split;
  float scale_log2;  ///< softmax scale * log2(e)
  float* partial_out;      ///< [batch][num_q_heads][splits][head_dim]
  float* partial_lse;      ///< [batch][num_q_heads][splits], log2 domain
  unsigned* counters;      ///< [batch][kv_heads * head_splits], zero between runs
};

/// Converts 16 bytes of T to kVec floats.
template <class T, int kVec>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[kVec]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of its fp32
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    T e[kVec];
    std::memcpy(e, &raw, 16);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = to_float(e[i]);
  }
}

/// The item-th slice a (sequence, KV head) attends: kept slices first, then
/// the window's (or, dense, slice `item`).
__device__ __forceinline__ std::int32_t slice_of_item(const std::int32_t* kept, int n_kept, std::int32_t first_window,
                                                      int item) {
  return item < n_kept ? kept[item] : first_window + (item - n_kept);
}

/// Grid: x = split, y = KV head * head_splits + head split, z = batch row.
template <class T, int D, int GT, int Warps, int Rows>
__global__ void __launch_bounds__(Warps * 32, min_blocks_per_sm(GT)) decode_attention_kernel(const __grid_constant__ decode_attention_params<T> p) {
  constexpr int kThreads = Warps * 32;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kLanes = D / kVec;                         // lanes per reader: one row
  constexpr int kReaders = kThreads / kLanes;
  static_assert(kLanes <= 32 && 32 % kLanes == 0, "a reader is a power-of-two part of a warp");
  const float kNegInf = -__int_as_float(0x7f800000);

  struct reader_state {
    float m[kReaders][GT];
    float l[kReaders][GT];
  };
  __shared__ reader_state rs;
  __shared__ float racc[kReaders][GT][D];
  __shared__ bool last_cta;
  __shared__ const T* chunk_pages[kPageChunk];
  __shared__ std::int32_t chunk_slices[kPageChunk];
  __shared__ float merge_w[GT][kMaxSplits];
  __shared__ float merge_lse[GT];

  const auto& a = p.a;
  const auto& c = a.cache;
  const int split = blockIdx.x, b = blockIdx.z;
  const int h = static_cast<int>(blockIdx.y) / p.head_splits, hs = static_cast<int>(blockIdx.y) % p.head_splits;
  const int g0 = hs * GT, heads = min(GT, p.group - g0);
  const int seq = a.slots[b];
  const std::int32_t len = c.lengths[std::int64_t{seq} * c.layers + a.layer];
  const int F = c.fine_slice;
  const std::int64_t at = std::int64_t{b} * c.kv_heads + h;
  const std::int32_t* kept = a.sparse() ? a.kept_slices + at * a.top_k_fine : nullptr;
  const int n_kept = a.sparse() ? a.num_slices[at] : 0;
  const std::int32_t first_window = a.sparse() ? a.window_begin[b] / F : 0;
  const std::int32_t end_slice = (len + F - 1) / F;
  const int items = n_kept + (end_slice - first_window);
  const int active = (items + p.slices_per_split - 1) / p.slices_per_split;
  const std::int64_t q_row0 = std::int64_t{b} * a.num_q_heads + std::int64_t{h} * p.group + g0;

  if (items <= 0 || len <= 0) {  // nothing stored: a zero output, lse -inf
    if (split == 0)
      for (int i = threadIdx.x; i < heads * D; i += kThreads) {
        a.out[(q_row0 + i / D) * D + i % D] = from_float<T>(0.0f);
        if (a.lse != nullptr && i % D == 0) a.lse[q_row0 + i / D] = kNegInf;
      }
    return;
  }
  if (split >= active) return;
  if (active > p.splits) {  // more slices than the plan's max_items: say so loudly, never drop any
    for (int i = threadIdx.x; i < heads * D; i += kThreads)
      a.out[(q_row0 + i / D) * D + i % D] = from_float<T>(__int_as_float(0x7fffffff));
    return;
  }

  const int lane_in_reader = threadIdx.x % kLanes, reader = threadIdx.x / kLanes;
  const int d0 = lane_in_reader * kVec;
  float q[GT][kVec];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (g < heads) {
      const uint4 raw = *reinterpret_cast<const uint4*>(a.queries + (q_row0 + g) * D + d0);
      unpack<T, kVec>(raw, q[g]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][e] = 0.0f;
    }
  }
  float m[GT], l[GT], acc[GT][kVec];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = kNegInf;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
  }

  const int item_begin = split * p.slices_per_split;
  const int item_end = min(items, item_begin + p.slices_per_split);
  const std::int64_t tile = std::int64_t{F} * D;
  for (int chunk = item_begin; chunk < item_end; chunk += kPageChunk) {
    // Fetch the chunk's slice ids and page pointers in parallel, so the walk
    // below waits on K/V loads only, not on a page-table load per slice.
    const int n = min(kPageChunk, item_end - chunk);
    __syncthreads();  // the previous chunk is no longer read
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const std::int32_t slice = slice_of_item(kept, n_kept, first_window, chunk + i);
      chunk_slices[i] = slice;
      chunk_pages[i] = c.page_table[c.table_index(seq, a.layer, slice)];
    }
    __syncthreads();
    for (int j = 0; j < n; ++j) {
      const std::int32_t slice = chunk_slices[j];
      const T* page = chunk_pages[j];
      const T* ktile = page + h * tile + d0;
      const T* vtile = page + (c.kv_heads + h) * tile + d0;
      const int rows = min(F, len - slice * F);
      // The trip count is the same for every thread (the readers of a warp
      // shuffle together); rows past the end are masked.
      for (int r0 = reader; r0 - reader < rows; r0 += kReaders * Rows) {
        uint4 kraw[Rows], vraw[Rows];
#pragma unroll
        for (int u = 0; u < Rows; ++u) {
          const int r = r0 + u * kReaders;
          if (r < rows) {
            kraw[u] = __ldg(reinterpret_cast<const uint4*>(ktile + std::int64_t{r} * D));
            vraw[u] = __ldg(reinterpret_cast<const uint4*>(vtile + std::int64_t{r} * D));
          }
        }
        float s[Rows][GT];
#pragma unroll
        for (int u = 0; u < Rows; ++u) {
          float k[kVec];
          if (r0 + u * kReaders < rows) unpack<T, kVec>(kraw[u], k);
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            float dot = 0.0f;
            if (r0 + u * kReaders < rows)
#pragma unroll
              for (int e = 0; e < kVec; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
            for (int off = kLanes / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
            s[u][g] = r0 + u * kReaders < rows ? dot : kNegInf;
          }
        }
#pragma unroll
        for (int g = 0; g < GT; ++g) {
          float mx = m[g];
#pragma unroll
          for (int u = 0; u < Rows; ++u) mx = fmaxf(mx, s[u][g]);
          if (mx == kNegInf) continue;  // every row masked so far (NaN scores propagate)
          const float corr = exp2f(m[g] - mx);
          l[g] *= corr;
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][e] *= corr;
          m[g] = mx;
        }
#pragma unroll
        for (int u = 0; u < Rows; ++u) {
          if (r0 + u * kReaders >= rows) continue;
          float v[kVec];
          unpack<T, kVec>(vraw[u], v);
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            const float pr = exp2f(s[u][g] - m[g]);
            l[g] += pr;
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(pr, v[e], acc[g][e]);
          }
        }
      }
    }
  }

  // Merge the readers: per head, rescale every reader to the common max.
  if (lane_in_reader == 0)
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      rs.m[reader][g] = m[g];
      rs.l[reader][g] = l[g];
    }
#pragma unroll
  for (int g = 0; g < GT; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e) racc[reader][g][d0 + e] = acc[g][e];
  __syncthreads();

  const bool single = active == 1;
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float mx = kNegInf;
    for (int r = 0; r < kReaders; ++r) mx = fmaxf(mx, rs.m[r][g]);
    float sum = 0.0f, o = 0.0f;
    for (int r = 0; r < kReaders; ++r) {
      const float w = rs.m[r][g] == kNegInf ? 0.0f : exp2f(rs.m[r][g] - mx);
      sum += rs.l[r][g] * w;
      o += racc[r][g][d] * w;
    }
    const float lse2 = mx + log2f(sum);
    const std::int64_t row = q_row0 + g;
    if (single) {
      a.out[row * D + d] = from_float<T>(o / sum);
      if (a.lse != nullptr && d == 0) a.lse[row] = lse2 * kLn2;
    } else {
      p.partial_out[(row * p.splits + split) * D + d] = o / sum;
      if (d == 0) p.partial_lse[row * p.splits + split] = lse2;
    }
  }
  if (single) return;

  // Flash-decoding merge by the last CTA of this (sequence, KV head, head
  // split) to finish: publish the partials, count arrivals, and the last
  // one combines every split and resets the counter for the next run.
  __threadfence();
  __syncthreads();
  unsigned* counter = p.counters + std::int64_t{b} * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) {
    const unsigned done = atomicAdd(counter, 1u);
    last_cta = done + 1 == static_cast<unsigned>(active);
  }
  __syncthreads();
  if (!last_cta) return;
  __threadfence();
  // Weights first (one parallel round of loads), then every output element
  // as a weighted sum whose loads are independent of each other.
  for (int i = threadIdx.x; i < heads * active; i += kThreads)
    merge_w[i / active][i % active] = __ldcg(p.partial_lse + (q_row0 + i / active) * p.splits + i % active);
  __syncthreads();
  if (threadIdx.x < heads) {
    const int g = threadIdx.x;
    float mx = kNegInf;
    for (int sp = 0; sp < active; ++sp) mx = fmaxf(mx, merge_w[g][sp]);
    float sum = 0.0f;
    for (int sp = 0; sp < active; ++sp) sum += exp2f(merge_w[g][sp] - mx);
    for (int sp = 0; sp < active; ++sp) merge_w[g][sp] = exp2f(merge_w[g][sp] - mx) / sum;
    merge_lse[g] = mx + log2f(sum);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int g = i / D, d = i % D;
    const std::int64_t row = q_row0 + g;
    const float* part = p.partial_out + row * p.splits * D + d;
    float o = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < active; ++sp) o = fmaf(merge_w[g][sp], __ldcg(part + std::int64_t{sp} * D), o);
    a.out[row * D + d] = from_float<T>(o);
    if (a.lse != nullptr && d == 0) a.lse[row] = merge_lse[g] * kLn2;
  }
  if (threadIdx.x == 0) *counter = 0;
}

template <class T, int D, int GT, tile_policy Tile>
status launch_decode_attention(const decode_attention_params<T>& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.a.cache.kv_heads * p.head_splits),
                  static_cast<unsigned>(p.a.batch));
  decode_attention_kernel<T, D, GT, Tile.warps, Tile.stages><<<grid, Tile.threads(), 0, stream>>>(p);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

template <class T, int D, tile_policy Tile>
status dispatch_heads_per_cta(int gt, const decode_attention_params<T>& p, cudaStream_t stream) {
  switch (gt) {
    case 1: return launch_decode_attention<T, D, 1, Tile>(p, stream);
    case 2: return launch_decode_attention<T, D, 2, Tile>(p, stream);
    case 4: return launch_decode_attention<T, D, 4, Tile>(p, stream);
    default: return launch_decode_attention<T, D, 8, Tile>(p, stream);
  }
}

}  // namespace detail

/// Checks the arguments before any work; names what is wrong.
template <class T>
[[nodiscard]] status can_implement_decode_attention(const decode_attention_arguments<T>& a) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "decode attention reads bf16 or fp16 KV");
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "decode attention: " + why); };
  const auto& c = a.cache;
  HISPARSE_TRY(check(attention_shape{a.num_q_heads, c.kv_heads, c.head_dim}));
  if (a.batch < 1) return bad("batch is empty");
  if (a.queries == nullptr || a.slots == nullptr || a.out == nullptr) return bad("queries, slots and out must be set");
  if (c.page_table == nullptr || c.lengths == nullptr) return bad("the cache view is empty");
  if (a.layer < 0 || a.layer >= c.layers) return bad("layer out of range");
  if (a.sparse() && (a.num_slices == nullptr || a.window_begin == nullptr || a.top_k_fine < 1))
    return bad("a sparse run needs num_slices, window_begin and top_k_fine");
  auto aligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(a.queries) || !aligned(a.out)) return bad("queries and out must be 16-byte aligned");
  if (a.max_items < 1 || a.max_items > c.max_slices)
    return bad("max_items " + std::to_string(a.max_items) + " must be in [1, the cache's max_slices " +
               std::to_string(c.max_slices) + "]");
  if (!(a.softmax_scale >= 0.0f) || std::isinf(a.softmax_scale)) return bad("softmax_scale must be finite and >= 0");
  return status::success;
}

/// Launch shape for `a` on a GPU with `num_sms` multiprocessors: one wave of
/// CTAs (min_blocks_per_sm per SM), never fewer than one slice per CTA, at
/// most 64 splits. `counter_batch` (default: a.batch) sizes the merge
/// counters for the largest batch the workspace will serve.
template <class T>
[[nodiscard]] status plan_decode_attention(const decode_attention_arguments<T>& a, int num_sms,
                                           decode_attention_plan& plan, int counter_batch = 0) {
  HISPARSE_TRY(can_implement_decode_attention(a));
  const int group = a.num_q_heads / a.cache.kv_heads;
  plan.heads_per_cta = 1;
  while (plan.heads_per_cta < std::min(group, detail::kMaxHeadsPerCta)) plan.heads_per_cta *= 2;
  plan.head_splits = (group + plan.heads_per_cta - 1) / plan.heads_per_cta;
  // As many splits as fill one wave (min_blocks_per_sm CTAs on every SM), not
  // more: a second, partial wave costs a whole CTA lifetime.
  const std::int64_t per_split = std::int64_t{a.batch} * a.cache.kv_heads * plan.head_splits;
  const std::int64_t want =
      std::max<std::int64_t>(1, std::int64_t{detail::min_blocks_per_sm(plan.heads_per_cta)} * std::max(num_sms, 1) / per_split);
  const std::int64_t splits_wanted = std::min<std::int64_t>(want, detail::kMaxSplits);
  plan.slices_per_split = static_cast<int>(std::max<std::int64_t>(1, (a.max_items + splits_wanted - 1) / splits_wanted));
  plan.splits = (a.max_items + plan.slices_per_split - 1) / plan.slices_per_split;
  if (std::int64_t{a.cache.kv_heads} * plan.head_splits > 65535 || a.batch > 65535)
    return fail(status::unsupported, "decode attention: batch and KV heads are limited to 65535 (grid y and z)");
  plan.batch = a.batch;
  plan.num_q_heads = a.num_q_heads;
  plan.kv_heads = a.cache.kv_heads;
  plan.head_dim = a.cache.head_dim;
  plan.max_items = a.max_items;
  plan.counter_batch = std::max(counter_batch, a.batch);
  auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  const std::size_t rows = static_cast<std::size_t>(a.batch) * a.num_q_heads;
  plan.counter_offset = 0;
  plan.counter_bytes =
      align(static_cast<std::size_t>(plan.counter_batch) * a.cache.kv_heads * plan.head_splits * sizeof(unsigned));
  plan.partial_offset = plan.counter_bytes;
  plan.lse_offset = plan.partial_offset;
  plan.workspace_bytes = plan.counter_bytes;
  if (plan.splits > 1) {
    plan.lse_offset = plan.partial_offset + align(rows * plan.splits * a.cache.head_dim * sizeof(float));
    plan.workspace_bytes = plan.lse_offset + align(rows * plan.splits * sizeof(float));
  }
  return status::success;
}

/// Zeroes the merge counters of a fresh workspace (once; every run leaves
/// them zero again). Stream-ordered.
[[nodiscard]] inline status initialize_decode_attention_workspace(const decode_attention_plan& plan, void* workspace,
                                                                  cudaStream_t stream = nullptr) {
  if (plan.counter_bytes == 0) return status::success;
  if (workspace == nullptr) return fail(status::invalid_argument, "decode attention: workspace is null");
  HISPARSE_CUDA_TRY(cudaMemsetAsync(static_cast<char*>(workspace) + plan.counter_offset, 0, plan.counter_bytes, stream));
  return status::success;
}

/// Launches a planned decode attention: one kernel, no allocation, no sync
/// (capturable in a CUDA graph; slots, lengths and the selection are read on
/// the device at run time). `workspace` holds plan.workspace_bytes,
/// initialized once by initialize_decode_attention_workspace; two runs that
/// share a workspace must be stream-ordered.
template <class T, tile_policy Tile = kDecodeTile>
[[nodiscard]] status decode_attention_async(const decode_attention_plan& plan, const decode_attention_arguments<T>& a,
                                            void* workspace, cudaStream_t stream = nullptr) {
  static_assert(valid_tile_policy_v<Tile>);
  static_assert(Tile.block_q == 1, "decode attention takes one query per sequence (block_q = 1)");
  static_assert(Tile.warps <= 4,
                "decode attention keeps every reader's partial output in static shared memory "
                "(warps x heads per CTA x 1 KB): at most 4 warps");
  if (plan.splits < 1) return fail(status::invalid_argument, "decode attention: the plan is empty");
  if (plan.batch != a.batch || plan.num_q_heads != a.num_q_heads || plan.kv_heads != a.cache.kv_heads ||
      plan.head_dim != a.cache.head_dim || plan.max_items != a.max_items)
    return fail(status::invalid_argument,
                "decode attention: the plan was made for another shape (batch " + std::to_string(plan.batch) +
                    ", max_items " + std::to_string(plan.max_items) + "); plan again for batch " +
                    std::to_string(a.batch) + ", max_items " + std::to_string(a.max_items));
  if (workspace == nullptr) return fail(status::invalid_argument, "decode attention: the plan needs a workspace");
  detail::decode_attention_params<T> p{};
  p.a = a;
  p.group = a.num_q_heads / a.cache.kv_heads;
  p.head_splits = plan.head_splits;
  p.splits = plan.splits;
  p.slices_per_split = plan.slices_per_split;
  const float scale = a.softmax_scale > 0.0f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(a.cache.head_dim));
  p.scale_log2 = scale * detail::kLog2e;
  auto* ws = static_cast<char*>(workspace);
  p.partial_out = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.partial_offset) : nullptr;
  p.partial_lse = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.lse_offset) : nullptr;
  p.counters = reinterpret_cast<unsigned*>(ws + plan.counter_offset);
  switch (a.cache.head_dim) {
    case 64: return detail::dispatch_heads_per_cta<T, 64, Tile>(plan.heads_per_cta, p, stream);
    case 128: return detail::dispatch_heads_per_cta<T, 128, Tile>(plan.heads_per_cta, p, stream);
    default: return detail::dispatch_heads_per_cta<T, 256, Tile>(plan.heads_per_cta, p, stream);
  }
}

/// The number of multiprocessors of the current device (for plans).
[[nodiscard]] inline status current_device_sms(int& sms) {
  int device = 0;
  HISPARSE_CUDA_TRY(cudaGetDevice(&device));
  HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return status::success;
}

}  // namespace hisparse::attention
