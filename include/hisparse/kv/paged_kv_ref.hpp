#pragma once
// The device-side view of a paged KV cache: trivially copyable, passed by
// value to kernels (the cuCollections `ref` idiom). The owning host object is
// `paged_kv_cache` (paged_kv_cache.cuh).
//
// Layout, and why:
//  * one page = one fine slice (F tokens) of one layer of one sequence, laid
//    out [K|V][kv_head][token][head_dim]. The selection keeps slices, so a
//    kept slice is exactly one page-table lookup, and the K (or V) tile of one
//    KV head is one contiguous run of F * head_dim elements (16 KB for bf16,
//    F = 64, D = 128): every warp load is 512 contiguous bytes of 16-byte
//    vectors, the best case for the attention kernel, which works on one
//    (sequence, KV head) at a time. The window starts on a slice boundary, so
//    it is whole pages too.
//  * the page table holds page base pointers, [sequence][layer][slice]:
//    one 8-byte load per slice, no chunk arithmetic in kernels.
//  * summaries are fp32 running sums kept beside the pages: per slice
//    [sequence][layer][slice][kv_head][head_dim] and per coarse block
//    [sequence][layer][block][kv_head][head_dim]. A block sum is always the
//    ordered sum of its slices' sums (never a running sum), so it is
//    deterministic and independent of how tokens were appended. Means follow
//    by dividing by the token count, which the length gives. On request the
//    cache also keeps each slice sum rounded to bf16, for selection policies
//    that read those instead (half the bytes), and for the key_bounds policy
//    each slice's key range: per dimension one `key_bounds_word` (minimum and
//    maximum rounded outward to bf16), laid out like the slice sums.

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "hisparse/core/macros.hpp"

namespace hisparse::kv {

template <class T>
struct paged_kv_ref {
  T* const* page_table = nullptr;      ///< [max_sequences][layers][max_slices]
  const float* slice_sums = nullptr;   ///< [max_sequences][layers][max_slices][kv_heads][head_dim]
  /// The same rounded to bf16 (round to nearest even); null unless the cache
  /// keeps them (paged_kv_cache_options::bf16_slice_sums).
  const __nv_bfloat16* slice_sums_bf16 = nullptr;
  /// Per dimension, the slice's key minimum and maximum (`key_bounds_word`),
  /// laid out like slice_sums; null unless the cache keeps them
  /// (paged_kv_cache_options::slice_key_bounds).
  const std::uint32_t* slice_bounds = nullptr;
  const float* block_sums = nullptr;   ///< [max_sequences][layers][max_blocks][kv_heads][head_dim]
  const std::int32_t* lengths = nullptr;  ///< [max_sequences][layers], tokens stored
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int fine_slice = 0;
  int coarse_block = 0;
  std::int32_t max_slices = 0;  ///< per (sequence, layer)
  std::int32_t max_blocks = 0;  ///< per (sequence, layer)

  /// Elements of one K (or V) tile of one KV head inside a page.
  HISPARSE_HOST_DEVICE constexpr std::int64_t head_tile_elems() const {
    return std::int64_t{fine_slice} * head_dim;
  }
  /// Elements in one page (K and V of every KV head).
  HISPARSE_HOST_DEVICE constexpr std::int64_t page_elems() const {
    return 2 * std::int64_t{kv_heads} * head_tile_elems();
  }
  HISPARSE_HOST_DEVICE constexpr std::int64_t table_index(int seq, int layer, std::int64_t slice) const {
    return (std::int64_t{seq} * layers + layer) * max_slices + slice;
  }
  /// First key of `slice` for KV head h: F rows of head_dim contiguous elements.
  HISPARSE_HOST_DEVICE const T* key_tile(int seq, int layer, std::int64_t slice, int h) const {
    return page_table[table_index(seq, layer, slice)] + std::int64_t{h} * head_tile_elems();
  }
  HISPARSE_HOST_DEVICE const T* value_tile(int seq, int layer, std::int64_t slice, int h) const {
    return page_table[table_index(seq, layer, slice)] + (std::int64_t{kv_heads} + h) * head_tile_elems();
  }
  HISPARSE_HOST_DEVICE const float* slice_sum(int seq, int layer, std::int64_t slice, int h) const {
    return slice_sums + (table_index(seq, layer, slice) * kv_heads + h) * head_dim;
  }
  HISPARSE_HOST_DEVICE const float* block_sum(int seq, int layer, std::int64_t block, int h) const {
    return block_sums + (((std::int64_t{seq} * layers + layer) * max_blocks + block) * kv_heads + h) * head_dim;
  }
};

static_assert(std::is_trivially_copyable_v<paged_kv_ref<float>>);

}  // namespace hisparse::kv
