#pragma once
// Prefill selection: the coarse and fine filters of DESIGN.md section 1 for
// query tiles of M consecutive positions (M = cfg.query_tile, tiles aligned
// to multiples of M), one CTA per (tile, KV head), both filters in one launch.
//
// A tile's score of a candidate is the max over its queries of (the group's
// summed query) . (the candidate's mean key): a small GEMM, M queries by 64
// candidates at a time, then the max over the queries. By default on the
// tensor cores in two passes: every candidate in a cheap plain pass with a
// proven bound on its distance from the split-tf32 (3xTF32, ~fp32) score;
// then only the candidates the bound cannot rule out of the top k (k + ~10
// on random rows) in 3xTF32, ranked among themselves. The kept sets are
// exactly those of scoring every candidate in 3xTF32 (`two_pass = false`;
// the contract's scores are fp32-grade). The plain pass runs in fp16
// (m16n8k16, half the operand bytes and instructions of tf32) where the
// caller gives it `plain_rows`: a pre-pass copies each summary row the
// selection may read to fp16, scaled by a power of 2 so its largest element
// sits in [2^14, 2^15) (11 significant bits, as tf32 has; the scale undone
// exactly), with its fp32 norm; the tile's queries get one such scale.
// Without them the plain pass is tf32 on the fp32 rows as they are.
// `use_tensor_cores = false` runs fp32 FMA on the CUDA cores (4 x 4
// outputs per thread). Candidates sit row by row in shared memory (D + 4
// floats a row, or D halves with 16-byte pieces swizzled), arriving by
// cp.async (4 threads a row); the queries row by row too (CUDA cores) or in
// mma fragment order (tensor cores). With `max_ring_stages = 2` the next
// round streams in while this one is scored (tuning.hpp: why one stage is
// the default).
// Ranking and compaction are the decode selection's (mark_top_k,
// compact_marked): ties to the lower index, kept slices ascending, padded
// with -1.
//
// Work and floors, T = 256K, M = 64, 8 KV heads, head_dim 128: 32768
// (tile, KV head) CTAs; 163 G multiply-adds (the fine stage's 64 queries x
// 512 slices dominates): 0.66 ms in plain tf32 at the H200's full dense
// tf32 rate (495 TFLOPS, which mma.sync does not reach), 2.0 ms if all were
// 3xTF32; the candidate rows come from L2, 10.5 GB in fp32 (half that in
// fp16). Measured: PERF_NOTES.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/dispatch.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/core/gpu_limits.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/select/decode_selection.cuh"
#include "hisparse/tuning.hpp"

namespace hisparse::select {

/// One sequence's run of prefill queries: positions [q_begin, q_begin + n),
/// rows [query_offset, query_offset + n) of the queries array, and the first
/// of its tiles in the output (tile_offset; its tiles are the M-aligned ones
/// that hold any of its positions). q_begin is a multiple of the query tile M
/// (a chunked prefill cuts between tiles, so a tile's max over its queries
/// does not depend on the chunking); the kernel reports a segment that breaks
/// this with num_slices = -1. The cache must already hold the keys up to
/// q_begin + n (the queries' own keys included).
struct prefill_segment {
  std::int32_t slot = 0;
  std::int32_t q_begin = 0;
  std::int32_t num_queries = 0;
  std::int32_t query_offset = 0;
  std::int32_t tile_offset = 0;
};

/// Tiles a segment covers for query tile M.
[[nodiscard]] HISPARSE_HOST_DEVICE inline std::int32_t prefill_tiles(std::int32_t q_begin, std::int32_t n, int m) {
  return n <= 0 ? 0 : (q_begin + n - 1) / m - q_begin / m + 1;
}

/// Host side: checks `count` segments (slot, q_begin, num_queries set) for
/// query tile m, packs their query rows in order (query_offset) and numbers
/// their tiles (tile_offset); `num_tiles` gets the total, the launch's grid.
[[nodiscard]] inline status layout_prefill_segments(prefill_segment* segs, int count, int m, int& num_tiles) {
  if (count < 1 || m < 1) return fail(status::invalid_argument, "prefill segments: need segments and a query tile");
  std::int64_t rows = 0, tiles = 0;
  for (int i = 0; i < count; ++i) {
    prefill_segment& s = segs[i];
    if (s.q_begin < 0 || s.num_queries < 1 || s.q_begin % m != 0)
      return fail(status::invalid_argument,
                  "prefill segment " + std::to_string(i) + ": q_begin " + std::to_string(s.q_begin) +
                      " must be a non-negative multiple of the query tile " + std::to_string(m) +
                      " and num_queries " + std::to_string(s.num_queries) + " at least 1");
    if (std::int64_t{s.q_begin} + s.num_queries > kMaxContext)
      return fail(status::invalid_argument, "prefill segment " + std::to_string(i) + " ends at " +
                                                std::to_string(std::int64_t{s.q_begin} + s.num_queries) +
                                                ", past the longest context (2^30 tokens)");
    s.query_offset = static_cast<std::int32_t>(rows);
    s.tile_offset = static_cast<std::int32_t>(tiles);
    rows += s.num_queries;
    tiles += prefill_tiles(s.q_begin, s.num_queries, m);
    if (rows > 0x7FFFFFFF || tiles > 0x7FFFFFFF)
      return fail(status::invalid_argument, "prefill segments: more than 2^31 - 1 query rows or tiles");
  }
  num_tiles = static_cast<int>(tiles);
  return status::success;
}

/// The fp16 plain pass's copy of a summary row: head_dim fp16 values, each
/// the fp32 sum times 2^e, then the fp32 2^-e and the fp32 row's squared
/// norm, padded to 16 bytes.
HISPARSE_HOST_DEVICE constexpr int prefill_plain_row_bytes(int head_dim) { return (head_dim + 8) * 2; }
/// The plain rows of one (segment, KV head) covering `positions`: the
/// slices' rows, then the blocks'.
HISPARSE_HOST_DEVICE constexpr std::int64_t prefill_plain_slices(std::int64_t positions, int fine_slice) {
  return (positions + fine_slice - 1) / fine_slice;
}
HISPARSE_HOST_DEVICE constexpr std::int64_t prefill_plain_blocks(std::int64_t positions, int coarse_block) {
  return (positions + coarse_block - 1) / coarse_block;
}
/// Bytes of prefill_selection_arguments::plain_rows for `segments` segments
/// that end at most `positions` into their sequences, on `cache`'s layout.
[[nodiscard]] inline std::size_t prefill_plain_rows_bytes(const kv::summary_layout& cache, int segments,
                                                          std::int64_t positions) {
  if (segments < 1 || positions < 1 || cache.fine_slice < 1 || cache.coarse_block < 1) return 0;
  const std::int64_t rows = prefill_plain_slices(positions, cache.fine_slice) +
                            prefill_plain_blocks(positions, cache.coarse_block);
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(segments) *
         static_cast<std::size_t>(cache.kv_heads) * static_cast<std::size_t>(prefill_plain_row_bytes(cache.head_dim));
}

/// Everything a prefill selection reads. `segments` lives on the device (its
/// tile offsets counted by the host with prefill_tiles); `num_tiles` is their
/// total, the launch's grid.
template <class Q>
struct prefill_selection_arguments : kv::summary_ref {  // (the cache's lengths are not read)
  /// The cache's summaries (kv::paged_kv_cache::ref() converts).
  void set_cache(const kv::summary_ref& r) { static_cast<kv::summary_ref&>(*this) = r; }

  const Q* queries = nullptr;  ///< [total queries][num_q_heads][head_dim]
  const prefill_segment* segments = nullptr;
  int num_segments = 0;
  int num_tiles = 0;
  int layer = 0;
  int num_q_heads = 0;
  /// Scores by 3xTF32 tensor-core products (~fp32 accuracy); false: fp32
  /// FMA on the CUDA cores (tests compare the two).
  bool use_tensor_cores = true;
  /// With tensor cores: score a stage's candidates first in plain tf32
  /// (one mma per 8 dims, no operand splits) with a proven error bound, and
  /// in 3xTF32 only the few the bound cannot rule out of the top k. The
  /// kept sets equal the one-pass 3xTF32 ones exactly (tests compare the
  /// two on random, tied and near-tied inputs); false: every candidate in
  /// 3xTF32, as before.
  bool two_pass = true;
  /// Optional, for the two passes: device memory of
  /// prefill_plain_rows_bytes(cache, plain_segments, plain_positions) bytes,
  /// 16-byte aligned, where the launch copies the summary rows its segments
  /// read to fp16 for the plain pass. Null: the plain pass is tf32. A
  /// segment past plain_segments or ending past plain_positions is scored
  /// in one exact pass (the same kept sets, slower).
  void* plain_rows = nullptr;
  int plain_segments = 0;
  std::int32_t plain_positions = 0;
  /// Deepest candidate ring to use (1 or 2; the plan takes less where shared
  /// memory is short; tuning.hpp has why 1). An RTX 4090 fits one stage only.
  int max_ring_stages = tuning::kPrefillRingStages;
};

/// Per tile and KV head: the kept slices (ascending, -1 padded) and their
/// count; per tile: the window start ws (the window of the query at p is
/// [ws, p]).
struct prefill_selection_output {
  std::int32_t* kept_slices = nullptr;   ///< [num_tiles][kv_heads][top_k_fine]
  std::int32_t* num_slices = nullptr;    ///< [num_tiles][kv_heads]
  std::int32_t* window_begin = nullptr;  ///< [num_tiles]
  std::int32_t* kept_blocks = nullptr;   ///< optional [num_tiles][kv_heads][top_k_coarse]
};

namespace detail {

/// Candidates scored per round: the GEMM tile's N.
inline constexpr int kPrefillCandidates = 64;
/// Floats per shared-memory row of a query or a candidate: D and 4 of
/// padding, so row r starts 4r banks on. The tensor-core fragment loads (8
/// rows x 4 columns a warp) and the CUDA-core path's float4 loads (8 rows a
/// quarter-warp) then hit 32 different banks, and rows stay 16-byte aligned
/// for cp.async.
HISPARSE_HOST_DEVICE constexpr int prefill_row_floats(int head_dim) { return head_dim + 4; }
/// Rows of partial maxima per candidate the reduction keeps: one per query
/// group of the GEMM's warps (4 of 16 queries) or threads (16 of 4).
HISPARSE_HOST_DEVICE constexpr int prefill_groups(bool tensor_cores) { return tensor_cores ? 4 : 16; }
/// Queries per tile the kernel holds: the GEMM tile's M (query_tile <= 64).
inline constexpr int kPrefillMaxQueries = 64;
static_assert(kPrefillMaxQueries == hisparse::kMaxQueryTile, "config.hpp's query_tile limit is a CTA's queries");
/// Shared-memory bytes of the tile's queries, and of one ring stage.
HISPARSE_HOST_DEVICE constexpr int prefill_query_bytes(int head_dim) {
  return kPrefillMaxQueries * prefill_row_floats(head_dim) * 4;
}
HISPARSE_HOST_DEVICE constexpr int prefill_stage_bytes(int head_dim) {
  return kPrefillCandidates * prefill_row_floats(head_dim) * 4;
}

template <class Q>
struct prefill_params {
  prefill_selection_arguments<Q> in;
  prefill_selection_output out;
  int window, top_k_coarse, top_k_fine, query_tile;
  selection_smem smem;  ///< ranking storage (decode's layout; its keys lie on the ring)
  int partial_offset;   ///< float[D]: the partial coarse block's summed far slices, then its plain row
  int red_offset;       ///< float[prefill_groups][64]: partial maxima per candidate
  int q_offset;         ///< float[64][D + 4]: the tile's group-summed queries
  int ring_offset;      ///< stages x float[64][D + 4]: candidate rows of a round
  int stages;           ///< 1 or 2
  std::int64_t plain_slices;  ///< plain rows of a (segment, KV head): its slices' first
  std::int64_t plain_stride;  ///< and its blocks' (prefill_plain_slices + prefill_plain_blocks)
};

/// CTAs per SM the prefill kernel is compiled for (its register bound;
/// tuning.hpp). A CTA holds the queries and one ring stage, plus ~8 KB of
/// ranking storage and the rest.
HISPARSE_HOST_DEVICE constexpr int prefill_ctas_per_sm(int head_dim, bool tensor_cores) {
  return tuning::prefill_ctas_per_sm(prefill_query_bytes(head_dim) + prefill_stage_bytes(head_dim) + 8 * 1024,
                                     tensor_cores);
}

using ptx::max_nan;   // NaN if either is NaN (fmaxf would drop it)
using ptx::mma_tf32;  // d += a b, one m16n8k8 tf32 tile

/// The fp32 bits of x cut to tf32 (the low 13 mantissa bits cleared): x -
/// tf32_cut(x) is exact in fp32, so x = hi + lo splits without rounding.
__device__ __forceinline__ unsigned tf32_cut(float x) { return __float_as_uint(x) & 0xFFFFE000u; }

/// The exponent e of the fp16 plain pass's scale 2^e for a row whose
/// largest |element| has the fp32 bits `top`: that element lands in
/// [2^14, 2^15) (fp16's largest finite value is 65504), clamped so 2^e and
/// 2^-e are normal floats. A non-finite row gets a finite scale; its scores
/// then fail the plain pass's finiteness checks.
HISPARSE_HOST_DEVICE constexpr int plain_f16_exponent(unsigned top) {
  const int e = 141 - static_cast<int>((top >> 23) & 0xFFu);  // top < 2^(biased exponent - 126)
  return e < -126 ? -126 : (e > 126 ? 126 : e);
}
/// The same for a tile's queries, from their largest squared norm (float
/// bits) rather than their largest element (which would cost the query
/// build registers): |q| bounds every element, and the largest element
/// keeps 11 significant bits down to 2^-29 |q|.
__device__ __forceinline__ int plain_query_exponent(unsigned qnorm2) {
  return plain_f16_exponent(__float_as_uint(sqrtf(__uint_as_float(qnorm2))));
}
/// 2^e for e in [-126, 127], exactly.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

/// One warp writes `row` (D fp32, global or shared) as a plain-pass row
/// (prefill_plain_row_bytes) at `dst`.
template <int D>
__device__ void store_plain_row(const float* row, unsigned char* dst, int lane) {
  constexpr int kPairs = D / 64;  // float2 pairs a lane
  float2 v[kPairs];
  unsigned top = 0;
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    v[j] = reinterpret_cast<const float2*>(row)[lane + 32 * j];
    top = max(top, max(__float_as_uint(fabsf(v[j].x)), __float_as_uint(fabsf(v[j].y))));
    sq = fmaf(v[j].x, v[j].x, fmaf(v[j].y, v[j].y, sq));
  }
  top = __reduce_max_sync(0xFFFFFFFFu, top);  // as unsigned bits: NaN above inf
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, off);
  const int e = plain_f16_exponent(top);
  const float up = pow2(e);
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
    reinterpret_cast<unsigned*>(dst)[lane + 32 * j] = ptx::pack2<__half>(v[j].x * up, v[j].y * up);
  if (lane == 0) *reinterpret_cast<float4*>(dst + 2 * D) = make_float4(pow2(-e), sq, 0.0f, 0.0f);
}

/// The pre-pass of the fp16 plain pass: what prefill_plain_rows_kernel reads.
struct plain_rows_params {
  kv::summary_ref cache;
  const prefill_segment* segments = nullptr;
  int layer = 0;
  unsigned char* rows = nullptr;
  std::int32_t positions = 0;        ///< segments ending later are left out
  std::int32_t slices = 0, blocks = 0;  ///< rows of a (segment, KV head): the slices', then the blocks'
};

/// Grid: x = 8 rows, y = KV head, z = segment; a warp a row. Copies the
/// rows of [0, end) a segment may read (every block and slice its tiles can
/// rank) to fp16; rows past them are left as they are, never read.
template <int D>
__global__ void __launch_bounds__(kSelectThreads) prefill_plain_rows_kernel(const __grid_constant__ plain_rows_params p) {
  const auto& c = p.cache;
  const std::int64_t r = std::int64_t{blockIdx.x} * (kSelectThreads / 32) + threadIdx.x / 32;
  const int h = static_cast<int>(blockIdx.y);
  const prefill_segment seg = p.segments[blockIdx.z];
  const std::int64_t end = std::int64_t{seg.q_begin} + seg.num_queries;
  if (end > p.positions) return;  // the selection scores this segment in one exact pass
  const std::int64_t sl = c.seq_layer(seg.slot, p.layer);
  const float* src = nullptr;
  if (r < p.slices) {
    if (r < min(prefill_plain_slices(end, c.fine_slice), std::int64_t{c.max_slices}))
      src = c.slice_sums + c.slice_row(sl, r, h);
  } else if (r - p.slices < min(prefill_plain_blocks(end, c.coarse_block), std::int64_t{c.max_blocks})) {
    src = c.block_sums + c.block_row(sl, r - p.slices, h);
  }
  if (src == nullptr) return;  // warp-uniform
  store_plain_row<D>(src,
                     p.rows + ((std::int64_t{blockIdx.z} * c.kv_heads + h) * (p.slices + p.blocks) + r) *
                                  prefill_plain_row_bytes(D),
                     static_cast<int>(threadIdx.x % 32));
}

/// The tensor-core kernels' k order: mma k-step s (8 dims) of 32-dim chunk
/// J = s / 4, j = s % 4, gives lane quad q4 the dims 32 J + 8 q4 + 2 j and
/// + 1 as its k = q4 and k = q4 + 4 (which dims play which k does not
/// matter as long as A and B agree). A candidate row (D + 4 floats) then
/// yields a lane's B fragments for two k-steps in one 16-byte load, free of
/// bank conflicts. The queries are stored in fragment order: k-step s of
/// query block qb (16 queries) is 32 lanes x 4 floats, lane g * 4 + q4
/// holding A[g][k = q4], A[g + 8][q4], A[g][q4 + 4], A[g + 8][q4 + 4] -- one
/// 16-byte load per lane and k-step, already in the mma's register order.
/// This is the float offset of query i, dim d.
template <int D>
HISPARSE_HOST_DEVICE constexpr int prefill_fragment_offset(int i, int d) {
  const int dl = d % 32, s = d / 32 * 4 + dl % 8 / 2, lane = i % 8 * 4 + dl / 8;
  return ((i / 16 * (D / 8) + s) * 32 + lane) * 4 + dl % 2 * 2 + i % 16 / 8;
}

/// The fp16 plain pass's query fragments (m16n8k16): k-step s = 2J + h of
/// 32-dim chunk J gives lane quad q4 the dims 32J + 8q4 + 4h + {0, 1} as
/// k = 2q4, 2q4 + 1 and + {2, 3} as k = 2q4 + 8, 2q4 + 9, so a candidate
/// row's 16-byte piece 4J + q4 holds a lane's B fragments of both k-steps.
/// k-step s of query block qb is 32 lanes x 4 words, lane g * 4 + q4
/// holding A[g][2q4..], A[g + 8][2q4..], A[g][2q4 + 8..], A[g + 8][2q4 + 8..]
/// (pairs of halves). The word offset of query i, dims d and d + 1 (d even).
template <int D>
HISPARSE_HOST_DEVICE constexpr int prefill_half_fragment_word(int i, int d) {
  const int dl = d % 32, s = d / 32 * 2 + dl % 8 / 4, lane = i % 8 * 4 + dl / 8;
  return ((i / 16 * (D / 16) + s) * 32 + lane) * 4 + dl % 4 / 2 * 2 + i % 16 / 8;
}

/// Byte offset of candidate c's 16-byte piece `piece` in a ring stage of the
/// fp16 plain pass: [64 rows of D halves | the queries' fragments | 64
/// rows' 16-byte tails (scale, norm)], the stage's size in fp32 rows
/// exactly. A row's pieces are swizzled by its parity (piece ^ 4): the 8
/// lanes of a B-fragment load phase read rows g, g + 1, 64 bytes each, from
/// the two halves of the banks.
template <int D>
HISPARSE_HOST_DEVICE constexpr int plain_piece_offset(int c, int piece) {
  return piece < D / 8 ? c * D * 2 + (piece ^ (c & 1) * 4) * 16 : kPrefillCandidates * D * 4 + c * 16;
}

/// max over queries i < valid of qs[i] . row in fp32 FMA, NaN if any dot
/// product is NaN, by one warp (lane takes queries lane, lane + 32); qs in
/// the tensor cores' fragment order, row global or shared. The rare path of
/// a 3xTF32 score that came out NaN.
template <int D>
__device__ __noinline__ float rescore_fp32(const float* qs, const float* row, int valid, int lane) {
  float best = -__int_as_float(0x7f800000);
#pragma unroll 1
  for (int i = lane; i < valid; i += 32) {
    float dot = 0.0f;
#pragma unroll 1
    for (int d = 0; d < D; ++d) dot = fmaf(qs[prefill_fragment_offset<D>(i, d)], row[d], dot);
    best = max_nan(best, dot);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) best = max_nan(best, __shfl_xor_sync(0xFFFFFFFFu, best, off));
  return best;
}

/// How score_candidates computes the products: fp32 FMA on the CUDA cores;
/// split tf32 on the tensor cores (3xTF32, ~fp32 accuracy); or plain tf32
/// (operands cut to 10 mantissa bits) or plain fp16 (power-of-2 scaled
/// rows, rounded to 11 significant bits), both within bound_tf32_delta,
/// which also record the largest scaled candidate norm.
enum class prefill_scoring { fma, split_tf32, plain_tf32, plain_f16 };

/// A 16-byte shared-memory load.
__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }

/// Scores `count` candidates against the tile's `valid` summed queries (qs,
/// one row per query): scores[c] = scale_of(c) * max_i qs[i] . row(c), where
/// row_of(c) is candidate c's D-float key sum (plain_f16: its plain-pass
/// row): a global row, or `partial` (in shared memory, copied rather than
/// streamed). Non-finite values score as the reference scores them, in
/// every exact mode: NaN for a NaN product or infinite products of both
/// signs, +-inf for infinite products of one sign; masked query rows never
/// count.
///
/// Rounds of 64 candidates go through `stages` ring buffers: round r + 1 is
/// in flight (cp.async, 4 threads a row, each 16-byte pieces q, q + 4, ...,
/// so row_of runs once per thread and round) while round r is scored.
/// Tensor cores: mma.m16n8k8 in the k order of prefill_fragment_offset (qs
/// in fragment order), 8 warps of 16 queries x 32 candidates. split_tf32
/// splits a = a_hi + a_lo (a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi);
/// plain_tf32 feeds the fp32 bits as they are (the tensor core reads their
/// tf32 part) and sets *cnorm to the largest (scale_of(c) |row(c)|)^2 (float
/// bits, atomicMax). plain_f16 first writes the queries times 2^e (e from
/// *qnorm2, their largest |q|^2: plain_query_exponent) as fp16 fragments
/// (prefill_half_fragment_word) into the ring, runs mma.m16n8k16,
/// undoes both scales on the maxima, and takes |row(c)| from the row's
/// tail. split_tf32 recomputes a NaN score in fp32 FMA (an infinite operand
/// makes 3xTF32 NaN) unless `nan_query` says a valid query is NaN, which
/// makes every score NaN anyway. fma: qs row-major, 4 x 4 per thread
/// (queries tq + 16i, candidates tc + 16j).
template <int D, prefill_scoring Mode, class RowOf, class ScaleOf>
__device__ void score_candidates(int count, int valid, int stages, const float* qs, float* ring, float* red,
                                 const void* partial, const void* any_row, float* scores, RowOf row_of,
                                 ScaleOf scale_of, unsigned* cnorm = nullptr, bool nan_query = false,
                                 const unsigned* qnorm2 = nullptr) {
  constexpr bool kTensorCores = Mode != prefill_scoring::fma;
  constexpr bool kHalf = Mode == prefill_scoring::plain_f16;
  constexpr int kN = kPrefillCandidates, kR = prefill_row_floats(D);
  constexpr int kTileFloats = kN * kR;
  constexpr int kGroups = prefill_groups(kTensorCores);
  constexpr int kRowThreads = kSelectThreads / kN;  // 4 threads copy a row
  constexpr int kPieces = kHalf ? D / 8 + 1 : D / 4;  // 16-byte pieces a row (fp16: and its tail)
  static_assert(D % 32 == 0 && kSelectThreads % kN == 0, "32-dim chunks; whole threads per row");
  static_assert(kN * D * 4 + kN * 16 == kTileFloats * 4, "an fp16 stage (rows, queries, tails) fills an fp32 one");
  const int t = static_cast<int>(threadIdx.x);
  const int rounds = (count + kN - 1) / kN;
  auto issue = [&](int round) {
    if (round < rounds) {
      const int c = t / kRowThreads, cand = round * kN + c;
      const int stage = stages == 2 ? round & 1 : 0;
      if constexpr (kHalf) {
        char* base = reinterpret_cast<char*>(ring + stage * kTileFloats);
        const auto* src = cand < count ? static_cast<const char*>(row_of(cand)) : nullptr;
#pragma unroll 4
        for (int piece = t % kRowThreads; piece < kPieces; piece += kRowThreads) {
          char* dst = base + plain_piece_offset<D>(c, piece);
          if (src == partial)
            *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src + piece * 16);
          else  // past the candidates: zeros, nothing read
            ptx::cp_async_16(ptx::smem_address(dst), src ? src + piece * 16 : any_row, src ? 16 : 0);
        }
      } else {
        float* dst = ring + stage * kTileFloats + c * kR;
        const float* src = cand < count ? row_of(cand) : nullptr;
#pragma unroll 4
        for (int piece = t % kRowThreads; piece < kPieces; piece += kRowThreads) {
          if (src == partial)
            *reinterpret_cast<float4*>(dst + piece * 4) = *reinterpret_cast<const float4*>(src + piece * 4);
          else  // past the candidates: zeros, nothing read
            ptx::cp_async_16(ptx::smem_address(dst + piece * 4), src ? src + piece * 4 : any_row, src ? 16 : 0);
        }
      }
    }
    ptx::cp_async_commit();  // every thread, every round (empty groups too): uniform group counts
  };
  __syncthreads();  // the ring's last use (the ranking's keys, or the previous stage) is over
  if constexpr (kHalf) {  // the queries' fp16 fragments, between stage 0's rows and tails
    const float up = pow2(plain_query_exponent(*qnorm2));
    auto* q16 = reinterpret_cast<unsigned*>(reinterpret_cast<char*>(ring) + kN * D * 2);
    for (int w = t; w < kPrefillMaxQueries * D / 2; w += kSelectThreads) {
      const int i = w / (D / 2), d = w % (D / 2) * 2;
      q16[prefill_half_fragment_word<D>(i, d)] = ptx::pack2<__half>(qs[prefill_fragment_offset<D>(i, d)] * up,
                                                                    qs[prefill_fragment_offset<D>(i, d + 1)] * up);
    }
  }
  if (stages == 2) issue(0);
  for (int r = 0; r < rounds; ++r) {
    issue(r + stages - 1);
    if (stages == 2) ptx::cp_async_wait<1>();
    else ptx::cp_async_wait<0>();
    __syncthreads();  // round r's rows have landed, for every thread (and the fp16 queries)
    const float* cs = ring + (stages == 2 ? r & 1 : 0) * kTileFloats;
    if constexpr (kTensorCores) {
      const int warp = t / 32, lane = t & 31, g = lane / 4, q4 = lane % 4;
      const int qb = warp % 4, ch = warp / 4;  // queries 16qb.., candidates 32ch..
      const float* qf = qs + (qb * (D / 8) * 32 + lane) * 4;  // k-step s at qf + 128 s
      const float* cb = cs + (32 * ch + g) * kR + 8 * q4;     // k-steps 4J + 2h, + 1 at cb + 32 J + 4 h
      float acc[4][4] = {};
      if constexpr (kHalf) {
        // Candidate 32ch + 8nt + g (parity g's), piece 4J + q4: B for k-steps 2J, 2J + 1.
        const auto* qh = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(ring) + kN * D * 2) +
                         qb * (D / 16) * 32 + lane;  // k-step s at qh + 32 s
        const char* rb = reinterpret_cast<const char*>(cs) + (32 * ch + g) * D * 2;
        const int swz = (g & 1) * 4;
#pragma unroll 2
        for (int J = 0; J < D / 32; ++J) {
          const uint4 a0 = qh[64 * J], a1 = qh[64 * J + 32];
          const unsigned f0[4] = {a0.x, a0.y, a0.z, a0.w}, f1[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const uint4 b = *reinterpret_cast<const uint4*>(rb + nt * 8 * D * 2 + ((4 * J + q4) ^ swz) * 16);
            ptx::mma_16816<__half>(acc[nt], f0, b.x, b.y, acc[nt]);
            ptx::mma_16816<__half>(acc[nt], f1, b.z, b.w, acc[nt]);
          }
        }
      } else if constexpr (Mode == prefill_scoring::split_tf32) {
        // The a_hi b_hi products and the two small ones in separate
        // accumulators: two independent mma chains per n-tile, not one of 3.
        float small[4][4] = {};
#pragma unroll 2
        for (int k = 0; k < D / 16; ++k) {
          unsigned ahi[2][4], alo[2][4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float4 av = lds4(qf + (2 * k + h) * 128);
            const float v[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              ahi[h][i] = tf32_cut(v[i]);
              alo[h][i] = tf32_cut(v[i] - __uint_as_float(ahi[h][i]));
            }
          }
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float4 bv = lds4(cb + nt * 8 * kR + k / 2 * 32 + k % 2 * 4);
            const float b[4] = {bv.x, bv.y, bv.z, bv.w};
            unsigned bhi[4], blo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              bhi[i] = tf32_cut(b[i]);
              blo[i] = tf32_cut(b[i] - __uint_as_float(bhi[i]));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              mma_tf32(small[nt], alo[h], bhi[2 * h], bhi[2 * h + 1]);
              mma_tf32(small[nt], ahi[h], blo[2 * h], blo[2 * h + 1]);
              mma_tf32(acc[nt], ahi[h], bhi[2 * h], bhi[2 * h + 1]);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] += small[nt][e];
      } else {
#pragma unroll 2
        for (int k = 0; k < D / 16; ++k) {
          const float4 a0 = lds4(qf + 2 * k * 128), a1 = lds4(qf + (2 * k + 1) * 128);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float4 b = lds4(cb + nt * 8 * kR + k / 2 * 32 + k % 2 * 4);
            mma_tf32(acc[nt], a0, b.x, b.y);
            mma_tf32(acc[nt], a1, b.z, b.w);
          }
        }
        // |row(c)|^2, candidates 8 warp + g (their dims 8 q4.. of every 32),
        // scaled; the warp's largest to *cnorm.
        const float* row = cs + (8 * warp + g) * kR + 8 * q4;
        float sq = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 32) {
          const float4 x = lds4(row + k0), y = lds4(row + k0 + 4);
          sq = fmaf(x.x, x.x, fmaf(x.y, x.y, fmaf(x.z, x.z, fmaf(x.w, x.w, sq))));
          sq = fmaf(y.x, y.x, fmaf(y.y, y.y, fmaf(y.z, y.z, fmaf(y.w, y.w, sq))));
        }
        sq += __shfl_xor_sync(0xFFFFFFFFu, sq, 1);
        sq += __shfl_xor_sync(0xFFFFFFFFu, sq, 2);
        const int cand = r * kN + 8 * warp + g;
        const float scale = cand < count ? scale_of(cand) : 0.0f;
        // Non-negative or NaN: as unsigned bits, larger means larger (NaN largest).
        const unsigned top = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(sq * scale * scale));
        if (lane == 0) atomicMax(cnorm, top);
      }
      // acc[nt]: queries 16qb + g (0, 1) and + 8 (2, 3), candidates 32ch + 8nt + 2q4 (+1).
      const bool row0 = 16 * qb + g < valid, row1 = 16 * qb + g + 8 < valid;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float best = -__int_as_float(0x7f800000);
          if (row0) best = max_nan(best, acc[nt][e]);
          if (row1) best = max_nan(best, acc[nt][2 + e]);
#pragma unroll
          for (int off = 4; off < 32; off <<= 1) best = max_nan(best, __shfl_xor_sync(0xFFFFFFFFu, best, off));
          if (g == 0) red[qb * kN + 32 * ch + 8 * nt + 2 * q4 + e] = best;
        }
    } else {
      const int tq = t / 16, tc = t % 16;
      float acc[4][4] = {};
#pragma unroll 1
      for (int d = 0; d < D; d += 4) {
        float4 q[4], x[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = *reinterpret_cast<const float4*>(qs + (tq + 16 * i) * kR + d);
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = *reinterpret_cast<const float4*>(cs + (tc + 16 * j) * kR + d);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float a = acc[i][j];
            a = fmaf(q[i].x, x[j].x, a);
            a = fmaf(q[i].y, x[j].y, a);
            a = fmaf(q[i].z, x[j].z, a);
            acc[i][j] = fmaf(q[i].w, x[j].w, a);
          }
      }
      // Max over this thread's valid queries; the 16 query groups below.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float best = -__int_as_float(0x7f800000);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (tq + 16 * i < valid) best = max_nan(best, acc[i][j]);
        red[tq * kN + tc + 16 * j] = best;
      }
    }
    float2 tail{};  // plain_f16: row t's 2^-e and |row|^2, read before the barrier frees the ring
    if constexpr (kHalf)
      if (t < kN)
        tail = *reinterpret_cast<const float2*>(reinterpret_cast<const char*>(cs) + plain_piece_offset<D>(t, D / 8));
    __syncthreads();  // red is complete; this round's buffer is free for round r + stages
    if (t < kN) {  // warps 0 and 1, whole
      const int c = r * kN + t;
      float best = -__int_as_float(0x7f800000);
#pragma unroll
      for (int g = 0; g < kGroups; ++g) best = max_nan(best, red[g * kN + t]);
      if constexpr (kHalf) {
        // The scales are powers of 2: undone exactly (NaN stays NaN).
        const float scale = c < count ? scale_of(c) : 0.0f;
        if (c < count) scores[c] = best * pow2(-plain_query_exponent(*qnorm2)) * tail.x * scale;
        const unsigned top = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(tail.y * scale * scale));
        if (t % 32 == 0) atomicMax(cnorm, top);
      } else if (c < count) {
        scores[c] = best * scale_of(c);  // NaN stays NaN
      }
      if constexpr (Mode == prefill_scoring::split_tf32) {
        // 3xTF32 turns an infinite operand into NaN (inf - inf in its split,
        // 0 * inf in the cross products) where the contract's score is +-inf.
        // A NaN score is rare (non-finite keys or queries), so the warp
        // recomputes it in fp32 FMA, which gives the contract's value (+-inf,
        // or NaN where that is what it is). From the candidate's own row,
        // not the ring, which the other warps may already be refilling.
        // A NaN query (nan_query: the tile's largest |q|^2 is NaN) makes
        // every score NaN, as in the reference: nothing to recompute.
        unsigned redo = __ballot_sync(0xFFFFFFFFu, c < count && isnan(best) && !nan_query);
        while (redo) {  // warp-uniform
          const int src = __ffs(static_cast<int>(redo)) - 1;
          redo &= redo - 1;
          const int cand = r * kN + (t & ~31) + src;
          const float exact = rescore_fp32<D>(qs, row_of(cand), valid, t & 31);
          if ((t & 31) == src) scores[cand] = exact * scale_of(cand);
        }
      }
    }
  }
  __syncthreads();
}

/// Candidates a stage rescores exactly after the plain-tf32 pass, at most
/// (two rounds); more fall back to scoring every candidate exactly.
inline constexpr int kPrefillExactMax = 2 * kPrefillCandidates;

/// Whether a stage of `count` candidates keeping k takes the two passes:
/// at least three rounds to save, and room for k and a margin in the exact
/// list (the margin, the candidates within the bound of the k-th, is ~10 on
/// random rows).
HISPARSE_HOST_DEVICE constexpr bool prefill_two_pass(int count, int k) {
  return count > 2 * kPrefillCandidates && 2 * k <= kPrefillExactMax;
}

/// The bound on |plain tf32 score - 3xTF32 score| for every candidate of a
/// stage: qnorm2 = the largest |q|^2 of the tile's valid summed queries,
/// cnorm2 = the largest (scale |row|)^2 of the stage's candidates.
/// Per product a b, tf32 keeps 10 mantissa bits of each operand (truncated
/// or rounded: relative error < 2^-10 each), so |a b - tf32(a) tf32(b)| <
/// (2^-9 + 2^-20) |a b|; fp32 accumulation of D <= 256 products adds
/// < 2^-15 sum |a b|, and the 3xTF32 score is itself within ~2^-15 sum |a b|
/// of the exact one. sum_d |q_d c_d| <= |q| |c| (Cauchy-Schwarz); the max over
/// queries moves by at most the largest per-query error. 2^-8 |q| |c| covers
/// all of it with a factor ~2 to spare for the fp32 arithmetic of the bound.
/// The second term covers flushed subnormals (operands, split parts and
/// products: < 2^-126 each, at most 2^9 of them, times |q| or |c| <= their
/// norms), which no relative bound does. The fp16 plain pass stays inside
/// it too: each operand is scaled by a power of 2 (exact) and rounded to 11
/// significant bits (relative error <= 2^-11, half tf32's), and an fp16
/// subnormal is off by < 2^-25 of the scaled unit, < 2^-39 of its row's
/// largest element (of the largest |q| for the queries, scaled by it), so
/// < 2^-35 |q| |c| over D <= 256 products. Where the scale stops at 2^126
/// (rows below 2^-112) that error is < 2^-151 an element, and undoing the
/// scales may round a score into fp32's subnormals (< 2^-149): both are
/// inside the second term.
HISPARSE_HOST_DEVICE inline float bound_tf32_delta(float qnorm2, float cnorm2) {
  const float q = std::sqrt(qnorm2), c = std::sqrt(cnorm2);
  return 0x1p-8f * q * c + 0x1p-110f * (q + c + 1.0f);
}

/// A prefill CTA's shared scalars and the exact list of a two-pass stage.
struct prefill_shared {
  int seg_index;
  unsigned qnorm2;  ///< largest |q|^2 of the tile's valid summed queries (float bits)
  unsigned cnorm2;  ///< the stage's largest (scale |row|)^2 (float bits)
  unsigned kth;     ///< a plain score k candidates reach (ordered_bits)
  int bad;          ///< a plain score was not a number or infinite
  std::int32_t exact[kPrefillExactMax];  ///< candidates rescored in 3xTF32
};

/// One filter stage: scores candidates [0, count) and keeps the top k (ties
/// to the lower index); emit(position, candidate) in ascending candidate
/// order; returns the number kept. One pass: every candidate in 3xTF32 (or
/// fp32 FMA). Two passes (prefill_two_pass, tensor cores): every candidate
/// in plain tf32 and the bound delta of bound_tf32_delta; with s_k a plain
/// score that at least k candidates reach (the k-th largest of 2k group
/// maxima: at most the k-th largest plain score), every candidate whose
/// 3xTF32 score can reach the k-th largest 3xTF32 score has a plain score
/// >= s_k - 2 delta (k candidates have 3xTF32 scores >= s_k - delta, and
/// none outside that band exceeds s_k - delta). Those, in candidate order,
/// are rescored in 3xTF32 and ranked among themselves, which keeps exactly
/// what ranking every candidate would. A score that is not a finite number,
/// a bound that is not finite, or a band of more than kPrefillExactMax
/// candidates: every candidate in 3xTF32.
///
/// `Plain` is the kernel's plain pass (plain_tf32 or plain_f16, whose rows
/// plain_of(c) gives, the partial block's at partial_plain), or fma: the
/// CUDA cores, one pass.
template <int D, bool Wide, prefill_scoring Plain, class RowOf, class ScaleOf, class PlainOf, class Emit>
__device__ int filter_stage(int count, int k, bool two_pass, int valid, int stages, const float* qs, float* ring,
                            float* red, const float* partial, const float* any_row, float* scores,
                            unsigned char* keep, topk_key* keys, selection_temp<Wide>& temp, prefill_shared& sh,
                            RowOf row_of, ScaleOf scale_of, const void* partial_plain, PlainOf plain_of, Emit emit) {
  constexpr bool kTensorCores = Plain != prefill_scoring::fma;
  constexpr int kMaxCandidates = Wide ? kMaxSelectCandidates : kFilterMaxCandidates;
  constexpr prefill_scoring kExact = kTensorCores ? prefill_scoring::split_tf32 : prefill_scoring::fma;
  if (count == 0) return 0;  // uniform
  const int t = static_cast<int>(threadIdx.x);
  int n = count;
  const std::int32_t* list = nullptr;  // the exact candidates, or all of them
  if (kTensorCores && two_pass && prefill_two_pass(count, k)) {  // uniform
    if (t == 0) {  // ordered before readers by score_candidates' first barrier
      sh.cnorm2 = 0;
      sh.bad = 0;
    }
    if constexpr (Plain == prefill_scoring::plain_f16)
      score_candidates<D, Plain>(count, valid, stages, qs, ring, red, partial_plain, any_row, scores, plain_of,
                                 scale_of, &sh.cnorm2, false, &sh.qnorm2);
    else if constexpr (kTensorCores)
      score_candidates<D, Plain>(count, valid, stages, qs, ring, red, partial, any_row, scores, row_of, scale_of,
                                 &sh.cnorm2);
    // s_k: the k-th largest of 2k group maxima (the groups partition the
    // candidates), a plain score at least k candidates reach. One pass and
    // a count over 2k maxima, not a ranking of every plain score.
    filter_storage& fs = temp.filter;
    store_group_maxima(scores, count, 2 * k, fs.group_max, [&](float s) {  // 2k < count (prefill_two_pass)
      if (!isfinite(s)) sh.bad = 1;
    });
    __syncthreads();
    find_kth_group_maximum(fs.group_max, 2 * k, k, [&](topk_key key) { sh.kth = static_cast<unsigned>(key >> 32); });
    __syncthreads();
    const float delta = bound_tf32_delta(__uint_as_float(sh.qnorm2), __uint_as_float(sh.cnorm2));
    if (!sh.bad && delta < __int_as_float(0x7f800000)) {  // uniform; false for a NaN delta too
      const float floor = from_ordered_bits(sh.kth) - 2.0f * delta;
      for (int c = t; c < count; c += kSelectThreads) keep[c] = scores[c] >= floor ? 1 : 0;
      __syncthreads();
      const int m = compact_marked<kMaxCandidates>(keep, count, temp.scan, [&](int pos, int c) {
        if (pos < kPrefillExactMax) sh.exact[pos] = c;
      });
      if (m <= kPrefillExactMax) {
        n = m;
        list = sh.exact;
      }
    }
  }
  auto cand = [&](int e) { return list ? static_cast<int>(list[e]) : e; };
  score_candidates<D, kExact>(
      n, valid, stages, qs, ring, red, partial, any_row, scores, [&](int e) { return row_of(cand(e)); },
      [&](int e) { return scale_of(cand(e)); }, nullptr, kTensorCores && isnan(__uint_as_float(sh.qnorm2)));
  mark_top_k<Wide>(scores, n, k, keep, keys, temp);
  return compact_marked<kMaxCandidates>(keep, n, temp.scan, [&](int pos, int e) { emit(pos, cand(e)); });
}

/// Grid: x = KV head, y = tile (across all segments).
template <class Q, int D, bool Wide, prefill_scoring Plain>
__global__ void __launch_bounds__(kSelectThreads, prefill_ctas_per_sm(D, Plain != prefill_scoring::fma))
    prefill_selection_kernel(const __grid_constant__ prefill_params<Q> p) {
  constexpr bool TensorCores = Plain != prefill_scoring::fma;
  __shared__ selection_temp<Wide> temp;
  __shared__ prefill_shared sh;
  extern __shared__ __align__(16) unsigned char smem[];
  auto* keys = reinterpret_cast<topk_key*>(smem + p.smem.keys);
  auto* coarse_scores = reinterpret_cast<float*>(smem + p.smem.coarse_scores);
  auto* fine_scores = reinterpret_cast<float*>(smem + p.smem.fine_scores);
  auto* keep = smem + p.smem.keep;
  auto* kept_blocks = reinterpret_cast<std::int32_t*>(smem + p.smem.kept_blocks);
  auto* partial = reinterpret_cast<float*>(smem + p.partial_offset);
  auto* red = reinterpret_cast<float*>(smem + p.red_offset);
  auto* qs = reinterpret_cast<float*>(smem + p.q_offset);
  auto* ring = reinterpret_cast<float*>(smem + p.ring_offset);

  const auto& in = p.in;
  const int h = blockIdx.x, tile = blockIdx.y;
  // The segment holding this tile: the last one whose tile_offset <= tile.
  if (threadIdx.x == 0) {
    int lo = 0, hi = in.num_segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (in.segments[mid].tile_offset <= tile) lo = mid;
      else hi = mid - 1;
    }
    sh.seg_index = lo;
    sh.qnorm2 = 0;
  }
  __syncthreads();
  const prefill_segment seg = in.segments[sh.seg_index];
  const int M = p.query_tile, F = in.fine_slice, C = in.coarse_block, spb = C / F;
  const std::int32_t p0 = (seg.q_begin / M + (tile - seg.tile_offset)) * M;  // the tile's first position
  const std::int32_t first = max(p0, seg.q_begin), last = min(p0 + M, seg.q_begin + seg.num_queries);
  const int valid = last - first;  // queries of this segment in the tile
  const std::int64_t at = std::int64_t{tile} * in.kv_heads + h;
  if (seg.q_begin % M != 0) {  // uniform: a broken segment is reported, never half-selected
    for (int i = threadIdx.x; i < p.top_k_fine; i += kSelectThreads) p.out.kept_slices[at * p.top_k_fine + i] = -1;
    if (threadIdx.x == 0) p.out.num_slices[at] = -1;
    return;
  }
  // Step 1: the window of the tile.
  const std::int32_t ws = contract::window_begin(p0, p.window, F);
  const std::int32_t far_slices = contract::far_slices(ws, F);
  const std::int32_t blocks = contract::candidate_blocks(ws, C);
  if (h == 0 && threadIdx.x == 0) p.out.window_begin[tile] = ws;

  // The group-summed queries of the tile (zeros past `valid`), row by row
  // (CUDA cores) or in mma fragment order (tensor cores): 8 dims a thread
  // at a time, one 16-byte load per head of the group.
  constexpr int kR = prefill_row_floats(D);
  const int group = in.num_q_heads / in.kv_heads;
  unsigned qtop = 0;  // the largest |q_i|^2 this thread saw (float bits)
  for (int e = threadIdx.x; e < kPrefillMaxQueries * (D / 8); e += kSelectThreads) {
    const int i = e / (D / 8), d0 = (e % (D / 8)) * 8;
    float acc[8] = {};
    if (i < valid) {
      const Q* q = in.queries + ((std::int64_t{seg.query_offset} + (first - seg.q_begin) + i) * in.num_q_heads +
                                 std::int64_t{h} * group) * D + d0;
      for (int g = 0; g < group; ++g) {
        if constexpr (sizeof(Q) == 2) {
          const uint4 raw = __ldg(reinterpret_cast<const uint4*>(q + std::int64_t{g} * D));
          const Q* v = reinterpret_cast<const Q*>(&raw);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += to_float(v[j]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += to_float(q[std::int64_t{g} * D + j]);
        }
      }
    }
    if constexpr (TensorCores) {
#pragma unroll
      for (int j = 0; j < 8; ++j) qs[prefill_fragment_offset<D>(i, d0 + j)] = acc[j];
    } else {
      *reinterpret_cast<float4*>(qs + i * kR + d0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      *reinterpret_cast<float4*>(qs + i * kR + d0 + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    if constexpr (TensorCores) {  // |q_i|^2 for the plain pass's bound: row i's D / 8 threads are adjacent lanes
      float sq = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sq = fmaf(acc[j], acc[j], sq);
#pragma unroll
      for (int off = 1; off < D / 8; off <<= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, off);
      qtop = max(qtop, __float_as_uint(sq));  // non-negative or NaN: as unsigned, NaN is largest

    }
  }
  if constexpr (TensorCores) {  // read after score_candidates' first barrier
    qtop = __reduce_max_sync(0xFFFFFFFFu, qtop);
    if (threadIdx.x % 32 == 0) atomicMax(&sh.qnorm2, qtop);
  }

  const std::int64_t seq_layer = in.seq_layer(seg.slot, in.layer);
  const std::int64_t head_stride = in.row_stride();
  const float* slice_base = in.slice_sums + in.slice_row(seq_layer, h);
  const float* block_base = in.block_sums + in.block_row(seq_layer, h);
  // This (segment, KV head)'s fp16 plain rows (prefill_plain_rows_kernel):
  // its slices', then its blocks', found again at each use from the
  // launch's constants (registers are short). A segment the rows do not
  // cover scores every candidate in one exact pass.
  constexpr bool kHalf = Plain == prefill_scoring::plain_f16;
  const bool half = kHalf && sh.seg_index < in.plain_segments &&
                    std::int64_t{seg.q_begin} + seg.num_queries <= in.plain_positions;
  const bool two_pass = in.two_pass && (half || !kHalf);
  auto plain_row = [&](std::int64_t r) -> const void* {
    return static_cast<const unsigned char*>(in.plain_rows) +
           ((std::int64_t{sh.seg_index} * in.kv_heads + h) * p.plain_stride + r) * prefill_plain_row_bytes(D);
  };
  auto* partial_plain = reinterpret_cast<unsigned char*>(partial + D);

  // Step 4: blocks; the one holding ws (if partial) by its far slices' sums,
  // added up here once (score_candidates starts with a barrier), and its
  // plain row.
  const bool partial_last = std::int64_t{blocks} * C > ws;
  if (partial_last) {
    for (int d = threadIdx.x; d < D; d += kSelectThreads) {
      float sum = 0.0f;
      for (std::int32_t sl = (blocks - 1) * spb; sl < far_slices; ++sl) sum += __ldg(slice_base + sl * head_stride + d);
      partial[d] = sum;
    }
    if (kHalf && half) {  // uniform
      __syncthreads();
      if (threadIdx.x < 32) store_plain_row<D>(partial, partial_plain, static_cast<int>(threadIdx.x));
    }
  }
  std::int32_t* out_blocks = p.out.kept_blocks ? p.out.kept_blocks + at * p.top_k_coarse : nullptr;
  const int kept = filter_stage<D, Wide, Plain>(
      blocks, p.top_k_coarse, two_pass, valid, p.stages, qs, ring, red, partial, slice_base, coarse_scores, keep,
      keys, temp, sh,
      [&](int r) -> const float* {
        return partial_last && r == blocks - 1 ? partial : block_base + r * head_stride;
      },
      [&](int r) { return 1.0f / static_cast<float>(partial_last && r == blocks - 1 ? ws - r * C : C); },
      partial_plain,
      [&](int r) -> const void* {
        return partial_last && r == blocks - 1 ? static_cast<const void*>(partial_plain)
                                               : plain_row(p.plain_slices + r);
      },
      [&](int pos, int block) {
        kept_blocks[pos] = block;
        if (out_blocks) out_blocks[pos] = block;
      });
  if (out_blocks)
    for (int i = kept + threadIdx.x; i < p.top_k_coarse; i += kSelectThreads) out_blocks[i] = -1;

  // Step 5: the far slices of the kept blocks (only the last kept block can
  // reach past ws, so the real candidates are exactly the first `candidates`).
  auto slice_of = [&](int c) { return kept_blocks[c / spb] * spb + c % spb; };
  const int candidates = kept == 0 ? 0 : contract::fine_candidates(kept, kept_blocks[kept - 1], spb, far_slices);
  std::int32_t* out_slices = p.out.kept_slices + at * p.top_k_fine;
  const int kept_slices = filter_stage<D, Wide, Plain>(
      candidates, p.top_k_fine, two_pass, valid, p.stages, qs, ring, red, partial, slice_base, fine_scores, keep,
      keys, temp, sh, [&](int c) -> const float* { return slice_base + slice_of(c) * head_stride; },
      [&](int) { return 1.0f / static_cast<float>(F); }, partial_plain,
      [&](int c) { return plain_row(slice_of(c)); },
      [&](int pos, int c) { out_slices[pos] = slice_of(c); });
  for (int i = kept_slices + threadIdx.x; i < p.top_k_fine; i += kSelectThreads) out_slices[i] = -1;
  if (threadIdx.x == 0) p.out.num_slices[at] = kept_slices;
}

/// Lays out a prefill CTA's shared memory in `p`: ranking storage (decode's
/// layout, its key scratch moved onto the ring, which is idle while ranking),
/// the partial block, the reduction, the queries and the ring, 2-deep where
/// `limit` bytes allow, else 1. Returns the bytes, or 0 where not even one
/// stage fits.
template <class Q>
int plan_prefill_smem(prefill_params<Q>& p, const SparseAttentionConfig& cfg, bool wide, bool tensor_cores,
                      int head_dim, int limit, int max_stages) {
  auto align = [](int x) { return (x + 15) / 16 * 16; };
  selection_smem sel = plan_selection_smem(cfg, p.in.max_blocks, wide, /*own_keys=*/false);
  const int key_bytes = selection_key_bytes(cfg, wide);
  const int tile_bytes = prefill_stage_bytes(head_dim);
  p.partial_offset = align(sel.bytes);
  p.red_offset = align(p.partial_offset + head_dim * 4 + prefill_plain_row_bytes(head_dim));
  p.q_offset = align(p.red_offset + prefill_groups(tensor_cores) * kPrefillCandidates * 4);
  p.ring_offset = p.q_offset + prefill_query_bytes(head_dim);
  sel.keys = p.ring_offset;
  p.smem = sel;
  for (int stages = std::clamp(max_stages, 1, 2); stages >= 1; --stages)
    if (p.ring_offset + stages * tile_bytes <= limit && key_bytes <= stages * tile_bytes) {
      p.stages = stages;
      return p.ring_offset + stages * tile_bytes;
    }
  return 0;
}

template <class Q, int D>
status launch_prefill_selection(prefill_params<Q>& p, const SparseAttentionConfig& cfg, bool wide,
                                bool tensor_cores, cudaStream_t stream) {
  using scoring = prefill_scoring;
  const bool half = tensor_cores && p.in.two_pass && p.in.plain_rows != nullptr;
  const scoring plain = !tensor_cores ? scoring::fma : half ? scoring::plain_f16 : scoring::plain_tf32;
  auto pick = [&](auto wide_c) {
    constexpr bool W = decltype(wide_c)::value;
    return plain == scoring::fma          ? &prefill_selection_kernel<Q, D, W, scoring::fma>
           : plain == scoring::plain_f16 ? &prefill_selection_kernel<Q, D, W, scoring::plain_f16>
                                         : &prefill_selection_kernel<Q, D, W, scoring::plain_tf32>;
  };
  auto* kernel = wide ? pick(std::true_type{}) : pick(std::false_type{});
  // Host queries only (capturable): the device's per-CTA opt-in limit less
  // the kernel's static shared memory.
  gpu_limits gpu;
  HISPARSE_TRY(current_gpu_limits(gpu));
  cudaFuncAttributes attr{};
  HISPARSE_CUDA_TRY(cudaFuncGetAttributes(&attr, kernel));
  const int bytes =
      plan_prefill_smem(p, cfg, wide, tensor_cores, D, gpu.smem_per_block - static_cast<int>(attr.sharedSizeBytes),
                        p.in.max_ring_stages);
  if (bytes == 0)
    return fail(status::unsupported, "prefill selection: head_dim " + std::to_string(D) +
                                         " needs more shared memory per CTA than this GPU's " +
                                         std::to_string(gpu.smem_per_block) + " bytes");
  HISPARSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (half) {  // the fp16 plain pass's rows first
    plain_rows_params r;
    r.cache = p.in;
    r.segments = p.in.segments;
    r.layer = p.in.layer;
    r.rows = static_cast<unsigned char*>(p.in.plain_rows);
    r.positions = p.in.plain_positions;
    r.slices = static_cast<std::int32_t>(prefill_plain_slices(r.positions, p.in.fine_slice));
    r.blocks = static_cast<std::int32_t>(prefill_plain_blocks(r.positions, p.in.coarse_block));
    p.plain_slices = r.slices;
    p.plain_stride = std::int64_t{r.slices} + r.blocks;
    constexpr int kWarps = kSelectThreads / 32;
    const dim3 rows_grid(static_cast<unsigned>((std::int64_t{r.slices} + r.blocks + kWarps - 1) / kWarps),
                         static_cast<unsigned>(p.in.kv_heads),
                         static_cast<unsigned>(std::min(p.in.num_segments, p.in.plain_segments)));
    prefill_plain_rows_kernel<D><<<rows_grid, kSelectThreads, 0, stream>>>(r);
    HISPARSE_CUDA_TRY(cudaGetLastError());
  }
  const dim3 grid(static_cast<unsigned>(p.in.kv_heads), static_cast<unsigned>(p.in.num_tiles));
  kernel<<<grid, kSelectThreads, static_cast<std::size_t>(bytes), stream>>>(p);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

}  // namespace detail

/// Checks a prefill selection before any work.
template <class Q>
[[nodiscard]] status can_implement_prefill_selection(const SparseAttentionConfig& cfg,
                                                     const prefill_selection_arguments<Q>& a,
                                                     const prefill_selection_output& out) {
  HISPARSE_TRY(check(cfg));
  HISPARSE_TRY(check(attention_shape{a.num_q_heads, a.kv_heads, a.head_dim}));
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "prefill selection: " + why); };
  if (a.num_segments < 1 || a.num_tiles < 1) return bad("no segments or no tiles");
  if (a.num_tiles > 65535) return fail(status::unsupported, "prefill selection: at most 65535 tiles per launch");
  if (cfg.coarse_summary != coarse_summary::mean)
    return fail(status::unsupported, "prefill selection: coarse_summary key_bounds is not built on the GPU for prefill (the "
                                         "decode selection has it)");
  if (a.queries == nullptr || a.segments == nullptr || a.slice_sums == nullptr || a.block_sums == nullptr)
    return bad("queries, segments and the cache's summaries must not be null (a cache without "
               "maintain_summaries keeps none)");
  if (reinterpret_cast<std::uintptr_t>(a.queries) % 16 != 0) return bad("queries must be 16-byte aligned");
  if (a.plain_rows != nullptr) {
    if (reinterpret_cast<std::uintptr_t>(a.plain_rows) % 16 != 0) return bad("plain_rows must be 16-byte aligned");
    // (At most the cache's positions: a (segment, KV head)'s rows then count
    // below 2^31, max_blocks being at most 4096.)
    if (a.plain_segments < 1 || a.plain_positions < 1 ||
        a.plain_positions > a.positions())
      return bad("plain_rows needs plain_segments of at least 1 and plain_positions in [1, the cache's positions]");
    if (std::min(a.num_segments, a.plain_segments) > 65535)
      return fail(status::unsupported, "prefill selection: plain rows for at most 65535 segments per launch");
  }
  if (out.kept_slices == nullptr || out.num_slices == nullptr || out.window_begin == nullptr)
    return bad("kept_slices, num_slices and window_begin outputs must not be null");
  return detail::check_summaries(cfg, a, a.layer, "prefill");
}

/// The selection of every query tile of a prefill batch: one launch (two
/// with plain_rows: their copy first), no sync, no allocation (capturable;
/// the segments are device data).
template <class Q>
[[nodiscard]] status select_prefill_async(const SparseAttentionConfig& cfg, const prefill_selection_arguments<Q>& a,
                                          const prefill_selection_output& out, cudaStream_t stream = nullptr) {
  HISPARSE_TRY(can_implement_prefill_selection(cfg, a, out));
  const bool wide = detail::wide_selection(cfg, a.max_blocks);
  detail::prefill_params<Q> p{};
  p.in = a;
  p.out = out;
  p.window = cfg.window;
  p.top_k_coarse = cfg.top_k_coarse;
  p.top_k_fine = cfg.top_k_fine;
  p.query_tile = cfg.query_tile;
  return dispatch_head_dim(a.head_dim, [&](auto d) {
    return detail::launch_prefill_selection<Q, d()>(p, cfg, wide, a.use_tensor_cores, stream);
  });
}

}  // namespace hisparse::select

/// `prefix template` of select_prefill_async for queries Q (core/macros.hpp:
/// HISPARSE_EXTERN_TEMPLATES).
#define HISPARSE_SELECT_PREFILL_INSTANCE(prefix, Q)                                                        \
  prefix template ::hisparse::status hisparse::select::select_prefill_async<Q>(                          \
      const ::hisparse::SparseAttentionConfig&, const ::hisparse::select::prefill_selection_arguments<Q>&, \
      const ::hisparse::select::prefill_selection_output&, cudaStream_t);
#if defined(HISPARSE_EXTERN_TEMPLATES)
HISPARSE_SELECT_PREFILL_INSTANCE(extern, __nv_bfloat16)
HISPARSE_SELECT_PREFILL_INSTANCE(extern, __half)
#endif
