#pragma once
// Order-preserving 64-bit keys for top-k: one comparison of two keys ranks
// two (score, index) pairs exactly as DESIGN.md section 1 does -- higher
// score first, ties to the lower index, NaN below every number (-inf
// included), -0 equal to +0 -- so selection is a search for the k largest
// distinct integers, deterministic by construction.
//
//   key = (ordered(score) << 32) | (0xFFFFFFFF - index)
//
// ordered() maps floats to uint32 monotonically with NaN -> 0; every real
// candidate then has a non-zero key (its low word is at least 2^31 for any
// index below 2^31), so 0 is free to mean "no candidate" (padding).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hisparse/core/macros.hpp"

namespace hisparse::select {

using topk_key = std::uint64_t;
inline constexpr topk_key kNoCandidate = 0;

HISPARSE_HOST_DEVICE inline std::uint32_t ordered_bits(float score) {
#if defined(__CUDA_ARCH__)
  // Five SASS instructions: -0 + +0 is +0 (add.rn without .ftz keeps subnormals
  // whatever the build's flush mode), the sign spread by a shift flips
  // negatives whole and sets the top bit of the rest, and NaN ranks last.
  float canonical;
  asm("add.rn.f32 %0, %1, 0f00000000;" : "=f"(canonical) : "f"(score));
  const std::uint32_t u = __float_as_uint(canonical);
  const std::uint32_t o = u ^ (static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31) | 0x80000000u);
  return isnan(score) ? 0u : o;
#else
  std::uint32_t u;
  std::memcpy(&u, &score, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0;  // NaN ranks last
  if ((u & 0x7FFFFFFFu) == 0) u = 0;              // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
#endif
}

/// ordered_bits' inverse on numbers (not NaN; -0 comes back as +0).
HISPARSE_HOST_DEVICE inline float from_ordered_bits(std::uint32_t o) {
  const std::uint32_t u = (o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o;
  float score;
  std::memcpy(&score, &u, sizeof score);
  return score;
}

/// The key of a score already turned into its ordered word.
HISPARSE_HOST_DEVICE inline topk_key key_of_word(std::uint32_t ordered, std::int32_t index) {
  return (static_cast<topk_key>(ordered) << 32) | static_cast<topk_key>(0xFFFFFFFFu - static_cast<std::uint32_t>(index));
}

HISPARSE_HOST_DEVICE inline topk_key make_key(float score, std::int32_t index) {
  return key_of_word(ordered_bits(score), index);
}

HISPARSE_HOST_DEVICE inline std::int32_t key_index(topk_key key) {
  return key == kNoCandidate ? -1
                             : static_cast<std::int32_t>(0xFFFFFFFFu - static_cast<std::uint32_t>(key));
}

}  // namespace hisparse::select
