#pragma once
// FP8 (e4m3) KV pages: the quantization rule the append applies and every
// reader (the attention, the CPU reference, tests) inverts.
//
// A key or value row -- one token of one KV head, head_dim elements -- is
// stored as e4m3 codes and one fp32 scale s, a power of two chosen so the
// row's largest finite magnitude m lands in [128, 256): s = 2^(floor(log2
// m) - 7). The stored value of x is e4m3(x / s) * s. Why a power of two per
// token:
//  * x / s and code * s are exact in fp32 and in bf16, so the stored key
//    k~ = code * s is a bf16 value: summaries, bounds and the attention read
//    exactly k~, and an fp8 cache behaves bit for bit like a bf16 cache
//    holding k~ (the tests check that);
//  * a per-token scale is final when the token is written (a decode append
//    never rescales earlier tokens, as a per-slice amax would have to);
//  * e4m3's precision is relative (3 mantissa bits), so the binade [256,
//    448] left unused costs range at the bottom only, not precision.
// Non-finite inputs: NaN and +-inf are stored as NaN codes (e4m3 has no
// infinity) and do not set the scale; a row with no finite non-zero
// element has s = 1. Scales below 2^-126 are clamped there (such a row's
// smallest elements flush to zero).
//
// Page layout of an fp8 cache (paged_kv_ref.hpp): the codes [K|V][kv_head]
// [token][head_dim], then the scales [K|V][kv_head][token] as fp32.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_fp8.h>

#include "hisparse/core/macros.hpp"

namespace hisparse::kv {

using fp8_e4m3 = __nv_fp8_e4m3;

template <class T>
inline constexpr bool is_fp8_v = std::is_same_v<std::remove_cv_t<T>, fp8_e4m3>;

/// What a cache of element type T takes as input K/V: bf16 for fp8 pages
/// (the append quantizes), T otherwise.
template <class T>
using kv_input_t = std::conditional_t<is_fp8_v<T>, __nv_bfloat16, T>;

/// The scale of a row whose largest finite magnitude is m (m >= 0).
HISPARSE_HOST_DEVICE inline float fp8_row_scale(float m) {
  std::uint32_t b;
  std::memcpy(&b, &m, sizeof b);
  const int biased = static_cast<int>((b >> 23) & 0xffu);
  if (biased == 0 || biased == 0xff) return 1.0f;  // zero, subnormal only, or not finite
  const std::uint32_t s = static_cast<std::uint32_t>(biased - 7 > 1 ? biased - 7 : 1) << 23;
  float r;
  std::memcpy(&r, &s, sizeof r);
  return r;
}

/// |x| if finite, else 0: what a row's scale is chosen from.
HISPARSE_HOST_DEVICE inline float fp8_finite_magnitude(float x) {
  const float a = x < 0.0f ? -x : x;
  return a <= 3.4028234663852886e38f ? a : 0.0f;  // false for NaN and inf
}

/// The code of x in a row of scale s (NaN for a non-finite x).
HISPARSE_HOST_DEVICE inline fp8_e4m3 fp8_encode(float x, float s) {
  if (fp8_finite_magnitude(x) == 0.0f && x != 0.0f) {  // NaN or +-inf
    fp8_e4m3 nan;
    nan.__x = 0x7f;
    return nan;
  }
  return fp8_e4m3(x * (1.0f / s));  // exact division; rounds to nearest even, saturates (never: |x / s| < 256)
}

/// The stored value of a code in a row of scale s (exact in fp32 and bf16).
HISPARSE_HOST_DEVICE inline float fp8_decode(fp8_e4m3 q, float s) { return static_cast<float>(q) * s; }

}  // namespace hisparse::kv
