#pragma once
// The paged KV cache: sequences x layers x KV heads of keys and values in
// fixed pages from a `page_pool`, with per-slice and per-block key sums (and,
// on request, per-slice key bounds) kept current by the append kernel itself
// (no separate pass over the cache).
// Layout and its reasons: paged_kv_ref.hpp.
//
// Ordering: every call on one cache is stream-ordered. The cache remembers the
// stream of its last launch; a call on another stream first makes that stream
// wait for the previous one, so alternating streams cannot race on the
// cache's scratch or page table. `free_sequence` hands pages back at once: do
// not free a sequence while kernels that read it are still queued on a stream
// other than the cache's. The cache keeps no stream handle past a call: it
// orders later calls through an event it owns, and its destructor waits for
// that event, so the streams it was used on may be destroyed before it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/cache_footprint.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/kv/page_pool.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/mr/resource.hpp"
#include "hisparse/tuning.hpp"

namespace hisparse::kv {

/// A run of new tokens for one sequence: rows [row, row + count) of the
/// packed K/V inputs ([rows][kv_heads][head_dim]) are appended to `slot`.
struct append_segment {
  int slot = 0;
  std::int32_t row = 0;
  std::int32_t count = 0;
};

/// Complete slices of one (sequence, layer), for the batched
/// offload_async / fetch_async that move many pairs in one call.
struct slice_list {
  int slot = 0;
  int layer = 0;
  std::span<const std::int32_t> slices;
};

/// Whole blocks of one (sequence, layer), for evict_async.
struct block_list {
  int slot = 0;
  int layer = 0;
  std::span<const std::int32_t> blocks;
};

namespace detail {

inline constexpr int kAppendThreads = tuning::kAppendThreads;
inline constexpr int kMaxHeadDim = 256;
// Descriptors ride in the kernel parameters (4 KB on every supported arch)
// when they fit (tuning.hpp).
inline constexpr int kInlineSegments = tuning::kInlineSegments;
inline constexpr int kInlinePages = tuning::kInlinePages;

/// Kernel parameters. Small batches (every decode step up to B = 32) carry
/// their descriptors inline, so a decode append is one launch and no copy.
template <class T>
struct append_batch {
  T** page_table;
  float* slice_sums;
  __nv_bfloat16* slice_sums_bf16;  ///< null unless the cache keeps them
  std::uint32_t* slice_bounds;     ///< key_bounds_word per dimension; null unless kept
  std::uint32_t* block_bounds;     ///< the blocks' (from their slices' bounds); null unless kept
  float* block_sums;
  float* block_bases;  ///< per block: ordered sum of its complete slices' sums
  std::int32_t* lengths;
  unsigned* block_counters;
  const kv_input_t<T>* src_k;  ///< bf16 for fp8 pages (the kernel quantizes)
  const kv_input_t<T>* src_v;
  const append_desc* segments;  ///< device copy when not inline
  T* const* new_pages;          ///< device copy when not inline
  int num_segments;
  int layer;
  int layers, kv_heads, head_dim, fine_slice, slices_per_block;
  std::int32_t max_slices, max_blocks;
  bool inline_segments, inline_pages, summaries;
  append_desc segs[kInlineSegments];
  T* pages[kInlinePages];
};

static_assert(sizeof(append_batch<float>) <= 4000, "append_batch must fit the 4 KB kernel parameter space");

/// Page-table entries set in one launch (offload and fetch move pages):
/// carried in the parameters, so a move needs no staging buffer.
inline constexpr int kTablePatch = 128;
template <class T>
struct table_patch {
  T** table;
  int count;
  std::int64_t index[kTablePatch];
  T* page[kTablePatch];
};
static_assert(sizeof(table_patch<float>) <= 4000, "table_patch must fit the 4 KB kernel parameter space");

template <class T>
__global__ void patch_table_kernel(const __grid_constant__ table_patch<T> p) {
  for (int i = static_cast<int>(threadIdx.x); i < p.count; i += static_cast<int>(blockDim.x))
    p.table[p.index[i]] = p.page[i];
}

/// Block summary rows an eviction turns to NaN: `count` blocks of `words`
/// 4-byte words each, at sums + row[i] and (where the cache keeps block
/// key bounds) bounds + row[i]. All-ones words: NaN as a float and as both
/// halves of a key_bounds word.
inline constexpr int kRowPoison = 128;
struct row_poison {
  float* sums;
  std::uint32_t* bounds;
  int words;
  int count;
  std::int64_t row[kRowPoison];
};
static_assert(sizeof(row_poison) <= 4000, "row_poison must fit the 4 KB kernel parameter space");

template <class T>  // a template so that including the header compiles no kernel
__global__ void poison_rows_kernel(const __grid_constant__ row_poison p) {
  const std::int64_t at = p.row[blockIdx.x];
  for (int w = static_cast<int>(threadIdx.x); w < p.words; w += static_cast<int>(blockDim.x)) {
    p.sums[at + w] = __uint_as_float(0xffffffffu);
    if (p.bounds != nullptr) p.bounds[at + w] = 0xffffffffu;
  }
}

template <class T>
__device__ __forceinline__ void accumulate(float* acc, const uint4& v) {
  constexpr int kPer = 16 / sizeof(T);
  T e[kPer];
  std::memcpy(e, &v, 16);
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] += to_float(e[i]);
}

// core/dtype.hpp's NaN-keeping min and max, and the same for 16-bit pairs
// (one instruction each).
using hisparse::nan_max;
using hisparse::nan_min;
__device__ __forceinline__ __half2 nan_min(__half2 m, __half2 x) { return __hmin2_nan(m, x); }
__device__ __forceinline__ __half2 nan_max(__half2 m, __half2 x) { return __hmax2_nan(m, x); }
__device__ __forceinline__ __nv_bfloat162 nan_min(__nv_bfloat162 m, __nv_bfloat162 x) { return __hmin2_nan(m, x); }
__device__ __forceinline__ __nv_bfloat162 nan_max(__nv_bfloat162 m, __nv_bfloat162 x) { return __hmax2_nan(m, x); }

template <class T>
__device__ __forceinline__ uint4 splat(T x) {
  T e[16 / sizeof(T)];
#pragma unroll
  for (auto& y : e) y = x;
  uint4 v;
  std::memcpy(&v, e, 16);
  return v;
}

/// Widens the running key bounds lo and hi (packed like v, in T: the min and
/// max of T values are T values) by the keys in v, four 32-bit lanes at a
/// time (a 16-bit pair or a float).
template <class T>
__device__ __forceinline__ void widen_bounds(uint4& lo, uint4& hi, const uint4& v) {
  using E = std::conditional_t<std::is_same_v<T, __half>, __half2,
                               std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, float>>;
  static_assert(sizeof(E) == 4, "widen_bounds takes 16-bit or 32-bit keys");
  E l[4], u[4], e[4];
  std::memcpy(l, &lo, 16);
  std::memcpy(u, &hi, 16);
  std::memcpy(e, &v, 16);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    l[i] = nan_min(l[i], e[i]);
    u[i] = nan_max(u[i], e[i]);
  }
  std::memcpy(&lo, l, 16);
  std::memcpy(&hi, u, 16);
}

/// Quantizes 8 bf16 elements of a row to fp8 codes (kv/fp8.hpp): the row's
/// scale is a max over its `width` threads (aligned groups of lanes, every
/// lane of the warp calling); writes it to `scale` when not null (the row's
/// first thread), replaces v by the stored values and returns the codes.
__device__ __forceinline__ uint2 quantize_fp8_row(uint4& v, int width, float* scale) {
  __nv_bfloat16 e[8];
  std::memcpy(e, &v, 16);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fp8_finite_magnitude(__bfloat162float(e[i])));
  for (int off = width / 2; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  const float s = fp8_row_scale(m);
  if (scale != nullptr && (threadIdx.x & (width - 1)) == 0) *scale = s;
  fp8_e4m3 q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = fp8_encode(__bfloat162float(e[i]), s);
    e[i] = __float2bfloat16_rn(fp8_decode(q[i], s));
  }
  std::memcpy(&v, e, 16);
  uint2 codes;
  std::memcpy(&codes, q, 8);
  return codes;
}

/// Grid: x = every slice touched by the batch, y = KV head. Each CTA copies
/// its slice's new K and V rows for one head into the page (16-byte vectors),
/// sums the new keys in fp32 into the slice sum (and, when kept, widens the
/// slice's key bounds by them), and the last CTA of each touched (block, head)
/// recomputes the block sum from its slices' sums (and, when kept, the
/// block's key range as the union of its old range and the touched slices').
template <class T>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ append_batch<T> b) {
  using In = kv_input_t<T>;              // the input (and, for fp8 pages, the dequantized) element
  constexpr bool kFp8 = is_fp8_v<T>;
  constexpr int kPer = 16 / sizeof(In);  // input elements per 16-byte vector
  // [rows_per_pass][head_dim] fp32 partial sums, then, with key bounds, the
  // row groups' minima and maxima as T, [rows_per_pass][head_dim] each.
  extern __shared__ __align__(16) float partial[];
  __shared__ bool last_for_block;

  const append_desc* segs = b.inline_segments ? b.segs : b.segments;
  int lo = 0, hi = b.num_segments - 1;  // last segment with slice_prefix <= blockIdx.x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].slice_prefix <= static_cast<int>(blockIdx.x)) lo = mid; else hi = mid - 1;
  }
  const append_desc s = segs[lo];
  const int h = blockIdx.y;
  const int F = b.fine_slice, D = b.head_dim;
  const std::int32_t slice = s.first_slice + (static_cast<std::int32_t>(blockIdx.x) - s.slice_prefix);
  const std::int32_t slice_begin = slice * F;
  const std::int32_t t0 = max(s.start, slice_begin);
  const std::int32_t t1 = min(s.start + s.count, slice_begin + F);
  const std::int64_t table = (std::int64_t{s.seq} * b.layers + b.layer) * b.max_slices + slice;

  T* page;
  if (slice >= s.first_new_slice) {
    const int k = s.new_page_prefix + (slice - s.first_new_slice);
    page = b.inline_pages ? b.pages[k] : b.new_pages[k];
    if (h == 0 && threadIdx.x == 0) b.page_table[table] = page;
  } else {
    page = b.page_table[table];
  }

  const std::int64_t tile = std::int64_t{F} * D;
  T* k_dst = page + std::int64_t{h} * tile + std::int64_t{t0 - slice_begin} * D;
  T* v_dst = page + (std::int64_t{b.kv_heads} + h) * tile + std::int64_t{t0 - slice_begin} * D;
  const std::int64_t row_stride = std::int64_t{b.kv_heads} * D;
  const std::int64_t src0 = (std::int64_t{s.src_row} + (t0 - s.start)) * row_stride + std::int64_t{h} * D;
  const In* k_src = b.src_k + src0;
  const In* v_src = b.src_v + src0;
  // FP8 pages: the rows' scales after the codes (kv/fp8.hpp).
  float* const k_scale = kFp8 ? reinterpret_cast<float*>(page + 2 * std::int64_t{b.kv_heads} * tile) +
                                    std::int64_t{h} * F + (t0 - slice_begin)
                              : nullptr;
  float* const v_scale = kFp8 ? k_scale + std::int64_t{b.kv_heads} * F : nullptr;

  // Summary state this CTA will need, fetched before the copy so its latency
  // hides behind the copy. A block's sum is always the ordered sum of its
  // slices' sums: block_base holds that sum over the block's complete slices,
  // so a CTA that is the only one touching its block this batch (every decode
  // step) finishes with one add instead of re-reading the block's slices.
  const std::int32_t end = s.start + s.count;
  const std::int32_t block = slice / b.slices_per_block;
  const std::int32_t block_first = block * b.slices_per_block;
  const std::int32_t in_block_first = max(s.first_slice, block_first);
  const std::int32_t in_block_last = min((end - 1) / F, block_first + b.slices_per_block - 1);
  const bool sole_cta = in_block_first == in_block_last;
  const std::int64_t block_index =
      ((std::int64_t{s.seq} * b.layers + b.layer) * b.max_blocks + block) * b.kv_heads + h;
  const std::int64_t slice_index = (table * b.kv_heads + h) * D;
  float* slice_sum = b.slice_sums + slice_index;
  float* block_sum = b.block_sums + block_index * D;
  float* block_base = b.block_bases + block_index * D;
  constexpr int kDimsPerThread = kMaxHeadDim / kAppendThreads;
  const bool bounds = b.slice_bounds != nullptr;  // only with summaries (validated)
  // The block's key range: a running union (ranges only widen), kept only
  // with the slices' (validated). The block held keys before this batch
  // unless the segment starts it.
  std::uint32_t* const block_word = b.block_bounds != nullptr ? b.block_bounds + block_index * D : nullptr;
  const bool block_held = s.start > block_first * F;
  float old_sum[kDimsPerThread], base[kDimsPerThread];
  std::uint32_t old_bounds[kDimsPerThread], old_block_bounds[kDimsPerThread];
  if (b.summaries) {
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) {
      const int d = threadIdx.x + i * kAppendThreads;
      old_sum[i] = d < D && t0 > slice_begin ? slice_sum[d] : 0.0f;
      base[i] = d < D && sole_cta && slice > block_first ? block_base[d] : 0.0f;
      // A slice's first tokens overwrite: the word may be a freed sequence's.
      // The empty range (+inf, -inf) is the identity of the combine below.
      old_bounds[i] = bounds && d < D && t0 > slice_begin ? b.slice_bounds[slice_index + d]
                                                          : key_bounds_word(INFINITY, -INFINITY);
      old_block_bounds[i] = block_word != nullptr && d < D && sole_cta && block_held
                                ? block_word[d]
                                : key_bounds_word(INFINITY, -INFINITY);
    }
  }

  // Thread (r, c): column vector c of rows r, r + R, r + 2R, ...
  const int vecs_per_row = D / kPer;
  const int rows_per_pass = kAppendThreads / vecs_per_row;
  const int c = threadIdx.x % vecs_per_row, r = threadIdx.x / vecs_per_row;
  const int rows = t1 - t0;
  float acc[kPer] = {};
  uint4 key_lo = splat(from_float<In>(INFINITY)), key_hi = splat(from_float<In>(-INFINITY));
  // All loads of a group before any store: the compiler cannot reorder loads
  // across stores it cannot prove disjoint, and bytes in flight are what
  // bound a copy. The trip count is uniform across the CTA (an fp8 row's
  // scale is a shuffle over the row's threads).
  constexpr int kUnroll = 4;
  for (int base = 0; base < rows; base += rows_per_pass * kUnroll) {
    uint4 kv[kUnroll], vv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int row = base + r + u * rows_per_pass;
      kv[u] = vv[u] = make_uint4(0u, 0u, 0u, 0u);
      if (row < rows) {
        kv[u] = __ldcs(reinterpret_cast<const uint4*>(k_src + row * row_stride + c * kPer));
        vv[u] = __ldcs(reinterpret_cast<const uint4*>(v_src + row * row_stride + c * kPer));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int row = base + r + u * rows_per_pass;
      if constexpr (kFp8) {
        // Codes and scale of the row, and the stored (dequantized) keys the
        // summaries take, as In (exact: kv/fp8.hpp).
        const uint2 kq = quantize_fp8_row(kv[u], vecs_per_row, row < rows ? k_scale + row : nullptr);
        const uint2 vq = quantize_fp8_row(vv[u], vecs_per_row, row < rows ? v_scale + row : nullptr);
        if (row < rows) {
          *reinterpret_cast<uint2*>(k_dst + std::int64_t{row} * D + c * kPer) = kq;
          *reinterpret_cast<uint2*>(v_dst + std::int64_t{row} * D + c * kPer) = vq;
        }
      } else if (row < rows) {
        *reinterpret_cast<uint4*>(k_dst + std::int64_t{row} * D + c * kPer) = kv[u];
        *reinterpret_cast<uint4*>(v_dst + std::int64_t{row} * D + c * kPer) = vv[u];
      }
      if (row < rows) {
        if (b.summaries) accumulate<In>(acc, kv[u]);
        if (bounds) widen_bounds<In>(key_lo, key_hi, kv[u]);
      }
    }
  }
  const bool first_cta_of_segment = blockIdx.x == static_cast<unsigned>(s.slice_prefix) && h == 0;
  if (first_cta_of_segment && threadIdx.x == 0) b.lengths[std::int64_t{s.seq} * b.layers + b.layer] = end;
  if (!b.summaries) return;

#pragma unroll
  for (int i = 0; i < kPer; ++i) partial[r * D + c * kPer + i] = acc[i];
  In* const lo_part = reinterpret_cast<In*>(partial + rows_per_pass * D);
  In* const hi_part = lo_part + rows_per_pass * D;
  if (bounds) {
    *reinterpret_cast<uint4*>(lo_part + r * D + c * kPer) = key_lo;
    *reinterpret_cast<uint4*>(hi_part + r * D + c * kPer) = key_hi;
  }
  __syncthreads();

  // Slice sum: the stored sum (if the slice already held tokens) plus the
  // row groups' partials in a fixed order: deterministic.
  const bool slice_complete = (slice + 1) * F <= end;
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) {
    const int d = threadIdx.x + i * kAppendThreads;
    if (d >= D) break;
    float sum = old_sum[i];
    for (int j = 0; j < rows_per_pass; ++j) sum += partial[j * D + d];
    slice_sum[d] = sum;
    if (b.slice_sums_bf16 != nullptr) b.slice_sums_bf16[slice_index + d] = __float2bfloat16_rn(sum);
    if (bounds) {
      // Decoding the stored word and rounding outward again is exact: the
      // rounding is monotone and leaves a rounded bound as it is (zeros too).
      float l = key_bounds_lo(old_bounds[i]), u = key_bounds_hi(old_bounds[i]);
      for (int j = 0; j < rows_per_pass; ++j) {
        l = nan_min(l, to_float(lo_part[j * D + d]));
        u = nan_max(u, to_float(hi_part[j * D + d]));
      }
      const std::uint32_t w = key_bounds_word(l, u);
      b.slice_bounds[slice_index + d] = w;
      if (block_word != nullptr && sole_cta) block_word[d] = widened_bounds(old_block_bounds[i], w);
    }
    if (sole_cta) {
      block_sum[d] = base[i] + sum;
      if (slice_complete) block_base[d] = base[i] + sum;
    }
  }
  if (sole_cta) return;

  // Several slices of this block in one batch (prefill): the last of their
  // CTAs to finish rebuilds the block from the base and the touched slices.
  unsigned* counter =
      b.block_counters + (std::int64_t{s.block_prefix} + (block - s.first_slice / b.slices_per_block)) * b.kv_heads + h;
  const auto expected = static_cast<unsigned>(in_block_last - in_block_first + 1);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_for_block = atomicAdd(counter, 1u) == expected - 1;
  __syncthreads();
  if (!last_for_block) return;
  __threadfence();
  const float* first_sum = slice_sum - std::int64_t{slice - in_block_first} * b.kv_heads * D;
  for (int d = threadIdx.x; d < D; d += kAppendThreads) {
    float complete = in_block_first > block_first ? __ldcg(block_base + d) : 0.0f;
    float total = complete;
    for (std::int32_t sl = 0; sl <= in_block_last - in_block_first; ++sl) {
      const float v = __ldcg(first_sum + std::int64_t{sl} * b.kv_heads * D + d);
      if ((in_block_first + sl + 1) * F <= end) {
        complete += v;
        total = complete;
      } else {
        total = complete + v;  // the partial frontier slice: never in the base
      }
    }
    block_base[d] = complete;
    block_sum[d] = total;
    if (block_word != nullptr) {
      const std::uint32_t* first_bounds = b.slice_bounds + slice_index -
                                          std::int64_t{slice - in_block_first} * b.kv_heads * D;
      std::uint32_t w = block_held ? __ldcg(block_word + d) : key_bounds_word(INFINITY, -INFINITY);
      for (std::int32_t sl = 0; sl <= in_block_last - in_block_first; ++sl)
        w = widened_bounds(w, __ldcg(first_bounds + std::int64_t{sl} * b.kv_heads * D + d));
      block_word[d] = w;
    }
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next batch
}

}  // namespace detail

/// Where a complete slice's page lives: device memory from the cache's pool,
/// or pinned host memory (offload_async), which kernels read through its
/// mapped address over PCIe: a step that keeps an offloaded slice reads the
/// same bytes, only slower.
/// Evicted: dropped by evict_async (retention); its page-table entry points
/// at a page of NaN K/V and it is never attended again.
enum class page_residency : std::uint8_t { device, host, evicted };

template <class T, mr::resource Resource>
class paged_kv_cache {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, float> ||
                    is_fp8_v<T>,
                "paged_kv_cache stores bf16, fp16, fp32 or fp8 e4m3 (kv/fp8.hpp)");
  static_assert(Resource::device_accessible, "paged_kv_cache needs device-accessible memory");

 public:
  using value_type = T;
  /// What appends take: T, or bf16 for fp8 pages (quantized by the append).
  using input_type = kv_input_t<T>;
  using slice_list = kv::slice_list;
  using block_list = kv::block_list;

  paged_kv_cache(Resource& resource, const paged_kv_cache_options& o, cudaStream_t stream = nullptr)
      : resource_(&resource), opt_(validated(o)), pool_(resource, pool_options(opt_)), stream_(stream) {
    const cache_footprint f = footprint_of(opt_, sizeof(T));
    max_slices_ = f.max_slices;
    max_blocks_ = f.max_blocks;
    table_bytes_ = f.table_bytes;
    slice_bytes_ = f.slice_sum_bytes;
    block_bytes_ = f.block_sum_bytes;
    slice_bf16_bytes_ = f.slice_bf16_bytes;
    slice_bounds_bytes_ = f.slice_bounds_bytes;
    block_bounds_bytes_ = f.block_bounds_bytes;
    length_bytes_ = f.length_bytes;
    counter_bytes_ = f.counter_bytes;
    pages_offset_ = f.pages_offset;
    scratch_bytes_ = f.scratch_bytes;
    topk_bytes_ = f.topk_cache_bytes;
    try {
      page_table_ = static_cast<T**>(resource_->allocate(table_bytes_, stream_));
      slice_sums_ = static_cast<float*>(resource_->allocate(slice_bytes_, stream_));
      if (slice_bf16_bytes_ != 0)
        slice_sums_bf16_ = static_cast<__nv_bfloat16*>(resource_->allocate(slice_bf16_bytes_, stream_));
      if (slice_bounds_bytes_ != 0)
        slice_bounds_ = static_cast<std::uint32_t*>(resource_->allocate(slice_bounds_bytes_, stream_));
      if (block_bounds_bytes_ != 0)
        block_bounds_ = static_cast<std::uint32_t*>(resource_->allocate(block_bounds_bytes_, stream_));
      block_sums_ = static_cast<float*>(resource_->allocate(block_bytes_, stream_));
      block_bases_ = static_cast<float*>(resource_->allocate(block_bytes_, stream_));
      lengths_ = static_cast<std::int32_t*>(resource_->allocate(length_bytes_, stream_));
      counters_ = static_cast<unsigned*>(resource_->allocate(counter_bytes_, stream_));
      scratch_ = static_cast<std::byte*>(resource_->allocate(scratch_bytes_, stream_));
      if (topk_bytes_ != 0) {
        topk_entries_ = static_cast<std::int32_t*>(resource_->allocate(topk_bytes_, stream_));
        HISPARSE_CUDA_CHECK(cudaMemsetAsync(topk_entries_, 0xff, topk_bytes_, stream_));  // every entry empty (-1)
      }
      HISPARSE_CUDA_CHECK(cudaMemsetAsync(page_table_, 0, table_bytes_, stream_));
      HISPARSE_CUDA_CHECK(cudaMemsetAsync(lengths_, 0, length_bytes_, stream_));
      HISPARSE_CUDA_CHECK(cudaMemsetAsync(counters_, 0, counter_bytes_, stream_));
      HISPARSE_CUDA_CHECK(cudaEventCreateWithFlags(&last_launch_, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
    slots_.resize(static_cast<std::size_t>(opt_.max_sequences));
  }

  paged_kv_cache(const paged_kv_cache&) = delete;
  paged_kv_cache& operator=(const paged_kv_cache&) = delete;
  ~paged_kv_cache() { release(); }

  [[nodiscard]] const paged_kv_cache_options& options() const noexcept { return opt_; }
  [[nodiscard]] const page_pool<Resource>& pool() const noexcept { return pool_; }

  /// Claims a free sequence slot able to grow to `reserved_length` tokens.
  [[nodiscard]] status add_sequence(std::int64_t reserved_length, int& slot) {
    if (reserved_length < 1 || reserved_length > opt_.max_context)
      return fail(status::invalid_argument, "add_sequence: reserved_length " + std::to_string(reserved_length) +
                                                " must be in [1, max_context = " +
                                                std::to_string(opt_.max_context) + "]");
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].active) {
        slots_[i].active = true;
        slots_[i].reserved = reserved_length;
        slots_[i].lengths.assign(static_cast<std::size_t>(opt_.num_layers), 0);
        slots_[i].pages.assign(static_cast<std::size_t>(opt_.num_layers), {});
        slots_[i].host.assign(static_cast<std::size_t>(opt_.num_layers), {});
        slots_[i].host_slices.assign(static_cast<std::size_t>(opt_.num_layers), 0);
        slots_[i].evicted_slices.assign(static_cast<std::size_t>(opt_.num_layers), 0);
        slot = static_cast<int>(i);
        return status::success;
      }
    return fail(status::out_of_memory,
                "add_sequence: all " + std::to_string(opt_.max_sequences) + " sequence slots are in use");
  }

  /// Returns a sequence's pages to the pool and frees its slot. Stream-ordered
  /// on `stream`: later appends that reuse the pages run after earlier work.
  [[nodiscard]] status free_sequence(int slot, cudaStream_t stream = nullptr) {
    HISPARSE_TRY(check_slot(slot, "free_sequence"));
    HISPARSE_TRY(order_after_last(stream));
    auto& s = slots_[static_cast<std::size_t>(slot)];
    auto valid = [](const std::vector<page_id>& ids) {
      std::vector<page_id> v;
      std::copy_if(ids.begin(), ids.end(), std::back_inserter(v), [](page_id id) { return id >= 0; });
      return v;
    };
    for (auto& layer_pages : s.pages) {
      HISPARSE_TRY(pool_.deallocate(valid(layer_pages)));
      layer_pages.clear();
    }
    for (auto& layer_pages : s.host) {
      if (host_pool_) HISPARSE_TRY(host_pool_->deallocate(valid(layer_pages)));
      layer_pages.clear();
    }
    std::fill(s.host_slices.begin(), s.host_slices.end(), 0);
    std::fill(s.evicted_slices.begin(), s.evicted_slices.end(), 0);
    HISPARSE_CUDA_TRY(cudaMemsetAsync(lengths_ + std::int64_t{slot} * opt_.num_layers, 0,
                                      sizeof(std::int32_t) * static_cast<std::size_t>(opt_.num_layers), stream));
    // The slot's TopK entries empty too: the next sequence in it selects
    // afresh rather than reuse this one's slices.
    if (topk_entries_ != nullptr) {
      const std::size_t per_slot = topk_bytes_ / static_cast<std::size_t>(opt_.max_sequences);
      HISPARSE_CUDA_TRY(cudaMemsetAsync(reinterpret_cast<std::byte*>(topk_entries_) + per_slot * slot, 0xff, per_slot,
                                        stream));
    }
    HISPARSE_CUDA_TRY(cudaEventRecord(last_launch_, stream));
    s = slot_state{};
    return status::success;
  }

  /// Appends one token to each sequence in `slots` for `layer`; k and v are
  /// device arrays [slots.size()][kv_heads][head_dim], 16-byte aligned.
  [[nodiscard]] status append_decode_async(int layer, std::span<const int> slots, const input_type* k, const input_type* v,
                                           cudaStream_t stream) {
    std::vector<append_segment> segs(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i) segs[i] = {slots[i], static_cast<std::int32_t>(i), 1};
    return append_async(layer, segs, k, v, stream);
  }

  /// Type-checked entry for engines that hold untyped buffers.
  [[nodiscard]] status append_async(int layer, std::span<const append_segment> segments, const void* k,
                                    const void* v, dtype kv_dtype, cudaStream_t stream) {
    if (kv_dtype != dtype_of_v<input_type>)
      return fail(status::invalid_argument, std::string("append: K/V dtype ") + std::string(name_of(kv_dtype)) +
                                                " does not match the cache's input " +
                                                std::string(name_of(dtype_of_v<input_type>)));
    return append_async(layer, segments, static_cast<const input_type*>(k), static_cast<const input_type*>(v), stream);
  }

  /// Appends ragged chunks (prefill, or decode) for `layer`: each segment's
  /// rows of the packed k/v ([rows][kv_heads][head_dim], device, 16-byte
  /// aligned) go to the end of its sequence. All or nothing: on any error
  /// nothing is appended and no page is taken.
  [[nodiscard]] status append_async(int layer, std::span<const append_segment> segments, const input_type* k,
                                    const input_type* v, cudaStream_t stream = nullptr) {
    if (layer < 0 || layer >= opt_.num_layers)
      return fail(status::invalid_argument, "append: layer " + std::to_string(layer) + " out of range [0, " +
                                                std::to_string(opt_.num_layers) + ")");
    if (segments.empty()) return fail(status::invalid_argument, "append: no segments");
    if (segments.size() > static_cast<std::size_t>(opt_.max_sequences))
      return fail(status::invalid_argument, "append: more segments than sequence slots");
    if (k == nullptr || v == nullptr) return fail(status::invalid_argument, "append: k and v must not be null");
    if (reinterpret_cast<std::uintptr_t>(k) % 16 != 0 || reinterpret_cast<std::uintptr_t>(v) % 16 != 0)
      return fail(status::invalid_argument, "append: k and v must be 16-byte aligned");
    std::vector<bool> seen(slots_.size(), false);
    for (const auto& seg : segments) {
      HISPARSE_TRY(check_slot(seg.slot, "append"));
      if (seen[static_cast<std::size_t>(seg.slot)])
        return fail(status::invalid_argument,
                    "append: sequence " + std::to_string(seg.slot) + " appears twice in one call");
      seen[static_cast<std::size_t>(seg.slot)] = true;
      if (seg.count < 1 || seg.row < 0)
        return fail(status::invalid_argument, "append: segment rows must be non-negative and count >= 1");
      const auto& s = slots_[static_cast<std::size_t>(seg.slot)];
      const std::int64_t len = s.lengths[static_cast<std::size_t>(layer)];
      if (len + seg.count > s.reserved)
        return fail(status::invalid_argument, "append: sequence " + std::to_string(seg.slot) + " layer " +
                                                  std::to_string(layer) + " would grow to " +
                                                  std::to_string(len + seg.count) + " tokens, past its reserved " +
                                                  std::to_string(s.reserved));
    }

    // Descriptors and the pages the batch needs (taken all at once).
    const int F = opt_.fine_slice, spb = opt_.coarse_block / opt_.fine_slice;
    std::vector<detail::append_desc> descs;
    std::int32_t slices = 0, blocks = 0, new_pages = 0;
    for (const auto& seg : segments) {
      const auto& s = slots_[static_cast<std::size_t>(seg.slot)];
      const auto start = static_cast<std::int32_t>(s.lengths[static_cast<std::size_t>(layer)]);
      const std::int32_t first = start / F, last = (start + seg.count - 1) / F;
      const std::int32_t first_new = start % F == 0 ? first : first + 1;
      descs.push_back({seg.slot, start, seg.count, seg.row, first, first_new, new_pages, slices, blocks});
      slices += last - first + 1;
      blocks += last / spb - first / spb + 1;
      new_pages += last - first_new + 1;
    }
    std::vector<page_id> ids(static_cast<std::size_t>(new_pages));
    HISPARSE_TRY(order_after_last(stream));
    HISPARSE_TRY(pool_.allocate(ids));
    std::vector<T*> addresses(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) addresses[i] = reinterpret_cast<T*>(pool_.address(ids[i]));

    detail::append_batch<T> batch{};
    batch.page_table = page_table_;
    batch.slice_sums = slice_sums_;
    batch.slice_sums_bf16 = slice_sums_bf16_;  // null without summaries (validated)
    batch.slice_bounds = slice_bounds_;        // likewise
    batch.block_bounds = block_bounds_;        // likewise
    batch.block_sums = block_sums_;
    batch.block_bases = block_bases_;
    batch.lengths = lengths_;
    batch.block_counters = counters_;
    batch.src_k = k;
    batch.src_v = v;
    batch.num_segments = static_cast<int>(descs.size());
    batch.layer = layer;
    batch.layers = opt_.num_layers;
    batch.kv_heads = opt_.num_kv_heads;
    batch.head_dim = opt_.head_dim;
    batch.fine_slice = F;
    batch.slices_per_block = spb;
    batch.max_slices = max_slices_;
    batch.max_blocks = max_blocks_;
    batch.summaries = opt_.maintain_summaries;
    batch.inline_segments = descs.size() <= detail::kInlineSegments;
    batch.inline_pages = addresses.size() <= detail::kInlinePages;
    auto* dev_descs = reinterpret_cast<detail::append_desc*>(scratch_);
    auto* dev_pages = reinterpret_cast<T**>(scratch_ + pages_offset_);
    status st = status::success;
    if (batch.inline_segments) {
      std::copy(descs.begin(), descs.end(), batch.segs);
    } else if (cudaMemcpyAsync(dev_descs, descs.data(), descs.size() * sizeof(descs[0]), cudaMemcpyHostToDevice,
                               stream) != cudaSuccess) {
      st = fail(status::cuda_error, "append: descriptor upload failed");
    }
    batch.segments = dev_descs;
    if (st == status::success) {
      if (batch.inline_pages) {
        std::copy(addresses.begin(), addresses.end(), batch.pages);
      } else if (cudaMemcpyAsync(dev_pages, addresses.data(), addresses.size() * sizeof(T*),
                                 cudaMemcpyHostToDevice, stream) != cudaSuccess) {
        st = fail(status::cuda_error, "append: page list upload failed");
      }
    }
    batch.new_pages = dev_pages;
    if (st == status::success) {
      const int rows_per_pass = detail::kAppendThreads / (opt_.head_dim * static_cast<int>(sizeof(input_type)) / 16);
      const std::size_t smem = static_cast<std::size_t>(rows_per_pass) * opt_.head_dim *
                               (sizeof(float) + (slice_bounds_ != nullptr ? 2 * sizeof(input_type) : 0));
      detail::append_kernel<T><<<dim3(static_cast<unsigned>(slices), static_cast<unsigned>(opt_.num_kv_heads)),
                                 detail::kAppendThreads, smem, stream>>>(batch);
      if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
        st = fail(status::cuda_error, std::string("append kernel launch failed: ") + cudaGetErrorString(e));
    }
    if (st != status::success) {
      (void)pool_.deallocate(ids);  // nothing was appended: give the pages back
      return st;
    }
    HISPARSE_CUDA_TRY(cudaEventRecord(last_launch_, stream));
    // Commit host state only after a successful launch.
    std::size_t next = 0;
    for (std::size_t i = 0; i < segments.size(); ++i) {
      auto& s = slots_[static_cast<std::size_t>(segments[i].slot)];
      auto& pages = s.pages[static_cast<std::size_t>(layer)];
      const auto& d = descs[i];
      const std::int32_t fresh = (d.start + d.count - 1) / F - d.first_new_slice + 1;
      pages.insert(pages.end(), ids.begin() + static_cast<std::ptrdiff_t>(next),
                   ids.begin() + static_cast<std::ptrdiff_t>(next + static_cast<std::size_t>(std::max(fresh, 0))));
      next += static_cast<std::size_t>(std::max(fresh, 0));
      s.lengths[static_cast<std::size_t>(layer)] += d.count;
    }
    return status::success;
  }

  /// Moves complete slices of (slot, layer) to pinned host memory and frees
  /// their device pages: the host tier (options.max_host_bytes) holds them,
  /// and the page table points kernels at their mapped addresses, so steps
  /// stay exact and pay PCIe reads only for offloaded slices they keep.
  /// Slices already on the host are skipped; only complete slices move (the
  /// last, partial one is where appends write). All or nothing on a bad
  /// slice or a full host tier. Stream-ordered like append_async.
  [[nodiscard]] status offload_async(int slot, int layer, std::span<const std::int32_t> slices,
                                     cudaStream_t stream = nullptr) {
    const slice_list one{slot, layer, slices};
    return move_slices({&one, 1}, page_residency::host, stream);
  }

  /// Brings offloaded slices of (slot, layer) back to device pages (slices
  /// already on the device are skipped); the reverse of offload_async.
  [[nodiscard]] status fetch_async(int slot, int layer, std::span<const std::int32_t> slices,
                                   cudaStream_t stream = nullptr) {
    const slice_list one{slot, layer, slices};
    return move_slices({&one, 1}, page_residency::device, stream);
  }

  /// The same for many (sequence, layer) pairs in one call: every list is
  /// checked before anything moves (all or nothing; a pair listed twice is
  /// invalid_argument), and the copies go out as one batch where the CUDA
  /// runtime has cudaMemcpyBatchAsync and `stream` is not the legacy default
  /// stream, so a step's policy costs a few API calls, not a few per pair.
  [[nodiscard]] status offload_async(std::span<const slice_list> lists, cudaStream_t stream = nullptr) {
    return move_slices(lists, page_residency::host, stream);
  }
  [[nodiscard]] status fetch_async(std::span<const slice_list> lists, cudaStream_t stream = nullptr) {
    return move_slices(lists, page_residency::device, stream);
  }

  /// Drops whole far blocks of (sequence, layer) pairs for good (retention,
  /// runtime/retention.hpp): their pages go back to the pool (or the host
  /// tier), their page-table entries point at one page of NaN K/V, their
  /// block summary rows become NaN, so a decode selection ranks them below
  /// every resident block, and the pair's TopK entries are emptied (a
  /// cached selection may name their slices). Refused before anything
  /// changes: sizes other than the cache's, a block that is not far under
  /// `cfg` (contract::evictable_blocks: it must end before the block holding
  /// the decode window's start), a pair listed twice, or a pair left with
  /// fewer than cfg.top_k_coarse far blocks resident. Within those rules a
  /// decode step of `cfg` never keeps an evicted slice: its coarse top-k
  /// fills with resident blocks (a config that keeps more blocks may reach
  /// an evicted one, and its output is then NaN, never silently wrong).
  /// Blocks already evicted are skipped. Stream-ordered like append_async.
  [[nodiscard]] status evict_async(std::span<const block_list> lists, const SparseAttentionConfig& cfg,
                                   cudaStream_t stream = nullptr) {
    HISPARSE_TRY(check(cfg));
    if (cfg.fine_slice != opt_.fine_slice || cfg.coarse_block != opt_.coarse_block)
      return fail(status::invalid_argument,
                  "evict: the config's slice/block sizes (" + std::to_string(cfg.fine_slice) + "/" +
                      std::to_string(cfg.coarse_block) + ") differ from the cache's (" +
                      std::to_string(opt_.fine_slice) + "/" + std::to_string(opt_.coarse_block) + ")");
    HISPARSE_TRY(check_pairs(lists, "evict"));
    const int spb = opt_.coarse_block / opt_.fine_slice;
    struct pick {
      std::size_t list;
      std::int32_t block;
    };
    std::vector<pick> dropping;
    std::vector<bool> taken, touched(lists.size(), false);  // touched: the list drops a block
    for (std::size_t li = 0; li < lists.size(); ++li) {
      const block_list& l = lists[li];
      const auto& s = slots_[static_cast<std::size_t>(l.slot)];
      const auto layer = static_cast<std::size_t>(l.layer);
      const std::int64_t length = s.lengths[layer];
      const auto far = static_cast<std::int32_t>(
          contract::evictable_blocks(length, cfg.window, opt_.fine_slice, opt_.coarse_block));
      std::int32_t resident = far - s.evicted_slices[layer] / spb;
      taken.assign(static_cast<std::size_t>(far), false);
      for (const std::int32_t b : l.blocks) {
        if (b < 0 || b >= far)
          return fail(status::invalid_argument,
                      "evict: block " + std::to_string(b) + " of sequence " + std::to_string(l.slot) + " layer " +
                          std::to_string(l.layer) + " is not far from its decode window (far blocks at length " +
                          std::to_string(length) + ", window " + std::to_string(cfg.window) + ": [0, " +
                          std::to_string(far) + "))");
        const auto i = static_cast<std::size_t>(b);
        if (taken[i] || s.pages[layer][i * static_cast<std::size_t>(spb)] == kEvictedPage) continue;
        taken[i] = true;
        touched[li] = true;
        dropping.push_back({li, b});
        --resident;
      }
      if (resident < cfg.top_k_coarse)
        return fail(status::invalid_argument,
                    "evict: sequence " + std::to_string(l.slot) + " layer " + std::to_string(l.layer) +
                        " would keep " + std::to_string(resident) + " far blocks, fewer than top_k_coarse (" +
                        std::to_string(cfg.top_k_coarse) + "): a decode step could then keep an evicted slice");
    }
    if (dropping.empty()) return status::success;
    HISPARSE_TRY(order_after_last(stream));
    if (tombstone_ == nullptr) {
      tombstone_ = static_cast<T*>(resource_->allocate(pool_.page_bytes(), stream));
      HISPARSE_CUDA_TRY(cudaMemsetAsync(tombstone_, 0xff, pool_.page_bytes(), stream));  // NaN codes and scales
    }
    const kv::paged_kv_ref<T> view = ref();
    // Device state first (all launches, then the host state): the table, the
    // block rows, the TopK entries.
    std::vector<std::int64_t> table_index;
    table_index.reserve(dropping.size() * static_cast<std::size_t>(spb));
    for (const pick& d : dropping) {
      const block_list& l = lists[d.list];
      for (int j = 0; j < spb; ++j)
        table_index.push_back(view.table_index(view.seq_layer(l.slot, l.layer), std::int64_t{d.block} * spb + j));
    }
    HISPARSE_TRY(patch_table(table_index, [&](std::size_t) { return tombstone_; }, stream, "evict"));
    for (std::size_t i = 0; i < dropping.size(); i += detail::kRowPoison) {
      detail::row_poison p{};
      p.sums = block_sums_;
      p.bounds = block_bounds_;
      p.words = opt_.num_kv_heads * opt_.head_dim;
      p.count = static_cast<int>(std::min<std::size_t>(detail::kRowPoison, dropping.size() - i));
      for (int j = 0; j < p.count; ++j) {
        const pick& d = dropping[i + static_cast<std::size_t>(j)];
        p.row[j] = view.block_row(view.seq_layer(lists[d.list].slot, lists[d.list].layer), d.block, 0);
      }
      detail::poison_rows_kernel<T><<<static_cast<unsigned>(p.count), 128, 0, stream>>>(p);
      HISPARSE_CUDA_TRY(cudaGetLastError());
    }
    if (topk_entries_ != nullptr)
      for (std::size_t li = 0; li < lists.size(); ++li)
        if (touched[li])
          HISPARSE_CUDA_TRY(cudaMemsetAsync(view.topk_entry(view.seq_layer(lists[li].slot, lists[li].layer), 0), 0xff,
                                            sizeof(std::int32_t) * static_cast<std::size_t>(view.topk.stride) *
                                                static_cast<std::size_t>(opt_.num_kv_heads),
                                            stream));
    HISPARSE_CUDA_TRY(cudaEventRecord(last_launch_, stream));
    // Host state, and the pages back to their pools (later work on this
    // stream is ordered after the table update; other streams wait for
    // last_launch_).
    std::vector<page_id> device_pages, host_pages;
    for (const pick& d : dropping) {
      const block_list& l = lists[d.list];
      auto& s = slots_[static_cast<std::size_t>(l.slot)];
      const auto layer = static_cast<std::size_t>(l.layer);
      auto& dev = s.pages[layer];
      auto& host = s.host[layer];
      for (int j = 0; j < spb; ++j) {
        const auto k = static_cast<std::size_t>(d.block) * static_cast<std::size_t>(spb) + static_cast<std::size_t>(j);
        if (dev[k] >= 0) {
          device_pages.push_back(dev[k]);
        } else if (k < host.size() && host[k] != kInvalidPage) {
          host_pages.push_back(host[k]);
          host[k] = kInvalidPage;
          --s.host_slices[layer];
        }
        dev[k] = kEvictedPage;
      }
      s.evicted_slices[layer] += spb;
    }
    HISPARSE_TRY(pool_.deallocate(device_pages));
    if (!host_pages.empty()) HISPARSE_TRY(host_pool_->deallocate(host_pages));
    return status::success;
  }

  /// Opens the host tier and grows it to hold `pages` pages, so the pinning
  /// (the slow part of a first offload) happens when the engine warms up,
  /// not inside a prefill. out_of_memory past max_host_bytes.
  [[nodiscard]] status reserve_host_pages(std::int64_t pages) {
    if (!host_pool_) HISPARSE_TRY(open_host_tier());
    return host_pool_->reserve(pages);
  }

  /// Residency of every slice of (slot, layer) at once, for policies that
  /// scan them all: `on_host(s)` for s in [0, size()), and how many are on
  /// the host. A view of the cache's own table: valid until the next
  /// append, move or free.
  class residency_view {
   public:
    residency_view(std::span<const page_id> device_pages, std::int32_t host_slices, std::int32_t evicted_slices)
        : pages_(device_pages), host_slices_(host_slices), evicted_slices_(evicted_slices) {}
    [[nodiscard]] std::int32_t size() const noexcept { return static_cast<std::int32_t>(pages_.size()); }
    [[nodiscard]] bool on_host(std::int32_t slice) const noexcept {
      return pages_[static_cast<std::size_t>(slice)] == kInvalidPage;
    }
    [[nodiscard]] bool evicted(std::int32_t slice) const noexcept {
      return pages_[static_cast<std::size_t>(slice)] == kEvictedPage;
    }
    [[nodiscard]] std::int32_t host_slices() const noexcept { return host_slices_; }
    [[nodiscard]] std::int32_t evicted_slices() const noexcept { return evicted_slices_; }

   private:
    std::span<const page_id> pages_;
    std::int32_t host_slices_, evicted_slices_;
  };
  [[nodiscard]] residency_view residency_of(int slot, int layer) const {
    const slot_state& s = state_of(slot, layer, "residency_of");
    const auto l = static_cast<std::size_t>(layer);
    return residency_view(s.pages[l], s.host_slices[l], s.evicted_slices[l]);
  }

  /// Where slice `slice` of (slot, layer) lives; throws invalid_argument for
  /// a slice the sequence has no page for.
  [[nodiscard]] page_residency residency(int slot, int layer, std::int32_t slice) const {
    const residency_view v(state_of(slot, layer, "residency").pages[static_cast<std::size_t>(layer)], 0, 0);
    if (slice < 0 || slice >= v.size())
      throw error(status::invalid_argument, "residency: sequence " + std::to_string(slot) + " layer " +
                                                std::to_string(layer) + " has no slice " + std::to_string(slice));
    return v.on_host(slice) ? page_residency::host : v.evicted(slice) ? page_residency::evicted : page_residency::device;
  }

  /// Pages the host tier holds now (0 without one), and has pinned.
  [[nodiscard]] std::int64_t host_pages_used() const noexcept { return host_pool_ ? host_pool_->pages_used() : 0; }
  [[nodiscard]] std::int64_t host_pages_total() const noexcept { return host_pool_ ? host_pool_->pages_total() : 0; }

  [[nodiscard]] std::int64_t length(int slot, int layer) const {
    return state_of(slot, layer, "length").lengths[static_cast<std::size_t>(layer)];
  }
  [[nodiscard]] bool active(int slot) const {
    return slot >= 0 && slot < opt_.max_sequences && slots_[static_cast<std::size_t>(slot)].active;
  }

  /// The view kernels read. Without maintain_summaries the summaries are
  /// never written: the view has none, so a selection refuses it.
  [[nodiscard]] paged_kv_ref<T> ref() const noexcept {
    paged_kv_ref<T> r;
    r.page_table = page_table_;
    const bool sums = opt_.maintain_summaries;
    r.slice_sums = sums ? slice_sums_ : nullptr;
    r.fine = opt_.fine_summary;
    r.fine_rows = !sums                       ? nullptr
                  : slice_sums_bf16_ != nullptr ? static_cast<const void*>(slice_sums_bf16_)
                  : slice_bounds_ != nullptr    ? static_cast<const void*>(slice_bounds_)
                                                : static_cast<const void*>(slice_sums_);
    r.block_sums = sums ? block_sums_ : nullptr;
    r.block_bounds = block_bounds_;
    r.lengths = lengths_;
    r.layers = opt_.num_layers;
    r.kv_heads = opt_.num_kv_heads;
    r.head_dim = opt_.head_dim;
    r.fine_slice = opt_.fine_slice;
    r.coarse_block = opt_.coarse_block;
    r.max_slices = max_slices_;
    r.max_blocks = max_blocks_;
    if (topk_entries_ != nullptr) {
      r.topk.entries = topk_entries_;
      r.topk.slices = opt_.topk_cache_slices;
      r.topk.stride = topk_cache_ref::stride_words(opt_.topk_cache_slices, opt_.head_dim);
    }
    return r;
  }

 private:
  struct slot_state {
    bool active = false;
    std::int64_t reserved = 0;
    std::vector<std::int64_t> lengths;        // [layer]
    std::vector<std::vector<page_id>> pages;  // [layer][slice]: device page, kInvalidPage while on the host
    std::vector<std::vector<page_id>> host;   // [layer][slice]: host page, kInvalidPage (or absent) on the device
    std::vector<std::int32_t> host_slices;    // [layer]: how many slices are on the host
    std::vector<std::int32_t> evicted_slices; // [layer]: how many slices evict_async dropped
  };
  /// A device-page entry for a slice evict_async dropped.
  static constexpr page_id kEvictedPage = -2;

  static paged_kv_cache_options validated(const paged_kv_cache_options& o) {
    auto bad = [](const std::string& why) { throw error(status::invalid_argument, "paged_kv_cache_options." + why); };
    if (o.num_layers < 1) bad("num_layers must be >= 1");
    if (o.num_kv_heads < 1 || o.num_kv_heads > kMaxHeads) bad("num_kv_heads must be in [1, 1024]");
    if (o.head_dim != 64 && o.head_dim != 128 && o.head_dim != 256) bad("head_dim must be 64, 128 or 256");
    if (o.fine_slice < 1 || o.fine_slice > 1024) bad("fine_slice must be in [1, 1024]");
    if (o.coarse_block < o.fine_slice || o.coarse_block % o.fine_slice != 0)
      bad("coarse_block must be a multiple of fine_slice");
    if (o.max_sequences < 1 || o.max_sequences > kMaxSequences)
      bad("max_sequences must be in [1, " + std::to_string(kMaxSequences) + "]");
    if (o.max_context < 1 || o.max_context > kMaxContext) bad("max_context must be in [1, 2^30]");
    if (!is_valid(o.fine_summary))
      bad("fine_summary must be mean, mean_bf16 or key_bounds");
    if (o.topk_cache_slices < 0 || o.topk_cache_slices > kMaxTopK)
      bad("topk_cache_slices must be in [0, 2048] (0: no TopK cache)");
    if (o.fine_summary != fine_summary::mean && !o.maintain_summaries)
      bad("fine_summary " + std::string(name_of(o.fine_summary)) + " needs maintain_summaries");
    if (!is_valid(o.coarse_summary)) bad("coarse_summary must be mean or key_bounds");
    if (o.coarse_summary == coarse_summary::key_bounds && o.fine_summary != fine_summary::key_bounds)
      bad("coarse_summary key_bounds needs fine_summary key_bounds (a block's range is its slices' ranges)");
    return o;
  }

  static page_pool_options pool_options(const paged_kv_cache_options& o) {
    const cache_footprint f = footprint_of(o, sizeof(T));
    page_pool_options p;
    p.page_bytes = f.page_bytes;
    p.chunk_bytes = f.pool_chunk_option;
    p.max_bytes = o.max_pool_bytes;
    p.reserve_pages = o.reserve_pages;
    return p;
  }

  /// A live slot's state, for a layer in range; throws invalid_argument.
  [[nodiscard]] const slot_state& state_of(int slot, int layer, const char* what) const {
    if (check_slot(slot, what) != status::success || layer < 0 || layer >= opt_.num_layers)
      throw error(status::invalid_argument, std::string(what) + ": unknown sequence or layer");
    return slots_[static_cast<std::size_t>(slot)];
  }

  [[nodiscard]] status check_slot(int slot, const char* what) const {
    if (slot < 0 || slot >= opt_.max_sequences || !slots_[static_cast<std::size_t>(slot)].active)
      return fail(status::invalid_argument, std::string(what) + ": unknown sequence id " + std::to_string(slot));
    return status::success;
  }

  /// Every list names a live sequence and a layer in range, and no
  /// (sequence, layer) pair twice.
  template <class List>
  [[nodiscard]] status check_pairs(std::span<const List> lists, const std::string& what) const {
    std::vector<std::pair<int, int>> pairs;
    pairs.reserve(lists.size());
    for (const List& l : lists) {
      HISPARSE_TRY(check_slot(l.slot, what.c_str()));
      if (l.layer < 0 || l.layer >= opt_.num_layers)
        return fail(status::invalid_argument, what + ": layer " + std::to_string(l.layer) + " out of range [0, " +
                                                  std::to_string(opt_.num_layers) + ")");
      pairs.emplace_back(l.slot, l.layer);
    }
    std::sort(pairs.begin(), pairs.end());
    if (std::adjacent_find(pairs.begin(), pairs.end()) != pairs.end())
      return fail(status::invalid_argument, what + ": a (sequence, layer) pair is listed twice in one batch");
    return status::success;
  }

  [[nodiscard]] status move_slices(std::span<const slice_list> lists, page_residency to, cudaStream_t stream) {
    const bool out = to == page_residency::host;
    const std::string what = out ? "offload" : "fetch";
    // Check every list first: a bad one moves nothing.
    HISPARSE_TRY(check_pairs(lists, what));
    struct pick {
      std::size_t list;
      std::int32_t slice;
    };
    std::vector<pick> moving;
    std::vector<bool> taken;
    for (std::size_t li = 0; li < lists.size(); ++li) {
      const slice_list& l = lists[li];
      auto& s = slots_[static_cast<std::size_t>(l.slot)];
      const auto& dev = s.pages[static_cast<std::size_t>(l.layer)];
      const auto& host = s.host[static_cast<std::size_t>(l.layer)];
      const auto complete = static_cast<std::int32_t>(s.lengths[static_cast<std::size_t>(l.layer)] / opt_.fine_slice);
      taken.assign(dev.size(), false);
      for (const std::int32_t slice : l.slices) {
        if (slice < 0 || slice >= complete)
          return fail(status::invalid_argument, what + ": slice " + std::to_string(slice) + " of sequence " +
                                                    std::to_string(l.slot) + " layer " + std::to_string(l.layer) +
                                                    " is not complete (complete slices: [0, " +
                                                    std::to_string(complete) + "))");
        const auto i = static_cast<std::size_t>(slice);
        const bool on_host = i < host.size() && host[i] != kInvalidPage;
        if (on_host == out || taken[i] || dev[i] == kEvictedPage) continue;  // already there, listed twice, or gone
        taken[i] = true;
        moving.push_back({li, slice});
      }
    }
    if (moving.empty()) return status::success;
    if (out && !host_pool_) HISPARSE_TRY(open_host_tier());
    HISPARSE_TRY(order_after_last(stream));
    std::vector<page_id> old(moving.size()), fresh;
    std::vector<std::int64_t> table_index(moving.size());
    for (std::size_t i = 0; i < moving.size(); ++i) {
      const slice_list& l = lists[moving[i].list];
      const auto& s = slots_[static_cast<std::size_t>(l.slot)];
      const auto k = static_cast<std::size_t>(moving[i].slice);
      old[i] = out ? s.pages[static_cast<std::size_t>(l.layer)][k] : s.host[static_cast<std::size_t>(l.layer)][k];
      table_index[i] = (std::int64_t{l.slot} * opt_.num_layers + l.layer) * max_slices_ + moving[i].slice;
    }
    if (out) {
      HISPARSE_TRY(transfer(pool_, *host_pool_, old, table_index, fresh, what, stream));
    } else {
      HISPARSE_TRY(transfer(*host_pool_, pool_, old, table_index, fresh, what, stream));
    }
    for (std::size_t i = 0; i < moving.size(); ++i) {
      const slice_list& l = lists[moving[i].list];
      auto& s = slots_[static_cast<std::size_t>(l.slot)];
      auto& dev = s.pages[static_cast<std::size_t>(l.layer)];
      auto& host = s.host[static_cast<std::size_t>(l.layer)];
      host.resize(dev.size(), kInvalidPage);
      const auto k = static_cast<std::size_t>(moving[i].slice);
      dev[k] = out ? kInvalidPage : fresh[i];
      host[k] = out ? fresh[i] : kInvalidPage;
      s.host_slices[static_cast<std::size_t>(l.layer)] += out ? 1 : -1;
    }
    // The old pages go back at once: later work on this stream is ordered
    // after the copies, and other streams wait for last_launch_.
    return out ? pool_.deallocate(old) : host_pool_->deallocate(old);
  }

  /// Copies pages `old` of one pool to fresh pages of the other (`fresh`)
  /// and points the page table's entries `table_index` at them; the caller
  /// frees `old`. On an error `to` gets its pages back and the host state
  /// still names the old ones.
  template <class From, class To>
  [[nodiscard]] status transfer(page_pool<From>& from, page_pool<To>& to, const std::vector<page_id>& old,
                                const std::vector<std::int64_t>& table_index, std::vector<page_id>& fresh,
                                const std::string& what, cudaStream_t stream) {
    fresh.assign(old.size(), kInvalidPage);
    HISPARSE_TRY(to.allocate(fresh));
    // The copies, merged into runs of consecutive pages within one chunk at
    // both ends (a copy may not span two allocations, even adjacent ones).
    const std::size_t bytes = pool_.page_bytes();
    const auto from_chunk = from.pages_per_chunk(), to_chunk = to.pages_per_chunk();
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<std::size_t> size;
    for (std::size_t i = 0; i < old.size();) {
      std::size_t n = 1;
      while (i + n < old.size() && old[i + n] == old[i] + static_cast<page_id>(n) &&
             fresh[i + n] == fresh[i] + static_cast<page_id>(n) && old[i + n] % from_chunk != 0 &&
             fresh[i + n] % to_chunk != 0)
        ++n;
      src.push_back(from.address(old[i]));
      dst.push_back(to.address(fresh[i]));
      size.push_back(n * bytes);
      i += n;
    }
    status st = copy_batch(dst, src, size, stream, what);
    if (st == status::success)
      st = patch_table(
          table_index, [&](std::size_t k) { return reinterpret_cast<T*>(to.address(fresh[k])); }, stream, what);
    if (st != status::success) {
      // A failed copy or launch leaves the CUDA context unusable.
      (void)to.deallocate(fresh);
      return st;
    }
    HISPARSE_CUDA_TRY(cudaEventRecord(last_launch_, stream));
    return status::success;
  }

  /// Points page-table entries index[k] at page_of(k), in launches of
  /// kTablePatch entries (stream-ordered).
  template <class PageOf>
  [[nodiscard]] status patch_table(const std::vector<std::int64_t>& index, PageOf&& page_of, cudaStream_t stream,
                                   const std::string& what) {
    for (std::size_t i = 0; i < index.size(); i += detail::kTablePatch) {
      detail::table_patch<T> p{};
      p.table = page_table_;
      p.count = static_cast<int>(std::min<std::size_t>(detail::kTablePatch, index.size() - i));
      for (int j = 0; j < p.count; ++j) {
        p.index[j] = index[i + static_cast<std::size_t>(j)];
        p.page[j] = page_of(i + static_cast<std::size_t>(j));
      }
      detail::patch_table_kernel<T><<<1, detail::kTablePatch, 0, stream>>>(p);
      if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
        return fail(status::cuda_error, what + ": page table update failed: " + cudaGetErrorString(e));
    }
    return status::success;
  }

  /// Stream-ordered copies: one cudaMemcpyBatchAsync where the runtime has
  /// it (CUDA 13's signature) and the stream is not the legacy default one
  /// (which that call refuses), else one cudaMemcpyAsync each.
  [[nodiscard]] static status copy_batch(const std::vector<void*>& dst, const std::vector<const void*>& src,
                                         const std::vector<std::size_t>& size, cudaStream_t stream,
                                         const std::string& what) {
    if (dst.empty()) return status::success;
#if CUDART_VERSION >= 13000
    if (stream != nullptr && stream != cudaStreamLegacy && dst.size() > 1) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t first = 0;
      if (const cudaError_t e = cudaMemcpyBatchAsync(dst.data(), src.data(), size.data(), dst.size(), &attr, &first,
                                                     1, stream);
          e != cudaSuccess)
        return fail(status::cuda_error, what + ": page copies failed: " + cudaGetErrorString(e));
      return status::success;
    }
#endif
    for (std::size_t i = 0; i < dst.size(); ++i)
      if (const cudaError_t e = cudaMemcpyAsync(dst[i], src[i], size[i], cudaMemcpyDefault, stream); e != cudaSuccess)
        return fail(status::cuda_error, what + ": page copy failed: " + cudaGetErrorString(e));
    return status::success;
  }

  /// The host tier: kernels read its pages by their host addresses, which
  /// unified addressing makes valid on the device for pinned memory.
  [[nodiscard]] status open_host_tier() {
    if (opt_.max_host_bytes == 0)
      return fail(status::invalid_argument,
                  "offload: the cache has no host tier (set paged_kv_cache_options.max_host_bytes)");
    int device = 0, unified = 0;
    HISPARSE_CUDA_TRY(cudaGetDevice(&device));
    HISPARSE_CUDA_TRY(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device));
    if (unified == 0)
      return fail(status::unsupported, "offload: the device has no unified addressing, so kernels cannot read "
                                         "pinned host pages by their addresses");
    page_pool_options p;
    p.page_bytes = pool_.page_bytes();
    p.chunk_bytes = std::max(opt_.host_chunk_bytes, p.page_bytes);
    p.max_bytes = opt_.max_host_bytes;
    try {
      host_pool_.emplace(host_resource_, p);
    } catch (const error& e) {
      return fail(e.code(), std::string("offload: ") + e.what());
    }
    return status::success;
  }

  [[nodiscard]] status order_after_last(cudaStream_t stream) {
    // Always, even on the same stream: a destroyed stream's handle may be
    // reused by a new one, so handles are never compared.
    HISPARSE_CUDA_TRY(cudaStreamWaitEvent(stream, last_launch_, 0));
    return status::success;
  }

  void release() noexcept {
    // Wait for the last launch, then free on the default stream: the stream
    // of that launch may already be destroyed (its handle is not used here).
    if (last_launch_ != nullptr) (void)cudaEventSynchronize(last_launch_);
    // No caller to report to (a destructor): a buffer the resource refuses
    // to take back, e.g. after a device-side fault, is dropped, not thrown
    // through noexcept into std::terminate (page_pool does the same).
    auto give = [&](auto*& p, std::size_t bytes) {
      try {
        if (p != nullptr) resource_->deallocate(p, bytes, nullptr);
      } catch (...) {
      }
      p = nullptr;
    };
    give(page_table_, table_bytes_);
    give(slice_sums_, slice_bytes_);
    give(slice_sums_bf16_, slice_bf16_bytes_);
    give(slice_bounds_, slice_bounds_bytes_);
    give(block_bounds_, block_bounds_bytes_);
    give(block_sums_, block_bytes_);
    give(block_bases_, block_bytes_);
    give(lengths_, length_bytes_);
    give(counters_, counter_bytes_);
    give(scratch_, scratch_bytes_);
    give(topk_entries_, topk_bytes_);
    if (tombstone_ != nullptr) give(tombstone_, pool_.page_bytes());
    if (last_launch_ != nullptr) cudaEventDestroy(last_launch_);
    last_launch_ = nullptr;
  }

  Resource* resource_;
  paged_kv_cache_options opt_;
  page_pool<Resource> pool_;
  mr::pinned_host_resource host_resource_;
  std::optional<page_pool<mr::pinned_host_resource>> host_pool_;  ///< opened by the first offload
  cudaStream_t stream_ = nullptr;
  cudaEvent_t last_launch_ = nullptr;
  std::int32_t max_slices_ = 0, max_blocks_ = 0;
  std::size_t table_bytes_ = 0, slice_bytes_ = 0, slice_bf16_bytes_ = 0, slice_bounds_bytes_ = 0, block_bytes_ = 0,
              block_bounds_bytes_ = 0, length_bytes_ = 0, counter_bytes_ = 0, scratch_bytes_ = 0, pages_offset_ = 0,
              topk_bytes_ = 0;
  T** page_table_ = nullptr;
  float* slice_sums_ = nullptr;
  __nv_bfloat16* slice_sums_bf16_ = nullptr;
  std::uint32_t* slice_bounds_ = nullptr;
  std::uint32_t* block_bounds_ = nullptr;
  float* block_sums_ = nullptr;
  float* block_bases_ = nullptr;
  std::int32_t* lengths_ = nullptr;
  unsigned* counters_ = nullptr;
  std::byte* scratch_ = nullptr;
  std::int32_t* topk_entries_ = nullptr;
  T* tombstone_ = nullptr;  ///< evicted slices' page: NaN K/V (and scales), made by the first evict_async
  std::vector<slot_state> slots_;
};

}  // namespace hisparse::kv
