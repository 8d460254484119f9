#pragma once
// Element types: a runtime enum for configs and dispatch, tag types for
// templates, and host/device conversions to and from float/double.
//
// fp16 and bf16 are CUDA's own `__half` and `__nv_bfloat16`, so the CPU
// reference reads exactly the buffers the kernels read; both headers compile
// in host-only (g++) translation units.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "hisparse/core/macros.hpp"

namespace hisparse {

enum class dtype : std::uint8_t { fp32, fp16, bf16, fp64 };

[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::fp16:
    case dtype::bf16: return 2;
    case dtype::fp32: return 4;
    case dtype::fp64: return 8;
  }
  return 0;
}

[[nodiscard]] constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::fp32: return "fp32";
    case dtype::fp16: return "fp16";
    case dtype::bf16: return "bf16";
    case dtype::fp64: return "fp64";
  }
  return "unknown";
}

/// Tag types: `fp16_t::type` is the storage type, `fp16_t::id` the enum.
struct fp32_t { using type = float; static constexpr dtype id = dtype::fp32; };
struct fp16_t { using type = __half; static constexpr dtype id = dtype::fp16; };
struct bf16_t { using type = __nv_bfloat16; static constexpr dtype id = dtype::bf16; };
struct fp64_t { using type = double; static constexpr dtype id = dtype::fp64; };

template <class T> struct dtype_of;
template <> struct dtype_of<float> : std::integral_constant<dtype, dtype::fp32> {};
template <> struct dtype_of<__half> : std::integral_constant<dtype, dtype::fp16> {};
template <> struct dtype_of<__nv_bfloat16> : std::integral_constant<dtype, dtype::bf16> {};
template <> struct dtype_of<double> : std::integral_constant<dtype, dtype::fp64> {};
template <class T> inline constexpr dtype dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

/// True for the element types HiSparse stores (and so reads in kernels).
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, __half> ||
    std::is_same_v<std::remove_cv_t<T>, __nv_bfloat16> ||
    std::is_same_v<std::remove_cv_t<T>, double>;

// Conversions. Narrowing conversions round to nearest even (the CUDA
// intrinsics' behaviour on host and device alike).
HISPARSE_HOST_DEVICE inline float to_float(float x) { return x; }
HISPARSE_HOST_DEVICE inline float to_float(double x) { return static_cast<float>(x); }
HISPARSE_HOST_DEVICE inline float to_float(__half x) { return __half2float(x); }
HISPARSE_HOST_DEVICE inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

HISPARSE_HOST_DEVICE inline double to_double(double x) { return x; }
HISPARSE_HOST_DEVICE inline double to_double(float x) { return x; }
HISPARSE_HOST_DEVICE inline double to_double(__half x) { return __half2float(x); }
HISPARSE_HOST_DEVICE inline double to_double(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
HISPARSE_HOST_DEVICE inline T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "from_float: unsupported element type");
    return static_cast<T>(x);
  }
}

/// Rounds a float to the precision of T and back (the value T would store).
template <class T>
HISPARSE_HOST_DEVICE inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

}  // namespace hisparse
