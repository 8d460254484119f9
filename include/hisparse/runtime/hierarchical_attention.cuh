#pragma once
// The composed decode step (DESIGN.md section 2): coarse filter -> fine
// filter -> compact slice lists -> attention, as two stage components with the
// same protocol (can_implement, workspace, run):
//   launch 1: select::select_decode_async (coarse + fine, one launch; a
//             cluster of CTAs per (sequence, KV head) on sm_90);
//   launch 2: attention::decode_attention_async over the kept slices and the
//             window (split across CTAs, merged by the last one in).
// `plan` sizes and carves the caller's workspace and zeroes the merge
// counters (stream-ordered, no device sync); `run` only launches, so a whole
// step captures into a CUDA graph and replays with new queries, slots and
// lengths in the same device buffers.
//
// `hierarchical_decode<T, Tile>` takes the config at run time (the
// selection kernel reads its sizes and widths as parameters);
// `hierarchical_attention<Selection, Tile, T>` fixes it at compile time from
// a selection policy, checks it there, and runs a selection kernel built
// for the policy's numbers (policy_shape).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/attention/decode.cuh"
#include "hisparse/config.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/runtime/compose.hpp"
#include "hisparse/select/decode_selection.cuh"

namespace hisparse {

/// One decode step of a batch: the queries, which cache slot each row is,
/// and where the output (and optionally the log-sum-exp) goes. KV: the
/// cache's element type (T, or fp8 e4m3 pages with bf16 queries).
template <class T, class KV = T>
struct decode_step_arguments {
  const T* queries = nullptr;           ///< [batch][num_q_heads][head_dim]
  const std::int32_t* slots = nullptr;  ///< [batch], device
  int batch = 0;
  int layer = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<KV> cache{};
  T* out = nullptr;      ///< [batch][num_q_heads][head_dim]
  float* lse = nullptr;  ///< optional [batch][num_q_heads], natural log
  float softmax_scale = 0.0f;  ///< 0: 1 / sqrt(head_dim)
};

/// Shape-only arguments for `cache`: what checks and workspace sizes read
/// (batch, heads, the cache's layout), with placeholder pointers that are
/// never dereferenced. For sizing before any buffer exists.
template <class KV, class T = kv::kv_input_t<KV>>
[[nodiscard]] decode_step_arguments<T, KV> shape_only_decode_arguments(const kv::paged_kv_ref<KV>& cache, int batch,
                                                                       int num_q_heads) {
  static const T placeholder alignas(16)[8]{};
  decode_step_arguments<T, KV> a;
  a.queries = placeholder;
  a.slots = reinterpret_cast<const std::int32_t*>(placeholder);
  a.batch = batch;
  a.num_q_heads = num_q_heads;
  a.cache = cache;
  a.out = const_cast<T*>(placeholder);
  return a;
}

namespace detail {
/// The attention over every stored token of a step's arguments (the sparse
/// step adds its selection to this).
template <class T, class KV>
attention::decode_attention_arguments<T, KV> dense_attention_arguments(const decode_step_arguments<T, KV>& a) {
  attention::decode_attention_arguments<T, KV> d;
  d.queries = a.queries;
  d.slots = a.slots;
  d.batch = a.batch;
  d.layer = a.layer;
  d.num_q_heads = a.num_q_heads;
  d.cache = a.cache;
  d.max_items = a.cache.max_slices;
  d.softmax_scale = a.softmax_scale;
  d.out = a.out;
  d.lse = a.lse;
  return d;
}
}  // namespace detail

/// Shape: the selection kernel's compile-time numbers (selection_shape; a
/// config that does not match them is refused at run), or the dynamic
/// shape, whose kernel reads them at run time.
template <class T, tile_policy Tile = attention::kDecodeTile, class KV = T, class Shape = dynamic_selection_shape>
class hierarchical_decode {
  static_assert(valid_decode_tile_v<Tile>);

 public:
  using arguments = decode_step_arguments<T, KV>;

  explicit hierarchical_decode(const SparseAttentionConfig& cfg) : cfg_(cfg) {}

  [[nodiscard]] const SparseAttentionConfig& config() const { return cfg_; }

  /// Every stage's check: the config, the selection, and the attention (on
  /// the dense form of the same arguments: the selection buffers live in
  /// the workspace).
  [[nodiscard]] status can_implement(const arguments& a) const {
    return can_implement_all([&] { return check(cfg_); },
                             [&] { return select::can_implement_decode_selection(cfg_, selection_arguments(a)); },
                             [&] { return attention::can_implement_decode_attention(attention_arguments(a, nullptr, nullptr)); });
  }

  /// Workspace bytes for `a` on the current device (queries the SM count):
  /// enough for a.batch and for every smaller batch `rebind` may bring (a
  /// smaller batch takes more splits per row, so it can need more).
  [[nodiscard]] status workspace_bytes(const arguments& a, std::size_t& bytes) const {
    attention::gpu_limits gpu;
    HISPARSE_TRY(attention::current_gpu_limits(gpu));
    return workspace_bytes(a, gpu, bytes);
  }

  /// The same for an sm_90-class GPU with `num_sms` multiprocessors (host only).
  [[nodiscard]] status workspace_bytes(const arguments& a, int num_sms, std::size_t& bytes) const {
    attention::gpu_limits gpu;
    gpu.sms = num_sms;
    return workspace_bytes(a, gpu, bytes);
  }

  /// The same for the GPU `gpu` describes (host only).
  [[nodiscard]] status workspace_bytes(const arguments& a, const attention::gpu_limits& gpu, std::size_t& bytes) const {
    HISPARSE_TRY(can_implement(a));
    bytes = 0;
    arguments smaller = a;
    for (smaller.batch = 1; smaller.batch <= a.batch; ++smaller.batch) {
      layout l;
      HISPARSE_TRY(make_layout(smaller, gpu, a.batch, l));
      bytes = std::max(bytes, l.total);
    }
    return status::success;
  }

  /// Checks `a`, lays out `workspace` (at least workspace_bytes), and zeroes
  /// the merge counters on `stream`. Keeps `a`: later runs read the same
  /// device buffers (refill them between runs or replays).
  [[nodiscard]] status plan(const arguments& a, void* workspace, std::size_t bytes, cudaStream_t stream = nullptr) {
    attention::gpu_limits gpu;
    HISPARSE_TRY(attention::current_gpu_limits(gpu));
    std::size_t needed = 0;
    HISPARSE_TRY(workspace_bytes(a, gpu, needed));
    if (workspace == nullptr || bytes < needed)
      return fail(status::invalid_argument, "hierarchical decode: workspace of " + std::to_string(bytes) +
                                                " bytes is smaller than the " + std::to_string(needed) + " required");
    layout l;
    HISPARSE_TRY(make_layout(a, gpu, a.batch, l));
    bind(a, l, workspace);
    HISPARSE_TRY(attention::initialize_decode_attention_workspace(attention_plan_, attention_workspace_, stream));
    workspace_ = workspace;
    capacity_ = bytes;
    gpu_ = gpu;
    planned_batch_ = a.batch;
    planned_ = true;
    return status::success;
  }

  /// Points a planned operator at another batch of at most the planned size
  /// and of the planned shape (new queries, slots, outputs, layer) in the
  /// same workspace: host work only, no stream operation. The merge counters
  /// `plan` zeroed stay valid: they are sized for the planned batch and
  /// shape at the front of the workspace, and every run leaves them zero.
  [[nodiscard]] status rebind(const arguments& a) {
    if (!planned_) return fail(status::invalid_argument, "hierarchical decode: rebind before plan");
    if (a.batch > planned_batch_)
      return fail(status::invalid_argument, "hierarchical decode: batch " + std::to_string(a.batch) +
                                                " exceeds the planned " + std::to_string(planned_batch_));
    HISPARSE_TRY(check_rebind_shape(args_, a, "hierarchical decode"));
    HISPARSE_TRY(can_implement(a));
    layout l;
    HISPARSE_TRY(make_layout(a, gpu_, planned_batch_, l));
    if (l.total > capacity_) return fail(status::internal_error, "hierarchical decode: workspace too small");
    bind(a, l, workspace_);
    return status::success;
  }

  /// Both launches, nothing else: capturable. On sm_90 the attention is a
  /// programmatic dependent of the selection: its CTAs start while the
  /// selection drains and wait for it only before reading the kept slices
  /// (under a late TopK rule, only where the entry is not valid).
  [[nodiscard]] status run(cudaStream_t stream = nullptr) const {
    HISPARSE_TRY(launch_selection(stream, selection_carveout_, attention_launch_));
    return launch_attention(stream, /*overlap_previous=*/true);
  }

  /// The two stages alone, for timing or profiling one of them: the
  /// selection (writes kept_slices()), and the attention over the last
  /// selection's kept slices, launched as an ordinary kernel.
  [[nodiscard]] status run_selection(cudaStream_t stream = nullptr) const {
    return launch_selection(stream, /*max_shared_carveout=*/false, dependents_launch::at_start);
  }
  [[nodiscard]] status run_attention(cudaStream_t stream = nullptr) const {
    return launch_attention(stream, /*overlap_previous=*/false);
  }

  /// The selection of the last run, on the device: [batch][kv_heads][top_k_fine]
  /// ascending slice ids padded with -1, their counts, and each row's window start.
  [[nodiscard]] const std::int32_t* kept_slices() const { return kept_slices_; }
  [[nodiscard]] const std::int32_t* num_slices() const { return num_slices_; }
  [[nodiscard]] const std::int32_t* window_begin() const { return window_begin_; }
  /// [batch][kv_heads]: 1 where the last run selected afresh, 0 where it
  /// reused the TopK entry (config.hpp, refresh_rule; always 1 by default).
  [[nodiscard]] const std::int32_t* refreshed() const { return refreshed_; }
  [[nodiscard]] const attention::decode_attention_plan& attention_plan() const { return attention_plan_; }
  /// When run()'s attention may start within the selection (the plan's
  /// choice, see make_layout).
  using dependents_launch = typename select::decode_selection_arguments<T>::dependents_launch;
  [[nodiscard]] dependents_launch attention_launch() const { return attention_launch_; }

 private:
  status launch_selection(cudaStream_t stream, bool max_shared_carveout, dependents_launch dependents) const {
    if (!planned_) return fail(status::invalid_argument, "hierarchical decode: run before plan");
    auto selection = selection_arguments(args_);
    selection.max_shared_carveout = max_shared_carveout;
    selection.dependents = dependents;
    if constexpr (Shape::kDynamic)
      return select::select_decode_async(cfg_, selection, selection_output(), stream);
    else
      return select::select_decode_fixed_async<Shape>(cfg_, selection, selection_output(), stream);
  }
  status launch_attention(cudaStream_t stream, bool overlap_previous) const {
    if (!planned_) return fail(status::invalid_argument, "hierarchical decode: run before plan");
    return attention::decode_attention_async<T, Tile>(attention_plan_,
                                                      attention_arguments(args_, kept_slices_, num_slices_),
                                                      attention_workspace_, stream, overlap_previous);
  }

  struct layout {
    std::size_t attention = 0, kept = 0, num = 0, window = 0, refreshed = 0, total = 0;
    attention::decode_attention_plan attention_plan;
    bool selection_carveout = false;  ///< run() asks the selection for max_shared_carveout
    dependents_launch attention_launch = dependents_launch::at_start;  ///< when run()'s attention may start
  };

  /// The selection's CTAs for `a` (an upper bound).
  std::int64_t selection_ctas(const arguments& a) const {
    return std::int64_t{a.batch} * a.cache.kv_heads *
           select::decode_selection_launch_profile(cfg_, a.cache.max_blocks).ctas_per_head;
  }
  /// Whether the attention's CTAs start beside the selection's (few
  /// selection CTAs an SM; tuning.hpp). Then the selection's writers (one
  /// CTA per (sequence, KV head), ranking the slices after the others have
  /// left) keep their slots until it ends, and the attention is planned for
  /// the wave less those slots (PERF_NOTES: Decode step).
  bool beside_selection(const arguments& a, const attention::gpu_limits& gpu) const {
    return selection_ctas(a) <= tuning::kBesideSelectionCtasPerSm * std::int64_t{gpu.sms};
  }

  /// [attention workspace (merge counters first) | kept slices | counts | windows | refreshed]
  status make_layout(const arguments& a, const attention::gpu_limits& gpu, int counter_batch, layout& l) const {
    const bool beside = beside_selection(a, gpu);
    HISPARSE_TRY(attention::plan_decode_attention<Tile>(attention_arguments(a, nullptr, nullptr), gpu,
                                                        l.attention_plan, counter_batch,
                                                        beside ? a.batch * a.cache.kv_heads : 0));
    // The selection's SMs keep their shared memory for the attention's CTAs
    // to start beside it where that is needed and possible: the attention's
    // grid does not fit on the SMs the selection leaves free, and it starts
    // beside the selection (elsewhere the carveout only costs L1).
    const auto& ap = l.attention_plan;
    const std::int64_t attention_ctas = std::int64_t{ap.splits} * ap.head_splits * ap.kv_heads * ap.batch;
    const std::int64_t free_sms = gpu.sms - std::min<std::int64_t>(selection_ctas(a), gpu.sms);
    l.selection_carveout = beside && attention_ctas > free_sms * ap.ctas_per_sm;
    // The attention's CTAs start beside the selection's as late as pays
    // (PERF_NOTES: Decode step): once the blocks are ranked where one warp
    // ranks the slices, once the fine candidates are scored where a whole
    // CTA does; with the selection where it takes several waves (its last
    // wave would hold them back).
    // A late TopK rule's attention mostly does not wait for the selection:
    // at once.
    const bool warp_ranks = select::decode_selection_launch_profile(cfg_, a.cache.max_blocks).fine_ranked_by_one_warp;
    l.attention_launch = !beside || cfg_.refresh.late ? dependents_launch::at_start
                         : warp_ranks ? dependents_launch::after_blocks
                                      : dependents_launch::after_fine_scores;
    const std::size_t rows = static_cast<std::size_t>(a.batch) * a.cache.kv_heads;
    const std::array<std::size_t, 5> bytes{l.attention_plan.workspace_bytes,
                                           rows * cfg_.top_k_fine * sizeof(std::int32_t), rows * sizeof(std::int32_t),
                                           static_cast<std::size_t>(a.batch) * sizeof(std::int32_t),
                                           rows * sizeof(std::int32_t)};
    const auto parts = workspace_layout<5>::of(bytes);
    l.attention = parts.offset[0];
    l.kept = parts.offset[1];
    l.num = parts.offset[2];
    l.window = parts.offset[3];
    l.refreshed = parts.offset[4];
    l.total = parts.total;
    return status::success;
  }

  void bind(const arguments& a, const layout& l, void* workspace) {
    auto* base = static_cast<char*>(workspace);
    attention_workspace_ = base + l.attention;
    kept_slices_ = reinterpret_cast<std::int32_t*>(base + l.kept);
    num_slices_ = reinterpret_cast<std::int32_t*>(base + l.num);
    window_begin_ = reinterpret_cast<std::int32_t*>(base + l.window);
    refreshed_ = reinterpret_cast<std::int32_t*>(base + l.refreshed);
    attention_plan_ = l.attention_plan;
    selection_carveout_ = l.selection_carveout;
    attention_launch_ = l.attention_launch;
    args_ = a;
  }

  select::decode_selection_arguments<T> selection_arguments(const arguments& a) const {
    select::decode_selection_arguments<T> s;
    s.queries = a.queries;
    s.slots = a.slots;
    s.batch = a.batch;
    s.layer = a.layer;
    s.num_q_heads = a.num_q_heads;
    s.set_cache(a.cache);
    return s;
  }

  select::decode_selection_output selection_output() const {
    select::decode_selection_output out{kept_slices_, num_slices_, window_begin_};
    out.refreshed = refreshed_;
    return out;
  }

  attention::decode_attention_arguments<T, KV> attention_arguments(const arguments& a, const std::int32_t* kept,
                                                               const std::int32_t* num) const {
    auto d = detail::dense_attention_arguments(a);
    d.kept_slices = kept;
    d.num_slices = num;
    d.top_k_fine = cfg_.top_k_fine;
    d.window = cfg_.window;
    d.max_items = std::min(attention::sparse_max_items(cfg_), a.cache.max_slices);
    d.late_topk = cfg_.refresh.late;
    d.topk_fingerprint = select::detail::selection_fingerprint(cfg_);
    return d;
  }

  SparseAttentionConfig cfg_;
  arguments args_{};
  attention::decode_attention_plan attention_plan_{};
  bool selection_carveout_ = false;
  dependents_launch attention_launch_ = dependents_launch::at_start;
  std::int32_t* kept_slices_ = nullptr;
  std::int32_t* num_slices_ = nullptr;
  std::int32_t* window_begin_ = nullptr;
  std::int32_t* refreshed_ = nullptr;
  void* attention_workspace_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t capacity_ = 0;
  attention::gpu_limits gpu_{};
  int planned_batch_ = 0;
  bool planned_ = false;
};

/// The composed operator with its selection fixed at compile time: an
/// invalid policy does not compile (selection_policy's static check).
template <class Selection = default_selection_policy, tile_policy Tile = attention::kDecodeTile,
          class T = __nv_bfloat16>
class hierarchical_attention : public hierarchical_decode<T, Tile, T, policy_shape<Selection>> {
  static_assert(is_selection_policy<Selection>::value, "hierarchical_attention takes a selection_policy");
  static_assert(valid_decode_tile_v<Tile>);

 public:
  using selection = Selection;
  static constexpr SparseAttentionConfig config_value = Selection::config;
  hierarchical_attention() : hierarchical_decode<T, Tile, T, policy_shape<Selection>>(Selection::config) {}
};

/// The dense baseline with the same plan/run protocol: the attention kernel
/// with every stored token kept (no selection launch).
template <class T, tile_policy Tile = attention::kDecodeTile, class KV = T>
class dense_decode {
  static_assert(valid_decode_tile_v<Tile>);

 public:
  using arguments = decode_step_arguments<T, KV>;

  [[nodiscard]] status workspace_bytes(const arguments& a, std::size_t& bytes) const {
    attention::decode_attention_plan p;
    HISPARSE_TRY(plan_for(a, p));
    bytes = p.workspace_bytes;
    return status::success;
  }

  [[nodiscard]] status plan(const arguments& a, void* workspace, std::size_t bytes, cudaStream_t stream = nullptr) {
    HISPARSE_TRY(plan_for(a, plan_));
    if (workspace == nullptr || bytes < plan_.workspace_bytes)
      return fail(status::invalid_argument, "dense decode: workspace too small");
    args_ = detail::dense_attention_arguments(a);
    workspace_ = workspace;
    HISPARSE_TRY(attention::initialize_decode_attention_workspace(plan_, workspace_, stream));
    planned_ = true;
    return status::success;
  }

  [[nodiscard]] status run(cudaStream_t stream = nullptr) const {
    if (!planned_) return fail(status::invalid_argument, "dense decode: run before plan");
    return attention::decode_attention_async<T, Tile>(plan_, args_, workspace_, stream);
  }

 private:
  static status plan_for(const arguments& a, attention::decode_attention_plan& p) {
    attention::gpu_limits gpu;
    HISPARSE_TRY(attention::current_gpu_limits(gpu));
    return attention::plan_decode_attention<Tile>(detail::dense_attention_arguments(a), gpu, p);
  }

  attention::decode_attention_arguments<T, KV> args_{};
  attention::decode_attention_plan plan_{};
  void* workspace_ = nullptr;
  bool planned_ = false;
};

}  // namespace hisparse
