#pragma once
// Top-k selection primitives: warp- and block-level (CUB style: the caller
// owns the TempStorage). The device-wide batched top-k built on them is in
// batched_topk.cuh.
//
// Algorithms (measured on the H200: PERF_NOTES.md, "Batched top-k"), all on
// the order-preserving 64-bit keys of topk_keys.hpp:
// - a warp (rows of up to 512, k <= 32): each lane sorts its keys in
//   registers, then k rounds of two `redux.sync` maxima take the largest
//   head across the lanes (detail::extract_top). No data-dependent path.
// - a block from fp32 scores (k <= Threads / 4): a threshold from the lanes'
//   maxima that at least k scores reach, float compares against it, the
//   survivors (~110 of 4096 for k = 64) placed by a warp scan and sorted by
//   a bitonic network in registers: two warps of 64 keys and a merge for 65
//   to 128 survivors, else one warp, 128 keys a pass.
// - otherwise, and where the filter leaves too many or too few survivors
//   (ties, sorted rows, NaNs): radix select with 1-bit digits. 32 rounds
//   over the high word (the score) find the k-th largest score, and only
//   when it is tied past k do 32 more over the low word (the index) pick the
//   lowest indices among the ties; each round is one comparison per key and
//   one count across the block, so no shared-memory histogram suffers when
//   scores cluster. The k found are sorted by a bitonic network in shared
//   memory.
// Contract (the same as DESIGN.md section 1 and reference::select_top_k):
// values descending, ties to the lower index, NaN below -inf, -0 == +0; a row
// with fewer than k valid entries ends in padding (index -1, value -inf).

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

#include "hisparse/core/ptx.cuh"
#include "hisparse/core/status.hpp"
#include "hisparse/tuning.hpp"
#include "hisparse/select/topk_keys.hpp"

namespace hisparse::select {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "hisparse top-k needs sm_80 or newer (it counts with redux.sync)"
#endif

inline constexpr unsigned kFullMask = 0xFFFFFFFFu;

namespace detail {
__device__ __forceinline__ std::uint32_t hi_word(topk_key k) { return static_cast<std::uint32_t>(k >> 32); }
__device__ __forceinline__ std::uint32_t lo_word(topk_key k) { return static_cast<std::uint32_t>(k); }

/// Warp-aggregated append: every lane of the warp calls it; the lanes with
/// `take` get consecutive slots from `*fill` (a shared counter), in lane
/// order, for one atomic per warp. Returns this lane's slot (meaningless
/// where !take).
__device__ __forceinline__ unsigned warp_append(bool take, unsigned* fill) {
  const unsigned ballot = __ballot_sync(kFullMask, take);
  if (ballot == 0) return 0;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(ballot) - 1;
  unsigned base = 0;
  if (lane == leader) base = atomicAdd(fill, static_cast<unsigned>(__popc(ballot)));
  base = __shfl_sync(kFullMask, base, leader);
  return base + __popc(ballot & ((1u << lane) - 1u));
}

/// Batcher's odd-even merge sort network for E inputs (E a power of two):
/// E = 8 takes 19 compare-exchanges, E = 16 takes 63. Built at compile time,
/// so every register index below is a constant.
template <int E>
struct batcher_network {
  struct pair {
    int a, b;
  };
  HISPARSE_HOST_DEVICE static constexpr int count() {
    int c = 0;
    for (int p = 1; p < E; p <<= 1)
      for (int q = p; q >= 1; q >>= 1)
        for (int j = q % p; j + q < E; j += 2 * q)
          for (int i = 0; i < q && i + j + q < E; ++i)
            if ((i + j) / (2 * p) == (i + j + q) / (2 * p)) ++c;
    return c;
  }
  struct table {
    pair at[count() > 0 ? count() : 1];
  };
  HISPARSE_HOST_DEVICE static constexpr table make() {
    table t{};
    int c = 0;
    for (int p = 1; p < E; p <<= 1)
      for (int q = p; q >= 1; q >>= 1)
        for (int j = q % p; j + q < E; j += 2 * q)
          for (int i = 0; i < q && i + j + q < E; ++i)
            if ((i + j) / (2 * p) == (i + j + q) / (2 * p)) t.at[c++] = {i + j, i + j + q};
    return t;
  }
  static constexpr int kCount = count();
  static constexpr table pairs = make();
};

template <int A, int B, int E>
__device__ __forceinline__ void exchange_descending(topk_key (&v)[E]) {
  const topk_key a = v[A], b = v[B];
  v[A] = a > b ? a : b;
  v[B] = a > b ? b : a;
}

template <int E, std::size_t... C>
__device__ __forceinline__ void run_network(topk_key (&v)[E], std::index_sequence<C...>) {
  using net = batcher_network<E>;
  (exchange_descending<net::pairs.at[C].a, net::pairs.at[C].b>(v), ...);
}

/// Sorts E keys (E a power of two) in registers, descending.
template <int E>
__device__ __forceinline__ void sort_descending(topk_key (&v)[E]) {
  static_assert(E >= 1 && (E & (E - 1)) == 0, "sort_descending needs a power of two");
  run_network(v, std::make_index_sequence<static_cast<std::size_t>(batcher_network<E>::kCount)>{});
}

/// The k largest keys of a warp whose lanes each hold a descending column:
/// `head` is this lane's first key and `next` points at its second, the
/// column continuing every 32 keys and ending in two kNoCandidate (each
/// round reads the key after the head, so one past the end). Round r names
/// the largest head (score word by `redux.sync` max, then the index word
/// among the tied lanes; real keys are distinct, so one lane owns it), and
/// its owner writes it to out[r] (shared) and moves down its column. The
/// warp must hold at least k real keys (not kNoCandidate): a round with only
/// padding left would have every lane own it.
__device__ __forceinline__ void extract_top(topk_key head, const topk_key* next, int k, topk_key* out) {
#pragma unroll 4
  for (int r = 0; r < k; ++r) {
    const topk_key after = *next;  // read every round, off the round's dependent chain
    const std::uint32_t hi = hi_word(head), lo = lo_word(head);
    const std::uint32_t top_hi = __reduce_max_sync(kFullMask, hi);
    const std::uint32_t top_lo = __reduce_max_sync(kFullMask, hi == top_hi ? lo : 0u);
    const bool owner = hi == top_hi && lo == top_lo;
    if (owner) out[r] = head;
    head = owner ? after : head;
    next += owner ? 32 : 0;
  }
}

/// Monotone map of non-NaN floats to int32 (an involution: it also maps
/// back); -0 sits just below +0.
__device__ __forceinline__ int ordered_int(int bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

/// A lower bound of the c-th largest of the warp's 32 values v (c >= 1)
/// that at least c lanes' v reach: the c-th largest after each v is floored
/// to a multiple of 32. The lane number rides in the five bits the floor
/// clears, so the values are distinct and each of the c - 1 rounds drops the
/// one lane holding the maximum by a compare with the redux (a redux, a
/// compare and a select; finding the owner among tied lanes by ballot took
/// eight). c <= 32 (larger c only ever returns INT_MIN, a bound every lane
/// reaches). Every lane calls it and gets the answer.
__device__ __forceinline__ int warp_cth_largest_floor(int v, int c, int lane) {
  int o = (v & ~31) | lane;
#pragma unroll 4  // straight-line rounds (predicated or with early exits) spilled block_topk at 40 registers
  for (int r = 1; r < c; ++r) {
    const int top = __reduce_max_sync(kFullMask, o);
    o = o == top ? INT_MIN : o;  // INT_MIN only ever ties INT_MIN: the answer is then INT_MIN either way
  }
  return __reduce_max_sync(kFullMask, o) & ~31;
}
}  // namespace detail

/// Warp-wide top-k of E keys per lane (E a power of two), k <= 32.
///
/// Each lane sorts its keys (Batcher's network in registers) and parks them
/// in its own column of shared memory; then k rounds each take the largest
/// head of the 32 columns: two `redux.sync` maxima (the score word, then the
/// index word among the lanes whose score word ties) name the key, and the
/// one lane whose head it was records it and advances to its next key.
/// About a dozen instructions a round and no data-dependent path: ties,
/// sorted rows, NaNs and padding cost what random rows cost.
template <int E>
class warp_topk {
 public:
  struct TempStorage {
    topk_key column[E + 2][32];  ///< lane i's sorted keys down column i; rows E, E + 1 stay kNoCandidate
    topk_key out[32];            ///< round r's key
  };

  __device__ explicit warp_topk(TempStorage& storage) : storage_(storage) {}

  /// Returns, in lane i < k, the i-th largest key of the warp (descending);
  /// kNoCandidate in lanes past k or past the number of real candidates.
  __device__ topk_key select(const topk_key (&keys)[E], int k) {
    unsigned real = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) real += keys[j] != kNoCandidate ? 1u : 0u;
    return select(keys, k, static_cast<int>(__reduce_add_sync(kFullMask, real)));
  }

  /// The same, told how many of the warp's keys are real (not kNoCandidate):
  /// `real` must be exact, as the rounds past it are skipped.
  __device__ topk_key select(const topk_key (&keys)[E], int k, int real) {
    const int lane = threadIdx.x & 31;
    topk_key v[E];
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = keys[j];
    detail::sort_descending(v);
#pragma unroll
    for (int j = 1; j < E; ++j) storage_.column[j][lane] = v[j];
    storage_.column[E][lane] = kNoCandidate;
    storage_.column[E + 1][lane] = kNoCandidate;  // read (never taken) by every round after the column runs out
    storage_.out[lane] = kNoCandidate;
    __syncwarp();  // out[] is written by whichever lane owns a round's key
    detail::extract_top(v[0], &storage_.column[1][lane], min(k, real), storage_.out);
    __syncwarp();
    const topk_key mine = storage_.out[lane];
    __syncwarp();
    return mine;
  }

 private:
  TempStorage& storage_;
};

namespace detail {

/// One merge level of warp_bitonic_sort: with the keys in runs of size / 2
/// sorted in alternating directions, sorts runs of `size` (descending where
/// (element & size) == 0; the whole warp's 32 KPL keys descending when size
/// is 32 KPL). Lane l holds elements e = KPL l + j, so strides below KPL
/// stay within a lane and the rest take one 64-bit shuffle per key.
template <int KPL>
__device__ __forceinline__ void warp_bitonic_merge(topk_key (&v)[KPL], int size, int lane) {
#pragma unroll
  for (int stride = 16 * KPL; stride > 0; stride >>= 1) {
    if (stride >= size) continue;  // resolved at compile time: size is a constant after unrolling
    if (stride < KPL) {  // both keys in this lane
#pragma unroll
      for (int j = 0; j < KPL; ++j) {
        const int jp = j ^ stride;
        if (jp > j) {
          const bool desc = ((lane * KPL + j) & size) == 0;
          const topk_key a = v[j], b = v[jp];
          const bool swap = desc ? a < b : b < a;
          v[j] = swap ? b : a;
          v[jp] = swap ? a : b;
        }
      }
    } else {  // the partner is lane ^ (stride / KPL), same j
      const int lmask = stride / KPL;
      const bool lower = (lane & lmask) == 0;
      const bool desc = ((lane * KPL) & size) == 0;  // size > stride >= KPL: j does not matter
#pragma unroll
      for (int j = 0; j < KPL; ++j) {
        const topk_key other = __shfl_xor_sync(kFullMask, v[j], lmask);
        v[j] = ((other > v[j]) == (lower == desc)) ? other : v[j];
      }
    }
  }
}

/// Sorts 32 KPL keys across a warp, descending, by a bitonic network in
/// registers (warp_bitonic_merge at sizes 2 .. 32 KPL): 28 steps for 128
/// keys (KPL = 4), 21 for 64, 15 for 32. Every lane calls it.
template <int KPL>
__device__ __forceinline__ void warp_bitonic_sort(topk_key (&v)[KPL]) {
  // The lane as a value the compiler cannot treat as loop-invariant: inside
  // a caller's loop, each step's direction test would otherwise be hoisted
  // and held in a register.
  int lane = static_cast<int>(threadIdx.x) & 31;
  asm volatile("" : "+r"(lane));
#pragma unroll
  for (int size = 2; size <= 32 * KPL; size <<= 1) warp_bitonic_merge(v, size, lane);
}

inline constexpr int kWarpSortKeys = tuning::kWarpSortKeys;

/// One warp's k largest of n (score bits, index) pairs in shared memory
/// (1 <= k <= n, k < 32 KPL), as keys, descending, to out[0, k) (shared, not
/// overlapping pairs). A pass loads up to 32 KPL keys -- the k kept by the
/// last pass from out[], then the next pairs, kNoCandidate past them --
/// sorts them (warp_bitonic_sort) and keeps the first k; n <= 32 KPL takes
/// one pass. Every lane calls it.
template <int KPL>
__device__ void warp_top_k_passes(const uint2* pairs, int n, int k, topk_key* out) {
  constexpr int kKeys = 32 * KPL;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int carried = 0, done = 0;
#pragma unroll 1
  do {
    const int taken = min(n - done, kKeys - carried);
    topk_key v[KPL];
#pragma unroll
    for (int j = 0; j < KPL; ++j) {
      const int e = lane * KPL + j;
      if (e < carried) {
        v[j] = out[e];
      } else if (e < carried + taken) {
        const uint2 pr = pairs[done + e - carried];
        v[j] = make_key(__uint_as_float(pr.x), static_cast<std::int32_t>(pr.y));
      } else {
        v[j] = kNoCandidate;
      }
    }
    warp_bitonic_sort(v);
    __syncwarp();  // every lane has read out[] before it is rewritten
#pragma unroll
    for (int j = 0; j < KPL; ++j)
      if (lane * KPL + j < k) out[lane * KPL + j] = v[j];
    __syncwarp();
    done += taken;
    carried = k;
  } while (done < n);
}

/// warp_top_k_passes with the smallest sort that holds n (32, 64 or 128
/// keys), and passes of 128 above that: k < 128, any n >= k. ~650
/// instructions for 128 keys, where ranking each of ~110 survivors against
/// all of them took ~2.6K (Nsight Compute, block top-k of 4096, k = 64).
__device__ __forceinline__ void warp_top_k(const uint2* pairs, int n, int k, topk_key* out) {
  if (n <= 32)
    warp_top_k_passes<1>(pairs, n, k, out);
  else if (n <= 64)
    warp_top_k_passes<2>(pairs, n, k, out);
  else
    warp_top_k_passes<kWarpSortKeys / 32>(pairs, n, k, out);
}

/// The k largest (k <= 64) of 64 < n <= 128 (score bits, index) pairs,
/// descending, to out[0, k), on two warps: each sorts 64 of them (21 steps
/// of two keys a lane, where one warp sorting all 128 takes 28 steps of
/// four), warp 1 parks its run in `scratch` (64 keys), and after a block
/// barrier warp 0 keeps the larger of A_e and B_(63 - e) -- the 64 largest
/// of both runs, as a bitonic sequence -- and merges it (6 steps). The sort
/// is the block's critical path while its other warps wait at the barrier,
/// so half the steps' work is what counts. Every thread of the block calls
/// it (two barriers).
__device__ __forceinline__ void two_warp_top_k(const uint2* pairs, int n, int k, topk_key* out, topk_key* scratch) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int lane = static_cast<int>(threadIdx.x) & 31;
  asm volatile("" : "+r"(lane));
  topk_key v[2];
  if (warp < 2) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int e = 64 * warp + 2 * lane + j;
      v[j] = kNoCandidate;
      if (e < n) {
        const uint2 pr = pairs[e];
        v[j] = make_key(__uint_as_float(pr.x), static_cast<std::int32_t>(pr.y));
      }
    }
    warp_bitonic_sort(v);
    if (warp == 1) {
      scratch[2 * lane] = v[0];
      scratch[2 * lane + 1] = v[1];
    }
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const topk_key b = scratch[63 - 2 * lane - j];
      v[j] = b > v[j] ? b : v[j];
    }
    warp_bitonic_merge(v, 64, lane);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (2 * lane + j < k) out[2 * lane + j] = v[j];
  }
  __syncthreads();
}

}  // namespace detail

/// Block-wide top-k of E keys per thread, k <= 2048. The caller provides
/// `sorted`, a shared array of at least `sort_capacity(k)` keys, which holds
/// the result in descending order (padding kNoCandidate after the
/// candidates).
///
/// For k <= Threads / 4, first a threshold filter: each warp takes the c-th
/// largest score of its lanes' maxima (c = ceil(k / warps)), floored to 32
/// ordered steps (warp_cth_largest_floor), and the smallest of those is a
/// score at least k keys reach (c per warp), so the k largest are all at or
/// above it; the survivors (~110 for k = 64 of 4096 random keys) are ranked
/// against each other in shared memory.
/// `select_scores`, which starts from fp32 scores, filters with float
/// compares, builds keys for the survivors alone and sorts them: 65 to 128
/// of them (k <= 64) on two warps (detail::two_warp_top_k), others on one
/// (detail::warp_top_k, up to 2 * Threads of them). Too many survivors
/// (ties, sorted or short rows), or too few (NaNs), take the radix select,
/// whose rounds each count one bit of the k-th key across the block.
template <int Threads, int E>
class block_topk {
  static_assert(Threads % 32 == 0 && Threads >= 64, "block_topk needs whole warps, at least two");
  static constexpr int kWarps = Threads / 32;
  static constexpr int kSurvivors = 2 * Threads;

  HISPARSE_HOST_DEVICE static constexpr int pow2(int k) {
    int p = 1;
    while (p < k) p <<= 1;
    return p;
  }
  /// pow2 in three instructions, for the kernels (k >= 1; the loop above
  /// runs one uniform round per doubling, 7 at k = 64, in every warp).
  __device__ static int pow2_fast(int k) { return k <= 1 ? 1 : 1 << (32 - __clz(k - 1)); }

 public:
  static constexpr int kFilterK = Threads / 4;  ///< the largest k the threshold filter takes

  struct TempStorage {
    unsigned counts[2][kWarps];
    unsigned fill;
    std::uint32_t warp_min[kWarps];  ///< each warp's threshold score word
  };

  /// Keys of shared memory `sorted` needs for k: the next power of two (the
  /// sort), and room for the filter's survivors after it where it runs.
  HISPARSE_HOST_DEVICE static constexpr int sort_capacity(int k) {
    return pow2(k) + (k <= kFilterK ? kSurvivors : 0);
  }

  __device__ explicit block_topk(TempStorage& storage) : storage_(storage) {}

  /// Returns the number of real candidates written (min(k, candidates)).
  __device__ int select(const topk_key (&keys)[E], int k, topk_key* sorted) {
    if (k <= kFilterK) {  // uniform
      const int found = select_filtered(keys, k, sorted);
      if (found >= 0) return found;
    }
    return select_radix(register_keys{keys}, k, sorted);
  }

  /// Keys of shared memory `sorted` needs for select_scores: sort_capacity(k)
  /// and, past it, room for the block's Threads * E score words, where the
  /// radix path keeps them (so its many passes hold no keys in registers).
  HISPARSE_HOST_DEVICE static constexpr int scores_capacity(int k) {
    return sort_capacity(k) + (Threads * E + 1) / 2;
  }

  /// Where select_scores' x[j] lies in the row, from the chunk's first
  /// entry: Vec = 1, entry first + j * Threads + threadIdx.x (a block's
  /// loads of one j are consecutive words); Vec = 4, runs of four (one
  /// 16-byte load a run), entry first + (j / 4) * 4 Threads + 4 threadIdx.x
  /// + j % 4. This thread's offset of x[j] from its first entry:
  template <int Vec>
  HISPARSE_HOST_DEVICE static constexpr int entry_offset(int j) {
    return (j / Vec) * (Threads * Vec) + j % Vec;
  }

  /// The same from fp32 scores, with `sorted` of scores_capacity(k) keys:
  /// this thread's x[j] is entry first + Vec * threadIdx.x +
  /// entry_offset<Vec>(j) of the row, a candidate below `len`. Past `len`,
  /// x[j] is never a candidate, but NaN there keeps the filter fast
  /// (anything larger can raise its threshold past the k-th score and send
  /// the row to the radix path).
  template <int Vec = 1>
  __device__ int select_scores(const float (&x)[E], int first, int len, int k, topk_key* sorted) {
    static_assert(Vec == 1 || (Vec == 4 && E % 4 == 0), "select_scores reads single entries or runs of four");
    if (k <= kFilterK) {  // uniform
      if (filter_scores<Vec>(x, first, len, k, sorted)) return k;
    }
    // The radix path reads each key back from shared memory: the score word
    // this thread parked there (only it reads its words, and every pass
    // starts after a barrier, so nothing is kept in registers across
    // passes), the index word from the position.
    auto* words = reinterpret_cast<std::uint32_t*>(sorted + sort_capacity(k)) + threadIdx.x;
#pragma unroll
    for (int j = 0; j < E; ++j) words[j * Threads] = ordered_bits(x[j]);
    return select_radix(shared_words<Vec>{words, first + Vec * static_cast<int>(threadIdx.x), len}, k, sorted);
  }

 private:
  /// The radix path's view of this thread's keys: key(j), j < E.
  struct register_keys {
    static constexpr bool kUnrolled = true;
    const topk_key (&keys)[E];
    __device__ topk_key operator()(int j) const { return keys[j]; }
  };
  template <int Vec>
  struct shared_words {  // one loop iteration per key: no per-key registers
    static constexpr bool kUnrolled = false;
    const std::uint32_t* words;  ///< this thread's first word; the next Threads apart
    int base, len;               ///< base: the entry of x[0]
    __device__ topk_key operator()(int j) const {
      const int i = base + entry_offset<Vec>(j);
      return i < len ? key_of_word(words[j * Threads], i) : kNoCandidate;
    }
  };

  /// Radix select over key(j), j < E (the keys of this thread).
  template <class Key>
  __device__ int select_radix(Key key, int k, topk_key* sorted) {
    const auto want = static_cast<unsigned>(k);
    std::uint32_t hi = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const std::uint32_t cand = hi | (1u << bit);
      if (count(key, [&](topk_key x) { return detail::hi_word(x) >= cand; }) >= want) hi = cand;
    }
    std::uint32_t lo = 0;
    const unsigned at_least = count(key, [&](topk_key x) { return detail::hi_word(x) >= hi; });
    if (at_least > want) {
      const unsigned above = count(key, [&](topk_key x) { return detail::hi_word(x) > hi; });
      const unsigned need = want - above;
      for (int bit = 31; bit >= 0; --bit) {
        const std::uint32_t cand = lo | (1u << bit);
        if (count(key, [&](topk_key x) { return detail::hi_word(x) == hi && detail::lo_word(x) >= cand; }) >=
            need)
          lo = cand;
      }
    }
    const topk_key threshold = (static_cast<topk_key>(hi) << 32) | lo;
    if (threadIdx.x == 0) storage_.fill = 0;
    __syncthreads();
    auto keep = [&](int j) {
      const topk_key x = key(j);
      if (x >= threshold && x != kNoCandidate) {
        const unsigned pos = atomicAdd(&storage_.fill, 1u);
        if (pos < want) sorted[pos] = x;
      }
    };
    if constexpr (Key::kUnrolled) {
#pragma unroll
      for (int j = 0; j < E; ++j) keep(j);
    } else {
#pragma unroll 1
      for (int j = 0; j < E; ++j) keep(j);
    }
    __syncthreads();
    const int found = static_cast<int>(min(storage_.fill, want));
    const int cap = pow2_fast(k);  // the bitonic network needs a power of two (not sort_capacity)
    for (int i = found + static_cast<int>(threadIdx.x); i < cap; i += Threads) sorted[i] = kNoCandidate;
    for (int size = 2; size <= cap; size <<= 1)
      for (int stride = size / 2; stride > 0; stride >>= 1) {
        __syncthreads();
        for (int i = threadIdx.x; i < cap; i += Threads) {
          const int j = i ^ stride;
          if (j > i) {
            const topk_key a = sorted[i], b = sorted[j];
            const bool descending = (i & size) == 0 || size == cap;
            if ((a < b) == descending) {
              sorted[i] = b;
              sorted[j] = a;
            }
          }
        }
      }
    __syncthreads();
    return found;
  }

  /// The threshold filter; -1 (and nothing written) when too many survive.
  __device__ int select_filtered(const topk_key (&keys)[E], int k, topk_key* sorted) {
    const int t = static_cast<int>(threadIdx.x);
    topk_key m = kNoCandidate;
#pragma unroll
    for (int j = 0; j < E; ++j) m = keys[j] > m ? keys[j] : m;
    if (t == 0) storage_.fill = 0;
    // A score word at least c of this warp's lane maxima reach (so c of its
    // keys): as filter_scores, on the words moved to signed order.
    const int c = (k + kWarps - 1) / kWarps;
    constexpr std::uint32_t kSign = 0x80000000u;
    const auto w = static_cast<std::uint32_t>(
                       detail::warp_cth_largest_floor(static_cast<int>(detail::hi_word(m) ^ kSign), c, t & 31)) ^
                   kSign;
    if ((t & 31) == 0) storage_.warp_min[t / 32] = w;
    __syncthreads();
    std::uint32_t floor_hi = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) floor_hi = min(floor_hi, storage_.warp_min[i]);
    const topk_key threshold = static_cast<topk_key>(floor_hi) << 32;
    topk_key* survivors = sorted + pow2_fast(k);
#pragma unroll
    for (int j = 0; j < E; ++j) {  // one shared atomic per warp and key slot that has survivors
      const bool take = keys[j] >= threshold && keys[j] != kNoCandidate;
      const unsigned pos = detail::warp_append(take, &storage_.fill);
      if (take && pos < kSurvivors) survivors[pos] = keys[j];
    }
    __syncthreads();
    const int n = static_cast<int>(storage_.fill);
    if (n > kSurvivors) {
      __syncthreads();  // every thread has read fill before the radix path reuses it
      return -1;
    }
    const int found = min(n, k);
    for (int i = t; i < n; i += Threads) {
      const topk_key key = survivors[i];
      int rank = 0;
      for (int u = 0; u < n; ++u) rank += survivors[u] > key ? 1 : 0;
      if (rank < k) sorted[rank] = key;
    }
    for (int i = found + t; i < pow2_fast(k); i += Threads) sorted[i] = kNoCandidate;
    __syncthreads();
    return found;
  }

  /// select_scores' filter: the same threshold, on floats (a NaN never
  /// passes `>=`), so the check that at least k entries passed is what
  /// proves the k largest are among them. The survivors are placed by a warp
  /// scan of per-thread bit masks (one shared atomic per warp) as (score,
  /// index) pairs, and two warps or one sort them (detail::two_warp_top_k,
  /// detail::warp_top_k). False (nothing of the result written; the pairs
  /// area past it may be) when fewer than k or more than kSortCap pass. (A bool,
  /// not the count: with a count the compiler cannot tell the sorted path
  /// from the radix one and keeps x alive through the sort, spilling it.)
  template <int Vec>
  __device__ bool filter_scores(const float (&x)[E], int first, int len, int k, topk_key* sorted) {
    const int t = static_cast<int>(threadIdx.x), lane = t & 31;
    float m = x[0];
#pragma unroll
    for (int j = 1; j < E; ++j) m = fmaxf(m, x[j]);  // ignores NaN; NaN only when the lane has no number
    // A score at least c of this warp's lane maxima reach (c of its entries,
    // then): their c-th largest, on the ordered ints, floored to a multiple
    // of 32 (a lane with no number counts as the lowest). The floor admits a
    // survivor more only where a score lies within 31 ulps below it; where
    // it takes -inf to a NaN word, nothing passes and the radix path ranks
    // the row.
    const int c = (k + kWarps - 1) / kWarps;
    const int o = detail::warp_cth_largest_floor(isnan(m) ? INT_MIN : detail::ordered_int(__float_as_int(m)), c, lane);
    if (t == 0) storage_.fill = 0;
    if (lane == 0) storage_.warp_min[t / 32] = static_cast<std::uint32_t>(o);
    __syncthreads();
    // The smallest warp threshold: one shared load a lane and a redux (kWarps <= 32).
    const int lowest =
        __reduce_min_sync(kFullMask, lane < kWarps ? static_cast<int>(storage_.warp_min[lane]) : INT_MAX);
    const float threshold = __int_as_float(detail::ordered_int(lowest));  // INT_MIN -> NaN: none pass
    // This thread's survivors as bits j (entries at or past len never count).
    const int rest = len - first - Vec * t;  // entries from this thread's first one to len
    unsigned mask = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) mask |= (x[j] >= threshold ? 1u : 0u) << j;
    if constexpr (Vec == 1) {
      const int valid = rest <= 0 ? 0 : min(E, (rest + Threads - 1) / Threads);  // ceil(rest / Threads)
      mask &= (1u << valid) - 1u;                                               // valid <= E <= 16
    } else if (len - first < Threads * E) {  // uniform: a partial chunk
      unsigned below = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) below |= (entry_offset<Vec>(j) < rest ? 1u : 0u) << j;
      mask &= below;
    }
    const int mine = __popc(mask);
    int before = mine;  // inclusive scan over the warp's lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(kFullMask, before, off);
      if (lane >= off) before += y;
    }
    const unsigned warp_total = __shfl_sync(kFullMask, before, 31);
    unsigned base = 0;
    if (lane == 31 && warp_total != 0) base = atomicAdd(&storage_.fill, warp_total);
    base = __shfl_sync(kFullMask, base, 31);
    // (score bits, index) pairs; sort_capacity leaves kSurvivors >= kSortCap keys here.
    auto* pairs = reinterpret_cast<uint2*>(sorted + pow2_fast(k));
    if (base + warp_total <= static_cast<unsigned>(kSortCap)) {  // uniform; more sends the row to the radix path
      // One shared address, advanced per survivor: three instructions a
      // slot (test, store, add), not the pointer rebuilt for every store.
      unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(pairs + base + (before - mine)));
      const unsigned index = static_cast<unsigned>(first + Vec * t);
#pragma unroll
      for (int j = 0; j < E; ++j)
        if (mask & (1u << j)) {
          ptx::st_shared_v2(at, __float_as_uint(x[j]), index + entry_offset<Vec>(j));
          at += sizeof(uint2);
        }
    }
    __syncthreads();
    const int n = static_cast<int>(storage_.fill);
    if (n < k || n > kSortCap) {
      __syncthreads();  // every thread has read fill before the radix path reuses it
      return false;
    }
    constexpr int kHalf = detail::kWarpSortKeys / 2;  // two_warp_top_k's run; its scratch follows 128 pairs
    if (kSurvivors >= detail::kWarpSortKeys + kHalf && k <= kHalf && n > kHalf && n <= detail::kWarpSortKeys) {
      detail::two_warp_top_k(pairs, n, k, sorted, reinterpret_cast<topk_key*>(pairs) + detail::kWarpSortKeys);
    } else {
      if (t < 32) detail::warp_top_k(pairs, n, k, sorted);  // uniform per warp
      __syncthreads();
    }
    return true;
  }

  static constexpr int kSortCap = kSurvivors;  ///< survivors the warp sort takes; more go to the radix path
  static_assert(kFilterK < detail::kWarpSortKeys, "each sort pass must take in at least one new survivor");

  /// Block-wide count of keys satisfying pred: one redux per warp, one
  /// barrier. The two count slots alternate, so a slot is rewritten only
  /// after every thread has passed the barrier that follows its last read.
  template <class Key, class Pred>
  __device__ unsigned count(Key key, Pred pred) {
    unsigned c = 0;
    if constexpr (Key::kUnrolled) {
#pragma unroll
      for (int j = 0; j < E; ++j) c += pred(key(j)) ? 1u : 0u;
    } else {
#pragma unroll 1
      for (int j = 0; j < E; ++j) c += pred(key(j)) ? 1u : 0u;
    }
    c = __reduce_add_sync(kFullMask, c);
    unsigned* slot = storage_.counts[parity_];
    if ((threadIdx.x & 31) == 0) slot[threadIdx.x / 32] = c;
    __syncthreads();
    unsigned total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += slot[w];
    parity_ ^= 1;
    return total;
  }
  TempStorage& storage_;
  int parity_ = 0;
};

}  // namespace hisparse::select
