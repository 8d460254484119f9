#pragma once
// Programmatic dependent launch (sm_90+), both halves: the primary grid
// (the decode selection) says when its dependent may start, and the
// dependent (the decode attention) waits for the primary before reading
// what it writes. No-ops on older architectures, which are never launched
// that way, and in a launch that was not programmatic.

namespace hisparse::ptx {

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

}  // namespace hisparse::ptx
