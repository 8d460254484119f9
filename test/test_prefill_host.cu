// The prefill selection's host side needs no device: segment layout and
// every argument check answer before any CUDA call, so they are CPU tests.
#include <catch2/catch.hpp>

#include <vector>

#include "hisparse/select/prefill_selection.cuh"

using namespace hisparse;

namespace {

select::prefill_segment segment(std::int32_t slot, std::int32_t q_begin, std::int32_t n) {
  select::prefill_segment s;
  s.slot = slot;
  s.q_begin = q_begin;
  s.num_queries = n;
  return s;
}

}  // namespace

TEST_CASE("layout_prefill_segments packs rows and numbers tiles", "[select][prefill]") {
  // A whole prompt ending mid-tile, a chunk from a tile boundary, one query.
  std::vector<select::prefill_segment> segs{segment(3, 0, 130), segment(0, 4096, 64), segment(7, 640, 1)};
  int tiles = -1;
  REQUIRE(select::layout_prefill_segments(segs.data(), 3, 64, tiles) == status::success);
  CHECK(segs[0].query_offset == 0);
  CHECK(segs[0].tile_offset == 0);
  CHECK(segs[1].query_offset == 130);
  CHECK(segs[1].tile_offset == 3);  // 130 queries from 0: tiles 0, 1, 2
  CHECK(segs[2].query_offset == 194);
  CHECK(segs[2].tile_offset == 4);
  CHECK(tiles == 5);
  CHECK(segs[2].slot == 7);  // untouched fields stay
  CHECK(select::prefill_tiles(0, 130, 64) == 3);
  CHECK(select::prefill_tiles(4096, 64, 64) == 1);
  CHECK(select::prefill_tiles(640, 0, 64) == 0);
}

TEST_CASE("layout_prefill_segments refuses chunks off a tile boundary", "[select][prefill][errors]") {
  int tiles = -7;
  auto bad = [&](select::prefill_segment s, int m) {
    std::vector<select::prefill_segment> v{segment(0, 0, 64), s};
    return select::layout_prefill_segments(v.data(), 2, m, tiles);
  };
  CHECK(bad(segment(1, 4001, 100), 64) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("segment 1") && Catch::Contains("q_begin 4001"));
  CHECK(bad(segment(1, 4000, 100), 16) == status::success);  // 4000 = 250 x 16
  tiles = -7;
  CHECK(bad(segment(1, -64, 100), 64) == status::invalid_argument);
  CHECK(bad(segment(1, 64, 0), 64) == status::invalid_argument);
  CHECK(bad(segment(1, 64, 1), 0) == status::invalid_argument);
  CHECK(tiles == -7);  // not written on failure
  CHECK(select::layout_prefill_segments(nullptr, 0, 64, tiles) == status::invalid_argument);
}

TEST_CASE("select_prefill_async rejects bad input before touching the device", "[select][prefill][errors]") {
  // Pointers are never dereferenced on the host: any non-null address works.
  static float sums[1];
  static __nv_bfloat16 q[1];
  static select::prefill_segment seg[1];
  static std::int32_t out_i[1];
  const SparseAttentionConfig cfg;
  select::prefill_selection_arguments<__nv_bfloat16> a;
  a.queries = q;
  a.segments = seg;
  a.num_segments = 1;
  a.num_tiles = 4;
  a.num_q_heads = 32;
  a.slice_sums = sums;
  a.block_sums = sums;
  a.layers = 2;
  a.kv_heads = 8;
  a.head_dim = 128;
  a.fine_slice = cfg.fine_slice;
  a.coarse_block = cfg.coarse_block;
  a.max_slices = 4096;
  a.max_blocks = 256;
  const select::prefill_selection_output out{out_i, out_i, out_i};
  REQUIRE(select::can_implement_prefill_selection(cfg, a, out) == status::success);

  auto rejects = [&](auto edit, status expected, const char* says) {
    auto b = a;
    auto c = cfg;
    auto o = out;
    edit(b, c, o);
    CHECK(select::select_prefill_async(c, b, o) == expected);
    CHECK_THAT(last_error(), Catch::Contains(says));
  };
  using args = select::prefill_selection_arguments<__nv_bfloat16>;
  using outs = select::prefill_selection_output;
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.num_tiles = 0; }, status::invalid_argument, "no segments");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.num_tiles = 70000; }, status::unsupported, "65535");
  rejects([](args&, SparseAttentionConfig& c, outs&) { c.query_tile = 128; }, status::unsupported, "query_tile 128");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.queries = nullptr; }, status::invalid_argument,
          "must not be null");
  rejects([](args&, SparseAttentionConfig&, outs& o) { o.window_begin = nullptr; }, status::invalid_argument,
          "must not be null");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.layer = 2; }, status::invalid_argument, "layer");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.fine_slice = 32; }, status::invalid_argument,
          "slice/block sizes");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.max_blocks = 8192; }, status::unsupported,
          "4096 blocks");
  rejects([](args&, SparseAttentionConfig& c, outs&) { c.top_k_coarse = 512; }, status::unsupported,
          "4096 fine candidates");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.num_q_heads = 12; }, status::invalid_argument,
          "num_q_heads");
}
