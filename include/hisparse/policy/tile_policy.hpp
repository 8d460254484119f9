#pragma once
// Tile policy of the attention kernels: a value, used as a non-type template
// parameter (`attention_kernel<tile_policy{64, 64, 4, 2}>`), so users
// instantiate their own tile sizes without a new type per choice.

#include <cstdint>

#include "hisparse/core/macros.hpp"

namespace hisparse {

enum class tile_error : std::uint8_t {
  none = 0,
  block_q_must_be_in_1_to_256,
  block_kv_must_be_a_positive_multiple_of_16,
  warps_must_be_in_1_to_16,
  stages_must_be_in_1_to_8,
  // The decode attention's own rules (validate_decode):
  decode_block_q_must_be_1,
  decode_warps_must_be_1_2_4_or_8,
  decode_block_kv_must_be_16_times_warps,
  // The prefill attention's (validate_prefill):
  prefill_block_q_must_be_16_times_warps,
  prefill_warps_must_be_1_2_4_or_8,
};

struct tile_policy {
  int block_q = 1;    ///< queries per CTA tile (decode: 1; the GQA group rides along)
  int block_kv = 64;  ///< keys per pipeline stage; a multiple of the 16-wide MMA fragment
  int warps = 4;      ///< warps per CTA
  int stages = 2;     ///< K/V tiles in flight (double buffering by default)

  [[nodiscard]] constexpr tile_error validate() const noexcept {
    if (block_q < 1 || block_q > 256) return tile_error::block_q_must_be_in_1_to_256;
    if (block_kv < 16 || block_kv % 16 != 0)
      return tile_error::block_kv_must_be_a_positive_multiple_of_16;
    if (warps < 1 || warps > 16) return tile_error::warps_must_be_in_1_to_16;
    if (stages < 1 || stages > 8) return tile_error::stages_must_be_in_1_to_8;
    return tile_error::none;
  }
  /// validate(), and what the decode attention kernel needs: one query per
  /// sequence (its GQA group rides along) and 16 rows of a tile per warp.
  [[nodiscard]] constexpr tile_error validate_decode() const noexcept {
    if (const tile_error e = validate(); e != tile_error::none) return e;
    if (block_q != 1) return tile_error::decode_block_q_must_be_1;
    if (warps != 1 && warps != 2 && warps != 4 && warps != 8) return tile_error::decode_warps_must_be_1_2_4_or_8;
    if (block_kv != 16 * warps) return tile_error::decode_block_kv_must_be_16_times_warps;
    return tile_error::none;
  }
  /// validate(), and what the prefill attention kernel needs: 16 query rows
  /// a warp (the MMA's A operand), whole 16-byte copies a pass.
  [[nodiscard]] constexpr tile_error validate_prefill() const noexcept {
    if (const tile_error e = validate(); e != tile_error::none) return e;
    if (warps != 1 && warps != 2 && warps != 4 && warps != 8) return tile_error::prefill_warps_must_be_1_2_4_or_8;
    if (block_q != 16 * warps) return tile_error::prefill_block_q_must_be_16_times_warps;
    return tile_error::none;
  }
  [[nodiscard]] constexpr int threads() const noexcept { return warps * 32; }

  friend constexpr bool operator==(const tile_policy&, const tile_policy&) = default;
};

namespace detail {
template <tile_error E>
struct assert_valid_tile {
  static_assert(E == tile_error::none, "invalid tile policy: see the tile_error above");
  static constexpr bool value = true;
};
}  // namespace detail

/// Compile-time check for a tile policy used as a template argument.
template <tile_policy P>
inline constexpr bool valid_tile_policy_v = detail::assert_valid_tile<P.validate()>::value;
/// The same for a decode attention tile (validate_decode).
template <tile_policy P>
inline constexpr bool valid_decode_tile_v = detail::assert_valid_tile<P.validate_decode()>::value;
/// The same for a prefill attention tile (validate_prefill).
template <tile_policy P>
inline constexpr bool valid_prefill_tile_v = detail::assert_valid_tile<P.validate_prefill()>::value;

}  // namespace hisparse
