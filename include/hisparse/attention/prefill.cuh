#pragma once
// Prefill attention over a paged KV cache (DESIGN.md section 1, step 6, for
// query tiles of M positions), in two modes that share one kernel:
//  * sparse: the query at p attends the kept slices of its tile and KV head
//    (select/prefill_selection.cuh) followed by the window [ws, p];
//  * dense: every key [0, p] -- the in-library causal baseline.
// One CTA per query tile and one or two query heads of a KV head (two where
// the GQA group pairs them: every K and V fragment a warp loads then feeds
// both heads' products). Its warps take 16 query rows of each head (the
// tile's M <= 16 x warps positions) and stream the tile's key rows -- the
// kept slices, then the window up to the tile's last query -- through a
// ring of Tile.block_kv-row K and V tiles filled by cp.async, Tile.stages
// deep. Per K/V tile and warp, FlashAttention-2's step on the tensor cores
// (mma.m16n8k16, fp32 accumulation): S = Q K^T, the causal mask on the
// tiles that reach the warp's first query, an online softmax in exp2, and
// O = O corr + P V with S's accumulators as P's A operand (pv_precision: P
// split in two halves, or rounded once). A kept slice is one page, so a K
// or V tile is a run of whole-row 16-byte copies. The grid runs the last
// tile first, so the longest causal rows start first, and a tile's query
// heads side by side, so the GQA group's K/V loads meet in L2.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

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

/// Grid: x = (tile, group of MTiles query heads of one KV head) pairs, the
/// last tile's first. A CTA's rows are its heads' queries, head after head
/// (block_q = 16 x Warps rows each); warp w takes rows [16 MTiles w,
/// 16 MTiles (w + 1)), MTiles m16 tiles that share every K and V fragment
/// it loads. Dynamic shared memory: the Q rows, then the ring, `stages` x
/// (K tile | V tile) of BlockKv rows; 16-byte chunk c of row r at c ^ (r & 7),
/// so ldmatrix reads are free of bank conflicts.
template <class T, int D, int Warps, int BlockKv, int MaxStages, int MTiles, bool SplitP>
__global__ void __launch_bounds__(Warps * 32, tuning::prefill_attention_ctas_per_sm(D, MTiles))
    prefill_attention_kernel(const __grid_constant__ prefill_attention_params<T> p) {
  constexpr int kThreads = Warps * 32;
  constexpr int kBlockQ = Warps * kPrefillWarpRows;  // query positions per head
  constexpr int kRows = MTiles * kBlockQ;           // Q rows of the CTA: MTiles heads
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  constexpr int kChunks = D / kVec;
  constexpr int kRowBytes = D * static_cast<int>(sizeof(T));
  constexpr int kQBytes = kRows * kRowBytes;
  constexpr int kTileBytes = BlockKv * kRowBytes;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kPasses = BlockKv / kRowsPerPass;
  constexpr int kQPasses = kRows / kRowsPerPass;
  constexpr int kKSteps = D / 16;       // k-steps of Q K^T
  constexpr int kSTiles = BlockKv / 8;  // n-tiles of S
  constexpr int kOTiles = D / 8;        // n-tiles of O
  static_assert(kChunks >= 8 && kThreads % kChunks == 0 && BlockKv % kRowsPerPass == 0 && kRows % kRowsPerPass == 0,
                "a row is at least 8 chunks (the swizzle) and a pass covers whole rows");
  static_assert(BlockKv % 16 == 0, "P V takes the tile's keys 16 at a time");
  const float kNegInf = -__int_as_float(0x7f800000);
  const float kNaN = __int_as_float(0x7fffffff);

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ const T* pages[kPrefillPageRing];

  const auto& a = p.a;
  const auto& c = a.cache;
  const int Hq = a.num_q_heads, M = a.query_tile, F = c.fine_slice;
  const int head_groups = Hq / MTiles;
  const std::int64_t pair = std::int64_t{a.num_tiles} * head_groups - 1 - blockIdx.x;
  const int tile = static_cast<int>(pair / head_groups), hq0 = static_cast<int>(pair % head_groups) * MTiles;
  const int h = hq0 / p.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // The segment holding the tile: the last with tile_offset <= tile.
  int lo = 0, hi = a.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.segments[mid].tile_offset <= tile) lo = mid;
    else hi = mid - 1;
  }
  const select::prefill_segment seg = a.segments[lo];
  const int p0 = (seg.q_begin / M + (tile - seg.tile_offset)) * M;  // the tile's first position
  const int q_rows = min(M, seg.q_begin + seg.num_queries - p0);    // its queries present
  const int p_last = p0 + q_rows - 1;
  const std::int64_t q_row0 = std::int64_t{seg.query_offset} + (p0 - seg.q_begin);  // row of position p0
  const std::int64_t seq_layer = c.seq_layer(seg.slot, a.layer);
  const std::int32_t len = c.lengths[seq_layer];
  const std::int32_t ws = a.sparse() ? contract::window_begin(p0, a.window, F) : 0;
  const std::int64_t at = std::int64_t{tile} * c.kv_heads + h;
  const std::int32_t* kept = a.sparse() ? a.kept_slices + at * a.top_k_fine : nullptr;
  const int n_kept = a.sparse() ? a.num_slices[at] : 0;

  // A chunk off a tile boundary, a cache short of the queries' own keys, a
  // kept count or slice the selection cannot have written: NaN, never a
  // silent drop or a read past the cache.
  bool bad = seg.q_begin % M != 0 || q_rows < 1 || len < p_last + 1 || n_kept < 0 || n_kept > a.top_k_fine;
  if (!bad)
    for (int i = threadIdx.x; i < n_kept; i += kThreads) bad |= kept[i] < 0 || kept[i] >= ws / F;
  if (__syncthreads_or(bad)) {
    const int r_lo = max(0, seg.q_begin - p0);  // a segment off a boundary starts inside its first tile
    for (int i = r_lo * MTiles * D + threadIdx.x; i < q_rows * MTiles * D; i += kThreads) {
      const std::int64_t row = (q_row0 + i / (MTiles * D)) * Hq + hq0 + i / D % MTiles;
      a.out[row * D + i % D] = from_float<T>(kNaN);
      if (a.lse != nullptr && i % D == 0) a.lse[row] = kNaN;
    }
    return;
  }

  // The tile's key rows: n_kept whole slices, then the window [ws, p_last];
  // row g is item g / F (kept item i < n_kept is slice kept[i], window item
  // i is slice ws / F + i - n_kept) at row g % F of its page.
  const int kept_rows = n_kept * F;
  const int total_rows = kept_rows + (p_last + 1 - ws);
  const int tiles = (total_rows + BlockKv - 1) / BlockKv;
  const int first_window = ws / F;
  // Key row g is causal-visible to the query at p0 + q when g <= visible0 + q.
  const int visible0 = p0 - ws + kept_rows;
  const int f_shift = (F & (F - 1)) == 0 ? __ffs(F) - 1 : -1;
  const std::int64_t head_tile = c.head_tile_elems();
  const std::int64_t v_offset = c.value_offset();
  const unsigned smem_base = smem_address(smem);
  const unsigned ring_base = smem_base + kQBytes;
  const int stages = p.stages;

  int page_base = 0, page_end = 0;
  auto fill_pages = [&](int first) {  // uniform across the CTA
    __syncthreads();  // nobody still reads the old pointers
    const int items = n_kept + (p_last / F - first_window + 1);
    page_base = first;
    page_end = min(items, first + kPrefillPageRing);
    for (int i = threadIdx.x; i < page_end - page_base; i += kThreads) {
      const int item = page_base + i;
      pages[i] = c.page(seq_layer, item < n_kept ? kept[item] : first_window + item - n_kept);
    }
    __syncthreads();
  };

  const int chunk = threadIdx.x % kChunks, row_in_pass = threadIdx.x / kChunks;
  // Q: this thread's chunk of kQPasses rows (row r: head hq0 + r / kBlockQ,
  // position p0 + r % kBlockQ); rows past the tile's queries are zero.
#pragma unroll
  for (int pass = 0; pass < kQPasses; ++pass) {
    const int r = row_in_pass + pass * kRowsPerPass;
    const unsigned dst = smem_base + static_cast<unsigned>(r * kRowBytes + ((chunk ^ (r & 7)) << 4));
    const int q = r % kBlockQ;
    const bool live = q < q_rows;
    const T* src = a.queries + ((q_row0 + (live ? q : 0)) * Hq + hq0 + r / kBlockQ) * D + chunk * kVec;
    cp_async_16(dst, src, live ? 16 : 0);
  }
  // Issues K/V tile t into ring stage `stage`; rows past the tile's key rows
  // are zero-filled (and masked).
  auto issue = [&](int t, int stage) {
    const int row0 = t * BlockKv;
    const int first = row0 / F, last = (min(total_rows, row0 + BlockKv) - 1) / F;
    if (first < page_base || last >= page_end) fill_pages(first);  // uniform across the CTA
    const unsigned kdst = ring_base + static_cast<unsigned>(stage * 2 * kTileBytes);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = row_in_pass + pass * kRowsPerPass;
      const int g = row0 + r;
      const unsigned off = static_cast<unsigned>(r * kRowBytes + ((chunk ^ (r & 7)) << 4));
      if (g < total_rows) {
        const int item = f_shift >= 0 ? g >> f_shift : g / F;
        const T* src = pages[item - page_base] + h * head_tile + std::int64_t{g - item * F} * D + chunk * kVec;
        cp_async_16(kdst + off, src, 16);
        cp_async_16(kdst + kTileBytes + off, src + v_offset, 16);
      } else {
        cp_async_16(kdst + off, a.queries, 0);
        cp_async_16(kdst + kTileBytes + off, a.queries, 0);
      }
    }
  };

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
    live[i] = q < q_rows;
    vis[i][0] = visible0 + q + qr;
    vis[i][1] = visible0 + q + qr + 8;
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
    if (next < tiles) issue(next, next % stages);
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
    // Online softmax per query row (two a lane and m-tile; a row's four
    // lanes agree on its max).
#pragma unroll
    for (int i = 0; i < MTiles; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = kNegInf;
#pragma unroll
        for (int n = 0; n < kSTiles; ++n) mx = fmaxf(mx, fmaxf(s[i][n][2 * half], s[i][n][2 * half + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const float m_new = fmaxf(m[i][half], mx * p.scale_log2);
        const float m_use = m_new == kNegInf ? 0.0f : m_new;  // every key masked so far: all weights 0
        const float corr = exp2f(m[i][half] - m_use);
        m[i][half] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kSTiles; ++n) {
          s[i][n][2 * half] = exp2f(fmaf(s[i][n][2 * half], p.scale_log2, -m_use));
          s[i][n][2 * half + 1] = exp2f(fmaf(s[i][n][2 * half + 1], p.scale_log2, -m_use));
          sum += s[i][n][2 * half] + s[i][n][2 * half + 1];
        }
        l[i][half] = fmaf(l[i][half], corr, sum);
#pragma unroll
        for (int n = 0; n < kOTiles; ++n) {
          o[i][n][2 * half] *= corr;
          o[i][n][2 * half + 1] *= corr;
        }
      }
    }
    // O += P V, 16 keys a k-step: S's accumulator layout is P's A operand.
    // SplitP: P = hi + lo (hi truncated, lo its rounded residual, >= 0), two
    // products per V fragment, so P keeps ~16 bits, not 8 (bf16).
#pragma unroll
    for (int j = 0; j < BlockKv / 16; ++j) {
      unsigned pa[MTiles][SplitP ? 2 : 1][4];
#pragma unroll
      for (int i = 0; i < MTiles; ++i) {
        const float(&x)[4] = s[i][2 * j];
        const float(&y)[4] = s[i][2 * j + 1];
        if constexpr (SplitP) {
          pa[i][0][0] = ptx::pack2_rz<T>(x[0], x[1]);
          pa[i][0][1] = ptx::pack2_rz<T>(x[2], x[3]);
          pa[i][0][2] = ptx::pack2_rz<T>(y[0], y[1]);
          pa[i][0][3] = ptx::pack2_rz<T>(y[2], y[3]);
          pa[i][1][0] = ptx::pack2_residual<T>(x[0], x[1], pa[i][0][0]);
          pa[i][1][1] = ptx::pack2_residual<T>(x[2], x[3], pa[i][0][1]);
          pa[i][1][2] = ptx::pack2_residual<T>(y[0], y[1], pa[i][0][2]);
          pa[i][1][3] = ptx::pack2_residual<T>(y[2], y[3], pa[i][0][3]);
        } else {
          pa[i][0][0] = pack2<T>(x[0], x[1]);
          pa[i][0][1] = pack2<T>(x[2], x[3]);
          pa[i][0][2] = pack2<T>(y[0], y[1]);
          pa[i][0][3] = pack2<T>(y[2], y[3]);
        }
      }
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
  // out = O / l per row; lse = (m + log2 l) ln 2.
#pragma unroll
  for (int i = 0; i < MTiles; ++i) {
    if (!live[i]) continue;
    const int r0 = 16 * (MTiles * warp + i);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = l[i][half];
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
      const int q = (r0 + qr + 8 * half) % kBlockQ;
      if (q >= q_rows) continue;
      const std::int64_t row = (q_row0 + q) * Hq + hq0 + r0 / kBlockQ;
      const float inv = 1.0f / sum;
      auto* dst = reinterpret_cast<unsigned*>(a.out + row * D + qc);
#pragma unroll
      for (int n = 0; n < kOTiles; ++n) dst[4 * n] = pack2<T>(o[i][n][2 * half] * inv, o[i][n][2 * half + 1] * inv);
      if (a.lse != nullptr && qc == 0) a.lse[row] = (m[i][half] + log2f(sum)) * kPrefillLn2;
    }
  }
}

template <class T, int D, tile_policy Tile, int MTiles, pv_precision P>
status launch_prefill_attention(const prefill_attention_params<T>& p, int smem_bytes, cudaStream_t stream) {
  constexpr auto kernel =
      &prefill_attention_kernel<T, D, Tile.warps, Tile.block_kv, Tile.stages, MTiles, P == pv_precision::split>;
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
template <class T, tile_policy Tile = kPrefillTile, pv_precision P = pv_precision::split>
[[nodiscard]] status prefill_attention_async(const prefill_attention_arguments<T>& a, cudaStream_t stream = nullptr) {
  static_assert(valid_prefill_tile_v<Tile>);
  HISPARSE_TRY(can_implement_prefill_attention(a, Tile));
  if (a.num_tiles == 0) return status::success;
  gpu_limits gpu{};
  HISPARSE_TRY(current_gpu_limits(gpu));
  const int heads =
      a.heads_per_cta > 0 ? a.heads_per_cta : detail::prefill_heads_per_cta(a.num_q_heads / a.cache.kv_heads, a.cache.head_dim);
  const int stages = prefill_attention_stages<T, Tile>(heads, a.cache.head_dim, gpu);
  const int smem = detail::prefill_smem_bytes(Tile, heads, stages, a.cache.head_dim, static_cast<int>(sizeof(T)));
  detail::prefill_attention_params<T> p{};
  p.a = a;
  p.group = a.num_q_heads / a.cache.kv_heads;
  p.stages = stages;
  const float scale = a.softmax_scale > 0.0f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(a.cache.head_dim));
  p.scale_log2 = scale * detail::kPrefillLog2e;
  return dispatch_head_dim(a.cache.head_dim, [&](auto d) {
    if constexpr (d() <= 128) {
      if (heads == 2) return detail::launch_prefill_attention<T, d(), Tile, 2, P>(p, smem, stream);
    }
    return detail::launch_prefill_attention<T, d(), Tile, 1, P>(p, smem, stream);
  });
}

}  // namespace hisparse::attention

/// `prefix template` of prefill_attention_async for KV type T with the
/// default tile (core/macros.hpp: HISPARSE_EXTERN_TEMPLATES).
#define HISPARSE_PREFILL_ATTENTION_INSTANCE(prefix, T)                                                       \
  prefix template ::hisparse::status hisparse::attention::prefill_attention_async<                            \
      T, hisparse::attention::kPrefillTile, hisparse::attention::pv_precision::split>(                       \
      const hisparse::attention::prefill_attention_arguments<T>&, cudaStream_t);
#if defined(HISPARSE_EXTERN_TEMPLATES)
HISPARSE_PREFILL_ATTENTION_INSTANCE(extern, __nv_bfloat16)
HISPARSE_PREFILL_ATTENTION_INSTANCE(extern, __half)
#endif
