#pragma once
// Every inline-PTX wrapper the kernels use, in one place: asynchronous
// copies (sm_80+), thread-block clusters and programmatic dependent launch
// (sm_90+), and the tensor-core and conversion instructions the kernels
// issue directly. The sm_90 ones trap when built for an older architecture,
// or do nothing where that is their meaning; the host launches clusters and
// programmatic dependents only where the loaded build is sm_90 or newer
// (detail::kernel_built_for_sm90).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "hisparse/core/macros.hpp"

namespace hisparse::ptx {

// ---- cp.async (sm_80+): 16-byte global -> shared copies in commit groups

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
/// 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/// Waits until at most `pending` (a run-time value below MaxStages) groups
/// of this thread's copies are still in flight.
template <int MaxStages>
__device__ __forceinline__ void cp_async_wait_at_most(int pending) {
  if constexpr (MaxStages > 1) {
    if (pending >= MaxStages - 2) {
      cp_async_wait<(MaxStages > 2 ? MaxStages - 2 : 0)>();
      return;
    }
    cp_async_wait_at_most<MaxStages - 1>(pending);
  } else {
    cp_async_wait<0>();
  }
}

/// Starts bringing the line holding `p` into L2 (no register, no wait): a
/// later load of it pays an L2 hit instead of the trip to HBM.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

/// Two 32-bit words to a shared-memory address in one store.
__device__ __forceinline__ void st_shared_v2(unsigned addr, unsigned a, unsigned b) {
  asm("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

/// blockIdx.x read again where it is needed, so the compiler does not keep
/// it in a register across a long stretch of code.
__device__ __forceinline__ unsigned block_index_x() {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  return x;
}

// ---- Thread-block clusters (sm_90+)

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

// ---- Programmatic dependent launch (sm_90+; no-ops elsewhere and in a
// launch that was not programmatic)

/// The primary's half: a kernel launched as this grid's programmatic
/// dependent may start once every CTA has executed this (or exited).
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// The dependent's half: waits until the grid this one may overlap has
/// finished and its writes are visible.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- Tensor cores (mma.sync, sm_80+) and their operands

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/// d = A B + c for one m16n8k16 tile of T (bf16 or fp16), fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                                          const float (&c)[4]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
}

/// d += a b for one m16n8k8 tf32 tile, fp32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// d += a b with A's four registers straight from a 16-byte load.
__device__ __forceinline__ void mma_tf32(float (&d)[4], float4 a, float b0, float b1) {
  const unsigned f[4] = {__float_as_uint(a.x), __float_as_uint(a.y), __float_as_uint(a.z), __float_as_uint(a.w)};
  mma_tf32(d, f, __float_as_uint(b0), __float_as_uint(b1));
}

/// Two floats as a T pair in one register (x in the low half), rounded.
template <class T>
__device__ __forceinline__ unsigned pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<const unsigned*>(&v);
  }
}

/// Two floats as a T pair truncated toward zero (x in the low half).
template <class T>
__device__ __forceinline__ unsigned pack2_rz(float x, float y) {
  unsigned r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("cvt.rz.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
  } else {
    asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(y), "f"(x));
  }
  return r;
}

/// The residual of pack2_rz's halves, rounded, as a second pair: x = hi +
/// lo to about twice the type's precision. lo is >= 0, and > 0 wherever x
/// is, so an infinite value times P is (hi + lo) inf = inf as in fp64, never
/// inf - inf or 0 * inf. The floor: bf16's smallest normal (2^-126, far
/// below any error that matters), fp16's smallest subnormal (2^-24, as
/// coarse as fp16's own spacing down there).
template <class T>
__device__ __forceinline__ unsigned pack2_residual(float x, float y, unsigned hi) {
  constexpr float kTiny = std::is_same_v<T, __nv_bfloat16> ? 0x1p-126f : 0x1p-24f;
  float2 h;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi));
  } else {
    h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  }
  return pack2<T>(fmaxf(x - h.x, x > 0.0f ? kTiny : 0.0f), fmaxf(y - h.y, y > 0.0f ? kTiny : 0.0f));
}

/// max(a, b), NaN if either is NaN (fmaxf would drop it).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

}  // namespace hisparse::ptx
