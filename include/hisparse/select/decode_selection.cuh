#pragma once
// Decode selection: the coarse and fine filters of DESIGN.md section 1 for
// one query per sequence (M = 1), fused into one launch. One CTA per
// (sequence, KV head):
//   1. the GQA group's queries are summed in fp32 (sum_g q_g . x = (sum_g q_g) . x);
//   2. every candidate block (bC < ws) is scored against its mean key -- the
//      stored block sum over C for whole blocks, the sum of the far slices'
//      sums over their token count for the block that holds ws;
//   3. top-k blocks, by the keys of topk_keys.hpp (ties to the lower index);
//   4. the far slices of the kept blocks are scored against their means;
//   5. top-k slices, emitted as an ascending int32 list (the attention kernel
//      walks memory forward), padded with -1, with the count and the window.
// Scores are fp32 (a dot product of fp32 sums, one warp per candidate row,
// 16-byte loads, several rows in flight per lane); the paged cache's sums are
// the only KV data read, so the step reads ~0.4 MB per (sequence, KV head)
// at 256K tokens.

#include <cstdint>
#include <string>

#include <cub/block/block_scan.cuh>
#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/select/topk.cuh"

namespace hisparse::select {

/// Where the selection of a decode batch goes. Kept lists are ascending and
/// padded with -1; the score arrays (optional) hold each kept item's score.
struct decode_selection_output {
  std::int32_t* kept_slices = nullptr;    ///< [batch][kv_heads][top_k_fine]
  std::int32_t* num_slices = nullptr;     ///< [batch][kv_heads]
  std::int32_t* window_begin = nullptr;   ///< [batch]: ws; the window is [ws, length)
  std::int32_t* kept_blocks = nullptr;    ///< optional [batch][kv_heads][top_k_coarse]
  float* block_scores = nullptr;          ///< optional [batch][kv_heads][top_k_coarse]
  float* slice_scores = nullptr;          ///< optional [batch][kv_heads][top_k_fine]
};

/// Everything a decode selection reads: the queries [batch][q_heads][head_dim],
/// the cache's summaries and lengths for `layer`, and which cache slot each
/// batch row is. `slots` lives on the device so a captured graph can be
/// replayed for another batch.
template <class Q>
struct decode_selection_arguments {
  const Q* queries = nullptr;
  const std::int32_t* slots = nullptr;  ///< [batch], device
  int batch = 0;
  int layer = 0;
  int num_q_heads = 0;
  // From the paged cache (kv::paged_kv_cache::ref()).
  const float* slice_sums = nullptr;
  const float* block_sums = nullptr;
  const std::int32_t* lengths = nullptr;
  int layers = 0, kv_heads = 0, head_dim = 0, fine_slice = 0, coarse_block = 0;
  std::int32_t max_slices = 0, max_blocks = 0;

  template <class T>
  void set_cache(const kv::paged_kv_ref<T>& r) {
    slice_sums = r.slice_sums;
    block_sums = r.block_sums;
    lengths = r.lengths;
    layers = r.layers;
    kv_heads = r.kv_heads;
    head_dim = r.head_dim;
    fine_slice = r.fine_slice;
    coarse_block = r.coarse_block;
    max_slices = r.max_slices;
    max_blocks = r.max_blocks;
  }
};

namespace detail {

inline constexpr int kSelectThreads = 512;
inline constexpr int kSelectWarps = kSelectThreads / 32;
inline constexpr int kSelectKeysPerThread = 8;
/// Candidates one CTA ranks: 4096 blocks (4M tokens at C = 1024) or 4096
/// fine candidates (top_k_coarse * C / F).
inline constexpr int kMaxSelectCandidates = kSelectThreads * kSelectKeysPerThread;

template <class Q>
struct decode_params {
  decode_selection_arguments<Q> in;
  decode_selection_output out;
  int window, top_k_coarse, top_k_fine;
};

/// Loads this lane's kPer consecutive floats of a D-float row.
template <int kPer>
__device__ __forceinline__ void load_lane(const float* row, float (&v)[kPer]) {
  if constexpr (kPer == 2) {
    const float2 x = __ldg(reinterpret_cast<const float2*>(row));
    v[0] = x.x, v[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < kPer; i += 4) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(row + i));
      v[i] = x.x, v[i + 1] = x.y, v[i + 2] = x.z, v[i + 3] = x.w;
    }
  }
}

/// Scores candidate rows [0, count) with one warp per row: `load(r, d0, v)`
/// fills the lane's floats d0..d0+kPer-1 of row r's key sum, which is dotted
/// with qsum and scaled by scale_of(r) (1 / tokens). Every row goes through
/// the same arithmetic in the same order, so equal means give equal scores.
template <int D, class Load, class ScaleOf>
__device__ void score_rows(int count, const float* qsum, Load load, ScaleOf scale_of, float* scores) {
  constexpr int kPer = D / 32;  // floats per lane: 2, 4 or 8
  constexpr int kRowsInFlight = 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  float q[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) q[i] = qsum[lane * kPer + i];
  for (int base = warp; base < count; base += kSelectWarps * kRowsInFlight) {
    float part[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int r = base + u * kSelectWarps;
      part[u] = 0.0f;
      if (r < count) {
        float v[kPer];
        load(r, lane * kPer, v);
#pragma unroll
        for (int i = 0; i < kPer; ++i) part[u] = fmaf(q[i], v[i], part[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      float s = part[u];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
      const int r = base + u * kSelectWarps;
      if (lane == 0 && r < count) scores[r] = s * scale_of(r);
    }
  }
}

/// Top-k of scores[0, count) (ids 0..count-1): sets keep[i] for the kept
/// candidates. Warp path for small problems, block path otherwise.
template <class BlockTopk, class WarpTopk>
__device__ void mark_top_k(const float* scores, int count, int k, unsigned char* keep,
                           typename BlockTopk::TempStorage& block_storage, typename WarpTopk::TempStorage& warp_storage,
                           topk_key* sorted) {
  for (int i = threadIdx.x; i < count; i += kSelectThreads) keep[i] = 0;
  __syncthreads();
  if (count <= 32 * 16 && k <= 32) {
    if (threadIdx.x < 32) {
      topk_key keys[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int i = j * 32 + static_cast<int>(threadIdx.x);
        keys[j] = i < count ? make_key(scores[i], i) : kNoCandidate;
      }
      const topk_key key = WarpTopk(warp_storage).select(keys, k);
      if (key != kNoCandidate) keep[key_index(key)] = 1;
    }
  } else {
    topk_key keys[kSelectKeysPerThread];
#pragma unroll
    for (int j = 0; j < kSelectKeysPerThread; ++j) {
      const int i = j * kSelectThreads + static_cast<int>(threadIdx.x);
      keys[j] = i < count ? make_key(scores[i], i) : kNoCandidate;
    }
    const int found = BlockTopk(block_storage).select(keys, k, sorted);
    for (int i = threadIdx.x; i < found; i += kSelectThreads) keep[key_index(sorted[i])] = 1;
  }
  __syncthreads();
}

/// Compacts the marked candidates, in candidate order, to out[0, n) and
/// returns n: every thread scans a contiguous run, one block-wide scan.
template <class Scan, class Emit>
__device__ int compact_marked(const unsigned char* keep, int count, typename Scan::TempStorage& scan_storage,
                              Emit emit) {
  constexpr int kPerThread = kMaxSelectCandidates / kSelectThreads;
  const int first = threadIdx.x * kPerThread;
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) mine += first + j < count ? keep[first + j] : 0;
  int offset = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(mine, offset, total);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j)
    if (first + j < count && keep[first + j]) emit(offset++, first + j);
  __syncthreads();
  return total;
}

template <class Q, int D>
__global__ void __launch_bounds__(kSelectThreads) decode_selection_kernel(const __grid_constant__ decode_params<Q> p) {
  using block_select = block_topk<kSelectThreads, kSelectKeysPerThread>;
  using warp_select = warp_topk<16>;
  using scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ float qsum[D];
  __shared__ float scores[kMaxSelectCandidates];
  __shared__ unsigned char keep[kMaxSelectCandidates];
  __shared__ std::int32_t kept_blocks[kMaxTopK];
  __shared__ union {
    typename block_select::TempStorage block;
    typename warp_select::TempStorage warp;
    typename scan::TempStorage scan;
  } storage;
  extern __shared__ topk_key sorted[];

  const auto& in = p.in;
  const int h = blockIdx.x, b = blockIdx.y;
  const int seq = in.slots[b];
  const std::int64_t seq_layer = std::int64_t{seq} * in.layers + in.layer;
  const std::int32_t length = in.lengths[seq_layer];
  const int F = in.fine_slice, C = in.coarse_block, spb = C / F;
  // Step 1 for M = 1: the query sits at length - 1.
  const std::int32_t x = length - 1 - p.window + 1;
  const std::int32_t ws = x <= 0 ? 0 : x / F * F;
  const std::int32_t far_slices = ws / F;
  const std::int32_t blocks = (ws + C - 1) / C;
  if (h == 0 && threadIdx.x == 0) p.out.window_begin[b] = ws;

  const int group = in.num_q_heads / in.kv_heads;
  const Q* q = in.queries + (std::int64_t{b} * in.num_q_heads + std::int64_t{h} * group) * D;
  for (int d = threadIdx.x; d < D; d += kSelectThreads) {
    float acc = 0.0f;
    for (int g = 0; g < group; ++g) acc += to_float(q[std::int64_t{g} * D + d]);
    qsum[d] = acc;
  }
  __syncthreads();

  const std::int64_t head_stride = std::int64_t{in.kv_heads} * D;
  const float* slice_base = in.slice_sums + (seq_layer * in.max_slices * in.kv_heads + h) * D;
  const float* block_base = in.block_sums + (seq_layer * in.max_blocks * in.kv_heads + h) * D;

  // Step 4: score the candidate blocks. Whole blocks use their stored sum;
  // the block holding ws is scored by the sum of its far slices' sums.
  constexpr int kPer = D / 32;
  const bool partial_last = std::int64_t{blocks} * C > ws;
  score_rows<D>(
      blocks, qsum,
      [&](int r, int d0, float(&v)[kPer]) {
        if (partial_last && r == blocks - 1) {
#pragma unroll
          for (int i = 0; i < kPer; ++i) v[i] = 0.0f;
          for (std::int32_t sl = r * spb; sl < far_slices; ++sl) {
            float w[kPer];
            load_lane<kPer>(slice_base + sl * head_stride + d0, w);
#pragma unroll
            for (int i = 0; i < kPer; ++i) v[i] += w[i];
          }
        } else {
          load_lane<kPer>(block_base + r * head_stride + d0, v);
        }
      },
      [&](int r) {
        const std::int32_t tokens = partial_last && r == blocks - 1 ? ws - r * C : C;
        return 1.0f / static_cast<float>(tokens);
      },
      scores);
  __syncthreads();
  int kept = 0;
  float* out_block_scores =
      p.out.block_scores ? p.out.block_scores + (std::int64_t{b} * in.kv_heads + h) * p.top_k_coarse : nullptr;
  std::int32_t* out_blocks =
      p.out.kept_blocks ? p.out.kept_blocks + (std::int64_t{b} * in.kv_heads + h) * p.top_k_coarse : nullptr;
  if (blocks > 0) {  // uniform across the CTA
    mark_top_k<block_select, warp_select>(scores, blocks, p.top_k_coarse, keep, storage.block, storage.warp, sorted);
    kept = compact_marked<scan>(keep, blocks, storage.scan, [&](int pos, int block) {
      kept_blocks[pos] = block;
      if (out_blocks) out_blocks[pos] = block;
      if (out_block_scores) out_block_scores[pos] = scores[block];
    });
  }
  if (out_blocks)
    for (int i = kept + threadIdx.x; i < p.top_k_coarse; i += kSelectThreads) {
      out_blocks[i] = -1;
      if (out_block_scores) out_block_scores[i] = -__int_as_float(0x7f800000);
    }

  // Step 5: the far slices of the kept blocks, in ascending slice order.
  // Candidate c is slice kept_blocks[c / spb] * spb + c % spb. Only the last
  // kept block can hold ws, and its slices past ws are the tail of the list,
  // so the real candidates are exactly the first `candidates`.
  auto slice_of = [&](int c) { return kept_blocks[c / spb] * spb + c % spb; };
  const int candidates = kept == 0 ? 0 : kept * spb - max(0, (kept_blocks[kept - 1] + 1) * spb - far_slices);
  std::int32_t* out_slices = p.out.kept_slices + (std::int64_t{b} * in.kv_heads + h) * p.top_k_fine;
  float* out_slice_scores =
      p.out.slice_scores ? p.out.slice_scores + (std::int64_t{b} * in.kv_heads + h) * p.top_k_fine : nullptr;
  int kept_slices = 0;
  if (candidates > 0) {  // uniform across the CTA
    score_rows<D>(
        candidates, qsum,
        [&](int c, int d0, float(&v)[kPer]) { load_lane<kPer>(slice_base + slice_of(c) * head_stride + d0, v); },
        [&](int) { return 1.0f / static_cast<float>(F); }, scores);
    __syncthreads();
    mark_top_k<block_select, warp_select>(scores, candidates, p.top_k_fine, keep, storage.block, storage.warp,
                                          sorted);
    kept_slices = compact_marked<scan>(keep, candidates, storage.scan, [&](int pos, int c) {
      out_slices[pos] = slice_of(c);
      if (out_slice_scores) out_slice_scores[pos] = scores[c];
    });
  }
  for (int i = kept_slices + threadIdx.x; i < p.top_k_fine; i += kSelectThreads) {
    out_slices[i] = -1;
    if (out_slice_scores) out_slice_scores[i] = -__int_as_float(0x7f800000);
  }
  if (threadIdx.x == 0) p.out.num_slices[std::int64_t{b} * in.kv_heads + h] = kept_slices;
}

}  // namespace detail

/// Checks a decode selection before any work: the config, the problem, and
/// that the cache was built with the config's slice and block sizes.
template <class Q>
[[nodiscard]] status can_implement_decode_selection(const SparseAttentionConfig& cfg,
                                                    const decode_selection_arguments<Q>& a,
                                                    const decode_selection_output& out) {
  HISPARSE_TRY(check(cfg));
  HISPARSE_TRY(check(attention_shape{a.num_q_heads, a.kv_heads, a.head_dim}));
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "decode selection: " + why); };
  if (a.batch < 1) return bad("batch is empty");
  if (a.queries == nullptr || a.slots == nullptr || a.slice_sums == nullptr || a.block_sums == nullptr ||
      a.lengths == nullptr)
    return bad("queries, slots and the cache's summaries must not be null");
  if (out.kept_slices == nullptr || out.num_slices == nullptr || out.window_begin == nullptr)
    return bad("kept_slices, num_slices and window_begin outputs must not be null");
  if (a.layer < 0 || a.layer >= a.layers) return bad("layer out of range");
  if (a.fine_slice != cfg.fine_slice || a.coarse_block != cfg.coarse_block)
    return bad("the cache's slice/block sizes (" + std::to_string(a.fine_slice) + "/" +
               std::to_string(a.coarse_block) + ") differ from the config's (" + std::to_string(cfg.fine_slice) +
               "/" + std::to_string(cfg.coarse_block) + ")");
  if (a.max_blocks > detail::kMaxSelectCandidates)
    return fail(status::unsupported, "decode selection ranks at most 4096 blocks per sequence (the cache allows " +
                                         std::to_string(a.max_blocks) + ")");
  if (std::int64_t{cfg.top_k_coarse} * cfg.slices_per_block() > detail::kMaxSelectCandidates)
    return fail(status::unsupported, "decode selection ranks at most 4096 fine candidates (top_k_coarse * C / F)");
  return status::success;
}

/// One decode step's selection for a batch: one launch, no sync, no
/// allocation (capturable in a CUDA graph with slots and lengths as inputs).
template <class Q>
[[nodiscard]] status select_decode_async(const SparseAttentionConfig& cfg, const decode_selection_arguments<Q>& a,
                                         const decode_selection_output& out, cudaStream_t stream = nullptr) {
  HISPARSE_TRY(can_implement_decode_selection(cfg, a, out));
  detail::decode_params<Q> p{a, out, cfg.window, cfg.top_k_coarse, cfg.top_k_fine};
  const int cap = block_topk<detail::kSelectThreads, detail::kSelectKeysPerThread>::sort_capacity(
      std::max(cfg.top_k_coarse, cfg.top_k_fine));
  const std::size_t smem = sizeof(topk_key) * static_cast<std::size_t>(cap);
  const dim3 grid(static_cast<unsigned>(a.kv_heads), static_cast<unsigned>(a.batch));
  switch (a.head_dim) {
    case 64: detail::decode_selection_kernel<Q, 64><<<grid, detail::kSelectThreads, smem, stream>>>(p); break;
    case 128: detail::decode_selection_kernel<Q, 128><<<grid, detail::kSelectThreads, smem, stream>>>(p); break;
    default: detail::decode_selection_kernel<Q, 256><<<grid, detail::kSelectThreads, smem, stream>>>(p); break;
  }
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

/// The selection stage as a component (DESIGN.md section 2): a policy fixes
/// the config at compile time; Arguments/can_implement/workspace_bytes/run.
template <class Policy, class Q>
struct decode_selection {
  static_assert(is_selection_policy<Policy>::value, "decode_selection takes a selection_policy");
  using arguments = decode_selection_arguments<Q>;
  static constexpr SparseAttentionConfig config = Policy::config;
  [[nodiscard]] static status can_implement(const arguments& a, const decode_selection_output& out) {
    return can_implement_decode_selection(config, a, out);
  }
  [[nodiscard]] static constexpr std::size_t workspace_bytes(const arguments&) { return 0; }
  [[nodiscard]] static status run(const arguments& a, const decode_selection_output& out,
                                  cudaStream_t stream = nullptr) {
    return select_decode_async(config, a, out, stream);
  }
};

}  // namespace hisparse::select
