#pragma once
// What a selection CTA is, shared by the decode and prefill selection
// kernels, their row scoring and their ranking: its threads, the cluster of
// CTAs a (sequence, KV head) takes on sm_90, the candidate limits, and the
// few cluster operations the kernels need.

#include "hisparse/config.hpp"
#include "hisparse/core/macros.hpp"
#include "hisparse/core/ptx.cuh"
#include "hisparse/tuning.hpp"

namespace hisparse::select::detail {

inline constexpr int kSelectThreads = tuning::kSelectThreads;
inline constexpr int kSelectWarps = kSelectThreads / 32;
inline constexpr int kSelectKeysPerThread = tuning::kSelectKeysPerThread;
/// Candidates one CTA ranks: 4096 blocks (4M tokens at C = 1024) or 4096
/// fine candidates (top_k_coarse * C / F).
inline constexpr int kMaxSelectCandidates = kSelectThreads * kSelectKeysPerThread;
static_assert(kMaxSelectCandidates == hisparse::kMaxCandidates, "config.hpp's limit is what one CTA ranks");
inline constexpr int kFilterMaxCandidates = tuning::kFilterMaxCandidates;
inline constexpr int kFilterMaxK = kSelectThreads / 2;
inline constexpr int kSelectCluster = tuning::kSelectCluster;
/// Blocks ranked by counting (count_top_k): one per thread of a cluster;
/// more take mark_top_k.
inline constexpr int kCountMax = kSelectThreads * kSelectCluster;
inline constexpr int kSelectMinBlocksPerSm = tuning::kSelectMinBlocksPerSm;

/// The few cluster operations the kernel needs, for a cluster of S CTAs;
/// S = 1 is a plain CTA (every architecture). Clusters exist from sm_90 on;
/// the host launches S > 1 only where the loaded binary is sm_90 or newer.
template <int S>
struct cluster_ops {
  __device__ static unsigned rank() {
    if constexpr (S == 1) return 0;
    return ptx::cluster_rank();
  }
  /// Barrier across the cluster with release/acquire semantics: shared
  /// memory written (locally or remotely) before it is visible after it.
  __device__ static void sync() {
    arrive();
    wait();
  }
  /// The two halves of a cluster barrier, for work between them. arrive()
  /// releases what this thread wrote; wait() returns once every thread of
  /// the cluster has arrived, and acquires. With S = 1 arrive() is nothing
  /// and wait() is __syncthreads().
  __device__ static void arrive() {
    if constexpr (S > 1) ptx::cluster_arrive();
  }
  /// arrive() without the release: for a barrier that only says "this CTA
  /// is running" (no memory of it is read across the barrier).
  __device__ static void arrive_relaxed() {
    if constexpr (S > 1) ptx::cluster_arrive_relaxed();
  }
  __device__ static void wait() {
    if constexpr (S == 1) {
      __syncthreads();
    } else {
      ptx::cluster_wait();
    }
  }
  /// `p` (an address in this CTA's shared memory) in CTA `r` of the cluster.
  template <class T>
  __device__ static T* peer(T* p, unsigned r) {
    if constexpr (S == 1) return p;
    return ptx::cluster_map(p, r);
  }
};

/// This thread's warp among the cluster's S * kSelectWarps.
template <int S>
__device__ __forceinline__ int cluster_warp() {
  return static_cast<int>(cluster_ops<S>::rank()) * kSelectWarps + static_cast<int>(threadIdx.x / 32);
}

}  // namespace hisparse::select::detail
