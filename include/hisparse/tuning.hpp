#pragma once
// The kernels' tuning constants, each with the measurement that chose it
// (docs/PERF_NOTES.md has the tables; figures are H200, sm_90). Sizes that
// follow from the algorithm or the instructions (an MMA's 16 rows, a warp's
// 32 lanes) stay with their kernel; what was picked by timing lives here.

#include "hisparse/core/macros.hpp"
#include "hisparse/policy/tile_policy.hpp"

namespace hisparse::tuning {

// ---- KV append (kv/paged_kv_cache.cuh) ----------------------------------
/// Threads per (slice, KV head) CTA: 16-byte vectors, a row of 128 bf16 per 16.
inline constexpr int kAppendThreads = 128;
/// Segments and pages carried in the kernel's parameters (4 KB) rather than
/// copied: every decode batch up to 32 and prefill chunks up to 16K tokens
/// launch with no host-to-device copy, the largest fixed cost of a 4K-token
/// append (PERF_NOTES: KV append).
inline constexpr int kInlineSegments = 32;
inline constexpr int kInlinePages = 256;

// ---- Batched top-k (select/batched_topk.cuh) -------------------------------
inline constexpr int kTopkThreads = 256;
/// Keys per thread of a block's chunk: 4096 a block, held in registers at
/// the 40 registers of 6 CTAs an SM (PERF_NOTES: batched top-k).
inline constexpr int kTopkKeysPerThread = 16;
/// Survivors one warp sorts in a pass, 4 a lane: block_topk's register bound
/// (6 CTAs an SM) leaves no room for 8 (PERF_NOTES: batched top-k).
inline constexpr int kWarpSortKeys = 128;
/// CTAs an SM block_topk_kernel asks ptxas to fit: the filtered kernel at
/// E = 16 at 6 (3-4% faster than 5), 8 where every chunk loads as runs of
/// four (4-5% faster than 6, no spills); none below E = 16 (a bound cost 5%).
/// Capped at the threads an SM holds (2048 on sm_80/90/100, else 1536).
template <int E, bool Filtered, bool Runs>
HISPARSE_HOST_DEVICE constexpr int topk_min_blocks_per_sm() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 800 && __CUDA_ARCH__ != 900 && __CUDA_ARCH__ != 1000
  constexpr int kThreadsPerSm = 1536;
#else
  constexpr int kThreadsPerSm = 2048;
#endif
  return Filtered && E == 16 ? ((Runs ? 8 : 6) < kThreadsPerSm / kTopkThreads ? (Runs ? 8 : 6)
                                                                               : kThreadsPerSm / kTopkThreads)
                             : 0;
}

// ---- Activation top-k and the gated GEMV (select/activation_topk.cuh) -----
/// Threads a row: 2048 columns a step, 7 steps for n = 14336.
inline constexpr int kGateThreads = 256;
/// CTAs an SM the gating kernel is compiled for: 64 registers, no spills (3
/// measured 4% slower) (PERF_NOTES: activation top-k).
inline constexpr int kGateMinBlocksPerSm = 4;
/// Steps of 2048 columns whose loads a thread issues together (16
/// registers): 453 -> 424 us with two-bit rounds (PERF_NOTES: activation top-k).
inline constexpr int kGateBatch = 4;
/// Sampled columns a thread (1024 a row): the bracket's margin of four
/// standard deviations then holds ~11% of a row at K = n / 4.
inline constexpr int kGateSamplePerThread = 4;
/// Candidate words a row keeps in shared memory (32 KB): rows up to ~70K
/// columns at K = n / 4 stay on the fast path.
inline constexpr int kGateCandidates = 8192;
/// Gated GEMV: threads a CTA (8 outputs each), columns of a CTA's range,
/// and columns of W a thread has in flight (twice that for 1-2 rows); not
/// swept.
inline constexpr int kGemvThreads = 128;
inline constexpr int kGemvColumns = 128;
inline constexpr int kGemvUnroll = 8;

// ---- Decode selection (select/decode_selection.cuh) ------------------------
inline constexpr int kSelectThreads = 256;
/// Keys a thread holds for the wide kernel's block_topk: 4096 candidates a
/// CTA (kMaxCandidates).
inline constexpr int kSelectKeysPerThread = 16;
/// CTAs of a cluster per (sequence, KV head) on sm_90: 4, not 8, so B = 8
/// (64 clusters) runs in one wave at 3 CTAs an SM (clusters of 8 at 2 CTAs
/// an SM took 1.94 waves) (PERF_NOTES: decode selection).
inline constexpr int kSelectCluster = 4;
/// CTAs an SM the kernel is compiled for: 80 registers, no spills (at 4,
/// 64 registers, the narrow kernel spilled 24 bytes, the wide one 48).
inline constexpr int kSelectMinBlocksPerSm = 3;
/// The threshold filter ranks up to this many candidates (k up to half the
/// CTA); larger stages take block_topk, which only the wide kernel carries.
inline constexpr int kFilterMaxCandidates = 1024;
/// Shared memory for the partial block's far slices, staged by cp.async.
inline constexpr int kPartialBytes = 8192;
/// The one-warp fine ranking: candidates a lane holds (512 a warp: the
/// defaults' 32 x 16) and survivors it ranks, two a lane; more fall back to
/// the CTA's filter (PERF_NOTES: decode selection, warp ranking).
inline constexpr int kWarpRankPerLane = 16;
inline constexpr int kWarpRankSurvivors = 64;

// ---- Decode attention (attention/decode.cuh) -------------------------------
/// 64 rows of K and V per stage (16 a warp, 4 warps), 3 stages: two tiles in
/// flight while one is used, 96 KB at head_dim 128, two CTAs an H200 SM
/// (the sweep: PERF_NOTES: decode attention, tile policies).
inline constexpr tile_policy kDecodeTile{1, 64, 4, 3};
/// Page pointers a CTA keeps in shared memory: one dependent load per 128
/// slices, not one per slice.
inline constexpr int kPageRing = 128;
/// Warps an SM the kernel's register budget allows: 12 at head_dim 64
/// (168 registers), 8 above (255: at 168, head_dim 128 spilled).
HISPARSE_HOST_DEVICE constexpr int attention_warps_per_sm(int head_dim) { return head_dim <= 64 ? 12 : 8; }

// ---- Prefill attention (attention/prefill.cuh) ------------------------------
/// 64 queries a head (16 a warp, 4 warps) by 64-key K/V tiles, 2 stages:
/// 96 KB at head_dim 128 with two heads a CTA, two CTAs an H200 SM
/// (FlashAttention-2's forward shape; not swept yet: PERF_NOTES: prefill
/// attention).
inline constexpr tile_policy kPrefillTile{64, 64, 4, 2};
/// The Hopper kernel's tile: 64 queries a head (one wgmma M, a warpgroup),
/// 128-key K/V tiles (S on m64n128k16: 3/4 the shared-memory operand bytes
/// per FLOP of n64), 2 stages: 161 KB at head_dim 128 with two heads a
/// CTA, one CTA an SM; 3 stages (225 KB) and FlashAttention-3's in-warpgroup
/// overlap both measured slower (PERF_NOTES: prefill attention).
inline constexpr tile_policy kPrefillTileSm90{64, 128, 4, 2};
/// The warp-specialised Hopper schedule (prefill_kernel::hopper_ws): a ring
/// of 3 (K | V) stages of 128 keys with V converted in place (Q 32 KB + 192
/// KB at head_dim 128, within 227 KB), and the register split of its 384
/// threads, 56 a producer thread and 224 a consumer's (2 x 128 x 224 + 128
/// x 56 <= 64K; ptxas at head_dim 128: 4 B of spill, 28-204 B with less for
/// the producer; PERF_NOTES: prefill attention).
inline constexpr int kPrefillWsStages = 3;
inline constexpr int kPrefillWsProducerRegs = 56;
inline constexpr int kPrefillWsConsumerRegs = 224;
/// CTAs an SM the prefill kernel is compiled for (its register budget):
/// three at head_dim 64 with one m16 tile a warp (four spilled), else two
/// (255 registers; two tiles at head_dim 128 spill 48-84 B, still 15% faster
/// than one: PERF_NOTES: prefill attention), one at 256.
HISPARSE_HOST_DEVICE constexpr int prefill_attention_ctas_per_sm(int head_dim, int m_tiles) {
  return head_dim <= 64 && m_tiles == 1 ? 3 : head_dim <= 128 ? 2 : 1;
}

// ---- Decode step (runtime/hierarchical_attention.cuh) ----------------------
/// The attention starts beside the selection (and its grid is planned for
/// the wave less the selection's writers) where the selection takes at most
/// this many CTAs an SM: B = 8, 256K 40.3 -> 38.1 us (PERF_NOTES: decode step).
inline constexpr int kBesideSelectionCtasPerSm = 2;

// ---- Prefill selection (select/prefill_selection.cuh) ----------------------
/// Candidate ring depth: 1 leaves room for 3 CTAs an H200 SM at head_dim
/// 128, and 3 resident CTAs hide the loads better than a 2-deep ring
/// (256K: 7.88 against 8.90 ms) (PERF_NOTES: prefill selection).
inline constexpr int kPrefillRingStages = 1;
/// CTAs an SM the prefill kernel is compiled for: 3 on sm_90 (80 registers);
/// below it as many as shared memory lets share an SM, at most 2 (sm_80: 2,
/// sm_86/89: 1 at head_dim 128), where a tighter bound only spilled. fp32
/// CUDA cores: 1. `cta_bytes` is one CTA's shared memory.
HISPARSE_HOST_DEVICE constexpr int prefill_ctas_per_sm(int cta_bytes, bool tensor_cores) {
  if (!tensor_cores) return 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  const int sm_bytes = __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870 ? 164 * 1024 : 100 * 1024;
  const int fit = sm_bytes / cta_bytes;
  return fit < 1 ? 1 : fit > 2 ? 2 : fit;
#else
  (void)cta_bytes;
  return 3;
#endif
}

}  // namespace hisparse::tuning
