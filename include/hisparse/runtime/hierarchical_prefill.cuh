#pragma once
// The composed prefill step (DESIGN.md section 2) with the decode step's
// protocol (can_implement, workspace_bytes, plan, rebind, run):
//   launch 1: select::select_prefill_async (the fp16 copy of the summary
//             rows its plain pass reads, then coarse + fine per query tile
//             and KV head);
//   launch 2: attention::prefill_attention_async over each tile's kept
//             slices and its window, causal inside the tile.
// `plan` is host work only (it carves the caller's workspace into the
// selection's lists); `run` only launches, so a chunk captures into a CUDA
// graph and replays with new queries and segments in the same device
// buffers. Every tile finds its segment on the device: no host loop over
// tiles per call.
//
// Where no tile of the chunk has more far slices than top_k_fine (prompts
// up to about W + top_k_fine F tokens), the selection would keep every far
// slice and the sparse attention would attend exactly the dense one's
// tokens: the plan then runs the dense attention alone (the same result,
// one launch fewer).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/attention/prefill.cuh"
#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/runtime/compose.hpp"
#include "hisparse/select/prefill_selection.cuh"

namespace hisparse {

/// One prefill call: the chunks of one or more sequences as the segments of
/// select::layout_prefill_segments (on the device), their queries, and where
/// the output goes.
template <class T>
struct prefill_step_arguments {
  const T* queries = nullptr;                         ///< [total queries][num_q_heads][head_dim]
  const select::prefill_segment* segments = nullptr;  ///< device, laid out by layout_prefill_segments
  int num_segments = 0;
  int num_tiles = 0;  ///< the layout's total
  /// Host: one past the last position of any segment (q_begin + num_queries
  /// at most); 0 if unknown. Lets the plan see that a chunk is short enough
  /// for the dense attention to be the sparse one.
  std::int32_t max_end = 0;
  int layer = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<T> cache{};
  T* out = nullptr;            ///< [total queries][num_q_heads][head_dim]
  float* lse = nullptr;        ///< optional [total queries][num_q_heads], natural log
  float softmax_scale = 0.0f;  ///< 0: 1 / sqrt(head_dim)
};

/// Shape-only arguments for `cache` and a call of `tiles` tiles over at most
/// `segments` sequences: what checks and workspace sizes read, with
/// placeholder pointers that are never dereferenced (hierarchical_attention.cuh
/// has the decode one).
template <class T>
[[nodiscard]] prefill_step_arguments<T> shape_only_prefill_arguments(const kv::paged_kv_ref<T>& cache, int tiles,
                                                                     int num_q_heads, int segments = 1) {
  static const T placeholder alignas(16)[8]{};
  static const select::prefill_segment segment{};
  prefill_step_arguments<T> a;
  a.queries = placeholder;
  a.segments = &segment;
  a.num_segments = segments;
  a.num_tiles = tiles;
  a.num_q_heads = num_q_heads;
  a.cache = cache;
  a.out = const_cast<T*>(placeholder);
  return a;
}

template <class T, tile_policy Tile = attention::kPrefillTile,
          attention::pv_precision P = attention::kPrefillPv>
class hierarchical_prefill {
  static_assert(valid_prefill_tile_v<Tile>);
  static_assert(!kv::is_fp8_v<T>,
                "the sparse prefill reads 16-bit K/V pages: prefill into a bf16 cache (an fp8 cache serves decode)");

 public:
  using arguments = prefill_step_arguments<T>;

  explicit hierarchical_prefill(const SparseAttentionConfig& cfg) : cfg_(cfg) {}

  [[nodiscard]] const SparseAttentionConfig& config() const { return cfg_; }

  /// Every stage's check: the config, the selection, the attention.
  [[nodiscard]] status can_implement(const arguments& a) const {
    return can_implement_all(
        [&] { return check(cfg_); },
        [&] {
          const std::int64_t capacity = a.cache.positions();
          if (a.max_end < 0) return fail(status::invalid_argument, "hierarchical prefill: max_end must be >= 0");
          if (a.max_end > capacity)
            return fail(status::invalid_argument, "hierarchical prefill: max_end " + std::to_string(a.max_end) +
                                                      " is past the cache's " + std::to_string(capacity) +
                                                      " positions a sequence");
          return status::success;
        },
        [&] {
          return attention::can_implement_prefill_attention(attention_arguments(a, true, dummy(), dummy()), Tile);
        });
  }

  /// Workspace bytes for `a` (and any call of at most a.num_tiles tiles):
  /// the kept slices, their counts and the window starts of every tile, and
  /// the selection's fp16 plain rows for a.num_segments segments of the
  /// cache's length (so a later, longer chunk keeps the fast plain pass). A
  /// later call with more segments scores the ones past them in one exact
  /// pass (the same kept sets, slower): plan for the most segments a call
  /// carries.
  [[nodiscard]] status workspace_bytes(const arguments& a, std::size_t& bytes) const {
    HISPARSE_TRY(can_implement(a));
    bytes = layout_for(a.num_tiles, a.cache, a.num_segments, plain_positions(a)).total;
    return status::success;
  }

  /// Checks `a` and lays out `workspace` (at least workspace_bytes). Host
  /// work only. Keeps `a`: later runs read the same device buffers.
  [[nodiscard]] status plan(const arguments& a, void* workspace, std::size_t bytes) {
    std::size_t needed = 0;
    HISPARSE_TRY(workspace_bytes(a, needed));
    if (workspace == nullptr || bytes < needed)
      return fail(status::invalid_argument, "hierarchical prefill: workspace of " + std::to_string(bytes) +
                                                " bytes is smaller than the " + std::to_string(needed) + " required");
    workspace_ = workspace;
    planned_tiles_ = a.num_tiles;
    planned_segments_ = a.num_segments;
    planned_positions_ = plain_positions(a);
    planned_ = true;
    bind(a);
    return status::success;
  }

  /// Points a planned operator at another call of at most the planned tiles
  /// and the planned shape (heads, head_dim) in the same workspace (host
  /// work only).
  [[nodiscard]] status rebind(const arguments& a) {
    if (!planned_) return fail(status::invalid_argument, "hierarchical prefill: rebind before plan");
    if (a.num_tiles > planned_tiles_)
      return fail(status::invalid_argument, "hierarchical prefill: " + std::to_string(a.num_tiles) +
                                                " tiles exceed the planned " + std::to_string(planned_tiles_));
    HISPARSE_TRY(check_rebind_shape(args_, a, "hierarchical prefill"));
    HISPARSE_TRY(can_implement(a));
    bind(a);
    return status::success;
  }

  /// The launches, nothing else: capturable.
  [[nodiscard]] status run(cudaStream_t stream = nullptr) const {
    if (!planned_) return fail(status::invalid_argument, "hierarchical prefill: run before plan");
    if (!dense_) HISPARSE_TRY(run_selection(stream));
    return run_attention(stream);
  }
  [[nodiscard]] status run_selection(cudaStream_t stream = nullptr) const {
    if (!planned_) return fail(status::invalid_argument, "hierarchical prefill: run before plan");
    select::prefill_selection_arguments<T> s;
    s.queries = args_.queries;
    s.segments = args_.segments;
    s.num_segments = args_.num_segments;
    s.num_tiles = args_.num_tiles;
    s.layer = args_.layer;
    s.num_q_heads = args_.num_q_heads;
    s.set_cache(args_.cache);
    s.plain_rows = plain_;
    s.plain_segments = planned_segments_;
    // (A rebind may name a cache with fewer positions: its rows, then, fit too.)
    s.plain_positions = std::min(planned_positions_, plain_positions(args_));
    return select::select_prefill_async(cfg_, s, select::prefill_selection_output{kept_, num_, window_}, stream);
  }
  [[nodiscard]] status run_attention(cudaStream_t stream = nullptr) const {
    if (!planned_) return fail(status::invalid_argument, "hierarchical prefill: run before plan");
    return attention::prefill_attention_async<T, Tile, P>(attention_arguments(args_, !dense_, kept_, num_), stream);
  }

  /// Whether the plan runs the dense attention alone (see the top of the file).
  [[nodiscard]] bool runs_dense() const { return dense_; }
  /// The last selection, on the device: [tiles][kv_heads][top_k_fine]
  /// ascending slice ids padded with -1, their counts, each tile's window start.
  [[nodiscard]] const std::int32_t* kept_slices() const { return kept_; }
  [[nodiscard]] const std::int32_t* num_slices() const { return num_; }
  [[nodiscard]] const std::int32_t* window_begin() const { return window_; }

 private:
  /// [kept slices | counts | window starts | the selection's plain rows]
  workspace_layout<4> layout_for(int tiles, const kv::summary_layout& cache, int segments,
                                 std::int32_t positions) const {
    const auto rows = static_cast<std::size_t>(tiles) * cache.kv_heads;
    return workspace_layout<4>::of({rows * cfg_.top_k_fine * sizeof(std::int32_t), rows * sizeof(std::int32_t),
                                    static_cast<std::size_t>(tiles) * sizeof(std::int32_t),
                                    select::prefill_plain_rows_bytes(cache, segments, positions)});
  }
  /// Positions the plain rows cover: the cache's, whatever this call's end.
  static std::int32_t plain_positions(const arguments& a) {
    return static_cast<std::int32_t>(std::clamp<std::int64_t>(a.cache.positions(), 1, kMaxContext));
  }

  /// The last tile's far region holds at most top_k_fine slices (every
  /// earlier tile's holds fewer): the selection would keep them all.
  bool dense_suffices(const arguments& a) const {
    if (a.max_end <= 0) return false;
    const std::int32_t last_tile = contract::tile_begin(a.max_end - 1, cfg_.query_tile);
    const std::int32_t ws = contract::window_begin(last_tile, cfg_.window, cfg_.fine_slice);
    return contract::far_slices(ws, cfg_.fine_slice) <= cfg_.top_k_fine;
  }

  void bind(const arguments& a) {
    const auto l = layout_for(planned_tiles_, a.cache, planned_segments_, planned_positions_);
    auto* base = static_cast<char*>(workspace_);
    kept_ = reinterpret_cast<std::int32_t*>(base + l.offset[0]);
    num_ = reinterpret_cast<std::int32_t*>(base + l.offset[1]);
    window_ = reinterpret_cast<std::int32_t*>(base + l.offset[2]);
    plain_ = l.total > l.offset[3] ? base + l.offset[3] : nullptr;
    dense_ = dense_suffices(a);
    args_ = a;
  }

  static const std::int32_t* dummy() {
    static const std::int32_t d[1]{};
    return d;
  }

  attention::prefill_attention_arguments<T> attention_arguments(const arguments& a, bool sparse,
                                                                const std::int32_t* kept,
                                                                const std::int32_t* num) const {
    attention::prefill_attention_arguments<T> d;
    d.queries = a.queries;
    d.segments = a.segments;
    d.num_segments = a.num_segments;
    d.num_tiles = a.num_tiles;
    d.query_tile = cfg_.query_tile;
    d.layer = a.layer;
    d.num_q_heads = a.num_q_heads;
    d.cache = a.cache;
    if (sparse) {
      d.kept_slices = kept;
      d.num_slices = num;
      d.top_k_fine = cfg_.top_k_fine;
      d.window = cfg_.window;
    }
    d.softmax_scale = a.softmax_scale;
    d.out = a.out;
    d.lse = a.lse;
    return d;
  }

  SparseAttentionConfig cfg_;
  arguments args_{};
  std::int32_t* kept_ = nullptr;
  std::int32_t* num_ = nullptr;
  std::int32_t* window_ = nullptr;
  void* plain_ = nullptr;
  void* workspace_ = nullptr;
  int planned_tiles_ = 0;
  int planned_segments_ = 0;
  std::int32_t planned_positions_ = 0;
  bool dense_ = false;
  bool planned_ = false;
};

/// The composed prefill with its selection fixed at compile time.
template <class Selection = default_selection_policy, tile_policy Tile = attention::kPrefillTile,
          class T = __nv_bfloat16>
class hierarchical_prefill_attention : public hierarchical_prefill<T, Tile> {
  static_assert(is_selection_policy<Selection>::value, "hierarchical_prefill_attention takes a selection_policy");

 public:
  using selection = Selection;
  static constexpr SparseAttentionConfig config_value = Selection::config;
  hierarchical_prefill_attention() : hierarchical_prefill<T, Tile>(Selection::config) {}
};

/// The dense causal baseline with the same protocol: the attention kernel
/// over every key up to each query (no selection).
template <class T, tile_policy Tile = attention::kPrefillTile,
          attention::pv_precision P = attention::kPrefillPv>
class dense_prefill {
 public:
  using arguments = prefill_step_arguments<T>;

  /// query_tile: the M the segments were laid out for.
  explicit dense_prefill(int query_tile = attention::kPrefillTile.block_q) : query_tile_(query_tile) {}

  [[nodiscard]] status plan(const arguments& a) {
    args_.queries = a.queries;
    args_.segments = a.segments;
    args_.num_segments = a.num_segments;
    args_.num_tiles = a.num_tiles;
    args_.query_tile = query_tile_;
    args_.layer = a.layer;
    args_.num_q_heads = a.num_q_heads;
    args_.cache = a.cache;
    args_.softmax_scale = a.softmax_scale;
    args_.out = a.out;
    args_.lse = a.lse;
    HISPARSE_TRY(attention::can_implement_prefill_attention(args_, Tile));
    planned_ = true;
    return status::success;
  }
  [[nodiscard]] status run(cudaStream_t stream = nullptr) const {
    if (!planned_) return fail(status::invalid_argument, "dense prefill: run before plan");
    return attention::prefill_attention_async<T, Tile, P>(args_, stream);
  }

 private:
  attention::prefill_attention_arguments<T> args_{};
  int query_tile_;
  bool planned_ = false;
};

}  // namespace hisparse
