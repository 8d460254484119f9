// The synthetic workload: reproducible, and its attention statistics are the
// ones it promises (measured here with the fp64 dense reference).
#include <catch2/catch.hpp>

#include <cmath>

#include "hisparse/reference/sparse_attention.hpp"
#include "workload/synthetic.hpp"

using namespace hisparse;

namespace {
/// Share of dense mass on the last `recent` positions and on the needles.
struct mass_split {
  double recent = 0, needles = 0;
};
mass_split measure(const workload::synthetic_workload<__nv_bfloat16>& w, std::int64_t recent) {
  const auto seq = w.sequence();
  const auto& s = w.options.shape;
  const auto dense = reference::dense_attention(s, seq);
  mass_split m;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const std::int64_t ctx = w.options.context;
  for (int qh = 0; qh < s.num_q_heads; ++qh) {
    const int h = qh / s.group_size();
    for (std::int64_t t = 0; t < ctx; ++t) {
      double qk = 0;
      for (int d = 0; d < s.head_dim; ++d) qk += to_double(seq.queries(0, qh, d)) * to_double(seq.keys(t, h, d));
      const double p = std::exp(qk * scale - dense.lse_of(0, qh));
      if (t >= ctx - recent) m.recent += p;
      for (const auto b : w.needle_begin[h])
        if (t >= b && t < b + w.options.needle_span) { m.needles += p; break; }
    }
  }
  m.recent /= s.num_q_heads;
  m.needles /= s.num_q_heads;
  return m;
}
}  // namespace

TEST_CASE("the synthetic workload is reproducible from its seed", "[workload]") {
  workload::synthetic_options o;
  o.context = 3000;
  o.shape = {8, 2, 64};
  o.seed = 42;
  const auto a = workload::make_synthetic_workload<float>(o);
  const auto b = workload::make_synthetic_workload<float>(o);
  CHECK(a.keys == b.keys);
  CHECK(a.queries == b.queries);
  o.seed = 43;
  const auto c = workload::make_synthetic_workload<float>(o);
  CHECK(a.keys != c.keys);
  // Never zeros: every tensor has real spread.
  double sum_sq = 0;
  for (const float x : a.values) sum_sq += double{x} * x;
  CHECK(sum_sq / a.values.size() == Approx(1.0).epsilon(0.1));
}

TEST_CASE("most dense mass falls on the last tokens, the rest on needles", "[workload]") {
  for (const std::int64_t ctx : {16384, 65536}) {
    workload::synthetic_options o;
    o.context = ctx;
    o.shape = {8, 2, 128};
    o.seed = 7 + ctx;
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(o);
    const auto m = measure(w, 2048);
    INFO("context " << ctx << ": recent " << m.recent << ", needles " << m.needles);
    CHECK(m.recent > 0.55);
    CHECK(m.recent < 0.80);
    CHECK(m.needles > 0.15);
    CHECK(m.recent + m.needles < 0.99);  // some background remains
  }
}

TEST_CASE("the standard selection recovers the planted structure", "[workload]") {
  workload::synthetic_options o;
  o.context = 65536;
  o.shape = {8, 2, 128};
  o.seed = 11;
  const auto w = workload::make_synthetic_workload<__nv_bfloat16>(o);
  const auto seq = w.sequence();
  const SparseAttentionConfig c;
  const auto sparse = reference::decode(c, o.shape, seq);
  const auto dense = reference::dense_attention(o.shape, seq);
  const double recall = reference::mass_recall(c, o.shape, seq, sparse, dense);
  INFO("recall " << recall);
  CHECK(recall > 0.9);
  CHECK(recall <= 1.0 + 1e-9);
}

TEST_CASE("a drifting stream keeps consecutive queries close and its keys as they were", "[workload]") {
  workload::synthetic_options o;
  o.context = 4096;
  o.shape = {8, 2, 64};
  o.num_queries = 48;
  o.seed = 7;
  const auto apart = workload::make_synthetic_workload<float>(o);
  o.drift_steps = 16;
  const auto stream = workload::make_synthetic_workload<float>(o);
  const auto again = workload::make_synthetic_workload<float>(o);
  CHECK(stream.keys == apart.keys);  // the keys are drawn before any query
  CHECK(stream.queries == again.queries);
  CHECK(stream.queries != apart.queries);
  // Cosine of query head qh between rows i and i + 1.
  auto cosine = [&](const workload::synthetic_workload<float>& w, std::int64_t i, int qh) {
    const int dim = o.shape.head_dim, hq = o.shape.num_q_heads;
    double dot = 0, a = 0, b = 0;
    for (int d = 0; d < dim; ++d) {
      const double x = w.queries[static_cast<std::size_t>((i * hq + qh) * dim + d)];
      const double y = w.queries[static_cast<std::size_t>(((i + 1) * hq + qh) * dim + d)];
      dot += x * y, a += x * x, b += y * y;
    }
    return dot / std::sqrt(a * b);
  };
  double stream_min = 1, apart_mean = 0;
  for (std::int64_t i = 0; i + 1 < o.num_queries; ++i)
    for (int qh = 0; qh < o.shape.num_q_heads; ++qh) {
      stream_min = std::min(stream_min, cosine(stream, i, qh));
      apart_mean += cosine(apart, i, qh) / static_cast<double>((o.num_queries - 1) * o.shape.num_q_heads);
    }
  INFO("stream: least cosine between steps " << stream_min << "; independent queries: mean " << apart_mean);
  CHECK(stream_min > 0.9);
  CHECK(apart_mean < stream_min - 0.1);
  // Needle swaps need a needle to swap in.
  o.needle_pool = o.needles_per_query;
  CHECK_THROWS_WITH(workload::make_synthetic_workload<float>(o), Catch::Contains("needle_pool"));
}

TEST_CASE("bad workload options are rejected", "[workload][errors]") {
  workload::synthetic_options o;
  o.context = 0;
  CHECK_THROWS_WITH(workload::make_synthetic_workload<float>(o), Catch::Contains("context"));
  o = {};
  o.num_queries = o.context + 1;
  CHECK_THROWS_WITH(workload::make_synthetic_workload<float>(o), Catch::Contains("num_queries"));
  o = {};
  o.recent_mass = 0.8;
  o.needle_mass = 0.3;
  CHECK_THROWS(workload::make_synthetic_workload<float>(o));
  o = {};
  o.shape = {6, 4, 128};
  CHECK_THROWS_WITH(workload::make_synthetic_workload<float>(o), Catch::Contains("num_q_heads"));
  o = {};
  o.drift_steps = -1;
  CHECK_THROWS_WITH(workload::make_synthetic_workload<float>(o), Catch::Contains("drift_steps"));
}
