#pragma once
// Decode selection: the coarse and fine filters of DESIGN.md section 1 for
// one query per sequence (M = 1), fused into one launch. A cluster of 4 CTAs
// per (sequence, KV head) on sm_90 (they split the scoring and exchange
// scores through distributed shared memory), one CTA on sm_80/sm_89:
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
// at 256K tokens. Step 4 reads the fine summary the config names
// (config.hpp, fine_summary): the fp32 sums, their bf16 roundings (widened
// exactly, scored in fp32 the same way; half the bytes of the step's
// bandwidth-bound part) or the key bounds (scored as sum_d Q_d (Q_d >= 0 ?
// hi_d : lo_d), not divided by the tokens).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cub/block/block_scan.cuh>
#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/core/dispatch.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/kernel_build.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/select/topk.cuh"
#include "hisparse/tuning.hpp"

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
struct decode_selection_arguments : kv::summary_ref {
  /// The cache's summaries (kv::paged_kv_cache::ref() converts).
  void set_cache(const kv::summary_ref& r) { static_cast<kv::summary_ref&>(*this) = r; }

  const Q* queries = nullptr;
  const std::int32_t* slots = nullptr;  ///< [batch], device
  int batch = 0;
  int layer = 0;
  int num_q_heads = 0;
  /// Launch a cluster of CTAs per (sequence, KV head) where the device and
  /// the binary allow it (sm_90+); false forces the single-CTA kernel that
  /// sm_80/sm_89 run (tests use it to cover that path on an H200).
  bool use_clusters = true;
  /// Run on SMs configured with all of their unified L1/shared memory as
  /// shared memory. Left to the driver, an SM running selection CTAs (~26 KB
  /// each at the defaults) is configured for ~100 KB of shared memory, and a
  /// kernel launched as this one's programmatic dependent whose CTAs need
  /// more (the decode attention's take ~100 KB) cannot start on it until
  /// every selection CTA there has left. The price is L1: the selection
  /// alone measured 0.5 us slower at B = 8 (1.5 at B = 32) on an H200, so
  /// hierarchical_decode::run asks for it only where the attention needs
  /// the selection's SMs and there is room on them (see there).
  bool max_shared_carveout = false;
  /// When a programmatic dependent (hierarchical_decode::run's attention)
  /// may launch: as this kernel starts, once the blocks are ranked, or once
  /// the fine candidates are scored. Its CTAs stream the window while they
  /// wait for this kernel; started later, they stay off the SMs and HBM
  /// through the phases before. See hierarchical_decode for where each
  /// pays.
  enum class dependents_launch : std::uint8_t { at_start, after_blocks, after_fine_scores };
  dependents_launch dependents = dependents_launch::at_start;
};

namespace detail {

inline constexpr int kSelectThreads = tuning::kSelectThreads;
inline constexpr int kSelectWarps = kSelectThreads / 32;
inline constexpr int kSelectKeysPerThread = tuning::kSelectKeysPerThread;
/// Candidates one CTA ranks: 4096 blocks (4M tokens at C = 1024) or 4096
/// fine candidates (top_k_coarse * C / F).
inline constexpr int kMaxSelectCandidates = kSelectThreads * kSelectKeysPerThread;
static_assert(kMaxSelectCandidates == hisparse::kMaxCandidates, "config.hpp's limit is what one CTA ranks");
inline constexpr int kFilterMaxCandidates = tuning::kFilterMaxCandidates;
inline constexpr int kFilterMaxK = kSelectThreads / 2;
inline constexpr int kSelectCluster = tuning::kSelectCluster;
/// Blocks ranked by counting (count_top_k): one per thread of a cluster;
/// more take mark_top_k.
inline constexpr int kCountMax = kSelectThreads * kSelectCluster;
inline constexpr int kSelectMinBlocksPerSm = tuning::kSelectMinBlocksPerSm;

/// Byte offsets into the kernel's dynamic shared memory, sized from the
/// config and the cache (host side, select_decode_async).
struct selection_smem {
  int keys = 0;           ///< topk_key[key_capacity]: filter survivors, or the block_topk sort (wide)
  int coarse_scores = 0;  ///< float[max_blocks]
  int fine_scores = 0;    ///< float[top_k_coarse * C / F]
  int keep = 0;           ///< uint8[max(max_blocks, fine candidates)]
  int kept_blocks = 0;    ///< int32[top_k_coarse]
  int partial = -1;       ///< float[kPartialBytes / 4]: the partial block's far slices (decode only)
  int bytes = 0;
};

template <class Q>
struct decode_params {
  decode_selection_arguments<Q> in;
  decode_selection_output out;
  int window, top_k_coarse, top_k_fine;
  selection_smem smem;
};

/// The few cluster operations the kernel needs, for a cluster of S CTAs;
/// S = 1 is a plain CTA (every architecture). Clusters exist from sm_90 on;
/// the host launches S > 1 only where the loaded binary is sm_90 or newer.
template <int S>
struct cluster_ops {
  __device__ static unsigned rank() {
    if constexpr (S == 1) return 0;
    return ptx::cluster_rank();
  }
  /// Barrier across the cluster with release/acquire semantics: shared
  /// memory written (locally or remotely) before it is visible after it.
  __device__ static void sync() {
    arrive();
    wait();
  }
  /// The two halves of a cluster barrier, for work between them. arrive()
  /// releases what this thread wrote; wait() returns once every thread of
  /// the cluster has arrived, and acquires. With S = 1 arrive() is nothing
  /// and wait() is __syncthreads().
  __device__ static void arrive() {
    if constexpr (S > 1) ptx::cluster_arrive();
  }
  /// arrive() without the release: for a barrier that only says "this CTA
  /// is running" (no memory of it is read across the barrier).
  __device__ static void arrive_relaxed() {
    if constexpr (S > 1) ptx::cluster_arrive_relaxed();
  }
  __device__ static void wait() {
    if constexpr (S == 1) {
      __syncthreads();
    } else {
      ptx::cluster_wait();
    }
  }
  /// `p` (an address in this CTA's shared memory) in CTA `r` of the cluster.
  template <class T>
  __device__ static T* peer(T* p, unsigned r) {
    if constexpr (S == 1) return p;
    return ptx::cluster_map(p, r);
  }
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

/// What a lane loads of a row of E for kPer elements: the floats
/// themselves, or the bf16 pairs as 32-bit words, widened only when they
/// are used (a widening beside each load would make every load of a batch
/// wait for the one before it).
template <class E, int kPer>
struct lane_words {
  using type = float;
  static constexpr int kCount = kPer;
};
template <int kPer>
struct lane_words<__nv_bfloat16, kPer> {
  using type = unsigned;
  static constexpr int kCount = kPer / 2;
};

/// Key bounds rows (fine_score = key_bounds): one 32-bit word a dimension,
/// loaded as the fp32 rows are and kept as raw bits until scored.
template <int kPer>
struct lane_words<std::uint32_t, kPer> {
  using type = float;
  static constexpr int kCount = kPer;
};
template <int kPer>
__device__ __forceinline__ void load_lane(const std::uint32_t* row, float (&w)[kPer]) {
  load_lane<kPer>(reinterpret_cast<const float*>(row), w);
}

/// Loads this lane's kPer consecutive bf16 of a row as kPer / 2 words.
template <int kPer>
__device__ __forceinline__ void load_lane(const __nv_bfloat16* row, unsigned (&w)[kPer / 2]) {
  if constexpr (kPer == 2) {
    w[0] = __ldg(reinterpret_cast<const unsigned*>(row));
  } else if constexpr (kPer == 4) {
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(row));
    w[0] = x.x, w[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < kPer / 2; i += 4) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(row + 2 * i));
      w[i] = x.x, w[i + 1] = x.y, w[i + 2] = x.z, w[i + 3] = x.w;
    }
  }
}

/// The loaded words as floats: a copy, or bf16 pairs widened exactly.
template <int kPer>
__device__ __forceinline__ void widen(const float (&w)[kPer], float (&v)[kPer]) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = w[i];
}
template <int kPer>
__device__ __forceinline__ void widen(const unsigned (&w)[kPer / 2], float (&v)[kPer]) {
#pragma unroll
  for (int i = 0; i < kPer / 2; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

/// This thread's warp among the cluster's S * kSelectWarps.
template <int S>
__device__ __forceinline__ int cluster_warp() {
  return static_cast<int>(cluster_ops<S>::rank()) * kSelectWarps + static_cast<int>(threadIdx.x / 32);
}

/// A row's score before the scale is warp_sum(lane_dot(q, v)): this lane's
/// kPer floats of the row's key sum dotted with qsum's (fmaf in order), then
/// summed across the warp. Every row goes through this arithmetic, so equal
/// means give equal scores wherever they are scored.
template <int kPer>
__device__ __forceinline__ float lane_dot(const float (&q)[kPer], const float (&v)[kPer]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s = fmaf(q[i], v[i], s);
  return s;
}

/// This lane's part of a key_bounds score: sum_i q_i b_i over its kPer
/// words (bits, see key_bounds_word), fmaf in order, with b_i the bound
/// facing q_i -- the maximum where q_i >= 0, else the minimum -- moved into
/// a float's high half by one byte permute (`sel`: bounds_selectors).
template <int kPer>
__device__ __forceinline__ float lane_bounds(const float (&q)[kPer], const unsigned (&sel)[kPer],
                                             const float (&w)[kPer]) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s = fmaf(q[i], __uint_as_float(__byte_perm(__float_as_uint(w[i]), 0u, sel[i])), s);
  return s;
}

/// The byte-permute selectors of lane_bounds: bytes 3-2 of the word (the
/// maximum) over two zero bytes where q_i >= 0 (-0 included; NaN either
/// way), else bytes 1-0 (the minimum).
template <int kPer>
__device__ __forceinline__ void bounds_selectors(const float (&q)[kPer], unsigned (&sel)[kPer]) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) sel[i] = q[i] >= 0.0f ? 0x3244u : 0x1044u;
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
  return s;
}

/// One butterfly step of warp_sum_rows per halving of N (N = R, R/2, ..., 2).
template <int N, int R>
__device__ __forceinline__ void halve_rows(float (&v)[R], int lane) {
  if constexpr (N > 1) {
    constexpr int kOff = 16 * N / R;  // 16, 8, ... as N halves from R
    const bool upper = (lane & kOff) != 0;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float send = upper ? v[j] : v[j + N / 2];
      const float keep = upper ? v[j + N / 2] : v[j];
      v[j] = keep + __shfl_xor_sync(kFullMask, send, kOff);
    }
    halve_rows<N / 2>(v, lane);
  }
}

/// warp_sum of each of R values (R a power of two <= 32) in R - 1 + 5 -
/// log2(R) shuffles instead of 5 R (9 for 40 at R = 8): the first log2(R)
/// butterfly steps each hand half of the lane's values to the partner and
/// add the other half, so lane l ends with the sum of value l / (32 / R).
/// Every partial adds the same two operands as warp_sum's (a + b == b + a),
/// so each sum is bit-identical to warp_sum's.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&v)[R]) {
  static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R must be a power of two <= 32");
  halve_rows<R>(v, static_cast<int>(threadIdx.x & 31));
  float s = v[0];
#pragma unroll
  for (int off = 16 / R; off > 0; off >>= 1) s += __shfl_xor_sync(kFullMask, s, off);
  return s;
}

template <int kPer>
__device__ __forceinline__ void load_q(const float* qsum, float (&q)[kPer]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kPer; ++i) q[i] = qsum[lane * kPer + i];
}

/// One warp's batch of candidate rows in registers: rows base + u * kStride
/// (u < kRows) of [0, count), this lane's kPer elements of each, widened to
/// float -- 128 bytes of loads in flight per lane (64 for bf16 rows).
/// `row(r)` is row r's key sum (D elements of E: float, or bf16).
template <int D, int S, class E = float>
struct row_batch {
  static constexpr int kPer = D / 32;  // elements per lane: 2, 4 or 8
  static constexpr int kRows = 32 / kPer;
  static constexpr int kStride = S * kSelectWarps;
  static constexpr int kLines = D * static_cast<int>(sizeof(E)) / 128;  // 128-byte lines per row
  static constexpr int kLineElems = 128 / static_cast<int>(sizeof(E));
  static_assert(kRows * kLines == 32 * static_cast<int>(sizeof(E)) / 4,
                "a batch is one 128-byte line per lane (fp32) or per two lanes (bf16)");
  using words = lane_words<E, kPer>;
  typename words::type v[kRows][words::kCount];

  /// Sends the batch's lines towards L2 (one per lane), holding no register:
  /// the load that follows pays an L2 hit instead of the trip to HBM.
  /// `row_of_slot(u)` points at row base + u * kStride; every lane calls it
  /// (it may shuffle), for its own slot lane / kLines.
  template <class RowOfSlot>
  __device__ __forceinline__ static void prefetch(int base, int count, RowOfSlot row_of_slot) {
    const int lane = threadIdx.x & 31;
    const E* p = row_of_slot(lane / kLines);
    if (lane < kRows * kLines && base + lane / kLines * kStride < count)
      ptx::prefetch_l2(p + lane % kLines * kLineElems);
  }

  /// Loads rows base + u * kStride (< count); `row_of_slot(u)` points at
  /// the u-th. The condition is uniform across the warp, so row_of_slot may
  /// shuffle.
  template <class RowOfSlot>
  __device__ __forceinline__ void load(int base, int count, RowOfSlot row_of_slot) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (base + u * kStride < count) load_lane<kPer>(row_of_slot(u) + lane * kPer, v[u]);
  }

  /// Dots every row with qsum's lane part q, sums over the warp and calls
  /// `store(r, score * scale)` in one lane per row.
  template <class Store>
  __device__ __forceinline__ void score(int base, int count, const float (&q)[kPer], float scale,
                                        Store store) {
    const int lane = threadIdx.x & 31;
    float part[kRows];
    [[maybe_unused]] unsigned sel[kPer];
    if constexpr (std::is_same_v<E, std::uint32_t>) bounds_selectors(q, sel);
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if constexpr (std::is_same_v<E, std::uint32_t>) {
        part[u] = base + u * kStride < count ? lane_bounds(q, sel, v[u]) : 0.0f;
      } else {
        float x[kPer];
        widen<kPer>(v[u], x);
        part[u] = base + u * kStride < count ? lane_dot(q, x) : 0.0f;
      }
    }
    const float s = warp_sum_rows(part);  // lane l: row l / kPer of the batch
    const int r = base + lane / kPer * kStride;
    if (lane % kPer == 0 && r < count) store(r, s * scale);
  }
};

/// Scores candidate rows [0, count) with one warp per row; the cluster's
/// S * kSelectWarps warps split the rows, and `store(r, score)` runs in one
/// lane per row (a lane stores at most one row per batch). Row r's key sum is
/// at row(index(r)): index (a slice number, say, that costs a division) is
/// evaluated once per lane for the batch -- lane u for row u -- and handed
/// to the loads by shuffle, not once per row in every lane. The rows are
/// dotted with qsum and scaled by `scale` (1 / tokens). Each batch's
/// successor is prefetched into L2 while the batch is loaded, so their trips
/// overlap. `batch_end(j)` runs in every lane after batch j of this warp, for
/// each of the ceil(count / step) batches, empty ones included.
template <int D, int S, class E = float, class Index, class Row, class Store, class BatchEnd>
__device__ __forceinline__ void score_rows(int count, const float* qsum, Index index, Row row, float scale,
                                           Store store, BatchEnd batch_end) {
  using batch_t = row_batch<D, S, E>;
  constexpr int kStep = batch_t::kStride * batch_t::kRows;
  const int lane = threadIdx.x & 31;
  float q[batch_t::kPer];
  load_q(qsum, q);
  // Lane u's index of row u of a batch starting at `base` (0 past count).
  auto slot_index = [&](int base) {
    const int r = base + lane * batch_t::kStride;
    return lane < batch_t::kRows && r < count ? index(r) : 0;
  };
  const int batches = (count + kStep - 1) / kStep;
  int next = slot_index(cluster_warp<S>());
  for (int j = 0; j < batches; ++j) {
    const int base = cluster_warp<S>() + j * kStep;
    if (base < count) {  // uniform across the warp
      const int mine = next;
      next = slot_index(base + kStep);
      batch_t::prefetch(base + kStep, count, [&](int u) { return row(__shfl_sync(kFullMask, next, u)); });
      batch_t batch;
      batch.load(base, count, [&](int u) { return row(__shfl_sync(kFullMask, mine, u)); });
      batch.score(base, count, q, scale, store);
    }
    batch_end(j);
  }
}

inline constexpr int kPartialBytes = tuning::kPartialBytes;
template <int D>
inline constexpr int kPartialRows = kPartialBytes / (D * 4);

/// Starts copying the first min(n, kPartialRows) of the n rows at rows + j *
/// stride into `staged` (the calling warp's lanes split the 16-byte chunks)
/// and prefetches the rest into L2; score_summed_row waits for them.
template <int D>
__device__ void stage_summed_row(float* staged, const float* rows, std::int64_t stride, int n) {
  constexpr int kChunks = D / 4;
  constexpr int kLines = D * 4 / 128;
  const int lane = threadIdx.x & 31;
  const int in_smem = min(n, kPartialRows<D>);
  const unsigned dst = ptx::smem_address(staged);
  for (int i = lane; i < in_smem * kChunks; i += 32)
    ptx::cp_async_16(dst + i * 16, rows + (i / kChunks) * stride + i % kChunks * 4, 16);
  ptx::cp_async_commit();
  for (int l = lane; l < (n - in_smem) * kLines; l += 32)
    ptx::prefetch_l2(rows + (in_smem + l / kLines) * stride + l % kLines * 32);
}

/// Scores, on the calling warp, a row whose key sum is the sum of the n
/// rows at rows + j * stride, added in order j = 0..n-1 (the partial block:
/// its far slices' sums): the first kPartialRows from `staged` (after
/// stage_summed_row), the rest from global memory, kRowsInFlight rows'
/// loads in flight at a time. `store(score)` runs in lane 0.
template <int D, class Store>
__device__ void score_summed_row(const float* staged, const float* rows, std::int64_t stride, int n,
                                 const float* qsum, float scale, Store store) {
  constexpr int kPer = D / 32;
  constexpr int kRowsInFlight = 32 / kPer;
  const int lane = threadIdx.x & 31;
  float v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = 0.0f;
  const int in_smem = min(n, kPartialRows<D>);
  ptx::cp_async_wait<0>();
  __syncwarp();  // every lane's chunks are in
  for (int j = 0; j < in_smem; ++j) {
    if constexpr (kPer == 2) {
      const float2 x = *reinterpret_cast<const float2*>(staged + j * D + lane * kPer);
      v[0] += x.x, v[1] += x.y;
    } else {
#pragma unroll
      for (int i = 0; i < kPer; i += 4) {
        const float4 x = *reinterpret_cast<const float4*>(staged + j * D + lane * kPer + i);
        v[i] += x.x, v[i + 1] += x.y, v[i + 2] += x.z, v[i + 3] += x.w;
      }
    }
  }
  for (int j0 = in_smem; j0 < n; j0 += kRowsInFlight) {
    float w[kRowsInFlight][kPer];
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j)
      if (j0 + j < n) load_lane<kPer>(rows + (j0 + j) * stride + lane * kPer, w[j]);
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j)
      if (j0 + j < n)
#pragma unroll
        for (int i = 0; i < kPer; ++i) v[i] += w[j][i];
  }
  float q[kPer];
  load_q(qsum, q);
  const float s = warp_sum(lane_dot(q, v));
  if (lane == 0) store(s * scale);
}

/// Stores a score into the same slot of every CTA of the cluster.
template <int S>
__device__ __forceinline__ void broadcast(float* scores, int r, float s) {
#pragma unroll
  for (int c = 0; c < S; ++c) cluster_ops<S>::peer(scores, static_cast<unsigned>(c))[r] = s;
}

struct filter_storage {
  topk_key group_max[2 * kFilterMaxK];  ///< mark_top_k's group maxima; top_k_of_groups' kept keys
  topk_key threshold;
  unsigned fill;
  unsigned kept_fill;
};

using select_scan = cub::BlockScan<int, kSelectThreads>;
using select_block_topk = block_topk<kSelectThreads, kSelectKeysPerThread>;

/// Shared temporaries of a top-k stage (the filter's or block_topk's) and of
/// the compaction that follows it; each use ends at a barrier before the next
/// begins. Only the wide kernel holds block_topk's.
template <bool Wide>
union selection_temp {
  filter_storage filter;
  select_scan::TempStorage scan;
};
template <>
union selection_temp<true> {
  filter_storage filter;
  select_scan::TempStorage scan;
  select_block_topk::TempStorage block;
};

/// log2 of the threads sharing one of n items in a block-wide pass: the
/// largest power of two p <= 32 with n * p <= kSelectThreads, at least 1.
/// The p threads of an item are p consecutive lanes of one warp (shifts, not
/// divisions by a run-time p, map threads to items).
__device__ __forceinline__ int log2_lanes_per_item(int n) {
  int lg = 5;
  while (lg > 0 && (n << lg) > kSelectThreads) --lg;
  return lg;
}

/// Max (sum) over the p consecutive lanes of an item; every lane of the
/// warp calls it with the same p.
__device__ __forceinline__ topk_key item_max(topk_key x, int p) {
  for (int off = p / 2; off > 0; off >>= 1) {
    const topk_key y = __shfl_xor_sync(kFullMask, x, off);
    x = y > x ? y : x;
  }
  return x;
}
__device__ __forceinline__ int item_sum(int x, int p) {
  for (int off = p / 2; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

/// Group maxima: group g of ng (ng <= kSelectThreads) holds candidates g,
/// g + ng, g + 2 ng, ... of scores[0, count) and its p threads take every
/// p-th of them; group_max[g] gets the largest key. visit(score) sees every
/// score once.
template <class Visit>
__device__ __forceinline__ void store_group_maxima(const float* scores, int count, int ng, topk_key* group_max,
                                                   Visit visit) {
  const int t = static_cast<int>(threadIdx.x);
  const int lp = log2_lanes_per_item(ng), p = 1 << lp;
  const int g = t >> lp, sub = t & (p - 1);
  topk_key m = kNoCandidate;
  if (g < ng)
    for (int i = g + ng * sub; i < count; i += ng * p) {
      visit(scores[i]);
      m = max(m, make_key(scores[i], i));
    }
  m = item_max(m, p);
  if (g < ng && sub == 0) group_max[g] = m;
}

/// The group maximum with exactly k - 1 above it (keys are distinct; k <=
/// ng): at least k candidates reach it, so every one of the true top k does.
/// found(key) runs in the one thread that holds it.
template <class Found>
__device__ __forceinline__ void find_kth_group_maximum(const topk_key* group_max, int ng, int k, Found found) {
  const int t = static_cast<int>(threadIdx.x);
  const int lp = log2_lanes_per_item(ng), p = 1 << lp;
  const int g = t >> lp, sub = t & (p - 1);
  const topk_key mine = g < ng ? group_max[g] : kNoCandidate;
  int above = 0;
  if (g < ng)
    for (int u = sub; u < ng; u += p) above += group_max[u] > mine ? 1 : 0;
  above = item_sum(above, p);
  if (g < ng && sub == 0 && above == k - 1) found(mine);
}

/// Appends the keys of scores[0, count) that reach `threshold` to keys[],
/// one shared atomic per warp (warp_append); *fill counts them.
__device__ __forceinline__ void append_survivors(const float* scores, int count, topk_key threshold, topk_key* keys,
                                                 unsigned* fill) {
  const int t = static_cast<int>(threadIdx.x);
  for (int i0 = 0; i0 < count; i0 += kSelectThreads) {  // the same trip count in every warp
    const int i = i0 + t;
    const topk_key key = i < count ? make_key(scores[i], i) : kNoCandidate;
    const bool take = i < count && key >= threshold;
    const unsigned pos = warp_append(take, fill);
    if (take) keys[pos] = key;
  }
}

/// Ranks each of keys[0, survivors) against all of them (keys distinct),
/// spread over the CTA (2^log2_lanes_per_item threads per key, combined by
/// shuffles), and calls kept(take, key) in every thread -- take: this
/// thread reports a key with fewer than k above it -- the same number of
/// times in every warp (kept may use warp collectives).
template <class Kept>
__device__ __forceinline__ void rank_survivors(const topk_key* keys, int survivors, int k, Kept kept) {
  const int t = static_cast<int>(threadIdx.x);
  const int lq = log2_lanes_per_item(survivors), q = 1 << lq;
  for (int s0 = 0; s0 < survivors; s0 += kSelectThreads >> lq) {  // uniform trip count
    const int s = s0 + (t >> lq), part = t & (q - 1);
    const topk_key mine = s < survivors ? keys[s] : kNoCandidate;
    int above = 0;
    if (s < survivors)
      for (int u = part; u < survivors; u += q) above += keys[u] > mine ? 1 : 0;
    above = item_sum(above, q);
    kept(s < survivors && part == 0 && above < k, mine);
  }
}

/// Top-k of scores[0, count) (candidate ids 0..count-1), ties to the lower
/// id: sets keep[i] to 1 for the kept candidates and 0 for the rest.
///
/// Threshold filter (count <= 1024, k <= 128): split the candidates into
/// ng = min(count, 2k) interleaved groups; the k-th largest group maximum is
/// a key that at least k candidates reach, so every one of the true top k
/// reaches it too. Only the survivors (~2k-3k on random scores; all of them
/// in the worst case, still exact) are ranked, each against the others, and
/// rank < k keeps. Four barriers, no serial rounds. Every pass spreads its
/// items (a group, a group maximum to rank, a survivor to rank) over the
/// whole CTA: 2^log2_lanes_per_item threads per item split its loop and
/// combine by shuffles, so a pass takes ~count / 256 or ~ng / (256 / ng)
/// steps, not the count / ng, ng or `survivors` of one thread per item.
/// Larger problems take block_topk, in the wide kernel only (the narrow one
/// is launched only where every stage fits the filter: fits_filter).
template <bool Wide>
__device__ void mark_top_k(const float* scores, int count, int k, unsigned char* keep, topk_key* keys,
                           selection_temp<Wide>& temp) {
  const int t = static_cast<int>(threadIdx.x);
  for (int i = t; i < count; i += kSelectThreads) keep[i] = count <= k ? 1 : 0;
  if (count <= k) {
    __syncthreads();
    return;
  }
  if constexpr (Wide) {
    if (count > kFilterMaxCandidates || k > kFilterMaxK) {
      topk_key mine[kSelectKeysPerThread];
#pragma unroll
      for (int j = 0; j < kSelectKeysPerThread; ++j) {
        const int i = j * kSelectThreads + t;
        mine[j] = i < count ? make_key(scores[i], i) : kNoCandidate;
      }
      const int found = select_block_topk(temp.block).select(mine, k, keys);
      for (int i = t; i < found; i += kSelectThreads) keep[key_index(keys[i])] = 1;
      __syncthreads();
      return;
    }
  }
  filter_storage& fs = temp.filter;
  const int ng = min(count, 2 * k);  // <= 2 * kFilterMaxK = kSelectThreads
  store_group_maxima(scores, count, ng, fs.group_max, [](float) {});
  if (t == 0) fs.fill = 0;
  __syncthreads();
  find_kth_group_maximum(fs.group_max, ng, k, [&](topk_key key) { fs.threshold = key; });
  __syncthreads();
  const topk_key threshold = fs.threshold;
  append_survivors(scores, count, threshold, keys, &fs.fill);
  __syncthreads();
  const int survivors = static_cast<int>(fs.fill);  // >= k
  rank_survivors(keys, survivors, k, [&](bool take, topk_key key) {
    if (take) keep[key_index(key)] = 1;
  });
  __syncthreads();
}

/// Compacts the marked candidates (count <= kMaxCandidates), in candidate
/// order, to out[0, n) and returns n: every thread scans a contiguous run,
/// one block-wide scan.
template <int kMaxCandidates, class Emit>
__device__ int compact_marked(const unsigned char* keep, int count, select_scan::TempStorage& scan_storage,
                              Emit emit) {
  constexpr int kPerThread = kMaxCandidates / kSelectThreads;
  const int first = threadIdx.x * kPerThread;
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) mine += first + j < count ? keep[first + j] : 0;
  int offset = 0, total = 0;
  select_scan(scan_storage).ExclusiveSum(mine, offset, total);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j)
    if (first + j < count && keep[first + j]) emit(offset++, first + j);
  __syncthreads();
  return total;
}

/// Top-k of scores[0, count) (ties to the lower index) by counting, split
/// over the cluster: every CTA builds the keys (in `keys`, padded with
/// kNoCandidate to an even length for 16-byte pair loads); CTA r ranks
/// candidates [r per, (r + 1) per) (per = ceil(count / S) <= the CTA's
/// threads), each against all `count` keys (2^log2_lanes_per_item threads
/// per candidate split the comparisons), in one pass: rank < k keeps. A
/// kept candidate sets its bit in `mask` (one bit per candidate, zeroed
/// before the cluster barrier that published the scores) in every CTA of
/// the cluster; after a cluster barrier every CTA turns the mask into the
/// ascending list, emit(position, candidate) (position = kept candidates
/// below it: a popcount prefix over the mask words). Returns the number
/// kept (min(count, k)). Two cluster-wide steps and no serial rounds,
/// against mark_top_k's four passes and a compaction in every CTA.
/// count <= 32 * 32 (the mask).
template <int S, class Emit>
__device__ int count_top_k(const float* scores, topk_key* keys, int count, int k, unsigned* mask, Emit emit) {
  using cluster = cluster_ops<S>;
  const int t = static_cast<int>(threadIdx.x), lane = t & 31;
  for (int i = t; i < count + (count & 1); i += kSelectThreads) keys[i] = i < count ? make_key(scores[i], i) : kNoCandidate;
  __syncthreads();
  {
    const int per = (count + S - 1) / S;
    const int first = static_cast<int>(cluster::rank()) * per, last = min(count, first + per);
    const int lp = log2_lanes_per_item(per), lanes = 1 << lp;
    const int c = first + (t >> lp), sub = t & (lanes - 1);
    const topk_key mine = c < last ? keys[c] : kNoCandidate;
    int above = 0;
    if (c < last) {
      const auto* pairs = reinterpret_cast<const ulonglong2*>(keys);
      for (int j = sub; j < (count + 1) / 2; j += lanes) {
        const ulonglong2 x = pairs[j];
        above += (x.x > mine ? 1 : 0) + (x.y > mine ? 1 : 0);
      }
    }
    above = item_sum(above, lanes);
    if (c < last && sub == 0 && above < k)
      for (unsigned r = 0; r < S; ++r) atomicOr(cluster::peer(mask, r) + c / 32, 1u << (c % 32));
  }
  cluster::sync();
  // The mask's words (at most 32): lane w counts word w; an inclusive scan
  // over the lanes gives each word's offset. Every warp does it (no barrier).
  const int words = (count + 31) / 32;
  const unsigned bits = lane < words ? mask[lane] : 0u;
  int inclusive = __popc(bits);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kFullMask, inclusive, off);
    if (lane >= off) inclusive += y;
  }
  const int exclusive = inclusive - __popc(bits);
  for (int w = t / 32; w < words; w += kSelectWarps) {  // uniform across the warp
    const unsigned m = mask[w];
    const int offset = __shfl_sync(kFullMask, exclusive, w);
    if ((m >> lane) & 1u) emit(offset + __popc(m & ((1u << lane) - 1u)), w * 32 + lane);
  }
  __syncthreads();
  return __shfl_sync(kFullMask, inclusive, 31);
}

/// Top-k of scores[0, count) (candidate ids 0..count-1, ties to the lower
/// id) given the maxima of ng groups that partition the candidates (any
/// partition: the scoring warps' batches), k < count <= kFilterMaxCandidates,
/// k <= kFilterMaxK, k <= ng <= kSelectThreads. The k-th largest group
/// maximum is the threshold (k groups reach it, so the k-th largest key
/// does); the survivors above it are appended to `keys` and ranked against
/// each other; the k kept go to a short list whose entries find their
/// position in candidate order by counting. emit(position, candidate), in
/// any order. Three barriers; mark_top_k + compact_marked take six.
template <class Emit>
__device__ void top_k_of_groups(const float* scores, int count, int k, const topk_key* group_max, int ng,
                                topk_key* keys, filter_storage& fs, Emit emit) {
  const int t = static_cast<int>(threadIdx.x);
  {  // the k-th largest maximum: fewer than k above it, at least k at or above it (empty groups are 0)
    const int lp = log2_lanes_per_item(ng), lanes = 1 << lp;
    const int g = t >> lp, sub = t & (lanes - 1);
    const topk_key mine = g < ng ? group_max[g] : kNoCandidate;
    int above = 0, equal = 0;
    if (g < ng)
      for (int u = sub; u < ng; u += lanes) {
        const topk_key x = group_max[u];
        above += x > mine ? 1 : 0;
        equal += x == mine ? 1 : 0;
      }
    above = item_sum(above, lanes);
    equal = item_sum(equal, lanes);
    if (g < ng && sub == 0 && above < k && above + equal >= k) fs.threshold = mine;  // one value
    if (t == 0) fs.fill = fs.kept_fill = 0;
  }
  __syncthreads();
  const topk_key threshold = fs.threshold;
  append_survivors(scores, count, threshold, keys, &fs.fill);
  __syncthreads();
  const int survivors = static_cast<int>(fs.fill);  // >= k
  topk_key* kept = fs.group_max;                     // k <= kFilterMaxK entries
  rank_survivors(keys, survivors, k, [&](bool take, topk_key key) {
    const unsigned pos = warp_append(take, &fs.kept_fill);
    if (take) kept[pos] = key;
  });
  __syncthreads();
  for (int i = t; i < k; i += kSelectThreads) {  // lower index = larger low word
    const topk_key mine = kept[i];
    int below = 0;
    for (int j = 0; j < k; ++j) below += static_cast<std::uint32_t>(kept[j]) > static_cast<std::uint32_t>(mine) ? 1 : 0;
    emit(below, key_index(mine));
  }
}

inline constexpr int kWarpRankPerLane = tuning::kWarpRankPerLane;
inline constexpr int kWarpRankMax = 32 * kWarpRankPerLane;
inline constexpr int kWarpRankSurvivors = tuning::kWarpRankSurvivors;

/// Whether warp_rank_* takes a stage of `count` candidates and top-k.
__host__ __device__ inline bool fits_warp_rank(int count, int k) {
  return count > k && count <= kWarpRankMax && k <= 32;
}

/// The first half of a top-k of scores[0, count) (ids 0..count-1, ties to
/// the lower id; fits_warp_rank) on the calling warp alone (all 32 lanes,
/// converged), no barrier and no shuffle. Lane l holds candidates l, l + 32,
/// l + 64, ... as ordered score words (ordered_bits). The threshold is the
/// largest word that at least k lane maxima reach, found one bit at a time
/// by ballots over the lane maxima's heights above the smallest of them, to
/// the 16 bits from the highest bit of their spread: at least k candidates
/// reach it, so every one of the true top k does too (ties and the
/// unresolved low bits only add survivors). The survivors (~20 of 512 on
/// random scores at k = 16: a lane's candidates are spread over every kept
/// block, so a block of high slices does not crowd one lane) go to
/// survivors[] as keys, in ascending candidate order. Returns their number;
/// above kWarpRankSurvivors warp_rank_place cannot finish (survivors[] then
/// holds the first kWarpRankSurvivors).
///
/// Heights, not absolute words: scores that share a large offset (keys with
/// a common mean direction) spread over a small fraction of it, and a
/// threshold of the 16 top bits of the word (7 of the mantissa) put all 512
/// candidates of N(50, 0.1) in one bucket, so every stage fell back to
/// mark_top_k; the bits below the lane maxima's common prefix still did
/// whenever the spread straddled a power of two (N(1.998, 0.001)). Only a
/// lane maximum far from the rest (an infinite score, a lane of NaN or
/// -inf) widens the buckets again.
///
/// Shuffles and shared-memory loads share the SM's MIO queue with the
/// decode attention's ldmatrix and cp.async traffic when its CTAs run
/// beside this one (hierarchical_decode::run): the same ranking with the
/// threshold counted by 31 shuffles measured 36.6 us per decode step
/// against 36.0 with the ballots (H200, B = 8, T = 256K), though both take
/// the same time alone.
__device__ __forceinline__ int warp_rank_filter(const float* scores, int count, int k, topk_key* survivors) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  std::uint32_t o[kWarpRankPerLane];  // 0 past count (NaN is 0 too: validity is tested apart)
  std::uint32_t lane_max = 0;
#pragma unroll
  for (int j = 0; j < kWarpRankPerLane; ++j) {
    const int c = j * 32 + lane;
    o[j] = c < count ? ordered_bits(scores[c]) : 0u;
    lane_max = max(lane_max, o[j]);
  }
  // The lane maxima of the lanes holding candidates lie in [lo, hi]: the
  // ballots search their heights above lo, from the highest bit of hi - lo
  // down, so the 16 rounds resolve the spread wherever it lies. All
  // min(count, 32) >= k lanes with candidates reach height 0.
  const std::uint32_t hi = __reduce_max_sync(kFullMask, lane_max);
  const std::uint32_t lo = __reduce_min_sync(kFullMask, lane < count ? lane_max : ~0u);
  const std::uint32_t height = lane < count ? lane_max - lo : 0u;
  std::uint32_t bit = hi == lo ? 0u : 0x80000000u >> __clz(hi - lo);  // 0: every maximum is lo
  std::uint32_t reached = 0;
#pragma unroll
  for (int round = 0; round < 16; ++round, bit >>= 1) {
    const std::uint32_t trial = reached | bit;
    if (__popc(__ballot_sync(kFullMask, height >= trial)) >= k) reached = trial;
  }
  const std::uint32_t threshold = lo + reached;
  // Survivors in candidate order j * 32 + lane: row j's before row j + 1's.
  const unsigned below_me = (1u << lane) - 1u;
  int base = 0;
#pragma unroll
  for (int j = 0; j < kWarpRankPerLane; ++j) {
    const int c = j * 32 + lane;
    const bool take = c < count && o[j] >= threshold;
    const unsigned row = __ballot_sync(kFullMask, take);
    const int at = base + __popc(row & below_me);
    if (take && at < kWarpRankSurvivors) survivors[at] = key_of_word(o[j], c);
    base += __popc(row);
  }
  return base;
}

/// The second half: ranks the n <= kWarpRankSurvivors keys of survivors[]
/// (distinct, ascending candidate order, written by warp_rank_filter on this
/// warp) against each other, two per lane, and calls emit(position,
/// candidate) for the k with fewer than k above them, position counted in
/// candidate order.
template <class Emit>
__device__ __forceinline__ void warp_rank_place(const topk_key* survivors, int n, int k, Emit emit) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  __syncwarp();  // survivors[] written by other lanes
  const topk_key a = lane < n ? survivors[lane] : kNoCandidate;
  const topk_key b = lane + 32 < n ? survivors[lane + 32] : kNoCandidate;
  int above_a = 0, above_b = 0;
  const auto* pairs = reinterpret_cast<const ulonglong2*>(survivors);
#pragma unroll 4
  for (int v = 0; v < (n + 1) / 2; ++v) {  // an odd n reads one slot past: masked below
    const ulonglong2 x = pairs[v];
    const bool second = 2 * v + 1 < n;
    above_a += (x.x > a ? 1 : 0) + (second && x.y > a ? 1 : 0);
    above_b += (x.x > b ? 1 : 0) + (second && x.y > b ? 1 : 0);
  }
  const bool take_a = lane < n && above_a < k, take_b = lane + 32 < n && above_b < k;
  const unsigned first = __ballot_sync(kFullMask, take_a), second = __ballot_sync(kFullMask, take_b);
  const unsigned below_me = (1u << lane) - 1u;
  if (take_a) emit(__popc(first & below_me), key_index(a));
  if (take_b) emit(__popc(first) + __popc(second & below_me), key_index(b));
}

/// Grid: x = KV head * S (a cluster of S CTAs per head), y = batch row.
/// The cluster's CTAs split the scoring of blocks and of fine candidates and
/// broadcast every block score into each other's shared memory, so each CTA
/// holds all of them after a cluster barrier; they split the block ranking
/// (count_top_k: each ranks a share, the kept bits go to every CTA), and
/// CTA 0 ranks the slices (on one warp, warp_rank_*, at the defaults) and
/// writes the outputs. Wide: the kernel that can
/// rank more than kFilterMaxCandidates candidates or keep more than
/// kFilterMaxK (block_topk); the narrow one ranks by the filter alone.
/// Fine: the fine summary the fine stage scores (config.fine_summary).
template <class Q, int D, int S, bool Wide, fine_summary Fine>
__global__ void __launch_bounds__(kSelectThreads, kSelectMinBlocksPerSm) decode_selection_kernel(const __grid_constant__ decode_params<Q> p) {
  using SumT = typename kv::fine_summary_traits<Fine>::element;
  using cluster = cluster_ops<S>;
  constexpr int kMaxCandidates = Wide ? kMaxSelectCandidates : kFilterMaxCandidates;
  // A kernel launched as this one's programmatic dependent (the attention of
  // hierarchical_decode::run) may start once every CTA has said so: here,
  // or later (p.in.dependents). It reads nothing this kernel writes before
  // its griddepcontrol.wait, which still waits for this whole grid to
  // finish. No-op for an ordinary next launch.
  using launch = typename decode_selection_arguments<Q>::dependents_launch;
  if (p.in.dependents == launch::at_start) ptx::launch_dependents();
  __shared__ float qsum[D];
  __shared__ selection_temp<Wide> temp;
  // count_top_k's kept-block bits (candidates <= kCountMax) and the fine
  // stage's group maxima, which the other CTAs write into rank 0's.
  __shared__ unsigned kept_mask[kCountMax / 32];
  __shared__ topk_key fine_group_max[kSelectThreads];
  __shared__ int fine_survivors;  // warp_rank_filter's count, for the rest of rank 0
  extern __shared__ __align__(16) unsigned char smem[];
  auto* keys = reinterpret_cast<topk_key*>(smem + p.smem.keys);
  auto* coarse_scores = reinterpret_cast<float*>(smem + p.smem.coarse_scores);
  auto* fine_scores = reinterpret_cast<float*>(smem + p.smem.fine_scores);
  auto* keep = smem + p.smem.keep;
  auto* kept_blocks = reinterpret_cast<std::int32_t*>(smem + p.smem.kept_blocks);
  auto* staged = reinterpret_cast<float*>(smem + p.smem.partial);

  // Every CTA of the cluster must be running before any writes into its
  // shared memory: this CTA says so now, and waits for the others only
  // before its first remote write, so the barrier's round trip overlaps the
  // loads below.
  cluster::arrive_relaxed();
  const auto& in = p.in;
  const unsigned rank = cluster::rank();
  const int h = static_cast<int>(blockIdx.x) / S, b = blockIdx.y;
  const int t = static_cast<int>(threadIdx.x);
  const int seq = in.slots[b];
  // Step 1's query sum (dimension threadIdx.x), loaded while the slot is on
  // its way, so the chain to the length is slot -> length, not three loads.
  static_assert(D <= kSelectThreads, "one query dimension per thread");
  if (t < D) {
    const int group = in.num_q_heads / in.kv_heads;
    const Q* q = in.queries + (std::int64_t{b} * in.num_q_heads + std::int64_t{h} * group) * D + t;
    float acc = 0.0f;
    for (int g = 0; g < group; ++g) acc += to_float(q[std::int64_t{g} * D]);
    qsum[t] = acc;
  }
  const std::int64_t seq_layer = in.seq_layer(seq, in.layer);
  const std::int32_t length = in.lengths[seq_layer];
  const int F = in.fine_slice, C = in.coarse_block, spb = C / F;
  // Step 1 for M = 1: the query sits at length - 1.
  const std::int32_t ws = contract::window_begin(length - 1, p.window, F);
  const std::int32_t far_slices = contract::far_slices(ws, F);
  const std::int32_t blocks = contract::candidate_blocks(ws, C);
  if (rank == 0 && h == 0 && t == 0) p.out.window_begin[b] = ws;

  const std::int64_t head_stride = in.row_stride();
  const std::int64_t slice_offset = in.slice_row(seq_layer, h);
  const float* slice_base = in.slice_sums + slice_offset;
  const float* block_base = in.block_sums + in.block_row(seq_layer, h);
  // Step 4's candidate blocks: whole blocks use their stored sum; the block
  // holding ws (if it is partial) is scored by the sum of its far slices'
  // sums, on the warp next in line after the whole blocks.
  const std::int32_t whole = std::int64_t{blocks} * C > ws ? blocks - 1 : blocks;
  auto block_row = [&](int r) { return block_base + r * head_stride; };
  // This warp's first batch of block sums heads for L2 now, and the partial
  // block's far slices for this CTA's shared memory, so their trips from
  // HBM overlap the cluster barrier.
  row_batch<D, S>::prefetch(cluster_warp<S>(), whole,
                            [&](int u) { return block_row(cluster_warp<S>() + u * row_batch<D, S>::kStride); });
  const bool partial_warp = whole < blocks && cluster_warp<S>() == whole % (S * kSelectWarps);
  const int partial_rows = far_slices - whole * spb;  // >= 1 where whole < blocks
  const float* partial_first = slice_base + std::int64_t{whole} * spb * head_stride;
  if (partial_warp) stage_summed_row<D>(staged, partial_first, head_stride, partial_rows);
  // Blocks ranked by counting (count_top_k): the mask their bits go to
  // starts empty.
  const bool count_blocks = blocks > p.top_k_coarse && blocks <= kSelectThreads * S;
  if (count_blocks)
    for (int w = t; w < (blocks + 31) / 32; w += kSelectThreads) kept_mask[w] = 0u;

  if constexpr (S > 1) __syncthreads();  // qsum, within the CTA (the arrive was relaxed)
  cluster::wait();                         // every CTA of the cluster is running

  // Step 4: score the candidate blocks.
  auto store_block = [&](int r, float s) { broadcast<S>(coarse_scores, r, s); };
  score_rows<D, S>(
      whole, qsum, [](int r) { return r; }, block_row, 1.0f / static_cast<float>(C), store_block, [](int) {});
  if (partial_warp)
    score_summed_row<D>(staged, partial_first, head_stride, partial_rows, qsum,
                        1.0f / static_cast<float>(ws - whole * C), [&](float s) { store_block(whole, s); });
  cluster::sync();

  int kept = 0;
  const bool writer = rank == 0;
  const std::int64_t at = std::int64_t{b} * in.kv_heads + h;
  float* out_block_scores = writer && p.out.block_scores ? p.out.block_scores + at * p.top_k_coarse : nullptr;
  std::int32_t* out_blocks = writer && p.out.kept_blocks ? p.out.kept_blocks + at * p.top_k_coarse : nullptr;
  auto emit_block = [&](int pos, int block) {
    kept_blocks[pos] = block;
    if (out_blocks) out_blocks[pos] = block;
    if (out_block_scores) out_block_scores[pos] = coarse_scores[block];
  };
  if (count_blocks) {  // uniform across the cluster
    kept = count_top_k<S>(coarse_scores, keys, blocks, p.top_k_coarse, kept_mask, emit_block);
  } else if (blocks > 0 && blocks <= p.top_k_coarse) {  // every block kept
    for (int i = t; i < blocks; i += kSelectThreads) emit_block(i, i);
    kept = blocks;
    __syncthreads();
  } else if (blocks > 0) {
    mark_top_k<Wide>(coarse_scores, blocks, p.top_k_coarse, keep, keys, temp);
    kept = compact_marked<kMaxCandidates>(keep, blocks, temp.scan, emit_block);
  }
  if (out_blocks)
    for (int i = kept + t; i < p.top_k_coarse; i += kSelectThreads) {
      out_blocks[i] = -1;
      if (out_block_scores) out_block_scores[i] = -__int_as_float(0x7f800000);
    }

  if (in.dependents == launch::after_blocks) ptx::launch_dependents();

  // Step 5: the far slices of the kept blocks, in ascending slice order.
  // Candidate c is slice kept_blocks[c / spb] * spb + c % spb. Only the last
  // kept block can hold ws, and its slices past ws are the tail of the list,
  // so the real candidates are exactly the first `candidates`.
  auto slice_of = [&](int c) {
    const int j = c / spb;
    return c + (kept_blocks[j] - j) * spb;
  };
  const int candidates = kept == 0 ? 0 : contract::fine_candidates(kept, kept_blocks[kept - 1], spb, far_slices);
  // Rank 0 ranks the slices: up to 512 candidates and k <= 32 (the default
  // 32 x 16 and 16) on warp 0 from registers (warp_rank_*; one CTA barrier
  // tells the other warps whether it finished, and more than
  // kWarpRankSurvivors survivors fall back to mark_top_k). Otherwise, where
  // the warps' batches make at least 2k groups, every warp hands it the
  // maximum key of each of its batches (group j * S * kSelectWarps + warp),
  // so the ranking starts at its threshold (top_k_of_groups); otherwise
  // mark_top_k finds its own.
  using batch_t = row_batch<D, S, SumT>;
  constexpr int kFineStep = batch_t::kStride * batch_t::kRows;
  const int fine_groups = (candidates + kFineStep - 1) / kFineStep * (S * kSelectWarps);
  const bool by_warp = fits_warp_rank(candidates, p.top_k_fine);
  const bool by_groups = !by_warp && candidates > p.top_k_fine && candidates <= kFilterMaxCandidates &&
                         p.top_k_fine <= kFilterMaxK && fine_groups >= 2 * p.top_k_fine &&
                         fine_groups <= kSelectThreads;
  topk_key batch_max = kNoCandidate;
  const SumT* fine_base = in.template rows<Fine>() + slice_offset;
  score_rows<D, S, SumT>(
      candidates, qsum, slice_of, [&](int sl) { return fine_base + sl * head_stride; },
      kv::fine_summary_traits<Fine>::kMean ? 1.0f / static_cast<float>(F) : 1.0f,
      [&](int c, float s) {
        cluster::peer(fine_scores, 0u)[c] = s;
        if (by_groups) batch_max = make_key(s, c);
      },
      [&](int j) {
        if (by_groups) {  // uniform
          const topk_key m = item_max(batch_max, 32);
          if ((t & 31) == 0) cluster::peer(fine_group_max, 0u)[j * (S * kSelectWarps) + cluster_warp<S>()] = m;
          batch_max = kNoCandidate;
        }
      });
  if (in.dependents == launch::after_fine_scores) ptx::launch_dependents();
  // Only the writer (rank 0) ranks the slices, so the scores go to it alone
  // and the others leave once their scores are released: nobody reads or
  // writes their shared memory after this arrive.
  cluster::arrive();
  if (!writer) return;
  cluster::wait();

  std::int32_t* out_slices = p.out.kept_slices + at * p.top_k_fine;
  float* out_slice_scores = p.out.slice_scores ? p.out.slice_scores + at * p.top_k_fine : nullptr;
  auto emit_slice = [&](int pos, int c) {
    out_slices[pos] = slice_of(c);
    if (out_slice_scores) out_slice_scores[pos] = fine_scores[c];
  };
  int kept_slices = 0;
  if (by_warp) {  // uniform across the CTA
    // Warp 0 ranks alone; the others wait only to learn whether it could
    // (more than kWarpRankSurvivors survivors: the CTA's filter below).
    // It writes num_slices itself, before the barrier: the same write at
    // the common end below, after it, measured ~0.1 us slower (H200).
    if (t < 32) {
      const int n = warp_rank_filter(fine_scores, candidates, p.top_k_fine, keys);
      if (t == 0) fine_survivors = n;
      if (n <= kWarpRankSurvivors) {
        warp_rank_place(keys, n, p.top_k_fine, emit_slice);
        if (t == 0) p.out.num_slices[at] = p.top_k_fine;
      }
    }
    __syncthreads();
    if (fine_survivors <= kWarpRankSurvivors) return;
  }
  if (by_groups) {  // uniform across the CTA
    top_k_of_groups(fine_scores, candidates, p.top_k_fine, fine_group_max, fine_groups, keys, temp.filter,
                    emit_slice);
    kept_slices = p.top_k_fine;
  } else if (candidates > 0) {  // by_warp's fallback too
    mark_top_k<Wide>(fine_scores, candidates, p.top_k_fine, keep, keys, temp);
    kept_slices = compact_marked<kMaxCandidates>(keep, candidates, temp.scan, emit_slice);
  }
  for (int i = kept_slices + t; i < p.top_k_fine; i += kSelectThreads) {
    out_slices[i] = -1;
    if (out_slice_scores) out_slice_scores[i] = -__int_as_float(0x7f800000);
  }
  if (t == 0) p.out.num_slices[at] = kept_slices;
}

/// Whether the narrow kernel can run a stage of up to `candidates`
/// candidates and top-k: its compaction covers kFilterMaxCandidates, and
/// mark_top_k either keeps all or takes the filter.
inline bool fits_filter(std::int64_t candidates, int k) {
  return candidates <= kFilterMaxCandidates && (candidates <= k || k <= kFilterMaxK);
}

/// Whether this config and cache need the wide kernel: the coarse stage ranks
/// at most max_blocks candidates, the fine one top_k_coarse * C / F.
inline bool wide_selection(const SparseAttentionConfig& cfg, std::int32_t max_blocks) {
  return !fits_filter(max_blocks, cfg.top_k_coarse) ||
         !fits_filter(std::int64_t{cfg.top_k_coarse} * cfg.slices_per_block(), cfg.top_k_fine);
}

/// Bytes of the ranking's key scratch (filter survivors, or the wide
/// kernel's block_topk sort).
inline int selection_key_bytes(const SparseAttentionConfig& cfg, bool wide) {
  const int key_capacity =
      wide ? std::max(kFilterMaxCandidates,
                      select_block_topk::sort_capacity(std::max(cfg.top_k_coarse, cfg.top_k_fine)))
           : kFilterMaxCandidates;
  return key_capacity * static_cast<int>(sizeof(topk_key));
}

/// Dynamic shared memory of the (wide or narrow) kernel for this config and
/// cache. own_keys = false leaves the key scratch out (keys = -1): a caller
/// with shared memory idle while it ranks places the selection_key_bytes
/// there itself.
inline selection_smem plan_selection_smem(const SparseAttentionConfig& cfg, std::int32_t max_blocks, bool wide,
                                          bool own_keys = true) {
  auto align = [](int x, int a) { return (x + a - 1) / a * a; };
  const int fine = cfg.top_k_coarse * cfg.slices_per_block();
  selection_smem s;
  int at = 0;
  s.keys = own_keys ? at : -1;
  if (own_keys) at += selection_key_bytes(cfg, wide);
  s.coarse_scores = at;
  at = align(at + max_blocks * 4, 16);
  s.fine_scores = at;
  at = align(at + fine * 4, 16);
  s.kept_blocks = at;
  at = align(at + cfg.top_k_coarse * 4, 16);
  s.keep = at;
  at = align(at + std::max<int>(max_blocks, fine), 16);
  s.bytes = at;
  return s;
}

template <class Q, int D, int S>
status launch_selection(const decode_params<Q>& p, bool wide, fine_summary fine, int kv_heads, int batch,
                        cudaStream_t stream) {
  auto* kernel = dispatch_fine_summary(fine, [&](auto k) {
    return wide ? &decode_selection_kernel<Q, D, S, true, k()> : &decode_selection_kernel<Q, D, S, false, k()>;
  });
  // Every launch (a cheap host call): the static shared memory counts toward
  // the 48 KB default too, so "dynamic > 48 KB" is not the test.
  HISPARSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem.bytes));
  // Set on every launch, either way: the attribute stays with the kernel.
  HISPARSE_CUDA_TRY(cudaFuncSetAttribute(
      kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
      p.in.max_shared_carveout ? static_cast<int>(cudaSharedmemCarveoutMaxShared)
                               : static_cast<int>(cudaSharedmemCarveoutDefault)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(kv_heads * S), static_cast<unsigned>(batch));
  config.blockDim = dim3(kSelectThreads);
  config.dynamicSmemBytes = static_cast<std::size_t>(p.smem.bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if constexpr (S > 1) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = S;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  HISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, p));
  return status::success;
}

template <class Q, int D>
status launch_selection(const decode_params<Q>& p, bool wide, fine_summary fine, int kv_heads, int batch,
                        cudaStream_t stream) {
  if (!p.in.use_clusters) return launch_selection<Q, D, 1>(p, wide, fine, kv_heads, batch, stream);
  // Clusters where the loaded build is sm_90 or newer (a build without sm_90
  // code runs the single-CTA kernel on an H100). The narrow and wide kernels
  // are built for the same architectures.
  static hisparse::detail::per_device_flag built;
  const bool clusters = built.get([] {
    void (*kernel)(decode_params<Q>) = &decode_selection_kernel<Q, D, kSelectCluster, false, fine_summary::mean>;
    return hisparse::detail::kernel_built_for_sm90(reinterpret_cast<const void*>(kernel));
  });
  return clusters ? launch_selection<Q, D, kSelectCluster>(p, wide, fine, kv_heads, batch, stream)
                  : launch_selection<Q, D, 1>(p, wide, fine, kv_heads, batch, stream);
}

/// The checks decode and prefill selection share: the layer, and that the
/// cache was built with the config's slice and block sizes and within what
/// the ranking covers. `stage` names the caller in the message.
inline status check_summaries(const SparseAttentionConfig& cfg, const kv::summary_ref& a, int layer,
                              const char* stage) {
  const std::string who = std::string(stage) + " selection: ";
  if (layer < 0 || layer >= a.layers) return fail(status::invalid_argument, who + "layer out of range");
  if (a.fine_slice != cfg.fine_slice || a.coarse_block != cfg.coarse_block)
    return fail(status::invalid_argument,
                who + "the cache's slice/block sizes (" + std::to_string(a.fine_slice) + "/" +
                    std::to_string(a.coarse_block) + ") differ from the config's (" + std::to_string(cfg.fine_slice) +
                    "/" + std::to_string(cfg.coarse_block) + ")");
  if (a.max_blocks > kMaxCandidates)
    return fail(status::unsupported, who + "ranks at most 4096 blocks per sequence (the cache allows " +
                                         std::to_string(a.max_blocks) + ": lower its max_context)");
  return status::success;
}

}  // namespace detail

/// How a decode selection launches, for a composer that plans around it
/// (hierarchical_decode starts the attention beside it).
struct decode_selection_profile {
  /// CTAs per (sequence, KV head) at most: a cluster where the device and
  /// the build run clusters, else one.
  int ctas_per_head = 1;
  /// Whether the fine stage is ranked on one warp of one CTA (the other
  /// CTAs leave once the candidates are scored) or by a whole CTA.
  bool fine_ranked_by_one_warp = false;
};

/// The profile of a selection of `cfg` over a cache of `max_blocks` blocks
/// a sequence.
[[nodiscard]] inline decode_selection_profile decode_selection_launch_profile(const SparseAttentionConfig& cfg,
                                                                              std::int32_t max_blocks) {
  // The fine stage's most candidates; a stage of no more than top_k_fine
  // is kept whole, not ranked.
  const int candidates = std::min(cfg.top_k_coarse, max_blocks) * cfg.slices_per_block();
  return {detail::kSelectCluster,
          candidates <= cfg.top_k_fine || detail::fits_warp_rank(candidates, cfg.top_k_fine)};
}

/// Checks a decode selection before any work: the config, the problem, and
/// that the cache was built with the config's slice and block sizes.
template <class Q>
[[nodiscard]] status can_implement_decode_selection(const SparseAttentionConfig& cfg,
                                                    const decode_selection_arguments<Q>& a) {
  HISPARSE_TRY(check(cfg));
  HISPARSE_TRY(check(attention_shape{a.num_q_heads, a.kv_heads, a.head_dim}));
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "decode selection: " + why); };
  if (a.batch < 1) return bad("batch is empty");
  if (a.queries == nullptr || a.slots == nullptr || a.slice_sums == nullptr || a.block_sums == nullptr ||
      a.lengths == nullptr)
    return bad("queries, slots and the cache's summaries must not be null");
  using launch = typename decode_selection_arguments<Q>::dependents_launch;
  if (static_cast<unsigned>(a.dependents) > static_cast<unsigned>(launch::after_fine_scores))
    return bad("dependents is not one of at_start, after_blocks, after_fine_scores");
  if (!a.keeps(cfg.fine_summary))
    return bad("the config's fine_summary is " + std::string(name_of(cfg.fine_summary)) +
               " and the cache does not keep it (paged_kv_cache_options::fine_summary is " +
               std::string(name_of(a.fine)) + ")");
  return detail::check_summaries(cfg, a, a.layer, "decode");
}

/// The same, and that the outputs the kernel always writes are set.
template <class Q>
[[nodiscard]] status can_implement_decode_selection(const SparseAttentionConfig& cfg,
                                                    const decode_selection_arguments<Q>& a,
                                                    const decode_selection_output& out) {
  HISPARSE_TRY(can_implement_decode_selection(cfg, a));
  if (out.kept_slices == nullptr || out.num_slices == nullptr || out.window_begin == nullptr)
    return fail(status::invalid_argument,
                "decode selection: kept_slices, num_slices and window_begin outputs must not be null");
  return status::success;
}

/// One decode step's selection for a batch: one launch, no sync, no
/// allocation (capturable in a CUDA graph with slots and lengths as inputs).
template <class Q>
[[nodiscard]] status select_decode_async(const SparseAttentionConfig& cfg, const decode_selection_arguments<Q>& a,
                                         const decode_selection_output& out, cudaStream_t stream = nullptr) {
  HISPARSE_TRY(can_implement_decode_selection(cfg, a, out));
  const bool wide = detail::wide_selection(cfg, a.max_blocks);
  detail::selection_smem smem = detail::plan_selection_smem(cfg, a.max_blocks, wide);
  smem.partial = smem.bytes;
  smem.bytes += detail::kPartialBytes;
  const detail::decode_params<Q> p{a, out, cfg.window, cfg.top_k_coarse, cfg.top_k_fine, smem};
  return dispatch_head_dim(a.head_dim, [&](auto d) {
    return detail::launch_selection<Q, d()>(p, wide, cfg.fine_summary, a.kv_heads, a.batch, stream);
  });
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

/// `prefix template` of select_decode_async for queries Q (core/macros.hpp:
/// HISPARSE_EXTERN_TEMPLATES).
#define HISPARSE_SELECT_DECODE_INSTANCE(prefix, Q)                                                        \
  prefix template ::hisparse::status hisparse::select::select_decode_async<Q>(                          \
      const ::hisparse::SparseAttentionConfig&, const ::hisparse::select::decode_selection_arguments<Q>&, \
      const ::hisparse::select::decode_selection_output&, cudaStream_t);
#if defined(HISPARSE_EXTERN_TEMPLATES)
HISPARSE_SELECT_DECODE_INSTANCE(extern, __nv_bfloat16)
HISPARSE_SELECT_DECODE_INSTANCE(extern, __half)
#endif
