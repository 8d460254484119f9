#pragma once
// fp64 CPU reference of hierarchical sparse attention: DESIGN.md section 1,
// step by step. It is the oracle every kernel is tested against (it returns
// the selected blocks and slices with their scores, so a GPU pipeline can be
// checked stage by stage) and the library's CPU path: it runs any batch the
// GPU path runs, only slower.
//
// Everything is computed in double from the stored element values (bf16 keys
// are widened, never re-rounded), so the only difference between this and a
// kernel is the kernel's own arithmetic.
//
// Non-finite inputs follow IEEE arithmetic (DESIGN.md section 1): a NaN
// score ranks below every number (-inf included), ties among NaNs go to the
// lower index, infinities rank as numbers; the attention's output is NaN in
// whatever dimensions the formula makes NaN (a NaN value, or a NaN or +inf
// logit), and a -inf logit weighs nothing. (The GPU attention may give NaN
// where an infinite value makes this +-inf: DESIGN.md section 1.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/tensor_view.hpp"

namespace hisparse::reference {

/// Step 1: the window of the tile that starts at `tile_begin` starts at the
/// slice boundary at or below `tile_begin - W + 1` (never below 0).
[[nodiscard]] constexpr std::int64_t window_begin(std::int64_t tile_begin,
                                                  const SparseAttentionConfig& c) noexcept {
  return contract::window_begin(tile_begin, c.window, c.fine_slice);
}

/// The start of the M-aligned query tile holding position p.
[[nodiscard]] constexpr std::int64_t tile_begin(std::int64_t p, int query_tile) noexcept {
  return contract::tile_begin(p, query_tile);
}

/// One sequence: its cached keys/values and a run of consecutive queries.
/// The query at row i sits at absolute position `q_begin + i` and its own key
/// is already in the cache, so `q_begin + num_queries <= keys.extent(0)`.
template <class T>
struct sequence {
  tensor_view<const T, 3> keys;     ///< [length, Hkv, D]
  tensor_view<const T, 3> values;   ///< [length, Hkv, D]
  tensor_view<const T, 3> queries;  ///< [num_queries, Hq, D]
  std::int64_t q_begin = 0;         ///< position of the first query

  [[nodiscard]] std::int64_t length() const { return keys.extent(0); }
  [[nodiscard]] std::int64_t num_queries() const { return queries.extent(0); }
};

/// A top-k selection with the scores needed to judge another implementation:
/// `kept` ascending, `kept_scores` beside it, and the best score left out.
struct scored_selection {
  std::vector<std::int32_t> kept;
  std::vector<double> kept_scores;
  double best_rejected = -std::numeric_limits<double>::infinity();  ///< -inf if nothing was left out
  std::int64_t num_candidates = 0;
};

/// What one query tile selected, per KV head.
struct tile_selection {
  std::int64_t begin = 0;         ///< first query position of the tile (p0)
  std::int64_t end = 0;           ///< one past the last query present
  std::int64_t window_begin = 0;  ///< ws; the far region is [0, ws)
  std::vector<scored_selection> blocks;  ///< [Hkv]
  std::vector<scored_selection> slices;  ///< [Hkv]
};

struct result {
  attention_shape shape;
  std::int64_t q_begin = 0;
  std::int64_t num_queries = 0;
  std::vector<double> output;             ///< [num_queries, Hq, D]
  std::vector<double> lse;                ///< [num_queries, Hq], natural log of sum exp(q.k/sqrt(D))
  std::vector<std::int64_t> attended;     ///< [num_queries, Hkv]: tokens each query attends
  std::vector<tile_selection> tiles;      ///< empty for dense attention

  [[nodiscard]] double out(std::int64_t i, int h, int d) const {
    return output[(static_cast<std::size_t>(i) * shape.num_q_heads + h) * shape.head_dim + d];
  }
  [[nodiscard]] double lse_of(std::int64_t i, int h) const {
    return lse[static_cast<std::size_t>(i) * shape.num_q_heads + h];
  }
  /// The tile that holds query row i.
  [[nodiscard]] const tile_selection& tile_of(std::int64_t i) const {
    const std::int64_t p = q_begin + i;
    auto it = std::upper_bound(tiles.begin(), tiles.end(), p,
                               [](std::int64_t pos, const tile_selection& t) { return pos < t.begin; });
    return *(it - 1);
  }
};

/// The token positions the query at position p attends through KV head h of
/// `tile`: the kept slices (ascending) followed by the window [ws, p].
[[nodiscard]] inline std::vector<std::int64_t> attended_positions(
    const tile_selection& tile, int kv_head, std::int64_t p, const SparseAttentionConfig& c) {
  std::vector<std::int64_t> pos;
  for (const std::int32_t s : tile.slices[kv_head].kept)
    for (std::int64_t t = std::int64_t{s} * c.fine_slice; t < std::int64_t{s + 1} * c.fine_slice; ++t)
      pos.push_back(t);
  for (std::int64_t t = tile.window_begin; t <= p; ++t) pos.push_back(t);
  return pos;
}

/// A selection reused by a later decode step (a TopK cache hit) for the
/// query at p: the cached tile's kept slices, and p's own window. The kept
/// slices lie before the cached window, so before p's (p is never before
/// the selecting query: refresh_due).
[[nodiscard]] inline tile_selection reused_selection(const tile_selection& cached, std::int64_t p,
                                                     const SparseAttentionConfig& c) {
  tile_selection t = cached;
  t.begin = p;
  t.end = p + 1;
  t.window_begin = contract::window_begin(p, c.window, c.fine_slice);
  return t;
}

/// The k best of `scores` (index i scores scores[i], index id ids[i]): higher
/// first, NaN below everything, ties to the lower id. Returns kept ids
/// ascending with their scores, and the best rejected score.
[[nodiscard]] inline scored_selection select_top_k(std::span<const double> scores,
                                                   std::span<const std::int32_t> ids, int k) {
  std::vector<std::size_t> order(scores.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  auto better = [&](std::size_t a, std::size_t b) {
    const bool na = std::isnan(scores[a]), nb = std::isnan(scores[b]);
    if (na != nb) return nb;
    if (!na && scores[a] != scores[b]) return scores[a] > scores[b];
    return ids[a] < ids[b];
  };
  std::sort(order.begin(), order.end(), better);
  scored_selection sel;
  sel.num_candidates = static_cast<std::int64_t>(scores.size());
  const std::size_t kept = std::min(order.size(), static_cast<std::size_t>(std::max(k, 0)));
  if (kept < order.size()) sel.best_rejected = scores[order[kept]];
  order.resize(kept);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ids[a] < ids[b]; });
  for (const std::size_t i : order) {
    sel.kept.push_back(ids[i]);
    sel.kept_scores.push_back(scores[i]);
  }
  return sel;
}

namespace detail {

template <class T>
void check_sequence(const SparseAttentionConfig& c, const attention_shape& s,
                    const sequence<T>& seq, int query_tile) {
  require_valid(c);
  require_valid(s);
  auto bad = [](const std::string& why) { throw error(status::invalid_argument, why); };
  if (seq.keys.data == nullptr || seq.values.data == nullptr || seq.queries.data == nullptr)
    bad("sequence: keys, values and queries must not be null");
  if (seq.keys.extent(1) != s.num_kv_heads || seq.keys.extent(2) != s.head_dim)
    bad("sequence.keys must be [length, num_kv_heads, head_dim]");
  for (int d = 0; d < 3; ++d)
    if (seq.values.extent(d) != seq.keys.extent(d)) bad("sequence.values must have the keys' extents");
  if (seq.queries.extent(1) != s.num_q_heads || seq.queries.extent(2) != s.head_dim)
    bad("sequence.queries must be [num_queries, num_q_heads, head_dim]");
  if (seq.length() < 1 || seq.length() > kMaxContext)
    bad("sequence length " + std::to_string(seq.length()) + " must be in [1, 2^30]");
  if (seq.num_queries() < 1) bad("sequence has no queries");
  if (seq.q_begin < 0 || seq.q_begin + seq.num_queries() > seq.length())
    bad("queries at [" + std::to_string(seq.q_begin) + ", " +
        std::to_string(seq.q_begin + seq.num_queries()) +
        ") need their own keys in the cache of length " + std::to_string(seq.length()));
  if (seq.q_begin % query_tile != 0)
    bad("a prefill chunk must start on a query-tile boundary (q_begin " +
        std::to_string(seq.q_begin) + ", query_tile " + std::to_string(query_tile) +
        ") so the result does not depend on chunking");
}

inline double dot(const double* a, const double* b, int n) {
  double acc = 0.0;
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

/// Softmax attention of one query row over `positions`; writes D outputs and
/// returns the log-sum-exp.
template <class T>
double attend_row(const double* q, const tensor_view<const T, 3>& keys,
                  const tensor_view<const T, 3>& values, int kv_head, int head_dim,
                  std::span<const std::int64_t> positions, double* out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> logits(positions.size());
  std::vector<double> k(head_dim);
  double m = -std::numeric_limits<double>::infinity();
  bool saw_nan = false;
  for (std::size_t j = 0; j < positions.size(); ++j) {
    for (int d = 0; d < head_dim; ++d) k[d] = to_double(keys(positions[j], kv_head, d));
    logits[j] = dot(q, k.data(), head_dim) * scale;
    if (std::isnan(logits[j])) saw_nan = true;
    m = std::max(m, logits[j]);
  }
  if (saw_nan) m = std::numeric_limits<double>::quiet_NaN();
  double sum = 0.0;
  std::fill(out, out + head_dim, 0.0);
  for (std::size_t j = 0; j < positions.size(); ++j) {
    const double w = std::exp(logits[j] - m);
    sum += w;
    for (int d = 0; d < head_dim; ++d) out[d] += w * to_double(values(positions[j], kv_head, d));
  }
  for (int d = 0; d < head_dim; ++d) out[d] /= sum;
  return m + std::log(sum);
}

template <class T>
std::vector<double> query_row(const sequence<T>& seq, std::int64_t i, int h, int head_dim) {
  std::vector<double> q(head_dim);
  for (int d = 0; d < head_dim; ++d) q[d] = to_double(seq.queries(i, h, d));
  return q;
}

}  // namespace detail

/// Per-slice mean keys of the complete slices below `limit` tokens:
/// [num_slices][Hkv][D], with num_slices = limit / F. Step 3's summaries.
/// With `kind` = mean_bf16, the means a decode fine filter scores under that
/// fine_summary: each exact sum rounded to fp32 and then to bf16 (round to
/// nearest even), over F. The cache rounds its own fp32 sum,
/// which can differ from the exact one's fp32 rounding in the last bits, so
/// a sum near a bf16 rounding boundary can land one bf16 ulp apart.
template <class T>
[[nodiscard]] std::vector<double> slice_means(const tensor_view<const T, 3>& keys,
                                              const SparseAttentionConfig& c, std::int64_t limit,
                                              fine_summary kind = fine_summary::mean) {
  const std::int64_t hkv = keys.extent(1), dim = keys.extent(2);
  const std::int64_t num_slices = std::min(limit, keys.extent(0)) / c.fine_slice;
  std::vector<double> means(static_cast<std::size_t>(num_slices * hkv * dim), 0.0);
  for (std::int64_t s = 0; s < num_slices; ++s)
    for (std::int64_t h = 0; h < hkv; ++h) {
      double* m = &means[static_cast<std::size_t>((s * hkv + h) * dim)];
      for (std::int64_t t = s * c.fine_slice; t < (s + 1) * c.fine_slice; ++t)
        for (std::int64_t d = 0; d < dim; ++d) m[d] += to_double(keys(t, h, d));
      for (std::int64_t d = 0; d < dim; ++d) {
        if (kind == fine_summary::mean_bf16) m[d] = to_double(from_float<__nv_bfloat16>(static_cast<float>(m[d])));
        m[d] /= c.fine_slice;
      }
    }
  return means;
}

/// Per-slice key bounds of the complete slices below `limit` tokens:
/// [num_slices][Hkv][D][2], each dimension's (lo, hi) as the cache keeps it
/// (`key_bounds_word` of the stored keys' minimum and maximum: bf16 rounded
/// outward, NaN in both where a key is NaN). What a `fine_summary::key_bounds`
/// fine filter scores.
template <class T>
[[nodiscard]] std::vector<double> slice_key_bounds(const tensor_view<const T, 3>& keys,
                                                   const SparseAttentionConfig& c, std::int64_t limit) {
  const std::int64_t hkv = keys.extent(1), dim = keys.extent(2);
  const std::int64_t num_slices = std::min(limit, keys.extent(0)) / c.fine_slice;
  std::vector<double> bounds(static_cast<std::size_t>(num_slices * hkv * dim * 2));
  for (std::int64_t s = 0; s < num_slices; ++s)
    for (std::int64_t h = 0; h < hkv; ++h)
      for (std::int64_t d = 0; d < dim; ++d) {
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (std::int64_t t = s * c.fine_slice; t < (s + 1) * c.fine_slice; ++t) {
          const float k = to_float(keys(t, h, d));
          if (std::isnan(k) || std::isnan(lo)) {
            lo = hi = k + lo;  // NaN stays
          } else {
            lo = std::min(lo, k), hi = std::max(hi, k);
          }
        }
        const std::uint32_t w = key_bounds_word(lo, hi);
        double* b = &bounds[static_cast<std::size_t>(((s * hkv + h) * dim + d) * 2)];
        b[0] = key_bounds_lo(w), b[1] = key_bounds_hi(w);
      }
  return bounds;
}

/// A key_bounds score: sum_d q_d b_d with b_d = hi_d where q_d >= 0 (-0
/// included), else lo_d: the largest q_d k_d over the range. IEEE products,
/// so 0 * inf and a NaN bound or query make it NaN.
[[nodiscard]] inline double key_bounds_score(const double* q, const double* bounds, int dim) {
  double s = 0.0;
  for (int d = 0; d < dim; ++d) s += q[d] * bounds[2 * d + (q[d] >= 0.0 ? 1 : 0)];
  return s;
}

/// The key bounds of a block's far slices [s0, s1) of KV head h, from
/// slice_key_bounds' rows: each dimension's (lo, hi) over the slices' (NaN
/// where any is NaN). What a `coarse_summary::key_bounds` coarse filter
/// scores (with key_bounds_score).
[[nodiscard]] inline std::vector<double> block_key_bounds(const std::vector<double>& slice_bounds, std::int64_t s0,
                                                          std::int64_t s1, int hkv, int h, int dim) {
  std::vector<double> b(static_cast<std::size_t>(2 * dim));
  for (int d = 0; d < dim; ++d) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (std::int64_t sl = s0; sl < s1; ++sl) {
      const double* r = &slice_bounds[static_cast<std::size_t>(((sl * hkv + h) * dim + d) * 2)];
      if (std::isnan(r[0]) || std::isnan(lo)) {
        lo = hi = std::numeric_limits<double>::quiet_NaN();
      } else {
        lo = std::min(lo, r[0]), hi = std::max(hi, r[1]);
      }
    }
    b[static_cast<std::size_t>(2 * d)] = lo, b[static_cast<std::size_t>(2 * d + 1)] = hi;
  }
  return b;
}

/// Hierarchical sparse attention of `seq`'s queries, in query tiles of
/// `query_tile` positions (1 for decode). `fine` is what step 5 scores:
/// fp32 means (DESIGN.md section 1; prefill always), or a decode config's
/// fine_summary (mean_bf16: slice_means; key_bounds: slice_key_bounds,
/// key_bounds_score). Step 4 scores the config's coarse_summary (block
/// means, or block_key_bounds), and NaN for the `evicted` blocks (ascending;
/// retention, paged_kv_cache::evict_async).
/// Throws hisparse::error on bad input.
template <class T>
[[nodiscard]] result sparse_attention(const SparseAttentionConfig& c, const attention_shape& s,
                                      const sequence<T>& seq, int query_tile,
                                      fine_summary fine = fine_summary::mean,
                                      std::span<const std::int32_t> evicted = {}) {
  if (query_tile < 1 || query_tile > kMaxQueryTile)
    throw error(status::invalid_argument, "query_tile must be in [1, " + std::to_string(kMaxQueryTile) + "]");
  detail::check_sequence(c, s, seq, query_tile);
  const int hq = s.num_q_heads, hkv = s.num_kv_heads, dim = s.head_dim, group = s.group_size();
  const std::int64_t n = seq.num_queries();
  const std::int64_t last_tile = tile_begin(seq.q_begin + n - 1, query_tile);
  const std::vector<double> smeans = slice_means(seq.keys, c, window_begin(last_tile, c));
  if (!is_valid(fine))
    throw error(status::invalid_argument, "fine must be mean, mean_bf16 or key_bounds");
  const std::vector<double> bf16_means = fine == fine_summary::mean_bf16
                                             ? slice_means(seq.keys, c, window_begin(last_tile, c), fine)
                                             : std::vector<double>{};
  const std::vector<double>& fine_means = fine == fine_summary::mean_bf16 ? bf16_means : smeans;
  const bool bounds = fine == fine_summary::key_bounds;
  const bool coarse_bounds = c.coarse_summary == coarse_summary::key_bounds;
  const std::vector<double> fine_bounds = bounds || coarse_bounds
                                              ? slice_key_bounds(seq.keys, c, window_begin(last_tile, c))
                                              : std::vector<double>{};
  const int spb = c.slices_per_block();

  result r;
  r.shape = s;
  r.q_begin = seq.q_begin;
  r.num_queries = n;
  r.output.assign(static_cast<std::size_t>(n * hq * dim), 0.0);
  r.lse.assign(static_cast<std::size_t>(n * hq), 0.0);
  r.attended.assign(static_cast<std::size_t>(n * hkv), 0);

  for (std::int64_t p0 = seq.q_begin; p0 < seq.q_begin + n; p0 += query_tile) {
    tile_selection tile;
    tile.begin = p0;
    tile.end = std::min(p0 + query_tile, seq.q_begin + n);
    tile.window_begin = window_begin(p0, c);
    const std::int64_t far_slices = contract::far_slices(tile.window_begin, c.fine_slice);
    const std::int64_t blocks = contract::candidate_blocks(tile.window_begin, c.coarse_block);

    for (int h = 0; h < hkv; ++h) {
      // Group-summed queries: sum_g q_g . x == (sum_g q_g) . x.
      std::vector<std::vector<double>> qsum;
      for (std::int64_t p = tile.begin; p < tile.end; ++p) {
        std::vector<double> acc(dim, 0.0);
        for (int g = 0; g < group; ++g) {
          const auto q = detail::query_row(seq, p - seq.q_begin, h * group + g, dim);
          for (int d = 0; d < dim; ++d) acc[d] += q[d];
        }
        qsum.push_back(std::move(acc));
      }
      // The tile's score of a candidate: the max over its queries of
      // score_of(summed query), NaN if any is NaN.
      auto tile_max = [&](auto score_of) {
        double best = -std::numeric_limits<double>::infinity();
        bool nan = false;
        for (const auto& q : qsum) {
          const double v = score_of(q.data());
          if (std::isnan(v)) nan = true;
          best = std::max(best, v);
        }
        return nan ? std::numeric_limits<double>::quiet_NaN() : best;
      };
      auto tile_score = [&](const double* summary) {
        return tile_max([&](const double* q) { return detail::dot(q, summary, dim); });
      };
      auto slice_mean = [&](std::int64_t sl) {
        return &smeans[static_cast<std::size_t>((sl * hkv + h) * dim)];
      };
      auto fine_mean = [&](std::int64_t sl) { return &fine_means[static_cast<std::size_t>((sl * hkv + h) * dim)]; };

      // Step 4: coarse filter over blocks with bC < ws, summaries over their far part.
      std::vector<double> bscore;
      std::vector<std::int32_t> bid;
      std::vector<double> summary(dim);
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t s0 = b * spb, s1 = std::min<std::int64_t>((b + 1) * spb, far_slices);
        bid.push_back(static_cast<std::int32_t>(b));
        if (std::binary_search(evicted.begin(), evicted.end(), static_cast<std::int32_t>(b))) {
          bscore.push_back(std::numeric_limits<double>::quiet_NaN());
          continue;
        }
        if (coarse_bounds) {
          const auto range = block_key_bounds(fine_bounds, s0, s1, hkv, h, dim);
          bscore.push_back(tile_max([&](const double* q) { return key_bounds_score(q, range.data(), dim); }));
          continue;
        }
        std::fill(summary.begin(), summary.end(), 0.0);
        for (std::int64_t sl = s0; sl < s1; ++sl)
          for (int d = 0; d < dim; ++d) summary[d] += slice_mean(sl)[d];
        for (int d = 0; d < dim; ++d) summary[d] /= static_cast<double>(s1 - s0);
        bscore.push_back(tile_score(summary.data()));
      }
      tile.blocks.push_back(select_top_k(bscore, bid, c.top_k_coarse));

      // Step 5: fine filter over the far slices of the kept blocks.
      std::vector<double> sscore;
      std::vector<std::int32_t> sid;
      for (const std::int32_t b : tile.blocks.back().kept)
        for (std::int64_t sl = std::int64_t{b} * spb;
             sl < std::min<std::int64_t>((std::int64_t{b} + 1) * spb, far_slices); ++sl) {
          sscore.push_back(bounds ? tile_max([&](const double* q) {
            return key_bounds_score(q, &fine_bounds[static_cast<std::size_t>((sl * hkv + h) * dim * 2)], dim);
          })
                                  : tile_score(fine_mean(sl)));
          sid.push_back(static_cast<std::int32_t>(sl));
        }
      tile.slices.push_back(select_top_k(sscore, sid, c.top_k_fine));
    }

    // Step 6: attention over kept slices + [ws, p].
    for (std::int64_t p = tile.begin; p < tile.end; ++p) {
      const std::int64_t i = p - seq.q_begin;
      for (int h = 0; h < hkv; ++h) {
        const auto positions = attended_positions(tile, h, p, c);
        r.attended[static_cast<std::size_t>(i * hkv + h)] = static_cast<std::int64_t>(positions.size());
        for (int g = 0; g < group; ++g) {
          const int qh = h * group + g;
          const auto q = detail::query_row(seq, i, qh, dim);
          r.lse[static_cast<std::size_t>(i * hq + qh)] = detail::attend_row(
              q.data(), seq.keys, seq.values, h, dim, positions,
              &r.output[static_cast<std::size_t>((i * hq + qh) * dim)]);
        }
      }
    }
    r.tiles.push_back(std::move(tile));
  }
  return r;
}

/// Prefill: query tiles of `c.query_tile` positions.
template <class T>
[[nodiscard]] result prefill(const SparseAttentionConfig& c, const attention_shape& s,
                             const sequence<T>& seq) {
  return sparse_attention(c, s, seq, c.query_tile);
}

/// Decode: one query at the last cached position, a tile of one; the fine
/// filter scores the config's fine_summary. `evicted`: blocks a retention
/// dropped (ascending), scored NaN.
template <class T>
[[nodiscard]] result decode(const SparseAttentionConfig& c, const attention_shape& s,
                            const sequence<T>& seq, std::span<const std::int32_t> evicted = {}) {
  if (seq.num_queries() != 1 || seq.q_begin != seq.length() - 1)
    throw error(status::invalid_argument,
                "decode takes one query at the last cached position (length - 1)");
  return sparse_attention(c, s, seq, 1, c.fine_summary, evicted);
}

/// One KV head's TopK cache entry: the selection a decode step made, the
/// group-summed query that made it, and that query's position (-1: empty).
struct topk_cache_entry {
  tile_selection tile;  ///< the selecting step's tile (its window start, every head's lists)
  std::vector<double> qsum;
  std::int64_t position = -1;
};

/// Whether `rule` has the decode query at position p with group-summed
/// query `qsum` select afresh rather than reuse `entry`: an empty or stale
/// entry (made by a query after p), `every` positions since it was
/// made, or the query's cosine to the entry's below min_cosine (a zero or
/// non-finite query refreshes).
[[nodiscard]] inline bool refresh_due(const refresh_rule& rule, const topk_cache_entry& entry,
                                      std::span<const double> qsum, std::int64_t p) {
  if (rule.every_step() || entry.position < 0 || p < entry.position || p - entry.position >= rule.every) return true;
  if (rule.min_cosine <= -1.0f) return false;
  double dot = 0, a = 0, b = 0;
  for (std::size_t d = 0; d < qsum.size(); ++d) {
    dot += qsum[d] * entry.qsum[d];
    a += qsum[d] * qsum[d];
    b += entry.qsum[d] * entry.qsum[d];
  }
  return !(dot / std::sqrt(a * b) >= rule.min_cosine);
}

/// One KV head's TopK entries as the GPU keeps them (kv::topk_cache_ref):
/// the current one, and the one a late rule's refreshing step writes for
/// the next step (and makes current after it).
struct topk_cache_slot {
  topk_cache_entry entries[2];
  int current = 0;

  [[nodiscard]] topk_cache_entry& entry() { return entries[current]; }
  [[nodiscard]] const topk_cache_entry& entry() const { return entries[current]; }
};

/// What decode_cached did for one step.
struct cached_step {
  result r;  ///< output, LSE and tokens attended over the selections used (r.tiles[0]: the fresh one)
  std::vector<std::int64_t> window_begin;  ///< [Hkv]: the window start each head attended from
  std::vector<bool> refreshed;             ///< [Hkv]: selected afresh (else reused)
  std::vector<bool> late;                  ///< [Hkv]: attended the entry as it stood (a late rule)
};

/// A decode step with a TopK cache (`cache`: one slot per KV head of this
/// sequence): per KV head, where c.refresh says so, the fresh selection
/// (decode's) is stored, elsewhere the entry is kept. On time, the step
/// attends the fresh selection where it refreshes and the entry's
/// (reused_selection) elsewhere. A late rule attends the entry as it stood
/// where it was made at or before the query (reused_selection), the fresh
/// selection otherwise (an empty or later entry always refreshes), and the
/// fresh one is stored beside it and made current after the step. With the
/// default rule every head refreshes and the result is decode's.
template <class T>
[[nodiscard]] cached_step decode_cached(const SparseAttentionConfig& c, const attention_shape& s,
                                        const sequence<T>& seq, std::vector<topk_cache_slot>& cache) {
  if (static_cast<int>(cache.size()) != s.num_kv_heads)
    throw error(status::invalid_argument, "decode_cached: one cache slot per KV head");
  cached_step out;
  out.r = decode(c, s, seq);
  const tile_selection& fresh = out.r.tiles[0];
  const int hkv = s.num_kv_heads, dim = s.head_dim, group = s.group_size();
  const std::int64_t p = seq.q_begin;
  for (int h = 0; h < hkv; ++h) {
    std::vector<double> qsum(static_cast<std::size_t>(dim), 0.0);
    for (int g = 0; g < group; ++g)
      for (int d = 0; d < dim; ++d) qsum[static_cast<std::size_t>(d)] += to_double(seq.queries(0, h * group + g, d));
    auto& slot = cache[static_cast<std::size_t>(h)];
    const topk_cache_entry& entry = slot.entry();
    const bool refresh = refresh_due(c.refresh, entry, qsum, p);
    const bool late = c.refresh.late && entry.position >= 0 && entry.position <= p;
    out.refreshed.push_back(refresh);
    out.late.push_back(late);
    const tile_selection used = late || !refresh ? reused_selection(entry.tile, p, c) : fresh;
    if (refresh) {
      // A late rule writes the other entry, made current after the step.
      slot.entries[c.refresh.late ? slot.current ^ 1 : slot.current] = {fresh, std::move(qsum), p};
      if (c.refresh.late) slot.current ^= 1;
    }
    if (!late && refresh) {
      out.window_begin.push_back(fresh.window_begin);
      continue;
    }
    out.window_begin.push_back(used.window_begin);
    const auto positions = attended_positions(used, h, p, c);
    out.r.attended[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(positions.size());
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      const auto q = detail::query_row(seq, 0, qh, dim);
      out.r.lse[static_cast<std::size_t>(qh)] = detail::attend_row(q.data(), seq.keys, seq.values, h, dim, positions,
                                                                   &out.r.output[static_cast<std::size_t>(qh * dim)]);
    }
  }
  return out;
}

/// Decode for a batch of sequences (possibly of different lengths). The
/// whole batch is validated before any work.
template <class T>
[[nodiscard]] std::vector<result> decode_batch(const SparseAttentionConfig& c,
                                               const attention_shape& s,
                                               std::span<const sequence<T>> batch) {
  std::vector<std::int64_t> lengths;
  for (const auto& seq : batch) lengths.push_back(seq.length());
  throw_if_error(check_problem(c, s, lengths));
  for (const auto& seq : batch) detail::check_sequence(c, s, seq, 1);
  std::vector<result> out;
  out.reserve(batch.size());
  for (const auto& seq : batch) out.push_back(decode(c, s, seq));
  return out;
}

/// Dense causal attention (every key at or before each query), fp64: the
/// baseline the sparse result is measured against.
template <class T>
[[nodiscard]] result dense_attention(const attention_shape& s, const sequence<T>& seq) {
  detail::check_sequence(SparseAttentionConfig{}, s, seq, 1);
  const int hq = s.num_q_heads, dim = s.head_dim, group = s.group_size();
  result r;
  r.shape = s;
  r.q_begin = seq.q_begin;
  r.num_queries = seq.num_queries();
  r.output.assign(static_cast<std::size_t>(r.num_queries * hq * dim), 0.0);
  r.lse.assign(static_cast<std::size_t>(r.num_queries * hq), 0.0);
  r.attended.assign(static_cast<std::size_t>(r.num_queries * s.num_kv_heads), 0);
  for (std::int64_t i = 0; i < r.num_queries; ++i) {
    std::vector<std::int64_t> positions(static_cast<std::size_t>(seq.q_begin + i + 1));
    std::iota(positions.begin(), positions.end(), std::int64_t{0});
    for (int h = 0; h < s.num_kv_heads; ++h)
      r.attended[static_cast<std::size_t>(i * s.num_kv_heads + h)] =
          static_cast<std::int64_t>(positions.size());
    for (int qh = 0; qh < hq; ++qh) {
      const auto q = detail::query_row(seq, i, qh, dim);
      r.lse[static_cast<std::size_t>(i * hq + qh)] = detail::attend_row(
          q.data(), seq.keys, seq.values, qh / group, dim, positions,
          &r.output[static_cast<std::size_t>((i * hq + qh) * dim)]);
    }
  }
  return r;
}

/// How much of dense attention the selection keeps: for each (query, query
/// head), the share of the dense softmax mass that falls on the positions the
/// sparse result attends, averaged over queries and heads. 1.0 is lossless.
template <class T>
[[nodiscard]] double mass_recall(const SparseAttentionConfig& c, const attention_shape& s,
                                 const sequence<T>& seq, const result& sparse,
                                 const result& dense) {
  const int dim = s.head_dim, group = s.group_size();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  double total = 0.0;
  std::vector<double> k(dim);
  for (std::int64_t i = 0; i < sparse.num_queries; ++i) {
    const tile_selection& tile = sparse.tile_of(i);
    for (int h = 0; h < s.num_kv_heads; ++h) {
      const auto positions = attended_positions(tile, h, seq.q_begin + i, c);
      for (int g = 0; g < group; ++g) {
        const int qh = h * group + g;
        const auto q = detail::query_row(seq, i, qh, dim);
        double mass = 0.0;
        for (const std::int64_t t : positions) {
          for (int d = 0; d < dim; ++d) k[d] = to_double(seq.keys(t, h, d));
          mass += std::exp(detail::dot(q.data(), k.data(), dim) * scale - dense.lse_of(i, qh));
        }
        total += mass;
      }
    }
  }
  return total / static_cast<double>(sparse.num_queries * s.num_q_heads);
}

}  // namespace hisparse::reference
