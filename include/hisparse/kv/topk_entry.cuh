#pragma once
// A TopK entry's verdict and its publication (paged_kv_ref.hpp,
// topk_cache_ref; config.hpp, refresh_rule), shared by the two kernels of a
// decode step: the selection decides and rewrites the entries it refreshes;
// the attention reaches the same verdict on its own, so a (sequence, KV
// head) that reuses its entry starts on the entry's slices without waiting
// for the selection grid.
//
// Same verdict: both kernels compute it here, from the same words, in one
// fixed order with no contraction (__fmul_rn, __fadd_rn, __fsqrt_rn,
// __fdiv_rn), by warps of 32 dimensions whatever the caller's shape.
//
// Publication: word 3 of an entry is a sequence lock. The selection makes
// it odd before it rewrites any word and even again after every word it
// wrote is fenced; it reads an entry only before that. A reader that sees
// the same even value before and after its reads (each side fenced) has one
// selection's words. An entry reset to -1 reads as being written (odd), so
// a reader falls back to waiting for the selection, whose verdict on an
// empty entry is to refresh.

#include <cstdint>

#include "hisparse/config.hpp"
#include "hisparse/core/dtype.hpp"
#include "hisparse/core/macros.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"

namespace hisparse::kv {

/// Words of an entry's header (topk_cache_ref::kHeader).
struct topk_entry_word {
  static constexpr int made = 0;        ///< position of the selecting query; -1: empty
  static constexpr int count = 1;       ///< kept slices
  static constexpr int fingerprint = 2; ///< of the selecting config
  static constexpr int generation = 3;  ///< the sequence lock: odd while the selection rewrites the entry
};

/// Dimension `d` of the group-summed query: the group's query heads (rows
/// `head_dim` apart from `q`) summed in head order.
template <class Q>
__device__ __forceinline__ float group_query_sum(const Q* q, int group, int head_dim) {
  float s = 0.0f;
  for (int g = 0; g < group; ++g) s = __fadd_rn(s, to_float(q[static_cast<std::int64_t>(g) * head_dim]));
  return s;
}

/// q . e, q . q and e . e over one warp's 32 dimensions (this lane's q and
/// e; 0 past head_dim), identical on every lane (a xor butterfly adds the
/// same pairs on both lanes of a pair).
struct cosine_terms {
  float dot, qq, ee;
};
__device__ __forceinline__ cosine_terms warp_cosine_terms(float q, float e) {
  float v[3] = {__fmul_rn(q, e), __fmul_rn(q, q), __fmul_rn(e, e)};
#pragma unroll
  for (float& x : v)
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o));
  return {v[0], v[1], v[2]};
}

/// The cosine test on the chunks' terms, summed in chunk order. NaN (a zero
/// or non-finite query) compares false: refresh.
template <class Terms>
__device__ __forceinline__ bool cosine_passes(Terms terms, int chunks, float min_cosine) {
  float dot = 0.0f, a = 0.0f, b = 0.0f;
  for (int w = 0; w < chunks; ++w) {
    const cosine_terms c = terms(w);
    dot = __fadd_rn(dot, c.dot);
    a = __fadd_rn(a, c.qq);
    b = __fadd_rn(b, c.ee);
  }
  return __fdiv_rn(dot, __fmul_rn(__fsqrt_rn(a), __fsqrt_rn(b))) >= min_cosine;
}

/// The rule's tests that need no query: the entry holds a selection by this
/// config (fingerprint) of at most top_k_fine slices, made by a query at
/// most `every - 1` positions before p0.
HISPARSE_HOST_DEVICE inline bool topk_entry_current(std::int32_t made, std::int32_t count, std::int32_t fingerprint,
                                                    std::int32_t p0, const refresh_rule& rule,
                                                    std::int32_t config_fingerprint, int top_k_fine) {
  return made >= 0 && p0 >= made && p0 - made < rule.every && fingerprint == config_fingerprint &&
         count <= top_k_fine;
}

/// The attention's verdict, by one whole warp: whether the query at p0 may
/// reuse `entry` (its group-summed query from `q`, the group's first query
/// head of the row), and the entry's kept count in `count`. False where a
/// selection is rewriting the entry, or rewrote it during the reads: the
/// caller then waits for the selection and reads its output, which holds
/// the same slices whichever verdict this step's selection reached.
template <int D, class Q>
__device__ bool warp_reuse_topk_entry(const std::int32_t* entry, std::int32_t p0, const refresh_rule& rule,
                                      std::int32_t config_fingerprint, int top_k_fine, int query_offset,
                                      const Q* q, int group, int& count) {
  static_assert(D % 32 == 0, "whole warps of dimensions");
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const volatile std::int32_t* e = entry;
  const std::int32_t before = __shfl_sync(0xffffffffu, lane == 0 ? e[topk_entry_word::generation] : 0, 0);
  __threadfence();
  const std::int32_t made = __shfl_sync(0xffffffffu, lane == 0 ? e[topk_entry_word::made] : 0, 0);
  count = __shfl_sync(0xffffffffu, lane == 0 ? e[topk_entry_word::count] : 0, 0);
  const std::int32_t fp = __shfl_sync(0xffffffffu, lane == 0 ? e[topk_entry_word::fingerprint] : 0, 0);
  bool reuse = (before & 1) == 0 && topk_entry_current(made, count, fp, p0, rule, config_fingerprint, top_k_fine);
  if (reuse && rule.min_cosine > -1.0f) {
    cosine_terms terms[D / 32];
#pragma unroll
    for (int w = 0; w < D / 32; ++w)
      terms[w] = warp_cosine_terms(group_query_sum(q + 32 * w + lane, group, D),
                                   __int_as_float(e[query_offset + 32 * w + lane]));
    reuse = cosine_passes([&](int w) { return terms[w]; }, D / 32, rule.min_cosine);
  }
  __threadfence();
  const std::int32_t after = __shfl_sync(0xffffffffu, lane == 0 ? e[topk_entry_word::generation] : 0, 0);
  return reuse && after == before;
}

/// The selection's side: marks `entry` as being rewritten (thread 0; every
/// thread of the CTA must call it, and write the entry only after) and
/// returns the generation to publish with.
__device__ __forceinline__ std::int32_t begin_topk_entry_write(std::int32_t* entry) {
  std::int32_t next = 0;
  if (threadIdx.x == 0) {
    volatile std::int32_t* g = entry + topk_entry_word::generation;
    const std::uint32_t odd = static_cast<std::uint32_t>(*g) | 1u;  // unsigned: wraps, never overflows
    *g = static_cast<std::int32_t>(odd);
    next = static_cast<std::int32_t>(odd + 1u);
    __threadfence();
  }
  __syncthreads();
  return next;
}

/// Publishes the entry's words written since begin_topk_entry_write (every
/// thread of the CTA; `next` is thread 0's return value from it).
__device__ __forceinline__ void end_topk_entry_write(std::int32_t* entry, std::int32_t next) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *(volatile std::int32_t*)(entry + topk_entry_word::generation) = next;
}

}  // namespace hisparse::kv
