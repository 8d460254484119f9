#pragma once
// Top-k selection: warp- and block-level primitives (CUB style: the caller
// owns the TempStorage) and a device-wide batched top-k.
//
// Algorithm: radix select with 1-bit digits on the 64-bit keys of
// topk_keys.hpp. Each key stays in a register; 32 rounds over the high word
// (the score) find the k-th largest score, and only when that score is tied
// past k do 32 more rounds over the low word (the index) among the ties pick
// the lowest indices. A round is one comparison per key and one count across
// the warp (`redux.sync`) or block: no shared-memory histograms, so no atomic
// contention when scores cluster (they do: the top bits of normally
// distributed floats take a handful of values). The k survivors are
// compacted and sorted by a bitonic network (in registers for a warp, in
// shared memory for a block). Rows longer than one block's registers hold are
// cut into chunks whose top-k candidates are reduced again (temp storage).
//
// Contract (the same as DESIGN.md section 1 and reference::select_top_k):
// values descending, ties to the lower index, NaN below -inf, -0 == +0; a row
// with fewer than k valid entries ends in padding (index -1, value -inf).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/select/topk_keys.hpp"

namespace hisparse::select {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "hisparse top-k needs sm_80 or newer (it counts with redux.sync)"
#endif

inline constexpr unsigned kFullMask = 0xFFFFFFFFu;

namespace detail {
__device__ __forceinline__ std::uint32_t hi_word(topk_key k) { return static_cast<std::uint32_t>(k >> 32); }
__device__ __forceinline__ std::uint32_t lo_word(topk_key k) { return static_cast<std::uint32_t>(k); }

/// Bitonic sort of one key per lane, descending across the warp.
__device__ __forceinline__ topk_key warp_sort_descending(topk_key key) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const topk_key other = __shfl_xor_sync(kFullMask, key, stride);
      const bool descending = (lane & size) == 0 || size == 32;
      const bool keep_max = ((lane & stride) == 0) == descending;
      key = keep_max ? (key > other ? key : other) : (key < other ? key : other);
    }
  }
  return key;
}

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
}  // namespace detail

/// Warp-wide top-k of E keys per lane, k <= 32.
///
/// First a threshold filter: the k-th largest score of 64 group maxima (each
/// lane's keys in two halves) is one at least k keys reach, so the k largest
/// are all at or above it; the survivors (~2k on random rows) are ranked against
/// each other, and each key's rank is its output slot. Where more than 64
/// survive (ties, sorted rows) the radix select below takes over.
template <int E>
class warp_topk {
 public:
  struct TempStorage {
    alignas(16) topk_key keys[64];  ///< the filter first counts 64 score words here, 16 bytes at a time
    topk_key out[32];
  };

  __device__ explicit warp_topk(TempStorage& storage) : storage_(storage) {}

  /// Returns, in lane i < k, the i-th largest key of the warp (descending);
  /// kNoCandidate in lanes past k or past the number of real candidates.
  __device__ topk_key select(const topk_key (&keys)[E], int k) {
    const int lane = threadIdx.x & 31;
    if constexpr (E >= 2) {
      topk_key m0 = kNoCandidate, m1 = kNoCandidate;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (j < E / 2) m0 = keys[j] > m0 ? keys[j] : m0;
        else m1 = keys[j] > m1 ? keys[j] : m1;
      }
      // Counted on the score words alone (32-bit compares, 4 per shared
      // load): the k-th largest of the 64 maxima's scores still has k keys
      // at or above it, so every key of the k largest passes.
      const std::uint32_t h0 = detail::hi_word(m0), h1 = detail::hi_word(m1);
      auto* words = reinterpret_cast<std::uint32_t*>(storage_.keys);
      words[lane] = h0;
      words[32 + lane] = h1;
      __syncwarp();
      int above0 = 0, above1 = 0;
#pragma unroll
      for (int u = 0; u < 64; u += 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(words + u);
        above0 += (x.x > h0) + (x.y > h0) + (x.z > h0) + (x.w > h0);
        above1 += (x.x > h1) + (x.y > h1) + (x.z > h1) + (x.w > h1);
      }
      // The k-th largest score word (with multiplicity): the smallest of
      // those with fewer than k strictly above.
      const std::uint32_t mine = min(above0 < k ? h0 : 0xFFFFFFFFu, above1 < k ? h1 : 0xFFFFFFFFu);
      const topk_key threshold = static_cast<topk_key>(__reduce_min_sync(kFullMask, mine)) << 32;
      __syncwarp();
      unsigned survivors = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const bool take = keys[j] >= threshold && keys[j] != kNoCandidate;
        const unsigned ballot = __ballot_sync(kFullMask, take);
        const unsigned pos = survivors + __popc(ballot & ((1u << lane) - 1u));
        if (take && pos < 64) storage_.keys[pos] = keys[j];
        survivors += __popc(ballot);
      }
      __syncwarp();
      if (survivors <= 64) {
        const int n = static_cast<int>(survivors);
        for (int i = lane; i < n; i += 32) {
          const topk_key key = storage_.keys[i];
          int rank = 0;
          for (int u = 0; u < n; ++u) rank += storage_.keys[u] > key ? 1 : 0;
          if (rank < k) storage_.out[rank] = key;
        }
        __syncwarp();
        const topk_key result = lane < min(n, k) ? storage_.out[lane] : kNoCandidate;
        __syncwarp();
        return result;
      }
    }
    auto count = [&](auto pred) {
      unsigned c = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) c += pred(keys[j]) ? 1u : 0u;
      return __reduce_add_sync(kFullMask, c);
    };
    const auto want = static_cast<unsigned>(k);
    std::uint32_t hi = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const std::uint32_t cand = hi | (1u << bit);
      if (count([&](topk_key x) { return detail::hi_word(x) >= cand; }) >= want) hi = cand;
    }
    std::uint32_t lo = 0;
    const unsigned at_least = count([&](topk_key x) { return detail::hi_word(x) >= hi; });
    if (at_least > want) {  // the k-th score is tied past k: lowest indices win
      const unsigned above = count([&](topk_key x) { return detail::hi_word(x) > hi; });
      const unsigned need = want - above;
      for (int bit = 31; bit >= 0; --bit) {
        const std::uint32_t cand = lo | (1u << bit);
        if (count([&](topk_key x) { return detail::hi_word(x) == hi && detail::lo_word(x) >= cand; }) >= need)
          lo = cand;
      }
    }
    const topk_key threshold = (static_cast<topk_key>(hi) << 32) | lo;
    unsigned base = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const bool take = keys[j] >= threshold && keys[j] != kNoCandidate;
      const unsigned ballot = __ballot_sync(kFullMask, take);
      const unsigned pos = base + __popc(ballot & ((1u << lane) - 1u));
      if (take && pos < 32) storage_.keys[pos] = keys[j];
      base += __popc(ballot);
    }
    __syncwarp();
    topk_key mine = lane < static_cast<int>(min(base, want)) ? storage_.keys[lane] : kNoCandidate;
    __syncwarp();
    return detail::warp_sort_descending(mine);
  }

 private:
  TempStorage& storage_;
};

/// Block-wide top-k of E keys per thread, k <= 2048. The caller provides
/// `sorted`, a shared array of at least `sort_capacity(k)` keys, which holds
/// the result in descending order (padding kNoCandidate after the
/// candidates).
///
/// For k <= Threads / 4, first a threshold filter: each warp takes the c-th
/// largest score of its lanes' maxima (c = ceil(k / warps)), and the
/// smallest of those is a score at least k keys reach (c per warp), so the k
/// largest are all at or above it; the survivors (~110 for k = 64 of 4096 random keys)
/// are ranked against each other in shared memory and written to their
/// slots: three barriers, where the radix select below spends one per bit.
/// More than kSurvivors survivors (ties, sorted or short rows) take the radix
/// path.
template <int Threads, int E>
class block_topk {
  static_assert(Threads % 32 == 0 && Threads >= 64, "block_topk needs whole warps, at least two");
  static constexpr int kWarps = Threads / 32;
  static constexpr int kFilterK = Threads / 4;
  static constexpr int kSurvivors = 2 * Threads;

  HISPARSE_HOST_DEVICE static constexpr int pow2(int k) {
    int p = 1;
    while (p < k) p <<= 1;
    return p;
  }

 public:
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
    const auto want = static_cast<unsigned>(k);
    std::uint32_t hi = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const std::uint32_t cand = hi | (1u << bit);
      if (count(keys, [&](topk_key x) { return detail::hi_word(x) >= cand; }) >= want) hi = cand;
    }
    std::uint32_t lo = 0;
    const unsigned at_least = count(keys, [&](topk_key x) { return detail::hi_word(x) >= hi; });
    if (at_least > want) {
      const unsigned above = count(keys, [&](topk_key x) { return detail::hi_word(x) > hi; });
      const unsigned need = want - above;
      for (int bit = 31; bit >= 0; --bit) {
        const std::uint32_t cand = lo | (1u << bit);
        if (count(keys, [&](topk_key x) { return detail::hi_word(x) == hi && detail::lo_word(x) >= cand; }) >=
            need)
          lo = cand;
      }
    }
    const topk_key threshold = (static_cast<topk_key>(hi) << 32) | lo;
    if (threadIdx.x == 0) storage_.fill = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (keys[j] >= threshold && keys[j] != kNoCandidate) {
        const unsigned pos = atomicAdd(&storage_.fill, 1u);
        if (pos < want) sorted[pos] = keys[j];
      }
    __syncthreads();
    const int found = static_cast<int>(min(storage_.fill, want));
    const int cap = pow2(k);  // the bitonic network needs a power of two (not sort_capacity)
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

 private:
  /// The threshold filter; -1 (and nothing written) when too many survive.
  __device__ int select_filtered(const topk_key (&keys)[E], int k, topk_key* sorted) {
    const int t = static_cast<int>(threadIdx.x);
    topk_key m = kNoCandidate;
#pragma unroll
    for (int j = 0; j < E; ++j) m = keys[j] > m ? keys[j] : m;
    if (t == 0) storage_.fill = 0;
    // This warp's c-th largest lane-maximum score (with multiplicity: the
    // smallest of those with fewer than c strictly above), on the 32-bit
    // score words: c keys of the warp reach it.
    const int c = (k + kWarps - 1) / kWarps;
    const std::uint32_t mh = detail::hi_word(m);
    int above = 0;
#pragma unroll 8
    for (int u = 0; u < 32; ++u) above += __shfl_sync(kFullMask, mh, u) > mh ? 1 : 0;
    const std::uint32_t w = __reduce_min_sync(kFullMask, above < c ? mh : 0xFFFFFFFFu);
    if ((t & 31) == 0) storage_.warp_min[t / 32] = w;
    __syncthreads();
    std::uint32_t floor_hi = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) floor_hi = min(floor_hi, storage_.warp_min[i]);
    const topk_key threshold = static_cast<topk_key>(floor_hi) << 32;
    topk_key* survivors = sorted + pow2(k);
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
    for (int i = found + t; i < pow2(k); i += Threads) sorted[i] = kNoCandidate;
    __syncthreads();
    return found;
  }

  /// Block-wide count of keys satisfying pred: one redux per warp, one
  /// barrier. The two count slots alternate, so a slot is rewritten only
  /// after every thread has passed the barrier that follows its last read.
  template <class Pred>
  __device__ unsigned count(const topk_key (&keys)[E], Pred pred) {
    unsigned c = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) c += pred(keys[j]) ? 1u : 0u;
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

// ---------------------------------------------------------------------------
// Device-wide batched top-k.

inline constexpr int kMaxBatchedTopK = 2048;

namespace detail {

inline constexpr int kTopkThreads = 256;
inline constexpr int kMaxKeysPerThread = 16;
inline constexpr int kChunkKeys = kTopkThreads * kMaxKeysPerThread;  ///< keys one block holds in registers

__device__ __forceinline__ int row_length(const std::int32_t* lengths, int row, int n) {
  return lengths == nullptr ? n : max(0, min(lengths[row], n));
}

__device__ __forceinline__ void write_result(topk_key key, const float* scores, std::int64_t row_stride, int row,
                                             int slot, int k, float* out_values, std::int32_t* out_indices) {
  const std::int32_t idx = key_index(key);
  const std::int64_t out = std::int64_t{row} * k + slot;
  out_indices[out] = idx;
  out_values[out] = idx >= 0 ? scores[std::int64_t{row} * row_stride + idx] : -__int_as_float(0x7f800000);
}

/// One warp per row: rows of up to 32 * E scores, k <= 32.
template <int E>
__global__ void __launch_bounds__(kTopkThreads) warp_topk_kernel(const float* scores, std::int64_t row_stride,
                                                                 const std::int32_t* lengths, int rows, int n,
                                                                 int k, float* out_values,
                                                                 std::int32_t* out_indices) {
  __shared__ typename warp_topk<E>::TempStorage storage[kTopkThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int row = blockIdx.x * (kTopkThreads / 32) + warp;
  if (row >= rows) return;  // whole warps leave; the warp primitive has no block barrier
  const int len = row_length(lengths, row, n);
  const float* in = scores + std::int64_t{row} * row_stride;
  topk_key keys[E];
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = j * 32 + lane;
    keys[j] = i < len ? make_key(__ldcs(in + i), i) : kNoCandidate;
  }
  const topk_key key = warp_topk<E>(storage[warp]).select(keys, k);
  if (lane < k) write_result(key, scores, row_stride, row, lane, k, out_values, out_indices);
}

/// One block per (row, chunk of 256 * E inputs). Inputs are scores (first
/// pass) or keys from an earlier pass. With one chunk per row it writes the
/// final result; otherwise each chunk's k best keys go to `keys_out`.
template <int E, bool FromScores>
__global__ void __launch_bounds__(kTopkThreads) block_topk_kernel(
    const float* scores, std::int64_t row_stride, const std::int32_t* lengths, int n, const topk_key* keys_in,
    int keys_per_row, int chunks, int k, topk_key* keys_out, float* out_values, std::int32_t* out_indices) {
  using block = block_topk<kTopkThreads, E>;
  __shared__ typename block::TempStorage storage;
  extern __shared__ topk_key sorted[];
  const int row = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const int span = kTopkThreads * E;
  topk_key keys[E];
  if constexpr (FromScores) {
    const int len = row_length(lengths, row, n);
    const float* in = scores + std::int64_t{row} * row_stride;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = chunk * span + j * kTopkThreads + static_cast<int>(threadIdx.x);
      keys[j] = i < len ? make_key(__ldcs(in + i), i) : kNoCandidate;
    }
  } else {
    const topk_key* in = keys_in + std::int64_t{row} * keys_per_row;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = chunk * span + j * kTopkThreads + static_cast<int>(threadIdx.x);
      keys[j] = i < keys_per_row ? in[i] : kNoCandidate;
    }
  }
  block(storage).select(keys, k, sorted);
  if (chunks == 1) {
    for (int i = threadIdx.x; i < k; i += kTopkThreads)
      write_result(sorted[i], scores, row_stride, row, i, k, out_values, out_indices);
  } else {
    topk_key* out = keys_out + (std::int64_t{row} * chunks + chunk) * k;
    for (int i = threadIdx.x; i < k; i += kTopkThreads) out[i] = sorted[i];
  }
}

inline int keys_per_thread(std::int64_t inputs, int threads) {
  int e = 1;
  while (std::int64_t{e} * threads < inputs) e <<= 1;
  return e;
}

template <template <int> class Launch, class... Args>
status dispatch_keys_per_thread(int e, Args&&... args) {
  switch (e) {
    case 1: return Launch<1>::run(args...);
    case 2: return Launch<2>::run(args...);
    case 4: return Launch<4>::run(args...);
    case 8: return Launch<8>::run(args...);
    case 16: return Launch<16>::run(args...);
    default: return fail(status::internal_error, "batched_topk: keys per thread out of range");
  }
}

template <int E>
struct launch_warp {
  static status run(const float* scores, std::int64_t stride, const std::int32_t* lengths, int rows, int n, int k,
                    float* values, std::int32_t* indices, cudaStream_t stream) {
    const int per_block = kTopkThreads / 32;
    warp_topk_kernel<E><<<(rows + per_block - 1) / per_block, kTopkThreads, 0, stream>>>(scores, stride, lengths,
                                                                                         rows, n, k, values, indices);
    HISPARSE_CUDA_TRY(cudaGetLastError());
    return status::success;
  }
};

template <bool FromScores>
struct launch_block {
  template <int E>
  struct with {
    static status run(const float* scores, std::int64_t stride, const std::int32_t* lengths, int n,
                      const topk_key* keys_in, int keys_per_row, int rows, int chunks, int k, topk_key* keys_out,
                      float* values, std::int32_t* indices, cudaStream_t stream) {
      const std::size_t smem = sizeof(topk_key) * block_topk<kTopkThreads, E>::sort_capacity(k);
      block_topk_kernel<E, FromScores><<<static_cast<unsigned>(std::int64_t{rows} * chunks), kTopkThreads, smem,
                                         stream>>>(scores, stride, lengths, n, keys_in, keys_per_row, chunks, k,
                                                   keys_out, values, indices);
      HISPARSE_CUDA_TRY(cudaGetLastError());
      return status::success;
    }
  };
};

/// Candidates per row after the chunked first pass, and after each
/// reduction pass; the last entry is what the final pass reads.
struct topk_plan {
  bool warp = false;
  std::int64_t passes = 0;
  std::int64_t temp_keys = 0;  ///< keys per ping-pong buffer
};

inline topk_plan plan_topk(int rows, int n, int k) {
  topk_plan p;
  if (n <= 32 * kMaxKeysPerThread && k <= 32) {
    p.warp = true;
    return p;
  }
  std::int64_t m = n;
  while (m > kChunkKeys) {
    const std::int64_t chunks = (m + kChunkKeys - 1) / kChunkKeys;
    p.temp_keys = std::max(p.temp_keys, std::int64_t{rows} * chunks * k);
    m = chunks * k;
    ++p.passes;
  }
  return p;
}

}  // namespace detail

/// Device-wide batched top-k: for each of `rows` rows of `n` fp32 scores
/// (row r starts at scores + r * row_stride; optional `row_lengths` limits
/// row r to its first row_lengths[r] entries), writes the k largest values
/// and their int32 column indices to out_values / out_indices ([rows][k]),
/// in descending order, ties to the lower index, NaN after -inf; rows with
/// fewer than k valid entries end in (value -inf, index -1) padding.
///
/// CUB-style two-phase temporary storage: with temp == nullptr, only sets
/// temp_bytes (at least 1) and returns. Stream-ordered, never synchronizes,
/// allocates nothing: capturable in a CUDA graph. 1 <= k <= 2048, any n >= 1.
[[nodiscard]] inline status batched_topk(void* temp, std::size_t& temp_bytes, const float* scores,
                                         std::int64_t row_stride, const std::int32_t* row_lengths, int rows, int n,
                                         int k, float* out_values, std::int32_t* out_indices,
                                         cudaStream_t stream = nullptr) {
  if (rows < 1 || n < 1 || n > (1 << 30))
    return fail(status::invalid_argument, "batched_topk: need rows >= 1 and 1 <= n <= 2^30 (got rows " +
                                              std::to_string(rows) + ", n " + std::to_string(n) + ")");
  if (k < 1 || k > kMaxBatchedTopK)
    return fail(status::invalid_argument, "batched_topk: k " + std::to_string(k) + " must be in [1, 2048]");
  if (row_stride < n) return fail(status::invalid_argument, "batched_topk: row_stride must be >= n");
  const detail::topk_plan plan = detail::plan_topk(rows, n, k);
  // Room to align the key buffers ourselves, so any temp pointer works.
  constexpr std::size_t kTempAlign = 256;
  const std::size_t needed =
      plan.temp_keys == 0 ? 1 : 2 * static_cast<std::size_t>(plan.temp_keys) * sizeof(topk_key) + kTempAlign;
  if (temp == nullptr) {
    temp_bytes = needed;
    return status::success;
  }
  if (temp_bytes < needed)
    return fail(status::invalid_argument, "batched_topk: temp storage of " + std::to_string(temp_bytes) +
                                              " bytes is smaller than the " + std::to_string(needed) + " required");
  if (scores == nullptr || out_values == nullptr || out_indices == nullptr)
    return fail(status::invalid_argument, "batched_topk: scores and outputs must not be null");

  if (!plan.warp && std::int64_t{rows} * ((n + detail::kChunkKeys - 1) / detail::kChunkKeys) > 0x7FFFFFFF)
    return fail(status::invalid_argument, "batched_topk: rows * ceil(n / 4096) exceeds the grid limit (2^31 - 1)");
  if (plan.warp)
    return detail::dispatch_keys_per_thread<detail::launch_warp>(detail::keys_per_thread(n, 32), scores, row_stride,
                                                                 row_lengths, rows, n, k, out_values, out_indices,
                                                                 stream);
  const auto aligned = (reinterpret_cast<std::uintptr_t>(temp) + kTempAlign - 1) / kTempAlign * kTempAlign;
  auto* buffers = reinterpret_cast<topk_key*>(aligned);
  topk_key* ping = buffers;
  topk_key* pong = buffers + plan.temp_keys;
  std::int64_t m = n;
  bool from_scores = true;
  const topk_key* keys_in = nullptr;
  while (true) {
    const std::int64_t chunks = (m + detail::kChunkKeys - 1) / detail::kChunkKeys;
    const int e = chunks == 1 ? detail::keys_per_thread(m, detail::kTopkThreads) : detail::kMaxKeysPerThread;
    topk_key* keys_out = chunks == 1 ? nullptr : ping;
    status st;
    if (from_scores)
      st = detail::dispatch_keys_per_thread<detail::launch_block<true>::template with>(
          e, scores, row_stride, row_lengths, n, keys_in, 0, rows, static_cast<int>(chunks), k, keys_out, out_values,
          out_indices, stream);
    else
      st = detail::dispatch_keys_per_thread<detail::launch_block<false>::template with>(
          e, scores, row_stride, row_lengths, n, keys_in, static_cast<int>(m), rows, static_cast<int>(chunks), k,
          keys_out, out_values, out_indices, stream);
    if (st != status::success || chunks == 1) return st;
    keys_in = ping;
    std::swap(ping, pong);
    m = chunks * k;
    from_scores = false;
  }
}

}  // namespace hisparse::select
