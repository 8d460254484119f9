#pragma once
// Device memory of a model's sparse attention, predicted on the host from
// the same arithmetic the cache and the operators allocate by
// (kv/cache_footprint.hpp, the operators' workspace_bytes): the KV pages of
// every request at its context, the cache's metadata, and the decode and
// prefill workspaces, against a device limit. What does not fit is said in
// pages: how many would have to live elsewhere (host offload) for the rest
// to fit, whether a host tier holds them, and the per-(sequence, layer)
// device budget of a residency_policy that keeps the rest resident -- or,
// instead of a host tier, how many far blocks each (sequence, layer) keeps
// under retention (runtime/retention.hpp), which drops the rest.
//
// One cache holds every layer (paged_kv_cache_options::num_layers); the
// operators run one layer at a time, so one decode and one prefill
// workspace serve them all, unless the decode step is a model_decode (one
// workspace part per layer, so each layer's kept slices outlive the step).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/cache_footprint.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "hisparse/runtime/hierarchical_prefill.cuh"
#include "hisparse/runtime/model_decode.cuh"

namespace hisparse {

/// The attention shape of a whole model.
struct model_shape {
  int layers = 28;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
};

struct memory_budget_inputs {
  model_shape model{};
  SparseAttentionConfig config{};
  /// Tokens each request will hold at most (prompt and generated): one cache
  /// slot each; the cache is sized for the longest.
  std::vector<std::int64_t> contexts;
  std::size_t elem_bytes = 2;  ///< K/V element: 2 for bf16/fp16
  std::size_t chunk_bytes = std::size_t{1} << 20;  ///< the page pool's chunk
  std::int32_t prefill_tokens = 16384;  ///< the largest prefill call (its selection lists)
  int num_sms = 132;                    ///< the GPU's (sm_90-class), for the decode attention's plan
  std::size_t device_limit = 0;         ///< bytes the whole must fit
  std::size_t host_limit = 0;           ///< pinned host bytes offloaded pages may take
  bool whole_model_decode = false;      ///< the decode step is a model_decode over every layer
};

struct memory_budget {
  kv::cache_footprint footprint{};
  std::int64_t pages = 0;            ///< every request at its context, every layer
  std::size_t page_memory = 0;       ///< those pages in whole pool chunks
  std::size_t metadata = 0;          ///< the cache's tables and summaries
  std::size_t decode_workspace = 0;  ///< hierarchical_decode (or model_decode) at the whole batch
  std::size_t prefill_workspace = 0; ///< hierarchical_prefill at prefill_tokens
  std::size_t device_limit = 0;
  std::size_t host_limit = 0;
  int sequences = 0;  ///< requests (cache slots)
  int layers = 0;
  std::int32_t slices_per_block = 0;  ///< the config's
  std::int32_t top_k_coarse = 0;      ///< the config's: the far blocks retention must keep
  std::int32_t near_slices = 0;       ///< most slices of a sequence from the window's block on (never evicted)

  [[nodiscard]] std::size_t total() const { return page_memory + metadata + decode_workspace + prefill_workspace; }
  [[nodiscard]] bool fits() const { return total() <= device_limit; }
  /// Bytes left for pages once metadata and workspaces are placed (0 if none).
  [[nodiscard]] std::size_t page_budget() const {
    const std::size_t fixed = metadata + decode_workspace + prefill_workspace;
    return device_limit > fixed ? device_limit - fixed : 0;
  }
  /// Pages that fit the page budget, in whole chunks.
  [[nodiscard]] std::int64_t resident_pages() const {
    return static_cast<std::int64_t>(page_budget() / footprint.chunk_bytes) * footprint.pages_per_chunk;
  }
  /// Pages that must live elsewhere (host memory) for the rest to fit; 0
  /// when everything fits. The metadata and workspaces always stay.
  [[nodiscard]] std::int64_t pages_off_device() const { return std::max<std::int64_t>(0, pages - resident_pages()); }
  [[nodiscard]] std::size_t host_bytes() const {
    return static_cast<std::size_t>(pages_off_device()) * footprint.page_bytes;
  }
  /// Whether the pages the device cannot hold fit the host tier (host
  /// offload keeps every step exact: paged_kv_cache::offload_async).
  [[nodiscard]] bool fits_with_offload() const {
    return total() - page_memory <= device_limit && host_bytes() <= host_limit;
  }
  /// The residency_policy budget (device_slices) that shares the resident
  /// pages evenly over every (sequence, layer).
  [[nodiscard]] std::int32_t device_slices_each() const {
    const std::int64_t rows = std::int64_t{sequences} * layers;
    return rows > 0 ? static_cast<std::int32_t>(std::min<std::int64_t>(resident_pages() / rows, footprint.max_slices))
                    : 0;
  }
  /// Retention's budget (retention_options::device_blocks): the far blocks
  /// each (sequence, layer) keeps when the resident pages are shared evenly
  /// and the slices from the window's block on stay.
  [[nodiscard]] std::int32_t retained_blocks_each() const {
    return slices_per_block > 0 ? std::max(0, device_slices_each() - near_slices) / slices_per_block : 0;
  }
  /// Whether retention fits without a host tier: every (sequence, layer)
  /// keeps at least top_k_coarse far blocks (evict_async's floor). Lossy:
  /// the dropped blocks are never attended again.
  [[nodiscard]] bool fits_with_retention() const {
    return total() - page_memory <= device_limit && (pages_off_device() == 0 || retained_blocks_each() >= top_k_coarse);
  }
};

/// The budget of `in`; fails with the reason on an invalid model, config or
/// context (a context over the config's limits, no request).
[[nodiscard]] inline status plan_memory(const memory_budget_inputs& in, memory_budget& out) {
  auto bad = [](const std::string& why) { return fail(status::invalid_argument, "memory budget: " + why); };
  const model_shape& m = in.model;
  if (m.layers < 1 || m.num_kv_heads < 1 || m.num_q_heads < m.num_kv_heads || m.num_q_heads % m.num_kv_heads != 0)
    return bad("model shape (layers >= 1, num_q_heads a multiple of num_kv_heads)");
  if (in.contexts.empty()) return bad("no request");
  if (in.contexts.size() > static_cast<std::size_t>(kv::kMaxSequences))
    return bad(std::to_string(in.contexts.size()) + " requests; a cache holds at most " +
               std::to_string(kv::kMaxSequences) + " sequences");
  if (in.elem_bytes != 1 && in.elem_bytes != 2 && in.elem_bytes != 4) return bad("elem_bytes must be 1, 2 or 4");
  HISPARSE_TRY(check(in.config));
  std::int64_t longest = 0;
  for (const std::int64_t c : in.contexts) {
    if (c < 1 || c > kMaxContext) return bad("a context of " + std::to_string(c) + " tokens");
    longest = std::max(longest, c);
  }
  const attention_shape shape{m.num_q_heads, m.num_kv_heads, m.head_dim};
  HISPARSE_TRY(check_problem(in.config, shape, in.contexts));

  kv::paged_kv_cache_options o;
  o.num_layers = m.layers;
  o.num_kv_heads = m.num_kv_heads;
  o.head_dim = m.head_dim;
  o.fine_slice = in.config.fine_slice;
  o.coarse_block = in.config.coarse_block;
  o.max_sequences = static_cast<int>(in.contexts.size());
  o.max_context = longest;
  o.chunk_bytes = in.chunk_bytes;
  o.fine_summary = in.config.fine_summary;
  o.coarse_summary = in.config.coarse_summary;
  memory_budget b;
  b.footprint = kv::footprint_of(o, in.elem_bytes);
  for (const std::int64_t c : in.contexts) b.pages += b.footprint.sequence_pages(c);
  b.page_memory = b.footprint.page_memory(b.pages);
  b.metadata = b.footprint.metadata_bytes();
  b.device_limit = in.device_limit;
  b.host_limit = in.host_limit;
  b.sequences = static_cast<int>(in.contexts.size());
  b.layers = m.layers;
  b.slices_per_block = in.config.slices_per_block();
  b.top_k_coarse = in.config.top_k_coarse;
  // From the window's block to the end: at most the blocks W + F - 1
  // tokens and the last token reach, two at the defaults.
  b.near_slices = ((in.config.window + in.config.fine_slice - 1) / in.config.coarse_block + 2) * b.slices_per_block;

  // The operators' own sizing, on shape-only arguments (nothing is read):
  // a cache view with this layout and placeholder pointers.
  static __nv_bfloat16 placeholder alignas(16)[8]{};
  static __nv_bfloat16* table[1]{placeholder};
  static std::int32_t lengths[1]{};
  kv::paged_kv_ref<__nv_bfloat16> cache;
  static_cast<kv::summary_layout&>(cache) =
      kv::summary_layout{m.layers, m.num_kv_heads, m.head_dim, o.fine_slice, o.coarse_block,
                         b.footprint.max_slices, b.footprint.max_blocks};
  cache.page_table = table;
  cache.lengths = lengths;
  cache.slice_sums = cache.block_sums = reinterpret_cast<const float*>(placeholder);
  cache.fine = o.fine_summary;
  cache.fine_rows = placeholder;
  if (o.coarse_summary == coarse_summary::key_bounds)
    cache.block_bounds = reinterpret_cast<const std::uint32_t*>(placeholder);
  const int batch = static_cast<int>(in.contexts.size());
  const auto step = shape_only_decode_arguments(cache, batch, m.num_q_heads);
  if (in.whole_model_decode) {
    model_decode_arguments<__nv_bfloat16> all;
    all.queries = step.queries;
    all.slots = step.slots;
    all.batch = batch;
    all.layers = m.layers;
    all.num_q_heads = m.num_q_heads;
    all.cache = cache;
    all.out = step.out;
    HISPARSE_TRY(model_decode<__nv_bfloat16>(in.config).workspace_bytes(all, in.num_sms,
                                                                                   b.decode_workspace));
  } else {
    HISPARSE_TRY(hierarchical_decode<__nv_bfloat16>(in.config).workspace_bytes(step, in.num_sms,
                                                                                b.decode_workspace));
  }
  if (in.prefill_tokens > 0) {
    // A call of prefill_tokens positions from any boundary, cut by at most
    // one tile more per sequence.
    const int tiles = (in.prefill_tokens + in.config.query_tile - 1) / in.config.query_tile + batch;
    HISPARSE_TRY(hierarchical_prefill<__nv_bfloat16>(in.config).workspace_bytes(
        shape_only_prefill_arguments(cache, tiles, m.num_q_heads, batch), b.prefill_workspace));
  }
  out = b;
  return status::success;
}

}  // namespace hisparse
