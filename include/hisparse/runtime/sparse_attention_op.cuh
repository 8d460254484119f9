#pragma once
// The decode step as a serving engine registers a kernel: `init` once with
// the resources (the paged cache, a device memory resource, the largest
// batch), `forward` per step with nothing but the batch and a preset id,
// `release` at shutdown. One workspace, sized at init for every preset the
// cache can serve and every batch up to the largest, is shared by all
// presets (a forward runs one preset at a time, stream-ordered).
//
// Presets whose slice and block sizes differ from the cache's cannot run on
// it (the summaries are built for one F and C), nor presets whose
// fine_summary the cache does not keep; init skips them and forward says
// why if one is asked for.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"
#include "hisparse/mr/resource.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"

namespace hisparse {

template <class T, mr::device_resource Resource, tile_policy Tile = attention::kDecodeTile>
class sparse_attention_op {
 public:
  struct init_arguments {
    Resource* resource = nullptr;        ///< workspace memory; must outlive the op
    kv::paged_kv_ref<T> cache{};
    int max_batch = 0;
    int num_q_heads = 0;
    const preset_registry* presets = nullptr;  ///< null: the built-in presets
    cudaStream_t stream = nullptr;             ///< where init zeroes the workspace
  };

  struct forward_arguments {
    preset_id preset = preset_id::standard;
    const T* queries = nullptr;           ///< [batch][num_q_heads][head_dim]
    const std::int32_t* slots = nullptr;  ///< [batch], device
    int batch = 0;
    int layer = 0;
    T* out = nullptr;
    float* lse = nullptr;
  };

  sparse_attention_op() = default;
  sparse_attention_op(const sparse_attention_op&) = delete;
  sparse_attention_op& operator=(const sparse_attention_op&) = delete;
  ~sparse_attention_op() { release(); }

  /// Plans every usable preset for every batch size up to max_batch and
  /// allocates the one workspace they share. Fails without side effects.
  [[nodiscard]] status init(const init_arguments& in) {
    if (initialized_) return fail(status::invalid_argument, "sparse_attention_op: init called twice");
    if (in.resource == nullptr) return fail(status::invalid_argument, "sparse_attention_op: no resource");
    if (in.max_batch < 1) return fail(status::invalid_argument, "sparse_attention_op: max_batch must be >= 1");
    const preset_registry builtin;
    const preset_registry& reg = in.presets != nullptr ? *in.presets : builtin;
    std::map<preset_id, hierarchical_decode<T, Tile>> ops;
    std::size_t bytes = 1;
    for (const auto& [id, name] : reg.list()) {
      const SparseAttentionConfig& cfg = reg.get(id);
      if (cfg.fine_slice != in.cache.fine_slice || cfg.coarse_block != in.cache.coarse_block) continue;
      if (!in.cache.keeps(cfg.fine_summary)) continue;
      hierarchical_decode<T, Tile> op(cfg);
      std::size_t b = 0;  // covers every batch up to max_batch
      HISPARSE_TRY(op.workspace_bytes(probe_arguments(in, in.max_batch), b));
      bytes = std::max(bytes, b);
      ops.emplace(id, op);
    }
    if (ops.empty())
      return fail(status::unsupported, "sparse_attention_op: no preset matches the cache's slice/block sizes (" +
                                           std::to_string(in.cache.fine_slice) + "/" +
                                           std::to_string(in.cache.coarse_block) + ")");
    void* ws = in.resource->allocate(bytes, in.stream);
    // Plan each preset at the largest batch: zeroes the (shared) counters.
    for (auto& [id, op] : ops) {
      const status st = op.plan(probe_arguments(in, in.max_batch), ws, bytes, in.stream);
      if (st != status::success) {
        in.resource->deallocate(ws, bytes, in.stream);
        return st;
      }
    }
    ops_ = std::move(ops);
    init_ = in;
    workspace_ = ws;
    workspace_bytes_ = bytes;
    initialized_ = true;
    return status::success;
  }

  /// One decode step of `batch` rows with the given preset: two launches, no
  /// allocation, no sync (capturable).
  [[nodiscard]] status forward(const forward_arguments& f, cudaStream_t stream) {
    if (!initialized_) return fail(status::invalid_argument, "sparse_attention_op: forward before init");
    const auto it = ops_.find(f.preset);
    if (it == ops_.end())
      return fail(status::invalid_argument, "sparse_attention_op: preset " + std::to_string(static_cast<int>(f.preset)) +
                                                " is unknown, or the cache cannot serve it (slice/block sizes or fine_summary)");
    if (f.batch < 1 || f.batch > init_.max_batch)
      return fail(status::invalid_argument, "sparse_attention_op: batch " + std::to_string(f.batch) +
                                                " outside [1, " + std::to_string(init_.max_batch) + "]");
    decode_step_arguments<T> a = probe_arguments(init_, f.batch);
    a.queries = f.queries;
    a.slots = f.slots;
    a.layer = f.layer;
    a.out = f.out;
    a.lse = f.lse;
    HISPARSE_TRY(it->second.rebind(a));
    return it->second.run(stream);
  }

  /// Frees the workspace, stream-ordered on the init stream: forwards queued
  /// on other streams must be ordered before it by the caller (the resource
  /// contract). The destructor calls it. Safe to call twice.
  void release() {
    if (!initialized_) return;
    init_.resource->deallocate(workspace_, workspace_bytes_, init_.stream);
    ops_.clear();
    workspace_ = nullptr;
    initialized_ = false;
  }

  [[nodiscard]] std::size_t workspace_bytes() const { return workspace_bytes_; }
  [[nodiscard]] bool serves(preset_id id) const { return ops_.count(id) != 0; }
  /// The operator of a preset (its selection buffers, for diagnostics).
  [[nodiscard]] const hierarchical_decode<T, Tile>& op(preset_id id) const { return ops_.at(id); }

 private:
  static decode_step_arguments<T> probe_arguments(const init_arguments& in, int batch) {
    // Shape-only arguments: checks and sizes never dereference these.
    static const T dummy_queries alignas(16)[8]{};
    decode_step_arguments<T> a;
    a.queries = dummy_queries;
    a.slots = reinterpret_cast<const std::int32_t*>(dummy_queries);
    a.batch = batch;
    a.num_q_heads = in.num_q_heads;
    a.cache = in.cache;
    a.out = const_cast<T*>(dummy_queries);
    return a;
  }

  std::map<preset_id, hierarchical_decode<T, Tile>> ops_;
  init_arguments init_{};
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  bool initialized_ = false;
};

}  // namespace hisparse
