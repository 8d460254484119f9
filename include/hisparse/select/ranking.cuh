#pragma once
// Ranking primitives of the selection kernels, on the order-preserving keys
// of topk_keys.hpp (ties to the lower index, NaN last): a stage's shared
// temporaries (filter_storage, selection_temp: CUB's TempStorage idiom, the
// caller owns them), the threshold filter (mark_top_k, top_k_of_groups),
// the compaction of what it marked (compact_marked), counting across a
// cluster (count_top_k) and the one-warp ranking of small stages
// (warp_rank_filter, warp_rank_place).

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "hisparse/select/selection_cta.cuh"
#include "hisparse/select/topk.cuh"
#include "hisparse/select/topk_keys.hpp"
#include "hisparse/tuning.hpp"

namespace hisparse::select::detail {

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
/// Ballots, not shuffles, count the threshold: shuffles and shared-memory
/// loads share the SM's MIO queue with the decode attention's ldmatrix and
/// cp.async traffic when its CTAs run beside this one
/// (hierarchical_decode::run; PERF_NOTES: Decode selection).
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

}  // namespace hisparse::select::detail
