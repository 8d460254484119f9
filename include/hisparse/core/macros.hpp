#pragma once
// Portability macros shared by every HiSparse header. Host-only translation
// units (g++) see the CUDA qualifiers as nothing, so host code can include the
// same headers that kernels use.

#if __cplusplus < 202002L
#error "HiSparse needs C++20 (-std=c++20 for nvcc and the host compiler; CMake: link hisparse::hisparse, README says which CMake knows nvcc's C++20)"
#endif

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define HISPARSE_HOST_DEVICE __host__ __device__
#define HISPARSE_DEVICE __device__
#else
#define HISPARSE_HOST_DEVICE
#define HISPARSE_DEVICE
#endif

#define HISPARSE_VERSION_MAJOR 0
#define HISPARSE_VERSION_MINOR 1
#define HISPARSE_VERSION_PATCH 0

// Build time: every translation unit that calls a launch function such as
// select::select_decode_async<bf16> compiles all of its kernels (every
// head_dim, cluster size and row type) for every architecture. A program
// that builds several such units can compile the standard instances once:
// define HISPARSE_EXTERN_TEMPLATES for all of them (each header then
// declares its standard instances `extern template`), and in one unit
// define them with the header's HISPARSE_*_INSTANCE macro and an empty
// first argument, e.g.
//   HISPARSE_SELECT_DECODE_INSTANCE(, __nv_bfloat16)
// The standard instances: bf16 and fp16 queries / KV of
// select::select_decode_async, select::select_prefill_async and
// attention::decode_attention_async (kDecodeTile). Other instances (your
// own tile policies) compile where they are used, as without the macro.
