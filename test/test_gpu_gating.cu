// Activation top-k gating and the gated GEMV on the GPU against the fp64
// reference (reference/activation_topk.hpp): kept sets, order, values and
// counts bit for bit on random rows of every path (rows held whole as
// candidates, sampled brackets, brackets that miss or overflow), strided
// and unaligned rows, adversarial values (ties, NaN, infinities, signed
// zeros, negative gates), per-row K and thresholds, offsets past 2^31,
// subnormal scores, non-finite weights and stray indices in the GEMV, and a
// captured graph (argument checks: test_topk_host.cu). Outputs start
// poisoned.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/reference/activation_topk.hpp"
#include "hisparse/select/activation_topk.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

using test::device_buffer;

/// One gating problem: rows of A `stride` apart (the gaps hold +inf, which
/// would rank first if the kernel read them), its gate, per-row K.
template <class T, class G>
struct gating_problem {
  int rows = 0, n = 0, k_max = 0;
  std::int64_t stride = 0;
  std::vector<T> a;
  std::vector<G> gate;
  std::vector<std::int32_t> k;  // empty: k_max in every row

  gating_problem(int r, int cols, std::int64_t row_stride, int kmax)
      : rows(r), n(cols), k_max(kmax), stride(row_stride),
        a(static_cast<std::size_t>(r * row_stride), from_float<T>(std::numeric_limits<float>::infinity())),
        gate(static_cast<std::size_t>(cols)) {}
  T& at(int r, int i) { return a[static_cast<std::size_t>(r * stride + i)]; }

  /// The rows without their gaps, as the reference reads them.
  [[nodiscard]] std::vector<T> packed() const {
    std::vector<T> out(static_cast<std::size_t>(rows) * static_cast<std::size_t>(n));
    for (int r = 0; r < rows; ++r)
      std::copy_n(a.begin() + r * stride, n, out.begin() + static_cast<std::int64_t>(r) * n);
    return out;
  }
};

struct gpu_gating {
  std::vector<std::int32_t> indices, counts;
  std::vector<double> values;
};

template <class T, class G>
gpu_gating run_gpu(const gating_problem<T, G>& p, select::gating_rule rule, float threshold, cudaStream_t stream) {
  device_buffer<T> a(p.a);
  device_buffer<G> gate(p.gate);
  device_buffer<std::int32_t> k(p.k.empty() ? std::vector<std::int32_t>{0} : p.k);
  const auto slots = static_cast<std::size_t>(p.rows) * static_cast<std::size_t>(p.k_max);
  device_buffer<std::int32_t> idx(slots), counts(static_cast<std::size_t>(p.rows));
  device_buffer<T> vals(slots);
  idx.poison(stream);
  vals.poison(stream);
  counts.poison(stream);
  REQUIRE(select::activation_topk(a.ptr, p.stride, gate.ptr, p.rows, p.n, rule, p.k.empty() ? nullptr : k.ptr,
                                  threshold, p.k_max, idx.ptr, vals.ptr, counts.ptr, stream) == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  gpu_gating out;
  out.indices = idx.download();
  out.counts = counts.download();
  for (const T v : vals.download()) out.values.push_back(to_double(v));
  return out;
}

/// GPU output equals the reference bit for bit (indices, values, counts,
/// and the padding after each row's count).
void require_equal(const gpu_gating& gpu, const reference::gated_rows& ref) {
  for (std::int64_t r = 0; r < ref.rows(); ++r) {
    INFO("row " << r);
    REQUIRE(gpu.counts[static_cast<std::size_t>(r)] == ref.counts[static_cast<std::size_t>(r)]);
    for (int s = 0; s < ref.k_max; ++s) {
      const auto at = static_cast<std::size_t>(r * ref.k_max + s);
      INFO("slot " << s);
      REQUIRE(gpu.indices[at] == ref.indices[at]);
      const double g = gpu.values[at], want = ref.values[at];
      REQUIRE(std::memcmp(&g, &want, sizeof g) == 0);  // the activation itself, -0 and NaN payloads included
    }
  }
}

template <class T, class G>
reference::gated_rows reference_of(const gating_problem<T, G>& p, select::gating_rule rule, float threshold) {
  const std::vector<T> packed = p.packed();
  const auto view = tensor_view<const T, 2>::contiguous(packed.data(), p.rows, p.n);
  if (rule == select::gating_rule::threshold)
    return reference::activation_topk_threshold(view, std::span<const G>(p.gate), threshold, p.k_max);
  return reference::activation_topk(view, std::span<const G>(p.gate), std::span<const std::int32_t>(p.k), p.k_max);
}

template <class T, class G>
void check_problem(const gating_problem<T, G>& p, select::gating_rule rule = select::gating_rule::top_k,
                   float threshold = 0.0f) {
  cudaStream_t stream = nullptr;
  const auto gpu = run_gpu(p, rule, threshold, stream);
  require_equal(gpu, reference_of(p, rule, threshold));
}

template <class T, class G>
gating_problem<T, G> random_problem(int rows, int n, std::int64_t stride, int k_max, workload::splitmix64& rng,
                                    bool per_row_k) {
  gating_problem<T, G> p(rows, n, stride, k_max);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) p.at(r, i) = from_float<T>(static_cast<float>(rng.normal()));
  for (auto& g : p.gate) g = from_float<G>(static_cast<float>(0.25 + rng.uniform()));
  if (per_row_k) {
    p.k.resize(static_cast<std::size_t>(rows));
    for (auto& x : p.k) x = static_cast<std::int32_t>(rng.below(k_max + 1));
    p.k[0] = k_max;  // the widest row is always there
  }
  return p;
}

}  // namespace

TEST_CASE("activation top-k on the GPU equals the reference on random rows", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  struct shape { int rows, n; std::int64_t stride; int k_max; bool per_row; };
  // n <= 8192: every column a candidate; above: sampled brackets. Odd n and
  // strides leave vector loads for the scalar path.
  for (const shape s : {shape{6, 1, 1, 1, false}, shape{5, 100, 100, 37, true}, shape{7, 4099, 4101, 1024, true},
                        shape{4, 8192, 8192, 2048, false}, shape{9, 14336, 14336, 3584, false},
                        shape{6, 14336, 14336, 7168, true}, shape{3, 20003, 20010, 5000, true},
                        shape{3, 65536, 65536, 16384, false}, shape{4, 14336, 14336, 14336, true},
                        shape{5, 9000, 9000, 3, false}}) {
    INFO("rows " << s.rows << " n " << s.n << " stride " << s.stride << " k_max " << s.k_max);
    check_problem(random_problem<__nv_bfloat16, float>(s.rows, s.n, s.stride, s.k_max, rng, s.per_row));
    check_problem(random_problem<__half, __half>(s.rows, s.n, s.stride, s.k_max, rng, s.per_row));
  }
  check_problem(random_problem<__nv_bfloat16, __nv_bfloat16>(4, 14336, 14336, 3584, rng, true));
}

TEST_CASE("activation top-k on the GPU: ties, NaN, infinities, signed zeros, sorted and periodic rows",
          "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const int n : {3000, 14336, 40000}) {
    INFO("n " << n);
    const int rows = 8, k_max = n / 4;
    gating_problem<__nv_bfloat16, float> p(rows, n, n, k_max);
    for (auto& g : p.gate) g = static_cast<float>(0.5 + rng.uniform());
    for (int i = 0; i < n; ++i) {
      const double x = rng.normal();
      p.at(0, i) = from_float<__nv_bfloat16>(static_cast<float>(rng.below(4)));  // four levels: ties at the cut
      p.at(1, i) = from_float<__nv_bfloat16>(1.0f);                              // one value: the lowest K indices
      p.at(2, i) = from_float<__nv_bfloat16>(static_cast<float>(i) / n);         // sorted ascending
      p.at(3, i) = from_float<__nv_bfloat16>(static_cast<float>(n - i) / n);     // sorted descending
      // Periodic: the sampled columns see only small values, so the
      // bracket misses and the search counts over the row.
      p.at(4, i) = from_float<__nv_bfloat16>(static_cast<float>(i % 7 == 0 ? 1e-3 * x : x));
      const auto pick = rng.below(10);
      p.at(5, i) = from_float<__nv_bfloat16>(pick == 0 ? nan : pick == 1 ? inf : pick == 2 ? -inf
                                             : pick == 3 ? -0.0f : pick == 4 ? 0.0f : static_cast<float>(x));
      p.at(6, i) = from_float<__nv_bfloat16>(i < n - 10 ? nan : static_cast<float>(x));  // fewer numbers than K
      p.at(7, i) = from_float<__nv_bfloat16>(static_cast<float>(x));
    }
    // Row 7 under a gate with negative, zero, NaN and infinite weights.
    gating_problem<__nv_bfloat16, float> q = p;
    for (int i = 0; i < n; ++i) {
      const auto pick = rng.below(8);
      q.gate[static_cast<std::size_t>(i)] = pick == 0 ? -1.0f : pick == 1 ? 0.0f : pick == 2 ? nan : pick == 3 ? inf
                                          : static_cast<float>(rng.normal());
    }
    check_problem(p);
    check_problem(q);
    p.k.assign(static_cast<std::size_t>(rows), 0);
    for (auto& k : p.k) k = static_cast<std::int32_t>(rng.below(k_max + 1));
    check_problem(p);
    // Thresholds: below, at and above the row's levels; capped by k_max.
    for (const float t : {0.0f, 1.0f, 0.5f, 3.0f, -inf, inf}) {
      INFO("threshold " << t);
      gating_problem<__nv_bfloat16, float> r = p;
      r.k.clear();
      check_problem(r, select::gating_rule::threshold, t);
    }
  }
}

TEST_CASE("activation top-k on the GPU: thresholds on random rows", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  for (const int n : {500, 14336}) {
    auto p = random_problem<__half, float>(6, n, n, n / 2, rng, false);
    for (const float t : {0.1f, 0.5f, 1.0f, 2.5f}) {  // from most rows capped at n / 2 to few kept
      INFO("n " << n << " threshold " << t);
      check_problem(p, select::gating_rule::threshold, t);
    }
  }
}

TEST_CASE("activation top-k on the GPU: row offsets past 2^31 elements", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const int rows = 3, n = 1000, k_max = 250;
  const std::int64_t stride = (std::int64_t{1} << 30) + 8;  // row 2 starts at 2^31 + 16
  std::size_t free_bytes = 0, total = 0;
  HISPARSE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  const std::size_t elems = static_cast<std::size_t>(stride) * (rows - 1) + n;
  if (free_bytes < elems * sizeof(__nv_bfloat16) + (std::size_t{1} << 30)) {
    std::printf("HISPARSE_TEST_SKIPPED: the device has too little free memory for a 4.3 GB row buffer\n");
    WARN("skipped: the device has too little free memory for a 4.3 GB row buffer");
    return;
  }
  gating_problem<__nv_bfloat16, float> p(rows, n, n, k_max);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) p.at(r, i) = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  for (auto& g : p.gate) g = static_cast<float>(0.5 + rng.uniform());
  device_buffer<__nv_bfloat16> a(elems);
  for (int r = 0; r < rows; ++r)
    HISPARSE_CUDA_CHECK(cudaMemcpy(a.ptr + r * stride, p.a.data() + r * n, n * sizeof(__nv_bfloat16),
                                   cudaMemcpyHostToDevice));
  device_buffer<float> gate(p.gate);
  device_buffer<std::int32_t> idx(rows * k_max), counts(rows);
  device_buffer<__nv_bfloat16> vals(rows * k_max);
  idx.poison(nullptr);
  vals.poison(nullptr);
  REQUIRE(select::activation_topk(a.ptr, stride, gate.ptr, rows, n, select::gating_rule::top_k, nullptr, 0.0f, k_max,
                                  idx.ptr, vals.ptr, counts.ptr) == status::success);
  gpu_gating gpu;
  gpu.indices = idx.download();
  gpu.counts = counts.download();
  for (const auto v : vals.download()) gpu.values.push_back(to_double(v));
  require_equal(gpu, reference_of(p, select::gating_rule::top_k, 0.0f));
}

TEST_CASE("the gated GEMV equals the reference for batches of 1 to 8, and is deterministic", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  cudaStream_t stream = nullptr;
  struct shape { int n, outs; std::int64_t ld; };
  for (const shape s : {shape{14336, 4096, 4096}, shape{1000, 1003, 1008}, shape{300, 5, 7}}) {
    for (const int rows : {1, 3, 8}) {
      INFO("n " << s.n << " outs " << s.outs << " ld " << s.ld << " rows " << rows);
      auto p = random_problem<__nv_bfloat16, float>(rows, s.n, s.n, s.n / 2, rng, true);
      std::vector<__nv_bfloat16> wt(static_cast<std::size_t>(s.n * s.ld), from_float<__nv_bfloat16>(1e30f));
      for (int c = 0; c < s.n; ++c)
        for (int o = 0; o < s.outs; ++o)
          wt[static_cast<std::size_t>(c * s.ld + o)] = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
      const auto ref_rows = reference_of(p, select::gating_rule::top_k, 0.0f);
      // W as the reference reads it: [outs][n], the transpose of W^T's view.
      tensor_view<const __nv_bfloat16, 2> w_view;
      w_view.data = wt.data();
      w_view.extents[0] = s.outs, w_view.extents[1] = s.n;
      w_view.strides[0] = 1, w_view.strides[1] = s.ld;
      const auto want = reference::gated_gemv(w_view, ref_rows);

      device_buffer<__nv_bfloat16> a(p.a), w(wt), vals(static_cast<std::size_t>(rows * p.k_max));
      device_buffer<float> gate(p.gate), y(static_cast<std::size_t>(rows * s.outs));
      device_buffer<std::int32_t> k(p.k), idx(static_cast<std::size_t>(rows * p.k_max)), counts(rows);
      REQUIRE(select::activation_topk(a.ptr, p.stride, gate.ptr, rows, p.n, select::gating_rule::top_k, k.ptr, 0.0f,
                                      p.k_max, idx.ptr, vals.ptr, counts.ptr, stream) == status::success);
      std::size_t bytes = 0;
      REQUIRE(select::gated_gemv(nullptr, bytes, w.ptr, s.ld, s.n, s.outs, idx.ptr, vals.ptr, p.k_max, counts.ptr, rows,
                                 y.ptr, stream) == status::success);
      device_buffer<char> temp(bytes);
      y.poison(stream);
      REQUIRE(select::gated_gemv(temp.ptr, bytes, w.ptr, s.ld, s.n, s.outs, idx.ptr, vals.ptr, p.k_max, counts.ptr, rows,
                                 y.ptr, stream) == status::success);
      const auto got = y.download();
      for (int r = 0; r < rows; ++r)
        for (int o = 0; o < s.outs; ++o) {
          // fp32 accumulation over the row's kept terms: |error| <= kept u sum |w v|.
          double magnitude = 0;
          const int kept = ref_rows.counts[static_cast<std::size_t>(r)];
          for (int j = 0; j < kept; ++j) {
            const auto at = static_cast<std::size_t>(r * p.k_max + j);
            magnitude += std::abs(to_double(w_view(o, ref_rows.indices[at])) * ref_rows.values[at]);
          }
          const double bound = (kept + 2) * std::ldexp(1.0, -24) * magnitude;
          const auto at = static_cast<std::size_t>(r * s.outs + o);
          INFO("row " << r << " output " << o);
          REQUIRE(std::abs(static_cast<double>(got[at]) - want[at]) <= bound);
        }
      // Run again: the same bits.
      y.poison(stream);
      REQUIRE(select::gated_gemv(temp.ptr, bytes, w.ptr, s.ld, s.n, s.outs, idx.ptr, vals.ptr, p.k_max, counts.ptr, rows,
                                 y.ptr, stream) == status::success);
      const auto again = y.download();
      REQUIRE(std::memcmp(got.data(), again.data(), got.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("the gated GEMV: a non-finite weight reaches only the rows that keep its column; stray indices are skipped",
          "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const int n = 1000, outs = 64, k_max = 4;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<__nv_bfloat16> wt(static_cast<std::size_t>(n) * outs);
  for (int c = 0; c < n; ++c)
    for (int o = 0; o < outs; ++o)
      wt[static_cast<std::size_t>(c * outs + o)] = from_float<__nv_bfloat16>(static_cast<float>((c * 7 + o * 3) % 11) - 5.0f);
  wt[5 * outs + 3] = from_float<__nv_bfloat16>(inf);    // column 5: row 0 only
  wt[700 * outs + 10] = from_float<__nv_bfloat16>(nan);  // column 700: row 0 only
  wt[100 * outs + 20] = from_float<__nv_bfloat16>(-inf);  // column 100: rows 0 and 1
  // Rows 0 and 1 keep columns of the same 128-column ranges; row 2's indices
  // lie outside [0, n) (int32 extremes: no overflow in the kernel's offsets).
  const std::vector<std::int32_t> idx{5, 100, 700, -1, 6, 100, 701, -1,
                                      std::numeric_limits<std::int32_t>::min(), -5, n, std::numeric_limits<std::int32_t>::max()};
  const std::vector<std::int32_t> counts{3, 3, 4};
  std::vector<__nv_bfloat16> vals(idx.size(), from_float<__nv_bfloat16>(0.0f));
  const float v[] = {1.5f, -2.0f, 0.75f, 0.0f, 3.0f, 0.5f, -1.25f, 0.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  for (std::size_t i = 0; i < vals.size(); ++i) vals[i] = from_float<__nv_bfloat16>(v[i]);
  device_buffer<__nv_bfloat16> w(wt), d_vals(vals);
  device_buffer<std::int32_t> d_idx(idx), d_counts(counts);
  device_buffer<float> y(static_cast<std::size_t>(3 * outs));
  std::size_t bytes = 0;
  REQUIRE(select::gated_gemv(nullptr, bytes, w.ptr, outs, n, outs, d_idx.ptr, d_vals.ptr, k_max, d_counts.ptr, 3, y.ptr,
                             nullptr) == status::success);
  device_buffer<char> temp(bytes);
  y.poison(nullptr);
  REQUIRE(select::gated_gemv(temp.ptr, bytes, w.ptr, outs, n, outs, d_idx.ptr, d_vals.ptr, k_max, d_counts.ptr, 3, y.ptr,
                             nullptr) == status::success);
  const auto got = y.download();
  // The reference for rows 0 and 1 (row 2 keeps nothing in range: zeros).
  reference::gated_rows g;
  g.n = n;
  g.k_max = k_max;
  g.indices.assign(idx.begin(), idx.begin() + 8);
  for (int i = 0; i < 8; ++i) g.values.push_back(to_double(vals[static_cast<std::size_t>(i)]));
  g.counts = {3, 3};
  tensor_view<const __nv_bfloat16, 2> w_view;
  w_view.data = wt.data();
  w_view.extents[0] = outs, w_view.extents[1] = n;
  w_view.strides[0] = 1, w_view.strides[1] = outs;
  const auto want = reference::gated_gemv(w_view, g);
  for (int r = 0; r < 3; ++r)
    for (int o = 0; o < outs; ++o) {
      const auto at = static_cast<std::size_t>(r * outs + o);
      const double expect = r < 2 ? want[at] : 0.0;
      INFO("row " << r << " output " << o << ": " << got[at] << " vs " << expect);
      if (std::isnan(expect)) {
        REQUIRE(std::isnan(got[at]));
      } else if (std::isinf(expect)) {
        REQUIRE(static_cast<double>(got[at]) == expect);
      } else {
        REQUIRE(std::abs(static_cast<double>(got[at]) - expect) <= 1e-5 * (1.0 + std::abs(expect)));
      }
    }
  // Row 1 sees -inf (it keeps column 100) and nothing of columns 5 and 700.
  REQUIRE(std::isinf(got[static_cast<std::size_t>(outs + 20)]));
  REQUIRE(std::isfinite(got[static_cast<std::size_t>(outs + 3)]));
  REQUIRE(std::isfinite(got[static_cast<std::size_t>(outs + 10)]));
}

TEST_CASE("activation top-k ranks subnormal scores", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const int rows = 4, n = 5000, k_max = 300;
  // bf16 activations that are fp32 subnormals under gates near 1, and fp16
  // activations under gates small enough for subnormal products: flushed
  // to 0 they would all tie and the lowest indices would be kept instead.
  gating_problem<__nv_bfloat16, float> sub(rows, n, n, k_max);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) {
      __nv_bfloat16_raw bits;
      bits.x = static_cast<unsigned short>((1 + rng.below(0x7F)) | (rng.below(2) ? 0x8000u : 0u));
      sub.at(r, i) = __nv_bfloat16(bits);
    }
  for (auto& g : sub.gate) g = static_cast<float>(1.0 + rng.uniform());
  check_problem(sub);
  check_problem(sub, select::gating_rule::threshold, std::ldexp(1.0f, -128));
  gating_problem<__half, float> tiny(rows, n, n, k_max);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) tiny.at(r, i) = from_float<__half>(static_cast<float>(rng.normal()));
  for (auto& g : tiny.gate) g = std::ldexp(static_cast<float>(1.0 + rng.uniform()), -130);
  check_problem(tiny);
}

TEST_CASE("activation top-k and the gated GEMV replay from a captured graph", "[gpu][gating]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const int rows = 4, n = 14336, outs = 512;
  auto p = random_problem<__nv_bfloat16, float>(rows, n, n, n / 4, rng, false);
  std::vector<__nv_bfloat16> wt(static_cast<std::size_t>(n) * outs);
  for (auto& x : wt) x = from_float<__nv_bfloat16>(static_cast<float>(rng.normal()));
  device_buffer<__nv_bfloat16> a(p.a), w(wt), vals(static_cast<std::size_t>(rows * p.k_max));
  device_buffer<float> gate(p.gate), y(static_cast<std::size_t>(rows * outs)), y_eager(y.n);
  device_buffer<std::int32_t> idx(static_cast<std::size_t>(rows * p.k_max)), counts(rows);
  cudaStream_t stream;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::size_t bytes = 0;
  REQUIRE(select::gated_gemv(nullptr, bytes, w.ptr, outs, n, outs, idx.ptr, vals.ptr, p.k_max, counts.ptr, rows, y.ptr,
                             stream) == status::success);
  device_buffer<char> temp(bytes);
  auto step = [&](float* out) {
    REQUIRE(select::activation_topk(a.ptr, n, gate.ptr, rows, n, select::gating_rule::top_k, nullptr, 0.0f, p.k_max,
                                    idx.ptr, vals.ptr, counts.ptr, stream) == status::success);
    REQUIRE(select::gated_gemv(temp.ptr, bytes, w.ptr, outs, n, outs, idx.ptr, vals.ptr, p.k_max, counts.ptr, rows, out,
                               stream) == status::success);
  };
  step(y_eager.ptr);
  const auto eager_idx = idx.download();
  idx.poison(stream);
  y.poison(stream);
  cudaGraph_t graph;
  HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step(y.ptr);
  HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  CHECK(idx.download() == eager_idx);
  const auto want = y_eager.download(), got = y.download();
  CHECK(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
  HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
