#pragma once
// A synthetic long-context decode workload with the attention statistics the
// field measured on real models: about 60-70% of the dense attention mass on
// the last 1-2K tokens, most of the rest on a few query-dependent far spans
// ("needles"), a thin remainder spread over everything else.
//
// Construction (per KV head h, logits are q.k / sqrt(D)):
//  * every key and query carries isotropic noise (background logits);
//  * a recency direction r_h: the key at distance d from the last position
//    carries a(d) r_h with a(d) flat for d < recent_full and fading linearly to
//    zero over recent_fade tokens; every query carries r_h;
//  * a pool of needle spans at random far positions, each with its own
//    direction u_{h,n} (r and the u's are orthonormal); each query picks
//    `needles_per_query` of them (shared by the heads of its group) and
//    carries their directions.
// The recency and needle logit levels are solved from the target mass shares
// for the given context, so the shares hold at any T. Queries sit at the last
// `num_queries` positions (decode, or the tail of a prefill), because the
// recency is anchored at the end of the context. With `drift_steps` > 0 the
// queries are a stream of decode steps that drift slowly instead of being
// drawn apart: per KV head one needle of the two a query attends is swapped
// for another every `drift_steps` steps, crossfading over those steps, and
// each query head's noise is an AR(1) series with correlation
// 1 - 1 / drift_steps from one step to the next.
//
// Reproducible: a given seed gives the same tensors on every platform (own
// generator and normal transform, not <random>'s implementation-defined ones).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/reference/sparse_attention.hpp"

namespace hisparse::workload {

/// splitmix64: small, fast, and the same sequence everywhere.
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  /// Standard normal (Box-Muller; the second value is dropped for simplicity).
  double normal() {
    constexpr double kTwoPi = 6.283185307179586;
    return std::sqrt(-2.0 * std::log(uniform())) * std::cos(kTwoPi * uniform());
  }
  /// Uniform integer in [0, n).
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

struct synthetic_options {
  std::int64_t context = 32768;      ///< T: keys in the cache
  attention_shape shape{};           ///< heads and head_dim
  std::int64_t num_queries = 1;      ///< queries at positions [T - num_queries, T)
  double recent_mass = 0.65;         ///< target share of dense mass on the recent tokens
  double needle_mass = 0.30;         ///< target share on the needles (the rest is background)
  int recent_full = 768;             ///< tokens at full recency boost
  int recent_fade = 512;             ///< tokens over which the boost fades to zero
  int needle_pool = 8;               ///< needle spans per KV head
  int needles_per_query = 2;         ///< spans each query attends
  int needle_span = 32;              ///< tokens per needle span
  double noise = 0.5;                ///< per-coordinate std of key and query noise
  int drift_steps = 0;               ///< > 0: the queries are a slowly drifting stream (above)
  std::uint64_t seed = 1;
};

template <class T>
struct synthetic_workload {
  synthetic_options options;
  std::vector<T> keys;     ///< [T, Hkv, D]
  std::vector<T> values;   ///< [T, Hkv, D]
  std::vector<T> queries;  ///< [num_queries, Hq, D]
  std::vector<std::vector<std::int64_t>> needle_begin;  ///< [Hkv][needle_pool] first positions
  double recent_logit = 0.0;  ///< solved recency logit level
  double needle_logit = 0.0;  ///< solved needle logit level

  [[nodiscard]] reference::sequence<T> sequence() const {
    const auto& s = options.shape;
    reference::sequence<T> seq;
    seq.keys = tensor_view<const T, 3>::contiguous(keys.data(), options.context, s.num_kv_heads, s.head_dim);
    seq.values = tensor_view<const T, 3>::contiguous(values.data(), options.context, s.num_kv_heads, s.head_dim);
    seq.queries = tensor_view<const T, 3>::contiguous(queries.data(), options.num_queries, s.num_q_heads, s.head_dim);
    seq.q_begin = options.context - options.num_queries;
    return seq;
  }
};

namespace detail {

/// Orthonormal vectors (Gram-Schmidt on Gaussian draws).
inline std::vector<std::vector<double>> orthonormal(int count, int dim, splitmix64& rng) {
  std::vector<std::vector<double>> basis;
  while (static_cast<int>(basis.size()) < count) {
    std::vector<double> v(dim);
    for (double& x : v) x = rng.normal();
    for (const auto& b : basis) {
      const double proj = std::inner_product(v.begin(), v.end(), b.begin(), 0.0);
      for (int d = 0; d < dim; ++d) v[d] -= proj * b[d];
    }
    const double norm = std::sqrt(std::inner_product(v.begin(), v.end(), v.begin(), 0.0));
    if (norm < 1e-6) continue;
    for (double& x : v) x /= norm;
    basis.push_back(std::move(v));
  }
  return basis;
}

inline double recency_ramp(std::int64_t distance, const synthetic_options& o) {
  if (distance < o.recent_full) return 1.0;
  const double fade = 1.0 - static_cast<double>(distance - o.recent_full) / o.recent_fade;
  return std::max(0.0, fade);
}

}  // namespace detail

/// Builds the workload. Throws hisparse::error on invalid options.
template <class T>
[[nodiscard]] synthetic_workload<T> make_synthetic_workload(const synthetic_options& o) {
  require_valid(o.shape);
  auto bad = [](const char* why) { throw error(status::invalid_argument, why); };
  if (o.context < 1 || o.context > kMaxContext) bad("synthetic_options.context must be in [1, 2^30]");
  if (o.num_queries < 1 || o.num_queries > o.context)
    bad("synthetic_options.num_queries must be in [1, context]");
  if (o.recent_mass <= 0 || o.needle_mass < 0 || o.recent_mass + o.needle_mass >= 1)
    bad("synthetic_options: recent_mass > 0, needle_mass >= 0 and their sum < 1");
  if (o.recent_full < 1 || o.recent_fade < 1 || o.needle_span < 1 || o.needle_pool < 0 ||
      o.needles_per_query < 0 || o.needles_per_query > o.needle_pool)
    bad("synthetic_options: spans must be positive and needles_per_query <= needle_pool");
  if (o.needle_pool + 1 > o.shape.head_dim) bad("synthetic_options.needle_pool must be < head_dim");
  if (o.drift_steps < 0) bad("synthetic_options.drift_steps must be >= 0");
  if (o.drift_steps > 0 && o.needles_per_query > 0 && o.needles_per_query >= o.needle_pool)
    bad("synthetic_options: a drifting stream needs needle_pool > needles_per_query (a needle to swap in)");

  const int hq = o.shape.num_q_heads, hkv = o.shape.num_kv_heads, dim = o.shape.head_dim;
  const int group = o.shape.group_size();
  const std::int64_t ctx = o.context;
  const double sqrt_d = std::sqrt(static_cast<double>(dim));
  const std::int64_t recent_end = std::int64_t{o.recent_full} + o.recent_fade;  // distance where boost is 0
  // Needles live in the far region: before the recent tokens, whole spans.
  const std::int64_t needle_room = ctx - recent_end - o.needle_span;
  const bool has_needles = o.needle_pool > 0 && o.needles_per_query > 0 && needle_room > 0;

  synthetic_workload<T> w;
  w.options = o;
  splitmix64 rng(o.seed);

  // Solve the logit levels from the target shares (background weight ~1/token).
  const double background_share = 1.0 - o.recent_mass - (has_needles ? o.needle_mass : 0.0);
  const double background_tokens = static_cast<double>(std::max<std::int64_t>(ctx - std::min(ctx, recent_end), 1));
  const double unit = background_tokens / background_share;  // total weight / 1
  auto recent_weight = [&](double rho) {
    double sum = 0.0;
    for (std::int64_t d = 0; d < std::min(ctx, recent_end); ++d) sum += std::exp(rho * detail::recency_ramp(d, o));
    return sum;
  };
  double lo = 0.0, hi = 40.0;
  for (int it = 0; it < 100; ++it) {
    const double mid = 0.5 * (lo + hi);
    (recent_weight(mid) < o.recent_mass * unit ? lo : hi) = mid;
  }
  w.recent_logit = lo;
  w.needle_logit =
      has_needles ? std::max(0.0, std::log(o.needle_mass * unit /
                                           (static_cast<double>(o.needles_per_query) * o.needle_span)))
                  : 0.0;
  // logit = (query amplitude)(key amplitude)/sqrt(D), split evenly.
  const double recent_amp = std::sqrt(w.recent_logit * sqrt_d);
  const double needle_amp = std::sqrt(w.needle_logit * sqrt_d);

  std::vector<std::vector<std::vector<double>>> dirs(hkv);  // [h][0]=r, [h][1+n]=u_n
  w.needle_begin.assign(hkv, {});
  for (int h = 0; h < hkv; ++h) {
    dirs[h] = detail::orthonormal(1 + o.needle_pool, dim, rng);
    if (has_needles)
      for (int n = 0; n < o.needle_pool; ++n) w.needle_begin[h].push_back(rng.below(needle_room));
  }

  w.keys.resize(static_cast<std::size_t>(ctx * hkv * dim));
  w.values.resize(w.keys.size());
  std::vector<double> k(dim);
  for (std::int64_t t = 0; t < ctx; ++t)
    for (int h = 0; h < hkv; ++h) {
      for (int d = 0; d < dim; ++d) k[d] = o.noise * rng.normal();
      const double a = recent_amp * detail::recency_ramp(ctx - 1 - t, o);
      if (a != 0.0)
        for (int d = 0; d < dim; ++d) k[d] += a * dirs[h][0][d];
      for (std::size_t n = 0; n < w.needle_begin[h].size(); ++n) {
        const std::int64_t b = w.needle_begin[h][n];
        if (t >= b && t < b + o.needle_span)
          for (int d = 0; d < dim; ++d) k[d] += needle_amp * dirs[h][1 + n][d];
      }
      const std::size_t base = static_cast<std::size_t>((t * hkv + h) * dim);
      for (int d = 0; d < dim; ++d) {
        w.keys[base + d] = from_float<T>(static_cast<float>(k[d]));
        w.values[base + d] = from_float<T>(static_cast<float>(rng.normal()));
      }
    }

  w.queries.resize(static_cast<std::size_t>(o.num_queries * hq * dim));
  const bool stream = o.drift_steps > 0;
  const double rho = stream ? 1.0 - 1.0 / o.drift_steps : 0.0;  // the stream's noise correlation a step
  std::vector<std::vector<int>> picks(hkv, std::vector<int>(o.needle_pool));
  std::vector<int> incoming(hkv, 0);  // the stream: the needle fading in for picks[h][0]
  std::vector<std::vector<double>> noise(static_cast<std::size_t>(hq), std::vector<double>(dim));
  auto shuffle = [&](std::vector<int>& p) {
    std::iota(p.begin(), p.end(), 0);
    for (int j = 0; j < o.needle_pool - 1; ++j) std::swap(p[j], p[j + rng.below(o.needle_pool - j)]);
  };
  for (std::int64_t i = 0; i < o.num_queries; ++i)
    for (int h = 0; h < hkv; ++h) {
      // Needle weights: a fresh pick per (query, KV head); in a stream the
      // same picks, needle picks[0] fading out as `incoming` fades in.
      double fade = 0.0;
      if (!stream || i == 0) {
        shuffle(picks[h]);
        if (stream && has_needles) incoming[h] = picks[h][o.needles_per_query];
      } else if (has_needles) {
        const std::int64_t phase = i % o.drift_steps;
        if (phase == 0) {  // the swap completes: pick the next one to fade in
          picks[h][0] = incoming[h];
          do {
            incoming[h] = static_cast<int>(rng.below(o.needle_pool));
          } while (std::find(picks[h].begin(), picks[h].begin() + o.needles_per_query, incoming[h]) !=
                   picks[h].begin() + o.needles_per_query);
        }
        fade = static_cast<double>(phase) / o.drift_steps;
      }
      for (int g = 0; g < group; ++g) {
        auto& n = noise[static_cast<std::size_t>(h * group + g)];
        for (int d = 0; d < dim; ++d)
          n[d] = stream && i > 0 ? rho * n[d] + std::sqrt(1.0 - rho * rho) * o.noise * rng.normal()
                                 : o.noise * rng.normal();
        std::vector<double> q(dim);
        for (int d = 0; d < dim; ++d) q[d] = n[d] + recent_amp * dirs[h][0][d];
        if (has_needles) {
          for (int j = 0; j < o.needles_per_query; ++j) {
            const double a = needle_amp * (j == 0 ? 1.0 - fade : 1.0);
            for (int d = 0; d < dim; ++d) q[d] += a * dirs[h][1 + picks[h][j]][d];
          }
          if (fade > 0.0)
            for (int d = 0; d < dim; ++d) q[d] += needle_amp * fade * dirs[h][1 + incoming[h]][d];
        }
        const std::size_t base = static_cast<std::size_t>((i * hq + h * group + g) * dim);
        for (int d = 0; d < dim; ++d) w.queries[base + d] = from_float<T>(static_cast<float>(q[d]));
      }
    }
  return w;
}

}  // namespace hisparse::workload
