// The activation top-k gating reference against hand-built rows and an
// independent brute force: the kept columns, their order and ties, NaN,
// per-row K and thresholds, the gated GEMV, and bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "hisparse/reference/activation_topk.hpp"
#include "test_support.hpp"

using namespace hisparse;

namespace {

using view = tensor_view<const double, 2>;

std::vector<std::int32_t> row_indices(const reference::gated_rows& g, std::int64_t r) {
  const auto* p = &g.indices[static_cast<std::size_t>(r * g.k_max)];
  return {p, p + g.counts[static_cast<std::size_t>(r)]};
}

}  // namespace

TEST_CASE("activation top-k keeps the largest |a| g, ascending, with the activations beside", "[reference][gating]") {
  const std::vector<double> a{3, -5, 1, 4, -4, 0.5};
  const std::vector<double> g{1, 0.5, 2, 1, 1, 4};  // scores 3, 2.5, 2, 4, 4, 2
  const auto r = reference::activation_topk(view::contiguous(a.data(), 1, 6), std::span<const double>(g), {}, 3);
  CHECK(row_indices(r, 0) == std::vector<std::int32_t>{0, 3, 4});  // 4 and 4 tie: both kept, then 3
  CHECK(r.values[0] == 3.0);
  CHECK(r.values[1] == 4.0);
  CHECK(r.values[2] == -4.0);  // the activation itself, sign kept
  // Two slots: the tie at 4 goes to the lower index.
  const auto two = reference::activation_topk(view::contiguous(a.data(), 1, 6), std::span<const double>(g), {}, 2);
  CHECK(row_indices(two, 0) == std::vector<std::int32_t>{3, 4});
  const std::vector<std::int32_t> k{1};
  const auto one = reference::activation_topk(view::contiguous(a.data(), 1, 6), std::span<const double>(g),
                                              std::span<const std::int32_t>(k), 2);
  CHECK(row_indices(one, 0) == std::vector<std::int32_t>{3});
  CHECK(one.indices[1] == -1);  // padding
  CHECK(one.values[1] == 0.0);
}

TEST_CASE("activation top-k ranks the fp32 product, so products that round together tie", "[reference][gating]") {
  // 3 (1 + 2^-23) = 3 + 1.5 ulp rounds (to even) to 3 + 2 ulp, the score of
  // column 1 exactly (ulp = 2^-22 at 3): the exact products differ, the fp32
  // ones tie, and the tie goes to the lower index.
  const double ulp = std::ldexp(1.0, -22);
  const std::vector<double> a{3.0, 3.0 + 2 * ulp};
  const std::vector<double> g{1.0 + ulp / 2, 1.0};
  CHECK(reference::score(a[0], g[0]) == reference::score(a[1], g[1]));
  CHECK(a[0] * g[0] < a[1] * g[1]);
  const auto r = reference::activation_topk(view::contiguous(a.data(), 1, 2), std::span<const double>(g), {}, 1);
  CHECK(row_indices(r, 0) == std::vector<std::int32_t>{0});
}

TEST_CASE("activation top-k: NaN ranks last, per-row K (0 included) and thresholds", "[reference][gating]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> a{nan, 1, -2, 0, 3, 0, -1, 2};  // two rows of four
  const std::vector<double> g{1, 1, 1, 1};
  const auto v = view::contiguous(a.data(), 2, 4);
  const std::vector<std::int32_t> k{4, 0};
  const auto r = reference::activation_topk(v, std::span<const double>(g), std::span<const std::int32_t>(k), 4);
  CHECK(row_indices(r, 0) == std::vector<std::int32_t>{0, 1, 2, 3});  // NaN kept only as the last of four
  CHECK(row_indices(r, 1).empty());
  const auto three = reference::activation_topk(v, std::span<const double>(g), {}, 3);
  CHECK(row_indices(three, 0) == std::vector<std::int32_t>{1, 2, 3});  // NaN left out
  CHECK(row_indices(three, 1) == std::vector<std::int32_t>{0, 2, 3});  // 3, 2, |-1| beat 0
  const auto t = reference::activation_topk_threshold(v, std::span<const double>(g), 1.0, 4);
  CHECK(row_indices(t, 0) == std::vector<std::int32_t>{1, 2});  // >= 1, never NaN
  CHECK(row_indices(t, 1) == std::vector<std::int32_t>{0, 2, 3});
  const auto capped = reference::activation_topk_threshold(v, std::span<const double>(g), 1.0, 2);
  CHECK(row_indices(capped, 1) == std::vector<std::int32_t>{0, 3});  // the two best of the three
}

TEST_CASE("activation top-k and the gated GEMV match brute force on random rows", "[reference][gating]") {
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const std::int64_t rows = 5, n = 300, outs = 7;
  std::vector<double> a(static_cast<std::size_t>(rows * n)), g(static_cast<std::size_t>(n)),
      w(static_cast<std::size_t>(outs * n));
  for (auto& x : a) x = rng.normal();
  for (auto& x : g) x = rng.uniform() + 0.1;
  for (auto& x : w) x = rng.normal();
  std::vector<std::int32_t> k(static_cast<std::size_t>(rows));
  for (auto& x : k) x = static_cast<std::int32_t>(rng.below(n / 2));
  const auto r = reference::activation_topk(view::contiguous(a.data(), rows, n), std::span<const double>(g),
                                            std::span<const std::int32_t>(k), static_cast<int>(n / 2));
  const auto y = reference::gated_gemv(view::contiguous(w.data(), outs, n), r);
  for (std::int64_t row = 0; row < rows; ++row) {
    // Brute force: sort columns by score (desc), index (asc); keep k.
    std::vector<std::int32_t> order(static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
    auto score = [&](std::int32_t i) {
      return std::abs(static_cast<float>(a[static_cast<std::size_t>(row * n + i)])) * static_cast<float>(g[static_cast<std::size_t>(i)]);
    };
    std::stable_sort(order.begin(), order.end(), [&](auto x, auto y2) { return score(x) > score(y2); });
    std::vector<std::int32_t> kept(order.begin(), order.begin() + k[static_cast<std::size_t>(row)]);
    std::sort(kept.begin(), kept.end());
    REQUIRE(row_indices(r, row) == kept);
    for (std::int64_t o = 0; o < outs; ++o) {
      double acc = 0;
      for (const auto i : kept) acc += w[static_cast<std::size_t>(o * n + i)] * a[static_cast<std::size_t>(row * n + i)];
      CHECK(y[static_cast<std::size_t>(row * outs + o)] == Approx(acc).margin(1e-12));
    }
  }
  // Every column kept: the dense product.
  const auto all = reference::activation_topk(view::contiguous(a.data(), rows, n), std::span<const double>(g), {},
                                              static_cast<int>(n));
  const auto dense = reference::gated_gemv(view::contiguous(w.data(), outs, n), all);
  for (std::int64_t row = 0; row < rows; ++row)
    for (std::int64_t o = 0; o < outs; ++o) {
      double acc = 0;
      for (std::int64_t i = 0; i < n; ++i) acc += w[static_cast<std::size_t>(o * n + i)] * a[static_cast<std::size_t>(row * n + i)];
      CHECK(dense[static_cast<std::size_t>(row * outs + o)] == Approx(acc).margin(1e-12));
    }
}

TEST_CASE("activation top-k rejects bad input", "[reference][gating][errors]") {
  const std::vector<double> a(8, 1.0), g(4, 1.0), short_gate(3, 1.0);
  const auto v = view::contiguous(a.data(), 2, 4);
  CHECK_THROWS_WITH(reference::activation_topk(v, std::span<const double>(short_gate), {}, 2),
                    Catch::Contains("gate"));
  CHECK_THROWS_WITH(reference::activation_topk(v, std::span<const double>(g), {}, 5), Catch::Contains("k_max"));
  CHECK_THROWS_WITH(reference::activation_topk(v, std::span<const double>(g), {}, 0), Catch::Contains("k_max"));
  const std::vector<std::int32_t> too_many{3, 1}, one{1};
  CHECK_THROWS_WITH(reference::activation_topk(v, std::span<const double>(g), std::span<const std::int32_t>(too_many), 2),
                    Catch::Contains("row 0"));
  CHECK_THROWS_WITH(reference::activation_topk(v, std::span<const double>(g), std::span<const std::int32_t>(one), 2),
                    Catch::Contains("one K per row"));
  // Columns past int32: rejected before anything is read (the view is never dereferenced).
  const auto wide = view::contiguous(a.data(), 1, std::int64_t{1} << 31);
  CHECK_THROWS_WITH(reference::activation_topk(wide, std::span<const double>(g), {}, 2), Catch::Contains("2^31"));
  CHECK_THROWS_WITH(reference::activation_topk_threshold(v, std::span<const double>(g), std::nanf(""), 2),
                    Catch::Contains("NaN"));
  const std::vector<double> w(12, 1.0);
  const auto r = reference::activation_topk(v, std::span<const double>(g), {}, 2);
  CHECK_THROWS_WITH(reference::gated_gemv(view::contiguous(w.data(), 4, 3), r), Catch::Contains("columns"));
}
