#pragma once
// Device-wide batched top-k of fp32 rows (CUB-style two-phase temporary
// storage, capturable), on the block primitives of topk.cuh: rows longer
// than one block holds (256 * 16) are cut into chunks whose top-k
// candidates are reduced again (temp storage). A full chunk at a 16-byte
// aligned address loads as runs of four (a v4 load a thread per 1024
// entries); where the launch finds every chunk so, it runs a kernel without
// the strided loads. Contract as topk.cuh's.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

#include "hisparse/core/ptx.cuh"
#include "hisparse/core/status.hpp"
#include "hisparse/select/topk.cuh"
#include "hisparse/tuning.hpp"

namespace hisparse::select {

inline constexpr int kMaxBatchedTopK = 2048;

namespace detail {

inline constexpr int kTopkThreads = tuning::kTopkThreads;
inline constexpr int kMaxKeysPerThread = tuning::kTopkKeysPerThread;
inline constexpr int kChunkKeys = kTopkThreads * kMaxKeysPerThread;  ///< keys one block holds in registers

__device__ __forceinline__ int row_length(const std::int32_t* lengths, int row, int n) {
  return lengths == nullptr ? n : max(0, min(lengths[row], n));
}

/// Writes one result slot. The value comes back from the key's score word
/// (ordered_bits is invertible on numbers), except for the two words it
/// does not invert: 0 (NaN, whose payload it dropped) and +0 (which may have
/// been -0); those read the score again.
__device__ __forceinline__ void write_result(topk_key key, const float* scores, std::int64_t row_stride, int row,
                                             int slot, int k, float* out_values, std::int32_t* out_indices) {
  const std::int32_t idx = key_index(key);
  const std::int64_t out = std::int64_t{row} * k + slot;
  out_indices[out] = idx;
  const std::uint32_t w = hi_word(key);
  float value;
  if (idx < 0)
    value = -__int_as_float(0x7f800000);
  else if (w == 0u || w == 0x80000000u)
    value = scores[std::int64_t{row} * row_stride + idx];
  else
    value = from_ordered_bits(w);
  out_values[out] = value;
}

/// Loads x[j] = row[first + j * Stride] for the entries below len (the rest
/// get `fill`) as predicated loads off one pointer with constant offsets, all
/// issued before any is used.
template <int E, int Stride>
__device__ __forceinline__ void load_strided(float (&x)[E], const float* row, int first, int len, float fill) {
  const float* p = row + first;
  // Keep p as computed: otherwise the compiler rebuilds each address from
  // the row's 64-bit offset (about eight instructions a load, not one).
  asm("" : "+l"(p));
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] = fill;
#pragma unroll
  for (int j = 0; j < E; ++j)
    if (first + j * Stride < len) x[j] = __ldcs(p + j * Stride);
}

/// Loads x[4g + q] = row[first + 4 Threads g + q] (q < 4) as E / 4 16-byte
/// loads, all issued before any is used: `row + first` 16-byte aligned, every
/// entry below the row's length.
template <int E, int Threads>
__device__ __forceinline__ void load_runs4(float (&x)[E], const float* row, int first) {
  static_assert(E % 4 == 0, "load_runs4 loads runs of four");
  const float4* p = reinterpret_cast<const float4*>(row + first);
  asm("" : "+l"(p));  // as load_strided: one pointer, constant offsets
#pragma unroll
  for (int g = 0; g < E / 4; ++g) {
    const float4 v = __ldcs(p + g * Threads);
    x[4 * g] = v.x;
    x[4 * g + 1] = v.y;
    x[4 * g + 2] = v.z;
    x[4 * g + 3] = v.w;
  }
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
  float x[E];
  topk_key keys[E];
  // A full row at a 16-byte aligned address loads as runs of four: x[4g + q]
  // is entry 4 lane + 128 g + q (a quarter of the load instructions).
  bool runs = false;
  if constexpr (E % 4 == 0) runs = len >= 32 * E && (reinterpret_cast<std::uintptr_t>(in) & 15u) == 0;
  if (runs) {  // uniform per warp
    if constexpr (E % 4 == 0) load_runs4<E, 32>(x, in, 4 * lane);
#pragma unroll
    for (int j = 0; j < E; ++j) keys[j] = make_key(x[j], 4 * lane + (j / 4) * 128 + j % 4);
  } else {
    load_strided<E, 32>(x, in, lane, len, 0.0f);
#pragma unroll
    for (int j = 0; j < E; ++j) {  // a full row (uniform per warp) takes every key without a compare
      const int i = j * 32 + lane;
      keys[j] = len >= 32 * E || i < len ? make_key(x[j], i) : kNoCandidate;
    }
  }
  const topk_key key = warp_topk<E>(storage[warp]).select(keys, k, min(len, 32 * E));
  if (lane < k) write_result(key, scores, row_stride, row, lane, k, out_values, out_indices);
}

/// What a block_topk_kernel reads: keys from an earlier pass, or scores,
/// with k <= block_topk::kFilterK (the float filter, its radix fallback
/// reading shared memory) or larger (the radix select on register keys).
/// Separate instantiations, so neither path pays the other's registers.
enum class block_input { keys, scores_filtered, scores };

/// block_topk_kernel's ranking of one chunk of fp32 scores (from entry
/// `first`) into `sorted`, x[] laid out as block_topk::entry_offset<Vec>:
/// Vec = 4 for a full chunk at a 16-byte aligned address (a quarter of the
/// load instructions, and no per-entry bound), else 1.
template <int Vec, int E, block_input In>
__device__ __forceinline__ void rank_score_chunk(typename block_topk<kTopkThreads, E>::TempStorage& storage,
                                                 const float* row, int first, int len, int k, topk_key* sorted) {
  using block = block_topk<kTopkThreads, E>;
  const int t = static_cast<int>(threadIdx.x);
  float x[E];
  if constexpr (Vec == 4)
    load_runs4<E, kTopkThreads>(x, row, first + 4 * t);
  else  // NaN past len: it fails every >= of select_scores' filter
    load_strided<E, kTopkThreads>(x, row, first + t, len, __int_as_float(0x7FFFFFFF));
  if constexpr (In == block_input::scores_filtered) {
    block(storage).template select_scores<Vec>(x, first, len, k, sorted);
  } else {
    topk_key keys[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = first + Vec * t + block::template entry_offset<Vec>(j);
      keys[j] = i < len ? make_key(x[j], i) : kNoCandidate;
    }
    block(storage).select(keys, k, sorted);
  }
}

/// CTAs an SM block_topk_kernel asks ptxas to fit (tuning.hpp).
template <int E, block_input In, bool Runs>
constexpr int block_topk_min_blocks() {
  return tuning::topk_min_blocks_per_sm<E, In == block_input::scores_filtered, Runs>();
}

/// One block per (row, chunk of 256 * E inputs). Inputs are scores (first
/// pass) or keys from an earlier pass. With one chunk per row it writes the
/// final result; otherwise each chunk's k best keys go to `keys_out`.
/// Runs: the launch found every chunk full and 16-byte aligned (no row
/// lengths, n a multiple of the chunk, an aligned `scores` and a row_stride
/// of whole 16-byte units),
/// so every chunk loads as runs of four; otherwise each chunk that can does.
template <int E, block_input In, bool Runs = false>
__global__ void __launch_bounds__(kTopkThreads, block_topk_min_blocks<E, In, Runs>())
    block_topk_kernel(const float* scores, std::int64_t row_stride, const std::int32_t* lengths, int n,
                      const topk_key* keys_in, int keys_per_row, int chunks, int k, topk_key* keys_out,
                      float* out_values, std::int32_t* out_indices) {
  using block = block_topk<kTopkThreads, E>;
  __shared__ typename block::TempStorage storage;
  extern __shared__ __align__(16) topk_key sorted[];  // 16: the survivor ranking reads two keys a load
  // One row a block is the common case: no integer division there.
  const int row = chunks == 1 ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) / chunks;
  const int chunk = static_cast<int>(blockIdx.x) - row * chunks;
  const int span = kTopkThreads * E;
  if constexpr (In != block_input::keys) {
    const int len = row_length(lengths, row, n);
    const float* in = scores + std::int64_t{row} * row_stride;
    if constexpr (Runs) {
      static_assert(E % 4 == 0, "runs of four need E a multiple of 4");
      rank_score_chunk<4, E, In>(storage, in, chunk * span, len, k, sorted);
    } else {
      bool ranked = false;
      if constexpr (E % 4 == 0) {
        if (chunk * span + span <= len && (reinterpret_cast<std::uintptr_t>(in) & 15u) == 0) {  // uniform
          rank_score_chunk<4, E, In>(storage, in, chunk * span, len, k, sorted);
          ranked = true;
        }
      }
      if (!ranked) rank_score_chunk<1, E, In>(storage, in, chunk * span, len, k, sorted);
    }
  } else {
    const topk_key* in = keys_in + std::int64_t{row} * keys_per_row;
    topk_key keys[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = chunk * span + j * kTopkThreads + static_cast<int>(threadIdx.x);
      keys[j] = i < keys_per_row ? in[i] : kNoCandidate;
    }
    block(storage).select(keys, k, sorted);
  }
  // The block's index read again, not kept: held across the two ranking
  // paths, ptxas spilled row and chunk at the 40 registers of 6 CTAs an SM.
  const unsigned block_index = ptx::block_index_x();
  if (chunks == 1) {
    for (int i = threadIdx.x; i < k; i += kTopkThreads)
      write_result(sorted[i], scores, row_stride, static_cast<int>(block_index), i, k, out_values, out_indices);
  } else {
    topk_key* out = keys_out + std::int64_t{block_index} * k;  // (row * chunks + chunk) * k
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
    /// block_topk_kernel from scores: the all-runs instantiation where the
    /// launch found every chunk full and aligned (and E allows runs).
    template <block_input In>
    static auto kernel_for(bool runs) {
      if constexpr (E % 4 == 0) {
        if (runs) return &block_topk_kernel<E, In, true>;
      }
      return &block_topk_kernel<E, In>;
    }

    static status run(const float* scores, std::int64_t stride, const std::int32_t* lengths, int n,
                      const topk_key* keys_in, int keys_per_row, int rows, int chunks, int k, topk_key* keys_out,
                      float* values, std::int32_t* indices, cudaStream_t stream) {
      using block = block_topk<kTopkThreads, E>;
      const auto grid = static_cast<unsigned>(std::int64_t{rows} * chunks);
      const std::size_t keys = sizeof(topk_key) * block::sort_capacity(k);
      if constexpr (!FromScores) {
        block_topk_kernel<E, block_input::keys><<<grid, kTopkThreads, keys, stream>>>(
            scores, stride, lengths, n, keys_in, keys_per_row, chunks, k, keys_out, values, indices);
      } else {
        // Every chunk full and 16-byte aligned: the kernel without strided loads.
        const bool runs = lengths == nullptr && n % (kTopkThreads * E) == 0 && stride % 4 == 0 &&
                          reinterpret_cast<std::uintptr_t>(scores) % 16 == 0;
        const bool filtered = k <= block::kFilterK;
        auto* kernel = filtered ? kernel_for<block_input::scores_filtered>(runs) : kernel_for<block_input::scores>(runs);
        kernel<<<grid, kTopkThreads, filtered ? sizeof(topk_key) * block::scores_capacity(k) : keys, stream>>>(
            scores, stride, lengths, n, keys_in, keys_per_row, chunks, k, keys_out, values, indices);
      }
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
///
/// A template (Score is float, never deduced), not an inline function: the
/// kernels a non-template function names are compiled in every translation
/// unit that includes this header, called or not.
template <class Score = float>
[[nodiscard]] status batched_topk(void* temp, std::size_t& temp_bytes, std::type_identity_t<const Score*> scores,
                                         std::int64_t row_stride, const std::int32_t* row_lengths, int rows, int n,
                                         int k, float* out_values, std::int32_t* out_indices,
                                         cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<Score, float>, "batched_topk ranks fp32 scores");
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
