#pragma once
// fp64 CPU reference of activation top-k gating: per row of activations
// A [rows][n] keep the K largest |A_i| g_i (gate weights g [n]) and emit
// their column indices (int32, ascending) apart from the gathered
// activations A_i -- an index cache and a value cache, as the TopK cache
// keeps slice indices apart from the K/V pages. A gated GEMV then reads
// only the kept columns of W: y = W[:, idx] vals. The oracle the GPU
// kernels are tested against; it ranks as select_top_k does (NaN below
// every number, ties to the lower index) and indexes in 64 bits.
//
// The score is the fp32 product fl32(|a| g) of the fp32 values of a and g
// (what a user computes in fp32, and what the GPU computes), so GPU and
// reference rank the same numbers and their kept sets are equal bit for bit;
// ranking the exact product instead would order differently the pairs whose
// fp32 products round to one value.

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/tensor_view.hpp"
#include "hisparse/reference/sparse_attention.hpp"

namespace hisparse::reference {

/// What activation_topk kept, `k_max` slots a row.
struct gated_rows {
  std::int64_t n = 0;  ///< columns of A
  int k_max = 0;
  std::vector<std::int32_t> indices;  ///< [rows][k_max]: ascending, then -1
  std::vector<double> values;         ///< [rows][k_max]: A at those indices, then 0
  std::vector<std::int32_t> counts;   ///< [rows]: kept columns

  [[nodiscard]] std::int64_t rows() const { return static_cast<std::int64_t>(counts.size()); }
};

/// A column's score: fl32(|a| g), one fp32 rounding, as the GPU computes it.
template <class T, class G>
[[nodiscard]] inline float score(T a, G g) {
  static_assert(FLT_EVAL_METHOD == 0, "the score must be rounded to fp32 once");
  return std::fabs(to_float(a)) * to_float(g);
}

namespace detail {

template <class T, class G>
void check_gating(const tensor_view<const T, 2>& a, std::span<const G> gate, int k_max) {
  auto bad = [](const std::string& why) { throw error(status::invalid_argument, "activation_topk: " + why); };
  const std::int64_t n = a.extent(1);
  if (n < 1 || n > 0x7FFFFFFF) bad("columns must be in [1, 2^31 - 1] (indices are int32)");
  if (static_cast<std::int64_t>(gate.size()) != n) bad("the gate has " + std::to_string(gate.size()) + " weights for " + std::to_string(n) + " columns");
  if (k_max < 1 || k_max > n) bad("k_max " + std::to_string(k_max) + " must be in [1, columns]");
}

/// Row r's kept columns: the `k` best of |A_ri| g_i among those `keep`
/// admits, ranked by select_top_k.
template <class T, class G, class Keep>
void gate_row(const tensor_view<const T, 2>& a, std::span<const G> gate, std::int64_t r, int k, Keep keep,
              gated_rows& out) {
  std::vector<double> scores;
  std::vector<std::int32_t> ids;
  for (std::int64_t i = 0; i < a.extent(1); ++i) {
    const float s = score(a(r, i), gate[static_cast<std::size_t>(i)]);
    if (!keep(s)) continue;
    scores.push_back(static_cast<double>(s));
    ids.push_back(static_cast<std::int32_t>(i));
  }
  const scored_selection sel = select_top_k(scores, ids, k);
  const std::size_t base = static_cast<std::size_t>(r) * static_cast<std::size_t>(out.k_max);
  for (std::size_t j = 0; j < sel.kept.size(); ++j) {
    out.indices[base + j] = sel.kept[j];
    out.values[base + j] = to_double(a(r, sel.kept[j]));
  }
  out.counts[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(sel.kept.size());
}

template <class T>
gated_rows empty_rows(const tensor_view<const T, 2>& a, int k_max) {
  gated_rows g;
  g.n = a.extent(1);
  g.k_max = k_max;
  const auto slots = static_cast<std::size_t>(a.extent(0)) * static_cast<std::size_t>(k_max);
  g.indices.assign(slots, -1);
  g.values.assign(slots, 0.0);
  g.counts.assign(static_cast<std::size_t>(a.extent(0)), 0);
  return g;
}

}  // namespace detail

/// Row r keeps its k[r] best columns (0 <= k[r] <= k_max); an empty `k`
/// keeps k_max in every row. Throws hisparse::error on bad input.
template <class T, class G>
[[nodiscard]] gated_rows activation_topk(const tensor_view<const T, 2>& a, std::span<const G> gate,
                                         std::span<const std::int32_t> k, int k_max) {
  detail::check_gating(a, gate, k_max);
  if (!k.empty() && static_cast<std::int64_t>(k.size()) != a.extent(0))
    throw error(status::invalid_argument, "activation_topk: one K per row, or none");
  gated_rows g = detail::empty_rows(a, k_max);
  for (std::int64_t r = 0; r < a.extent(0); ++r) {
    const int kr = k.empty() ? k_max : k[static_cast<std::size_t>(r)];
    if (kr < 0 || kr > k_max)
      throw error(status::invalid_argument, "activation_topk: row " + std::to_string(r) + "'s K " +
                                                std::to_string(kr) + " must be in [0, k_max]");
    detail::gate_row(a, gate, r, kr, [](float) { return true; }, g);
  }
  return g;
}

/// Row r keeps the columns whose score is at least `threshold` (never a
/// NaN), the k_max best of them where there are more.
template <class T, class G>
[[nodiscard]] gated_rows activation_topk_threshold(const tensor_view<const T, 2>& a, std::span<const G> gate,
                                                   float threshold, int k_max) {
  detail::check_gating(a, gate, k_max);
  if (std::isnan(threshold)) throw error(status::invalid_argument, "activation_topk: the threshold is NaN");
  gated_rows g = detail::empty_rows(a, k_max);
  for (std::int64_t r = 0; r < a.extent(0); ++r)
    detail::gate_row(a, gate, r, k_max, [threshold](float s) { return s >= threshold; }, g);
  return g;
}

/// The gated GEMV: y[r][o] = sum over row r's kept j of W[o][idx_j] vals_j,
/// for W [out][n]. With every column kept it is W A_r.
template <class W>
[[nodiscard]] std::vector<double> gated_gemv(const tensor_view<const W, 2>& w, const gated_rows& g) {
  if (w.extent(1) != g.n)
    throw error(status::invalid_argument, "gated_gemv: W has " + std::to_string(w.extent(1)) +
                                              " columns, the gating " + std::to_string(g.n));
  const std::int64_t outs = w.extent(0);
  std::vector<double> y(static_cast<std::size_t>(g.rows() * outs), 0.0);
  for (std::int64_t r = 0; r < g.rows(); ++r)
    for (std::int64_t o = 0; o < outs; ++o) {
      double acc = 0.0;
      for (int j = 0; j < g.counts[static_cast<std::size_t>(r)]; ++j) {
        const std::size_t at = static_cast<std::size_t>(r) * static_cast<std::size_t>(g.k_max) + static_cast<std::size_t>(j);
        acc += to_double(w(o, g.indices[at])) * g.values[at];
      }
      y[static_cast<std::size_t>(r * outs + o)] = acc;
    }
  return y;
}

}  // namespace hisparse::reference
