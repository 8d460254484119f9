#pragma once
// Element types: a runtime enum for configs and dispatch, tag types for
// templates, and host/device conversions to and from float/double.
//
// fp16 and bf16 are CUDA's own `__half` and `__nv_bfloat16`, so the CPU
// reference reads exactly the buffers the kernels read; both headers compile
// in host-only (g++) translation units.

#include <cstddef>
#include <cstdint>
#include <cstring>
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

/// Slice key bounds (the `slice_score::key_bounds` policy): one dimension's
/// key range over a slice in one 32-bit word, the minimum's bf16 bits in the
/// low half and the maximum's in the high half. Both are rounded outward (the
/// minimum toward -inf, the maximum toward +inf), so the pair always brackets
/// the keys; for bf16 keys it is exact. A NaN key makes both halves NaN.
/// Host and device compute it with the same integer arithmetic.
HISPARSE_HOST_DEVICE inline std::uint32_t float_bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
HISPARSE_HOST_DEVICE inline float bits_float(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
/// bf16 bits of x rounded toward +inf (`up`) or -inf; NaN gives 0x7fc0.
HISPARSE_HOST_DEVICE inline std::uint32_t bf16_bits_directed(float x, bool up) {
  const std::uint32_t b = float_bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  const std::uint32_t t = b >> 16;
  const bool negative = (b >> 31) != 0;
  // Exact, or toward zero unless away from it is the direction asked.
  const std::uint32_t r = (b & 0xffffu) == 0 || up == negative ? t : t + 1;
  // A zero bound is -0 below and +0 above, whichever zero the keys held or a
  // tiny value rounded to, so the word does not depend on the order a min or
  // max met them, and rounding a bound again leaves it as it is.
  if ((r & 0x7fffu) == 0) return up ? 0x0000u : 0x8000u;
  return r;
}
HISPARSE_HOST_DEVICE inline std::uint32_t key_bounds_word(float lo, float hi) {
  if (lo != lo || hi != hi) return 0x7fc07fc0u;
  return bf16_bits_directed(hi, true) << 16 | bf16_bits_directed(lo, false);
}
HISPARSE_HOST_DEVICE inline float key_bounds_lo(std::uint32_t w) { return bits_float(w << 16); }
HISPARSE_HOST_DEVICE inline float key_bounds_hi(std::uint32_t w) { return bits_float(w & 0xffff0000u); }
/// Min and max that keep a NaN once seen (fminf and fmaxf drop it): a NaN
/// key must mark its dimension's bounds, not vanish.
HISPARSE_HOST_DEVICE inline float nan_min(float m, float x) { return x < m || x != x ? x : m; }
HISPARSE_HOST_DEVICE inline float nan_max(float m, float x) { return x > m || x != x ? x : m; }
/// The union of two key_bounds_word ranges (NaN once either is NaN): exact,
/// as rounding a bound again leaves it as it is.
HISPARSE_HOST_DEVICE inline std::uint32_t widened_bounds(std::uint32_t a, std::uint32_t b) {
  return key_bounds_word(nan_min(key_bounds_lo(a), key_bounds_lo(b)), nan_max(key_bounds_hi(a), key_bounds_hi(b)));
}

}  // namespace hisparse
