#pragma once
// A whole model's decode step (DESIGN.md section 4): one planned
// hierarchical_decode per layer of one cache, replayed from one CUDA graph.
// `warm_up` pays every first-call cost before the first step an engine
// times: each layer's plan, an eager pass (module loading, kernel
// attributes), the capture and instantiation of the graph, and one replay;
// `replay` then launches the graph and nothing else. A hook records the
// engine's own work before each layer's step into the same graph (its
// projections, which make layer l + 1's queries from layer l's output).
//
// Appends stay outside the graph: a decode append may take a fresh page,
// a host decision. Each layer plans into its own part of the workspace, so
// every layer's kept slices (layer(l).kept_slices()) outlive the step for
// a residency policy to read.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/runtime/compose.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"

namespace hisparse {

/// One decode step of every layer in [0, layers) of the cache: each layer's
/// queries, outputs and log-sum-exps one after another.
template <class T, class KV = T>
struct model_decode_arguments {
  const T* queries = nullptr;           ///< [layers][batch][num_q_heads][head_dim]
  const std::int32_t* slots = nullptr;  ///< [batch], device
  int batch = 0;
  int layers = 0;
  int num_q_heads = 0;
  kv::paged_kv_ref<KV> cache{};
  T* out = nullptr;      ///< [layers][batch][num_q_heads][head_dim]
  float* lse = nullptr;  ///< optional [layers][batch][num_q_heads]
  float softmax_scale = 0.0f;

  /// Layer l's step.
  [[nodiscard]] decode_step_arguments<T, KV> layer(int l) const {
    const std::size_t rows = static_cast<std::size_t>(batch) * num_q_heads;
    const std::size_t elems = rows * static_cast<std::size_t>(cache.head_dim);
    decode_step_arguments<T, KV> a;
    a.queries = queries + l * elems;
    a.slots = slots;
    a.batch = batch;
    a.layer = l;
    a.num_q_heads = num_q_heads;
    a.cache = cache;
    a.out = out + l * elems;
    a.lse = lse != nullptr ? lse + l * rows : nullptr;
    a.softmax_scale = softmax_scale;
    return a;
  }
};

/// Host wall time of warm_up's phases (each ends with the stream synchronized).
struct warm_up_times {
  double plan_ms = 0, first_run_ms = 0, capture_ms = 0, first_replay_ms = 0;
};

template <class T, tile_policy Tile = attention::kDecodeTile, class KV = T>
class model_decode {
 public:
  using arguments = model_decode_arguments<T, KV>;
  using layer_operator = hierarchical_decode<T, Tile, KV>;
  /// Work recorded before layer l's step (in the eager run and the graph).
  using layer_hook = std::function<status(int layer, cudaStream_t)>;

  explicit model_decode(const SparseAttentionConfig& cfg) : cfg_(cfg) {}
  ~model_decode() { destroy_graph(); }
  model_decode(const model_decode&) = delete;
  model_decode& operator=(const model_decode&) = delete;

  [[nodiscard]] status can_implement(const arguments& a) const {
    if (a.layers < 1 || a.layers > a.cache.layers)
      return fail(status::invalid_argument, "model decode: layers " + std::to_string(a.layers) +
                                                " outside [1, " + std::to_string(a.cache.layers) +
                                                "] (the cache's layers)");
    // Every layer has the same shapes: the first one's check is every one's.
    return layer_operator(cfg_).can_implement(a.layer(0));
  }

  /// Workspace bytes: one aligned part per layer (the current device's plan).
  [[nodiscard]] status workspace_bytes(const arguments& a, std::size_t& bytes) const {
    HISPARSE_TRY(can_implement(a));
    std::size_t part = 0;
    HISPARSE_TRY(layer_operator(cfg_).workspace_bytes(a.layer(0), part));
    bytes = static_cast<std::size_t>(a.layers) * workspace_layout<1>::align(part);
    return status::success;
  }

  /// The same for an sm_90-class GPU with `num_sms` multiprocessors (host only).
  [[nodiscard]] status workspace_bytes(const arguments& a, int num_sms, std::size_t& bytes) const {
    HISPARSE_TRY(can_implement(a));
    std::size_t part = 0;
    HISPARSE_TRY(layer_operator(cfg_).workspace_bytes(a.layer(0), num_sms, part));
    bytes = static_cast<std::size_t>(a.layers) * workspace_layout<1>::align(part);
    return status::success;
  }

  /// Plans every layer into its part of `workspace` (stream-ordered zeroing
  /// of the merge counters on `stream`); drops a graph captured before.
  [[nodiscard]] status plan(const arguments& a, void* workspace, std::size_t bytes, cudaStream_t stream = nullptr) {
    std::size_t needed = 0;
    HISPARSE_TRY(workspace_bytes(a, needed));
    if (workspace == nullptr || bytes < needed)
      return fail(status::invalid_argument, "model decode: workspace of " + std::to_string(bytes) +
                                                " bytes is smaller than the " + std::to_string(needed) + " required");
    destroy_graph();
    layers_.clear();
    layers_.reserve(static_cast<std::size_t>(a.layers));
    const std::size_t part = needed / static_cast<std::size_t>(a.layers);
    for (int l = 0; l < a.layers; ++l) {
      layers_.emplace_back(cfg_);
      HISPARSE_TRY(layers_.back().plan(a.layer(l), static_cast<char*>(workspace) + l * part, part, stream));
    }
    return status::success;
  }

  /// Every layer in order, eagerly (`before_layer` first, when given).
  [[nodiscard]] status run(cudaStream_t stream = nullptr, const layer_hook& before_layer = {}) const {
    if (layers_.empty()) return fail(status::invalid_argument, "model decode: run before plan");
    for (int l = 0; l < layers(); ++l) {
      if (before_layer) HISPARSE_TRY(before_layer(l, stream));
      HISPARSE_TRY(layers_[static_cast<std::size_t>(l)].run(stream));
    }
    return status::success;
  }

  /// Captures run(stream, before_layer) into the graph replay() launches
  /// (thread-local capture: other threads' CUDA calls are unaffected).
  [[nodiscard]] status capture(cudaStream_t stream, const layer_hook& before_layer = {}) {
    if (layers_.empty()) return fail(status::invalid_argument, "model decode: capture before plan");
    if (stream == nullptr)
      return fail(status::invalid_argument, "model decode: capture needs a created stream, not the legacy default");
    destroy_graph();
    HISPARSE_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const status recorded = run(stream, before_layer);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    HISPARSE_TRY(recorded);
    if (ended != cudaSuccess)
      return fail(status::cuda_error, std::string("model decode: capture failed: ") + cudaGetErrorString(ended));
    const cudaError_t made = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    if (made != cudaSuccess) {
      exec_ = nullptr;
      return fail(status::cuda_error, std::string("model decode: graph instantiation failed: ") +
                                          cudaGetErrorString(made));
    }
    return status::success;
  }

  /// Plan, one eager run, capture and one replay, each synchronized, so the
  /// next replay() costs what every later one does. Pool growth is the
  /// caller's: the workspace and the cache's pages exist before this.
  [[nodiscard]] status warm_up(const arguments& a, void* workspace, std::size_t bytes, cudaStream_t stream,
                               const layer_hook& before_layer = {}, warm_up_times* times = nullptr) {
    warm_up_times t;
    auto phase = [&](double& ms, auto&& work) -> status {
      const auto begin = std::chrono::steady_clock::now();
      HISPARSE_TRY(work());
      HISPARSE_CUDA_TRY(cudaStreamSynchronize(stream));
      ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
      return status::success;
    };
    HISPARSE_TRY(phase(t.plan_ms, [&] { return plan(a, workspace, bytes, stream); }));
    HISPARSE_TRY(phase(t.first_run_ms, [&] { return run(stream, before_layer); }));
    HISPARSE_TRY(phase(t.capture_ms, [&] { return capture(stream, before_layer); }));
    HISPARSE_TRY(phase(t.first_replay_ms, [&] { return replay(stream); }));
    if (times != nullptr) *times = t;
    return status::success;
  }

  /// The captured step: one graph launch.
  [[nodiscard]] status replay(cudaStream_t stream) const {
    if (exec_ == nullptr) return fail(status::invalid_argument, "model decode: replay before capture");
    HISPARSE_CUDA_TRY(cudaGraphLaunch(exec_, stream));
    return status::success;
  }

  [[nodiscard]] int layers() const { return static_cast<int>(layers_.size()); }
  /// Layer l's planned step (its kept slices after a run or replay).
  [[nodiscard]] const layer_operator& layer(int l) const { return layers_.at(static_cast<std::size_t>(l)); }

 private:
  void destroy_graph() noexcept {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
  }

  SparseAttentionConfig cfg_;
  std::vector<layer_operator> layers_;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace hisparse
