#pragma once
// Prefill attention over a paged KV cache (DESIGN.md section 1, step 6, for
// query tiles of M positions), in two modes:
//  * sparse: the query at p attends the kept slices of its tile and KV head
//    (select/prefill_selection.cuh) followed by the window [ws, p];
//  * dense: every key [0, p] -- the in-library causal baseline.
// One CTA per query tile and one or two query heads of a KV head (two where
// the GQA group pairs them, so every K and V tile it loads feeds both
// heads). The CTA streams the tile's key rows -- the kept slices, then the
// window up to the tile's last query -- through a ring of K and V tiles
// filled by cp.async (a kept slice is one page: whole-row 16-byte copies),
// and per tile takes FlashAttention-2's step with fp32 accumulation: S =
// Q K^T, the causal mask on the tiles that reach past a warp's first query,
// an online softmax in exp2 (its running max lagging by up to 2^8 unless P
// is rounded to 8 bits, so most tiles leave O alone), O = O corr + P V
// with S's accumulators as P's A operand (pv_precision: P split in two
// halves, in fp16 against an fp16 copy of V, or rounded once). Two kernels
// share that loop (prefill_kernel):
//  * Hopper (sm_90a): a warpgroup a head, wgmma with Q, K and V read from
//    shared memory in the 128-byte swizzle and P from registers, 128-key
//    tiles (tuning::kPrefillTileSm90);
//  * portable (sm_80+): 16 query rows a warp, mma.sync m16n8k16 fed by
//    ldmatrix, the tile policy's block_kv-key tiles.
// The grid runs the last tile first, so the longest causal rows start
// first, and a tile's query heads side by side, so the GQA group's K/V
// loads meet in L2.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/dispatch.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/gpu_limits.hpp"
#include "hisparse/core/kernel_build.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/tile_policy.hpp"
#include "hisparse/select/prefill_selection.cuh"
#include "hisparse/tuning.hpp"

namespace hisparse::attention {

inline constexpr tile_policy kPrefillTile = tuning::kPrefillTile;  ///< the default prefill tile (tuning.hpp)

/// How the softmax weights P enter P V on the tensor cores.
enum class pv_precision {
  /// P = hi + lo, both in the KV type (hi truncated, lo the rounded
  /// residual): ~16 bits of each weight, the decode kernel's accuracy, held
  /// to DESIGN.md section 6's rule against an fp32 naive attention. Twice
  /// the P V products (each V fragment feeds both).
  split,
  /// P rounded once to the KV type (8 bits in bf16): FlashAttention's
  /// precision, whose error on short rows (a few keys carry the softmax)
  /// exceeds twice the fp32 naive's.
  rounded,
  /// For a bf16 cache on the Hopper kernel: P rounded once to fp16 (11
  /// bits, 8x finer than bf16; held to the same rule as split) and one P V
  /// product in fp16, each V tile copied to fp16 in shared memory (exact
  /// for 0 and |v| in [2^-14, 65504], at most 2^-25 off below); a tile
  /// holding a value fp16 cannot carry (|v| >= 65536, Inf, NaN) takes
  /// split. Elsewhere split: against an fp16 output's rounding, P's 11 bits
  /// are not enough, and the portable kernel has no copy.
  fp16,
};

/// The default: split's accuracy rule at one P V product where the Hopper
/// kernel can copy V (docs/PERF_NOTES.md, Prefill attention).
inline constexpr pv_precision kPrefillPv = pv_precision::fp16;

/// Which kernel runs a prefill attention.
enum class prefill_kernel {
  /// The Hopper kernel where it can run (an sm_90 device, a build for
  /// sm_90a, head_dim 64 or 128), else the portable one.
  automatic,
  /// mma.sync (sm_80+), any head_dim and tile policy.
  portable,
  /// wgmma (sm_90a), tile tuning::kPrefillTileSm90; an error where it
  /// cannot run.
  hopper,
  /// The warp-specialised Hopper kernel (a producer warpgroup, two
  /// consumers in ping-pong; two heads a CTA, sm_90a, head_dim 64 or 128):
  /// the same results, not the default (slower where measured; PERF_NOTES:
  /// Prefill attention).
  hopper_ws,
};

/// One prefill attention over the segments of a prefill selection (the same
/// segments, laid out by select::layout_prefill_segments). Sparse when
/// `top_k_fine` > 0: the kept slices of the selection of each (tile, KV
/// head) and the window of `window` tokens before each tile (DESIGN.md
/// section 1); dense (every key up to the query) otherwise.
template <class T>
struct prefill_attention_arguments {
  const T* queries = nullptr;  ///< [total queries][num_q_heads][head_dim]
  const select::prefill_segment* segments = nullptr;  ///< device
  int num_segments = 0;
  int num_tiles = 0;   ///< the segments' tiles (layout_prefill_segments)
  int query_tile = 0;  ///< M: the selection's query tile
  int layer = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<T> cache{};
  const std::int32_t* kept_slices = nullptr;  ///< [num_tiles][kv_heads][top_k_fine], -1 padded
  const std::int32_t* num_slices = nullptr;   ///< [num_tiles][kv_heads]
  int top_k_fine = 0;                         ///< > 0: sparse
  int window = 0;                             ///< W, tokens (sparse)
  float softmax_scale = 0.0f;                 ///< 0: 1 / sqrt(head_dim)
  /// Query heads a CTA takes: 0 the library's choice (two where the group
  /// pairs them and head_dim <= 128), 1 or 2 to force it (2 needs both).
  int heads_per_cta = 0;
  prefill_kernel kernel = prefill_kernel::automatic;
  T* out = nullptr;                           ///< [total queries][num_q_heads][head_dim]
  float* lse = nullptr;                       ///< optional [total queries][num_q_heads], natural log

  [[nodiscard]] HISPARSE_HOST_DEVICE bool sparse() const { return top_k_fine > 0; }
};

namespace detail {

/// Rows of a query tile each warp takes: one m16n8k16 A operand.
inline constexpr int kPrefillWarpRows = 16;
/// Page pointers a CTA keeps in shared memory (a dense row refills it).
inline constexpr int kPrefillPageRing = 64;
inline constexpr float kPrefillLog2e = 1.4426950408889634f;
inline constexpr float kPrefillLn2 = 0.6931471805599453f;
/// log2 of how far a row's running max may lag its true max where P keeps
/// 11 bits or more (weights up to 2^8: in range for fp16 and bf16 P;
/// prefill_softmax_step).
inline constexpr float kPrefillMaxLagLog2 = 8.0f;

/// Bytes of a tile of `rows` rows of head_dim elements.
HISPARSE_HOST_DEVICE constexpr int prefill_tile_bytes(int rows, int head_dim, int elem_bytes) {
  return rows * head_dim * elem_bytes;
}
/// Dynamic shared memory: the Q rows of `heads` heads, then `stages` x
/// (K tile | V tile).
HISPARSE_HOST_DEVICE constexpr int prefill_smem_bytes(tile_policy tile, int heads, int stages, int head_dim,
                                                      int elem_bytes) {
  return prefill_tile_bytes(heads * tile.block_q, head_dim, elem_bytes) +
         stages * 2 * prefill_tile_bytes(tile.block_kv, head_dim, elem_bytes);
}

template <class T>
struct prefill_attention_params {
  prefill_attention_arguments<T> a;
  int group;         ///< query heads per KV head
  int stages;        ///< ring depth (<= the tile's)
  float scale_log2;  ///< softmax scale * log2(e)
};

using ptx::cp_async_16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::cp_async_wait_at_most;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_16816;
using ptx::pack2;
using ptx::smem_address;

/// What one CTA attends: query heads hq0 .. hq0 + Heads - 1 (of KV head h)
/// at the positions p0 .. p_last of one query tile, over the tile's key
/// rows: n_kept kept slices, then the window [ws, p_last]. Key row g is
/// causal-visible to the query at p0 + q when g <= visible0 + q.
struct prefill_cta_task {
  int hq0, h, p0, q_rows, p_last;
  std::int64_t q_row0;     ///< the query row of position p0
  std::int64_t seq_layer;  ///< the cache's (sequence, layer) row
  std::int32_t ws;
  const std::int32_t* kept;
  int n_kept, kept_rows, total_rows, visible0;
};

/// The task of this CTA (grid x: (tile, group of Heads query heads of one
/// KV head) pairs, the last tile's first). False where its inputs cannot be
/// attended: a chunk off a tile boundary, a cache short of the queries' own
/// keys, a kept count or slice the selection cannot have written; then the
/// CTA has written the task's rows NaN (never a silent drop or a read past
/// the cache). Every thread of the CTA calls it.
template <class T, int D, int Heads, int Threads>
__device__ __forceinline__ bool prefill_cta_begin(const prefill_attention_params<T>& p, prefill_cta_task& w) {
  const auto& a = p.a;
  const auto& c = a.cache;
  const int Hq = a.num_q_heads, M = a.query_tile, F = c.fine_slice;
  const int head_groups = Hq / Heads;
  const std::int64_t pair = std::int64_t{a.num_tiles} * head_groups - 1 - blockIdx.x;
  const int tile = static_cast<int>(pair / head_groups);
  w.hq0 = static_cast<int>(pair % head_groups) * Heads;
  w.h = w.hq0 / p.group;

  // The segment holding the tile: the last with tile_offset <= tile.
  int lo = 0, hi = a.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.segments[mid].tile_offset <= tile) lo = mid;
    else hi = mid - 1;
  }
  const select::prefill_segment seg = a.segments[lo];
  w.p0 = (seg.q_begin / M + (tile - seg.tile_offset)) * M;
  w.q_rows = min(M, seg.q_begin + seg.num_queries - w.p0);
  w.p_last = w.p0 + w.q_rows - 1;
  w.q_row0 = std::int64_t{seg.query_offset} + (w.p0 - seg.q_begin);
  w.seq_layer = c.seq_layer(seg.slot, a.layer);
  const std::int32_t len = c.lengths[w.seq_layer];
  w.ws = a.sparse() ? contract::window_begin(w.p0, a.window, F) : 0;
  const std::int64_t at = std::int64_t{tile} * c.kv_heads + w.h;
  w.kept = a.sparse() ? a.kept_slices + at * a.top_k_fine : nullptr;
  w.n_kept = a.sparse() ? a.num_slices[at] : 0;
  w.kept_rows = w.n_kept * F;
  w.total_rows = w.kept_rows + (w.p_last + 1 - w.ws);
  w.visible0 = w.p0 - w.ws + w.kept_rows;

  bool bad = seg.q_begin % M != 0 || w.q_rows < 1 || len < w.p_last + 1 || w.n_kept < 0 || w.n_kept > a.top_k_fine;
  if (!bad)
    for (int i = threadIdx.x; i < w.n_kept; i += Threads) bad |= w.kept[i] < 0 || w.kept[i] >= w.ws / F;
  if (!__syncthreads_or(bad)) return true;
  const float kNaN = __int_as_float(0x7fffffff);
  const int r_lo = max(0, seg.q_begin - w.p0);  // a segment off a boundary starts inside its first tile
  for (int i = r_lo * Heads * D + threadIdx.x; i < w.q_rows * Heads * D; i += Threads) {
    const std::int64_t row = (w.q_row0 + i / (Heads * D)) * Hq + w.hq0 + i / D % Heads;
    a.out[row * D + i % D] = from_float<T>(kNaN);
    if (a.lse != nullptr && i % D == 0) a.lse[row] = kNaN;
  }
  return false;
}

/// Streams a task's query and key rows into shared memory by cp.async,
/// Threads threads together. Key row g is item g / F (kept item i < n_kept
/// is slice kept[i], window item i is slice ws / F + i - n_kept) at row
/// g % F of its page; the page pointers pass through a ring in shared
/// memory, refilled CTA-wide. A tile of R rows is stored in one of two
/// layouts, each with 16-byte chunk c of a 128-byte row segment at chunk
/// c ^ (r % 8) (no bank conflicts for ldmatrix, wgmma's 128-byte swizzle):
/// whole rows one after another (ldmatrix), or D / 64 column blocks of R
/// 128-byte rows (wgmma's canonical layout; the same where D = 64).
template <class T, int D, int Threads, bool ColumnBlocks>
struct prefill_loader {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  static constexpr int kChunks = D / kVec;
  static constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  static constexpr int kRowsPerPass = Threads / kChunks;
  static_assert(kChunks >= 8 && Threads % kChunks == 0, "a row is at least 8 chunks (the swizzle), a pass whole rows");

  /// Byte offset of chunk c of row r in a tile of R rows.
  template <int R>
  static __device__ __forceinline__ unsigned offset(int r, int c) {
    const int swizzled = (c & ~7) | ((c ^ r) & 7);
    if constexpr (ColumnBlocks) return static_cast<unsigned>((swizzled >> 3) * R * 128 + r * 128 + ((swizzled & 7) << 4));
    return static_cast<unsigned>(r * kRowBytes + (swizzled << 4));
  }

  const prefill_cta_task& w;
  const kv::paged_kv_ref<T>& cache;
  const T** pages;  ///< the ring, kPrefillPageRing entries of shared memory
  int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  int page_base = 0, page_end = 0;
  /// The barrier the loading threads share: 0 the CTA's, else named
  /// barrier bar_id of Threads threads (a producer warpgroup).
  unsigned bar_id = 0;

  /// The Q rows of Heads heads, RowsPerHead positions each (BlockQ-row
  /// tiles one after another); rows past the tile's queries are zero.
  template <int Heads, int RowsPerHead>
  __device__ __forceinline__ void load_queries(const T* queries, int num_q_heads, unsigned dst) const {
    static_assert((Heads * RowsPerHead) % kRowsPerPass == 0);
#pragma unroll
    for (int pass = 0; pass < Heads * RowsPerHead / kRowsPerPass; ++pass) {
      const int r = row_in_pass + pass * kRowsPerPass, q = r % RowsPerHead;
      const bool live = q < w.q_rows;
      const T* src = queries + ((w.q_row0 + (live ? q : 0)) * num_q_heads + w.hq0 + r / RowsPerHead) * D + chunk * kVec;
      cp_async_16(dst + static_cast<unsigned>(r / RowsPerHead * RowsPerHead * kRowBytes) + offset<RowsPerHead>(q, chunk),
                  src, live ? 16 : 0);
    }
  }

  /// Issues the task's key rows [t BlockKv, (t + 1) BlockKv): their keys
  /// as a tile at kdst and their values at vdst; rows past the task's are
  /// zero (and masked). Uniform across the CTA (it may refill the page ring).
  template <int BlockKv>
  __device__ __forceinline__ void load_kv(int t, unsigned kdst, unsigned vdst, const void* zero_src) {
    static_assert(BlockKv % kRowsPerPass == 0);
    const int F = cache.fine_slice;
    const int row0 = t * BlockKv, end = min(w.total_rows, row0 + BlockKv);
    const int f_shift = (F & (F - 1)) == 0 ? __ffs(F) - 1 : -1;
    const int first = f_shift >= 0 ? row0 >> f_shift : row0 / F;
    const int last = f_shift >= 0 ? (end - 1) >> f_shift : (end - 1) / F;
    if (first < page_base || last >= page_end) fill_pages(first);
    const std::int64_t head = w.h * cache.head_tile_elems(), v_offset = cache.value_offset();
    if constexpr (kRowsPerPass % 8 == 0) {
      // A whole tile over power-of-two slices holding whole passes: a pass
      // is one page's rows, and this thread's chunk sits at one swizzle, so
      // a pass costs a page pointer and two copies.
      if (f_shift >= 0 && F % kRowsPerPass == 0 && end == row0 + BlockKv) {
        constexpr unsigned kPassBytes = kRowsPerPass * (ColumnBlocks ? 128 : kRowBytes);
        const unsigned off0 = offset<BlockKv>(row_in_pass, chunk);
        const std::int64_t lane = head + std::int64_t{row_in_pass} * D + chunk * kVec;
#pragma unroll
        for (int pass = 0; pass < BlockKv / kRowsPerPass; ++pass) {
          const int g0 = row0 + pass * kRowsPerPass;
          const T* src = pages[(g0 >> f_shift) - page_base] + lane + std::int64_t{g0 & (F - 1)} * D;
          cp_async_16(kdst + off0 + pass * kPassBytes, src, 16);
          cp_async_16(vdst + off0 + pass * kPassBytes, src + v_offset, 16);
        }
        return;
      }
    }
#pragma unroll
    for (int pass = 0; pass < BlockKv / kRowsPerPass; ++pass) {
      const int r = row_in_pass + pass * kRowsPerPass;
      const int g = row0 + r;
      const unsigned off = offset<BlockKv>(r, chunk);
      const bool live = g < w.total_rows;
      const T* src = static_cast<const T*>(zero_src);
      if (live) {
        const int item = f_shift >= 0 ? g >> f_shift : g / F;
        src = pages[item - page_base] + head + std::int64_t{g - item * F} * D + chunk * kVec;
      }
      cp_async_16(kdst + off, src, live ? 16 : 0);
      cp_async_16(vdst + off, live ? src + v_offset : src, live ? 16 : 0);
    }
  }

  /// f(offset) for each chunk of a BlockKv-row tile this thread copies
  /// (load_kv): after its own cp.async group is waited for, the thread
  /// reads them without a barrier.
  template <int BlockKv, class F>
  __device__ __forceinline__ void for_own_chunks(F f) const {
#pragma unroll
    for (int pass = 0; pass < BlockKv / kRowsPerPass; ++pass) f(offset<BlockKv>(row_in_pass + pass * kRowsPerPass, chunk));
  }

  /// load_kv of tile t into stage t % stages of a ring of (K tile | V tile)
  /// pairs at ring_base.
  template <int BlockKv>
  __device__ __forceinline__ void load_ring(int t, int stages, unsigned ring_base, const void* zero_src) {
    constexpr int kTileBytes = BlockKv * kRowBytes;
    const unsigned dst = ring_base + static_cast<unsigned>((t % stages) * 2 * kTileBytes);
    load_kv<BlockKv>(t, dst, dst + kTileBytes, zero_src);
  }

 private:
  __device__ __forceinline__ void sync() const {
    if (bar_id == 0) __syncthreads();
    else ptx::named_barrier_sync(bar_id, Threads);
  }
  __device__ __forceinline__ void fill_pages(int first) {
    sync();  // nobody still reads the old pointers
    const int F = cache.fine_slice;
    const int items = w.n_kept + (w.p_last / F - w.ws / F + 1);
    page_base = first;
    page_end = min(items, first + kPrefillPageRing);
    for (int i = threadIdx.x; i < page_end - page_base; i += Threads) {
      const int item = page_base + i;
      pages[i] = cache.page(w.seq_layer, item < w.n_kept ? w.kept[item] : w.ws / F + item - w.n_kept);
    }
    sync();
  }
};

/// One query row's online softmax over a tile of scores, FlashAttention-2's
/// step in exp2: s (the row's scores this lane holds, N of them, masked ones
/// -inf) becomes the weights exp2(s scale - m), and m and this lane's sum l
/// move on. With Lag, m moves to the tile's max only when that exceeds it
/// by more than 2^kPrefillMaxLagLog2 (FlashAttention-4's rule), so weights
/// stay at most 2^8, which P carries in fp16 or bf16, and most tiles leave
/// the output alone. Without (P rounded once to 8 bits), m is the row's max
/// so far, whose weight 1 is exact: FlashAttention's precision. Returns the
/// factor that rescales the row's output: exactly 1 where m did not move.
/// The row's four lanes (lane ^ 1, lane ^ 2) agree on its max.
template <int N, int Stride, bool Lag>
__device__ __forceinline__ float prefill_softmax_step(float* s, float& m, float& l, float scale_log2) {
  const float kNegInf = -__int_as_float(0x7f800000);
  float mx = kNegInf;
#pragma unroll
  for (int n = 0; n < N; ++n) mx = fmaxf(mx, fmaxf(s[n * Stride], s[n * Stride + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
  float corr = 1.0f;
  if (mx * scale_log2 > m + (Lag ? kPrefillMaxLagLog2 : 0.0f)) {  // from m = -inf: the first unmasked score
    corr = ptx::exp2_ftz(m - mx * scale_log2);
    m = mx * scale_log2;
  }
  const float m_use = m == kNegInf ? 0.0f : m;  // every key masked so far: all weights 0
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    s[n * Stride] = ptx::exp2_ftz(fmaf(s[n * Stride], scale_log2, -m_use));
    s[n * Stride + 1] = ptx::exp2_ftz(fmaf(s[n * Stride + 1], scale_log2, -m_use));
    sum += s[n * Stride] + s[n * Stride + 1];
  }
  l = fmaf(l, corr, sum);
  return corr;
}

/// Rescales a lane's output accumulators (D / 8 groups of four: a pair of
/// its first row, then a pair of its second) by corr of the row, where some
/// row of the warp moved its max (a warp-uniform branch).
template <int D>
__device__ __forceinline__ void prefill_rescale(float* o, const float (&corr)[2]) {
  if (!__any_sync(0xFFFFFFFFu, corr[0] != 1.0f || corr[1] != 1.0f)) return;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    o[4 * n] *= corr[0];
    o[4 * n + 1] *= corr[0];
    o[4 * n + 2] *= corr[1];
    o[4 * n + 3] *= corr[1];
  }
}

/// P's m16n8k16 A operand for keys [16 j, 16 j + 16) of a lane's two rows
/// from the scores' accumulator layout (x: keys 16 j.., y: keys 16 j + 8..,
/// four values each): rounded once, or (SplitP) hi truncated and lo its
/// rounded residual, so P keeps ~16 bits, not 8 (bf16).
template <class T, bool SplitP>
__device__ __forceinline__ void prefill_p_operand(const float* x, const float* y, unsigned (&hi)[4], unsigned (&lo)[4]) {
  if constexpr (SplitP) {
    hi[0] = ptx::pack2_rz<T>(x[0], x[1]);
    hi[1] = ptx::pack2_rz<T>(x[2], x[3]);
    hi[2] = ptx::pack2_rz<T>(y[0], y[1]);
    hi[3] = ptx::pack2_rz<T>(y[2], y[3]);
    lo[0] = ptx::pack2_residual<T>(x[0], x[1], hi[0]);
    lo[1] = ptx::pack2_residual<T>(x[2], x[3], hi[1]);
    lo[2] = ptx::pack2_residual<T>(y[0], y[1], hi[2]);
    lo[3] = ptx::pack2_residual<T>(y[2], y[3], hi[3]);
  } else {
    hi[0] = pack2<T>(x[0], x[1]);
    hi[1] = pack2<T>(x[2], x[3]);
    hi[2] = pack2<T>(y[0], y[1]);
    hi[3] = pack2<T>(y[2], y[3]);
  }
}

/// A query row's sum over its four lanes (lane ^ 1, lane ^ 2).
__device__ __forceinline__ float prefill_row_sum(float l) {
  l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
  return l + __shfl_xor_sync(0xFFFFFFFFu, l, 2);
}

/// Writes a lane's part of one output row: out = O / l (o: D / 8 pairs,
/// Stride apart, dims 8 n + qc and + 1), and from the lane holding dim 0
/// lse = (m + log2 l) ln 2. l is the row's whole sum.
template <class T, int D, int Stride>
__device__ __forceinline__ void prefill_store_row(const prefill_attention_arguments<T>& a, std::int64_t row,
                                                  const float* o, float m, float l, int qc) {
  const float inv = 1.0f / l;
  auto* dst = reinterpret_cast<unsigned*>(a.out + row * D + qc);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dst[4 * n] = pack2<T>(o[n * Stride] * inv, o[n * Stride + 1] * inv);
  if (a.lse != nullptr && qc == 0) a.lse[row] = (m + log2f(l)) * kPrefillLn2;
}

/// The portable kernel (mma.sync, sm_80+). A CTA's rows are its heads'
/// queries, head after head (block_q = 16 x Warps rows each); warp w takes
/// rows [16 MTiles w, 16 MTiles (w + 1)), MTiles m16 tiles that share every
/// K and V fragment it loads. Dynamic shared memory: the Q rows, then the
/// ring, `stages` x (K tile | V tile) of BlockKv whole rows.
template <class T, int D, int Warps, int BlockKv, int MaxStages, int MTiles, bool SplitP>
__global__ void __launch_bounds__(Warps * 32, tuning::prefill_attention_ctas_per_sm(D, MTiles))
    prefill_attention_kernel(const __grid_constant__ prefill_attention_params<T> p) {
  constexpr int kThreads = Warps * 32;
  constexpr int kBlockQ = Warps * kPrefillWarpRows;  // query positions per head
  constexpr int kRows = MTiles * kBlockQ;           // Q rows of the CTA: MTiles heads
  constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  constexpr int kQBytes = kRows * kRowBytes;
  constexpr int kTileBytes = BlockKv * kRowBytes;
  constexpr int kKSteps = D / 16;       // k-steps of Q K^T
  constexpr int kSTiles = BlockKv / 8;  // n-tiles of S
  constexpr int kOTiles = D / 8;        // n-tiles of O
  static_assert(BlockKv % 16 == 0, "P V takes the tile's keys 16 at a time");
  using loader_t = prefill_loader<T, D, kThreads, false>;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ const T* pages[kPrefillPageRing];

  const auto& a = p.a;
  prefill_cta_task w;
  if (!prefill_cta_begin<T, D, MTiles, kThreads>(p, w)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = (w.total_rows + BlockKv - 1) / BlockKv;
  const unsigned smem_base = smem_address(smem);
  const unsigned ring_base = smem_base + kQBytes;
  const int stages = p.stages;
  loader_t load{w, a.cache, pages};
  load.template load_queries<MTiles, kBlockQ>(a.queries, a.num_q_heads, smem_base);

  // Per lane and m-tile i: rows 16 (MTiles warp + i) + lane / 4 and + 8 of
  // the CTA, key columns 8n + qc (+1) of S, output dims 8n + qc (+1).
  const int qr = lane >> 2, qc = (lane & 3) * 2;
  float m[MTiles][2], l[MTiles][2];  // running max (scaled, log2) and this lane's sum
  float o[MTiles][kOTiles][4];
  int vis[MTiles][2];  // the last key row each of this lane's query rows sees (causal)
  bool live[MTiles];   // the m-tile holds a query of the tile
#pragma unroll
  for (int i = 0; i < MTiles; ++i) {
    const int q = (16 * (MTiles * warp + i)) % kBlockQ;
    live[i] = q < w.q_rows;
    vis[i][0] = w.visible0 + q + qr;
    vis[i][1] = w.visible0 + q + qr + 8;
    m[i][0] = m[i][1] = kNegInf;
    l[i][0] = l[i][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.0f;
  }
  const bool warp_live = live[0];  // m-tiles past the tile's queries only help load
  const int warp_first_visible = vis[0][0] - qr;
  // ldmatrix addresses. Q (A, row-major): row 16 (MTiles warp + i) + lane %
  // 16, chunk half lane / 16. K (B, non-transposed): key row 8 (lane / 16)
  // + lane % 8, chunk half (lane / 8) % 2. V (B, transposed): key row
  // 8 ((lane / 8) % 2) + lane % 8, chunk half lane / 16. A row's swizzle is
  // row & 7 = lane & 7.
  const unsigned q_lane = smem_base + static_cast<unsigned>((16 * MTiles * warp + (lane & 15)) * kRowBytes);
  const unsigned k_lane = static_cast<unsigned>((((lane >> 4) << 3) + (lane & 7)) * kRowBytes);
  const unsigned v_lane = static_cast<unsigned>(kTileBytes + ((((lane >> 3) & 1) << 3) + (lane & 7)) * kRowBytes);
  const int q_half = lane >> 4, k_half = (lane >> 3) & 1, v_half = lane >> 4, swz = lane & 7;

  // Tile t is issued stages - 1 tiles ahead of its use; Q rides with the
  // first group.
  for (int t = 1 - stages;; ++t) {
    if (t >= 0) {
      if (stages >= 2) cp_async_wait_at_most<MaxStages>(stages - 2);
      __syncthreads();
    }
    if (t >= tiles) break;
    const int next = t + stages - 1;
    if (next < tiles) load.template load_ring<BlockKv>(next, stages, ring_base, a.queries);
    cp_async_commit();
    if (t < 0) continue;
    if (stages == 1) {
      cp_async_wait<0>();
      __syncthreads();
    }
    if (!warp_live) continue;
    const unsigned base = ring_base + static_cast<unsigned>((t % stages) * 2 * kTileBytes);

    // S = Q K^T: MTiles x 16 query rows by BlockKv keys.
    float s[MTiles][kSTiles][4];
#pragma unroll
    for (int i = 0; i < MTiles; ++i)
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < kKSteps; ++k) {
      unsigned qa[MTiles][4];
#pragma unroll
      for (int i = 0; i < MTiles; ++i)
        ldmatrix_x4(q_lane + static_cast<unsigned>(i * 16 * kRowBytes + (((2 * k + q_half) ^ swz) << 4)), qa[i]);
#pragma unroll
      for (int n2 = 0; n2 < kSTiles / 2; ++n2) {
        unsigned bk[4];
        ldmatrix_x4(base + k_lane + static_cast<unsigned>(n2 * 16 * kRowBytes + (((2 * k + k_half) ^ swz) << 4)),
                    bk);
#pragma unroll
        for (int i = 0; i < MTiles; ++i) {
          mma_16816<T>(s[i][2 * n2], qa[i], bk[0], bk[1], s[i][2 * n2]);
          mma_16816<T>(s[i][2 * n2 + 1], qa[i], bk[2], bk[3], s[i][2 * n2 + 1]);
        }
      }
    }
    // The causal mask, on the tiles that reach past the warp's first query's
    // visible rows (the last one or two of the window).
    const int row0 = t * BlockKv;
    if (row0 + BlockKv - 1 > warp_first_visible) {
#pragma unroll
      for (int i = 0; i < MTiles; ++i)
#pragma unroll
        for (int n = 0; n < kSTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (row0 + 8 * n + qc + (e & 1) > vis[i][e >> 1]) s[i][n][e] = kNegInf;
    }
#pragma unroll
    for (int i = 0; i < MTiles; ++i) {
      float corr[2];
#pragma unroll
      for (int half = 0; half < 2; ++half)
        corr[half] = prefill_softmax_step<kSTiles, 4, SplitP>(&s[i][0][2 * half], m[i][half], l[i][half], p.scale_log2);
      prefill_rescale<D>(&o[i][0][0], corr);
    }
    // O += P V, 16 keys a k-step: S's accumulator layout is P's A operand.
#pragma unroll
    for (int j = 0; j < BlockKv / 16; ++j) {
      unsigned pa[MTiles][2][4];
#pragma unroll
      for (int i = 0; i < MTiles; ++i) prefill_p_operand<T, SplitP>(s[i][2 * j], s[i][2 * j + 1], pa[i][0], pa[i][1]);
#pragma unroll
      for (int n2 = 0; n2 < kOTiles / 2; ++n2) {
        unsigned bv[4];
        ldmatrix_x4_trans(base + v_lane + static_cast<unsigned>(j * 16 * kRowBytes + (((2 * n2 + v_half) ^ swz) << 4)),
                          bv);
#pragma unroll
        for (int i = 0; i < MTiles; ++i)
#pragma unroll
          for (int part = 0; part < (SplitP ? 2 : 1); ++part) {
            mma_16816<T>(o[i][2 * n2], pa[i][part], bv[0], bv[1], o[i][2 * n2]);
            mma_16816<T>(o[i][2 * n2 + 1], pa[i][part], bv[2], bv[3], o[i][2 * n2 + 1]);
          }
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < MTiles; ++i) {
    if (!live[i]) continue;
    const int r0 = 16 * (MTiles * warp + i);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = prefill_row_sum(l[i][half]);
      const int q = (r0 + qr + 8 * half) % kBlockQ;
      if (q < w.q_rows)
        prefill_store_row<T, D, 4>(a, (w.q_row0 + q) * a.num_q_heads + w.hq0 + r0 / kBlockQ, &o[i][0][2 * half],
                                   m[i][half], sum, qc);
    }
  }
}

/// Whether the Hopper kernel copies V to fp16 (pv_precision::fp16, bf16).
template <class T, pv_precision P>
inline constexpr bool kPrefillCopiesV = P == pv_precision::fp16 && std::is_same_v<T, __nv_bfloat16>;

/// V's fp16 range check. A 16-byte chunk of bf16 folds into `top`, the
/// running maximum of its magnitudes: non-negative as signed 16-bit halves,
/// so a three-way max a word pair (VIMNMX3 on sm_90). A tile holds a value
/// fp16 cannot carry (|v| >= 65536, the first bf16 past 65504, Inf or NaN)
/// where a magnitude's bits reach 0x4780.
__device__ __forceinline__ unsigned prefill_v_top(unsigned top, uint4 b) {
  constexpr unsigned kMagnitude = 0x7FFF7FFFu;
  top = __vimax3_s16x2(b.x & kMagnitude, b.y & kMagnitude, top);
  return __vimax3_s16x2(b.z & kMagnitude, b.w & kMagnitude, top);
}
__device__ __forceinline__ bool prefill_v_wide(unsigned top) { return max(top & 0xFFFFu, top >> 16) >= 0x4780u; }
/// A 16-byte chunk of bf16 as fp16.
__device__ __forceinline__ uint4 prefill_v_f16(uint4 b) {
  return uint4{ptx::bf16x2_to_f16x2(b.x), ptx::bf16x2_to_f16x2(b.y), ptx::bf16x2_to_f16x2(b.z),
               ptx::bf16x2_to_f16x2(b.w)};
}

/// Copies this thread's chunks of a bf16 tile (Loader::for_own_chunks) at
/// shared address `src` to fp16 at `dst`, same layout, and makes them
/// visible to wgmma. Returns whether they hold a value fp16 cannot carry
/// (prefill_v_wide).
template <int BlockKv, class Loader>
__device__ __forceinline__ bool prefill_v_to_fp16(const Loader& load, unsigned src, unsigned dst) {
  unsigned top = 0;
  load.template for_own_chunks<BlockKv>([&](unsigned off) {
    const uint4 b = ptx::ld_shared_v4(src + off);
    top = prefill_v_top(top, b);
    ptx::st_shared_v4(dst + off, prefill_v_f16(b));
  });
  ptx::fence_proxy_async_shared();
  return prefill_v_wide(top);
}

/// S = Q K^T of a warpgroup's 64 rows by BlockKv keys on wgmma, Q and K
/// K-major in the 128-byte swizzle (D / 64 column blocks): 16 dims a
/// k-step, four a column block. `between` runs after the commit, while the
/// tensor cores take it.
template <class T, int D, int BlockKv, class Between>
__device__ __forceinline__ void prefill_sm90_scores(float (&s)[BlockKv / 2], unsigned q_tile, unsigned k_tile,
                                                    Between between) {
#pragma unroll
  for (int i = 0; i < BlockKv / 2; ++i) ptx::fence_operand(s[i]);
  const auto q_desc = ptx::smem_desc_sw128(q_tile, 16, 1024), k_desc = ptx::smem_desc_sw128(k_tile, 16, 1024);
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    const unsigned block = static_cast<unsigned>(k >> 2), within = static_cast<unsigned>((k & 3) * 32);
    ptx::wgmma_ss<T, BlockKv>(s, ptx::smem_desc_add(q_desc, block * 64 * 128 + within),
                              ptx::smem_desc_add(k_desc, block * BlockKv * 128 + within), k > 0);
  }
  ptx::wgmma_commit();
  between();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < BlockKv / 2; ++i) ptx::fence_operand(s[i]);
}

/// The causal mask (on the tiles that reach past the warp's first row's
/// visible keys: the last one or two of the window) and the softmax step of
/// a lane's two rows over a tile of BlockKv scores from key row row0; O is
/// rescaled where a row's max moved.
template <int D, int BlockKv, bool Lag>
__device__ __forceinline__ void prefill_sm90_softmax(float (&s)[BlockKv / 2], float (&o)[D / 2], float (&m)[2],
                                                     float (&l)[2], int row0, const int (&vis)[2], int qr, int qc,
                                                     float scale_log2) {
  if (row0 + BlockKv - 1 > vis[0] - qr) {
#pragma unroll
    for (int n = 0; n < BlockKv / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (row0 + 8 * n + qc + (e & 1) > vis[e >> 1]) s[4 * n + e] = -__int_as_float(0x7f800000);
  }
  float corr[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    corr[half] = prefill_softmax_step<BlockKv / 8, 4, Lag>(&s[2 * half], m[half], l[half], scale_log2);
  prefill_rescale<D>(o, corr);
}

/// O += P V on wgmma, 16 keys a k-step (two 8-row groups of the V tile, V
/// MN-major at v_base), P from the weights in registers, in PT, split or
/// not. `between` runs after the commit, while the tensor cores take it.
template <class PT, bool Split, int D, int BlockKv, class Between>
__device__ __forceinline__ void prefill_sm90_pv(float (&o)[D / 2], const float (&s)[BlockKv / 2], unsigned v_base,
                                                Between between) {
  unsigned pa[BlockKv / 16][2][4];
#pragma unroll
  for (int j = 0; j < BlockKv / 16; ++j) prefill_p_operand<PT, Split>(&s[8 * j], &s[8 * j + 4], pa[j][0], pa[j][1]);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) ptx::fence_operand(o[i]);
  const auto v_desc = ptx::smem_desc_sw128(v_base, BlockKv * 128, 1024);
  ptx::wgmma_fence();
#pragma unroll
  for (int j = 0; j < BlockKv / 16; ++j) {
    const auto v = ptx::smem_desc_add(v_desc, static_cast<unsigned>(j * 16 * 128));
#pragma unroll
    for (int part = 0; part < (Split ? 2 : 1); ++part) ptx::wgmma_rs<PT, D>(o, pa[j][part], v, true);
  }
  ptx::wgmma_commit();
  between();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < D / 2; ++i) ptx::fence_operand(o[i]);
}

/// Writes a warpgroup's rows of head `head` of the task (its lane's rows
/// q0 and q0 + 8, where they are queries of the tile).
template <class T, int D>
__device__ __forceinline__ void prefill_sm90_store(const prefill_attention_arguments<T>& a, const prefill_cta_task& w,
                                                   const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                                   int q0, int head, int qc) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = prefill_row_sum(l[half]);
    const int q = q0 + 8 * half;
    if (q < w.q_rows)
      prefill_store_row<T, D, 4>(a, (w.q_row0 + q) * a.num_q_heads + w.hq0 + head, &o[2 * half], m[half], sum, qc);
  }
}

/// The Hopper kernel (wgmma, sm_90a). One warpgroup a query head: the
/// tile's 64 positions are one wgmma M (warp w of the group holds rows
/// 16 w ..), and a CTA's Heads heads share every K/V tile. Per tile of
/// BlockKv keys: S = Q K^T by wgmma from shared memory (Q and K K-major),
/// the causal mask and the online softmax in registers, then O += P V with
/// P from registers (the accumulators' layout is the A operand's, as with
/// mma.sync) and V MN-major from shared memory. Shared memory, 1024-byte
/// aligned: the Q tiles of the heads, then the ring, Stages x (K | V); every
/// tile as D / 64 column blocks of 128-byte swizzled rows (prefill_loader).
template <class T, int D, int BlockKv, int Stages, int Heads, pv_precision P>
__global__ void __launch_bounds__(Heads * 128, 1)
    prefill_attention_sm90_kernel(const __grid_constant__ prefill_attention_params<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (BlockKv == 64 || BlockKv == 128) && Stages >= 2,
                "wgmma m64nNk16 with N = BlockKv for S and N = D for O, a 2-byte type, a ring of 2+ tiles");
  constexpr int kThreads = Heads * 128;
  constexpr int kBlockQ = 64;
  constexpr int kRowBytes = D * 2;
  constexpr int kQBytes = kBlockQ * kRowBytes;  // one head's Q tile
  constexpr int kTileBytes = BlockKv * kRowBytes;
  using loader_t = prefill_loader<T, D, kThreads, true>;
  // pv_precision::fp16 over a bf16 cache: each V tile is copied to fp16,
  // into two buffers (v16) taken in turn.
  constexpr bool kConvertV = kPrefillCopiesV<T, P>;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ const T* pages[kPrefillPageRing];

  const auto& a = p.a;
  prefill_cta_task w;
  if (!prefill_cta_begin<T, D, Heads, kThreads>(p, w)) return;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, head = threadIdx.x >> 7;
  const int tiles = (w.total_rows + BlockKv - 1) / BlockKv;
  const unsigned smem_base = (smem_address(smem) + 1023u) & ~1023u;  // the swizzle's atoms
  const unsigned ring_base = smem_base + Heads * kQBytes;
  const unsigned v16_base = ring_base + static_cast<unsigned>(Stages * 2 * kTileBytes);  // kConvertV
  const unsigned q_tile = smem_base + head * kQBytes;
  loader_t load{w, a.cache, pages};
  load.template load_queries<Heads, kBlockQ>(a.queries, a.num_q_heads, smem_base);

  // This lane's query rows of its head: q0 = 16 warp + lane / 4 and q0 + 8;
  // key columns (output dims) 8 n + qc and + 1 of accumulator 4 n + e.
  const int qr = lane >> 2, qc = (lane & 3) * 2;
  const int q0 = 16 * warp + qr;
  const int vis[2] = {w.visible0 + q0, w.visible0 + q0 + 8};  // the last key row each row sees
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;

  // kConvertV: tile u's V to v16 buffer u % 2, each thread its own copies,
  // once they are in (one tile ahead, while the tensor cores take P V);
  // `wide` says whether they hold a value fp16 cannot carry.
  bool wide = false;
  auto prepare_v = [&](int u) {
    if constexpr (kConvertV) {
      if (u < tiles) {
        cp_async_wait<Stages - 2>();
        const unsigned v = ring_base + static_cast<unsigned>((u % Stages) * 2 * kTileBytes + kTileBytes);
        wide = prefill_v_to_fp16<BlockKv>(load, v, v16_base + static_cast<unsigned>((u & 1) * kTileBytes));
      }
    }
  };
  for (int t = 1 - Stages;; ++t) {
    bool v_split = false;  // kConvertV: this tile's V takes P split
    if (t >= 0) {
      cp_async_wait<Stages - 2>();
      ptx::fence_proxy_async_shared();  // the copies, to wgmma's proxy
      if constexpr (kConvertV)
        v_split = __syncthreads_or(wide);
      else
        __syncthreads();
    }
    if (t >= tiles) break;
    const int next = t + Stages - 1;
    auto load_next = [&] {
      if (next < tiles) load.template load_ring<BlockKv>(next, Stages, ring_base, a.queries);
      cp_async_commit();
    };
    if (t < 0) {
      load_next();
      if (t == -1) prepare_v(0);
      continue;
    }
    const unsigned k_tile = ring_base + static_cast<unsigned>((t % Stages) * 2 * kTileBytes);
    const unsigned v_tile = k_tile + kTileBytes;

    // S = Q K^T, the next tile's copies (another stage) issued while the
    // tensor cores run it; the mask and the softmax; O += P V, the tile
    // after's V converted meanwhile.
    constexpr bool kLag = P != pv_precision::rounded;
    float s[BlockKv / 2];
    prefill_sm90_scores<T, D, BlockKv>(s, q_tile, k_tile, load_next);
    prefill_sm90_softmax<D, BlockKv, kLag>(s, o, m, l, t * BlockKv, vis, qr, qc, p.scale_log2);
    auto next_v = [&] { prepare_v(t + 1); };
    if constexpr (kConvertV) {
      if (!v_split)
        prefill_sm90_pv<__half, false, D, BlockKv>(o, s, v16_base + static_cast<unsigned>((t & 1) * kTileBytes),
                                                   next_v);
      else
        prefill_sm90_pv<T, true, D, BlockKv>(o, s, v_tile, next_v);
    } else {  // fp16 over an fp16 cache is split (see pv_precision)
      prefill_sm90_pv<T, kLag, D, BlockKv>(o, s, v_tile, next_v);
    }
  }
  cp_async_wait<0>();
  prefill_sm90_store<T, D>(a, w, o, m, l, q0, head, qc);
#else
  __trap();  // launched only where the loaded build targets sm_90a (built_for_sm90a)
#endif
}

/// The warp-specialised Hopper kernel (wgmma, sm_90a): warpgroup 0 the
/// producer, warpgroups 1..Heads one query head each. The producer copies
/// Q and each tile's K and V rows by cp.async into a ring of Stages
/// (K | V) pairs, and where P runs in fp16 over a bf16 cache converts V in
/// place (a tile holding a value fp16 cannot carry stays bf16 and its
/// stage's flag sends the consumers to P split); K and V of a stage each
/// have a full mbarrier, and the consumers free a stage through its empty
/// mbarrier after P V. The two consumers take the tensor cores in turn
/// (FlashAttention-3's ping-pong, two named barriers): one runs S while the
/// other runs its softmax. Register budgets by setmaxnreg.
template <class T, int D, int BlockKv, int Stages, int Heads, pv_precision P>
__global__ void __launch_bounds__((Heads + 1) * 128, 1)
    prefill_attention_sm90_ws_kernel(const __grid_constant__ prefill_attention_params<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (BlockKv == 64 || BlockKv == 128) && Stages >= 2 &&
                Heads == 2);
  constexpr int kThreads = (Heads + 1) * 128;
  constexpr int kBlockQ = 64;
  constexpr int kRowBytes = D * 2;
  constexpr int kQBytes = kBlockQ * kRowBytes;
  constexpr int kTileBytes = BlockKv * kRowBytes;
  constexpr bool kConvertV = kPrefillCopiesV<T, P>;
  // Named barriers: 1 the producer's page ring, 2 and 3 the consumers' turns.
  constexpr unsigned kProducerBar = 1, kTurnBar = 2;
  using loader_t = prefill_loader<T, D, 128, true>;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ const T* pages[kPrefillPageRing];
  __shared__ __align__(8) unsigned long long full_k[Stages], full_v[Stages], empty[Stages];
  __shared__ int v_split[Stages];

  const auto& a = p.a;
  prefill_cta_task w;
  if (!prefill_cta_begin<T, D, Heads, kThreads>(p, w)) return;
  const int tiles = (w.total_rows + BlockKv - 1) / BlockKv;
  const unsigned smem_base = (smem_address(smem) + 1023u) & ~1023u;
  const unsigned ring_base = smem_base + Heads * kQBytes;
  const int wg = threadIdx.x >> 7;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      ptx::mbarrier_init(smem_address(&full_k[s]), 128);
      ptx::mbarrier_init(smem_address(&full_v[s]), 128);
      ptx::mbarrier_init(smem_address(&empty[s]), Heads * 128);
    }
  }
  __syncthreads();

  if (wg == 0) {  // the producer
    ptx::setmaxnreg_dec<tuning::kPrefillWsProducerRegs>();
    loader_t load{w, a.cache, pages};
    load.bar_id = kProducerBar;
    load.template load_queries<Heads, kBlockQ>(a.queries, a.num_q_heads, smem_base);
    // Tile u's copies have landed (this thread's): K is ready; V is
    // checked, converted in place unless wide, and ready.
    auto finish = [&](int u, auto pending) {
      cp_async_wait<decltype(pending)::value>();
      const int s = u % Stages;
      ptx::fence_proxy_async_shared();
      ptx::mbarrier_arrive(smem_address(&full_k[s]));
      if constexpr (kConvertV) {
        const unsigned v = ring_base + static_cast<unsigned>(s * 2 * kTileBytes + kTileBytes);
        // In place, so the whole tile is checked before any of it changes.
        unsigned top = 0;
        load.template for_own_chunks<BlockKv>(
            [&](unsigned off) { top = prefill_v_top(top, ptx::ld_shared_v4(v + off)); });
        const bool wide = ptx::named_barrier_or(kProducerBar, 128, prefill_v_wide(top));
        if (!wide) {
          load.template for_own_chunks<BlockKv>(
              [&](unsigned off) { ptx::st_shared_v4(v + off, prefill_v_f16(ptx::ld_shared_v4(v + off))); });
          ptx::fence_proxy_async_shared();
        }
        if (threadIdx.x == 0) v_split[s] = wide;
      }
      ptx::mbarrier_arrive(smem_address(&full_v[s]));
    };
    for (int t = 0; t < tiles; ++t) {
      const int s = t % Stages;
      if (t >= Stages) ptx::mbarrier_wait(smem_address(&empty[s]), static_cast<unsigned>((t / Stages - 1) & 1));
      load.template load_ring<BlockKv>(t, Stages, ring_base, a.queries);
      cp_async_commit();  // Q rides with tile 0
      if (t > 0) finish(t - 1, std::integral_constant<int, 1>{});
    }
    if (tiles > 0) finish(tiles - 1, std::integral_constant<int, 0>{});
    return;
  }

  // A consumer: query head hq0 + head.
  ptx::setmaxnreg_inc<tuning::kPrefillWsConsumerRegs>();
  const int head = wg - 1, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const unsigned q_tile = smem_base + head * kQBytes;
  const int qr = lane >> 2, qc = (lane & 3) * 2;
  const int q0 = 16 * warp + qr;
  const int vis[2] = {w.visible0 + q0, w.visible0 + q0 + 8};
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  // Turns: consumer 0 goes first; each hands the tensor cores over once
  // its S has run (consumer 1 skips its last hand-over: every bar.sync
  // meets exactly one bar.arrive).
  const unsigned my_turn = kTurnBar + head, other_turn = kTurnBar + (head ^ 1);
  if (head == 1) ptx::named_barrier_arrive(other_turn, 256);
  for (int t = 0; t < tiles; ++t) {
    const int s = t % Stages;
    const unsigned phase = static_cast<unsigned>((t / Stages) & 1);
    const unsigned k_tile = ring_base + static_cast<unsigned>(s * 2 * kTileBytes), v_tile = k_tile + kTileBytes;
    ptx::mbarrier_wait(smem_address(&full_k[s]), phase);
    ptx::named_barrier_sync(my_turn, 256);
    float sc[BlockKv / 2];
    prefill_sm90_scores<T, D, BlockKv>(sc, q_tile, k_tile, [] {});
    if (head == 0 || t + 1 < tiles) ptx::named_barrier_arrive(other_turn, 256);
    constexpr bool kLag = P != pv_precision::rounded;
    prefill_sm90_softmax<D, BlockKv, kLag>(sc, o, m, l, t * BlockKv, vis, qr, qc, p.scale_log2);
    ptx::mbarrier_wait(smem_address(&full_v[s]), phase);
    if constexpr (kConvertV) {
      if (!v_split[s])
        prefill_sm90_pv<__half, false, D, BlockKv>(o, sc, v_tile, [] {});
      else
        prefill_sm90_pv<T, true, D, BlockKv>(o, sc, v_tile, [] {});
    } else {
      prefill_sm90_pv<T, kLag, D, BlockKv>(o, sc, v_tile, [] {});
    }
    ptx::mbarrier_arrive(smem_address(&empty[s]));
  }
  prefill_sm90_store<T, D>(a, w, o, m, l, q0, head, qc);
#else
  __trap();  // launched only where the loaded build targets sm_90a (built_for_sm90a)
#endif
}

template <class T, int D, tile_policy Tile, int MTiles, pv_precision P>
status launch_prefill_attention(const prefill_attention_params<T>& p, int smem_bytes, cudaStream_t stream) {
  constexpr auto kernel =
      &prefill_attention_kernel<T, D, Tile.warps, Tile.block_kv, Tile.stages, MTiles, P != pv_precision::rounded>;
  HISPARSE_TRY(hisparse::detail::raise_dynamic_smem<kernel>(smem_bytes));
  const std::int64_t ctas = std::int64_t{p.a.num_tiles} * (p.a.num_q_heads / MTiles);
  kernel<<<static_cast<unsigned>(ctas), Tile.threads(), static_cast<std::size_t>(smem_bytes), stream>>>(p);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

/// Query heads one CTA takes: two where the GQA group pairs them (every K
/// and V fragment then feeds two MMAs: half the shared-memory reads per
/// product) and head_dim is at most 128 (at 256 two heads' accumulators
/// spill), else one.
[[nodiscard]] inline int prefill_heads_per_cta(int group, int head_dim) {
  return group % 2 == 0 && head_dim <= 128 ? 2 : 1;
}

template <class T, int D, int Heads, pv_precision P>
status launch_prefill_attention_sm90(const prefill_attention_params<T>& p, int smem_bytes, cudaStream_t stream) {
  constexpr tile_policy kTile = tuning::kPrefillTileSm90;
  constexpr auto kernel = &prefill_attention_sm90_kernel<T, D, kTile.block_kv, kTile.stages, Heads, P>;
  HISPARSE_TRY(hisparse::detail::raise_dynamic_smem<kernel>(smem_bytes));
  const std::int64_t ctas = std::int64_t{p.a.num_tiles} * (p.a.num_q_heads / Heads);
  kernel<<<static_cast<unsigned>(ctas), Heads * 128, static_cast<std::size_t>(smem_bytes), stream>>>(p);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

template <class T, int D, pv_precision P>
status launch_prefill_attention_sm90_ws(const prefill_attention_params<T>& p, int smem_bytes, cudaStream_t stream) {
  constexpr tile_policy kTile = tuning::kPrefillTileSm90;
  constexpr auto kernel = &prefill_attention_sm90_ws_kernel<T, D, kTile.block_kv, tuning::kPrefillWsStages, 2, P>;
  HISPARSE_TRY(hisparse::detail::raise_dynamic_smem<kernel>(smem_bytes));
  const std::int64_t ctas = std::int64_t{p.a.num_tiles} * (p.a.num_q_heads / 2);
  kernel<<<static_cast<unsigned>(ctas), 3 * 128, static_cast<std::size_t>(smem_bytes), stream>>>(p);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

/// The warp-specialised kernel's dynamic shared memory: two heads' Q, the
/// stages of (K | V), 1024 bytes of alignment.
HISPARSE_HOST_DEVICE constexpr int prefill_sm90_ws_smem_bytes(int head_dim) {
  constexpr tile_policy kTile = tuning::kPrefillTileSm90;
  return 2 * prefill_tile_bytes(kTile.block_q, head_dim, 2) +
         tuning::kPrefillWsStages * 2 * prefill_tile_bytes(kTile.block_kv, head_dim, 2) + 1024;
}

/// The Hopper kernel's dynamic shared memory: Q and the ring as
/// prefill_smem_bytes, V's two fp16 copies where P V runs in fp16 over a
/// bf16 cache, and up to 1023 bytes to align them to the swizzle.
HISPARSE_HOST_DEVICE constexpr int prefill_sm90_smem_bytes(int heads, int head_dim, bool v_copy) {
  constexpr tile_policy kTile = tuning::kPrefillTileSm90;
  return prefill_smem_bytes(kTile, heads, kTile.stages, head_dim, 2) +
         (v_copy ? 2 * prefill_tile_bytes(kTile.block_kv, head_dim, 2) : 0) + 1024;
}

/// Whether the Hopper kernel runs `a` on this device with `heads` heads a CTA.
template <class T, pv_precision P>
[[nodiscard]] bool prefill_sm90_runs(const prefill_attention_arguments<T>& a, int heads, const gpu_limits& gpu) {
  return sizeof(T) == 2 && (a.cache.head_dim == 64 || a.cache.head_dim == 128) && gpu.cc_major == 9 &&
         prefill_sm90_smem_bytes(heads, a.cache.head_dim, kPrefillCopiesV<T, P>) +
                 static_cast<int>(kPrefillPageRing * sizeof(void*)) <=
             gpu.smem_per_block &&
         hisparse::detail::built_for_sm90a();
}

}  // namespace detail

/// The ring depth a launch uses: the tile's, less where the device's shared
/// memory per CTA is short (an RTX 4090 holds 99 KB).
template <class T, tile_policy Tile>
[[nodiscard]] int prefill_attention_stages(int heads, int head_dim, const gpu_limits& gpu) {
  int stages = Tile.stages;
  while (stages > 1 && detail::prefill_smem_bytes(Tile, heads, stages, head_dim, static_cast<int>(sizeof(T))) +
                               static_cast<int>(detail::kPrefillPageRing * sizeof(void*)) >
                           gpu.smem_per_block)
    --stages;
  return stages;
}

/// Checks the arguments' shape (host values only; the device arrays are
/// checked by the kernel, which writes NaN for what it cannot attend).
template <class T>
[[nodiscard]] status can_implement_prefill_attention(const prefill_attention_arguments<T>& a, tile_policy tile) {
  const auto& c = a.cache;
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "prefill attention: " + why); };
  if (a.queries == nullptr || a.out == nullptr || a.segments == nullptr || c.page_table == nullptr ||
      c.lengths == nullptr)
    return bad("queries, out, segments and the cache's page table and lengths are required");
  if (a.num_segments < 1 || a.num_tiles < 0) return bad("need at least one segment");
  auto aligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(a.queries) || !aligned(a.out)) return bad("queries and out must be 16-byte aligned");
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)
    return bad("head_dim " + std::to_string(c.head_dim) + " (64, 128 or 256)");
  if (c.kv_heads < 1 || a.num_q_heads < c.kv_heads || a.num_q_heads % c.kv_heads != 0)
    return bad("num_q_heads " + std::to_string(a.num_q_heads) + " must be a multiple of kv_heads " +
               std::to_string(c.kv_heads));
  if (a.query_tile < 1 || a.query_tile > tile.block_q)
    return bad("query tile " + std::to_string(a.query_tile) + " must be in 1.." + std::to_string(tile.block_q) +
               " (the tile policy's block_q)");
  if (c.fine_slice < 1 || a.layer < 0 || a.layer >= c.layers) return bad("layer or fine slice out of range");
  if (std::int64_t{a.num_tiles} * a.num_q_heads > 0x7FFFFFFF) return bad("more than 2^31 - 1 (tile, head) pairs");
  if (!a.sparse() && a.num_slices != nullptr) return bad("a dense run (top_k_fine 0) takes no selection");
  if (a.heads_per_cta < 0 || a.heads_per_cta > 2 ||
      (a.heads_per_cta == 2 && ((a.num_q_heads / c.kv_heads) % 2 != 0 || c.head_dim > 128)))
    return bad("heads_per_cta " + std::to_string(a.heads_per_cta) +
               " (0, 1, or 2 where the GQA group is even and head_dim at most 128)");
  if (a.sparse() && (a.kept_slices == nullptr || a.num_slices == nullptr || a.window < 1))
    return bad("a sparse run needs kept_slices, num_slices and a window");
  return status::success;
}

/// Launches a prefill attention: one kernel, no allocation, no sync
/// (capturable in a CUDA graph; the segments and the selection are read on
/// the device). P (pv_precision): how the softmax weights enter P V.
template <class T, tile_policy Tile = kPrefillTile, pv_precision P = kPrefillPv>
[[nodiscard]] status prefill_attention_async(const prefill_attention_arguments<T>& a, cudaStream_t stream = nullptr) {
  static_assert(valid_prefill_tile_v<Tile>);
  HISPARSE_TRY(can_implement_prefill_attention(a, Tile));
  if (a.num_tiles == 0) return status::success;
  gpu_limits gpu{};
  HISPARSE_TRY(current_gpu_limits(gpu));
  const int heads =
      a.heads_per_cta > 0 ? a.heads_per_cta : detail::prefill_heads_per_cta(a.num_q_heads / a.cache.kv_heads, a.cache.head_dim);
  detail::prefill_attention_params<T> p{};
  p.a = a;
  p.group = a.num_q_heads / a.cache.kv_heads;
  const float scale = a.softmax_scale > 0.0f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(a.cache.head_dim));
  p.scale_log2 = scale * detail::kPrefillLog2e;
  if (a.kernel == prefill_kernel::hopper_ws) {
    const int smem = detail::prefill_sm90_ws_smem_bytes(a.cache.head_dim);
    if (heads != 2 || !detail::prefill_sm90_runs<T, P>(a, heads, gpu) ||
        smem + static_cast<int>(detail::kPrefillPageRing * sizeof(void*)) > gpu.smem_per_block)
      return fail(status::invalid_argument,
                  "prefill attention: the warp-specialised kernel takes two heads a CTA and needs an sm_90 device, "
                  "an sm_90a build, a 2-byte type, head_dim 64 or 128 and " + std::to_string(smem) +
                      " bytes of shared memory a CTA");
    p.stages = tuning::kPrefillWsStages;
    if constexpr (sizeof(T) == 2) {
      if (a.cache.head_dim == 64) return detail::launch_prefill_attention_sm90_ws<T, 64, P>(p, smem, stream);
      return detail::launch_prefill_attention_sm90_ws<T, 128, P>(p, smem, stream);
    }
  }
  if (a.kernel != prefill_kernel::portable && detail::prefill_sm90_runs<T, P>(a, heads, gpu)) {
    p.stages = tuning::kPrefillTileSm90.stages;
    const int smem = detail::prefill_sm90_smem_bytes(heads, a.cache.head_dim, detail::kPrefillCopiesV<T, P>);
    if constexpr (sizeof(T) == 2) {
      if (a.cache.head_dim == 64)
        return heads == 2 ? detail::launch_prefill_attention_sm90<T, 64, 2, P>(p, smem, stream)
                          : detail::launch_prefill_attention_sm90<T, 64, 1, P>(p, smem, stream);
      return heads == 2 ? detail::launch_prefill_attention_sm90<T, 128, 2, P>(p, smem, stream)
                        : detail::launch_prefill_attention_sm90<T, 128, 1, P>(p, smem, stream);
    }
  }
  if (a.kernel == prefill_kernel::hopper)
    return fail(status::invalid_argument,
                "prefill attention: the Hopper kernel needs an sm_90 device, a build for sm_90a, a 2-byte type and "
                "head_dim 64 or 128");
  const int stages = prefill_attention_stages<T, Tile>(heads, a.cache.head_dim, gpu);
  const int smem = detail::prefill_smem_bytes(Tile, heads, stages, a.cache.head_dim, static_cast<int>(sizeof(T)));
  p.stages = stages;
  return dispatch_head_dim(a.cache.head_dim, [&](auto d) {
    if constexpr (d() <= 128) {
      if (heads == 2) return detail::launch_prefill_attention<T, d(), Tile, 2, P>(p, smem, stream);
    }
    return detail::launch_prefill_attention<T, d(), Tile, 1, P>(p, smem, stream);
  });
}

}  // namespace hisparse::attention

/// `prefix template` of prefill_attention_async for KV type T with the
/// default tile and P (core/macros.hpp: HISPARSE_EXTERN_TEMPLATES).
#define HISPARSE_PREFILL_ATTENTION_INSTANCE(prefix, T)                                                       \
  prefix template ::hisparse::status hisparse::attention::prefill_attention_async<                            \
      T, hisparse::attention::kPrefillTile, hisparse::attention::kPrefillPv>(                                 \
      const hisparse::attention::prefill_attention_arguments<T>&, cudaStream_t);
#if defined(HISPARSE_EXTERN_TEMPLATES)
HISPARSE_PREFILL_ATTENTION_INSTANCE(extern, __nv_bfloat16)
HISPARSE_PREFILL_ATTENTION_INSTANCE(extern, __half)
#endif
