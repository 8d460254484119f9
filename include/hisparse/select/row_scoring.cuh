#pragma once
// Row scoring for the selection kernels: a warp scores candidate rows (a
// block's or a slice's key sum, its bf16 rounding, or its key bounds)
// against the group-summed query, 16-byte loads, several rows in flight per
// lane (row_batch, score_rows), and the partial block's far slices staged
// and summed (stage_summed_row, score_summed_row). Every row goes through
// the same arithmetic, so equal summaries score equal wherever they are
// scored.

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/select/selection_cta.cuh"
#include "hisparse/select/topk.cuh"

namespace hisparse::select::detail {

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

/// Loads this lane's kPer consecutive floats of a row staged in shared memory.
template <int kPer>
__device__ __forceinline__ void load_staged_lane(const float* row, float (&v)[kPer]) {
  if constexpr (kPer == 2) {
    const float2 x = *reinterpret_cast<const float2*>(row);
    v[0] = x.x, v[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < kPer; i += 4) {
      const float4 x = *reinterpret_cast<const float4*>(row + i);
      v[i] = x.x, v[i + 1] = x.y, v[i + 2] = x.z, v[i + 3] = x.w;
    }
  }
}

inline constexpr int kPartialBytes = tuning::kPartialBytes;
template <int D>
inline constexpr int kPartialRows = kPartialBytes / (D * 4);

/// Starts copying the first min(n, kPartialRows) of the n rows at rows + j *
/// stride into `staged` (the calling warp's lanes split the 16-byte chunks)
/// and prefetches the rest into L2; score_summed_row (or, for key_bounds
/// rows, score_bounds_union) waits for them.
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
    float x[kPer];
    load_staged_lane<kPer>(staged + j * D + lane * kPer, x);
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] += x[i];
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

/// Scores, on the calling warp, the key range that is the union of the n
/// key_bounds rows at rows + j * stride (the partial block's far slices,
/// coarse_summary key_bounds), through a whole row's arithmetic
/// (lane_bounds, then the warp sum): a range scores the same whether it
/// was stored or combined here. The first kPartialRows rows come from
/// `staged` (after stage_summed_row on the same rows), the rest from global
/// memory. `store(score)` runs in lane 0.
template <int D, class Store>
__device__ void score_bounds_union(const float* staged, const std::uint32_t* rows, std::int64_t stride, int n,
                                   const float* qsum, Store store) {
  constexpr int kPer = D / 32;
  constexpr int kRowsInFlight = 32 / kPer;  // 128 bytes of loads in flight per lane
  const int lane = threadIdx.x & 31;
  // The union of decoded bounds, encoded once: the same words as widening
  // word by word (bf16 values encode exactly), in a few instructions a row.
  float lo[kPer], hi[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) lo[i] = INFINITY, hi[i] = -INFINITY;
  auto unite = [&](const float (&x)[kPer]) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      lo[i] = nan_min(lo[i], key_bounds_lo(__float_as_uint(x[i])));
      hi[i] = nan_max(hi[i], key_bounds_hi(__float_as_uint(x[i])));
    }
  };
  const int in_smem = min(n, kPartialRows<D>);
  ptx::cp_async_wait<0>();
  __syncwarp();  // every lane's chunks are in
#pragma unroll 1
  for (int j = 0; j < in_smem; ++j) {
    float x[kPer];
    load_staged_lane<kPer>(staged + j * D + lane * kPer, x);
    unite(x);
  }
#pragma unroll 1
  for (int j0 = in_smem; j0 < n; j0 += kRowsInFlight) {
    float x[kRowsInFlight][kPer];
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j)
      if (j0 + j < n) load_lane<kPer>(rows + (j0 + j) * stride + lane * kPer, x[j]);
#pragma unroll
    for (int j = 0; j < kRowsInFlight; ++j)
      if (j0 + j < n) unite(x[j]);
  }
  float w[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) w[i] = __uint_as_float(key_bounds_word(lo[i], hi[i]));
  float q[kPer];
  unsigned sel[kPer];
  load_q(qsum, q);
  bounds_selectors(q, sel);
  const float s = warp_sum(lane_bounds(q, sel, w));
  if (lane == 0) store(s);
}

/// Stores a score into the same slot of every CTA of the cluster.
template <int S>
__device__ __forceinline__ void broadcast(float* scores, int r, float s) {
#pragma unroll
  for (int c = 0; c < S; ++c) cluster_ops<S>::peer(scores, static_cast<unsigned>(c))[r] = s;
}

}  // namespace hisparse::select::detail
