#pragma once
// The decode and prefill steps as a serving engine registers a kernel:
// `init` once with the resources (the paged cache, a device memory resource,
// the largest decode batch and prefill chunk), `forward` per step with
// nothing but the batch (or the chunk's segments) and a preset id, `release`
// at shutdown. One workspace, sized at init for every preset the cache can
// serve, every batch up to the largest and every chunk up to the largest
// (the decode part first, the prefill selection's lists after it), is shared
// by all presets (a forward runs one preset at a time, stream-ordered).
//
// Presets whose slice and block sizes differ from the cache's cannot run on
// it (the summaries are built for one F and C), nor presets whose
// fine_summary or coarse_summary the cache does not keep; init skips them
// and forward says why if one is asked for. Presets that rank blocks by
// key bounds serve decode only.

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
#include "hisparse/runtime/hierarchical_prefill.cuh"

namespace hisparse {

template <class T, mr::device_resource Resource, tile_policy Tile = attention::kDecodeTile>
class sparse_attention_op {
 public:
  struct init_arguments {
    Resource* resource = nullptr;        ///< workspace memory; must outlive the op
    kv::paged_kv_ref<T> cache{};
    int max_batch = 0;
    int max_prefill_tiles = 0;  ///< query tiles of the largest prefill call (0: decode only)
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

  /// One prefill call: the chunks of one or more sequences (prefill_step_arguments).
  struct prefill_forward_arguments {
    preset_id preset = preset_id::standard;
    const T* queries = nullptr;                         ///< [total queries][num_q_heads][head_dim]
    const select::prefill_segment* segments = nullptr;  ///< device, laid out by layout_prefill_segments
    int num_segments = 0;
    int num_tiles = 0;
    std::int32_t max_end = 0;  ///< host: one past the last position, 0 if unknown
    int layer = 0;
    T* out = nullptr;
    float* lse = nullptr;
  };

  sparse_attention_op() = default;
  sparse_attention_op(const sparse_attention_op&) = delete;
  sparse_attention_op& operator=(const sparse_attention_op&) = delete;
  ~sparse_attention_op() {
    try {
      release();
    } catch (...) {  // a destructor cannot report a refused free (see paged_kv_cache::release)
    }
  }

  /// Plans every usable preset for every batch size up to max_batch and
  /// allocates the one workspace they share. Fails without side effects.
  [[nodiscard]] status init(const init_arguments& in) {
    if (initialized_) return fail(status::invalid_argument, "sparse_attention_op: init called twice");
    if (in.resource == nullptr) return fail(status::invalid_argument, "sparse_attention_op: no resource");
    if (in.max_batch < 1) return fail(status::invalid_argument, "sparse_attention_op: max_batch must be >= 1");
    const preset_registry builtin;
    const preset_registry& reg = in.presets != nullptr ? *in.presets : builtin;
    if (in.max_prefill_tiles < 0) return fail(status::invalid_argument, "sparse_attention_op: max_prefill_tiles < 0");
    std::map<preset_id, hierarchical_decode<T, Tile>> ops;
    std::map<preset_id, hierarchical_prefill<T>> prefill_ops;
    std::size_t bytes = 1, prefill_bytes = 0;
    for (const auto& [id, name] : reg.list()) {
      const SparseAttentionConfig& cfg = reg.get(id);
      if (cfg.fine_slice != in.cache.fine_slice || cfg.coarse_block != in.cache.coarse_block) continue;
      if (!in.cache.keeps(cfg.fine_summary) || !in.cache.keeps(cfg.coarse_summary)) continue;
      hierarchical_decode<T, Tile> op(cfg);
      std::size_t b = 0;  // covers every batch up to max_batch
      HISPARSE_TRY(op.workspace_bytes(probe_arguments(in, in.max_batch), b));
      bytes = std::max(bytes, b);
      ops.emplace(id, op);
      // The prefill selection ranks blocks by their means only.
      if (in.max_prefill_tiles > 0 && cfg.coarse_summary == coarse_summary::mean) {
        hierarchical_prefill<T> pre(cfg);
        HISPARSE_TRY(pre.workspace_bytes(prefill_probe_arguments(in, in.max_prefill_tiles), b));
        prefill_bytes = std::max(prefill_bytes, b);
        prefill_ops.emplace(id, pre);
      }
    }
    if (ops.empty())
      return fail(status::unsupported, "sparse_attention_op: no preset matches the cache's slice/block sizes (" +
                                           std::to_string(in.cache.fine_slice) + "/" +
                                           std::to_string(in.cache.coarse_block) + ")");
    const std::size_t decode_bytes = workspace_layout<1>::align(bytes);
    bytes = decode_bytes + prefill_bytes;
    void* ws = in.resource->allocate(bytes, in.stream);
    // Plan each preset at the largest batch (zeroes the shared counters) and
    // the largest chunk.
    for (auto& [id, op] : ops) {
      status st = op.plan(probe_arguments(in, in.max_batch), ws, decode_bytes, in.stream);
      if (st == status::success && prefill_ops.count(id) != 0)
        st = prefill_ops.at(id).plan(prefill_probe_arguments(in, in.max_prefill_tiles),
                                     static_cast<char*>(ws) + decode_bytes, prefill_bytes);
      if (st != status::success) {
        in.resource->deallocate(ws, bytes, in.stream);
        return st;
      }
    }
    ops_ = std::move(ops);
    prefill_ops_ = std::move(prefill_ops);
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

  /// One prefill call with the given preset: the selection and the
  /// attention (or the dense attention alone where it is the same, see
  /// hierarchical_prefill), no allocation, no sync (capturable).
  [[nodiscard]] status forward(const prefill_forward_arguments& f, cudaStream_t stream) {
    if (!initialized_) return fail(status::invalid_argument, "sparse_attention_op: forward before init");
    const auto it = prefill_ops_.find(f.preset);
    if (it == prefill_ops_.end())
      return fail(status::invalid_argument,
                  "sparse_attention_op: no prefill for preset " + std::to_string(static_cast<int>(f.preset)) +
                      " (init with max_prefill_tiles > 0, and a preset the cache can serve)");
    if (f.num_tiles < 0 || f.num_tiles > init_.max_prefill_tiles)
      return fail(status::invalid_argument, "sparse_attention_op: " + std::to_string(f.num_tiles) +
                                                " prefill tiles outside [0, " +
                                                std::to_string(init_.max_prefill_tiles) + "]");
    prefill_step_arguments<T> a = prefill_probe_arguments(init_, f.num_tiles);
    a.queries = f.queries;
    a.segments = f.segments;
    a.num_segments = f.num_segments;
    a.max_end = f.max_end;
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
    prefill_ops_.clear();
    workspace_ = nullptr;
    initialized_ = false;
  }

  [[nodiscard]] std::size_t workspace_bytes() const { return workspace_bytes_; }
  [[nodiscard]] bool serves(preset_id id) const { return ops_.count(id) != 0; }
  [[nodiscard]] bool serves_prefill(preset_id id) const { return prefill_ops_.count(id) != 0; }
  /// The query tile a preset's prefill chunks start on (layout_prefill_segments).
  [[nodiscard]] int query_tile(preset_id id) const { return prefill_ops_.at(id).config().query_tile; }
  /// The operator of a preset (its selection buffers, for diagnostics).
  [[nodiscard]] const hierarchical_decode<T, Tile>& op(preset_id id) const { return ops_.at(id); }

 private:
  static decode_step_arguments<T> probe_arguments(const init_arguments& in, int batch) {
    return shape_only_decode_arguments(in.cache, batch, in.num_q_heads);
  }
  static prefill_step_arguments<T> prefill_probe_arguments(const init_arguments& in, int tiles) {
    return shape_only_prefill_arguments(in.cache, tiles, in.num_q_heads, in.max_batch);
  }

  std::map<preset_id, hierarchical_decode<T, Tile>> ops_;
  std::map<preset_id, hierarchical_prefill<T>> prefill_ops_;
  init_arguments init_{};
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  bool initialized_ = false;
};

}  // namespace hisparse
