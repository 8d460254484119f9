#pragma once
// A batch of random sequences, their host copies, and the paged cache they
// are appended to: the common input of the selection and attention tests.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/config.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/reference/sparse_attention.hpp"
#include "workload/synthetic.hpp"

namespace hisparse::test {

template <class T = __nv_bfloat16>
struct problem {
  attention_shape shape;
  SparseAttentionConfig cfg;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<T>> keys, values;  // [seq] -> [t][h][d]
  std::vector<T> queries;                    // [b][hq][d]

  /// The reference's view of batch row b (its one decode query at length - 1).
  [[nodiscard]] reference::sequence<T> sequence(int b) const {
    reference::sequence<T> seq;
    const std::int64_t len = lengths[static_cast<std::size_t>(b)];
    seq.keys = tensor_view<const T, 3>::contiguous(keys[b].data(), len, shape.num_kv_heads, shape.head_dim);
    seq.values = tensor_view<const T, 3>::contiguous(values[b].data(), len, shape.num_kv_heads, shape.head_dim);
    seq.queries = tensor_view<const T, 3>::contiguous(
        queries.data() + static_cast<std::size_t>(b) * shape.num_q_heads * shape.head_dim, 1, shape.num_q_heads,
        shape.head_dim);
    seq.q_begin = len - 1;
    return seq;
  }
};

/// Normal keys, values and queries (never zeros); constant keys plant ties.
template <class T = __nv_bfloat16>
problem<T> make_problem(const attention_shape& shape, const SparseAttentionConfig& cfg,
                        std::vector<std::int64_t> lengths, std::uint64_t seed, bool constant_keys = false) {
  problem<T> p{shape, cfg, std::move(lengths), {}, {}, {}};
  workload::splitmix64 rng(seed);
  for (const auto len : p.lengths) {
    std::vector<T> k(static_cast<std::size_t>(len * shape.num_kv_heads * shape.head_dim));
    std::vector<T> v(k.size());
    for (auto& x : k) x = from_float<T>(constant_keys ? 0.5f : static_cast<float>(rng.normal()));
    for (auto& x : v) x = from_float<T>(static_cast<float>(rng.normal()));
    p.keys.push_back(std::move(k));
    p.values.push_back(std::move(v));
  }
  p.queries.resize(p.lengths.size() * shape.num_q_heads * shape.head_dim);
  for (auto& x : p.queries) x = from_float<T>(static_cast<float>(rng.normal()));
  return p;
}

/// Cache options that fit the problem: one slot per sequence, and the
/// summaries its config reads.
template <class T>
kv::paged_kv_cache_options cache_options(const problem<T>& p, std::int64_t max_context) {
  kv::paged_kv_cache_options o;
  o.num_kv_heads = p.shape.num_kv_heads;
  o.head_dim = p.shape.head_dim;
  o.fine_slice = p.cfg.fine_slice;
  o.coarse_block = p.cfg.coarse_block;
  o.max_sequences = static_cast<int>(p.lengths.size());
  o.max_context = max_context;
  o.fine_summary = p.cfg.fine_summary;  // what the config's decode filters read
  o.coarse_summary = p.cfg.coarse_summary;
  return o;
}

/// Appends every sequence of the problem to a fresh cache (one prefill call);
/// returns the slots in batch order.
template <class T, class Cache>
std::vector<int> fill(const problem<T>& p, Cache& cache) {
  std::vector<int> slots;
  std::vector<kv::append_segment> segs;
  std::vector<T> k, v;
  for (std::size_t s = 0; s < p.lengths.size(); ++s) {
    int slot = -1;
    REQUIRE(cache.add_sequence(cache.options().max_context, slot) == status::success);
    slots.push_back(slot);
    segs.push_back({slot, static_cast<std::int32_t>(k.size() / (p.shape.num_kv_heads * p.shape.head_dim)),
                    static_cast<std::int32_t>(p.lengths[s])});
    k.insert(k.end(), p.keys[s].begin(), p.keys[s].end());
    v.insert(v.end(), p.values[s].begin(), p.values[s].end());
  }
  device_buffer<T> dk(k), dv(v);
  REQUIRE(cache.append_async(0, segs, dk.ptr, dv.ptr, nullptr) == status::success);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  return slots;
}

}  // namespace hisparse::test
