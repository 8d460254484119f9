#pragma once
// The device-side views of a paged KV cache: trivially copyable, passed by
// value to kernels (the cuCollections `ref` idiom). The owning host object is
// `paged_kv_cache` (paged_kv_cache.cuh). Every kernel finds a page, a slice
// sum or a length through the accessors here; nothing else re-derives the
// layout.
//
// Layout, and why:
//  * one page = one fine slice (F tokens) of one layer of one sequence, laid
//    out [K|V][kv_head][token][head_dim]. The selection keeps slices, so a
//    kept slice is exactly one page-table lookup, and the K (or V) tile of one
//    KV head is one contiguous run of F * head_dim elements (16 KB for bf16,
//    F = 64, D = 128): every warp load is 512 contiguous bytes of 16-byte
//    vectors, the best case for the attention kernel, which works on one
//    (sequence, KV head) at a time. The window starts on a slice boundary, so
//    it is whole pages too. FP8 pages (kv/fp8.hpp) add one fp32 scale per
//    K and V row after the codes.
//  * the page table holds page base pointers, [sequence][layer][slice]:
//    one 8-byte load per slice, no chunk arithmetic in kernels. A pointer
//    may name pinned host memory (paged_kv_cache::offload_async): kernels
//    read it the same way, over PCIe.
//  * summaries are fp32 running sums kept beside the pages: per slice
//    [sequence][layer][slice][kv_head][head_dim] and per coarse block
//    [sequence][layer][block][kv_head][head_dim]. A block sum is always the
//    ordered sum of its slices' sums (never a running sum), so it is
//    deterministic and independent of how tokens were appended. Means follow
//    by dividing by the token count, which the length gives. A cache may also
//    keep one other fine summary per slice (config.hpp, fine_summary), laid
//    out like the slice sums: the sums rounded to bf16, or each dimension's
//    key range as a `key_bounds_word`; and per block its keys' range, laid
//    out like the block sums (coarse_summary key_bounds).

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "hisparse/config.hpp"
#include "hisparse/core/macros.hpp"

namespace hisparse::kv {

/// The element a fine summary row holds per dimension, and whether a score
/// of it is a mean (divided by the slice's tokens) or a bound (as it is).
template <fine_summary K> struct fine_summary_traits;
template <> struct fine_summary_traits<fine_summary::mean> {
  using element = float;
  static constexpr bool kMean = true;
};
template <> struct fine_summary_traits<fine_summary::mean_bf16> {
  using element = __nv_bfloat16;
  static constexpr bool kMean = true;
};
template <> struct fine_summary_traits<fine_summary::key_bounds> {
  using element = std::uint32_t;  ///< key_bounds_word
  static constexpr bool kMean = false;
};

/// Where a cache's summaries of one (sequence, layer, slice or block, KV
/// head) live: the geometry shared by the summary arrays.
struct summary_layout {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int fine_slice = 0;
  int coarse_block = 0;
  std::int32_t max_slices = 0;  ///< per (sequence, layer)
  std::int32_t max_blocks = 0;  ///< per (sequence, layer)

  /// Positions a sequence can hold: every slice's tokens.
  HISPARSE_HOST_DEVICE constexpr std::int64_t positions() const { return std::int64_t{max_slices} * fine_slice; }
  /// The row of (sequence, layer) in the per-(sequence, layer) arrays.
  HISPARSE_HOST_DEVICE constexpr std::int64_t seq_layer(int seq, int layer) const {
    return std::int64_t{seq} * layers + layer;
  }
  /// Elements between the rows of two consecutive slices (or blocks) of one
  /// KV head: every KV head's row sits between them.
  HISPARSE_HOST_DEVICE constexpr std::int64_t row_stride() const { return std::int64_t{kv_heads} * head_dim; }
  /// Element offset of slice 0 of (sequence, layer), KV head h, in a
  /// per-slice array; slice s is `row_stride()` elements on per slice.
  HISPARSE_HOST_DEVICE constexpr std::int64_t slice_row(std::int64_t seq_layer, int h) const {
    return (seq_layer * max_slices * kv_heads + h) * head_dim;
  }
  HISPARSE_HOST_DEVICE constexpr std::int64_t slice_row(std::int64_t seq_layer, std::int64_t slice, int h) const {
    return ((seq_layer * max_slices + slice) * kv_heads + h) * head_dim;
  }
  /// The same for a per-block array.
  HISPARSE_HOST_DEVICE constexpr std::int64_t block_row(std::int64_t seq_layer, int h) const {
    return (seq_layer * max_blocks * kv_heads + h) * head_dim;
  }
  HISPARSE_HOST_DEVICE constexpr std::int64_t block_row(std::int64_t seq_layer, std::int64_t block, int h) const {
    return ((seq_layer * max_blocks + block) * kv_heads + h) * head_dim;
  }
  /// The page-table entry of (sequence, layer, slice).
  HISPARSE_HOST_DEVICE constexpr std::int64_t table_index(std::int64_t seq_layer, std::int64_t slice) const {
    return seq_layer * max_slices + slice;
  }
};

/// A cache's TopK entries (config.hpp, refresh_rule): per (sequence, layer,
/// KV head), apart from the pages, two control words and two entries (the
/// one steps read, the other a late rule's next). Control: [0] which entry
/// is current (bit 0), [1] 1 where a late selection wrote the other for
/// the next step (the step's attention makes it current once every reader
/// is done), then two unused words. An entry is int32 words: [0] the
/// position of the query that selected (-1: empty), [1] its kept count,
/// [2] the selecting config's fingerprint (decode_selection.cuh), [3]
/// unused, then `slices` kept slice ids (ascending; padded to 4 words),
/// then head_dim fp32 words: the selecting query's group sum. Read and
/// written by the decode selection, and by the attention of a late rule.
struct topk_cache_ref {
  static constexpr int kHeader = 4;
  static constexpr int kControl = 4;
  std::int32_t* entries = nullptr;  ///< [sequences][layers][kv_heads][stride]; null: the cache keeps none
  int slices = 0;                   ///< kept slices an entry holds at most
  int stride = 0;                   ///< int32 words per (sequence, layer, KV head): control and two entries

  /// Words of one entry for `slices` kept slices and head_dim `dim`.
  [[nodiscard]] HISPARSE_HOST_DEVICE static constexpr int words(int slices, int dim) {
    return kHeader + (slices + 3) / 4 * 4 + dim;
  }
  /// Words per (sequence, layer, KV head).
  [[nodiscard]] HISPARSE_HOST_DEVICE static constexpr int stride_words(int slices, int dim) {
    return kControl + 2 * words(slices, dim);
  }
  /// Offset (words) of the kept list and of the group sum in an entry.
  [[nodiscard]] HISPARSE_HOST_DEVICE static constexpr int kept_offset() { return kHeader; }
  [[nodiscard]] HISPARSE_HOST_DEVICE constexpr int query_offset() const { return kHeader + (slices + 3) / 4 * 4; }
  /// Entry `which` (0 or 1) of the control words at `control`.
  [[nodiscard]] HISPARSE_HOST_DEVICE std::int32_t* entry(std::int32_t* control, int which) const {
    return control + kControl + which * ((stride - kControl) / 2);
  }
};

/// What a selection reads of a cache: the summaries, the lengths and their
/// layout (no pages, so no element type), and the TopK entries it may
/// reuse and rewrite.
struct summary_ref : summary_layout {
  const float* slice_sums = nullptr;   ///< [sequences][layers][max_slices][kv_heads][head_dim]
  const float* block_sums = nullptr;   ///< [sequences][layers][max_blocks][kv_heads][head_dim]
  const std::int32_t* lengths = nullptr;  ///< [sequences][layers], tokens stored
  /// The cache's other fine summary (fine_summary_traits<fine>::element,
  /// laid out like slice_sums); for `mean` the slice sums themselves.
  const void* fine_rows = nullptr;
  hisparse::fine_summary fine = hisparse::fine_summary::mean;
  /// Each block's key range (key_bounds_word per dimension, laid out like
  /// block_sums); null unless the cache keeps it (coarse_summary key_bounds).
  const std::uint32_t* block_bounds = nullptr;

  /// Whether the decode fine filter can score `kind` from this cache.
  [[nodiscard]] HISPARSE_HOST_DEVICE constexpr bool keeps(hisparse::fine_summary kind) const {
    return kind == hisparse::fine_summary::mean || (kind == fine && fine_rows != nullptr);
  }
  /// Whether the coarse filter can score `kind` from this cache: block
  /// bounds, and the slice bounds a partial block's range comes from.
  [[nodiscard]] HISPARSE_HOST_DEVICE constexpr bool keeps(hisparse::coarse_summary kind) const {
    return kind == hisparse::coarse_summary::mean || (block_bounds != nullptr && keeps(fine_summary::key_bounds));
  }
  /// The rows of `kind` (keeps(kind)), as their element type.
  template <hisparse::fine_summary K>
  [[nodiscard]] HISPARSE_HOST_DEVICE const typename fine_summary_traits<K>::element* rows() const {
    if constexpr (K == hisparse::fine_summary::mean) return slice_sums;
    return static_cast<const typename fine_summary_traits<K>::element*>(fine_rows);
  }
  [[nodiscard]] HISPARSE_HOST_DEVICE std::int32_t length(int seq, int layer) const {
    return lengths[seq_layer(seq, layer)];
  }
  topk_cache_ref topk{};
  /// The TopK control words of (sequence, layer) row `seq_layer`, KV head h
  /// (topk_cache_ref::entry finds its entries).
  [[nodiscard]] HISPARSE_HOST_DEVICE std::int32_t* topk_entry(std::int64_t seq_layer, int h) const {
    return topk.entries + (seq_layer * kv_heads + h) * topk.stride;
  }
};

/// The pages too: what an attention kernel reads.
template <class T>
struct paged_kv_ref : summary_ref {
  T* const* page_table = nullptr;  ///< [sequences][layers][max_slices]

  /// Elements of one K (or V) tile of one KV head inside a page.
  HISPARSE_HOST_DEVICE constexpr std::int64_t head_tile_elems() const {
    return std::int64_t{fine_slice} * head_dim;
  }
  /// Elements in one page (K and V of every KV head).
  HISPARSE_HOST_DEVICE constexpr std::int64_t page_elems() const { return 2 * std::int64_t{kv_heads} * head_tile_elems(); }
  /// Offset of KV head h's V tile from its K tile.
  HISPARSE_HOST_DEVICE constexpr std::int64_t value_offset() const { return std::int64_t{kv_heads} * head_tile_elems(); }
  HISPARSE_HOST_DEVICE const T* page(std::int64_t seq_layer, std::int64_t slice) const {
    return page_table[table_index(seq_layer, slice)];
  }
  /// First key of `slice` for KV head h: F rows of head_dim contiguous elements.
  HISPARSE_HOST_DEVICE const T* key_tile(int seq, int layer, std::int64_t slice, int h) const {
    return page(seq_layer(seq, layer), slice) + std::int64_t{h} * head_tile_elems();
  }
  HISPARSE_HOST_DEVICE const T* value_tile(int seq, int layer, std::int64_t slice, int h) const {
    return key_tile(seq, layer, slice, h) + value_offset();
  }
  /// FP8 pages (kv/fp8.hpp) end in one fp32 scale per row: [K|V][kv_head]
  /// [token], past the codes. Offset (floats from the page's scale area) of
  /// KV head h's value scales from its key scales.
  HISPARSE_HOST_DEVICE constexpr std::int64_t value_scale_offset() const { return std::int64_t{kv_heads} * fine_slice; }
  /// The F key scales of `slice` for KV head h (fp8 pages only).
  HISPARSE_HOST_DEVICE const float* key_scales(const T* page, int h) const {
    return reinterpret_cast<const float*>(page + page_elems()) + std::int64_t{h} * fine_slice;
  }
  [[nodiscard]] HISPARSE_HOST_DEVICE const summary_ref& summaries() const { return *this; }
};

static_assert(std::is_trivially_copyable_v<paged_kv_ref<float>>);

}  // namespace hisparse::kv
