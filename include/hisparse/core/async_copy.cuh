#pragma once
// cp.async (sm_80+): 16-byte global -> shared copies that bypass the
// registers, in commit groups a thread waits on. Shared by the kernels that
// stage tiles through a shared-memory ring (decode attention, prefill
// selection); and an L2 prefetch, for a load that waits on something else.

namespace hisparse::ptx {

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

}  // namespace hisparse::ptx
