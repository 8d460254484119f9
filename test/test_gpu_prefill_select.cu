// Prefill selection on the GPU against the fp64 CPU reference: per query tile
// (M consecutive positions) and KV head, the kept slices equal the
// reference's (but for rare near-ties at the boundary), every window start
// equals it, across GQA ratios, head dims, tile sizes, ragged segments and
// tiles cut by a segment's last position; a segment that does not start on a
// tile is refused by the host layout and reported (-1) by the kernel.
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "gpu_problem.hpp"
#include "gpu_test.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/select/prefill_selection.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

template <class T>
using dev = test::device_buffer<T>;
using bf16 = __nv_bfloat16;

/// What one prefill selection produced.
struct prefill_run {
  std::vector<select::prefill_segment> segs;
  std::vector<bf16> queries;
  std::vector<std::int32_t> kept, num, window, blocks;
};

/// How a run scores: tensor cores (two passes or one) or fp32 CUDA cores,
/// the candidate ring's depth, and the plain pass's rows: fp16 copies for
/// `plain_segments` segments ending by `plain_positions` (0: the longest
/// sequence), or none (-1: the tf32 plain pass).
struct scoring {
  bool tensor_cores = true;
  bool two_pass = true;
  int ring_stages = 2;
  int plain_segments = -1;
  std::int32_t plain_positions = 0;
};
constexpr scoring kFp16Plain{true, true, 1, 64};

/// Every scoring mode: two passes (fp16 or tf32 plain pass, 1-deep ring),
/// one 3xTF32 pass, fp32 CUDA cores; and its name for a failure message.
constexpr scoring kEveryScoring[] = {kFp16Plain, {true, true, 1}, {true, false, 2}, {false, false, 2}};
const char* name_of(const scoring& how) {
  if (!how.tensor_cores) return "fp32 CUDA cores";
  if (!how.two_pass) return "3xTF32";
  return how.plain_segments > 0 ? "plain fp16 then 3xTF32" : "plain tf32 then 3xTF32";
}

/// Changes the queries of a run before they are uploaded: (queries, laid-out
/// segments), queries [row][q_heads][head_dim] with segment b's rows from
/// segs[b].query_offset.
using query_edit = std::function<void(std::vector<bf16>&, const std::vector<select::prefill_segment>&)>;

/// Runs the prefill selection for the last ~n[b] positions of every
/// sequence of `p` (random queries from `seed`, the same for every scoring,
/// then `edit`).
prefill_run run_prefill(const test::problem<bf16>& p, const std::vector<std::int32_t>& n, std::uint64_t seed,
                        scoring how, const query_edit& edit = {}) {
  mr::device_pool_resource device;
  std::int64_t longest = 1;
  for (const auto len : p.lengths) longest = std::max(longest, len);
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, test::cache_options(p, longest));
  const auto slots = test::fill(p, cache);
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads;
  const int D = p.shape.head_dim, M = p.cfg.query_tile, kf = p.cfg.top_k_fine, kc = p.cfg.top_k_coarse;

  prefill_run run;
  workload::splitmix64 rng(seed);
  for (int b = 0; b < B; ++b) {
    // The last ~n[b] positions, from the tile boundary at or before len - n[b]
    // (a chunk starts on a tile; its end may cut one).
    select::prefill_segment s;
    const auto len = static_cast<std::int32_t>(p.lengths[static_cast<std::size_t>(b)]);
    s.slot = slots[static_cast<std::size_t>(b)];
    s.q_begin = (len - n[static_cast<std::size_t>(b)]) / M * M;
    s.num_queries = len - s.q_begin;
    for (std::int64_t i = 0; i < std::int64_t{s.num_queries} * Hq * D; ++i)
      run.queries.push_back(from_float<bf16>(static_cast<float>(rng.normal())));
    run.segs.push_back(s);
  }
  int tiles = 0;
  REQUIRE(select::layout_prefill_segments(run.segs.data(), B, M, tiles) == status::success);
  if (edit) edit(run.queries, run.segs);
  dev<bf16> d_q(run.queries);
  dev<select::prefill_segment> d_segs(run.segs);
  dev<std::int32_t> kept(static_cast<std::size_t>(tiles) * Hkv * kf), num(static_cast<std::size_t>(tiles) * Hkv),
      window(static_cast<std::size_t>(tiles)), blocks(static_cast<std::size_t>(tiles) * Hkv * kc);
  kept.poison(nullptr);
  num.poison(nullptr);
  window.poison(nullptr);
  blocks.poison(nullptr);
  select::prefill_selection_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = B;
  a.num_tiles = tiles;
  a.num_q_heads = Hq;
  a.set_cache(cache.ref());
  a.use_tensor_cores = how.tensor_cores;
  a.two_pass = how.two_pass;
  a.max_ring_stages = how.ring_stages;
  // The plain rows, poisoned with finite fp16 values and scales (0x3C
  // bytes): a row the pre-pass did not write would rank wrongly, not fall
  // back.
  const std::int32_t positions = how.plain_positions > 0 ? how.plain_positions : static_cast<std::int32_t>(longest);
  const std::size_t plain_bytes =
      how.plain_segments > 0 ? select::prefill_plain_rows_bytes(cache.ref(), how.plain_segments, positions) : 0;
  dev<unsigned char> plain(plain_bytes);
  HISPARSE_CUDA_CHECK(cudaMemset(plain.ptr, 0x3C, plain.n));
  if (how.plain_segments > 0) {
    a.plain_rows = plain.ptr;
    a.plain_segments = how.plain_segments;
    a.plain_positions = positions;
  }
  REQUIRE(select::select_prefill_async(p.cfg, a,
                                       select::prefill_selection_output{kept.ptr, num.ptr, window.ptr, blocks.ptr}) ==
          status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  run.kept = kept.download();
  run.num = num.download();
  run.window = window.download();
  run.blocks = blocks.download();
  return run;
}

/// "{a, b, ...}" for a failure message.
std::string ids(const std::vector<std::int32_t>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "}";
}

/// Checks each tile of a run against the reference; returns the reference's
/// kept slices per (tile, KV head), in the run's tile order.
std::vector<std::vector<std::int32_t>> check_prefill(const test::problem<bf16>& p, const std::vector<std::int32_t>& n,
                                                     std::uint64_t seed, scoring how = {},
                                                     const query_edit& edit = {}) {
  const prefill_run run = run_prefill(p, n, seed, how, edit);
  const int B = static_cast<int>(p.lengths.size()), Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads;
  const int D = p.shape.head_dim, M = p.cfg.query_tile, kf = p.cfg.top_k_fine, kc = p.cfg.top_k_coarse;
  int equal = 0, total = 0;
  std::vector<std::vector<std::int32_t>> reference_kept(run.num.size());
  std::string first_mismatch;
  for (int b = 0; b < B; ++b) {
    const auto& s = run.segs[static_cast<std::size_t>(b)];
    auto seq = p.sequence(b);
    seq.queries = tensor_view<const bf16, 3>::contiguous(
        run.queries.data() + static_cast<std::size_t>(s.query_offset) * Hq * D, s.num_queries, Hq, D);
    seq.q_begin = s.q_begin;
    const auto r = reference::sparse_attention(p.cfg, p.shape, seq, M);
    REQUIRE(static_cast<std::int32_t>(r.tiles.size()) == select::prefill_tiles(s.q_begin, s.num_queries, M));
    for (std::size_t t = 0; t < r.tiles.size(); ++t) {
      const auto tile = static_cast<std::size_t>(s.tile_offset) + t;
      INFO("sequence " << b << ", tile at " << r.tiles[t].begin);
      REQUIRE(run.window[tile] == r.tiles[t].window_begin);
      for (int h = 0; h < Hkv; ++h) {
        const std::size_t at = tile * Hkv + static_cast<std::size_t>(h);
        const int count = run.num[at];
        REQUIRE(count == static_cast<int>(r.tiles[t].slices[h].kept.size()));
        std::vector<std::int32_t> got(run.kept.begin() + at * kf, run.kept.begin() + at * kf + count);
        for (int i = count; i < kf; ++i) REQUIRE(run.kept[at * kf + i] == -1);
        REQUIRE(std::is_sorted(got.begin(), got.end()));
        // The kept blocks too: ascending, then -1.
        std::vector<std::int32_t> want_blocks = r.tiles[t].blocks[static_cast<std::size_t>(h)].kept;
        want_blocks.resize(static_cast<std::size_t>(kc), -1);
        const bool blocks_equal = std::equal(want_blocks.begin(), want_blocks.end(), run.blocks.begin() + at * kc);
        const bool same = got == r.tiles[t].slices[h].kept && blocks_equal;
        if (!same && first_mismatch.empty())
          first_mismatch = "sequence " + std::to_string(b) + ", tile at " + std::to_string(r.tiles[t].begin) +
                           ", KV head " + std::to_string(h) + ": slices " + ids(got) + " against " +
                           ids(r.tiles[t].slices[h].kept) + (blocks_equal ? "" : "; the blocks differ");
        equal += same ? 1 : 0;
        ++total;
        reference_kept[at] = r.tiles[t].slices[h].kept;
      }
    }
  }
  // Random normal inputs: a near-tie at a boundary (of the blocks or of the
  // slices) is rare, not impossible.
  UNSCOPED_INFO(equal << " of " << total << " (tile, KV head) selections (blocks and slices) equal the reference's");
  if (!first_mismatch.empty()) UNSCOPED_INFO("first difference: " << first_mismatch);
  REQUIRE(equal >= total - 1);
  return reference_kept;
}

/// The two-pass scoring keeps exactly what the one-pass 3xTF32 scoring
/// keeps: blocks, slices, counts and windows, bit for bit.
void check_two_pass_equals_one_pass(const test::problem<bf16>& p, const std::vector<std::int32_t>& n,
                                    std::uint64_t seed) {
  const prefill_run one = run_prefill(p, n, seed, {true, false, 1});
  for (const scoring how : {scoring{true, true, 1}, kFp16Plain}) {
    INFO(name_of(how));
    const prefill_run two = run_prefill(p, n, seed, how);
    REQUIRE(two.window == one.window);
    REQUIRE(two.num == one.num);
    REQUIRE(two.blocks == one.blocks);
    REQUIRE(two.kept == one.kept);
  }
}

/// Keys whose slices repeat: slice s of every head holds the keys of slice
/// s % period (shifted by `step` per repeat when step != 0), so many slice
/// and block summaries tie exactly (step 0) or nearly (a small step).
test::problem<bf16> repeated_slices(test::problem<bf16> p, int period, float step) {
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim, F = p.cfg.fine_slice;
  const std::size_t row = static_cast<std::size_t>(H) * D;
  for (std::size_t b = 0; b < p.keys.size(); ++b) {
    auto& k = p.keys[b];
    const std::int64_t len = p.lengths[b];
    for (std::int64_t t = static_cast<std::int64_t>(period) * F; t < len; ++t) {
      const std::int64_t src = t % (static_cast<std::int64_t>(period) * F);
      const auto repeat = static_cast<float>(t / (static_cast<std::int64_t>(period) * F));
      for (std::size_t j = 0; j < row; ++j)
        k[static_cast<std::size_t>(t) * row + j] =
            from_float<bf16>(to_float(k[static_cast<std::size_t>(src) * row + j]) * (1.0f + step * repeat));
    }
  }
  return p;
}

/// Writes `value` into key dimension `dim` of token `token` of sequence b,
/// every KV head; with `whole_slice`, into every dimension of every key of
/// the token's slice.
void poison_keys(test::problem<bf16>& p, std::size_t b, std::int64_t token, int dim, float value,
                 bool whole_slice = false) {
  const int H = p.shape.num_kv_heads, D = p.shape.head_dim, F = p.cfg.fine_slice;
  const std::int64_t first = whole_slice ? token / F * F : token, last = whole_slice ? first + F : token + 1;
  for (std::int64_t t = first; t < last; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = whole_slice ? 0 : dim; d < (whole_slice ? D : dim + 1); ++d)
        p.keys[b][static_cast<std::size_t>((t * H + h) * D + d)] = from_float<bf16>(value);
}

}  // namespace

TEST_CASE("prefill selection matches the reference tile by tile", "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // A whole short prompt (no far region), prompts ending mid-tile, a long one.
  const auto p = test::make_problem<bf16>({32, 8, 128}, SparseAttentionConfig{}, {300, 5000, 70001}, seed);
  {
    INFO("3xTF32 tensor cores");
    check_prefill(p, {300, 200, 130}, seed + 1, {true, false, 2});
  }
  {
    INFO("fp32 CUDA cores");
    check_prefill(p, {300, 200, 130}, seed + 1, {false, false, 2});
  }
  {
    INFO("plain tf32 then 3xTF32 (two passes), a 1-deep candidate ring");
    check_prefill(p, {300, 200, 130}, seed + 1, {true, true, 1});
  }
  {
    INFO("plain fp16 then 3xTF32, 1- and 2-deep rings");
    check_prefill(p, {300, 200, 130}, seed + 1, kFp16Plain);
    check_prefill(p, {300, 200, 130}, seed + 1, {true, true, 2, 64});
  }
  {
    INFO("plain rows for fewer segments, or ending before the longest: those take one exact pass");
    check_prefill(p, {300, 200, 130}, seed + 1, {true, true, 1, 2});
    check_prefill(p, {300, 200, 130}, seed + 1, {true, true, 1, 64, 6000});
  }
}

TEST_CASE("prefill selection across GQA 1/4, head_dim 64/256, query tiles 16 and 64", "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  const SparseAttentionConfig small{128, 256, 32, 4, 6, 16};
  for (const int group : {1, 4})
    for (const int dim : {64, 256}) {
      INFO("group " << group << ", head_dim " << dim);
      const auto p = test::make_problem<bf16>({2 * group, 2, dim}, small, {33, 1000, 9001}, seed + group * dim);
      check_prefill(p, {33, 100, 77}, seed + 7, {true, true, 2});
      check_prefill(p, {33, 100, 77}, seed + 7, {true, true, 2, 64});
      check_prefill(p, {33, 100, 77}, seed + 7, {false, false, 2});
    }
}

TEST_CASE("two-pass prefill scoring keeps exactly what one 3xTF32 pass keeps", "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // 200 blocks (the coarse stage takes two passes too: > 128 candidates)
  // and 512 fine candidates; a small config where k is 4 of 2k + 1 groups.
  const auto p = test::make_problem<bf16>({8, 2, 128}, SparseAttentionConfig{}, {204800, 9000}, seed);
  {
    INFO("random keys");
    check_two_pass_equals_one_pass(p, {200, 300}, seed + 1);
    check_prefill(p, {200, 300}, seed + 1);
  }
  {
    INFO("slices repeating every 7: exact ties between summaries (most stages fall back)");
    check_two_pass_equals_one_pass(repeated_slices(p, 7, 0.0f), {200, 300}, seed + 2);
  }
  {
    INFO("slices repeating every 24, 2^-9 apart: near-ties inside the bound");
    check_two_pass_equals_one_pass(repeated_slices(p, 24, 0x1p-9f), {200, 300}, seed + 3);
  }
  {
    INFO("constant keys: every score tied");
    const auto c = test::make_problem<bf16>({8, 2, 128}, SparseAttentionConfig{}, {150000}, seed, true);
    check_two_pass_equals_one_pass(c, {130}, seed + 4);
  }
  {
    INFO("head_dim 64 and 256, GQA 1");
    const SparseAttentionConfig small{128, 256, 16, 12, 8, 64};
    for (const int dim : {64, 256}) {
      const auto q = test::make_problem<bf16>({2, 2, dim}, small, {60000}, seed + dim);
      check_two_pass_equals_one_pass(q, {150}, seed + 5);
      check_prefill(q, {150}, seed + 5);
    }
  }
}

TEST_CASE("a prefill segment off a tile boundary is reported by the kernel",
          "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  const auto p = test::make_problem<bf16>({8, 2, 64}, SparseAttentionConfig{}, {5000}, seed);
  const int M = p.cfg.query_tile, Hq = p.shape.num_q_heads, Hkv = p.shape.num_kv_heads, kf = p.cfg.top_k_fine;
  // (layout_prefill_segments refuses it on the host: test_prefill_host.cu.)
  // Built by hand past that check: the kernel writes -1, never a selection.
  mr::device_pool_resource device;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, test::cache_options(p, 5000));
  const auto slots = test::fill(p, cache);
  const std::vector<select::prefill_segment> segs{{slots[0], 4001, 100, 0, 0}};  // 4001: not a multiple of 64
  const int tiles = select::prefill_tiles(4001, 100, M);
  std::vector<bf16> queries(static_cast<std::size_t>(100) * Hq * p.shape.head_dim, from_float<bf16>(0.5f));
  dev<bf16> d_q(queries);
  dev<select::prefill_segment> d_segs(segs);
  dev<std::int32_t> kept(static_cast<std::size_t>(tiles) * Hkv * kf), num(static_cast<std::size_t>(tiles) * Hkv),
      window(static_cast<std::size_t>(tiles));
  // Not the usual poison: its 0xFF bytes already read as -1.
  HISPARSE_CUDA_CHECK(cudaMemset(kept.ptr, 0x11, kept.n * sizeof(std::int32_t)));
  HISPARSE_CUDA_CHECK(cudaMemset(num.ptr, 0x11, num.n * sizeof(std::int32_t)));
  select::prefill_selection_arguments<bf16> a;
  a.queries = d_q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = 1;
  a.num_tiles = tiles;
  a.num_q_heads = Hq;
  a.set_cache(cache.ref());
  REQUIRE(select::select_prefill_async(p.cfg, a, select::prefill_selection_output{kept.ptr, num.ptr, window.ptr}) ==
          status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  for (const auto c : num.download()) REQUIRE(c == -1);
  for (const auto s : kept.download()) REQUIRE(s == -1);
}

TEST_CASE("prefill selection ranks NaN scores last and infinite ones as numbers", "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // 19 blocks (all kept: the fine stage ranks ~300 slices in two passes,
  // whose plain scores are not finite), 68 (a one-pass coarse stage) and 146
  // (a two-pass coarse stage). In every sequence: slice 5 all NaN; slice 40
  // +inf and slice 100 -inf in one dimension (either scores +inf against a
  // tile whose queries take both signs there); block 10 a +inf slice and a
  // -inf slice (its mean NaN); slice 200 one NaN. The reference ranks NaN
  // below everything and infinities as numbers; 3xTF32 alone would turn the
  // infinities into NaN (inf - inf in the split, 0 * inf in the cross
  // products).
  auto p = test::make_problem<bf16>({8, 2, 128}, SparseAttentionConfig{}, {20000, 70000, 150000}, seed);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const int F = p.cfg.fine_slice;
  for (std::size_t b = 0; b < p.lengths.size(); ++b) {
    poison_keys(p, b, 5 * F, 0, nan, /*whole_slice=*/true);
    poison_keys(p, b, 40 * F, 0, inf);
    poison_keys(p, b, 100 * F + 7, 3, -inf);
    poison_keys(p, b, 161 * F + 1, 1, inf);
    poison_keys(p, b, 162 * F + 2, 1, -inf);
    poison_keys(p, b, 200 * F + 9, 5, nan);
  }
  const std::vector<std::int32_t> n{130, 130, 130};
  for (const scoring& how : kEveryScoring) {
    INFO(name_of(how));
    const auto kept = check_prefill(p, n, seed + 1, how);
    // The test tests something: the reference keeps the infinite slices.
    int infinite = 0;
    for (const auto& k : kept)
      infinite += static_cast<int>(std::count(k.begin(), k.end(), 40) + std::count(k.begin(), k.end(), 100));
    CHECK(infinite > 0);
  }
}

TEST_CASE("prefill selection of tiles with a NaN or an infinite query", "[gpu][select][prefill]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  // Sequence 0's second tile has a NaN in one query: every score of its
  // first KV head is NaN (the max over queries), so the lowest blocks and
  // slices are kept (ties to the lower index). Sequence 1's first tile has
  // +inf in one query dimension of its second KV head: scores +inf where the
  // summary is positive there, the other queries' maximum elsewhere.
  const auto p = test::make_problem<bf16>({8, 2, 128}, SparseAttentionConfig{}, {20000, 70000}, seed);
  const int Hq = p.shape.num_q_heads, D = p.shape.head_dim;
  const query_edit poison = [&](std::vector<bf16>& q, const std::vector<select::prefill_segment>& segs) {
    const auto at = [&](const select::prefill_segment& s, std::int32_t position, int head, int dim) {
      return static_cast<std::size_t>((std::int64_t{s.query_offset} + position - s.q_begin) * Hq + head) * D +
             static_cast<std::size_t>(dim);
    };
    const int M = p.cfg.query_tile;
    q[at(segs[0], segs[0].q_begin + M + 6, 2, 9)] = from_float<bf16>(std::numeric_limits<float>::quiet_NaN());
    q[at(segs[1], segs[1].q_begin + 10, 5, 4)] = from_float<bf16>(std::numeric_limits<float>::infinity());
  };
  const std::vector<std::int32_t> n{130, 130};
  std::vector<std::int32_t> lowest(static_cast<std::size_t>(p.cfg.top_k_fine));
  std::iota(lowest.begin(), lowest.end(), 0);
  for (const scoring& how : kEveryScoring) {
    INFO(name_of(how));
    const auto kept = check_prefill(p, n, seed + 1, how, poison);
    // Sequence 0's second tile (tile 1), KV head 0: slices 0-15.
    CHECK(kept[static_cast<std::size_t>(1 * p.shape.num_kv_heads + 0)] == lowest);
  }
}
