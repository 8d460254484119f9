// The prefill selection's and the composed prefill's host sides need no
// device: segment layout, sizes, plans and every argument check answer
// before any CUDA call, so they are CPU tests.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <cuda_fp16.h>
#include <vector>

#include "hisparse/runtime/hierarchical_prefill.cuh"
#include "hisparse/select/prefill_selection.cuh"
#include "workload/synthetic.hpp"

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
  // Past the longest context (2^30): refused, not wrapped past int32.
  CHECK(bad(segment(1, (1 << 30) - 64, 64), 64) == status::success);
  tiles = -7;
  CHECK(bad(segment(1, (1 << 30) - 64, 65), 64) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("past the longest context"));
  CHECK(bad(segment(1, 0x7FFFFFC0, 128), 64) == status::invalid_argument);
  CHECK(tiles == -7);  // not written on failure
  CHECK(select::layout_prefill_segments(nullptr, 0, 64, tiles) == status::invalid_argument);
}

TEST_CASE("select_prefill_async rejects bad input before touching the device", "[select][prefill][errors]") {
  // Pointers are never dereferenced on the host: any non-null (and, for the
  // queries, 16-byte aligned) address works.
  static float sums[1];
  static __nv_bfloat16 q alignas(16)[8];
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
  // Beyond what a CTA holds: the config itself is invalid (config.hpp's limits).
  rejects([](args&, SparseAttentionConfig& c, outs&) { c.query_tile = 128; }, status::invalid_argument, "query_tile");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.queries = nullptr; }, status::invalid_argument,
          "must not be null");
  // The kernel reads eight query elements at a time (16-byte loads).
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.queries = q + 1; }, status::invalid_argument,
          "queries must be 16-byte aligned");
  rejects([](args&, SparseAttentionConfig&, outs& o) { o.window_begin = nullptr; }, status::invalid_argument,
          "must not be null");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.layer = 2; }, status::invalid_argument, "layer");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.fine_slice = 32; }, status::invalid_argument,
          "slice/block sizes");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.max_blocks = 8192; }, status::unsupported,
          "4096 blocks");
  rejects([](args&, SparseAttentionConfig& c, outs&) { c.top_k_coarse = 512; }, status::invalid_argument,
          "top_k_coarse");
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.num_q_heads = 12; }, status::invalid_argument,
          "num_q_heads");
  // The fp16 plain pass's rows: 16-byte loads, a capacity to lay them out.
  static unsigned char plain alignas(16)[32];
  rejects([](args& b, SparseAttentionConfig&, outs&) { b.plain_rows = plain + 8; }, status::invalid_argument,
          "plain_rows must be 16-byte aligned");
  rejects(
      [](args& b, SparseAttentionConfig&, outs&) {
        b.plain_rows = plain;
        b.plain_positions = 4096;
      },
      status::invalid_argument, "plain_rows needs plain_segments");
  rejects(
      [](args& b, SparseAttentionConfig&, outs&) {
        b.plain_rows = plain;
        b.plain_segments = 1;
      },
      status::invalid_argument, "plain_rows needs plain_segments");
  rejects(
      [](args& b, SparseAttentionConfig&, outs&) {
        b.plain_rows = plain;
        b.plain_segments = 1;
        b.plain_positions = 4096 * 64 + 1;
      },
      status::invalid_argument, "plain_positions in [1, the cache's positions]");
  CHECK(select::prefill_plain_rows_bytes(a, 3, 262144) == std::size_t{3} * 8 * (4096 + 256) * (128 + 8) * 2);
  CHECK(select::prefill_plain_rows_bytes(a, 0, 262144) == 0);
  // A valid config the GPU prefill selection cannot run: said, not ignored.
  rejects([](args&, SparseAttentionConfig& c, outs&) { c.coarse_summary = coarse_summary::key_bounds; },
          status::unsupported, "coarse_summary key_bounds is not built on the GPU");
}

TEST_CASE("the decode selection needs block bounds for coarse key bounds, and entries for a TopK rule",
          "[select][errors]") {
  static float sums[1];
  static __nv_bfloat16 q[1];
  static std::int32_t ints[1];
  select::decode_selection_arguments<__nv_bfloat16> a;
  a.queries = q;
  a.slots = ints;
  a.batch = 1;
  a.num_q_heads = 32;
  a.kv_heads = 8;
  a.head_dim = 128;
  a.slice_sums = sums;
  a.block_sums = sums;
  a.lengths = ints;
  a.layers = 1;
  SparseAttentionConfig cfg;
  a.fine_slice = cfg.fine_slice;
  a.coarse_block = cfg.coarse_block;
  a.max_blocks = 256;
  REQUIRE(select::can_implement_decode_selection(cfg, a) == status::success);
  cfg.coarse_summary = coarse_summary::key_bounds;  // beside slice means: not built
  CHECK(select::can_implement_decode_selection(cfg, a) == status::unsupported);
  CHECK_THAT(last_error(), Catch::Contains("beside fine_summary key_bounds only"));
  cfg.fine_summary = fine_summary::key_bounds;
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("keeps no block key bounds"));
  static std::uint32_t words[1];
  a.block_bounds = words;  // without the slices' bounds (a partial block's range): still refused
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  a.fine = fine_summary::key_bounds;
  a.fine_rows = words;
  CHECK(select::can_implement_decode_selection(cfg, a) == status::success);
  a.block_bounds = nullptr;
  a.fine = fine_summary::mean;
  a.fine_rows = nullptr;
  cfg = SparseAttentionConfig{};
  cfg.refresh.every = 4;
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("keeps none") && Catch::Contains("topk_cache_slices >= top_k_fine (16)"));
  static std::int32_t entries[1];
  a.topk = {entries, 8, kv::topk_cache_ref::words(8, 128)};  // entries narrower than top_k_fine
  CHECK(select::can_implement_decode_selection(cfg, a) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("entries of 8 slices"));
  a.topk.slices = 16;
  CHECK(select::can_implement_decode_selection(cfg, a) == status::success);
  a.topk = {};
  cfg.refresh = {1, 0.9f};  // a cosine test beside refreshing every step changes nothing
  CHECK(select::can_implement_decode_selection(cfg, a) == status::success);
}

/// The tensor-core kernels' query layout against the mma.m16n8k8 (tf32) A
/// fragment: lane g * 4 + q4 holds A[g][k], A[g + 8][k], A[g][k + 4],
/// A[g + 8][k + 4] for k = q4; and the dims it maps to each k must be the
/// ones the kernel loads for B from a row-major candidate row (k-step s =
/// 2 j + h of load j reads dims 32 (j / 2) + 8 q4 + 4 (j % 2) + 2 h and + 1).
template <int D>
void check_fragment_layout() {
  INFO("head_dim " << D);
  std::vector<int> hits(64 * D, 0);
  for (int i = 0; i < 64; ++i)
    for (int d = 0; d < D; ++d) {
      const int off = select::detail::prefill_fragment_offset<D>(i, d);
      REQUIRE(off >= 0);
      REQUIRE(off < 64 * D);
      ++hits[static_cast<std::size_t>(off)];
    }
  for (const int h : hits) REQUIRE(h == 1);  // a bijection onto 64 D floats
  for (int qb = 0; qb < 4; ++qb)
    for (int s = 0; s < D / 8; ++s)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, q4 = lane % 4;
        const int j = s / 2, h = s % 2;  // the B load j (16 dims) and its half
        const int b_dim = 32 * (j / 2) + 8 * q4 + 4 * (j % 2) + 2 * h;  // B's k = q4; k = q4 + 4 at + 1
        const int base = ((qb * (D / 8) + s) * 32 + lane) * 4;
        // elements 0..3: (row g, k), (row g + 8, k), (row g, k + 4), (row g + 8, k + 4)
        CHECK(select::detail::prefill_fragment_offset<D>(16 * qb + g, b_dim) == base + 0);
        CHECK(select::detail::prefill_fragment_offset<D>(16 * qb + g + 8, b_dim) == base + 1);
        CHECK(select::detail::prefill_fragment_offset<D>(16 * qb + g, b_dim + 1) == base + 2);
        CHECK(select::detail::prefill_fragment_offset<D>(16 * qb + g + 8, b_dim + 1) == base + 3);
      }
}

TEST_CASE("prefill queries in mma fragment order: a bijection that agrees with the B loads", "[select][prefill]") {
  check_fragment_layout<64>();
  check_fragment_layout<128>();
  check_fragment_layout<256>();
}

/// x with its low 13 mantissa bits cleared (truncate = true) or rounded
/// to nearest: the two ways a tensor core may read fp32 bits as tf32.
float to_tf32(float x, bool truncate) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (!truncate) u += 0x1000u;  // round half away (finite inputs well below overflow)
  u &= 0xFFFFE000u;
  std::memcpy(&x, &u, sizeof u);
  return x;
}

/// A query and a row for the plain passes' bound tests: the query's entries
/// span 40 binades, the row's are normal; their exact dot product and
/// squared norms in fp64.
struct bound_trial {
  std::vector<float> q, c;
  double exact = 0, q2 = 0, c2 = 0;
  bound_trial(workload::splitmix64& rng, int D) : q(static_cast<std::size_t>(D)), c(static_cast<std::size_t>(D)) {
    for (std::size_t d = 0; d < q.size(); ++d) {
      const double mag = std::ldexp(1.0 + rng.uniform(), static_cast<int>(rng.next() % 41) - 20);
      q[d] = static_cast<float>(rng.next() & 1 ? mag : -mag);
      c[d] = static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(rng.next() % 9) - 4));
    }
    for (std::size_t d = 0; d < q.size(); ++d) {
      exact += static_cast<double>(q[d]) * c[d];
      q2 += static_cast<double>(q[d]) * q[d];
      c2 += static_cast<double>(c[d]) * c[d];
    }
  }
};

/// |plain - exact| within half the bound (the other half is the 3xTF32
/// score's own error) for every plain score plain_of(trial) gives, over
/// 20000 trials at D = 64, 128, 256; returns the largest ratio to the bound.
template <class PlainOf>
double worst_plain_error(std::uint64_t seed, PlainOf plain_of) {
  workload::splitmix64 rng(seed);
  double worst = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const bound_trial b(rng, trial % 3 == 0 ? 64 : trial % 3 == 1 ? 128 : 256);
    const float delta = select::detail::bound_tf32_delta(static_cast<float>(b.q2), static_cast<float>(b.c2));
    for (const float plain : plain_of(b)) {
      const double err = std::abs(plain - b.exact);
      worst = std::max(worst, err / delta);
      REQUIRE(err <= 0.5 * delta);
    }
  }
  return worst;
}
/// fp32 sums of f(q_d) g(c_d), forward and backward.
template <class F, class G>
std::vector<float> both_orders(const bound_trial& b, F f, G g) {
  float forward = 0, backward = 0;
  const int D = static_cast<int>(b.q.size());
  for (int d = 0; d < D; ++d) forward += f(b.q[static_cast<std::size_t>(d)]) * g(b.c[static_cast<std::size_t>(d)]);
  for (int d = D - 1; d >= 0; --d) backward += f(b.q[static_cast<std::size_t>(d)]) * g(b.c[static_cast<std::size_t>(d)]);
  return {forward, backward};
}

TEST_CASE("prefill two passes: the rule, and the bound against emulated tf32 products", "[select][prefill]") {
  using select::detail::prefill_two_pass;
  // More than two rounds of 64 candidates, and room for 2k in the exact list.
  CHECK_FALSE(prefill_two_pass(128, 16));
  CHECK(prefill_two_pass(129, 16));
  CHECK(prefill_two_pass(512, 64));
  CHECK_FALSE(prefill_two_pass(512, 65));
  CHECK_FALSE(prefill_two_pass(4096, 128));

  // Entries over 40 binades, summed in fp32 in either order, operands cut
  // or rounded to tf32.
  const double worst = worst_plain_error(17, [](const bound_trial& b) {
    std::vector<float> all;
    for (const bool truncate : {true, false}) {
      const auto cut = [truncate](float x) { return to_tf32(x, truncate); };
      for (const float v : both_orders(b, cut, cut)) all.push_back(v);
    }
    return all;
  });
  UNSCOPED_INFO("largest |plain - exact| / delta: " << worst);
  CHECK(worst > 0.0);
}

/// x times 2^e rounded to fp16 and scaled back: what the fp16 plain pass
/// multiplies (exact in fp32 for the ranges here).
float to_fp16_scaled(float x, int e) {
  return __half2float(__float2half_rn(std::ldexp(x, e))) * std::ldexp(1.0f, -e);
}
int largest_bits(const std::vector<float>& v) {
  float top = 0;
  for (const float x : v) top = std::max(top, std::abs(x));
  std::uint32_t u;
  std::memcpy(&u, &top, sizeof u);
  return static_cast<int>(u);
}

TEST_CASE("the fp16 plain pass: its scales, and the bound against emulated fp16 products", "[select][prefill]") {
  using select::detail::plain_f16_exponent;
  auto bits = [](float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
  };
  // The largest element lands in [2^14, 2^15); zero, subnormal and
  // non-finite rows get a finite scale.
  for (const float x : {1.0f, 0.75f, 3.0e-30f, 6.5e4f, 1.0e30f, 1.0e-33f, 3.4e38f}) {
    const float scaled = std::ldexp(x, plain_f16_exponent(bits(x)));
    CHECK(scaled >= 16384.0f);
    CHECK(scaled < 32768.0f);
  }
  // Below 2^-112 the scale stops at 2^126 (2^-126 lands on 1, under fp16's top).
  CHECK(std::ldexp(1.17549435e-38f, plain_f16_exponent(bits(1.17549435e-38f))) == 1.0f);
  CHECK(plain_f16_exponent(0) == 126);
  CHECK(plain_f16_exponent(bits(1e-40f)) == 126);
  CHECK(plain_f16_exponent(bits(INFINITY)) == -114);
  CHECK(plain_f16_exponent(bits(NAN)) == -114);

  // As for tf32: the queries scaled by their norm, the row by its largest element.
  const double worst = worst_plain_error(23, [&](const bound_trial& b) {
    const int eq = plain_f16_exponent(bits(std::sqrt(static_cast<float>(b.q2))));
    const int ec = plain_f16_exponent(static_cast<std::uint32_t>(largest_bits(b.c)));
    return both_orders(
        b, [eq](float x) { return to_fp16_scaled(x, eq); }, [ec](float x) { return to_fp16_scaled(x, ec); });
  });
  UNSCOPED_INFO("largest |plain fp16 - exact| / delta: " << worst);
  CHECK(worst > 0.0);
}

/// The fp16 plain pass's operand layouts, emulated lane by lane through
/// m16n8k16's fragment definition: query fragments (prefill_half_fragment_word)
/// and row pieces must pair the same dims, and a stage's pieces must tile it.
template <int D>
void check_fp16_layouts() {
  using select::detail::prefill_half_fragment_word;
  using select::detail::plain_piece_offset;
  constexpr int kQ = 64, kN = 64;
  // Every (query, dim pair) has its own word, inside the queries' region.
  std::vector<int> word_of(kQ * D / 2, -1);
  for (int i = 0; i < kQ; ++i)
    for (int d = 0; d < D; d += 2) {
      const int w = prefill_half_fragment_word<D>(i, d);
      REQUIRE(w >= 0);
      REQUIRE(w < kQ * D / 2);
      REQUIRE(word_of[static_cast<std::size_t>(w)] == -1);
      word_of[static_cast<std::size_t>(w)] = i * D + d;
    }
  // Integer operands (exact): the emulated mma over the layouts equals the
  // plain dot products.
  std::vector<float> q(kQ * D), rows(kN * D);
  for (std::size_t j = 0; j < q.size(); ++j) q[j] = static_cast<float>(static_cast<int>(j * 7 % 13) - 6);
  for (std::size_t j = 0; j < rows.size(); ++j) rows[j] = static_cast<float>(static_cast<int>(j * 5 % 11) - 5);
  auto half_of = [&](int word, int which) {  // the query element a word's half holds
    const int at = word_of[static_cast<std::size_t>(word)];
    return q[static_cast<std::size_t>(at + which)];
  };
  for (int qb = 0; qb < kQ / 16; ++qb)
    for (int nb = 0; nb < kN / 8; ++nb) {
      double acc[16][8] = {};
      for (int s = 0; s < D / 16; ++s) {
        float A[16][16], B[16][8];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, q4 = lane % 4;
          const int base = ((qb * (D / 16) + s) * 32 + lane) * 4;
          for (int j = 0; j < 2; ++j) {
            A[g][2 * q4 + j] = half_of(base + 0, j);
            A[g + 8][2 * q4 + j] = half_of(base + 1, j);
            A[g][2 * q4 + 8 + j] = half_of(base + 2, j);
            A[g + 8][2 * q4 + 8 + j] = half_of(base + 3, j);
          }
          // Row n = 8nb + g, logical piece 4J + q4 (8 halves): words x, y
          // for k-step 2J, z, w for 2J + 1.
          const int J = s / 2, h = s % 2, n = 8 * nb + g;
          const float* piece = rows.data() + static_cast<std::size_t>(n) * D + (4 * J + q4) * 8;
          for (int j = 0; j < 2; ++j) {
            B[2 * q4 + j][g] = piece[4 * h + j];
            B[2 * q4 + 8 + j][g] = piece[4 * h + 2 + j];
          }
        }
        for (int m = 0; m < 16; ++m)
          for (int n = 0; n < 8; ++n)
            for (int k = 0; k < 16; ++k) acc[m][n] += static_cast<double>(A[m][k]) * B[k][n];
      }
      for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 8; ++n) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += static_cast<double>(q[static_cast<std::size_t>((16 * qb + m) * D + d)]) *
                   rows[static_cast<std::size_t>((8 * nb + n) * D + d)];
          REQUIRE(acc[m][n] == dot);
        }
    }
  // A stage: 64 rows of D halves, then the queries (64 D halves), then 64
  // tails of 16 bytes; every piece once, 16-byte aligned, never the queries'.
  const int stage = kN * (D + 4) * 4;
  std::vector<char> used(static_cast<std::size_t>(stage), 0);
  for (int c = 0; c < kN; ++c)
    for (int piece = 0; piece <= D / 8; ++piece) {
      const int at = plain_piece_offset<D>(c, piece);
      REQUIRE(at % 16 == 0);
      REQUIRE(at + 16 <= stage);
      REQUIRE_FALSE((at >= kN * D * 2 && at < kN * D * 4));
      for (int b = 0; b < 16; ++b) {
        REQUIRE(used[static_cast<std::size_t>(at + b)] == 0);
        used[static_cast<std::size_t>(at + b)] = 1;
      }
    }
}

TEST_CASE("the fp16 plain pass's fragment layouts pair the same dims", "[select][prefill]") {
  check_fp16_layouts<64>();
  check_fp16_layouts<128>();
  check_fp16_layouts<256>();
}

TEST_CASE("the composed prefill checks, sizes and plans on the host", "[runtime][prefill][errors]") {
  using bf16 = __nv_bfloat16;
  // Shape-only arguments: checks and sizes never dereference these.
  static bf16 dummy alignas(16)[8]{};
  static bf16* table[1]{dummy};
  static std::int32_t lengths[1]{};
  static const select::prefill_segment seg{};
  prefill_step_arguments<bf16> a;
  a.queries = dummy;
  a.segments = &seg;
  a.num_segments = 1;
  a.num_tiles = 4096;
  a.num_q_heads = 32;
  a.out = dummy;
  a.cache.layers = 1;
  a.cache.kv_heads = 8;
  a.cache.head_dim = 128;
  a.cache.fine_slice = 64;
  a.cache.coarse_block = 1024;
  a.cache.max_slices = 4096;  // 256K positions a sequence
  a.cache.page_table = table;
  a.cache.lengths = lengths;
  const SparseAttentionConfig cfg;
  hierarchical_prefill<bf16> op(cfg);
  REQUIRE(op.can_implement(a) == status::success);
  std::size_t bytes = 0;
  REQUIRE(op.workspace_bytes(a, bytes) == status::success);
  // kept slices, counts, window starts, and the plain pass's fp16 rows (one
  // segment of the cache's 256K positions: 4096 slices and 256 blocks a KV
  // head, D + 8 halves each): each part 256-byte aligned.
  auto aligned = [](std::size_t b) { return (b + 255) / 256 * 256; };
  CHECK(bytes == aligned(4096 * 8 * 16 * 4) + aligned(4096 * 8 * 4) + aligned(4096 * 4) +
                     aligned((4096 + 256) * 8 * (128 + 8) * 2));
  {  // rows for every segment, each of the cache's length (a later, longer chunk keeps them)
    auto more_segments = a;
    more_segments.num_segments = 3;
    more_segments.max_end = 100000;
    std::size_t b2 = 0;
    REQUIRE(op.workspace_bytes(more_segments, b2) == status::success);
    CHECK(b2 == aligned(4096 * 8 * 16 * 4) + aligned(4096 * 8 * 4) + aligned(4096 * 4) +
                    aligned(std::size_t{3} * (4096 + 256) * 8 * (128 + 8) * 2));
  }
  std::vector<char> ws(bytes);
  CHECK(op.plan(a, ws.data(), bytes - 1) == status::invalid_argument);
  CHECK(op.rebind(a) == status::invalid_argument);  // before plan
  REQUIRE(op.plan(a, ws.data(), bytes) == status::success);
  CHECK_FALSE(op.runs_dense());  // max_end unknown: sparse
  auto more = a;
  more.num_tiles = 4097;
  CHECK(op.rebind(more) == status::invalid_argument);
  // Another shape in the same workspace: its parts were laid out for 8 KV
  // heads (16 would write the kept slices past them).
  auto other = a;
  other.cache.kv_heads = 16;
  REQUIRE(op.can_implement(other) == status::success);
  CHECK(op.rebind(other) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("plan again"));
  other = a;
  other.num_q_heads = 16;
  CHECK(op.rebind(other) == status::invalid_argument);
  // A prompt of 1500 tokens: its last tile's far region is 15 slices, fewer
  // than top_k_fine: the selection would keep all of them.
  auto short_prompt = a;
  short_prompt.num_tiles = 24;
  short_prompt.max_end = 1500;
  REQUIRE(op.rebind(short_prompt) == status::success);
  CHECK(op.runs_dense());
  short_prompt.max_end = 1600;  // 16 far slices: still every one kept
  REQUIRE(op.rebind(short_prompt) == status::success);
  CHECK(op.runs_dense());
  short_prompt.max_end = 1601;  // the last tile starts at 1600: 17 far slices
  short_prompt.num_tiles = 26;
  REQUIRE(op.rebind(short_prompt) == status::success);
  CHECK_FALSE(op.runs_dense());
  // Bad shapes are refused by the stage that cannot take them.
  auto bad = a;
  bad.num_q_heads = 12;  // not a multiple of 8 KV heads
  CHECK(op.can_implement(bad) == status::invalid_argument);
  bad = a;
  bad.cache.head_dim = 96;
  CHECK(op.can_implement(bad) == status::invalid_argument);
  bad = a;
  bad.max_end = -1;
  CHECK(op.can_implement(bad) == status::invalid_argument);
  // Positions past what the cache holds a sequence: refused before the
  // selection would rank blocks past the cache's rows.
  bad.max_end = 262144;
  CHECK(op.can_implement(bad) == status::success);
  bad.max_end = 262145;
  CHECK(op.can_implement(bad) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("past the cache's 262144 positions"));
  // Queries and outputs move 16 bytes at a time.
  bad = a;
  bad.queries = dummy + 1;
  CHECK(op.can_implement(bad) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("16-byte aligned"));
  bad = a;
  bad.out = dummy + 4;
  CHECK(op.can_implement(bad) == status::invalid_argument);
  SparseAttentionConfig wide = cfg;
  wide.query_tile = 128;  // wider than the config allows (and the tile's block_q)
  CHECK(hierarchical_prefill<bf16>(wide).can_implement(a) == status::invalid_argument);
}
