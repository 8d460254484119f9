#pragma once
// Decode attention over a paged KV cache (DESIGN.md section 1, step 6), in
// two modes that share one kernel:
//  * sparse: per (sequence, KV head) the kept slices of a decode selection
//    (select/decode_selection.cuh) followed by the window [ws, length);
//  * dense: every slice [0, length) -- the in-library baseline.
// A (sequence, KV head) attends up to `max_items` slices (sparse: the
// window's, then the kept ones); `splits` CTAs share them round robin (CTA s
// takes items s, s + splits, ...: flash-decoding), and their partial
// results are merged by log-sum-exp: in a sparse run on sm_90 with at most
// 8 splits the splits are one thread-block cluster, and CTA 0 merges the
// partials the others write into its drained ring (two cluster barriers,
// no global memory); otherwise the last CTA to finish merges them through
// the workspace (a fence and a counter). Up to 8 query heads of the GQA
// group share every K/V load.
// Launched as a programmatic dependent of the selection
// (hierarchical_decode::run, sm_90), the CTAs start while the selection
// runs, attend their share of the window (which does not depend on it), and
// wait for it only before their kept slices.
//
// Inside a CTA the rows of its run stream through a ring of shared-memory
// tiles (Tile.block_kv rows of K and of V each, Tile.stages deep): cp.async
// keeps the next stages' rows in flight while the warps work on one, so a
// CTA waits on memory once, not once per slice. Each warp takes 16 rows of a
// tile on the tensor cores (mma.m16n8k16, fp32 accumulation):
//  * scores S = Q K^T with the group's heads as the 8 live rows of A;
//  * the output P V with the probabilities split into a high and a low half
//    (P = hi + lo, both bf16/fp16; hi truncated, lo >= 0 and > 0 wherever P
//    is, so an infinite value gives the infinity fp64 does) in A's two 8-row
//    halves, so the product keeps ~16 bits of each probability, not 8;
//  * an online softmax (exp2, fp32) per warp; the warps, then the CTAs, are
//    merged by log-sum-exp.
// The tiles are XOR-swizzled by 16-byte chunk so ldmatrix reads are free of
// bank conflicts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/dispatch.hpp"
#include "hisparse/core/gpu_limits.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/kernel_build.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/tile_policy.hpp"
#include "hisparse/tuning.hpp"

namespace hisparse::attention {

inline constexpr tile_policy kDecodeTile = tuning::kDecodeTile;  ///< the default decode tile (tuning.hpp)

/// One decode step's attention for a batch. Sparse when `top_k_fine` > 0:
/// the kept slices of a selection (kept_slices, num_slices) and the window
/// of `window` tokens the contract places at the end (DESIGN.md section 1:
/// from ws = floor((length - window) / F) * F, at least 0); dense otherwise.
/// A plan does not read kept_slices and num_slices: they may be null until
/// launch (the selection's buffers may not exist yet). KV: the cache's
/// element type, T or fp8 e4m3 (with bf16 queries; kv/fp8.hpp).
template <class T, class KV = T>
struct decode_attention_arguments {
  const T* queries = nullptr;           ///< [batch][num_q_heads][head_dim]
  const std::int32_t* slots = nullptr;  ///< [batch], device: cache slot of each row
  int batch = 0;
  int layer = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<KV> cache{};
  const std::int32_t* kept_slices = nullptr;  ///< [batch][kv_heads][top_k_fine], ascending, -1 padded
  const std::int32_t* num_slices = nullptr;   ///< [batch][kv_heads]
  int top_k_fine = 0;                         ///< > 0: sparse
  int window = 0;                             ///< W, tokens (sparse)
  /// Most slices one (sequence, KV head) attends; fixes the launch grid.
  /// Sparse: top_k_fine + window slices (sparse_max_items); dense: the
  /// cache's max_slices (or fewer, if every length in the batch is known to
  /// be shorter).
  std::int32_t max_items = 0;
  float softmax_scale = 0.0f;  ///< 0: 1 / sqrt(head_dim)
  T* out = nullptr;            ///< [batch][num_q_heads][head_dim]
  float* lse = nullptr;        ///< optional [batch][num_q_heads], natural log
  /// A late TopK rule (config.hpp, refresh_rule::late; sparse): each
  /// (sequence, KV head) attends the cache's current TopK entry where it is
  /// valid (made with this fingerprint, at or before the query, at most
  /// top_k_fine slices) without waiting for kept_slices, and the last of
  /// its CTAs, once the selection has finished, makes current the entry the
  /// selection marked pending (select::decode_selection_kernel).
  bool late_topk = false;
  std::int32_t topk_fingerprint = 0;

  [[nodiscard]] HISPARSE_HOST_DEVICE bool sparse() const { return top_k_fine > 0; }
};

/// Slices a sparse decode attends at most: the kept slices plus the window,
/// which holds W to W + F - 1 tokens and starts on a slice boundary.
[[nodiscard]] inline std::int32_t sparse_max_items(const SparseAttentionConfig& cfg) {
  return cfg.top_k_fine + (cfg.window + cfg.fine_slice - 1 + cfg.fine_slice - 1) / cfg.fine_slice;
}

using hisparse::gpu_limits;  // core/gpu_limits.hpp
using hisparse::current_gpu_limits;

/// Launch shape and workspace of a decode attention; `plan_decode_attention`
/// fills it on the host without touching the device's queues.
///
/// Workspace layout: [merge counters | partial outputs | partial LSEs]. The
/// counters are always there, sized for `counter_batch` (at least the batch),
/// so a workspace planned and initialized for a batch serves any smaller
/// batch planned with the same counter_batch: the counters sit at the same
/// place, zeroed once, and every run leaves them zero.
struct decode_attention_plan {
  int heads_per_cta = 0;     ///< query heads of a group one CTA serves (<= 8)
  int head_splits = 0;       ///< CTAs across one group: ceil(group / 8)
  int splits = 0;            ///< CTAs along the slices of one (sequence, KV head)
  int slices_per_split = 0;  ///< most slices one CTA takes (max_items / splits, rounded up)
  bool sparse = false;
  int stages = 0;            ///< shared-memory ring depth (<= the tile policy's stages)
  int ctas_per_sm = 0;       ///< resident CTAs per SM the grid was sized for
  int smem_bytes = 0;        ///< dynamic shared memory per CTA
  /// The splits are one thread-block cluster and merge in CTA 0's shared
  /// memory, at byte `merge_offset` of its drained ring (past the warps'
  /// merge): sparse runs on sm_90+, 2 to 8 splits, and the partials fit
  /// the ring.
  /// Otherwise (or where the loaded build is older than sm_90) the merge
  /// goes through the workspace.
  bool cluster_merge = false;
  int merge_offset = 0;
  tile_policy tile{};        ///< the tile policy planned for (a launch must use the same)
  // The arguments' shape the plan was made for (checked at launch).
  int batch = 0, num_q_heads = 0, kv_heads = 0, head_dim = 0, counter_batch = 0;
  std::int32_t max_items = 0;
  std::size_t counter_offset = 0, counter_bytes = 0, partial_offset = 0, lse_offset = 0;
  std::size_t workspace_bytes = 0;
};

namespace detail {

/// Query heads one CTA serves: the 8 rows of the MMA's A operand.
inline constexpr int kMaxHeadsPerCta = 8;
/// Most CTAs along one (sequence, KV head): the merge keeps one weight per
/// split and head in shared memory.
inline constexpr int kMaxSplits = 64;
/// Most splits merged in a cluster: the portable cluster size.
inline constexpr int kMaxClusterSplits = 8;
inline constexpr int kPageRing = tuning::kPageRing;
/// Static shared memory of the kernel (3.1 KB) plus the 1 KB the hardware
/// reserves per CTA, rounded up (planning only).
inline constexpr int kStaticSmem = 5 * 1024;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

/// Rows of a tile each warp takes: one m16n8k16 k-step of P V.
inline constexpr int kWarpRows = 16;

/// CTAs per SM the kernel is compiled for: its register budget in warps
/// (tuning.hpp) over its warps.
HISPARSE_HOST_DEVICE constexpr int register_ctas_per_sm(int head_dim, int warps) {
  const int warps_per_sm = tuning::attention_warps_per_sm(head_dim);
  return warps_per_sm / warps > 0 ? warps_per_sm / warps : 1;
}
/// Bytes of one ring stage: a tile of K and one of V; for fp8 pages
/// (one-byte elements) also their rows' scales.
HISPARSE_HOST_DEVICE constexpr int stage_bytes(int rows, int head_dim, int elem_bytes) {
  return 2 * rows * head_dim * elem_bytes + (elem_bytes == 1 ? 2 * rows * 4 : 0);
}
/// FP8 pages: the warps widen their rows of a stage into a bf16/fp16 stage
/// after the ring (the tensor cores' operands); none otherwise.
HISPARSE_HOST_DEVICE constexpr int staging_bytes(int rows, int head_dim, int kv_bytes, int q_bytes) {
  return kv_bytes == 1 ? 2 * rows * head_dim * q_bytes : 0;
}
/// Shared memory of the tiles: the ring and the staging stage.
HISPARSE_HOST_DEVICE constexpr int tile_smem_bytes(int stages, int rows, int head_dim, int kv_bytes, int q_bytes) {
  return stages * stage_bytes(rows, head_dim, kv_bytes) + staging_bytes(rows, head_dim, kv_bytes, q_bytes);
}
/// Bytes the merge of the warps needs (it reuses the ring): per warp and
/// head the running max and sum, and the output row (padded by 8 floats).
HISPARSE_HOST_DEVICE constexpr int warp_merge_bytes(int warps, int head_dim) {
  return warps * kMaxHeadsPerCta * (2 + head_dim + 8) * 4;
}
/// Where a cluster merge's partials start in CTA 0's ring: past the warps'
/// merge, which runs while the other CTAs write them.
HISPARSE_HOST_DEVICE constexpr int cluster_merge_offset(int warps, int head_dim) {
  return (warp_merge_bytes(warps, head_dim) + 15) / 16 * 16;
}
/// Where they end: per head and split the output row and the LSE
/// ([heads][splits][head_dim], then [heads][splits]).
HISPARSE_HOST_DEVICE constexpr int cluster_merge_end(int warps, int heads, int splits, int head_dim) {
  return cluster_merge_offset(warps, head_dim) + heads * splits * (head_dim + 1) * 4;
}

template <class T, class KV = T>
struct decode_attention_params {
  using kv_type = KV;
  decode_attention_arguments<T, KV> a;
  int group, head_splits, splits, stages;
  int merge_offset;  ///< > 0: the splits are a cluster; CTA 0's partials at this dynamic shared-memory byte
  float scale_log2;  ///< softmax scale * log2(e)
  float* partial_out;      ///< [batch][num_q_heads][splits][head_dim]
  float* partial_lse;      ///< [batch][num_q_heads][splits], log2 domain
  unsigned* counters;      ///< [batch][kv_heads * head_splits], zero between runs
  unsigned* readers;       ///< late_topk: [batch][kv_heads], zero between runs
};

// ---- PTX wrappers (sm_80+: cp.async, ldmatrix, mma.sync; sm_90: griddepcontrol)

using ptx::cp_async_16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::cp_async_wait_at_most;
using ptx::smem_address;
using ptx::wait_for_prior_grid;  // the selection, when launched as its programmatic dependent
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_16816;
using ptx::pack2;
/// The high half of P's split: two probabilities (>= 0) truncated toward
/// zero, so its residual is never negative.
using ptx::pack2_rz;
/// Its residual, rounded, as a second pair (lo >= 0, > 0 wherever P is).
using ptx::pack2_residual;

/// Writes `value` to every output element of the CTA's `heads` heads from
/// row `q_row0` on, and `lse` to their LSEs (the early exits: nothing
/// stored, or a selection the plan cannot hold).
template <class T, int D, int Threads, class A>
__device__ __forceinline__ void fill_output(const A& a, std::int64_t q_row0, int heads,
                                            float value, float lse) {
  for (int i = threadIdx.x; i < heads * D; i += Threads) {
    a.out[(q_row0 + i / D) * D + i % D] = from_float<T>(value);
    if (a.lse != nullptr && i % D == 0) a.lse[q_row0 + i / D] = lse;
  }
}

/// One round of a warp on the ring stage at `base`: S = Q K^T over its 16
/// rows, the online softmax of head qh (= lane / 4) over them, and O = O corr
/// + P V into (m, l, o). `t` is the tile's index in the CTA's run (tiles
/// [0, wt) the window's `w_rows` rows, then the kept items' `kept_rows`);
/// this lane's first row in the tile is wrow + qc. k_lane, v_lane, k_half,
/// v_half and swz: the lane's ldmatrix addresses (the kernel's comment).
/// The scale is read from `p` here, beside its use: the compiler then orders
/// the products as the single-function kernel did.
template <class T, int D, int TileRows, class P>
__device__ __forceinline__ void attend_tile(const P& p, unsigned base, unsigned k_lane,
                                            unsigned v_lane, int k_half, int v_half, int swz,
                                            const uint2 (&q_frag)[D / 16][32], int lane, int t, int wt, int w_rows,
                                            int kept_rows, int wrow, int qc, float& m, float& l,
                                            float (&o)[D / 8][2]) {
  constexpr int kKSteps = D / 16;  // k-steps of Q K^T
  constexpr int kNTiles = D / 8;   // n-tiles of P V
  const float kNegInf = -__int_as_float(0x7f800000);
  // S = Q K^T over this warp's 16 rows: two n-tiles of 8 rows.
  float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int k = 0; k < kKSteps; ++k) {
    unsigned bk[4];
    ldmatrix_x4(base + k_lane + static_cast<unsigned>(((2 * k + k_half) ^ swz) << 4), bk);
    const uint2 q = q_frag[k][lane];
    const unsigned qa4[4] = {q.x, 0u, q.y, 0u};
    mma_16816<T>(sc[0], qa4, bk[0], bk[1], sc[0]);
    mma_16816<T>(sc[1], qa4, bk[2], bk[3], sc[1]);
  }
  // Online softmax for head qh over rows 8j + qc (+1); rows past the
  // window's or the kept items' rows are masked. The four lanes of a head
  // agree on the max.
  const bool win = t < wt;
  const int rows = win ? w_rows : kept_rows;
  const int grow = (win ? t : t - wt) * TileRows + wrow + qc;
  float s[2][2], mx = kNegInf;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[j][e] = grow + 8 * j + e < rows ? sc[j][e] * p.scale_log2 : kNegInf;
      mx = fmaxf(mx, s[j][e]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float m_use = m_new == kNegInf ? 0.0f : m_new;  // every row masked so far: all weights 0
  const float corr = exp2f(m - m_use);
  float pr[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) pr[j][e] = exp2f(s[j][e] - m_use);
  l = l * corr + (pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]);
  m = m_new;
  // O = O corr + P V: P's high half in A's rows 0-7, its rounding error in
  // rows 8-15; the two halves of each output are added.
  unsigned pa[4];
  pa[0] = pack2_rz<T>(pr[0][0], pr[0][1]);
  pa[1] = pack2_residual<T>(pr[0][0], pr[0][1], pa[0]);
  pa[2] = pack2_rz<T>(pr[1][0], pr[1][1]);
  pa[3] = pack2_residual<T>(pr[1][0], pr[1][1], pa[2]);
#pragma unroll
  for (int n2 = 0; n2 < kNTiles / 2; ++n2) {
    unsigned bv[4];
    ldmatrix_x4_trans(base + v_lane + static_cast<unsigned>(((2 * n2 + v_half) ^ swz) << 4), bv);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float d[4];
    mma_16816<T>(d, pa, bv[0], bv[1], zero);
    o[2 * n2][0] = fmaf(o[2 * n2][0], corr, d[0] + d[2]);
    o[2 * n2][1] = fmaf(o[2 * n2][1], corr, d[1] + d[3]);
    mma_16816<T>(d, pa, bv[2], bv[3], zero);
    o[2 * n2 + 1][0] = fmaf(o[2 * n2 + 1][0], corr, d[0] + d[2]);
    o[2 * n2 + 1][1] = fmaf(o[2 * n2 + 1][1], corr, d[1] + d[3]);
  }
}

/// Merges the warps' results (m, l and o of head qh, l already summed over
/// the head's four lanes) in the drained ring, per head rescaling every warp
/// to the common max, and writes this CTA's partial: the output itself when
/// it is the only CTA with items (`active` == 1), else CTA 0's ring past its
/// warp-merge area (`clustered`: [heads][splits][D] outputs, then
/// [heads][splits] LSEs) or the workspace. S: the splits.
template <class T, int D, int Warps, class P>
__device__ __forceinline__ void merge_warps(const P& p, unsigned char* ring, int split, int S,
                                            int active, int heads, std::int64_t q_row0, bool clustered, float m,
                                            float l, const float (&o)[D / 8][2]) {
  constexpr int kThreads = Warps * 32;
  constexpr int kNTiles = D / 8;
  constexpr int kHeads = kMaxHeadsPerCta;
  constexpr int kMergeStride = D + 8;  // floats per (warp, head) output row
  const float kNegInf = -__int_as_float(0x7f800000);
  const auto& a = p.a;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int qh = lane >> 2, qc = (lane & 3) * 2;
  __syncthreads();
  auto* wm = reinterpret_cast<float*>(ring);            // [Warps][kHeads]
  auto* wl = wm + Warps * kHeads;                       // [Warps][kHeads]
  auto* wo = wl + Warps * kHeads;                       // [Warps][kHeads][kMergeStride]
  if ((lane & 3) == 0) {
    wm[warp * kHeads + qh] = m;
    wl[warp * kHeads + qh] = l;
  }
#pragma unroll
  for (int n = 0; n < kNTiles; ++n)
    *reinterpret_cast<float2*>(wo + (warp * kHeads + qh) * kMergeStride + 8 * n + qc) = make_float2(o[n][0], o[n][1]);
  __syncthreads();

  const bool single = active == 1;
  float* cluster_out = nullptr;
  float* cluster_lse = nullptr;
  if (clustered && !single) {
    ptx::cluster_wait();  // every CTA of the cluster is done with its ring
    cluster_out = ptx::cluster_map(reinterpret_cast<float*>(ring + p.merge_offset), 0u);
    cluster_lse = cluster_out + min(kHeads, p.group) * S * D;
  }
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float mx = kNegInf;
    for (int w = 0; w < Warps; ++w) mx = fmaxf(mx, wm[w * kHeads + g]);
    float sum = 0.0f, out = 0.0f;
    for (int w = 0; w < Warps; ++w) {
      const float mw = wm[w * kHeads + g];
      const float f = mw == kNegInf ? 0.0f : exp2f(mw - mx);
      sum += wl[w * kHeads + g] * f;
      out += wo[(w * kHeads + g) * kMergeStride + d] * f;
    }
    const float lse2 = mx + log2f(sum);
    const std::int64_t row = q_row0 + g;
    if (single) {
      a.out[row * D + d] = from_float<T>(out / sum);
      if (a.lse != nullptr && d == 0) a.lse[row] = lse2 * kLn2;
    } else if (clustered) {
      cluster_out[(g * S + split) * D + d] = out / sum;
      if (d == 0) cluster_lse[g * S + split] = lse2;
    } else {
      p.partial_out[(row * p.splits + split) * D + d] = out / sum;
      if (d == 0) p.partial_lse[row * p.splits + split] = lse2;
    }
  }
}

/// Flash-decoding merge of the `active` CTAs' partials (merge_warps wrote
/// them) into the output and LSE. Clustered: the partials are in CTA 0's
/// shared memory once every CTA with items has arrived a second time; the
/// others leave (nobody reads their shared memory). Otherwise by the last
/// CTA of this (sequence, KV head, head split) to finish: publish the
/// partials, count arrivals, and the last one stages every run and resets
/// the counter for the next run. merge_w, merge_lse and last_cta: the
/// kernel's shared scratch; b: the batch row; stages: the ring's depth.
template <class T, int D, int Warps, class P>
__device__ __forceinline__ void merge_splits(const P& p, unsigned char* ring,
                                             unsigned ring_base, float (&merge_w)[kMaxHeadsPerCta][kMaxSplits],
                                             float (&merge_lse)[kMaxHeadsPerCta], bool& last_cta, int b, int split,
                                             int S, int stages, int active, int heads, std::int64_t q_row0,
                                             bool clustered) {
  constexpr int kThreads = Warps * 32;
  constexpr int kTileBytes = Warps * kWarpRows * D * static_cast<int>(sizeof(T));
  constexpr int kHeads = kMaxHeadsPerCta;
  const float kNegInf = -__int_as_float(0x7f800000);
  const auto& a = p.a;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  static_assert(2 * kTileBytes >= kHeads * D * 4, "one split's partials fit a ring stage");
  const float* staged;  // [heads][per_round][D]
  int per_round;
  unsigned* counter = nullptr;
  auto stage_round = [&](int sp0) {  // the workspace path: splits [sp0, sp0 + per_round) into the ring
    const int n = min(per_round, active - sp0);
    for (int c4 = threadIdx.x; c4 < heads * n * (D / 4); c4 += kThreads) {  // 16-byte chunks
      const int g = c4 / (n * (D / 4)), r = c4 % (n * (D / 4));
      cp_async_16(ring_base + static_cast<unsigned>(((g * per_round) * D + r * 4) * 4),
                  p.partial_out + ((q_row0 + g) * p.splits + sp0) * D + r * 4, 16);
    }
    cp_async_commit();
  };
  if (clustered) {
    ptx::cluster_arrive();  // releases this CTA's partial
    if (split != 0) return;
    ptx::cluster_wait();
    staged = reinterpret_cast<const float*>(ring + p.merge_offset);
    per_round = S;
    for (int i = threadIdx.x; i < heads * active; i += kThreads)
      merge_w[i / active][i % active] = staged[min(kHeads, p.group) * S * D + (i / active) * S + i % active];
  } else {
    __threadfence();
    __syncthreads();
    counter = p.counters + std::int64_t{b} * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) {
      const unsigned done = atomicAdd(counter, 1u);
      last_cta = done + 1 == static_cast<unsigned>(active);
    }
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    // The partials go through the drained ring by cp.async, `per_round`
    // splits at a time (all of them at B >= 8), beside the weights' loads:
    // one trip to L2 for everything, with nothing held in registers. A
    // head's partials are contiguous: [splits][D].
    per_round = tile_smem_bytes(stages, Warps * kWarpRows, D, sizeof(typename P::kv_type), sizeof(T)) / (heads * D * 4);
    staged = reinterpret_cast<const float*>(ring);
    stage_round(0);
    for (int i = threadIdx.x; i < heads * active; i += kThreads)
      merge_w[i / active][i % active] = __ldcg(p.partial_lse + (q_row0 + i / active) * p.splits + i % active);
  }
  __syncthreads();
  // Warp g % Warps weighs head g: two splits a lane (kMaxSplits = 64), the
  // max and the sum by shuffles.
  static_assert(kMaxSplits <= 64, "two splits per lane");
  for (int g = warp; g < heads; g += Warps) {
    const bool has0 = lane < active, has1 = lane + 32 < active;
    const float x0 = has0 ? merge_w[g][lane] : kNegInf, x1 = has1 ? merge_w[g][lane + 32] : kNegInf;
    float mx = fmaxf(x0, x1);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
    const float e0 = has0 ? exp2f(x0 - mx) : 0.0f, e1 = has1 ? exp2f(x1 - mx) : 0.0f;
    float sum = e0 + e1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    if (has0) merge_w[g][lane] = e0 / sum;
    if (has1) merge_w[g][lane + 32] = e1 / sum;
    if (lane == 0) merge_lse[g] = mx + log2f(sum);
  }
  // out = sum over the splits in order of weight x partial (fmaf).
  constexpr int kPerThread = (kHeads * D + kThreads - 1) / kThreads;
  float acc[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) acc[j] = 0.0f;
  for (int sp0 = 0; sp0 < active; sp0 += per_round) {
    if (sp0 > 0) {
      __syncthreads();  // the last round is read
      stage_round(sp0);
    }
    cp_async_wait<0>();
    __syncthreads();  // the round (and, first time, the weights) for every thread
    const int n = min(per_round, active - sp0);
    // kPerThread independent chains per split, without a branch between
    // them (a guarded element makes each wait for its own loads; PERF_NOTES:
    // Decode attention); elements past the heads read the last head and are
    // not stored.
    for (int u = 0; u < n; ++u)
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int i = static_cast<int>(threadIdx.x) + j * kThreads;
        const int g = min(i / D, heads - 1), d = i % D;
        acc[j] = fmaf(merge_w[g][sp0 + u], staged[(g * per_round + u) * D + d], acc[j]);
      }
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads;
    if (i < heads * D) {
      const int g = i / D, d = i % D;
      const std::int64_t row = q_row0 + g;
      a.out[row * D + d] = from_float<T>(acc[j]);
      if (a.lse != nullptr && d == 0) a.lse[row] = merge_lse[g] * kLn2;
    }
  }
  if (counter != nullptr && threadIdx.x == 0) *counter = 0;
}

/// FP8 pages: widens this warp's 16 rows of the ring stage at `stage` (K
/// and V codes, then their rows' scales) into the operand stage `op`, as T
/// in the XOR-swizzled layout attend_tile reads, each row times its scale
/// (exact: kv/fp8.hpp). Only the warp's own rows: no CTA barrier.
template <class T, int D, int TileRows>
__device__ __forceinline__ void widen_fp8_rows(const unsigned char* stage, unsigned char* op, int wrow, int lane) {
  constexpr int kChunks = D / 16;  // 16 codes a chunk
  constexpr int kPerLane = kWarpRows * kChunks / 32;
  constexpr int kOpRowBytes = D * static_cast<int>(sizeof(T));
  const auto* scales = reinterpret_cast<const float*>(stage + 2 * TileRows * D);
  __syncwarp();  // the warp's reads of its previous rows are done
#pragma unroll
  for (int kv = 0; kv < 2; ++kv)
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j, r = wrow + i / kChunks, c = i % kChunks;
      const uint4 codes = *reinterpret_cast<const uint4*>(stage + (kv * TileRows + r) * D + c * 16);
      const float sc = scales[kv * TileRows + r];
      __nv_fp8x2_storage_t pairs[8];
      std::memcpy(pairs, &codes, 16);
      unsigned w[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3)));
        w[e] = pack2<T>(f.x * sc, f.y * sc);
      }
      unsigned char* row = op + kv * TileRows * kOpRowBytes + r * kOpRowBytes;
      *reinterpret_cast<uint4*>(row + (((2 * c) ^ (r & 7)) << 4)) = make_uint4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<uint4*>(row + (((2 * c + 1) ^ (r & 7)) << 4)) = make_uint4(w[4], w[5], w[6], w[7]);
    }
  __syncwarp();
}

/// Grid: x = split, y = KV head * head_splits + head split, z = batch row.
/// Dynamic shared memory: the ring, `stages` x (K tile | V tile), each tile
/// kTileRows x D elements, 16-byte chunk c of row r stored at c ^ (r & 7).
/// FP8 pages: a stage's tiles hold codes (unswizzled; the warps read them
/// row by row) and then the rows' K and V scales, and one operand stage of
/// T follows the ring (widen_fp8_rows).
template <class T, class KV, int D, int Warps, int MaxStages>
__global__ void __launch_bounds__(Warps * 32, register_ctas_per_sm(D, Warps))
    decode_attention_kernel(const __grid_constant__ decode_attention_params<T, KV> p) {
  constexpr bool kFp8 = kv::is_fp8_v<KV>;
  constexpr int kThreads = Warps * 32;
  constexpr int kTileRows = Warps * kWarpRows;
  constexpr int kVec = 16 / static_cast<int>(sizeof(KV));  // elements per 16-byte chunk
  constexpr int kChunks = D / kVec;                         // chunks per row
  constexpr int kRowBytes = D * static_cast<int>(sizeof(KV));
  constexpr int kTileBytes = kTileRows * kRowBytes;
  constexpr int kStageBytes = stage_bytes(kTileRows, D, static_cast<int>(sizeof(KV)));
  // The tensor cores' operand tiles: the ring's, or the fp8 staging's.
  constexpr int kOpRowBytes = D * static_cast<int>(sizeof(T));
  constexpr int kOpTileBytes = kTileRows * kOpRowBytes;
  constexpr int kRowsPerPass = kThreads / kChunks;  // rows one pass of the CTA copies
  constexpr int kPasses = kTileRows / kRowsPerPass;
  constexpr int kKSteps = D / 16;   // k-steps of Q K^T
  constexpr int kNTiles = D / 8;    // n-tiles of P V
  constexpr int kHeads = kMaxHeadsPerCta;
  static_assert(!kFp8 || std::is_same_v<T, __nv_bfloat16>, "fp8 pages take bf16 queries");
  static_assert((kFp8 || kChunks >= 8) && kThreads % kChunks == 0 && kTileRows % kRowsPerPass == 0,
                "a row is at least 8 chunks (the swizzle) and a pass covers whole rows");
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ const KV* pages[kPageRing];
  // Q's A fragments while the tiles stream (read from shared memory at
  // every k-step, not held in registers: the kernel must stay under 192
  // registers to start beside the selection's CTAs), the merge's weights
  // after.
  union q_or_weights {
    uint2 q[kKSteps][32];
    float w[kHeads][kMaxSplits];
  };
  __shared__ q_or_weights scratch;
  auto& merge_w = scratch.w;
  __shared__ float merge_lse[kHeads];
  __shared__ bool last_cta;
  __shared__ bool last_reader;

  // The splits of a (sequence, KV head) are one cluster (see the merge).
  const bool clustered = p.merge_offset > 0;

  const auto& a = p.a;
  const auto& c = a.cache;
  const int split = blockIdx.x, b = blockIdx.z;
  const int h = static_cast<int>(blockIdx.y) / p.head_splits, hs = static_cast<int>(blockIdx.y) % p.head_splits;
  const int g0 = hs * kHeads, heads = min(kHeads, p.group - g0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int qh = lane >> 2, qc = (lane & 3) * 2;  // the MMA row (head) and column pair of this lane
  const std::int64_t q_row0 = std::int64_t{b} * a.num_q_heads + std::int64_t{h} * p.group + g0;

  // Inputs the step's producer (the selection) does not write: read them
  // before waiting on it.
  const int seq = a.slots[b];
  const std::int64_t seq_layer = c.seq_layer(seq, a.layer);
  const std::int32_t len = c.lengths[seq_layer];
  // Q as the A operand of S = Q K^T: lane holds head qh, dims 16k + qc (+1)
  // and 16k + 8 + qc (+1) (rows 8-15 of A are zero); warp w stores the
  // k-steps w, w + Warps, ... for every warp. Read after the first barrier.
  {
    const bool live = qh < heads;
    const auto* qrow = reinterpret_cast<const unsigned*>(a.queries + (q_row0 + (live ? qh : 0)) * D);
    for (int k = warp; k < kKSteps; k += Warps)
      scratch.q[k][lane] = live ? make_uint2(qrow[(16 * k + qc) / 2], qrow[(16 * k + 8 + qc) / 2]) : make_uint2(0u, 0u);
  }
  const int F = c.fine_slice;
  const std::int64_t at = std::int64_t{b} * c.kv_heads + h;
  const std::int32_t end_slice = (len + F - 1) / F;
  // Sparse: ws / F, the query sitting at len - 1; dense: every slice.
  const std::int32_t first_window = a.sparse() ? contract::window_first_slice(len - 1, a.window, F) : 0;
  const int window_items = end_slice - first_window;  // dense: every slice

  // The items of a (sequence, KV head) are its window's slices, then (sparse)
  // its kept ones; CTA `split` takes items split, split + S, split + 2S, ...
  // (S = p.splits), so every CTA holds a share of the window. The window
  // does not depend on the selection: a CTA streams and attends its window
  // slices before it waits for the selection (griddepcontrol.wait), while
  // the selection drains, and only its kept slices after. Its rows are its
  // window items' rows, then its kept items' rows from the next tile on.
  // Only the sequence's last slice (the window's last item) can be partial.
  const int S = p.splits;
  const int cw = window_items > split ? (window_items - split + S - 1) / S : 0;  // window items of this CTA
  const bool owns_last = cw > 0 && split + (cw - 1) * S == window_items - 1;
  const int w_rows = cw * F - (owns_last ? end_slice * F - len : 0);
  // Window tiles (none when the window alone exceeds max_items: NaN below).
  const int wt = window_items > a.max_items ? 0 : (w_rows + kTileRows - 1) / kTileRows;
  const std::int32_t* kept = a.sparse() ? a.kept_slices + at * a.top_k_fine : nullptr;
  // What the selection decides, known once waited for (dense: now).
  int items = window_items, ck = 0, tiles = wt;
  bool known = !a.sparse(), waited = false;
  // A late TopK rule: the control words of this (sequence, KV head)'s
  // entries, and which is current (the selection writes the other).
  std::int32_t* const topk_control = a.late_topk && a.sparse() ? c.topk_entry(seq_layer, h) : nullptr;
  const int topk_current = topk_control != nullptr ? topk_control[0] & 1 : 0;

  if (len <= 0) {  // nothing stored: a zero output, lse -inf
    if (a.sparse()) wait_for_prior_grid();  // every CTA of a programmatic launch waits before it ends
    if (split == 0) fill_output<T, D, kThreads>(a, q_row0, heads, 0.0f, kNegInf);
    return;
  }

  const int f_shift = (F & (F - 1)) == 0 ? __ffs(F) - 1 : -1;
  const std::int64_t head_tile = std::int64_t{F} * D;
  const std::int64_t v_offset = std::int64_t{c.kv_heads} * head_tile;
  const unsigned ring_base = smem_address(ring);
  const int stages = p.stages;

  // The page ring holds the pages of this CTA's items [page_base, page_end).
  int page_base = 0, page_end = 0;
  auto slice_of = [&](int r) {  // slice of this CTA's item r (r >= cw: kept, the selection is known)
    const int pos = split + r * S;
    return pos < window_items ? first_window + pos : kept[pos - window_items];
  };
  auto fill_pages = [&](int first, int known_items) {  // uniform across the CTA
    __syncthreads();  // nobody still reads the old pointers
    page_base = first;
    page_end = min(known_items, first + kPageRing);
    for (int i = threadIdx.x; i < page_end - page_base; i += kThreads)
      pages[i] = c.page(seq_layer, slice_of(page_base + i));
    __syncthreads();
  };
  // Waits for the selection, then learns this CTA's kept items and their
  // pages. The list's entries are loaded beside num_slices (the list holds
  // top_k_fine entries, -1 past the kept count), so the chain to the first
  // kept K/V is wait -> list -> page table. Uniform across the CTA.
  auto learn_selection = [&]() {
    int n_kept = 0;
    bool from_entry = false;
    if (topk_control != nullptr) {  // a valid current entry: its slices, no wait
      const std::int32_t* e = c.topk.entry(topk_control, topk_current);
      const std::int32_t made = e[0], n = e[1];
      from_entry = made >= 0 && made < len && e[2] == a.topk_fingerprint && n >= 0 && n <= a.top_k_fine;
      if (from_entry) {
        kept = e + kv::topk_cache_ref::kept_offset();
        n_kept = n;
      }
    }
    if (!from_entry) {
      wait_for_prior_grid();
      waited = true;
      n_kept = a.num_slices[at];
    }
    constexpr int kPagesPerThread = (kPageRing + kThreads - 1) / kThreads;
    std::int32_t first_kept[kPagesPerThread];
#pragma unroll
    for (int m = 0; m < kPagesPerThread; ++m) {
      const int e = split + (cw + static_cast<int>(threadIdx.x) + m * kThreads) * S - window_items;
      first_kept[m] = e < a.top_k_fine ? kept[e] : -1;
    }
    items = window_items + n_kept;
    const bool valid = n_kept >= 0 && n_kept <= a.top_k_fine && items <= a.max_items;  // else NaN, below
    ck = valid ? (items > split ? (items - split + S - 1) / S : 0) - cw : 0;
    tiles = wt + (ck * F + kTileRows - 1) / kTileRows;
    known = true;
    __syncthreads();  // nobody still reads the window's pointers
    page_base = cw;
    page_end = cw + min(ck, kPageRing);
#pragma unroll
    for (int m = 0; m < kPagesPerThread; ++m) {
      const int i = static_cast<int>(threadIdx.x) + m * kThreads;
      if (i < page_end - page_base) pages[i] = c.page(seq_layer, first_kept[m]);
    }
    __syncthreads();
  };
  if (cw > 0) fill_pages(0, cw);

  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  // Issues tile t's copies into ring stage `stage`: this thread's chunk of
  // kPasses rows of K and of V; rows past the window's or the kept items'
  // rows are zero-filled.
  auto issue = [&](int t, int stage) {
    const bool win = t < wt;
    const int row0 = (win ? t : t - wt) * kTileRows, rows = win ? w_rows : ck * F, r0 = win ? 0 : cw;
    const int first = r0 + row0 / F, last = r0 + (min(rows, row0 + kTileRows) - 1) / F;  // items of the CTA
    if (first < page_base || last >= page_end) fill_pages(first, cw + ck);  // uniform across the CTA
    const unsigned kdst = ring_base + static_cast<unsigned>(stage * kStageBytes);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = row_in_pass + pass * kRowsPerPass;
      const int g = row0 + r;
      const unsigned off = static_cast<unsigned>(r * kRowBytes + ((kFp8 ? chunk : chunk ^ (r & 7)) << 4));
      if (g < rows) {
        const int item = f_shift >= 0 ? g >> f_shift : g / F;
        const int rr = g - item * F;
        const KV* src = pages[r0 + item - page_base] + h * head_tile + std::int64_t{rr} * D + chunk * kVec;
        cp_async_16(kdst + off, src, 16);
        cp_async_16(kdst + kTileBytes + off, src + v_offset, 16);
      } else {
        cp_async_16(kdst + off, a.queries, 0);
        cp_async_16(kdst + kTileBytes + off, a.queries, 0);
      }
    }
    if constexpr (kFp8) {  // the rows' K and V scales; zero past the rows
      for (int i = threadIdx.x; i < 2 * kTileRows; i += kThreads) {
        const int r = i % kTileRows, g = row0 + r;
        const unsigned dst = kdst + static_cast<unsigned>(2 * kTileBytes + i * 4);
        if (g < rows) {
          const int item = f_shift >= 0 ? g >> f_shift : g / F;
          const float* sc = c.key_scales(pages[r0 + item - page_base], h) + (g - item * F) +
                            (i >= kTileRows ? c.value_scale_offset() : 0);
          ptx::cp_async_4(dst, sc, 4);
        } else {
          ptx::cp_async_4(dst, a.queries, 0);
        }
      }
    }
  };

  float m = kNegInf, l = 0.0f;  // running max (log2 domain) and this lane's part of the sum, head qh
  float o[kNTiles][2];          // head qh, dims 8n + qc (+1)
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) o[n][0] = o[n][1] = 0.0f;
  // ldmatrix addresses: K (non-transposed) lane row = warp row + 8 (lane / 16) + lane % 8,
  // chunk half (lane / 8) % 2; V (transposed) row = warp row + 8 ((lane / 8) % 2) + lane % 8,
  // chunk half lane / 16. Every row's swizzle is lane & 7.
  const int wrow = warp * kWarpRows;
  const unsigned k_lane = static_cast<unsigned>((wrow + ((lane >> 4) << 3) + (lane & 7)) * kOpRowBytes);
  const unsigned v_lane =
      static_cast<unsigned>(kOpTileBytes + (wrow + (((lane >> 3) & 1) << 3) + (lane & 7)) * kOpRowBytes);
  const int k_half = (lane >> 3) & 1, v_half = lane >> 4, swz = lane & 7;

  // Tile t is issued stages - 1 tiles ahead of its use (the first
  // stages - 1 rounds only issue); the first kept tile (wt) waits for the
  // selection before it is issued. One round: tile t is in (and the stage
  // of tile t - 1 free) for every thread, issue tile t + stages - 1 into
  // that stage, attend tile t.
  for (int t = 1 - stages;; ++t) {
    if (t >= 0) {
      if (stages >= 2) cp_async_wait_at_most<MaxStages>(stages - 2);
      __syncthreads();
    }
    const int next = t + stages - 1;
    if (next >= wt && !known) learn_selection();
    if (t >= tiles) break;
    if (next < tiles) issue(next, next % stages);
    cp_async_commit();
    if (t < 0) continue;
    if (stages == 1) {  // the single stage: wait for the tile just issued
      cp_async_wait<0>();
      __syncthreads();
    }
    const int stage = t % stages;
    unsigned operands = ring_base + static_cast<unsigned>(stage * kStageBytes);
    if constexpr (kFp8) {
      widen_fp8_rows<T, D, kTileRows>(ring + stage * kStageBytes, ring + stages * kStageBytes, wrow, lane);
      operands = ring_base + static_cast<unsigned>(stages * kStageBytes);
    }
    attend_tile<T, D, kTileRows>(p, operands, k_lane, v_lane, k_half, v_half, swz, scratch.q, lane, t, wt, w_rows,
                                 ck * F, wrow, qc, m, l, o);
  }
  l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
  l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
  cp_async_wait<0>();
  // A late TopK rule: every CTA of this (sequence, KV head) has read the
  // current entry; the last one, once the selection has finished (it reads
  // the current entry too), makes the pending one current and leaves the
  // counter zero for the next run.
  if (topk_control != nullptr) {  // uniform
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      last_reader = atomicAdd(p.readers + at, 1u) + 1 == gridDim.x * static_cast<unsigned>(p.head_splits);
    }
    __syncthreads();
    if (last_reader) {
      if (!waited) wait_for_prior_grid();
      if (threadIdx.x == 0) {
        if (__ldcg(topk_control + 1) == 1) {
          topk_control[1] = 0;
          topk_control[0] = topk_current ^ 1;
        }
        p.readers[at] = 0;
      }
    }
  }
  // More slices than the plan's max_items (or a kept count the selection
  // cannot have written): NaN output and LSE, never a silent drop.
  if (items > a.max_items || items < window_items || items > window_items + a.top_k_fine) {
    const float nan = __int_as_float(0x7fffffff);
    if (split == 0) fill_output<T, D, kThreads>(a, q_row0, heads, nan, nan);
    return;
  }
  const int active = min(S, items);  // CTAs with at least one item
  if (split >= active) return;
  // Clustered: this CTA no longer reads its ring (CTA 0's: the others may
  // write their partials past its warp-merge area once everyone has
  // arrived; CTAs without items have left, and the barrier does not wait
  // for exited threads). The wait is after the warp merge.
  if (clustered) ptx::cluster_arrive();

  merge_warps<T, D, Warps>(p, ring, split, S, active, heads, q_row0, clustered, m, l, o);
  if (active == 1) return;  // the output is written
  merge_splits<T, D, Warps>(p, ring, ring_base, merge_w, merge_lse, last_cta, b, split, S, stages, active, heads,
                            q_row0, clustered);
}

/// Whether this device runs a build of the kernel compiled for sm_90+: one
/// that honours griddepcontrol.wait (a programmatic launch of an older
/// build would read the selection before it is written) and has the cluster
/// merge.
template <class T, class KV, int D, tile_policy Tile>
bool runs_sm90_build() {
  static hisparse::detail::per_device_flag built;
  return built.get([] {
    void (*kernel)(decode_attention_params<T, KV>) = &decode_attention_kernel<T, KV, D, Tile.warps, Tile.stages>;
    return hisparse::detail::kernel_built_for_sm90(reinterpret_cast<const void*>(kernel));
  });
}

template <class T, class KV, int D, tile_policy Tile>
status launch_decode_attention(decode_attention_params<T, KV> p, int smem_bytes, bool overlap_previous,
                               cudaStream_t stream) {
  constexpr auto kernel = &decode_attention_kernel<T, KV, D, Tile.warps, Tile.stages>;
  HISPARSE_TRY(hisparse::detail::raise_dynamic_smem<kernel>(smem_bytes));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.a.cache.kv_heads * p.head_splits),
                        static_cast<unsigned>(p.a.batch));
  config.blockDim = dim3(static_cast<unsigned>(Tile.threads()));
  config.dynamicSmemBytes = static_cast<std::size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  // Only a sparse run waits (griddepcontrol.wait) before reading what the
  // previous kernel wrote; a dense one is never launched programmatically.
  // Programmatic edges in captured graphs came with CUDA 12.3: older
  // toolkits launch in plain stream order.
  constexpr bool kToolkitOverlaps = CUDART_VERSION >= 12030;
  const bool sm90 = runs_sm90_build<T, KV, D, Tile>();
  if (kToolkitOverlaps && overlap_previous && p.a.sparse() && sm90) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  // The cluster merge needs the sm_90 build; an older one merges through
  // the workspace, which the plan always holds.
  if (p.merge_offset > 0 && !sm90) p.merge_offset = 0;
  if (p.merge_offset > 0) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = static_cast<unsigned>(p.splits);
    attribute[n].val.clusterDim.y = 1;
    attribute[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = n > 0 ? attribute : nullptr;
  config.numAttrs = n;
  HISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, p));
  return status::success;
}

}  // namespace detail

/// Checks the arguments before any work; names what is wrong.
template <class T, class KV>
[[nodiscard]] status can_implement_decode_attention(const decode_attention_arguments<T, KV>& a) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "decode attention takes bf16 or fp16 queries");
  static_assert(std::is_same_v<KV, T> || (kv::is_fp8_v<KV> && std::is_same_v<T, __nv_bfloat16>),
                "decode attention reads KV of the queries' type, or fp8 e4m3 pages with bf16 queries");
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "decode attention: " + why); };
  const auto& c = a.cache;
  HISPARSE_TRY(check(attention_shape{a.num_q_heads, c.kv_heads, c.head_dim}));
  if (a.batch < 1) return bad("batch is empty");
  if (a.queries == nullptr || a.slots == nullptr || a.out == nullptr) return bad("queries, slots and out must be set");
  if (c.page_table == nullptr || c.lengths == nullptr) return bad("the cache view is empty");
  if (a.layer < 0 || a.layer >= c.layers) return bad("layer out of range");
  if (c.fine_slice < 1) return bad("the cache's fine_slice must be >= 1");
  if (a.sparse() && a.window < 1) return bad("a sparse run needs the window (tokens, >= 1)");
  auto aligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(a.queries) || !aligned(a.out)) return bad("queries and out must be 16-byte aligned");
  if (a.max_items < 1 || a.max_items > c.max_slices)
    return bad("max_items " + std::to_string(a.max_items) + " must be in [1, the cache's max_slices " +
               std::to_string(c.max_slices) + "]");
  if (!(a.softmax_scale >= 0.0f) || std::isinf(a.softmax_scale)) return bad("softmax_scale must be finite and >= 0");
  if (a.late_topk && (!a.sparse() || c.topk.entries == nullptr || c.topk.slices < a.top_k_fine))
    return bad("late_topk needs a sparse run over a cache whose TopK entries hold top_k_fine slices");
  return status::success;
}

/// Launch shape for `a` with tile policy `Tile` on a GPU described by
/// `gpu`: as many CTAs as fit on it at once (one wave; shared memory and
/// registers decide how many per SM) less `reserved_ctas` slots, never fewer
/// than one slice per CTA, at most 64 splits. `counter_batch` (default:
/// a.batch) sizes the merge counters for the largest batch the workspace
/// will serve. `reserved_ctas`: slots of the wave another kernel holds while
/// this one starts (the selection's CTAs that outlive the rest of it, when
/// the attention is its programmatic dependent); a CTA that finds no slot
/// starts late and finishes late, and the merge waits for it.
template <tile_policy Tile = kDecodeTile, class T, class KV>
[[nodiscard]] status plan_decode_attention(const decode_attention_arguments<T, KV>& a, const gpu_limits& gpu,
                                           decode_attention_plan& plan, int counter_batch = 0,
                                           int reserved_ctas = 0) {
  static_assert(valid_decode_tile_v<Tile>);
  HISPARSE_TRY(can_implement_decode_attention(a));
  const int group = a.num_q_heads / a.cache.kv_heads;
  plan.heads_per_cta = std::min(group, detail::kMaxHeadsPerCta);
  plan.head_splits = (group + detail::kMaxHeadsPerCta - 1) / detail::kMaxHeadsPerCta;
  // The ring: as many of the policy's stages as one CTA's shared memory holds.
  const int tile_rows = Tile.warps * detail::kWarpRows, kv_bytes = static_cast<int>(sizeof(KV));
  const int stage = detail::stage_bytes(tile_rows, a.cache.head_dim, kv_bytes);
  const int staging = detail::staging_bytes(tile_rows, a.cache.head_dim, kv_bytes, static_cast<int>(sizeof(T)));
  const int room = gpu.smem_per_block - detail::kStaticSmem - staging;
  plan.tile = Tile;
  plan.stages = std::min(Tile.stages, room / stage);
  if (plan.stages < 1)
    return fail(status::unsupported, "decode attention: one stage of " + std::to_string(stage) +
                                         " bytes does not fit the GPU's " + std::to_string(gpu.smem_per_block) +
                                         " bytes of shared memory per CTA (use fewer warps per tile)");
  const int tiles_bytes = plan.stages * stage + staging;  // the merges reuse all of it
  plan.smem_bytes = std::max(tiles_bytes, detail::warp_merge_bytes(Tile.warps, a.cache.head_dim));
  plan.ctas_per_sm = std::max(1, std::min(detail::register_ctas_per_sm(a.cache.head_dim, Tile.warps),
                                          gpu.smem_per_sm / (plan.smem_bytes + detail::kStaticSmem)));
  // As many splits as fill one wave, not more: a second, partial wave costs
  // a whole CTA lifetime (PERF_NOTES: Decode attention).
  plan.sparse = a.sparse();
  const std::int64_t per_split = std::int64_t{a.batch} * a.cache.kv_heads * plan.head_splits;
  const std::int64_t slots = std::int64_t{plan.ctas_per_sm} * std::max(gpu.sms, 1) - std::max(reserved_ctas, 0);
  const std::int64_t want = std::max<std::int64_t>(1, slots / per_split);
  std::int64_t splits_wanted = std::min<std::int64_t>(want, detail::kMaxSplits);
  // A sparse run has few items per (sequence, KV head) (25 by default), and
  // merging more than a cluster's 8 splits through the workspace costs more
  // than the extra CTAs gain (PERF_NOTES: Decode attention). A dense run
  // streams thousands of slices and keeps every CTA it can fill.
  const auto cluster_fits = [&](std::int64_t splits) {
    return a.sparse() && gpu.cc_major >= 9 && splits >= 2 && splits <= detail::kMaxClusterSplits &&
           detail::cluster_merge_end(Tile.warps, plan.heads_per_cta, static_cast<int>(splits), a.cache.head_dim) <=
               tiles_bytes;
  };
  if (a.sparse() && splits_wanted > detail::kMaxClusterSplits && cluster_fits(detail::kMaxClusterSplits))
    splits_wanted = detail::kMaxClusterSplits;
  plan.slices_per_split = static_cast<int>(std::max<std::int64_t>(1, (a.max_items + splits_wanted - 1) / splits_wanted));
  plan.splits = (a.max_items + plan.slices_per_split - 1) / plan.slices_per_split;
  // A sparse run's splits merge as a cluster where the partials fit in the
  // ring past the warps' merge (not in shared memory of their own: more per
  // CTA, fewer attention CTAs beside the selection's). A dense run does not
  // cluster: its grid fills the wave, and clusters that must share a GPC do
  // not all fit at once, for a merge of microseconds in milliseconds
  // (PERF_NOTES: Decode attention).
  plan.cluster_merge = cluster_fits(plan.splits);
  plan.merge_offset = plan.cluster_merge ? detail::cluster_merge_offset(Tile.warps, a.cache.head_dim) : 0;
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
  // The merge's counters, then a late TopK rule's reader counters.
  plan.counter_bytes = align(static_cast<std::size_t>(plan.counter_batch) * a.cache.kv_heads * (plan.head_splits + 1) *
                             sizeof(unsigned));
  plan.partial_offset = plan.counter_bytes;
  plan.lse_offset = plan.partial_offset;
  plan.workspace_bytes = plan.counter_bytes;
  if (plan.splits > 1) {
    plan.lse_offset = plan.partial_offset + align(rows * plan.splits * a.cache.head_dim * sizeof(float));
    plan.workspace_bytes = plan.lse_offset + align(rows * plan.splits * sizeof(float));
  }
  return status::success;
}

/// The same for an sm_90-class GPU with `num_sms` multiprocessors (host-side
/// planning without a device; runtime code passes current_gpu_limits).
template <tile_policy Tile = kDecodeTile, class T, class KV>
[[nodiscard]] status plan_decode_attention(const decode_attention_arguments<T, KV>& a, int num_sms,
                                           decode_attention_plan& plan, int counter_batch = 0,
                                           int reserved_ctas = 0) {
  gpu_limits gpu;
  gpu.sms = num_sms;
  return plan_decode_attention<Tile>(a, gpu, plan, counter_batch, reserved_ctas);
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
/// share a workspace must be stream-ordered. The plan must come from
/// plan_decode_attention with the same Tile.
///
/// `overlap_previous`: on sm_90, launch as a programmatic dependent of the
/// kernel launched just before on `stream`, so this one's CTAs start (and
/// read queries, slots and lengths) while that one drains, and wait for it
/// only before reading the selection. Pass true only when that kernel is the
/// selection feeding this run and writes nothing else this run reads
/// (hierarchical_decode::run does).
template <class T, tile_policy Tile = kDecodeTile, class KV>
[[nodiscard]] status decode_attention_async(const decode_attention_plan& plan, const decode_attention_arguments<T, KV>& a,
                                            void* workspace, cudaStream_t stream = nullptr,
                                            bool overlap_previous = false) {
  static_assert(valid_decode_tile_v<Tile>);
  static_assert(Tile.block_kv == Tile.warps * detail::kWarpRows);
  if (plan.splits < 1 || plan.tile != Tile)
    return fail(status::invalid_argument, "decode attention: the plan is empty or was made for another tile policy");
  // The kernel trusts the ring, the split count and the cluster merge's
  // layout; a plan edited by hand must not break them.
  const int ring_bytes =
      std::max(detail::tile_smem_bytes(plan.stages, Tile.block_kv, a.cache.head_dim, static_cast<int>(sizeof(KV)),
                                       static_cast<int>(sizeof(T))),
               detail::warp_merge_bytes(Tile.warps, a.cache.head_dim));
  const int merge_end =
      detail::cluster_merge_end(Tile.warps, std::min(a.num_q_heads / a.cache.kv_heads, detail::kMaxHeadsPerCta),
                                plan.splits, a.cache.head_dim);
  if (plan.stages < 1 || plan.stages > Tile.stages || plan.splits > detail::kMaxSplits ||
      plan.smem_bytes < ring_bytes ||
      (plan.cluster_merge &&
       (plan.splits < 2 || plan.splits > detail::kMaxClusterSplits ||
        plan.merge_offset != detail::cluster_merge_offset(Tile.warps, a.cache.head_dim) ||
        plan.smem_bytes < merge_end)))
    return fail(status::invalid_argument,
                "decode attention: the plan's stages, splits or shared memory are inconsistent (plan again)");
  HISPARSE_TRY(can_implement_decode_attention(a));
  if (plan.batch != a.batch || plan.num_q_heads != a.num_q_heads || plan.kv_heads != a.cache.kv_heads ||
      plan.head_dim != a.cache.head_dim || plan.max_items != a.max_items || plan.sparse != a.sparse())
    return fail(status::invalid_argument,
                "decode attention: the plan was made for another shape (batch " + std::to_string(plan.batch) +
                    ", max_items " + std::to_string(plan.max_items) + "); plan again for batch " +
                    std::to_string(a.batch) + ", max_items " + std::to_string(a.max_items));
  if (workspace == nullptr) return fail(status::invalid_argument, "decode attention: the plan needs a workspace");
  if (a.sparse() && (a.kept_slices == nullptr || a.num_slices == nullptr))
    return fail(status::invalid_argument, "decode attention: a sparse run needs kept_slices and num_slices");
  detail::decode_attention_params<T, KV> p{};
  p.a = a;
  p.group = a.num_q_heads / a.cache.kv_heads;
  p.head_splits = plan.head_splits;
  p.splits = plan.splits;
  p.stages = plan.stages;
  p.merge_offset = plan.cluster_merge ? plan.merge_offset : 0;
  const float scale = a.softmax_scale > 0.0f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(a.cache.head_dim));
  p.scale_log2 = scale * detail::kLog2e;
  auto* ws = static_cast<char*>(workspace);
  p.partial_out = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.partial_offset) : nullptr;
  p.partial_lse = plan.splits > 1 ? reinterpret_cast<float*>(ws + plan.lse_offset) : nullptr;
  p.counters = reinterpret_cast<unsigned*>(ws + plan.counter_offset);
  p.readers = p.counters + static_cast<std::size_t>(plan.counter_batch) * a.cache.kv_heads * plan.head_splits;
  return dispatch_head_dim(a.cache.head_dim, [&](auto d) {
    return detail::launch_decode_attention<T, KV, d(), Tile>(p, plan.smem_bytes, overlap_previous, stream);
  });
}

}  // namespace hisparse::attention

/// `prefix template` of decode_attention_async for queries T over pages of
/// KV with the default tile (core/macros.hpp: HISPARSE_EXTERN_TEMPLATES).
#define HISPARSE_DECODE_ATTENTION_INSTANCE(prefix, T, KV)                                                     \
  prefix template ::hisparse::status                                                                          \
  hisparse::attention::decode_attention_async<T, hisparse::attention::kDecodeTile, KV>(                       \
      const hisparse::attention::decode_attention_plan&, const hisparse::attention::decode_attention_arguments<T, KV>&, \
      void*, cudaStream_t, bool);
#if defined(HISPARSE_EXTERN_TEMPLATES)
HISPARSE_DECODE_ATTENTION_INSTANCE(extern, __nv_bfloat16, __nv_bfloat16)
HISPARSE_DECODE_ATTENTION_INSTANCE(extern, __half, __half)
HISPARSE_DECODE_ATTENTION_INSTANCE(extern, __nv_bfloat16, ::hisparse::kv::fp8_e4m3)
#endif
