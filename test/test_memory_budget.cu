// The memory budget on the host: the reference deployment's figures from
// the footprint arithmetic (checked against independent products), what
// fits a 48 GB card, and bad input. (test_gpu_kv checks the footprint
// against what a real cache allocates.)
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "hisparse/runtime/memory_budget.cuh"

using namespace hisparse;

TEST_CASE("8 x 256K of the 7B model: pages, metadata and what a 48 GB card holds", "[runtime][budget]") {
  memory_budget_inputs in;  // 28 layers, 32/8 heads, d128, standard
  in.contexts.assign(8, 262144);
  in.device_limit = std::size_t{48} << 30;
  memory_budget b;
  REQUIRE(plan_memory(in, b) == status::success);
  // One request's K/V in bf16: 28 x 2 x 8 x 128 x 2 B x 262144 = 30.1 GB.
  const std::size_t per_request = std::size_t{28} * 2 * 8 * 128 * 2 * 262144;
  CHECK(per_request == 30064771072ull);
  CHECK(b.footprint.page_bytes == 2 * 8 * 64 * 128 * 2);
  CHECK(b.pages == std::int64_t{8} * 28 * 4096);
  CHECK(b.page_memory == 8 * per_request);  // 1 MiB chunks hold 4 pages exactly
  // Metadata: fp32 slice sums dominate: 8 x 28 x 4096 slices x 8 x 128 x 4 B.
  CHECK(b.footprint.slice_sum_bytes == std::size_t{8} * 28 * 4096 * 1024 * 4);
  CHECK(b.footprint.block_sum_bytes == std::size_t{8} * 28 * 256 * 1024 * 4);
  CHECK(b.footprint.table_bytes == std::size_t{8} * 28 * 4096 * 8);
  CHECK(b.metadata > b.footprint.slice_sum_bytes);
  CHECK(b.metadata < b.footprint.slice_sum_bytes * 115 / 100);
  CHECK(b.decode_workspace > 0);
  CHECK(b.prefill_workspace >= std::size_t{16384 / 64} * 8 * 16 * 4);
  CHECK_FALSE(b.fits());
  // What stays on the device: whole chunks of the page budget.
  CHECK(b.resident_pages() % b.footprint.pages_per_chunk == 0);
  CHECK(static_cast<std::size_t>(b.resident_pages()) * b.footprint.page_bytes <= b.page_budget());
  CHECK(b.pages_off_device() == b.pages - b.resident_pages());
  CHECK(b.host_bytes() == static_cast<std::size_t>(b.pages_off_device()) * b.footprint.page_bytes);
  // Host offload: the rest is ~193 GB of pinned pages, more than a host of
  // 128 GiB holds; the device's share per (sequence, layer) is the
  // residency policy's budget.
  CHECK(b.host_bytes() > (std::size_t{175} << 30));
  CHECK(b.host_bytes() < (std::size_t{190} << 30));
  CHECK_FALSE(b.fits_with_offload());
  CHECK(b.device_slices_each() == b.resident_pages() / (8 * 28));
  CHECK(b.device_slices_each() > 700);
  CHECK(b.device_slices_each() < 4096 / 4);
  in.host_limit = std::size_t{256} << 30;
  memory_budget h;
  REQUIRE(plan_memory(in, h) == status::success);
  CHECK(h.fits_with_offload());
  in.host_limit = 0;
  // Even with 1-byte elements (an FP8 cache) the pages are 124 GB: most
  // must live off the device. A row of 128 codes carries a 4-byte scale.
  in.elem_bytes = 1;
  memory_budget f;
  REQUIRE(plan_memory(in, f) == status::success);
  CHECK(f.page_memory == b.page_memory / 2 / 128 * (128 + 4));
  CHECK_FALSE(f.fits());
  CHECK(f.pages_off_device() > f.pages / 2);
  in.host_limit = std::size_t{100} << 30;  // FP8 with offload: ~80 GB on the host
  REQUIRE(plan_memory(in, f) == status::success);
  CHECK(f.fits_with_offload());
  // Or FP8 with retention, no host tier: each (sequence, layer) keeps what
  // its share of the device holds past the window's two blocks.
  CHECK(f.near_slices == 32);
  CHECK(f.retained_blocks_each() == (f.device_slices_each() - 32) / 16);
  CHECK(f.retained_blocks_each() >= 32);
  CHECK(f.fits_with_retention());
  // bf16 keeps fewer, still above top_k_coarse; a quarter of the card does not.
  CHECK(b.retained_blocks_each() >= 32);
  CHECK(b.fits_with_retention());
  in.elem_bytes = 2;
  in.device_limit = std::size_t{12} << 30;
  memory_budget q;
  REQUIRE(plan_memory(in, q) == status::success);
  CHECK(q.retained_blocks_each() < 32);
  CHECK_FALSE(q.fits_with_retention());
}

TEST_CASE("the memory budget of a small model fits and sums its parts", "[runtime][budget]") {
  memory_budget_inputs in;
  in.model = {2, 8, 2, 64};
  in.contexts = {1000, 70, 5000};
  in.device_limit = std::size_t{1} << 30;
  memory_budget b;
  REQUIRE(plan_memory(in, b) == status::success);
  CHECK(b.pages == 2 * ((1000 + 63) / 64 + (70 + 63) / 64 + (5000 + 63) / 64));
  CHECK(b.footprint.page_bytes == 2 * 2 * 64 * 64 * 2);
  // 1 MiB chunks of 32 KB pages: 32 a chunk.
  CHECK(b.footprint.pages_per_chunk == 32);
  CHECK(b.page_memory == static_cast<std::size_t>((b.pages + 31) / 32) * (std::size_t{1} << 20));
  CHECK(b.total() == b.page_memory + b.metadata + b.decode_workspace + b.prefill_workspace);
  CHECK(b.fits());
  CHECK(b.pages_off_device() == 0);
  CHECK(b.host_bytes() == 0);
  // A model_decode plans each layer into its own aligned part.
  in.whole_model_decode = true;
  memory_budget m;
  REQUIRE(plan_memory(in, m) == status::success);
  CHECK(m.decode_workspace == 2 * workspace_layout<1>::align(b.decode_workspace));
  CHECK(m.total() - m.decode_workspace == b.total() - b.decode_workspace);
  // Key bounds at both levels: the slices' and the blocks' ranges, 4 bytes
  // a dimension each, on top of the sums.
  in.whole_model_decode = false;
  in.config = preset_registry{}.get(preset_id::key_bounds_both);
  memory_budget k;
  REQUIRE(plan_memory(in, k) == status::success);
  CHECK(k.footprint.slice_bounds_bytes == k.footprint.slice_sum_bytes);
  CHECK(k.footprint.block_bounds_bytes == k.footprint.block_sum_bytes);
  CHECK(k.metadata == b.metadata + k.footprint.slice_bounds_bytes + k.footprint.block_bounds_bytes);
}

TEST_CASE("the memory budget rejects what no cache could hold", "[runtime][budget][errors]") {
  memory_budget b;
  memory_budget_inputs in;
  CHECK(plan_memory(in, b) == status::invalid_argument);  // no request
  in.contexts = {0};
  CHECK(plan_memory(in, b) == status::invalid_argument);
  in.contexts = {std::int64_t{1} << 31};
  CHECK(plan_memory(in, b) == status::invalid_argument);
  in.contexts = {5000000};  // more than 4096 blocks
  CHECK(plan_memory(in, b) == status::invalid_argument);
  in.contexts.assign(4097, 4096);  // more sequences than a cache holds
  CHECK(plan_memory(in, b) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("at most 4096 sequences"));
  in.contexts = {4096};
  in.model.num_q_heads = 12;
  CHECK(plan_memory(in, b) == status::invalid_argument);
  in.model.num_q_heads = 32;
  in.elem_bytes = 3;
  CHECK(plan_memory(in, b) == status::invalid_argument);
  in.elem_bytes = 2;
  in.config.fine_slice = 48;  // does not divide 1024
  CHECK(plan_memory(in, b) == status::invalid_argument);
}

TEST_CASE("a TopK cache adds one entry per (sequence, layer, KV head) to the metadata", "[runtime][budget]") {
  kv::paged_kv_cache_options o;  // 8 KV heads, head_dim 128
  o.num_layers = 28;
  o.max_sequences = 8;
  o.max_context = 262144;
  const auto without = kv::footprint_of(o, 2);
  CHECK(without.topk_cache_bytes == 0);
  o.topk_cache_slices = 16;
  const auto with = kv::footprint_of(o, 2);
  // An entry: 4 header words, 16 slice ids, 128 fp32 query words.
  CHECK(kv::topk_cache_ref::words(16, 128) == 148);
  CHECK(kv::topk_cache_ref::words(13, 128) == 148);  // slice ids padded to 4 words
  // Per (sequence, layer, KV head): 4 control words and two entries.
  CHECK(kv::topk_cache_ref::stride_words(16, 128) == 4 + 2 * 148);
  CHECK(with.topk_cache_bytes == std::size_t{8} * 28 * 8 * (4 + 2 * 148) * 4);
  CHECK(with.metadata_bytes() == without.metadata_bytes() + with.topk_cache_bytes);
  CHECK(with.page_bytes == without.page_bytes);
}
