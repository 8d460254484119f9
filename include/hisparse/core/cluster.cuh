#pragma once
// Thread-block cluster operations (sm_90+): the barrier halves and the
// mapping of a shared-memory address into another CTA of the cluster.
// Shared by the decode selection (clusters that split the scoring) and the
// decode attention (the splits of a (sequence, KV head) merging through
// distributed shared memory). Built for an older architecture they trap: the
// host launches clusters only where the loaded build is sm_90 or newer
// (detail::kernel_built_for_sm90).

#include <cooperative_groups.h>

namespace hisparse::ptx {

/// This CTA's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  __trap();
  return 0;
#endif
}

/// The first half of a cluster barrier: releases what this thread wrote
/// (to its own or another CTA's shared memory). Every thread of the CTA
/// executes it.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// cluster_arrive without the release: for a barrier that only says "this
/// CTA is running" (no memory is read across it).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// The second half: returns once every thread of the cluster that has not
/// exited has arrived, and acquires what they released.
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

/// `p` (an address in this CTA's shared memory) in CTA `rank` of the
/// cluster, as a generic pointer (loads and stores through it reach that
/// CTA's shared memory while it runs).
template <class T>
__device__ __forceinline__ T* cluster_map(T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  __trap();
  return p;
#endif
}

}  // namespace hisparse::ptx
