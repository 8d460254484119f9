#pragma once
// Decode selection: the coarse and fine filters of DESIGN.md section 1 for
// one query per sequence (M = 1), fused into one launch. A cluster of 4 CTAs
// per (sequence, KV head) on sm_90 (they split the scoring and exchange
// scores through distributed shared memory), one CTA on sm_80/sm_89:
//   1. the GQA group's queries are summed in fp32 (sum_g q_g . x = (sum_g q_g) . x);
//   2. every candidate block (bC < ws) is scored against its mean key -- the
//      stored block sum over C for whole blocks, the sum of the far slices'
//      sums over their token count for the block that holds ws (or, with
//      coarse_summary key_bounds, against its key range: the stored block
//      bounds, or the union of the far slices' bounds);
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
#include "hisparse/select/ranking.cuh"
#include "hisparse/select/row_scoring.cuh"
#include "hisparse/select/selection_cta.cuh"
#include "hisparse/select/topk.cuh"
#include "hisparse/tuning.hpp"

namespace hisparse::select {

/// Where the selection of a decode batch goes. Kept lists are ascending and
/// padded with -1; the score arrays (optional) hold each kept item's score.
/// A (sequence, KV head) that reuses its TopK entry (config.hpp,
/// refresh_rule) gets the entry's slices, NaN slice scores, and no kept
/// blocks (-1, scores -inf): its blocks were not ranked this step. Under a
/// late rule they are what serves the next step, not what this step's
/// attention attends (its entry as it stood).
struct decode_selection_output {
  std::int32_t* kept_slices = nullptr;    ///< [batch][kv_heads][top_k_fine]
  std::int32_t* num_slices = nullptr;     ///< [batch][kv_heads]
  std::int32_t* window_begin = nullptr;   ///< [batch]: ws; the window is [ws, length)
  std::int32_t* kept_blocks = nullptr;    ///< optional [batch][kv_heads][top_k_coarse]
  float* block_scores = nullptr;          ///< optional [batch][kv_heads][top_k_coarse]
  float* slice_scores = nullptr;          ///< optional [batch][kv_heads][top_k_fine]
  std::int32_t* refreshed = nullptr;      ///< optional [batch][kv_heads]: 1 selected afresh, 0 reused
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
  /// every selection CTA there has left. The price is L1 (the selection
  /// alone is slower; PERF_NOTES: Decode step), so hierarchical_decode::run
  /// asks for it only where the attention needs the selection's SMs and
  /// there is room on them (see there).
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
  refresh_rule refresh;
  bool cached;              ///< refresh.keeps_entries(): the TopK entries are read and written
  std::int32_t fingerprint;  ///< of the config (selection_fingerprint): an entry another config made is not reused
};

/// What makes a TopK entry reusable by a config besides the rule: the
/// config's window and kept widths and what it scored by (the cache fixes
/// the slice and block sizes). 31 bits, so never an empty entry's -1.
inline std::int32_t selection_fingerprint(const SparseAttentionConfig& c) {
  std::uint32_t h = 2166136261u;
  for (const std::uint32_t x : {static_cast<std::uint32_t>(c.window), static_cast<std::uint32_t>(c.top_k_coarse),
                                static_cast<std::uint32_t>(c.top_k_fine), static_cast<std::uint32_t>(c.fine_summary),
                                static_cast<std::uint32_t>(c.coarse_summary)})
    h = (h ^ x) * 16777619u;
  return static_cast<std::int32_t>(h & 0x7fffffffu);
}

/// The TopK verdict (config.hpp, refresh_rule) for the query at p0 and the
/// entry of its (sequence, KV head): true to reuse the entry. `q` is this
/// thread's dimension of the group-summed query (0 past head_dim); `red`
/// 3 * kSelectWarps floats of shared memory. Every CTA of a cluster gets
/// the same verdict: the same words, summed in the same order.
template <int D>
__device__ bool reuse_topk_entry(const std::int32_t* entry, std::int32_t p0, const refresh_rule& rule,
                                 std::int32_t fingerprint, int top_k_fine, int query_offset, float q, float* red) {
  const std::int32_t made = entry[0];
  if (rule.every <= 1 || made < 0 || p0 < made || p0 - made >= rule.every || entry[2] != fingerprint ||
      entry[1] > top_k_fine)
    return false;
  if (rule.min_cosine <= -1.0f) return true;
  const int t = static_cast<int>(threadIdx.x);
  const float e = t < D ? __int_as_float(entry[query_offset + t]) : 0.0f;
  float v[3] = {q * e, q * q, e * e};
#pragma unroll
  for (float& x : v)
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  constexpr int kWarps = (D + 31) / 32;
  if (t % 32 == 0 && t / 32 < kWarps)
    for (int i = 0; i < 3; ++i) red[i * kWarps + t / 32] = v[i];
  __syncthreads();
  float dot = 0, a = 0, b = 0;
  for (int w = 0; w < kWarps; ++w) {
    dot += red[w];
    a += red[kWarps + w];
    b += red[2 * kWarps + w];
  }
  // NaN (a zero or non-finite query) compares false: refresh.
  return dot / (sqrtf(a) * sqrtf(b)) >= rule.min_cosine;
}

/// A reused TopK entry as the selection's output, on the writer CTA: the
/// entry's kept slices (padded with -1), NaN slice scores (not scored this
/// step), no kept blocks.
template <class Q>
__device__ void write_reused_selection(const decode_params<Q>& p, std::int64_t at, const std::int32_t* entry) {
  const int n = entry[1];
  const std::int32_t* kept = entry + kv::topk_cache_ref::kept_offset();
  const float inf = __int_as_float(0x7f800000);
  for (int i = static_cast<int>(threadIdx.x); i < p.top_k_fine; i += kSelectThreads) {
    p.out.kept_slices[at * p.top_k_fine + i] = i < n ? kept[i] : -1;
    if (p.out.slice_scores) p.out.slice_scores[at * p.top_k_fine + i] = i < n ? __int_as_float(0x7fc00000) : -inf;
  }
  if (p.out.kept_blocks)
    for (int i = static_cast<int>(threadIdx.x); i < p.top_k_coarse; i += kSelectThreads) {
      p.out.kept_blocks[at * p.top_k_coarse + i] = -1;
      if (p.out.block_scores) p.out.block_scores[at * p.top_k_coarse + i] = -inf;
    }
  if (threadIdx.x == 0) {
    p.out.num_slices[at] = n;
    if (p.out.refreshed) p.out.refreshed[at] = 0;
  }
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
/// CoarseBounds: the coarse stage scores the blocks' key bounds
/// (coarse_summary key_bounds; built with Fine = key_bounds only, whose
/// slice bounds make the partial block's range), else their means.
template <class Q, int D, int S, bool Wide, fine_summary Fine, bool CoarseBounds = false,
          class Shape = dynamic_selection_shape>
__global__ void __launch_bounds__(kSelectThreads, kSelectMinBlocksPerSm) decode_selection_kernel(const __grid_constant__ decode_params<Q> p) {
  if constexpr (S > 1 && !ptx::kArchHasClusters) {  // never launched below sm_90 (launch_selection): no body
    __trap();
    return;
  }
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
  float my_q = 0.0f;  // this thread's dimension of the sum (the TopK test reads it)
  if (t < D) {
    const int group = in.num_q_heads / in.kv_heads;
    const Q* q = in.queries + (std::int64_t{b} * in.num_q_heads + std::int64_t{h} * group) * D + t;
    for (int g = 0; g < group; ++g) my_q += to_float(q[std::int64_t{g} * D]);
    qsum[t] = my_q;
  }
  const std::int64_t seq_layer = in.seq_layer(seq, in.layer);
  const std::int32_t length = in.lengths[seq_layer];
  const int F = Shape::kFineSlice ? Shape::kFineSlice : in.fine_slice;
  const int C = Shape::kCoarseBlock ? Shape::kCoarseBlock : in.coarse_block, spb = C / F;
  const int top_k_coarse = Shape::kTopKCoarse ? Shape::kTopKCoarse : p.top_k_coarse;
  const int top_k_fine = Shape::kTopKFine ? Shape::kTopKFine : p.top_k_fine;
  // Step 1 for M = 1: the query sits at length - 1.
  const std::int32_t ws = contract::window_begin(length - 1, p.window, F);
  const std::int32_t far_slices = contract::far_slices(ws, F);
  const std::int32_t blocks = contract::candidate_blocks(ws, C);
  if (rank == 0 && h == 0 && t == 0) p.out.window_begin[b] = ws;

  // A TopK entry the rule lets this query reuse: the writer copies it out
  // and the cluster leaves before any load for the ranking is issued. Every
  // CTA reads the current entry here, before the first cluster barrier; an
  // on-time rule's writer overwrites it only after the second, a late
  // rule's writes the other entry (its step's attention reads the current
  // one meanwhile) and marks it pending (control word 1: the attention
  // makes it current). Either clears a pending mark it does not set.
  const std::int64_t at = std::int64_t{b} * in.kv_heads + h;
  const bool writer = rank == 0;
  std::int32_t* control = p.cached ? in.topk_entry(seq_layer, h) : nullptr;
  std::int32_t* entry = nullptr;  // the current entry
  std::int32_t* written = nullptr;  // where a fresh selection goes
  if (p.cached) {  // uniform
    const int current = control[0] & 1;
    entry = in.topk.entry(control, current);
    written = p.refresh.late ? in.topk.entry(control, current ^ 1) : entry;
    __shared__ float reuse_red[3 * kSelectWarps];
    if (reuse_topk_entry<D>(entry, length - 1, p.refresh, p.fingerprint, top_k_fine, in.topk.query_offset(), my_q,
                            reuse_red)) {
      if (writer) {
        write_reused_selection(p, at, entry);
        if (threadIdx.x == 0) control[1] = 0;
      }
      cluster::wait();  // the arrive above; nobody touches another CTA's shared memory
      return;
    }
  }

  const std::int64_t head_stride = in.row_stride();
  const std::int64_t slice_offset = in.slice_row(seq_layer, h);
  const float* slice_base = in.slice_sums + slice_offset;
  const float* block_base = in.block_sums + in.block_row(seq_layer, h);
  // With coarse key bounds the block rows are their bounds (4-byte words
  // like the sums, so the same batches and prefetches) and the partial
  // block's are its far slices' bounds, combined where they are scored.
  const std::uint32_t* bounds_base = CoarseBounds ? in.block_bounds + in.block_row(seq_layer, h) : nullptr;
  const std::uint32_t* slice_bounds_base =
      CoarseBounds ? static_cast<const std::uint32_t*>(in.fine_rows) + slice_offset : nullptr;
  // Step 4's candidate blocks: whole blocks use their stored sum; the block
  // holding ws (if it is partial) is scored by the sum of its far slices'
  // sums, on the warp next in line after the whole blocks.
  const std::int32_t whole = std::int64_t{blocks} * C > ws ? blocks - 1 : blocks;
  auto block_row = [&](int r) { return block_base + r * head_stride; };
  auto block_bounds_row = [&](int r) { return bounds_base + r * head_stride; };
  // This warp's first batch of block sums heads for L2 now, and the partial
  // block's far slices for this CTA's shared memory, so their trips from
  // HBM overlap the cluster barrier.
  row_batch<D, S>::prefetch(cluster_warp<S>(), whole, [&](int u) {
    const int r = cluster_warp<S>() + u * row_batch<D, S>::kStride;
    if constexpr (CoarseBounds) return reinterpret_cast<const float*>(block_bounds_row(r));
    return block_row(r);
  });
  const bool partial_warp = whole < blocks && cluster_warp<S>() == whole % (S * kSelectWarps);
  const int partial_rows = far_slices - whole * spb;  // >= 1 where whole < blocks
  const float* partial_first = slice_base + std::int64_t{whole} * spb * head_stride;
  const std::uint32_t* partial_bounds =
      CoarseBounds ? slice_bounds_base + std::int64_t{whole} * spb * head_stride : nullptr;
  if (partial_warp)
    stage_summed_row<D>(staged, CoarseBounds ? reinterpret_cast<const float*>(partial_bounds) : partial_first,
                        head_stride, partial_rows);
  // Blocks ranked by counting (count_top_k): the mask their bits go to
  // starts empty.
  const bool count_blocks = blocks > top_k_coarse && blocks <= kSelectThreads * S;
  if (count_blocks)
    for (int w = t; w < (blocks + 31) / 32; w += kSelectThreads) kept_mask[w] = 0u;

  if constexpr (S > 1) __syncthreads();  // qsum, within the CTA (the arrive was relaxed)
  cluster::wait();                         // every CTA of the cluster is running

  // Step 4: score the candidate blocks.
  auto store_block = [&](int r, float s) { broadcast<S>(coarse_scores, r, s); };
  if constexpr (CoarseBounds) {
    score_rows<D, S, std::uint32_t>(
        whole, qsum, [](int r) { return r; }, block_bounds_row, 1.0f, store_block, [](int) {});
    if (partial_warp)
      score_bounds_union<D>(staged, partial_bounds, head_stride, partial_rows, qsum,
                            [&](float s) { store_block(whole, s); });
  } else {
    score_rows<D, S>(
        whole, qsum, [](int r) { return r; }, block_row, 1.0f / static_cast<float>(C), store_block, [](int) {});
    if (partial_warp)
      score_summed_row<D>(staged, partial_first, head_stride, partial_rows, qsum,
                          1.0f / static_cast<float>(ws - whole * C), [&](float s) { store_block(whole, s); });
  }
  cluster::sync();
  // Every CTA has read the TopK entry (before this barrier): the writer
  // may overwrite it with this selection.
  if (writer && (p.cached || p.out.refreshed)) {
    if (p.cached) {
      if (t < D) reinterpret_cast<float*>(written + in.topk.query_offset())[t] = my_q;
      if (t == 0) {
        written[0] = length - 1;
        written[2] = p.fingerprint;
        control[1] = p.refresh.late ? 1 : 0;
      }
    }
    if (t == 0 && p.out.refreshed) p.out.refreshed[at] = 1;
  }
  std::int32_t* entry_kept = p.cached ? written + kv::topk_cache_ref::kept_offset() : nullptr;

  int kept = 0;
  float* out_block_scores = writer && p.out.block_scores ? p.out.block_scores + at * top_k_coarse : nullptr;
  std::int32_t* out_blocks = writer && p.out.kept_blocks ? p.out.kept_blocks + at * top_k_coarse : nullptr;
  auto emit_block = [&](int pos, int block) {
    kept_blocks[pos] = block;
    if (out_blocks) out_blocks[pos] = block;
    if (out_block_scores) out_block_scores[pos] = coarse_scores[block];
  };
  if (count_blocks) {  // uniform across the cluster
    kept = count_top_k<S>(coarse_scores, keys, blocks, top_k_coarse, kept_mask, emit_block);
  } else if (blocks > 0 && blocks <= top_k_coarse) {  // every block kept
    for (int i = t; i < blocks; i += kSelectThreads) emit_block(i, i);
    kept = blocks;
    __syncthreads();
  } else if (blocks > 0) {
    mark_top_k<Wide>(coarse_scores, blocks, top_k_coarse, keep, keys, temp);
    kept = compact_marked<kMaxCandidates>(keep, blocks, temp.scan, emit_block);
  }
  if (out_blocks)
    for (int i = kept + t; i < top_k_coarse; i += kSelectThreads) {
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
  const bool by_warp = fits_warp_rank(candidates, top_k_fine);
  const bool by_groups = !by_warp && candidates > top_k_fine && candidates <= kFilterMaxCandidates &&
                         top_k_fine <= kFilterMaxK && fine_groups >= 2 * top_k_fine &&
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

  std::int32_t* out_slices = p.out.kept_slices + at * top_k_fine;
  float* out_slice_scores = p.out.slice_scores ? p.out.slice_scores + at * top_k_fine : nullptr;
  auto emit_slice = [&](int pos, int c) {
    out_slices[pos] = slice_of(c);
    if (entry_kept) entry_kept[pos] = slice_of(c);
    if (out_slice_scores) out_slice_scores[pos] = fine_scores[c];
  };
  int kept_slices = 0;
  if (by_warp) {  // uniform across the CTA
    // Warp 0 ranks alone; the others wait only to learn whether it could
    // (more than kWarpRankSurvivors survivors: the CTA's filter below).
    // It writes num_slices itself, before the barrier (sooner than at the
    // common end below).
    if (t < 32) {
      const int n = warp_rank_filter(fine_scores, candidates, top_k_fine, keys);
      if (t == 0) fine_survivors = n;
      if (n <= kWarpRankSurvivors) {
        warp_rank_place(keys, n, top_k_fine, emit_slice);
        if (t == 0) {
          p.out.num_slices[at] = top_k_fine;
          if (written) written[1] = top_k_fine;
        }
      }
    }
    __syncthreads();
    if (fine_survivors <= kWarpRankSurvivors) return;
  }
  if (by_groups) {  // uniform across the CTA
    top_k_of_groups(fine_scores, candidates, top_k_fine, fine_group_max, fine_groups, keys, temp.filter,
                    emit_slice);
    kept_slices = top_k_fine;
  } else if (candidates > 0) {  // by_warp's fallback too
    mark_top_k<Wide>(fine_scores, candidates, top_k_fine, keep, keys, temp);
    kept_slices = compact_marked<kMaxCandidates>(keep, candidates, temp.scan, emit_slice);
  }
  for (int i = kept_slices + t; i < top_k_fine; i += kSelectThreads) {
    out_slices[i] = -1;
    if (out_slice_scores) out_slice_scores[i] = -__int_as_float(0x7f800000);
  }
  if (t == 0) {
    p.out.num_slices[at] = kept_slices;
    if (written) written[1] = kept_slices;
  }
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

template <class Q, int D, int S, auto Kernel>
status launch_selection_kernel(const decode_params<Q>& p, int kv_heads, int batch, cudaStream_t stream) {
  // Both attributes stay with the kernel, so each is set only where it
  // changes (kernel_build.hpp): a launch costs no driver call for them.
  HISPARSE_TRY(hisparse::detail::raise_dynamic_smem<Kernel>(p.smem.bytes));
  HISPARSE_TRY(hisparse::detail::prefer_carveout<Kernel>(p.in.max_shared_carveout
                                                             ? static_cast<int>(cudaSharedmemCarveoutMaxShared)
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
  HISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, Kernel, p));
  return status::success;
}

template <class Q, int D, int S, class Shape = dynamic_selection_shape>
status launch_selection(const decode_params<Q>& p, bool wide, fine_summary fine, bool coarse_bounds, int kv_heads,
                        int batch, cudaStream_t stream) {
  auto launch = [&](auto k, auto bounds) {
    return wide ? launch_selection_kernel<Q, D, S, &decode_selection_kernel<Q, D, S, true, k(), bounds(), Shape>>(
                      p, kv_heads, batch, stream)
                : launch_selection_kernel<Q, D, S, &decode_selection_kernel<Q, D, S, false, k(), bounds(), Shape>>(
                      p, kv_heads, batch, stream);
  };
  if constexpr (Shape::kFineSummary >= 0) {  // one kind, fixed (matches() checked the config's)
    constexpr auto k = std::integral_constant<fine_summary, static_cast<fine_summary>(Shape::kFineSummary)>{};
    constexpr bool bounds = Shape::kCoarseSummary == static_cast<int>(coarse_summary::key_bounds);
    return launch(k, std::bool_constant<bounds>{});
  } else {
    return dispatch_fine_summary(fine, [&](auto k) {
      if constexpr (k() == fine_summary::key_bounds)
        if (coarse_bounds) return launch(k, std::true_type{});
      return launch(k, std::false_type{});
    });
  }
}

template <class Q, int D, class Shape = dynamic_selection_shape>
status launch_selection(const decode_params<Q>& p, bool wide, fine_summary fine, bool coarse_bounds, int kv_heads,
                        int batch, cudaStream_t stream) {
  if (!p.in.use_clusters)
    return launch_selection<Q, D, 1, Shape>(p, wide, fine, coarse_bounds, kv_heads, batch, stream);
  // Clusters where the loaded build is sm_90 or newer (a build without sm_90
  // code runs the single-CTA kernel on an H100). The narrow and wide kernels
  // are built for the same architectures.
  static hisparse::detail::per_device_flag built;
  const bool clusters = built.get([] {
    constexpr auto kFine = Shape::kFineSummary >= 0 ? static_cast<fine_summary>(Shape::kFineSummary) : fine_summary::mean;
    constexpr bool kBounds = Shape::kCoarseSummary == static_cast<int>(coarse_summary::key_bounds);
    void (*kernel)(decode_params<Q>) = &decode_selection_kernel<Q, D, kSelectCluster, false, kFine, kBounds, Shape>;
    return hisparse::detail::kernel_built_for_sm90(reinterpret_cast<const void*>(kernel));
  });
  return clusters ? launch_selection<Q, D, kSelectCluster, Shape>(p, wide, fine, coarse_bounds, kv_heads, batch, stream)
                  : launch_selection<Q, D, 1, Shape>(p, wide, fine, coarse_bounds, kv_heads, batch, stream);
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
    return bad("queries, slots and the cache's summaries must not be null (a cache without maintain_summaries "
               "keeps none)");
  using launch = typename decode_selection_arguments<Q>::dependents_launch;
  if (static_cast<unsigned>(a.dependents) > static_cast<unsigned>(launch::after_fine_scores))
    return bad("dependents is not one of at_start, after_blocks, after_fine_scores");
  if (cfg.coarse_summary == coarse_summary::key_bounds && cfg.fine_summary != fine_summary::key_bounds)
    return fail(status::unsupported, "decode selection: coarse_summary key_bounds is built beside fine_summary "
                                     "key_bounds only (the GPU ranks blocks by bounds where it ranks slices by them)");
  if (!a.keeps(cfg.coarse_summary))
    return bad("the config's coarse_summary is key_bounds and the cache keeps no block key bounds with slice key "
               "bounds beside them (build it with paged_kv_cache_options::coarse_summary and fine_summary "
               "key_bounds)");
  if (cfg.refresh.keeps_entries() && (a.topk.entries == nullptr || a.topk.slices < cfg.top_k_fine))
    return bad("the config's refresh rule (every " + std::to_string(cfg.refresh.every) + ", min_cosine " +
               std::to_string(cfg.refresh.min_cosine) +
               (cfg.refresh.late ? ", late" : "") + ") reuses TopK entries and the cache keeps " +
               (a.topk.entries == nullptr ? std::string("none")
                                          : "entries of " + std::to_string(a.topk.slices) + " slices") +
               "; build it with paged_kv_cache_options::topk_cache_slices >= top_k_fine (" +
               std::to_string(cfg.top_k_fine) + ")");
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
/// Shape: the kernel's compile-time numbers (selection_shape); a config
/// they do not match is invalid_argument.
template <class Shape, class Q>
[[nodiscard]] status select_decode_fixed_async(const SparseAttentionConfig& cfg, const decode_selection_arguments<Q>& a,
                                               const decode_selection_output& out, cudaStream_t stream = nullptr) {
  HISPARSE_TRY(can_implement_decode_selection(cfg, a, out));
  if (!Shape::matches(cfg))
    return fail(status::invalid_argument, "decode selection: the config's top-k widths or slice/block sizes differ "
                                          "from the kernel's compile-time shape");
  const bool wide = detail::wide_selection(cfg, a.max_blocks);
  detail::selection_smem smem = detail::plan_selection_smem(cfg, a.max_blocks, wide);
  smem.partial = smem.bytes;
  smem.bytes += detail::kPartialBytes;
  const detail::decode_params<Q> p{a,
                                   out,
                                   cfg.window,
                                   cfg.top_k_coarse,
                                   cfg.top_k_fine,
                                   smem,
                                   cfg.refresh,
                                   cfg.refresh.keeps_entries(),
                                   detail::selection_fingerprint(cfg)};
  return dispatch_head_dim(a.head_dim, [&](auto d) {
    return detail::launch_selection<Q, d(), Shape>(p, wide, cfg.fine_summary,
                                                   cfg.coarse_summary == coarse_summary::key_bounds, a.kv_heads,
                                                   a.batch, stream);
  });
}

/// The same for any config: the kernel reads the numbers at run time.
template <class Q>
[[nodiscard]] status select_decode_async(const SparseAttentionConfig& cfg, const decode_selection_arguments<Q>& a,
                                         const decode_selection_output& out, cudaStream_t stream = nullptr) {
  return select_decode_fixed_async<dynamic_selection_shape>(cfg, a, out, stream);
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
    return select_decode_fixed_async<policy_shape<Policy>>(config, a, out, stream);
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
