#pragma once
// Portability macros shared by every HiSparse header. Host-only translation
// units (g++) see the CUDA qualifiers as nothing, so host code can include the
// same headers that kernels use.

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
