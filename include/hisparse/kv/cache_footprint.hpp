#pragma once
// What a paged KV cache allocates, as arithmetic on its options, so a memory
// budget (runtime/memory_budget.cuh) can predict it without a device and
// the cache (paged_kv_cache.cuh) allocates exactly what is predicted: both
// read the sizes here.
//
// Two kinds of memory:
//  * pages, from the page pool: one page is one fine slice of one layer of
//    one sequence, K and V of every KV head; the pool carves whole pages
//    from chunks of `chunk_bytes` (rounded down to whole pages), so page
//    memory grows a chunk at a time;
//  * metadata, allocated once for every slot at its full context: the page
//    table, the fp32 slice and block sums (blocks twice: sums and bases),
//    the optional second fine summary, lengths, the append's block counters
//    and its scratch (descriptors and the new pages' pointers), and the
//    optional TopK cache entries.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "hisparse/config.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::kv {

/// Sequence slots a cache holds at most.
inline constexpr int kMaxSequences = 4096;

struct paged_kv_cache_options {
  int num_layers = 1;
  int num_kv_heads = 8;
  int head_dim = 128;
  int fine_slice = 64;       ///< F: tokens per page and per slice summary
  int coarse_block = 1024;   ///< C: tokens per block summary; a multiple of F
  int max_sequences = 8;     ///< sequence slots, at most kMaxSequences
  std::int64_t max_context = 262144;  ///< largest reservation of one sequence
  std::size_t chunk_bytes = std::size_t{1} << 20;  ///< page pool chunk size
  std::size_t max_pool_bytes = SIZE_MAX;           ///< cap on page memory
  std::int64_t reserve_pages = 0;                  ///< pages to carve up front
  bool maintain_summaries = true;  ///< off only for dense-only use, or to measure their cost
  /// The fine summary kept besides the fp32 slice sums, for configs that
  /// name it (config.hpp): `mean` keeps nothing more; `mean_bf16` the sums
  /// rounded to bf16 (half their memory again); `key_bounds` each
  /// dimension's key range (as much memory as the sums).
  hisparse::fine_summary fine_summary = hisparse::fine_summary::mean;
  /// The coarse summary kept besides the fp32 block sums: `key_bounds`
  /// keeps each block's key range (as much memory as the block sums; the
  /// slices' ranges it comes from need fine_summary key_bounds).
  hisparse::coarse_summary coarse_summary = hisparse::coarse_summary::mean;
  /// Kept slices a TopK cache entry holds (config.hpp, refresh_rule): at
  /// least the top_k_fine of a config that reuses selections; 0 keeps no
  /// entries. Two entries per (sequence, layer, KV head) (the current one
  /// and a late rule's next), ~1.2 KB at 16 slices and head_dim 128.
  int topk_cache_slices = 0;
  /// Pinned host memory complete pages may move to (paged_kv_cache::
  /// offload_async); 0: no host tier.
  std::size_t max_host_bytes = 0;
  std::size_t host_chunk_bytes = std::size_t{64} << 20;  ///< the host tier's pinned allocation unit
};

namespace detail {

/// One segment as the append kernel sees it (all int32: positions are below
/// 2^30 by construction).
struct append_desc {
  std::int32_t seq;
  std::int32_t start;            ///< position of the first new token
  std::int32_t count;
  std::int32_t src_row;
  std::int32_t first_slice;      ///< slice of the first new token
  std::int32_t first_new_slice;  ///< first slice that gets a fresh page
  std::int32_t new_page_prefix;  ///< index of its first fresh page in the batch's page list
  std::int32_t slice_prefix;     ///< CTAs (slices) of the segments before this one
  std::int32_t block_prefix;     ///< touched blocks of the segments before this one
};

}  // namespace detail

/// The sizes a cache with given options allocates (element size
/// `elem_bytes`: 1 for fp8 e4m3, 2 for bf16/fp16, 4 for fp32).
struct cache_footprint {
  std::int32_t max_slices = 0;  ///< per (sequence, layer)
  std::int32_t max_blocks = 0;
  int fine_slice = 0;
  int num_layers = 0;
  std::size_t page_bytes = 0;       ///< one page, aligned to mr::kAlignment
  std::int64_t pages_per_chunk = 0;
  std::size_t chunk_bytes = 0;      ///< what the pool allocates at a time: pages_per_chunk pages
  std::size_t pool_chunk_option = 0;  ///< the pool's requested chunk size (at least one page)
  // Metadata, one allocation each.
  std::size_t table_bytes = 0, slice_sum_bytes = 0, slice_bf16_bytes = 0, slice_bounds_bytes = 0,
              block_sum_bytes = 0, block_bounds_bytes = 0, length_bytes = 0, counter_bytes = 0, scratch_bytes = 0,
              topk_cache_bytes = 0;
  std::size_t pages_offset = 0;  ///< where the scratch's page pointers start

  /// Every metadata allocation (block sums twice: sums and bases).
  [[nodiscard]] constexpr std::size_t metadata_bytes() const {
    return table_bytes + slice_sum_bytes + slice_bf16_bytes + slice_bounds_bytes + 2 * block_sum_bytes +
           block_bounds_bytes +
           length_bytes + counter_bytes + scratch_bytes + topk_cache_bytes;
  }
  /// Pages one (sequence, layer) holds at `tokens` tokens.
  [[nodiscard]] constexpr std::int64_t pages_for_tokens(std::int64_t tokens) const {
    return (tokens + fine_slice - 1) / fine_slice;
  }
  /// Pages one sequence holds at `tokens` tokens, every layer.
  [[nodiscard]] constexpr std::int64_t sequence_pages(std::int64_t tokens) const {
    return pages_for_tokens(tokens) * num_layers;
  }
  /// Page memory the pool holds for `pages` pages in use, packed into whole
  /// chunks (the pool never frees a chunk while the cache lives).
  [[nodiscard]] constexpr std::size_t page_memory(std::int64_t pages) const {
    const std::int64_t chunks = (pages + pages_per_chunk - 1) / pages_per_chunk;
    return static_cast<std::size_t>(chunks) * chunk_bytes;
  }
};

/// The footprint of a cache built with `o` (validated by the cache) storing
/// elements of `elem_bytes` bytes.
[[nodiscard]] constexpr cache_footprint footprint_of(const paged_kv_cache_options& o, std::size_t elem_bytes) {
  constexpr std::size_t kPointer = sizeof(void*);
  auto align = [](std::size_t b) { return (b + mr::kAlignment - 1) / mr::kAlignment * mr::kAlignment; };
  cache_footprint f;
  f.fine_slice = o.fine_slice;
  f.num_layers = o.num_layers;
  f.max_slices = static_cast<std::int32_t>((o.max_context + o.fine_slice - 1) / o.fine_slice);
  f.max_blocks = static_cast<std::int32_t>((o.max_context + o.coarse_block - 1) / o.coarse_block);
  // One-byte elements are fp8 codes, with one fp32 scale per K and V row (kv/fp8.hpp).
  const std::size_t rows = 2 * static_cast<std::size_t>(o.num_kv_heads) * o.fine_slice;
  f.page_bytes = align(rows * o.head_dim * elem_bytes + (elem_bytes == 1 ? rows * sizeof(float) : 0));
  f.pool_chunk_option = std::max(o.chunk_bytes, f.page_bytes);
  f.pages_per_chunk = std::max<std::int64_t>(1, static_cast<std::int64_t>(f.pool_chunk_option / f.page_bytes));
  f.chunk_bytes = static_cast<std::size_t>(f.pages_per_chunk) * f.page_bytes;
  const auto seq_layers = static_cast<std::size_t>(std::int64_t{o.max_sequences} * o.num_layers);
  const auto vec = static_cast<std::size_t>(std::int64_t{o.num_kv_heads} * o.head_dim);
  const auto slices = static_cast<std::size_t>(f.max_slices), blocks = static_cast<std::size_t>(f.max_blocks);
  f.table_bytes = seq_layers * slices * kPointer;
  f.slice_sum_bytes = seq_layers * slices * vec * sizeof(float);
  f.block_sum_bytes = seq_layers * blocks * vec * sizeof(float);
  f.slice_bf16_bytes = o.fine_summary == fine_summary::mean_bf16 ? seq_layers * slices * vec * 2 : 0;
  f.slice_bounds_bytes = o.fine_summary == fine_summary::key_bounds ? seq_layers * slices * vec * 4 : 0;
  f.block_bounds_bytes = o.coarse_summary == coarse_summary::key_bounds ? seq_layers * blocks * vec * 4 : 0;
  f.length_bytes = seq_layers * sizeof(std::int32_t);
  f.topk_cache_bytes = o.topk_cache_slices > 0 ? seq_layers * static_cast<std::size_t>(o.num_kv_heads) *
                                                     topk_cache_ref::stride_words(o.topk_cache_slices, o.head_dim) *
                                                     sizeof(std::int32_t)
                                               : 0;
  f.counter_bytes = static_cast<std::size_t>(o.max_sequences) * blocks * static_cast<std::size_t>(o.num_kv_heads) *
                    sizeof(unsigned);
  f.pages_offset = align(static_cast<std::size_t>(o.max_sequences) * sizeof(detail::append_desc));
  f.scratch_bytes = f.pages_offset + static_cast<std::size_t>(o.max_sequences) * slices * kPointer;
  return f;
}

}  // namespace hisparse::kv
