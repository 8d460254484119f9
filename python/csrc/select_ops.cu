// The stateless selection ops: batched top-k, activation top-k gating and
// the gated GEMV. Each has a CUDA kernel (the library's) and a CPU kernel
// (the fp64 reference), so torch.library.opcheck runs without a GPU too.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include <hisparse/reference/activation_topk.hpp>
#include <hisparse/select/activation_topk.cuh>
#include <hisparse/select/batched_topk.cuh>

#include "common.hpp"

namespace hisparse::torch_ops {
namespace {

using torch::stable::new_empty;

// ---- topk -------------------------------------------------------------------

void check_topk(const Tensor& scores, std::int64_t k, const std::optional<Tensor>& row_lengths) {
  expect(scores, "topk", "scores", 2, ScalarType::Float);
  STD_TORCH_CHECK(k >= 1 && k <= select::kMaxBatchedTopK, "hisparse.topk: k ", k, " must be in [1, ",
                  select::kMaxBatchedTopK, "]");
  STD_TORCH_CHECK(scores.size(1) >= 1, "hisparse.topk: rows must have at least one score");
  if (row_lengths) {
    expect(*row_lengths, "topk", "row_lengths", 1, ScalarType::Int);
    STD_TORCH_CHECK(row_lengths->size(0) == scores.size(0), "hisparse.topk: one row length per row");
    expect_same_device(scores, *row_lengths, "topk", "row_lengths");
  }
}

std::tuple<Tensor, Tensor> topk_cuda(Tensor scores, std::int64_t k, std::optional<Tensor> row_lengths) {
  check_topk(scores, k, row_lengths);
  const std::int64_t rows = scores.size(0), n = scores.size(1);
  Tensor values = new_empty(scores, {rows, k});
  Tensor indices = new_empty(scores, {rows, k}, ScalarType::Int);
  if (rows == 0) return {values, indices};
  STD_TORCH_CHECK(rows <= std::numeric_limits<int>::max() && n <= (1 << 30), "hisparse.topk: at most 2^31 - 1 rows of 2^30 scores");
  torch::stable::accelerator::DeviceGuard guard(scores.get_device_index());
  const cudaStream_t stream = current_stream(scores);
  const std::int32_t* lengths = row_lengths ? data<const std::int32_t>(*row_lengths) : nullptr;
  const std::int64_t stride = rows == 1 ? n : scores.stride(0);
  std::size_t bytes = 0;
  check(select::batched_topk<float>(nullptr, bytes, data<const float>(scores), stride, lengths, static_cast<int>(rows),
                                    static_cast<int>(n), static_cast<int>(k), data<float>(values),
                                    data<std::int32_t>(indices), stream),
        "topk");
  Tensor temp = new_empty(scores, {static_cast<std::int64_t>(bytes)}, ScalarType::Byte);
  check(select::batched_topk<float>(temp.data_ptr(), bytes, data<const float>(scores), stride, lengths,
                                    static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k),
                                    data<float>(values), data<std::int32_t>(indices), stream),
        "topk");
  return {values, indices};
}

/// Descending, ties to the lower index, NaN after every number: the
/// library's order, written out plainly.
std::tuple<Tensor, Tensor> topk_cpu(Tensor scores, std::int64_t k, std::optional<Tensor> row_lengths) {
  check_topk(scores, k, row_lengths);
  const std::int64_t rows = scores.size(0), n = scores.size(1);
  Tensor values = new_empty(scores, {rows, k});
  Tensor indices = new_empty(scores, {rows, k}, ScalarType::Int);
  auto* v = data<float>(values);
  auto* ix = data<std::int32_t>(indices);
  std::vector<std::int32_t> order;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = data<const float>(scores) + r * scores.stride(0);
    const std::int64_t len =
        row_lengths ? std::clamp<std::int64_t>(data<const std::int32_t>(*row_lengths)[r], 0, n) : n;
    order.resize(static_cast<std::size_t>(len));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      const float x = row[a], y = row[b];
      if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
      return x > y;
    });
    for (std::int64_t j = 0; j < k; ++j) {
      const bool real = j < len;
      v[r * k + j] = real ? row[order[static_cast<std::size_t>(j)]] : -std::numeric_limits<float>::infinity();
      ix[r * k + j] = real ? order[static_cast<std::size_t>(j)] : -1;
    }
  }
  return {values, indices};
}

// ---- activation_topk ----------------------------------------------------------

struct gating_args {
  std::int64_t rows, n;
};

gating_args check_gating(const Tensor& a, const Tensor& gate, std::int64_t k_max, const std::optional<Tensor>& k_per_row,
                         const std::optional<double>& threshold) {
  STD_TORCH_CHECK(a.dim() == 2, "hisparse.activation_topk: a must be [rows, n] (got ", a.dim(), " dimensions)");
  STD_TORCH_CHECK(a.scalar_type() == ScalarType::Half || a.scalar_type() == ScalarType::BFloat16,
                  "hisparse.activation_topk: a must be float16 or bfloat16 (got ", name_of(a.scalar_type()), ")");
  expect(a, "activation_topk", "a", 2, a.scalar_type());
  const ScalarType g = gate.scalar_type();
  STD_TORCH_CHECK(g == ScalarType::Float || g == ScalarType::Half || g == ScalarType::BFloat16,
                  "hisparse.activation_topk: gate must be float32, float16 or bfloat16");
  STD_TORCH_CHECK(gate.dim() == 1 && gate.size(0) == a.size(1), "hisparse.activation_topk: gate must be [n] = [",
                  a.size(1), "]");
  expect_contiguous(gate, "activation_topk", "gate");
  expect_same_device(a, gate, "activation_topk", "gate");
  STD_TORCH_CHECK(a.size(1) >= 1, "hisparse.activation_topk: n must be >= 1");
  STD_TORCH_CHECK(k_max >= 1 && k_max <= a.size(1), "hisparse.activation_topk: k_max ", k_max, " must be in [1, n = ",
                  a.size(1), "]");
  STD_TORCH_CHECK(!(k_per_row && threshold), "hisparse.activation_topk: give k_per_row or threshold, not both");
  if (threshold) STD_TORCH_CHECK(!std::isnan(*threshold), "hisparse.activation_topk: the threshold is NaN");
  if (k_per_row) {
    expect(*k_per_row, "activation_topk", "k_per_row", 1, ScalarType::Int);
    STD_TORCH_CHECK(k_per_row->size(0) == a.size(0), "hisparse.activation_topk: one K per row");
    expect_same_device(a, *k_per_row, "activation_topk", "k_per_row");
  }
  return {a.size(0), a.size(1)};
}

std::tuple<Tensor, Tensor, Tensor> gating_outputs(const Tensor& a, std::int64_t rows, std::int64_t k_max) {
  return {new_empty(a, {rows, k_max}, ScalarType::Int), new_empty(a, {rows, k_max}),
          new_empty(a, {rows}, ScalarType::Int)};
}

std::tuple<Tensor, Tensor, Tensor> activation_topk_cuda(Tensor a, Tensor gate, std::int64_t k_max,
                                                        std::optional<Tensor> k_per_row,
                                                        std::optional<double> threshold) {
  const auto [rows, n] = check_gating(a, gate, k_max, k_per_row, threshold);
  auto out = gating_outputs(a, rows, k_max);
  if (rows == 0) return out;
  STD_TORCH_CHECK(rows <= std::numeric_limits<int>::max(), "hisparse.activation_topk: at most 2^31 - 1 rows");
  torch::stable::accelerator::DeviceGuard guard(a.get_device_index());
  const cudaStream_t stream = current_stream(a);
  const auto rule = threshold ? select::gating_rule::threshold : select::gating_rule::top_k;
  const std::int64_t stride = rows == 1 ? n : a.stride(0);
  with_gating_types(a.scalar_type(), gate.scalar_type(), "activation_topk", [&](auto* t, auto* g) {
    using T = std::remove_pointer_t<decltype(t)>;
    using G = std::remove_pointer_t<decltype(g)>;
    check(select::activation_topk<T, G>(
              data<const T>(a), stride, data<const G>(gate), static_cast<int>(rows), static_cast<int>(n), rule,
              k_per_row ? data<const std::int32_t>(*k_per_row) : nullptr,
              threshold ? static_cast<float>(*threshold) : 0.0f, static_cast<int>(k_max),
              data<std::int32_t>(std::get<0>(out)), data<T>(std::get<1>(out)), data<std::int32_t>(std::get<2>(out)),
              stream),
          "activation_topk");
  });
  return out;
}

template <class T, class G>
reference::gated_rows gate_on_cpu(const Tensor& a, const Tensor& gate, std::int64_t k_max,
                                  const std::optional<Tensor>& k_per_row, const std::optional<double>& threshold) {
  tensor_view<const T, 2> view{data<const T>(a), {a.size(0), a.size(1)}, {a.stride(0), 1}};
  const std::span<const G> g(data<const G>(gate), static_cast<std::size_t>(gate.size(0)));
  if (threshold) return reference::activation_topk_threshold(view, g, static_cast<float>(*threshold), static_cast<int>(k_max));
  std::vector<std::int32_t> k;
  if (k_per_row) {
    const auto* kr = data<const std::int32_t>(*k_per_row);
    // The kernel's rule: a row's K is clamped to [0, k_max].
    for (std::int64_t r = 0; r < a.size(0); ++r) k.push_back(std::clamp<std::int32_t>(kr[r], 0, static_cast<std::int32_t>(k_max)));
  }
  return reference::activation_topk(view, g, std::span<const std::int32_t>(k), static_cast<int>(k_max));
}

std::tuple<Tensor, Tensor, Tensor> activation_topk_cpu(Tensor a, Tensor gate, std::int64_t k_max,
                                                       std::optional<Tensor> k_per_row,
                                                       std::optional<double> threshold) {
  const auto [rows, n] = check_gating(a, gate, k_max, k_per_row, threshold);
  auto out = gating_outputs(a, rows, k_max);
  if (rows == 0) return out;
  with_gating_types(a.scalar_type(), gate.scalar_type(), "activation_topk", [&](auto* t, auto* g) {
    using T = std::remove_pointer_t<decltype(t)>;
    using G = std::remove_pointer_t<decltype(g)>;
    const reference::gated_rows r = gate_on_cpu<T, G>(a, gate, k_max, k_per_row, threshold);
    std::copy(r.indices.begin(), r.indices.end(), data<std::int32_t>(std::get<0>(out)));
    std::transform(r.values.begin(), r.values.end(), data<T>(std::get<1>(out)),
                   [](double v) { return T(static_cast<float>(v)); });  // exact: they are T values
    std::copy(r.counts.begin(), r.counts.end(), data<std::int32_t>(std::get<2>(out)));
  });
  return out;
}

// ---- gated_gemv ---------------------------------------------------------------

void check_gemv(const Tensor& wt, const Tensor& indices, const Tensor& values, const Tensor& counts) {
  STD_TORCH_CHECK(wt.dim() == 2, "hisparse.gated_gemv: wt must be W transposed, [n, outs]");
  STD_TORCH_CHECK(wt.scalar_type() == ScalarType::Half || wt.scalar_type() == ScalarType::BFloat16,
                  "hisparse.gated_gemv: wt must be float16 or bfloat16");
  expect(wt, "gated_gemv", "wt", 2, wt.scalar_type());
  expect(indices, "gated_gemv", "indices", 2, ScalarType::Int);
  expect_contiguous(indices, "gated_gemv", "indices");
  expect(values, "gated_gemv", "values", 2, values.scalar_type());
  STD_TORCH_CHECK(values.scalar_type() == ScalarType::Half || values.scalar_type() == ScalarType::BFloat16,
                  "hisparse.gated_gemv: values must be float16 or bfloat16");
  expect_contiguous(values, "gated_gemv", "values");
  expect(counts, "gated_gemv", "counts", 1, ScalarType::Int);
  STD_TORCH_CHECK(values.size(0) == indices.size(0) && values.size(1) == indices.size(1) &&
                      counts.size(0) == indices.size(0),
                  "hisparse.gated_gemv: indices and values must be [rows, k_max], counts [rows]");
  STD_TORCH_CHECK(indices.size(1) >= 1 && indices.size(1) <= wt.size(0),
                  "hisparse.gated_gemv: k_max must be in [1, n]");
  expect_same_device(wt, indices, "gated_gemv", "indices");
  expect_same_device(wt, values, "gated_gemv", "values");
  expect_same_device(wt, counts, "gated_gemv", "counts");
}

Tensor gated_gemv_cuda(Tensor wt, Tensor indices, Tensor values, Tensor counts) {
  check_gemv(wt, indices, values, counts);
  const std::int64_t rows = indices.size(0), k_max = indices.size(1), n = wt.size(0), outs = wt.size(1);
  Tensor y = new_empty(wt, {rows, outs}, ScalarType::Float);
  if (rows == 0 || outs == 0) return y;
  torch::stable::accelerator::DeviceGuard guard(wt.get_device_index());
  const cudaStream_t stream = current_stream(wt);
  const std::int64_t ld = n == 1 ? outs : wt.stride(0);
  constexpr std::int64_t kRowsPerCall = 8;  // the kernel's batch limit; more rows go 8 at a time
  with_half_type(values.scalar_type(), "gated_gemv", [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    with_half_type(wt.scalar_type(), "gated_gemv", [&](auto* w) {
      using W = std::remove_pointer_t<decltype(w)>;
      std::size_t bytes = 0;
      const int first = static_cast<int>(std::min(rows, kRowsPerCall));
      check(select::gated_gemv<T, W>(nullptr, bytes, data<const W>(wt), ld, static_cast<int>(n), static_cast<int>(outs),
                                     nullptr, nullptr, static_cast<int>(k_max), nullptr, first, nullptr, stream),
            "gated_gemv");
      Tensor temp = new_empty(wt, {static_cast<std::int64_t>(bytes)}, ScalarType::Byte);
      for (std::int64_t r = 0; r < rows; r += kRowsPerCall) {
        const int batch = static_cast<int>(std::min(kRowsPerCall, rows - r));
        check(select::gated_gemv<T, W>(temp.data_ptr(), bytes, data<const W>(wt), ld, static_cast<int>(n),
                                       static_cast<int>(outs), data<const std::int32_t>(indices) + r * k_max,
                                       data<const T>(values) + r * k_max, static_cast<int>(k_max),
                                       data<const std::int32_t>(counts) + r, batch, data<float>(y) + r * outs, stream),
              "gated_gemv");
      }
    });
  });
  return y;
}

Tensor gated_gemv_cpu(Tensor wt, Tensor indices, Tensor values, Tensor counts) {
  check_gemv(wt, indices, values, counts);
  const std::int64_t rows = indices.size(0), k_max = indices.size(1), n = wt.size(0), outs = wt.size(1);
  Tensor y = new_empty(wt, {rows, outs}, ScalarType::Float);
  reference::gated_rows g;
  g.n = n;
  g.k_max = static_cast<int>(k_max);
  const auto* ix = data<const std::int32_t>(indices);
  const auto* cn = data<const std::int32_t>(counts);
  g.indices.assign(ix, ix + rows * k_max);
  g.counts.assign(cn, cn + rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    STD_TORCH_CHECK(cn[r] >= 0 && cn[r] <= k_max, "hisparse.gated_gemv: row ", r, "'s count ", cn[r],
                    " must be in [0, k_max]");
    for (std::int64_t j = 0; j < cn[r]; ++j)
      STD_TORCH_CHECK(ix[r * k_max + j] >= 0 && ix[r * k_max + j] < n, "hisparse.gated_gemv: row ", r, " keeps column ",
                      ix[r * k_max + j], ", outside [0, n)");
  }
  with_half_type(values.scalar_type(), "gated_gemv", [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const auto* v = data<const T>(values);
    for (std::int64_t i = 0; i < rows * k_max; ++i) g.values.push_back(to_double(v[i]));
  });
  with_half_type(wt.scalar_type(), "gated_gemv", [&](auto* w) {
    using W = std::remove_pointer_t<decltype(w)>;
    // W [outs][n] is wt read across: element (o, i) at i * ld + o.
    const tensor_view<const W, 2> wview{data<const W>(wt), {outs, n}, {1, wt.stride(0)}};
    const std::vector<double> out = reference::gated_gemv(wview, g);
    std::transform(out.begin(), out.end(), data<float>(y), [](double x) { return static_cast<float>(x); });
  });
  return y;
}

}  // namespace
}  // namespace hisparse::torch_ops

STABLE_TORCH_LIBRARY_FRAGMENT(hisparse, m) {
  m.def("topk(Tensor scores, int k, Tensor? row_lengths=None) -> (Tensor values, Tensor indices)");
  m.def("activation_topk(Tensor a, Tensor gate, int k_max, Tensor? k_per_row=None, float? threshold=None) -> "
        "(Tensor indices, Tensor values, Tensor counts)");
  m.def("gated_gemv(Tensor wt, Tensor indices, Tensor values, Tensor counts) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  using namespace hisparse::torch_ops;
  m.impl("topk", TORCH_BOX(&topk_cuda));
  m.impl("activation_topk", TORCH_BOX(&activation_topk_cuda));
  m.impl("gated_gemv", TORCH_BOX(&gated_gemv_cuda));
}

STABLE_TORCH_LIBRARY_IMPL(hisparse, CPU, m) {
  using namespace hisparse::torch_ops;
  m.impl("topk", TORCH_BOX(&topk_cpu));
  m.impl("activation_topk", TORCH_BOX(&activation_topk_cpu));
  m.impl("gated_gemv", TORCH_BOX(&gated_gemv_cpu));
}
