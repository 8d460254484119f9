// The fp64 CPU reference against independent brute force, hand-built cases,
// ties, and every edge case of DESIGN.md section 6.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "hisparse/reference/sparse_attention.hpp"
#include "test_support.hpp"

using namespace hisparse;
using hisparse::test::brute_attend;
using hisparse::test::brute_select;
using hisparse::test::fresh_seed;
using hisparse::test::random_sequence;

namespace {

std::vector<int> as_int(const std::vector<std::int32_t>& v) { return {v.begin(), v.end()}; }

/// Checks every selection and every output row of `r` against brute force.
template <class T>
void check_against_brute_force(const random_sequence<T>& s, const SparseAttentionConfig& c,
                               const reference::result& r, int query_tile, fine_summary fine = fine_summary::mean) {
  const int hq = s.shape.num_q_heads, hkv = s.shape.num_kv_heads, dim = s.shape.head_dim;
  for (const auto& tile : r.tiles) {
    REQUIRE(tile.begin % query_tile == 0);
    REQUIRE(tile.window_begin == reference::window_begin(tile.begin, c));
    for (int h = 0; h < hkv; ++h) {
      const auto [blocks, slices] = brute_select(s, c, tile.begin, tile.end, h, fine);
      REQUIRE(as_int(tile.blocks[h].kept) == blocks);
      REQUIRE(as_int(tile.slices[h].kept) == slices);
    }
  }
  std::vector<double> out;
  double lse = 0;
  for (std::int64_t i = 0; i < r.num_queries; ++i) {
    const auto& tile = r.tile_of(i);
    for (int qh = 0; qh < hq; ++qh) {
      const auto pos = reference::attended_positions(tile, qh / s.shape.group_size(), s.q_begin + i, c);
      brute_attend(s, i, qh, pos, out, lse);
      for (int d = 0; d < dim; ++d) REQUIRE(r.out(i, qh, d) == Approx(out[d]).margin(1e-12));
      REQUIRE(r.lse_of(i, qh) == Approx(lse).margin(1e-12));
    }
  }
}

/// Queries of ones, keys zero but for two planted slices (F = 16, one KV
/// head of 64 dims, query at 699 so ws = 624: 39 far slices, 5 blocks of
/// 128): slice 2 every key 0.25 (mean 0.25, bound 0.25); slice 10 one key
/// at 2 in every dimension and 15 at -1/15 (mean 1/16, bound 2).
random_sequence<float> planted_bounds_case() {
  random_sequence<float> s({2, 1, 64}, 700, 699, 1, 5);
  for (auto& x : s.queries) x = 1.0f;
  for (std::int64_t t = 0; t < 624; ++t)
    for (int d = 0; d < 64; ++d)
      s.key(t, 0, d) = t / 16 == 2 ? 0.25f : t / 16 == 10 ? (t == 160 ? 2.0f : -1.0f / 15.0f) : 0.0f;
  return s;
}

/// A config scaled down so short contexts exercise every stage.
SparseAttentionConfig small_config() { return SparseAttentionConfig{64, 128, 16, 3, 4, 8}; }

}  // namespace

TEST_CASE("window_begin follows the contract", "[reference]") {
  const SparseAttentionConfig c;  // W=512, F=64
  CHECK(reference::window_begin(0, c) == 0);
  CHECK(reference::window_begin(511, c) == 0);
  CHECK(reference::window_begin(512 + 62, c) == 0);
  CHECK(reference::window_begin(512 + 63, c) == 64);
  CHECK(reference::window_begin(100000, c) == (100000 - 511) / 64 * 64);
  // The window holds between W and W + F - 1 tokens up to and including p0.
  for (std::int64_t p0 = 600; p0 < 2000; ++p0) {
    const std::int64_t held = p0 - reference::window_begin(p0, c) + 1;
    REQUIRE(held >= c.window);
    REQUIRE(held <= c.window + c.fine_slice - 1);
  }
}

TEST_CASE("keeping everything reproduces dense attention to 1e-12", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{8, 2, 64};
  const std::int64_t len = 1500;
  // Every block and every slice fits in the top-k: selection keeps the whole far region.
  const SparseAttentionConfig keep_all{64, 128, 16, 64, 512, 16};
  random_sequence<double> s(shape, len, 1456, 44, seed);  // 1456 = 91 tiles of 16
  const auto sparse = reference::sparse_attention(keep_all, shape, s.view(), keep_all.query_tile);
  std::vector<double> out;
  double lse = 0;
  for (std::int64_t i = 0; i < s.num_queries; ++i)
    for (int qh = 0; qh < shape.num_q_heads; ++qh) {
      std::vector<std::int64_t> all(static_cast<std::size_t>(s.q_begin + i + 1));
      for (std::size_t t = 0; t < all.size(); ++t) all[t] = static_cast<std::int64_t>(t);
      brute_attend(s, i, qh, all, out, lse);
      for (int d = 0; d < shape.head_dim; ++d) REQUIRE(std::abs(sparse.out(i, qh, d) - out[d]) <= 1e-12);
      REQUIRE(std::abs(sparse.lse_of(i, qh) - lse) <= 1e-12);
      REQUIRE(sparse.attended[static_cast<std::size_t>(i * shape.num_kv_heads + qh / 4)] == s.q_begin + i + 1);
    }
  // And the library's own dense baseline agrees.
  const auto dense = reference::dense_attention(shape, s.view());
  REQUIRE(test::max_abs_diff(dense.output, sparse.output) <= 1e-12);
}

TEST_CASE("decode matches brute force on random inputs", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();
  const attention_shape shape{4, 2, 64};
  for (const std::int64_t len : {700, 1024, 1031, 2049}) {
    INFO("length " << len);
    random_sequence<double> s(shape, len, len - 1, 1, seed + len);
    check_against_brute_force(s, c, reference::decode(c, shape, s.view()), 1);
  }
}

TEST_CASE("decode on bf16 slice summaries matches brute force, and only its fine stage differs", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  SparseAttentionConfig c = small_config();
  c.fine_summary = fine_summary::mean_bf16;
  SparseAttentionConfig fp32 = c;
  fp32.fine_summary = fine_summary::mean;
  const attention_shape shape{4, 2, 64};
  for (const std::int64_t len : {700, 1031, 2049, 4100}) {
    INFO("length " << len);
    // Keys with a shared offset: the sums' low bits, which bf16 drops, then
    // decide between close slices.
    random_sequence<float> s(shape, len, len - 1, 1, seed + len);
    for (auto& k : s.keys) k += 3.0f;
    const auto r = reference::decode(c, shape, s.view());
    check_against_brute_force(s, c, r, 1, fine_summary::mean_bf16);
    const auto plain = reference::decode(fp32, shape, s.view());
    for (int h = 0; h < shape.num_kv_heads; ++h) REQUIRE(r.tiles[0].blocks[h].kept == plain.tiles[0].blocks[h].kept);
  }
}

TEST_CASE("bf16 slice summaries tie what fp32 tells apart, and the tie goes to the lower index", "[reference]") {
  SparseAttentionConfig c{64, 128, 16, 3, 1, 8};
  const attention_shape shape{2, 1, 64};
  random_sequence<float> s(shape, 700, 699, 1, 5);  // ws = 624: 39 far slices, 5 blocks
  for (auto& q : s.queries) q = 1.0f;
  for (std::int64_t t = 0; t < 624; ++t)
    for (int d = 0; d < 64; ++d) {
      const std::int64_t slice = t / 16;
      // Slice 2: keys 1, sum 16. Slice 10: keys 1 + 2^-10, sum 16 + 2^-6,
      // exact in fp32 and 16 in bf16 (8 significant bits). Others 0.
      s.key(t, 0, d) = slice == 2 ? 1.0f : slice == 10 ? 1.0f + 0x1.0p-10f : 0.0f;
    }
  CHECK(reference::decode(c, shape, s.view()).tiles[0].slices[0].kept == std::vector<std::int32_t>{10});
  c.fine_summary = fine_summary::mean_bf16;
  CHECK(reference::decode(c, shape, s.view()).tiles[0].slices[0].kept == std::vector<std::int32_t>{2});
}

TEST_CASE("key bounds: outward bf16 words, the bound score, and the slice it keeps", "[reference]") {
  // Words: minimum rounded down, maximum up; exact values stay; NaN spreads.
  CHECK(key_bounds_lo(key_bounds_word(1.0f, 2.0f)) == 1.0f);
  CHECK(key_bounds_hi(key_bounds_word(1.0f, 2.0f)) == 2.0f);
  const std::uint32_t w = key_bounds_word(-1.00001f, 1.00001f);
  CHECK(key_bounds_lo(w) == -1.0078125f);  // one bf16 ulp outward on each side
  CHECK(key_bounds_hi(w) == 1.0078125f);
  CHECK(key_bounds_lo(key_bounds_word(0.30000001f, 1.0f)) < 0.30000001f);
  CHECK(key_bounds_hi(key_bounds_word(-5.0f, -0.30000001f)) > -0.30000001f);
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(key_bounds_hi(key_bounds_word(0.0f, 3.4e38f)) == inf);  // above bf16's largest: rounds up to inf
  CHECK(key_bounds_lo(key_bounds_word(-inf, inf)) == -inf);
  CHECK(key_bounds_word(std::nanf(""), 1.0f) == 0x7fc07fc0u);
  CHECK(key_bounds_word(0.0f, -0.0f) == key_bounds_word(-0.0f, 0.0f));  // zeros: -0 below, +0 above
  CHECK(key_bounds_word(0.0f, 0.0f) == 0x00008000u);
  // The score: sum_d max(q_d lo_d, q_d hi_d), NaN where a product is.
  const double q[2] = {1.0, -1.0}, b[4] = {-1.0, 2.0, -3.0, 0.5};
  CHECK(reference::key_bounds_score(q, b, 2) == 2.0 + 3.0);
  const double q0[2] = {0.0, 1.0}, binf[4] = {-1.0, inf, 0.0, 1.0};
  CHECK(std::isnan(reference::key_bounds_score(q0, binf, 2)));  // 0 * inf
  // Slice 2: every key 0.25 (mean 0.25, bound 0.25). Slice 10: one key at 2
  // in every dimension, the other 15 at -1/15 (mean 1/16, bound 2). Means
  // keep slice 2, bounds slice 10.
  SparseAttentionConfig c{64, 128, 16, 3, 1, 8};
  const attention_shape shape{2, 1, 64};
  const auto s = planted_bounds_case();
  CHECK(reference::decode(c, shape, s.view()).tiles[0].slices[0].kept == std::vector<std::int32_t>{2});
  c.fine_summary = fine_summary::key_bounds;
  const auto r = reference::decode(c, shape, s.view());
  CHECK(r.tiles[0].slices[0].kept == std::vector<std::int32_t>{10});
  CHECK(r.tiles[0].slices[0].kept_scores[0] == 2.0 * 64 * 2.0);  // summed query 2, bound 2, 64 dimensions
  const auto bounds = reference::slice_key_bounds(s.view().keys, c, 624);
  REQUIRE(bounds.size() == 39 * 64 * 2);
  CHECK(bounds[(10 * 64 + 7) * 2] == key_bounds_lo(key_bounds_word(-1.0f / 15.0f, 0.0f)));
  CHECK(bounds[(10 * 64 + 7) * 2 + 1] == 2.0);
  // Blocks keep their means: kept one at a time, block 0 (mean 0.25 / 8)
  // beats block 1 (slice 10's mean 1/16, over 8), which bounds would keep.
  SparseAttentionConfig one_block = c;
  one_block.top_k_coarse = 1;
  const auto rb = reference::decode(one_block, shape, s.view());
  CHECK(rb.tiles[0].blocks[0].kept == std::vector<std::int32_t>{0});
  CHECK(rb.tiles[0].slices[0].kept == std::vector<std::int32_t>{2});
  // Prefill scores means under the policy: the policy is the decode fine
  // filter's. The last tile's selection is the decode's under means.
  random_sequence<float> tail(shape, 700, 696, 4, 5);  // one tile, [696, 700): ws = 624 again
  tail.keys = s.keys;
  for (auto& x : tail.queries) x = 1.0f;
  const auto pre = reference::prefill(c, shape, tail.view());
  REQUIRE(pre.tiles.size() == 1);
  CHECK(pre.tiles[0].slices[0].kept == std::vector<std::int32_t>{2});
}

TEST_CASE("coarse key bounds keep the block a mean dilutes, and match brute force", "[reference]") {
  // The keys of the test above: slice 2 of block 0 at 0.25, slice 10 of
  // block 1 one key at 2 and 15 at -1/15. One block kept: means keep block
  // 0, bounds block 1 (bound 2 against 0.25 in every dimension).
  SparseAttentionConfig c{64, 128, 16, 1, 1, 8};
  const attention_shape shape{2, 1, 64};
  const auto s = planted_bounds_case();
  CHECK(reference::decode(c, shape, s.view()).tiles[0].blocks[0].kept == std::vector<std::int32_t>{0});
  c.coarse_summary = coarse_summary::key_bounds;
  const auto r = reference::decode(c, shape, s.view());
  CHECK(r.tiles[0].blocks[0].kept == std::vector<std::int32_t>{1});
  CHECK(r.tiles[0].blocks[0].kept_scores[0] == 2.0 * 64 * 2.0);  // summed query 2, bound 2, 64 dimensions
  CHECK(r.tiles[0].slices[0].kept == std::vector<std::int32_t>{10});  // the fine filter still scores means
  // A block's bounds are its far slices' bounds together.
  const auto slices = reference::slice_key_bounds(s.view().keys, c, 624);
  const auto block = reference::block_key_bounds(slices, 8, 16, 1, 0, 64);
  CHECK(block[2 * 7] == key_bounds_lo(key_bounds_word(-1.0f / 15.0f, 0.0f)));
  CHECK(block[2 * 7 + 1] == 2.0);

  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  SparseAttentionConfig small = small_config();
  small.coarse_summary = coarse_summary::key_bounds;
  const attention_shape random_shape{4, 2, 64};
  for (const std::int64_t len : {700, 1031, 2049}) {
    INFO("length " << len);
    random_sequence<double> d(random_shape, len, len - 1, 1, seed + len);
    check_against_brute_force(d, small, reference::decode(small, random_shape, d.view()), 1);
  }
  random_sequence<double> p(random_shape, 900, 800, 100, seed);
  check_against_brute_force(p, small, reference::prefill(small, random_shape, p.view()), small.query_tile);
}

TEST_CASE("a reused selection attends the cached slices and the query's own window", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();  // W 64, F 16
  const attention_shape shape{4, 2, 64};
  random_sequence<double> s(shape, 2001, 2000, 1, seed);  // the selection made at 2000
  const auto made = reference::decode(c, shape, s.view()).tiles[0];
  for (const std::int64_t p : {2000, 2001, 2040}) {
    const auto t = reference::reused_selection(made, p, c);
    CHECK(t.begin == p);
    CHECK(t.end == p + 1);
    CHECK(t.window_begin == reference::window_begin(p, c));
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      CHECK(t.slices[h].kept == made.slices[h].kept);
      REQUIRE(!made.slices[h].kept.empty());
      CHECK(std::int64_t{made.slices[h].kept.back() + 1} * c.fine_slice <= made.window_begin);  // all before the window
      const auto pos = reference::attended_positions(t, h, p, c);
      REQUIRE(pos.size() == made.slices[h].kept.size() * 16 + static_cast<std::size_t>(p - t.window_begin + 1));
      CHECK(pos.back() == p);
    }
  }
  CHECK(made.window_begin < reference::window_begin(2040, c));  // 2040's window moved on
}

TEST_CASE("decode with a TopK cache: every step is decode, reuse follows the refresh rule", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{4, 2, 64};
  constexpr int kSteps = 8;
  constexpr std::int64_t kFirst = 2000;  // step i's query sits at kFirst + i
  random_sequence<double> s(shape, kFirst + kSteps, kFirst, kSteps, seed);
  auto step_view = [&](int i) {
    reference::sequence<double> q;
    q.keys = tensor_view<const double, 3>::contiguous(s.keys.data(), kFirst + i + 1, 2, 64);
    q.values = tensor_view<const double, 3>::contiguous(s.values.data(), kFirst + i + 1, 2, 64);
    q.queries = tensor_view<const double, 3>::contiguous(s.queries.data() + static_cast<std::size_t>(i) * 4 * 64, 1, 4, 64);
    q.q_begin = kFirst + i;
    return q;
  };
  SparseAttentionConfig c = small_config();
  {
    std::vector<reference::topk_cache_slot> cache(2);
    for (int i = 0; i < kSteps; ++i) {
      const auto got = reference::decode_cached(c, shape, step_view(i), cache);
      const auto want = reference::decode(c, shape, step_view(i));
      CHECK(got.refreshed == std::vector<bool>{true, true});
      CHECK(got.r.output == want.output);
      CHECK(got.r.lse == want.lse);
    }
  }
  // Every 4 positions, on time and a step late: a late step attends the
  // selection the step before left (step 0 has none: on time), and every
  // step, a step late, attends the previous step's.
  struct rule_case {
    refresh_rule rule;
    int period;
  };
  for (const auto& [rule, period] : {rule_case{{4}, 4}, rule_case{{4, -1.0f, true}, 4}, rule_case{{1, -1.0f, true}, 1}}) {
    INFO("every " << rule.every << (rule.late ? ", a step late" : ""));
    c.refresh = rule;
    std::vector<reference::topk_cache_slot> cache(2);
    std::vector<reference::tile_selection> made;
    for (int i = 0; i < kSteps; ++i) {
      const auto got = reference::decode_cached(c, shape, step_view(i), cache);
      CHECK(got.refreshed == std::vector<bool>(2, i % period == 0));
      CHECK(got.late == std::vector<bool>(2, rule.late && i > 0));
      const bool late = rule.late && i > 0;
      if (i % period == 0 && !late) made.push_back(got.r.tiles[0]);
      const auto from = made.back();
      if (i % period == 0 && late) made.push_back(got.r.tiles[0]);
      for (int h = 0; h < 2; ++h) {
        CHECK(got.window_begin[static_cast<std::size_t>(h)] == reference::window_begin(kFirst + i, c));
        const auto pos =
            reference::attended_positions(reference::reused_selection(from, kFirst + i, c), h, kFirst + i, c);
        CHECK(got.r.attended[static_cast<std::size_t>(h)] == static_cast<std::int64_t>(pos.size()));
        for (int g = 0; g < 2; ++g) {
          std::vector<double> out;
          double lse = 0;
          test::brute_attend(s, i, h * 2 + g, pos, out, lse);
          for (int d = 0; d < 64; ++d) REQUIRE(got.r.out(0, h * 2 + g, d) == Approx(out[static_cast<std::size_t>(d)]).margin(1e-12));
          REQUIRE(got.r.lse_of(0, h * 2 + g) == Approx(lse).margin(1e-12));
        }
      }
    }
  }
  // The cosine test: independent queries refresh every step; the same
  // query never does.
  c.refresh = {1000, 0.99f};
  std::vector<reference::topk_cache_slot> drift(2), still(2);
  for (int i = 0; i < kSteps; ++i)
    CHECK(reference::decode_cached(c, shape, step_view(i), drift).refreshed == std::vector<bool>{true, true});
  for (int i = 1; i < kSteps; ++i)
    std::copy(s.queries.begin(), s.queries.begin() + 4 * 64, s.queries.begin() + i * 4 * 64);
  for (int i = 0; i < kSteps; ++i)
    CHECK(reference::decode_cached(c, shape, step_view(i), still).refreshed == std::vector<bool>(2, i == 0));
  std::vector<reference::topk_cache_slot> wrong(3);
  CHECK_THROWS_WITH(reference::decode_cached(c, shape, step_view(0), wrong), Catch::Contains("per KV head"));
}

TEST_CASE("prefill matches brute force with max-over-tile pooling", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();  // query_tile 8
  const attention_shape shape{4, 1, 64};
  random_sequence<double> s(shape, 900, 800, 100, seed);  // 800 is tile-aligned, tail tile partial
  const auto r = reference::prefill(c, shape, s.view());
  REQUIRE(r.tiles.size() == 13);
  REQUIRE(r.tiles.back().end == 900);
  check_against_brute_force(s, c, r, c.query_tile);
}

TEST_CASE("hand-built keys give a selection known in advance", "[reference]") {
  // Keys are constant 0.25 (never zero) except planted slices with a strong
  // component along dimension 0; the query points along dimension 0.
  const attention_shape shape{1, 1, 64};
  const SparseAttentionConfig c{512, 1024, 64, 2, 3, 1};
  const std::int64_t len = 8 * 1024;
  random_sequence<double> s(shape, len, len - 1, 1, 1);
  for (auto& k : s.keys) k = 0.25;
  for (auto& q : s.queries) q = 0.0;
  s.query(0, 0, 0) = 1.0;
  auto plant = [&](int slice, double v) {
    for (std::int64_t t = std::int64_t{slice} * 64; t < std::int64_t{slice + 1} * 64; ++t) s.key(t, 0, 0) = v;
  };
  // Block 5 (slices 80..95): one very strong slice and two weaker ones.
  plant(83, 40.0);
  plant(90, 30.0);
  plant(91, 20.0);
  // Block 2 (slices 32..47): two medium slices; block 6: one slice, weaker in total.
  plant(33, 25.0);
  plant(40, 24.0);
  plant(100, 20.0);
  const auto r = reference::decode(c, shape, s.view());
  const auto& t = r.tiles.at(0);
  CHECK(t.window_begin == (len - 512) / 64 * 64);
  // Block sums along dim 0: block 5 = 90, block 2 = 49, block 6 = 20 (plus constants).
  CHECK(as_int(t.blocks[0].kept) == std::vector<int>{2, 5});
  // Slices of blocks 2 and 5 ranked 83 (40) > 90 (30) > 33 (25) > 40 (24) > 91 (20).
  CHECK(as_int(t.slices[0].kept) == std::vector<int>{33, 83, 90});
  CHECK(t.slices[0].best_rejected == Approx(24.0));
  CHECK(r.attended[0] == 3 * 64 + (len - t.window_begin));
}

TEST_CASE("ties go to the lower index in both filters", "[reference]") {
  // All keys equal (0.5, exactly representable): every block and slice scores
  // the same, so the lowest indices win.
  const attention_shape shape{2, 1, 64};
  const SparseAttentionConfig c{512, 1024, 64, 3, 5, 1};
  const std::int64_t len = 10 * 1024 + 17;
  random_sequence<double> s(shape, len, len - 1, 1, 7);
  for (auto& k : s.keys) k = 0.5;
  const auto r = reference::decode(c, shape, s.view());
  const auto& t = r.tiles.at(0);
  CHECK(as_int(t.blocks[0].kept) == std::vector<int>{0, 1, 2});
  CHECK(as_int(t.slices[0].kept) == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(t.blocks[0].best_rejected == t.blocks[0].kept_scores[0]);
  // Equal keys: the output is the mean of the attended values, still finite.
  for (const double x : r.output) CHECK(std::isfinite(x));
}

TEST_CASE("select_top_k ranks NaN last and breaks ties by id", "[reference]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> scores{1.0, nan, -inf, 3.0, 1.0, nan, 2.0};
  const std::vector<std::int32_t> ids{10, 11, 12, 13, 14, 15, 16};
  auto sel = reference::select_top_k(scores, ids, 4);
  CHECK(sel.kept == std::vector<std::int32_t>{10, 13, 14, 16});
  CHECK(sel.best_rejected == -inf);
  sel = reference::select_top_k(scores, ids, 6);
  CHECK(sel.kept == std::vector<std::int32_t>{10, 11, 12, 13, 14, 16});
  sel = reference::select_top_k(scores, ids, 100);
  CHECK(sel.kept.size() == 7);
  CHECK(sel.best_rejected == -inf);
  CHECK(sel.num_candidates == 7);
}

TEST_CASE("edge: context shorter than the window is dense attention", "[reference][edge]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{8, 8, 64};
  const SparseAttentionConfig c;
  random_sequence<double> s(shape, 300, 299, 1, seed);
  const auto r = reference::decode(c, shape, s.view());
  CHECK(r.tiles.at(0).window_begin == 0);
  CHECK(r.tiles.at(0).blocks[0].kept.empty());
  const auto dense = reference::dense_attention(shape, s.view());
  CHECK(test::max_abs_diff(r.output, dense.output) <= 1e-12);
}

TEST_CASE("edge: a single token attends to itself", "[reference][edge]") {
  const attention_shape shape{4, 2, 128};
  random_sequence<double> s(shape, 1, 0, 1, fresh_seed());
  const auto r = reference::decode(SparseAttentionConfig{}, shape, s.view());
  for (int qh = 0; qh < 4; ++qh) {
    double qk = 0;
    for (int d = 0; d < 128; ++d) {
      CHECK(r.out(0, qh, d) == s.value(0, qh / 2, d));
      qk += s.query(0, qh, d) * s.key(0, qh / 2, d);
    }
    CHECK(r.lse_of(0, qh) == Approx(qk / std::sqrt(128.0)).margin(1e-12));
  }
}

TEST_CASE("edge: contexts that are not multiples of the block or slice", "[reference][edge]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();
  const attention_shape shape{2, 1, 64};
  for (const std::int64_t len : {129, 143, 1000, 1039, 1153}) {
    INFO("length " << len);
    random_sequence<double> s(shape, len, len - 1, 1, seed ^ len);
    const auto r = reference::decode(c, shape, s.view());
    const auto& t = r.tiles.at(0);
    // Selections come only from the far region, and only complete slices.
    for (const auto b : t.blocks[0].kept) REQUIRE(std::int64_t{b} * c.coarse_block < t.window_begin);
    for (const auto sl : t.slices[0].kept) REQUIRE(std::int64_t{sl + 1} * c.fine_slice <= t.window_begin);
    check_against_brute_force(s, c, r, 1);
  }
}

TEST_CASE("edge: fewer candidate blocks than top_k keeps them all", "[reference][edge]") {
  const SparseAttentionConfig c;  // k = 32 blocks
  const attention_shape shape{4, 1, 64};
  const std::int64_t len = 5 * 1024 + 100;
  random_sequence<double> s(shape, len, len - 1, 1, fresh_seed());
  const auto r = reference::decode(c, shape, s.view());
  const auto& t = r.tiles.at(0);
  const std::int64_t candidates = (t.window_begin + 1023) / 1024;
  CHECK(static_cast<std::int64_t>(t.blocks[0].kept.size()) == candidates);
  CHECK(t.blocks[0].best_rejected == -std::numeric_limits<double>::infinity());
  CHECK(t.slices[0].kept.size() == 16);
}

TEST_CASE("edge: GQA ratios 1, 4 and 8 share one selection per KV head", "[reference][edge]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();
  for (const int group : {1, 4, 8}) {
    INFO("group " << group);
    const attention_shape shape{2 * group, 2, 64};
    random_sequence<double> s(shape, 1100, 1099, 1, seed + group);
    check_against_brute_force(s, c, reference::decode(c, shape, s.view()), 1);
  }
}

TEST_CASE("edge: head_dim 64, 128 and 256", "[reference][edge]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig c = small_config();
  for (const int dim : {64, 128, 256}) {
    INFO("head_dim " << dim);
    const attention_shape shape{4, 2, dim};
    random_sequence<double> s(shape, 800, 799, 1, seed + dim);
    check_against_brute_force(s, c, reference::decode(c, shape, s.view()), 1);
  }
}

TEST_CASE("edge: NaN in a far key is never selected and never leaks", "[reference][edge]") {
  const SparseAttentionConfig c = small_config();
  const attention_shape shape{2, 1, 64};
  const std::int64_t len = 2000;
  random_sequence<double> s(shape, len, len - 1, 1, fresh_seed());
  s.key(100, 0, 3) = std::numeric_limits<double>::quiet_NaN();  // slice 6, block 0
  const auto r = reference::decode(c, shape, s.view());
  const auto& t = r.tiles.at(0);
  for (const auto b : t.blocks[0].kept) CHECK(b != 0);
  for (const double x : r.output) CHECK(std::isfinite(x));
}

TEST_CASE("edge: NaN or Inf in the window poisons only its KV head", "[reference][edge]") {
  const SparseAttentionConfig c = small_config();
  const attention_shape shape{4, 2, 64};
  const std::int64_t len = 600;
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    random_sequence<double> s(shape, len, len - 1, 1, fresh_seed());
    s.key(len - 3, 1, 0) = bad;  // inside the window of KV head 1
    s.query(0, 2, 0) = s.query(0, 3, 0) = 1.0;  // so +Inf gives a +Inf logit, not -Inf
    const auto r = reference::decode(c, shape, s.view());
    for (int d = 0; d < 64; ++d) {
      CHECK(std::isfinite(r.out(0, 0, d)));
      CHECK(std::isfinite(r.out(0, 1, d)));
      CHECK_FALSE(std::isfinite(r.out(0, 2, d)));
      CHECK_FALSE(std::isfinite(r.out(0, 3, d)));
    }
  }
}

TEST_CASE("decode equals prefill of one query", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{8, 2, 64};
  SparseAttentionConfig c = small_config();
  random_sequence<double> s(shape, 1601, 1600, 1, seed);  // 1600 is a multiple of 8 and 64
  const auto dec = reference::decode(c, shape, s.view());
  for (const int tile : {1, 8, 64}) {
    INFO("query_tile " << tile);
    c.query_tile = tile;
    const auto pre = reference::prefill(c, shape, s.view());
    REQUIRE(pre.output == dec.output);
    REQUIRE(pre.lse == dec.lse);
    REQUIRE(pre.tiles[0].slices[0].kept == dec.tiles[0].slices[0].kept);
  }
}

TEST_CASE("prefill does not depend on tile-aligned chunking", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{4, 2, 64};
  const SparseAttentionConfig c = small_config();
  const std::int64_t len = 1000;
  random_sequence<double> whole(shape, len, 0, len, seed);
  const auto all = reference::prefill(c, shape, whole.view());
  // Same tensors, consumed as chunks [0, 96), [96, 600), [600, 1000).
  for (const auto& [b, e] : {std::pair<std::int64_t, std::int64_t>{0, 96}, {96, 600}, {600, 1000}}) {
    auto chunk = whole.view();
    chunk.queries.data += b * shape.num_q_heads * shape.head_dim;
    chunk.queries.extents[0] = e - b;
    chunk.q_begin = b;
    const auto part = reference::prefill(c, shape, chunk);
    for (std::int64_t i = 0; i < e - b; ++i)
      for (int qh = 0; qh < shape.num_q_heads; ++qh)
        for (int d = 0; d < shape.head_dim; ++d) REQUIRE(part.out(i, qh, d) == all.out(b + i, qh, d));
  }
}

TEST_CASE("a batch of different lengths decodes each sequence", "[reference]") {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{4, 2, 64};
  const SparseAttentionConfig c = small_config();
  std::vector<random_sequence<double>> owned;
  for (const std::int64_t len : {1, 200, 1033}) owned.emplace_back(shape, len, len - 1, 1, seed + len);
  std::vector<reference::sequence<double>> batch;
  for (const auto& o : owned) batch.push_back(o.view());
  const auto results = reference::decode_batch<double>(c, shape, batch);
  REQUIRE(results.size() == 3);
  for (std::size_t i = 0; i < 3; ++i)
    REQUIRE(results[i].output == reference::decode(c, shape, batch[i]).output);
}

TEMPLATE_TEST_CASE("the reference reads low-precision storage exactly", "[reference]", float, __half,
                   __nv_bfloat16) {
  const std::uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const attention_shape shape{4, 1, 64};
  const SparseAttentionConfig c = small_config();
  random_sequence<TestType> low(shape, 700, 699, 1, seed);
  // The same values widened to double must give bit-identical results.
  random_sequence<double> wide(shape, 700, 699, 1, seed);
  for (std::size_t i = 0; i < low.keys.size(); ++i) {
    wide.keys[i] = to_double(low.keys[i]);
    wide.values[i] = to_double(low.values[i]);
  }
  for (std::size_t i = 0; i < low.queries.size(); ++i) wide.queries[i] = to_double(low.queries[i]);
  const auto a = reference::decode(c, shape, low.view());
  const auto b = reference::decode(c, shape, wide.view());
  REQUIRE(a.output == b.output);
}

TEST_CASE("bad input is rejected before any work", "[reference][errors]") {
  const attention_shape shape{4, 2, 64};
  const SparseAttentionConfig c;
  random_sequence<double> s(shape, 100, 99, 1, 3);
  SECTION("Hq not a multiple of Hkv") {
    CHECK_THROWS_WITH(reference::decode(c, attention_shape{6, 4, 64}, s.view()),
                      Catch::Contains("num_q_heads must be a multiple of num_kv_heads"));
  }
  SECTION("unsupported head_dim") {
    CHECK_THROWS_WITH(reference::decode(c, attention_shape{4, 2, 96}, s.view()), Catch::Contains("head_dim"));
  }
  SECTION("tensors that do not match the shape") {
    CHECK_THROWS_WITH(reference::decode(c, attention_shape{4, 2, 128}, s.view()), Catch::Contains("keys"));
  }
  SECTION("queries without their keys in the cache") {
    auto v = s.view();
    v.q_begin = 100;
    CHECK_THROWS_WITH(reference::sparse_attention(c, shape, v, 1), Catch::Contains("own keys"));
  }
  SECTION("a prefill chunk that starts inside a tile") {
    auto v = s.view();
    v.q_begin = 99;
    CHECK_THROWS_WITH(reference::prefill(c, shape, v), Catch::Contains("query-tile boundary"));
  }
  SECTION("decode of a query that is not the last position") {
    auto v = s.view();
    v.q_begin = 50;
    CHECK_THROWS_WITH(reference::decode(c, shape, v), Catch::Contains("last cached position"));
  }
  SECTION("an empty batch") {
    CHECK_THROWS_WITH(reference::decode_batch<double>(c, shape, {}), Catch::Contains("batch is empty"));
  }
  SECTION("an invalid config") {
    SparseAttentionConfig bad = c;
    bad.fine_slice = 100;
    CHECK_THROWS_WITH(reference::decode(bad, shape, s.view()), Catch::Contains("fine_slice"));
  }
}
