#pragma once
// Shared test helpers: seeded random problems (fresh seed per run, printed on
// failure, fixed with HISPARSE_TEST_SEED), and an independent brute-force
// implementation of DESIGN.md section 1 for one query, written as plainly as
// possible so it shares no code with the reference it checks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "workload/synthetic.hpp"

namespace hisparse::test {

/// A fresh seed each run unless HISPARSE_TEST_SEED pins one.
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("HISPARSE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

/// Owns the tensors of one random sequence; `view()` is the reference input.
template <class T = double>
struct random_sequence {
  attention_shape shape;
  std::int64_t length = 0, q_begin = 0, num_queries = 0;
  std::vector<T> keys, values, queries;

  random_sequence(const attention_shape& s, std::int64_t len, std::int64_t q0, std::int64_t nq,
                  std::uint64_t seed, double key_scale = 1.0)
      : shape(s), length(len), q_begin(q0), num_queries(nq) {
    workload::splitmix64 rng(seed);
    keys.resize(static_cast<std::size_t>(len * s.num_kv_heads * s.head_dim));
    values.resize(keys.size());
    queries.resize(static_cast<std::size_t>(nq * s.num_q_heads * s.head_dim));
    for (auto& x : keys) x = from_float<T>(static_cast<float>(key_scale * rng.normal()));
    for (auto& x : values) x = from_float<T>(static_cast<float>(rng.normal()));
    for (auto& x : queries) x = from_float<T>(static_cast<float>(rng.normal()));
  }

  [[nodiscard]] reference::sequence<T> view() const {
    reference::sequence<T> seq;
    seq.keys = tensor_view<const T, 3>::contiguous(keys.data(), length, shape.num_kv_heads, shape.head_dim);
    seq.values = tensor_view<const T, 3>::contiguous(values.data(), length, shape.num_kv_heads, shape.head_dim);
    seq.queries = tensor_view<const T, 3>::contiguous(queries.data(), num_queries, shape.num_q_heads, shape.head_dim);
    seq.q_begin = q_begin;
    return seq;
  }
  T& key(std::int64_t t, int h, int d) {
    return keys[static_cast<std::size_t>((t * shape.num_kv_heads + h) * shape.head_dim + d)];
  }
  T& value(std::int64_t t, int h, int d) {
    return values[static_cast<std::size_t>((t * shape.num_kv_heads + h) * shape.head_dim + d)];
  }
  T& query(std::int64_t i, int h, int d) {
    return queries[static_cast<std::size_t>((i * shape.num_q_heads + h) * shape.head_dim + d)];
  }
};

/// Plain softmax attention of query row i, head qh, over explicit positions.
template <class T>
void brute_attend(const random_sequence<T>& s, std::int64_t i, int qh,
                  const std::vector<std::int64_t>& positions, std::vector<double>& out, double& lse) {
  const int dim = s.shape.head_dim, h = qh / s.shape.group_size();
  std::vector<double> logit;
  for (const std::int64_t t : positions) {
    double acc = 0;
    for (int d = 0; d < dim; ++d)
      acc += to_double(s.queries[static_cast<std::size_t>((i * s.shape.num_q_heads + qh) * dim + d)]) *
             to_double(s.keys[static_cast<std::size_t>((t * s.shape.num_kv_heads + h) * dim + d)]);
    logit.push_back(acc / std::sqrt(static_cast<double>(dim)));
  }
  const double m = *std::max_element(logit.begin(), logit.end());
  double sum = 0;
  out.assign(dim, 0.0);
  for (std::size_t j = 0; j < positions.size(); ++j) {
    const double w = std::exp(logit[j] - m);
    sum += w;
    for (int d = 0; d < dim; ++d)
      out[d] += w * to_double(s.values[static_cast<std::size_t>((positions[j] * s.shape.num_kv_heads + h) * dim + d)]);
  }
  for (double& x : out) x /= sum;
  lse = m + std::log(sum);
}

/// The selection DESIGN.md section 1 prescribes for the tile [p0, p1) of
/// query rows, KV head h, computed straight from raw keys (no slice means, no
/// shared helpers): returns {kept blocks, kept slices}, both ascending.
template <class T>
std::pair<std::vector<int>, std::vector<int>> brute_select(const random_sequence<T>& s,
                                                           const SparseAttentionConfig& c,
                                                           std::int64_t p0, std::int64_t p1, int h,
                                                           fine_summary fine = fine_summary::mean) {
  // mean_bf16 (a decode config's fine_summary): slices score their key sum
  // rounded to fp32 and then bf16, over F. Prefill always scores fp32 means.
  const bool bf16_fine = fine == fine_summary::mean_bf16;
  const int dim = s.shape.head_dim, group = s.shape.group_size();
  std::int64_t ws = p0 - c.window + 1;
  ws = ws <= 0 ? 0 : (ws / c.fine_slice) * c.fine_slice;
  auto score_of_range = [&](std::int64_t a, std::int64_t b, bool rounded = false) {  // mean key of [a, b)
    double best = -std::numeric_limits<double>::infinity();
    for (std::int64_t p = p0; p < p1; ++p) {
      double total = 0;
      for (int g = 0; g < group; ++g)
        for (int d = 0; d < dim; ++d) {
          double mean = 0;
          for (std::int64_t t = a; t < b; ++t)
            mean += to_double(s.keys[static_cast<std::size_t>((t * s.shape.num_kv_heads + h) * dim + d)]);
          if (rounded) mean = to_double(from_float<__nv_bfloat16>(static_cast<float>(mean)));
          mean /= static_cast<double>(b - a);
          total += to_double(s.queries[static_cast<std::size_t>(((p - s.q_begin) * s.shape.num_q_heads + h * group + g) * dim + d)]) * mean;
        }
      best = std::max(best, total);
    }
    return best;
  };
  auto top = [](std::vector<std::pair<double, int>> v, int k) {
    std::sort(v.begin(), v.end(), [](auto& x, auto& y) { return x.first != y.first ? x.first > y.first : x.second < y.second; });
    std::vector<int> kept;
    for (int i = 0; i < std::min<int>(k, static_cast<int>(v.size())); ++i) kept.push_back(v[i].second);
    std::sort(kept.begin(), kept.end());
    return kept;
  };
  // coarse_summary key_bounds: per dimension the range of [a, b)'s keys,
  // bf16 rounded outward, scored by the group-summed query's upper bound.
  auto bound_of_range = [&](std::int64_t a, std::int64_t b) {
    std::vector<double> lo(static_cast<std::size_t>(dim)), hi(static_cast<std::size_t>(dim));
    for (int d = 0; d < dim; ++d) {
      float mn = std::numeric_limits<float>::infinity(), mx = -mn;
      for (std::int64_t t = a; t < b; ++t) {
        const float k = to_float(s.keys[static_cast<std::size_t>((t * s.shape.num_kv_heads + h) * dim + d)]);
        mn = std::min(mn, k), mx = std::max(mx, k);
      }
      const std::uint32_t w = key_bounds_word(mn, mx);
      lo[static_cast<std::size_t>(d)] = key_bounds_lo(w), hi[static_cast<std::size_t>(d)] = key_bounds_hi(w);
    }
    double best = -std::numeric_limits<double>::infinity();
    for (std::int64_t p = p0; p < p1; ++p) {
      double total = 0;
      for (int d = 0; d < dim; ++d) {
        double q = 0;
        for (int g = 0; g < group; ++g)
          q += to_double(s.queries[static_cast<std::size_t>(((p - s.q_begin) * s.shape.num_q_heads + h * group + g) * dim + d)]);
        total += q * (q >= 0 ? hi[static_cast<std::size_t>(d)] : lo[static_cast<std::size_t>(d)]);
      }
      best = std::max(best, total);
    }
    return best;
  };
  std::vector<std::pair<double, int>> blocks;
  for (std::int64_t b = 0; b * c.coarse_block < ws; ++b) {
    const std::int64_t end = std::min<std::int64_t>((b + 1) * c.coarse_block, ws);
    blocks.push_back({c.coarse_summary == coarse_summary::key_bounds ? bound_of_range(b * c.coarse_block, end)
                                                                      : score_of_range(b * c.coarse_block, end),
                      static_cast<int>(b)});
  }
  const auto kept_blocks = top(blocks, c.top_k_coarse);
  std::vector<std::pair<double, int>> slices;
  for (const int b : kept_blocks)
    for (std::int64_t sl = std::int64_t{b} * c.coarse_block / c.fine_slice;
         sl < (std::int64_t{b} + 1) * c.coarse_block / c.fine_slice && (sl + 1) * c.fine_slice <= ws; ++sl)
      slices.push_back({score_of_range(sl * c.fine_slice, (sl + 1) * c.fine_slice, bf16_fine), static_cast<int>(sl)});
  return {kept_blocks, top(slices, c.top_k_fine)};
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace hisparse::test
