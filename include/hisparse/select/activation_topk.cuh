#pragma once
// Activation top-k gating on the GPU: per row of activations A [rows][n]
// keep the K largest scores fl32(|A_i| g_i) (gate g [n]), emitting their
// column indices in ascending order and the gathered activations as two
// arrays -- an index cache apart from a value cache -- and the gated GEMV
// that consumes them. Contract: reference/activation_topk.hpp, which the
// kept sets equal bit for bit (ties to the lower index, NaN below every
// number, -0 == +0).
//
// One CTA a row, reading it twice (the second read hits L2):
//  1. 1024 evenly spaced scores bracket the K-th largest: the top 16 bits
//     of the sample's words at the ranks K 1024 / n -+ four standard
//     deviations of that count, widened to whole 16-bit prefixes, are
//     [lo, hi] (radix select with 8-bit digits, two digits a rank);
//  2. one pass, each warp over its own contiguous segment of the row,
//     counts the scores above hi and compacts the words inside [lo, hi]
//     into the warp's room of shared memory (~11% of the row at K = n / 4);
//     the same radix select over those candidates, on the bits lo and hi
//     differ in, finds the K-th largest word T and how many ties at T are
//     kept. Where the bracket misses (sorted or periodic rows) or a warp
//     finds more than its room holds (ties; sorted rows, whose bracket lies
//     in one segment, past ~9K columns), the search reads the row instead:
//     slower, same answer;
//  3. one pass emits, in index order, every score above T and the first
//     ties at T, each at its warp's offset (one scan of the warps' counts)
//     plus a warp scan a step, staged in the warp's room so the outputs
//     leave in coalesced runs.
// Words are topk_keys.hpp's ordered_bits, so a comparison of two words
// ranks two scores as the contract does.
//
// The gated GEMV, y_r = W[:, idx_r] vals_r, reads W stored by column
// (W^T [n][outs]: a kept column is one contiguous run) and only the
// columns some row of the batch keeps. A CTA takes a range of columns and
// a tile of outputs: it scatters the rows' kept values of its range into
// shared memory, lists the columns any row kept, and streams those columns
// of W once for the whole batch. Partial sums per column range go to
// temporary storage and a second kernel adds them in a fixed order, so the
// result is deterministic.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/kernel_build.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/core/status.hpp"
#include "hisparse/select/topk.cuh"
#include "hisparse/select/topk_keys.hpp"
#include "hisparse/tuning.hpp"

namespace hisparse::select {

/// What a row keeps: its own K, or every score at least a threshold.
enum class gating_rule { top_k, threshold };

namespace detail {

inline constexpr int kGateThreads = tuning::kGateThreads;
inline constexpr int kGateVec = 8;                            ///< columns a thread reads at once: 16 bytes of fp16
inline constexpr int kGateWarpTile = 32 * kGateVec;          ///< columns a warp covers per step
inline constexpr int kGateSamplePerThread = tuning::kGateSamplePerThread;
inline constexpr int kGateSample = kGateThreads * kGateSamplePerThread;  ///< sampled scores a row
inline constexpr int kGateCandidates = tuning::kGateCandidates;
inline constexpr int kGateWarps = kGateThreads / 32;
inline constexpr int kGateWarpCandidates = kGateCandidates / kGateWarps;  ///< a warp's room for candidates
inline constexpr int kGateBatch = tuning::kGateBatch;         ///< steps whose loads are in flight together
inline constexpr float kGateSampleSigmas = 4.0f;              ///< the bracket's margin, in standard deviations

template <class T>
inline constexpr bool is_gate_value_v = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;
template <class G>
inline constexpr bool is_gate_weight_v = is_gate_value_v<G> || std::is_same_v<G, float>;

/// The ordered word of one column's score: fl32(|a| g), one rounding.
__device__ __forceinline__ std::uint32_t gate_word(float a, float g) { return ordered_bits(ptx::abs_mul_rn(a, g)); }

/// f(std::integral_constant<unsigned, J>) for J = 0 .. kGateVec - 1.
template <class F>
__device__ __forceinline__ void for_each_column(F&& f) {
  [&]<unsigned... J>(std::integer_sequence<unsigned, J...>) {
    (f(std::integral_constant<unsigned, J>{}), ...);
  }(std::make_integer_sequence<unsigned, kGateVec>{});
}

/// One row as its CTA reads it, a step of kGateVec columns a thread.
template <class T, class G>
struct gate_row {
  const T* a;
  const G* gate;
  int n;
  int seg;            ///< columns a warp covers, [warp seg, (warp + 1) seg): whole warp steps
  bool a_vec, g_vec;  ///< 16-byte aligned: whole steps load as vectors

  /// Columns first .. first + 7 of A (0 past n).
  __device__ __forceinline__ uint4 load(int first) const {
    if (a_vec && first + kGateVec <= n) return ptx::ld_nc_no_l1(a + first);  // L1 keeps the gate every row reads
    uint4 raw = make_uint4(0, 0, 0, 0);
    T* x = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < kGateVec; ++j)
      if (first + j < n) x[j] = a[first + j];
    return raw;
  }

  /// The scores fl32(|a| g) of those columns (garbage past n: the caller
  /// masks them).
  __device__ __forceinline__ void scores(const uint4& raw, int first, float (&s)[kGateVec]) const {
    const T* x = reinterpret_cast<const T*>(&raw);
    float g[kGateVec];
    if (g_vec && first + kGateVec <= n) {
      if constexpr (std::is_same_v<G, float>) {
        const float4 g0 = __ldg(reinterpret_cast<const float4*>(gate + first));
        const float4 g1 = __ldg(reinterpret_cast<const float4*>(gate + first) + 1);
        g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w, g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
      } else {
        const uint4 graw = __ldg(reinterpret_cast<const uint4*>(gate + first));
        const G* gv = reinterpret_cast<const G*>(&graw);
#pragma unroll
        for (int j = 0; j < kGateVec; ++j) g[j] = to_float(gv[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kGateVec; ++j) g[j] = first + j < n ? to_float(gate[first + j]) : 0.0f;
    }
    float v[kGateVec];
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // A bf16 is the top half of its float: one shift or mask a column.
      const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < kGateVec; j += 2) {
        v[j] = __uint_as_float(w[j / 2] << 16);
        v[j + 1] = __uint_as_float(w[j / 2] & 0xFFFF0000u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kGateVec; ++j) v[j] = to_float(x[j]);
    }
#pragma unroll
    for (int j = 0; j < kGateVec; ++j) s[j] = ptx::abs_mul_rn(v[j], g[j]);
  }

  /// Their ordered words.
  __device__ __forceinline__ void words(const uint4& raw, int first, std::uint32_t (&w)[kGateVec]) const {
    float s[kGateVec];
    scores(raw, first, s);
#pragma unroll
    for (int j = 0; j < kGateVec; ++j) w[j] = ordered_bits(s[j]);
  }

  /// Bit j set where column first + j is below n.
  __device__ __forceinline__ unsigned valid_mask(int first) const {
    return first + kGateVec <= n ? (1u << kGateVec) - 1u : first >= n ? 0u : (1u << (n - first)) - 1u;
  }

  /// f(first, raw) for each of this thread's steps in column order, its
  /// warp's segment a step of 32 x kGateVec columns at a time, the loads of
  /// kGateBatch steps issued before any is used. Every lane of a warp makes
  /// the same calls (f may hold warp collectives, not barriers); a step
  /// wholly past n is skipped by the warp.
  template <class F>
  __device__ __forceinline__ void for_each_step(F&& f) const {
    const int start = static_cast<int>(threadIdx.x >> 5) * seg;
    const int lane_col = static_cast<int>(threadIdx.x & 31) * kGateVec;
    const int end = min(n, start + seg);
    for (int base = start; base < end; base += kGateWarpTile * kGateBatch) {
      uint4 raw[kGateBatch];
#pragma unroll
      for (int b = 0; b < kGateBatch; ++b) {
        const int first = base + b * kGateWarpTile + lane_col;
        raw[b] = first < end ? load(first) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < kGateBatch; ++b) {
        const int step = base + b * kGateWarpTile;
        if (step < end) f(step + lane_col, raw[b]);
      }
    }
  }
};

/// Block-wide sum of an int a thread; every thread gets it. Two sets of
/// per-warp partials are used in turn, so one barrier a call suffices (a
/// set is rewritten only after the next call's barrier, which every thread
/// passes after reading it).
struct gate_block_sum {
  int (*slots)[kGateWarps];
  int parity = 0;

  __device__ __forceinline__ int operator()(int v) {
    static_assert(kGateWarps == 8, "three butterfly steps add the eight partials");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = __reduce_add_sync(kFullMask, v);
    if (lane == 0) slots[parity][warp] = v;
    __syncthreads();
    int x = slots[parity][lane & 7];
    x += __shfl_xor_sync(kFullMask, x, 1);
    x += __shfl_xor_sync(kFullMask, x, 2);
    x += __shfl_xor_sync(kFullMask, x, 4);
    parity ^= 1;
    return x;
  }
};

static_assert(2 * kGateWarpTile <= kGateWarpCandidates, "a warp stages a step's (index, values) pairs in its room");
static_assert(kGateCandidates % kGateWarps == 0 && kGateWarpCandidates % 2 == 0,
              "every warp's room starts 8-byte aligned, for its staged pairs");
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "values leave as 16-bit words");

struct gate_shared {
  int sums[2][kGateWarps];
  unsigned fill[kGateWarps];  ///< candidates each warp found (its room holds kGateWarpCandidates)
  int kept[2][kGateWarps];    ///< columns above t and ties at t, each warp's segment
  int hist[2][256];           ///< radix_kth's digit counts, used in turn (the idle one is kept zero)
  int found[8];               ///< a radix round's results: (digit, rank left inside it) pairs
  alignas(16) std::uint32_t candidates[kGateCandidates];  ///< a room a warp; then its staged output
};

/// Warp 0's part of a radix round: lane l reads the counts of digits
/// 255 - 8l down to 248 - 8l, and a scan over the lanes from the top digit
/// down tells which digit holds the k-th word.
struct digit_scan {
  int c[8];
  int before, incl;  ///< words in the digits above this lane's, and through its last

  __device__ __forceinline__ explicit digit_scan(const int* hist) {
    const int lane = threadIdx.x & 31;
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      c[j] = hist[255 - 8 * lane - j];
      sum += c[j];
    }
    incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += y;
    }
    before = incl - sum;
  }

  /// The lane holding the k-th word writes (its digit, k less the words
  /// in higher digits) to out.
  __device__ __forceinline__ void find(int k, int* out) const {
    if (before < k && k <= incl) {
      int b = before;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (b + c[j] >= k) {
          out[0] = 255 - 8 * static_cast<int>(threadIdx.x & 31) - j;
          out[1] = k - b;
          break;
        }
        b += c[j];
      }
    }
  }
};

/// Radix select with 8-bit digits: the k-th largest (1 <= k <= their
/// number) of the words for_each_key(f) hands to f across the block (each
/// thread calls f on its own words; every call of for_each_key makes the
/// same barrier-free pass), among those sharing `prefix`'s bits above bit
/// `top`, resolved down to bit `stop` (a multiple of 8; bits below it are
/// left zero). `rest` returns k less the words above the answer's resolved
/// bits: for stop = 0, how many ties at the answer are wanted. A digit
/// costs one shared atomic a word and two barriers; warp 0 finds the digit
/// by a scan of the 256 counts and zeroes the idle histogram.
template <class ForEachKey>
__device__ __forceinline__ std::uint32_t radix_kth(gate_shared& sm, int& cur, int k, std::uint32_t prefix, int top,
                                                   int stop, ForEachKey&& for_each_key, int& rest) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  std::uint32_t w = top >= 31 ? 0u : prefix & ~((2u << top) - 1u);  // the shared bits above top
  for (int shift = top / 8 * 8; shift >= stop; shift -= 8) {
    int* hist = sm.hist[cur];
    const int above_bits = shift + 8;  // words must match w on the bits from here up
    for_each_key([&](std::uint32_t x) {
      if (above_bits >= 32 || ((x ^ w) >> above_bits) == 0) atomicAdd(&hist[(x >> shift) & 0xFF], 1);
    });
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm.hist[cur ^ 1][8 * lane + j] = 0;
      digit_scan(hist).find(k, sm.found);
    }
    __syncthreads();
    w |= static_cast<std::uint32_t>(sm.found[0]) << shift;
    k = sm.found[1];
    cur ^= 1;
  }
  rest = k;
  return w;
}

/// radix_kth to bit 16 for two ranks at once: the rank_hi-th and rank_lo-th
/// largest (each in [1, their number]) of the words for_each_key hands
/// out, their low 16 bits zero. Each of the two digits is one pass that
/// counts for both ranks (the second into two histograms where their top
/// digits differ). Takes both histograms zero and leaves them so.
template <class ForEachKey>
__device__ __forceinline__ void radix_top16_pair(gate_shared& sm, int rank_hi, int rank_lo, ForEachKey&& for_each_key,
                                                 std::uint32_t& hi, std::uint32_t& lo) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* h0 = sm.hist[0];
  int* h1 = sm.hist[1];
  for_each_key([&](std::uint32_t x) { atomicAdd(&h0[x >> 24], 1); });
  __syncthreads();
  if (warp == 0) {
    const digit_scan top(h0);
    top.find(rank_hi, sm.found);
    top.find(rank_lo, sm.found + 2);
    __syncwarp();  // every lane has its counts before any is cleared
#pragma unroll
    for (int j = 0; j < 8; ++j) h0[8 * lane + j] = 0;
  }
  __syncthreads();
  const int d_hi = sm.found[0], d_lo = sm.found[2];
  for_each_key([&](std::uint32_t x) {
    const int d = static_cast<int>(x >> 24), e = static_cast<int>(x >> 16) & 0xFF;
    if (d == d_hi) atomicAdd(&h0[e], 1);
    else if (d == d_lo) atomicAdd(&h1[e], 1);
  });
  __syncthreads();
  if (warp == 0) {
    digit_scan(h0).find(sm.found[1], sm.found + 4);
    digit_scan(d_lo == d_hi ? h0 : h1).find(sm.found[3], sm.found + 6);
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      h0[8 * lane + j] = 0;
      h1[8 * lane + j] = 0;
    }
  }
  __syncthreads();
  hi = static_cast<std::uint32_t>(d_hi) << 24 | static_cast<std::uint32_t>(sm.found[4]) << 16;
  lo = static_cast<std::uint32_t>(d_lo) << 24 | static_cast<std::uint32_t>(sm.found[6]) << 16;
}

template <class T, class G>
__global__ void __launch_bounds__(kGateThreads, tuning::kGateMinBlocksPerSm)
    activation_topk_kernel(const T* __restrict__ a, std::int64_t row_stride, const G* __restrict__ gate, int n,
                           gating_rule rule, const std::int32_t* __restrict__ k_per_row, float threshold, int k_max,
                           std::int32_t* __restrict__ out_indices, T* __restrict__ out_values,
                           std::int32_t* __restrict__ out_counts) {
  __shared__ gate_shared sm;
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const T* a_row = a + static_cast<std::int64_t>(row) * row_stride;
  const int lane = tid & 31, warp = tid >> 5;
  // Each warp a contiguous segment of whole warp steps, so a column's
  // output slot is its warp's offset plus a warp-local count.
  const int seg = (n + kGateWarps * kGateWarpTile - 1) / (kGateWarps * kGateWarpTile) * kGateWarpTile;
  const gate_row<T, G> src{a_row, gate, n, seg, (reinterpret_cast<std::uintptr_t>(a_row) & 15u) == 0,
                           (reinterpret_cast<std::uintptr_t>(gate) & 15u) == 0};
  gate_block_sum block_sum{sm.sums};
  if (tid < kGateWarps) sm.fill[tid] = 0;
  for (int i = tid; i < 2 * 256; i += kGateThreads) sm.hist[i / 256][i % 256] = 0;
  int cur = 0;  // radix_kth's histogram in use
  __syncthreads();

  // The row's words, for radix_kth (the fallback search).
  auto row_words = [&](auto&& f) {
    src.for_each_step([&](int first, const uint4& raw) {
      std::uint32_t x[kGateVec];
      src.words(raw, first, x);
#pragma unroll
      for (int j = 0; j < kGateVec; ++j)
        if (first + j < n) f(x[j]);
    });
  };
  // The row's columns with word >= w (a block-wide collective).
  auto stream_count_ge = [&](std::uint32_t w) {
    int c = 0;
    row_words([&](std::uint32_t x) { c += x >= w ? 1 : 0; });
    return block_sum(c);
  };

  // K, and the rule that keeps: a word above `t`, or equal to it among the
  // first `need` ties.
  int k;
  bool rank;
  // Each warp's columns above t and ties at t (sm.kept) are known where the
  // ranking leaves them so (`counted`); else the emission counts them first.
  bool counted = false;
  std::uint32_t t = 0;  // top_k with K = n: every word is at least 0 (NaN's)
  int need = n;
  if (rule == gating_rule::threshold) {
    const std::uint32_t tw = ordered_bits(threshold);
    const int reach = stream_count_ge(tw);
    k = min(reach, k_max);
    rank = reach > k_max;
    t = tw;  // where no ranking follows: every score >= threshold, ties included
  } else {
    k = k_per_row == nullptr ? k_max : max(0, min(k_per_row[row], k_max));
    rank = k > 0 && k < n;
  }
  if (k == 0) {
    t = 0xFFFFFFFFu;  // no word is above it, and no tie is kept
    need = 0;
  } else if (rank) {
    std::uint32_t lo = 0, hi = 0xFFFFFFFFu;
    if (n > kGateCandidates) {
      // 1. The bracket from a sample of evenly spaced columns: the top 16
      // bits of the sample's words at two ranks, widened outward to whole
      // 16-bit prefixes.
      std::uint32_t s[kGateSamplePerThread];
#pragma unroll
      for (int j = 0; j < kGateSamplePerThread; ++j) {
        const int col = static_cast<int>(static_cast<std::int64_t>(tid * kGateSamplePerThread + j) * n / kGateSample);
        s[j] = gate_word(to_float(a_row[col]), to_float(gate[col]));
      }
      auto sample = [&](auto&& f) {
#pragma unroll
        for (int j = 0; j < kGateSamplePerThread; ++j) f(s[j]);
      };
      const double q = static_cast<double>(k) / n;
      const float center = static_cast<float>(q * kGateSample);
      const float margin = kGateSampleSigmas * sqrtf(static_cast<float>(kGateSample * q * (1.0 - q))) + 2.0f;
      const int rank_hi = static_cast<int>(floorf(center - margin));  // hi: the rank_hi-th largest sampled word
      const int rank_lo = static_cast<int>(ceilf(center + margin));   // lo: the rank_lo-th largest
      if (rank_hi >= 1 || rank_lo <= kGateSample) {
        std::uint32_t w_hi, w_lo;  // a rank out of the sample is computed as the other, and dropped
        radix_top16_pair(sm, rank_hi >= 1 ? rank_hi : rank_lo, rank_lo <= kGateSample ? rank_lo : rank_hi, sample,
                         w_hi, w_lo);
        if (rank_hi >= 1) hi = w_hi | 0xFFFFu;
        if (rank_lo <= kGateSample) lo = w_lo;
      }
    }
    // 2. Count above hi, keep the words inside [lo, hi]. Where the bracket
    // lies within the positive numbers (|a| g with a positive gate), floats
    // compare (IEEE setp, exact under -ftz too) for words (word order is float order there,
    // NaN and zeros below it) and only a kept column's word is made.
    int mine = 0;
    const bool positive = lo > 0x80000000u && hi < 0xFF800000u;
    const float lo_f = from_ordered_bits(lo), hi_f = from_ordered_bits(hi);
    const std::uint32_t span = hi - lo;  // x in [lo, hi] is x - lo <= span, one compare
    src.for_each_step([&](int first, const uint4& raw) {
      const unsigned valid = src.valid_mask(first);
      unsigned in_bits = 0;
      float sc[kGateVec];
      std::uint32_t x[kGateVec];
      if (positive) {
        src.scores(raw, first, sc);
        unsigned above_bits = 0;
        for_each_column([&](auto j) {
          constexpr unsigned J = decltype(j)::value;
          ptx::or_above_inside<J>(sc[J], lo_f, hi_f, above_bits, in_bits);
        });
        mine += __popc(above_bits & valid);
      } else {
        src.words(raw, first, x);
#pragma unroll
        for (int j = 0; j < kGateVec; ++j) {
          mine += (valid >> j & 1u) && x[j] > hi ? 1 : 0;
          in_bits |= (x[j] - lo <= span ? 1u : 0u) << j;
        }
      }
      in_bits &= valid;
      if (in_bits != 0) {
        const unsigned count = static_cast<unsigned>(__popc(in_bits));
        unsigned slot = atomicAdd(&sm.fill[warp], count);
        std::uint32_t* room = sm.candidates + warp * kGateWarpCandidates;
        // A candidate of a positive bracket is a positive number, kept as
        // its float bits (its ordered word less the top bit).
        auto word = [&](int j) { return positive ? __float_as_uint(sc[j]) : x[j]; };
        if (slot + count <= kGateWarpCandidates) {  // the room's bound tested once, not per store
#pragma unroll
          for (int j = 0; j < kGateVec; ++j)
            if (in_bits >> j & 1u) room[slot++] = word(j);
        } else {
#pragma unroll
          for (int j = 0; j < kGateVec; ++j)
            if (in_bits >> j & 1u) {
              if (slot < kGateWarpCandidates) room[slot] = word(j);
              ++slot;
            }
        }
      }
    });
    const int warp_above_hi = __reduce_add_sync(kFullMask, mine);
    const int above = block_sum(mine);  // columns above hi; the barrier also publishes the candidates
    int held = 0;
    bool spilled = false;  // a warp found more than its room holds
#pragma unroll
    for (int w = 0; w < kGateWarps; ++w) {
      held += static_cast<int>(sm.fill[w]);
      spilled |= sm.fill[w] > kGateWarpCandidates;
    }
    if (above < k && k <= above + held) {
      const int top = lo == hi ? -1 : 31 - __clz(lo ^ hi);
      if (top < 0) {
        t = lo;
        need = k - above;
      } else if (!spilled) {
        const std::uint32_t* room = sm.candidates + warp * kGateWarpCandidates;
        const int mine_held = static_cast<int>(sm.fill[warp]);
        const std::uint32_t top_bit = positive ? 0x80000000u : 0u;
        auto candidates = [&](auto&& f) {
          for (int i = lane; i < mine_held; i += 32) f(room[i] | top_bit);
        };
        t = radix_kth(sm, cur, k - above, lo, top, 0, candidates, need);
      } else {
        // More in the bracket than shared memory holds (ties, narrow
        // clusters): the same search over the row, still inside the bracket.
        t = radix_kth(sm, cur, k - above, lo, top, 0, [&](auto&& f) {
          row_words([&](std::uint32_t x) {
            if (x - lo <= span) f(x);
          });
        }, need);
      }
      if (!spilled) {
        // Every column above t is above hi or a candidate above t; every tie
        // is a candidate: the warp's counts without another pass.
        const std::uint32_t* room = sm.candidates + warp * kGateWarpCandidates;
        const int mine_held = static_cast<int>(sm.fill[warp]);
        const std::uint32_t top_bit = positive ? 0x80000000u : 0u;
        int a = 0, e = 0;
        for (int i = lane; i < mine_held; i += 32) {
          const std::uint32_t x = room[i] | top_bit;
          a += x > t ? 1 : 0;
          e += x == t ? 1 : 0;
        }
        a = __reduce_add_sync(kFullMask, a);
        e = __reduce_add_sync(kFullMask, e);
        if (lane == 0) {
          sm.kept[0][warp] = warp_above_hi + a;
          sm.kept[1][warp] = e;
        }
        counted = true;
      }
    } else {
      // The bracket missed (sorted or periodic rows): search the row.
      t = radix_kth(sm, cur, k, 0u, 31, 0, row_words, need);
    }
  }

  // 3. Emit in index order: a column's slot is the columns kept before it
  // (those above t, and the first `need` ties at t): its warp's offset (a
  // scan of the warps' counts, one barrier) plus a warp-local scan a step.
  // Scores compare as floats, one IEEE setp (exact under -ftz too), not an
  // ordered word's six: for the word t of a number, word(s) > t is s > t's
  // float and word(s) == t is s == it (-0 == +0, NaN neither); for t = 0
  // (NaN's word) a tie is a NaN and every number is above. Where every tie
  // is kept (rows without ties at the K-th: the common case) a column is
  // kept iff s >= t, one compare and one scan a step. A step's kept columns
  // are staged in the warp's room (the candidates are spent) and leave in
  // coalesced runs.
  const std::int64_t out_row = static_cast<std::int64_t>(row) * k_max;
  if (k > 0) {
    const bool t_nan = t == 0;
    const float tf = t_nan ? 0.0f : from_ordered_bits(t);
    // This thread's columns above t and ties at t (bits j of the step).
    auto classify = [&](int first, const uint4& raw, unsigned& above_bits, unsigned& tie_bits) {
      float sc[kGateVec];
      src.scores(raw, first, sc);
      above_bits = 0;
      tie_bits = 0;
      if (!t_nan) {  // uniform
        for_each_column([&](auto j) {
          constexpr unsigned J = decltype(j)::value;
          ptx::or_above_equal<J>(sc[J], tf, above_bits, tie_bits);
        });
      } else {
#pragma unroll
        for (int j = 0; j < kGateVec; ++j) {
          const unsigned number = ptx::eq_ieee(sc[j], sc[j]);
          above_bits |= number << j;
          tie_bits |= (number ^ 1u) << j;
        }
      }
      const unsigned valid = src.valid_mask(first);
      above_bits &= valid;
      tie_bits &= valid;
    };
    if (!counted) {  // uniform: a pass that counts
      int a = 0, e = 0;
      src.for_each_step([&](int first, const uint4& raw) {
        unsigned above_bits, tie_bits;
        classify(first, raw, above_bits, tie_bits);
        a += __popc(above_bits);
        e += __popc(tie_bits);
      });
      a = __reduce_add_sync(kFullMask, a);
      e = __reduce_add_sync(kFullMask, e);
      if (lane == 0) {
        sm.kept[0][warp] = a;
        sm.kept[1][warp] = e;
      }
    }
    __syncthreads();  // also: every warp is done with the candidates
    int above_before = 0, ties_before = 0;  // in the warps before this one, then the steps already emitted
    int ties = 0;                           // in the row
#pragma unroll
    for (int w = 0; w < kGateWarps; ++w) {
      if (w < warp) {
        above_before += sm.kept[0][w];
        ties_before += sm.kept[1][w];
      }
      ties += sm.kept[1][w];
    }
    std::int32_t* idx_row = out_indices + out_row;
    unsigned short* val_row = reinterpret_cast<unsigned short*>(out_values + out_row);
    uint2* stage = reinterpret_cast<uint2*>(sm.candidates + warp * kGateWarpCandidates);
    // A step's kept columns (bits j of `keep`, `count` of them) staged in
    // the warp's room and stored from slot `base` on, in index order.
    auto store_step = [&](int first, const uint4& raw, unsigned keep, int count, int& base) {
      int incl = count;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(kFullMask, incl, d);
        if (lane >= d) incl += y;
      }
      const int step = __shfl_sync(kFullMask, incl, 31);
      int o = incl - count;
      const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < kGateVec; ++j)
        if (keep >> j & 1u) stage[o++] = make_uint2(static_cast<unsigned>(first + j), words[j / 2]);
      __syncwarp();
      for (int i = lane; i < step; i += 32) {
        const uint2 kept = stage[i];  // a column's index and the word holding its value (its parity picks the half)
        idx_row[base + i] = static_cast<std::int32_t>(kept.x);
        val_row[base + i] = static_cast<unsigned short>(kept.y >> (16 * (kept.x & 1u)));
      }
      __syncwarp();
      base += step;
    };
    if (need >= ties) {  // uniform, and the rule on random rows: every tie is kept, so a column is kept iff s >= t
      int base = above_before + ties_before;
      src.for_each_step([&](int first, const uint4& raw) {
        unsigned keep = 0;
        if (!t_nan) {  // uniform
          float sc[kGateVec];
          src.scores(raw, first, sc);
          for_each_column([&](auto j) {
            constexpr unsigned J = decltype(j)::value;
            ptx::or_at_least<J>(sc[J], tf, keep);
          });
        } else {
          keep = 0xFFu;  // numbers above t, NaNs its ties
        }
        keep &= src.valid_mask(first);
        store_step(first, raw, keep, __popc(keep), base);
      });
    } else {  // the first `need` ties kept: a tie's slot counts the ties before it
      int base = above_before + min(ties_before, need);
      src.for_each_step([&](int first, const uint4& raw) {
        unsigned above_bits, tie_bits;
        classify(first, raw, above_bits, tie_bits);
        const int e = __popc(tie_bits);
        int incl = e;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int y = __shfl_up_sync(kFullMask, incl, d);
          if (lane >= d) incl += y;
        }
        const int tie_room = need - (ties_before + incl - e);
        if (tie_room < e) {  // the last ties kept lie in this thread, or none of its ties is
          unsigned kept_ties = 0;
          for (int r = tie_room; r > 0; --r, tie_bits &= tie_bits - 1) kept_ties |= tie_bits & (0u - tie_bits);
          tie_bits = kept_ties;
        }
        const unsigned keep = above_bits | tie_bits;
        store_step(first, raw, keep, __popc(keep), base);
        ties_before += __shfl_sync(kFullMask, incl, 31);
      });
    }
  }
  for (int s = k + tid; s < k_max; s += kGateThreads) {
    out_indices[out_row + s] = -1;
    out_values[out_row + s] = from_float<T>(0.0f);
  }
  if (tid == 0) out_counts[row] = k;
}

// ---- Gated GEMV -------------------------------------------------------------

inline constexpr int kGemvThreads = tuning::kGemvThreads;
inline constexpr int kGemvOutputs = kGemvThreads * 8;  ///< outputs a CTA covers: 16 bytes of W a thread a column
inline constexpr int kGemvColumns = tuning::kGemvColumns;
inline constexpr int kGemvUnroll = tuning::kGemvUnroll;

/// The first position of ascending idx[0, count) holding a value >= c0
/// (count where none does), by a warp: each round probes 32 evenly spaced
/// positions, so 14K indices take three dependent loads, not fourteen.
__device__ __forceinline__ int warp_lower_bound(const std::int32_t* idx, int count, int c0, int lane) {
  int lo = 0, hi = count;  // the answer lies in [lo, hi]
  while (hi - lo > 32) {
    const std::int64_t span = hi - lo;
    const int probe = lo + static_cast<int>(span * (lane + 1) / 33);
    const int below = __popc(__ballot_sync(kFullMask, idx[probe] < c0));  // the probes below c0 come first
    const int new_lo = below == 0 ? lo : lo + static_cast<int>(span * below / 33) + 1;
    const int new_hi = below == 32 ? hi : lo + static_cast<int>(span * (below + 1) / 33);
    lo = new_lo;
    hi = new_hi;
  }
  const int j = lo + lane;
  return lo + __popc(__ballot_sync(kFullMask, j < hi && idx[j] < c0));
}

template <class T, class W, int Rows>
__global__ void __launch_bounds__(kGemvThreads)
    gated_gemv_kernel(const W* __restrict__ wt, std::int64_t ld_w, int n, int outs,
                      const std::int32_t* __restrict__ indices, const T* __restrict__ values, int k_max,
                      const std::int32_t* __restrict__ counts, float* __restrict__ partial) {
  static_assert(Rows <= 32, "a column's rows are one 32-bit mask");
  __shared__ float vals[Rows][kGemvColumns];
  __shared__ unsigned kept[kGemvColumns];  ///< bit r: row r keeps the column
  __shared__ int list[kGemvColumns];
  __shared__ int warp_base[kGemvThreads / 32 + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c0 = blockIdx.y * kGemvColumns;
  const int width = min(kGemvColumns, n - c0);
  for (int i = tid; i < kGemvColumns; i += kGemvThreads) {
    kept[i] = 0u;
#pragma unroll
    for (int r = 0; r < Rows; ++r) vals[r][i] = 0.0f;
  }
  __syncthreads();
  // Scatter each row's kept values of [c0, c0 + width): the row's indices
  // ascend, so they are one run, found by a warp's 32-way search.
  for (int r = warp; r < Rows; r += kGemvThreads / 32) {
    const std::int32_t* idx = indices + static_cast<std::int64_t>(r) * k_max;
    const int count = max(0, min(counts[r], k_max));
    const int first = warp_lower_bound(idx, count, c0, lane);
    int c[kGemvColumns / 32];
    float x[kGemvColumns / 32];
#pragma unroll
    for (int i = 0; i < kGemvColumns / 32; ++i) {
      const int j = first + lane + 32 * i;
      const int col = j < count ? idx[j] : -1;
      c[i] = col >= c0 && col < c0 + width ? col - c0 : kGemvColumns;  // no overflow for any index
      x[i] = j < count ? to_float(values[static_cast<std::int64_t>(r) * k_max + j]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kGemvColumns / 32; ++i)
      if (c[i] < width) {
        vals[r][c[i]] = x[i];
        atomicOr(&kept[c[i]], 1u << r);
      }
  }
  __syncthreads();
  // The columns any row kept, in column order (a fixed summation order).
  int listed = 0;
  for (int base = 0; base < width; base += kGemvThreads) {
    const int c = base + tid;
    const bool take = c < width && kept[c] != 0u;
    const unsigned ballot = __ballot_sync(kFullMask, take);
    if (lane == 0) warp_base[warp] = __popc(ballot);
    __syncthreads();
    int offset = listed;
    for (int w = 0; w < warp; ++w) offset += warp_base[w];
    int step = 0;
    for (int w = 0; w < kGemvThreads / 32; ++w) step += warp_base[w];
    if (take) list[offset + __popc(ballot & ((1u << lane) - 1u))] = c;
    listed += step;
    __syncthreads();
  }
  const int o = blockIdx.x * kGemvOutputs + tid * 8;
  float acc[Rows][8];
#pragma unroll
  for (int r = 0; r < Rows; ++r)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
  if (o < outs) {
    const W* col0 = wt + static_cast<std::int64_t>(c0) * ld_w + o;
    const bool whole = o + 8 <= outs && (reinterpret_cast<std::uintptr_t>(col0) & 15u) == 0 && (ld_w & 7) == 0;
    constexpr int kUnroll = Rows <= 2 ? 2 * kGemvUnroll : kGemvUnroll;  // registers allow more in flight
    for (int u = 0; u < listed; u += kUnroll) {
      uint4 raw[kUnroll];  // packed: 4 registers a column
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        const int c = list[min(u + q, listed - 1)];
        const W* p = col0 + static_cast<std::int64_t>(c) * ld_w;
        if (whole) {
          raw[q] = __ldcs(reinterpret_cast<const uint4*>(p));
        } else {
          W* x = reinterpret_cast<W*>(&raw[q]);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] = o + e < outs ? p[e] : from_float<W>(0.0f);
        }
      }
#pragma unroll
      for (int q = 0; q < kUnroll; ++q) {
        if (u + q >= listed) break;
        const int c = list[u + q];
        const unsigned rows_kept = Rows == 1 ? 1u : kept[c];  // one row keeps every listed column: no test
        const W* x = reinterpret_cast<const W*>(&raw[q]);
#pragma unroll
        for (int r = 0; r < Rows; ++r) {
          // Only the rows that keep the column: a row multiplying another
          // row's column by zero would turn an infinite weight into NaN.
          if ((rows_kept >> r & 1u) == 0u) continue;
          const float v = vals[r][c];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(to_float(x[e]), v, acc[r][e]);
        }
      }
    }
  }
  // The reduce (a programmatic dependent on sm_90) may launch once every
  // CTA is past its loads; it waits for this grid before reading.
  ptx::launch_dependents();
  if (o < outs) {
#pragma unroll
    for (int r = 0; r < Rows; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (o + e < outs)
          partial[(static_cast<std::int64_t>(blockIdx.y) * Rows + r) * outs + o + e] = acc[r][e];
  }
}

inline constexpr int kReduceOutputs = 32;  ///< outputs a reduce CTA sums
inline constexpr int kReduceGroups = 8;    ///< runs of ranges summed in parallel, then in order

/// y[r][o] = the column ranges' partials summed in a fixed tree: each of
/// eight threads adds its run of ranges in order, then the eight runs are
/// added in order.
/// (A template, as every kernel here: a header's non-template kernel would
/// be compiled in every translation unit that includes it.)
template <int Outputs, int Groups>
__global__ void __launch_bounds__(Outputs * Groups)
    gated_gemv_reduce_kernel(const float* __restrict__ partial, int ranges, std::int64_t total, float* __restrict__ y) {
  __shared__ float runs[Groups][Outputs];
  ptx::wait_for_prior_grid();  // the partials, where launched as the GEMV's programmatic dependent
  const int x = threadIdx.x % Outputs, group = threadIdx.x / Outputs;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * Outputs + x;
  const int per = (ranges + Groups - 1) / Groups;
  const int g0 = group * per, g1 = min(ranges, g0 + per);
  float s = 0.0f;
  if (i < total)
#pragma unroll 8
    for (int g = g0; g < g1; ++g) s += partial[static_cast<std::int64_t>(g) * total + i];
  runs[group][x] = s;
  __syncthreads();
  if (group == 0 && i < total) {
    float sum = runs[0][x];
#pragma unroll
    for (int r = 1; r < Groups; ++r) sum += runs[r][x];
    y[i] = sum;
  }
}

template <class T, class W, int Rows>
void launch_gated_gemv(dim3 grid, const W* wt, std::int64_t ld_w, int n, int outs, const std::int32_t* indices,
                       const T* values, int k_max, const std::int32_t* counts, float* partial, cudaStream_t stream) {
  gated_gemv_kernel<T, W, Rows><<<grid, kGemvThreads, 0, stream>>>(wt, ld_w, n, outs, indices, values, k_max, counts,
                                                                  partial);
}

inline int gemv_ranges(int n) { return (n + kGemvColumns - 1) / kGemvColumns; }

/// The reduce, as the GEMV's programmatic dependent where the loaded build
/// honours griddepcontrol.wait (sm_90+, CUDA >= 12.3 for captured graphs):
/// its launch overlaps the GEMV's tail instead of following it. (A
/// template, so that only a translation unit calling it compiles the
/// kernel.)
template <int Outputs = kReduceOutputs, int Groups = kReduceGroups>
[[nodiscard]] status launch_gemv_reduce(const float* partial, int ranges, std::int64_t total, float* y,
                                        cudaStream_t stream) {
  constexpr auto kernel = &gated_gemv_reduce_kernel<Outputs, Groups>;
  static hisparse::detail::per_device_flag sm90;
  const bool overlap = CUDART_VERSION >= 12030 &&
                       sm90.get([] { return hisparse::detail::kernel_built_for_sm90(reinterpret_cast<const void*>(kernel)); });
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>((total + Outputs - 1) / Outputs));
  config.blockDim = dim3(Outputs * Groups);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = overlap ? &attribute : nullptr;
  config.numAttrs = overlap ? 1 : 0;
  HISPARSE_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, partial, ranges, total, y));
  return status::success;
}

}  // namespace detail

/// Activation top-k gating: for each of `rows` rows of A (row r at
/// a + r * row_stride, n columns) and gate weights g [n], keeps the columns
/// with the largest scores fl32(|A_ri| g_i) and writes, at [r][0, K_r) of
/// the [rows][k_max] outputs, their indices in ascending order and A's
/// values there; slots K_r .. k_max - 1 get index -1 and value 0, and
/// out_counts[r] = K_r. With `rule` top_k, K_r = k_per_row[r] clamped to
/// [0, k_max] (k_max where k_per_row is null), at most n; with threshold,
/// the columns whose score is at least `threshold`, the k_max best of them
/// where more reach it. Ties go to the lower index, NaN scores rank below
/// every number (kept only to fill K), -0 equals +0.
///
/// Stream-ordered, allocates nothing, never synchronizes: capturable.
/// Offsets are 64-bit: rows * row_stride may exceed 2^31.
template <class T, class G>
[[nodiscard]] status activation_topk(const T* a, std::int64_t row_stride, const G* gate, int rows, int n,
                                     gating_rule rule, const std::int32_t* k_per_row, float threshold, int k_max,
                                     std::int32_t* out_indices, T* out_values, std::int32_t* out_counts,
                                     cudaStream_t stream = nullptr) {
  static_assert(detail::is_gate_value_v<T>, "activation_topk reads fp16 or bf16 activations");
  static_assert(detail::is_gate_weight_v<G>, "gate weights are fp32, fp16 or bf16");
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "activation_topk: " + why); };
  if (rows < 1 || n < 1) return bad("need rows >= 1 and n >= 1 (got rows " + std::to_string(rows) + ", n " + std::to_string(n) + ")");
  if (n > (1 << 30)) return bad("n " + std::to_string(n) + " exceeds 2^30");
  if (row_stride < n) return bad("row_stride must be >= n");
  if (k_max < 1 || k_max > n) return bad("k_max " + std::to_string(k_max) + " must be in [1, n]");
  if (rule == gating_rule::threshold && std::isnan(threshold)) return bad("the threshold is NaN");
  if (rule == gating_rule::threshold && k_per_row != nullptr) return bad("a threshold rule takes no per-row K");
  if (a == nullptr || gate == nullptr || out_indices == nullptr || out_values == nullptr || out_counts == nullptr)
    return bad("inputs and outputs must not be null");
  detail::activation_topk_kernel<T, G><<<rows, detail::kGateThreads, 0, stream>>>(
      a, row_stride, gate, n, rule, k_per_row, threshold, k_max, out_indices, out_values, out_counts);
  HISPARSE_CUDA_TRY(cudaGetLastError());
  return status::success;
}

/// The gated GEMV over activation_topk's outputs: y[r][o] = sum over row
/// r's kept j of W^T[idx_rj][o] vals_rj (fp32 accumulation, fp32 y
/// [rows][outs]), for W stored by column: W^T [n][outs] with leading
/// dimension ld_w >= outs. 1 <= rows <= 8. A row's indices must ascend (as
/// activation_topk writes them); columns a row keeps are each read once
/// for the whole batch, so the gain over the dense GEMV is n / (the
/// columns any row keeps). Deterministic: partial sums per column range
/// are added in a fixed order. Non-finite weights reach only the rows that
/// keep their column, as in the reference.
///
/// CUB-style two-phase temporary storage: with temp == nullptr, only sets
/// temp_bytes and returns. Capturable.
template <class T, class W>
[[nodiscard]] status gated_gemv(void* temp, std::size_t& temp_bytes, const W* wt, std::int64_t ld_w, int n, int outs,
                                const std::int32_t* indices, const T* values, int k_max,
                                const std::int32_t* counts, int rows, float* y, cudaStream_t stream = nullptr) {
  static_assert(detail::is_gate_value_v<T> && detail::is_gate_value_v<W>, "gated_gemv reads fp16 or bf16");
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "gated_gemv: " + why); };
  if (rows < 1 || rows > 8) return bad("rows " + std::to_string(rows) + " must be in [1, 8]");
  if (n < 1 || outs < 1 || n > (1 << 30)) return bad("need 1 <= n <= 2^30 and outs >= 1");
  if (ld_w < outs) return bad("ld_w must be >= outs");
  if (k_max < 1 || k_max > n) return bad("k_max must be in [1, n]");
  const int ranges = detail::gemv_ranges(n);
  if (ranges > 65535)  // the column ranges are the grid's y dimension
    return bad("n " + std::to_string(n) + " exceeds " + std::to_string(65535 * detail::kGemvColumns) +
               " columns (65535 ranges of " + std::to_string(detail::kGemvColumns) + ")");
  const std::size_t needed = static_cast<std::size_t>(ranges) * rows * outs * sizeof(float);
  if (temp == nullptr) {
    temp_bytes = needed;
    return status::success;
  }
  if (temp_bytes < needed)
    return bad("temp storage of " + std::to_string(temp_bytes) + " bytes is smaller than the " +
               std::to_string(needed) + " required");
  if (wt == nullptr || indices == nullptr || values == nullptr || counts == nullptr || y == nullptr)
    return bad("inputs and outputs must not be null");
  if (reinterpret_cast<std::uintptr_t>(temp) % alignof(float) != 0 ||
      reinterpret_cast<std::uintptr_t>(y) % alignof(float) != 0)
    return bad("temp storage and y must be float-aligned");
  auto* partial = static_cast<float*>(temp);
  const dim3 grid((outs + detail::kGemvOutputs - 1) / detail::kGemvOutputs, ranges);
  switch (rows) {
    case 1: detail::launch_gated_gemv<T, W, 1>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 2: detail::launch_gated_gemv<T, W, 2>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 3: detail::launch_gated_gemv<T, W, 3>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 4: detail::launch_gated_gemv<T, W, 4>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 5: detail::launch_gated_gemv<T, W, 5>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 6: detail::launch_gated_gemv<T, W, 6>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    case 7: detail::launch_gated_gemv<T, W, 7>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
    default: detail::launch_gated_gemv<T, W, 8>(grid, wt, ld_w, n, outs, indices, values, k_max, counts, partial, stream); break;
  }
  HISPARSE_CUDA_TRY(cudaGetLastError());
  const std::int64_t total = static_cast<std::int64_t>(rows) * outs;
  return detail::launch_gemv_reduce(partial, ranges, total, y, stream);
}

}  // namespace hisparse::select
