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
/// 4 bytes global -> shared (through L1: .cg takes 16 only); src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
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

/// 16 read-only bytes that skip L1 (L2 keeps them as usual): a stream read
/// once per pass leaves L1 to data many CTAs share.
__device__ __forceinline__ uint4 ld_nc_no_l1(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/// |a| * b rounded to nearest, subnormal inputs and results kept even where
/// the translation unit is compiled with -ftz=true (--use_fast_math): the
/// contract's fl32 product, which ftz would turn to 0.
__device__ __forceinline__ float abs_mul_rn(float a, float b) {
  float r;
  asm("{\n .reg .f32 t;\n abs.f32 t, %1;\n mul.rn.f32 %0, t, %2;\n}\n" : "=f"(r) : "f"(a), "f"(b));  // |a| folds into FMUL
  return r;
}

// IEEE compares, subnormals kept even where the translation unit is
// compiled with -ftz=true (whose setp.*.ftz.f32 flushes both operands to
// zero, so a subnormal would equal 0 and its neighbours).

/// a == b as 0/1.
__device__ __forceinline__ unsigned eq_ieee(float a, float b) {
  unsigned r;
  asm("{\n .reg .pred p;\n setp.eq.f32 p, %1, %2;\n selp.u32 %0, 1, 0, p;\n}\n" : "=r"(r) : "f"(a), "f"(b));
  return r;
}

/// Bit `Bit` of `above` set where a > hi and of `inside` where lo <= a and
/// not a > hi: predicated ORs, no 0/1 values (a NaN sets neither).
template <unsigned Bit>
__device__ __forceinline__ void or_above_inside(float a, float lo, float hi, unsigned& above, unsigned& inside) {
  asm("{\n .reg .pred p, q;\n setp.gt.f32 p, %2, %4;\n setp.ge.and.f32 q, %2, %3, !p;\n"
      " @p or.b32 %0, %0, %5;\n @q or.b32 %1, %1, %5;\n}\n"
      : "+r"(above), "+r"(inside)
      : "f"(a), "f"(lo), "f"(hi), "n"(1u << Bit));
}

/// Bit `Bit` of `above` set where a > t and of `equal` where a == t.
template <unsigned Bit>
__device__ __forceinline__ void or_above_equal(float a, float t, unsigned& above, unsigned& equal) {
  asm("{\n .reg .pred p, q;\n setp.gt.f32 p, %2, %3;\n setp.eq.f32 q, %2, %3;\n"
      " @p or.b32 %0, %0, %4;\n @q or.b32 %1, %1, %4;\n}\n"
      : "+r"(above), "+r"(equal)
      : "f"(a), "f"(t), "n"(1u << Bit));
}

/// Bit `Bit` of `bits` set where a >= t (a NaN sets none).
template <unsigned Bit>
__device__ __forceinline__ void or_at_least(float a, float t, unsigned& bits) {
  asm("{\n .reg .pred p;\n setp.ge.f32 p, %1, %2;\n @p or.b32 %0, %0, %3;\n}\n"
      : "+r"(bits)
      : "f"(a), "f"(t), "n"(1u << Bit));
}

/// Two 32-bit words to a shared-memory address in one store.
__device__ __forceinline__ void st_shared_v2(unsigned addr, unsigned a, unsigned b) {
  asm("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

/// Four 32-bit words from / to a shared-memory address in one access.
__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(unsigned addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

/// 2^x by the SFU alone: results below 2^-126 flush to 0 (exp2f adds a
/// compare and two multiplies around the same instruction to keep them).
__device__ __forceinline__ float exp2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

/// A bf16 pair as an fp16 pair, rounded to nearest: exact where both
/// values are 0 or in fp16's normal range (2^-14 <= |x| <= 65504).
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned w) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(__uint_as_float(w & 0xFFFF0000u)), "f"(__uint_as_float(w << 16)));
  return r;
}

/// blockIdx.x read again where it is needed, so the compiler does not keep
/// it in a register across a long stretch of code.
__device__ __forceinline__ unsigned block_index_x() {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  return x;
}

// ---- Thread-block clusters (sm_90+)

/// Whether the device code being compiled can run in a cluster: false in
/// an sm_80/sm_89 pass, where a cluster kernel can be left without a body
/// (its launcher picks the one-CTA kernel there).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
inline constexpr bool kArchHasClusters = false;
#else
inline constexpr bool kArchHasClusters = true;
#endif

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

// ---- Warpgroup tensor cores (wgmma, sm_90a): operands from shared memory
// through descriptors (A also from registers), fp32 accumulators in
// registers, asynchronous in commit groups. Built only where the compiler
// targets sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); elsewhere they trap, and the
// host launches their kernels only where the loaded build has them.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HISPARSE_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define HISPARSE_WGMMA_ASM(...) __trap()
#endif
// The accumulators: registers %0.. and their constraints.
#define HISPARSE_WGMMA_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define HISPARSE_WGMMA_R64 HISPARSE_WGMMA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define HISPARSE_WGMMA_D32 \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define HISPARSE_WGMMA_D64 \
    HISPARSE_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// m64nNk16, d = A B + (accumulate ? d : 0); operand numbers after the
// accumulators as strings. SS: A and B K-major through descriptors a, b.
#define HISPARSE_WGMMA_SS(N, TY, R, D, A, B, P)                                                      \
  HISPARSE_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, %" A ", %" B \
                     ", p, 1, 1, 0, 0;\n}\n"                                                           \
                     : D                                                                           \
                     : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
// RS: A from registers (mma.sync's m16n8k16 A layout in each warp), B
// MN-major (transposed) through descriptor b.
#define HISPARSE_WGMMA_RS(N, TY, R, D, A0, A1, A2, A3, B, P)                                         \
  HISPARSE_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, {%" A0     \
                     ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1;\n}\n"                            \
                     : D                                                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))

/// Orders the warpgroup's register and shared-memory writes before its
/// next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() { HISPARSE_WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  HISPARSE_WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/// Waits until at most N of the warpgroup's wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  HISPARSE_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Makes this thread's generic-proxy shared-memory writes (cp.async,
/// st.shared) visible to the async proxy wgmma reads through.
__device__ __forceinline__ void fence_proxy_async_shared() {
  HISPARSE_WGMMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// ---- mbarriers, named barriers and register budgets (sm_90) ----------------

/// Initialises the mbarrier at shared address `bar` for `count` arrivals a phase.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
  HISPARSE_WGMMA_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// One arrival (release: this thread's earlier writes are seen by a waiter).
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
  HISPARSE_WGMMA_ASM("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
/// Waits until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
  HISPARSE_WGMMA_ASM(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
/// The barrier `id` (1..15) of `threads` threads: wait for all of them.
__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/// The barrier `id` of `threads` threads: count this warp in, do not wait.
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/// The barrier `id` of `threads` threads: wait, and return whether any
/// of them passed true.
__device__ __forceinline__ bool named_barrier_or(unsigned id, unsigned threads, bool p) {
  unsigned r;
  asm volatile(
      "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\n"
      "bar.red.or.pred out, %2, %3, in;\nselp.u32 %0, 1, 0, out;\n}\n"
      : "=r"(r)
      : "r"(static_cast<unsigned>(p)), "r"(id), "r"(threads)
      : "memory");
  return r != 0;
}
/// The warpgroup's register budget a thread: raised (consumers) or lowered
/// (a producer), all four warps together.
template <unsigned N>
__device__ __forceinline__ void setmaxnreg_inc() {
  HISPARSE_WGMMA_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <unsigned N>
__device__ __forceinline__ void setmaxnreg_dec() {
  HISPARSE_WGMMA_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

/// Keeps the compiler from moving uses of a wgmma accumulator or operand
/// register across the asynchronous instructions.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }

/// A shared-memory matrix descriptor of the 128-byte swizzle: atoms of 8
/// rows of 128 bytes, 1024-byte aligned, 16-byte chunk c of row r at c ^
/// (r % 8). lbo, sbo: the leading and stride byte offsets of the PTX ISA's
/// canonical layouts.
__device__ __forceinline__ unsigned long long smem_desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
  return static_cast<unsigned long long>((addr & 0x3FFFFu) >> 4) |
         static_cast<unsigned long long>((lbo >> 4) & 0x3FFFu) << 16 |
         static_cast<unsigned long long>((sbo >> 4) & 0x3FFFu) << 32 | 1ull << 62;
}

/// The descriptor of the matrix `bytes` further on in shared memory: one
/// add to the 14-bit address field (address / 16 of a real shared-memory
/// matrix is below 2^14, so no carry reaches the fields above it).
__device__ __forceinline__ unsigned long long smem_desc_add(unsigned long long desc, unsigned bytes) {
  const unsigned lo = static_cast<unsigned>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

/// wgmma m64nNk16, N = 64 or 128: A (64 x 16) and B (N x 16) K-major in
/// shared memory; d = A B^T (+ d when accumulate), fp32.
template <class T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                         bool accumulate) {
  static_assert(N == 64 || N == 128);
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && kBf16) HISPARSE_WGMMA_SS(64, "bf16", HISPARSE_WGMMA_R32, HISPARSE_WGMMA_D32, "32", "33", "34");
  else if constexpr (N == 64) HISPARSE_WGMMA_SS(64, "f16", HISPARSE_WGMMA_R32, HISPARSE_WGMMA_D32, "32", "33", "34");
  else if constexpr (kBf16) HISPARSE_WGMMA_SS(128, "bf16", HISPARSE_WGMMA_R64, HISPARSE_WGMMA_D64, "64", "65", "66");
  else HISPARSE_WGMMA_SS(128, "f16", HISPARSE_WGMMA_R64, HISPARSE_WGMMA_D64, "64", "65", "66");
}

/// wgmma m64nNk16, N = 64 or 128: A (64 x 16) from registers, B (16 x N)
/// MN-major in shared memory; d = A B (+ d when accumulate), fp32.
template <class T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b,
                                         bool accumulate) {
  static_assert(N == 64 || N == 128);
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && kBf16)
    HISPARSE_WGMMA_RS(64, "bf16", HISPARSE_WGMMA_R32, HISPARSE_WGMMA_D32, "32", "33", "34", "35", "36", "37");
  else if constexpr (N == 64)
    HISPARSE_WGMMA_RS(64, "f16", HISPARSE_WGMMA_R32, HISPARSE_WGMMA_D32, "32", "33", "34", "35", "36", "37");
  else if constexpr (kBf16)
    HISPARSE_WGMMA_RS(128, "bf16", HISPARSE_WGMMA_R64, HISPARSE_WGMMA_D64, "64", "65", "66", "67", "68", "69");
  else
    HISPARSE_WGMMA_RS(128, "f16", HISPARSE_WGMMA_R64, HISPARSE_WGMMA_D64, "64", "65", "66", "67", "68", "69");
}

/// max(a, b), NaN if either is NaN (fmaxf would drop it).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

}  // namespace hisparse::ptx
