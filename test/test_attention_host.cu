// The decode attention's and the composed step's host side needs no device:
// plans, workspace layouts and argument checks answer before any CUDA call
// (the SM count is passed in), so they are CPU tests.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>

#include "hisparse/attention/decode.cuh"
#include "hisparse/runtime/hierarchical_attention.cuh"

using namespace hisparse;

namespace {

using bf16 = __nv_bfloat16;

// Host checks never dereference these: they only need to be non-null and
// 16-byte aligned.
alignas(16) bf16 fake_queries[8];
alignas(16) std::int32_t fake_ints[8];
bf16* fake_page_table[8];

kv::paged_kv_ref<bf16> fake_cache(std::int32_t max_slices) {
  kv::paged_kv_ref<bf16> c;
  c.page_table = fake_page_table;
  c.lengths = fake_ints;
  c.slice_sums = reinterpret_cast<const float*>(fake_ints);
  c.block_sums = reinterpret_cast<const float*>(fake_ints);
  c.layers = 1;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.fine_slice = 64;
  c.coarse_block = 1024;
  c.max_slices = max_slices;
  c.max_blocks = max_slices / 16;
  return c;
}

attention::decode_attention_arguments<bf16> dense_args(int batch, std::int32_t max_slices) {
  attention::decode_attention_arguments<bf16> a;
  a.queries = fake_queries;
  a.slots = fake_ints;
  a.batch = batch;
  a.num_q_heads = 32;
  a.cache = fake_cache(max_slices);
  a.max_items = max_slices;
  a.out = fake_queries;
  return a;
}

}  // namespace

TEST_CASE("decode attention plans one wave and keeps its counters in place for smaller batches",
          "[attention][plan]") {
  constexpr int kSms = 132;
  attention::decode_attention_plan big;
  REQUIRE(attention::plan_decode_attention(dense_args(16, 4096), kSms, big) == status::success);
  CHECK(big.heads_per_cta == 4);
  CHECK(big.counter_batch == 16);
  CHECK(big.counter_offset == 0);
  CHECK(big.counter_bytes >= 16 * 8 * sizeof(unsigned));
  for (int batch = 1; batch <= 16; ++batch) {
    INFO("batch " << batch);
    attention::decode_attention_plan p;
    REQUIRE(attention::plan_decode_attention(dense_args(batch, 4096), kSms, p, 16) == status::success);
    // The same zeroed counters, and the partials never overlap them.
    CHECK(p.counter_offset == big.counter_offset);
    CHECK(p.counter_bytes == big.counter_bytes);
    CHECK(p.partial_offset >= p.counter_bytes);
    // One wave of CTAs (2 per SM: three 32 KB stages each), at most 64
    // splits, and the splits cover every slice.
    CHECK(p.ctas_per_sm == 2);
    CHECK(p.stages == 3);
    CHECK(std::int64_t{p.splits} * batch * 8 <= std::max<std::int64_t>(2 * kSms, batch * 8));
    CHECK(p.splits <= 64);
    CHECK(std::int64_t{p.splits} * p.slices_per_split >= 4096);
    CHECK(std::int64_t{p.splits - 1} * p.slices_per_split < 4096);
  }
  // A large batch takes one split, but still reserves (and will zero) the
  // counters a smaller batch on the same workspace needs.
  attention::decode_attention_plan huge;
  REQUIRE(attention::plan_decode_attention(dense_args(64, 4096), kSms, huge) == status::success);
  CHECK(huge.splits == 1);
  CHECK(huge.counter_bytes >= 64 * 8 * sizeof(unsigned));
  CHECK(huge.workspace_bytes == huge.counter_bytes);
}

TEST_CASE("decode attention leaves the wave's reserved slots to the kernel beside it", "[attention][plan]") {
  constexpr int kSms = 132;  // 264 CTA slots at two per SM
  auto a = dense_args(8, 4096);
  a.top_k_fine = 16;
  a.window = 512;
  a.max_items = 25;  // 16 kept slices + 9 window slices of 64 tokens
  attention::decode_attention_plan full, beside;
  REQUIRE(attention::plan_decode_attention(a, kSms, full) == status::success);
  CHECK(full.splits == 4);  // 256 CTAs of 264
  // B = 8 beside the selection: its 64 writer CTAs keep their slots.
  REQUIRE(attention::plan_decode_attention(a, kSms, beside, 0, 64) == status::success);
  CHECK(beside.splits == 3);
  CHECK(std::int64_t{beside.splits} * 64 <= 2 * kSms - 64);
  CHECK(std::int64_t{beside.splits} * beside.slices_per_split >= 25);
  // Both merge as a cluster (sm_90, at most 8 splits): 4 heads x 3 splits
  // of 128 outputs and an LSE in CTA 0's drained ring.
  CHECK(full.cluster_merge);
  CHECK(beside.cluster_merge);
  CHECK(beside.merge_offset == 4 * 8 * (2 + 128 + 8) * 4);  // in the ring, past the warps' merge
  CHECK(beside.smem_bytes == 3 * 32 * 1024);
  CHECK(beside.ctas_per_sm == 2);
  // More reserved than the wave holds: still one split, nothing to merge.
  REQUIRE(attention::plan_decode_attention(a, kSms, beside, 0, 100000) == status::success);
  CHECK(beside.splits == 1);
  CHECK(beside.slices_per_split == 25);
  CHECK_FALSE(beside.cluster_merge);
  CHECK(beside.smem_bytes == 3 * 32 * 1024);
  // B = 1: a wave would take 25 splits of one slice; a sparse run takes at
  // most a cluster's 8 (7 of 4 slices) on sm_90, and all 25 without clusters.
  a.batch = 1;
  attention::decode_attention_plan one;
  REQUIRE(attention::plan_decode_attention(a, kSms, one) == status::success);
  CHECK(one.splits == 7);
  CHECK(one.slices_per_split == 4);
  CHECK(one.cluster_merge);
  attention::gpu_limits ampere;
  ampere.sms = kSms;
  ampere.cc_major = 8;
  REQUIRE(attention::plan_decode_attention(a, ampere, one) == status::success);
  CHECK(one.splits == 25);
  CHECK_FALSE(one.cluster_merge);
  // The dense baseline keeps the whole wave (4096 slices: 33 splits).
  REQUIRE(attention::plan_decode_attention(dense_args(1, 4096), kSms, one) == status::success);
  CHECK(one.splits == 33);
  CHECK_FALSE(one.cluster_merge);
}

TEST_CASE("a sparse decode attention merges in a cluster where the partials fit its ring", "[attention][plan]") {
  auto a = dense_args(1, 4096);
  a.top_k_fine = 64;
  a.window = 512;
  a.max_items = 73;  // 64 kept slices + 9 window slices
  attention::gpu_limits gpu;
  const int offset = 4 * 8 * (2 + 128 + 8) * 4;  // past the warps' merge (4 warps, 8 heads, head_dim 128)
  // 2 slots per SM / 8 (B x KV heads) -> 1, 2, 4, 8, 16 splits wanted; a
  // sparse run on sm_90 takes at most 8.
  const int sms[] = {4, 8, 16, 32, 64};
  const int splits_sm90[] = {1, 2, 4, 8, 8}, splits_sm80[] = {1, 2, 4, 8, 15};
  for (int i = 0; i < 5; ++i) {
    gpu.sms = sms[i];
    for (const int cc : {8, 9}) {
      gpu.cc_major = cc;
      INFO(sms[i] << " SMs, sm_" << cc << "x");
      attention::decode_attention_plan p;
      REQUIRE(attention::plan_decode_attention(a, gpu, p) == status::success);
      CHECK(p.splits == (cc >= 9 ? splits_sm90 : splits_sm80)[i]);
      // 4 heads x up to 8 splits x (128 outputs + an LSE) = 16.5 KB fit the
      // 96 KB ring past the warps' 17 KB.
      const bool expect = cc >= 9 && p.splits >= 2;
      CHECK(p.cluster_merge == expect);
      CHECK(p.merge_offset == (expect ? offset : 0));
      CHECK(p.smem_bytes == 3 * 32 * 1024);  // no shared memory of their own
      CHECK(p.ctas_per_sm == 2);
      // The workspace holds the partials either way (an sm_80 build on an
      // sm_90 part merges through it).
      if (p.splits > 1) CHECK(p.workspace_bytes > p.counter_bytes);
      // The dense baseline never clusters (its grid fills the wave).
      attention::decode_attention_plan d;
      REQUIRE(attention::plan_decode_attention(dense_args(1, 4096), gpu, d) == status::success);
      CHECK_FALSE(d.cluster_merge);
      CHECK(d.splits == std::max(1, sms[i] / 4));
    }
  }
  // One 32 KB stage (40 KB per CTA): the 15 KB past the warps' merge hold
  // up to 7 splits of 4 heads (2 KB each), not 8.
  gpu.cc_major = 9;
  gpu.smem_per_block = 40 * 1024;
  gpu.smem_per_sm = 100 * 1024;
  for (const int n : {12, 16}) {  // two CTAs per SM: 3 and 4 splits
    gpu.sms = n;
    attention::decode_attention_plan p;
    REQUIRE(attention::plan_decode_attention(a, gpu, p) == status::success);
    CHECK(p.stages == 1);
    CHECK(p.splits == n / 4);
    CHECK(p.cluster_merge);
  }
  gpu.sms = 32;
  attention::decode_attention_plan p;
  REQUIRE(attention::plan_decode_attention(a, gpu, p) == status::success);
  CHECK(p.splits == 8);
  CHECK_FALSE(p.cluster_merge);
}

TEST_CASE("decode attention sizes its shared-memory ring to the GPU", "[attention][plan]") {
  // An RTX 4090 (sm_89): 100 KB per SM, 99 KB per CTA.
  attention::gpu_limits ada;
  ada.cc_major = 8;  // no clusters: the merge goes through the workspace
  ada.sms = 128;
  ada.smem_per_sm = 100 * 1024;
  ada.smem_per_block = 99 * 1024;
  attention::decode_attention_plan p;
  REQUIRE(attention::plan_decode_attention(dense_args(8, 4096), ada, p) == status::success);
  CHECK(p.stages == 2);  // two 32 KB stages of 64 rows x 128 dims of K and V
  CHECK(p.ctas_per_sm == 1);
  CHECK(p.smem_bytes == 2 * 32 * 1024);
  // head_dim 256 keeps one 64 KB stage there.
  auto wide = dense_args(8, 4096);
  wide.cache.head_dim = 256;
  REQUIRE(attention::plan_decode_attention(wide, ada, p) == status::success);
  CHECK(p.stages == 1);
  // A user's tile: 2 warps, 32 rows per stage, 4 stages (16 KB each).
  constexpr tile_policy narrow{1, 32, 2, 4};
  REQUIRE(attention::plan_decode_attention<narrow>(dense_args(8, 4096), ada, p) == status::success);
  CHECK(p.stages == 4);
  CHECK(p.smem_bytes == 4 * 16 * 1024);
  // A plan for one tile policy is refused by a launch with another.
  alignas(256) static char workspace[1];
  attention::decode_attention_plan deep;
  constexpr tile_policy two_stages{1, 64, 4, 2};
  REQUIRE(attention::plan_decode_attention(dense_args(8, 4096), 132, deep) == status::success);
  CHECK(deep.stages == 3);
  CHECK(attention::decode_attention_async<bf16, two_stages>(deep, dense_args(8, 4096), workspace) ==
        status::invalid_argument);
  // A plan edited by hand past what the kernel can hold is refused.
  for (int field = 0; field < 3; ++field) {
    auto edited = deep;
    if (field == 0) edited.stages = 4;
    if (field == 1) edited.splits = 65;
    if (field == 2) edited.smem_bytes = 32 * 1024;
    CHECK(attention::decode_attention_async(edited, dense_args(8, 4096), workspace) == status::invalid_argument);
    CHECK_THAT(last_error(), Catch::Contains("inconsistent"));
  }
  // So is a cluster merge edited past the portable cluster size or onto the
  // warps' merge (a sparse plan: 4 splits in a cluster).
  auto sparse = dense_args(8, 4096);
  sparse.top_k_fine = 16;
  sparse.window = 512;
  sparse.max_items = 25;
  sparse.kept_slices = sparse.num_slices = fake_ints;
  attention::decode_attention_plan clustered;
  REQUIRE(attention::plan_decode_attention(sparse, 132, clustered) == status::success);
  REQUIRE(clustered.cluster_merge);
  for (int field = 0; field < 2; ++field) {
    auto edited = clustered;
    if (field == 0) edited.splits = 9;
    if (field == 1) edited.merge_offset = 64;
    CHECK(attention::decode_attention_async(edited, sparse, workspace) == status::invalid_argument);
    CHECK_THAT(last_error(), Catch::Contains("inconsistent"));
  }
  // Too little shared memory for one stage is unsupported, and says so.
  attention::gpu_limits tiny;
  tiny.sms = 8;
  tiny.smem_per_sm = tiny.smem_per_block = 16 * 1024;
  CHECK(attention::plan_decode_attention(dense_args(8, 4096), tiny, p) == status::unsupported);
  CHECK_THAT(last_error(), Catch::Contains("does not fit"));
}

TEST_CASE("decode attention refuses a plan made for another shape, before launching", "[attention][errors]") {
  attention::decode_attention_plan p;
  REQUIRE(attention::plan_decode_attention(dense_args(8, 512), 132, p) == status::success);
  alignas(256) static char workspace[1];
  auto other = dense_args(4, 512);
  CHECK(attention::decode_attention_async(p, other, workspace) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("another shape"));
  other = dense_args(8, 256);
  CHECK(attention::decode_attention_async(p, other, workspace) == status::invalid_argument);
  CHECK(attention::decode_attention_async(p, dense_args(8, 512), nullptr) == status::invalid_argument);
  CHECK(attention::decode_attention_async(attention::decode_attention_plan{}, dense_args(8, 512), workspace) ==
        status::invalid_argument);
}

namespace {
/// Shape-only arguments of a composed step over a 4096-slice cache.
decode_step_arguments<bf16> fake_step_args(int batch) {
  decode_step_arguments<bf16> a;
  a.queries = fake_queries;
  a.slots = fake_ints;
  a.num_q_heads = 32;
  a.batch = batch;
  a.cache = fake_cache(4096);
  a.out = fake_queries;
  return a;
}
}  // namespace

TEST_CASE("the composed step's workspace covers every smaller batch", "[attention][plan]") {
  hierarchical_decode<bf16> op(SparseAttentionConfig{});
  auto a = fake_step_args(1);
  for (const int planned : {1, 7, 16, 50}) {
    INFO("planned batch " << planned);
    a.batch = planned;
    std::size_t bytes = 0;
    REQUIRE(op.workspace_bytes(a, 132, bytes) == status::success);
    for (int batch = 1; batch <= planned; ++batch) {
      auto smaller = a;
      smaller.batch = batch;
      std::size_t own = 0;
      REQUIRE(op.workspace_bytes(smaller, 132, own) == status::success);
      CHECK(own <= bytes);
    }
  }
  a.batch = 0;
  std::size_t bytes = 0;
  CHECK(op.workspace_bytes(a, 132, bytes) == status::invalid_argument);
}

TEST_CASE("a composed workspace places each stage's part after the last, 256-byte aligned", "[runtime][compose]") {
  constexpr auto l = workspace_layout<4>::of({1000, 0, 256, 1});
  STATIC_REQUIRE(l.offset[0] == 0);
  STATIC_REQUIRE(l.offset[1] == 1024);
  STATIC_REQUIRE(l.offset[2] == 1024);  // an empty part takes no room
  STATIC_REQUIRE(l.offset[3] == 1280);
  STATIC_REQUIRE(l.total == 1536);
  // Every stage is checked in order; the first failure is the answer and
  // the checks after it do not run.
  int ran = 0;
  auto ok = [&] { ++ran; return status::success; };
  auto bad = [&] { ++ran; return status::unsupported; };
  CHECK(can_implement_all(ok, ok) == status::success);
  CHECK(ran == 2);
  ran = 0;
  CHECK(can_implement_all(ok, bad, ok) == status::unsupported);
  CHECK(ran == 2);
}

TEST_CASE("the composed step's checks name the stage that refuses", "[runtime][compose]") {
  hierarchical_decode<bf16> op(SparseAttentionConfig{});
  const auto a = fake_step_args(4);
  CHECK(op.can_implement(a) == status::success);
  auto no_lengths = a;
  no_lengths.cache.lengths = nullptr;
  CHECK(op.can_implement(no_lengths) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("decode selection"));
  auto no_out = a;
  no_out.out = nullptr;
  CHECK(op.can_implement(no_out) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("decode attention"));
}
