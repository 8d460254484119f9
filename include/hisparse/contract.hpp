#pragma once
// The arithmetic of DESIGN.md section 1, once: the window of a query tile,
// the far region's slices and blocks, the fine stage's candidates and what a
// query attends at most. The kernels (int32 positions) and the fp64 CPU
// reference (int64) call the same functions, so they cannot disagree on
// where a window starts.

#include <cstdint>

#include "hisparse/config.hpp"
#include "hisparse/core/macros.hpp"

namespace hisparse::contract {

/// The start of the M-aligned query tile holding position p.
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I tile_begin(I p, int query_tile) {
  return p / query_tile * query_tile;
}

/// Step 1: the first slice of the window of the tile that starts at p0: the
/// slice boundary at or below p0 - W + 1, never below 0. (Decode: p0 is the
/// query's position, length - 1.)
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I window_first_slice(I p0, int window, int fine_slice) {
  const I x = p0 - window + 1;
  return x <= 0 ? I{0} : x / fine_slice;
}

/// Step 1: ws, the window's first token; the far region is [0, ws).
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I window_begin(I p0, int window, int fine_slice) {
  const I x = p0 - window + 1;
  return x <= 0 ? I{0} : x / fine_slice * fine_slice;
}

/// Step 2: the complete slices of the far region [0, ws).
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I far_slices(I ws, int fine_slice) {
  return ws / fine_slice;
}

/// Step 4: the candidate blocks, those with b C < ws (the last may reach past
/// ws: its summary covers only its far slices).
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I candidate_blocks(I ws, int coarse_block) {
  return (ws + coarse_block - 1) / coarse_block;
}

/// Step 5: the candidates of the fine stage, given the kept blocks in
/// ascending order (`kept` of them, the last `last_kept`): every slice of
/// every kept block, less the last block's slices at or past ws (only it
/// can reach past ws, so they are the tail of the list).
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I fine_candidates(I kept, I last_kept, int slices_per_block,
                                                              I far) {
  if (kept == 0) return 0;
  const I past = (last_kept + 1) * slices_per_block - far;
  return kept * slices_per_block - (past > 0 ? past : I{0});
}

/// The whole far blocks of a decode sequence of `length` tokens: blocks
/// [0, n) end at or before the block holding the window's start ws (of the
/// query at length - 1), so no later decode step's window, partial block
/// or append reaches them. What retention may drop.
template <class I>
[[nodiscard]] HISPARSE_HOST_DEVICE constexpr I evictable_blocks(I length, int window, int fine_slice,
                                                               int coarse_block) {
  return length < 1 ? I{0} : window_begin(length - 1, window, fine_slice) / coarse_block;
}

/// The most slices one (decode query, KV head) attends: the kept slices and
/// the window, which holds W to W + F - 1 tokens and starts on a slice
/// boundary.
[[nodiscard]] constexpr std::int32_t max_attended_slices(const SparseAttentionConfig& c) {
  return c.top_k_fine + (c.window + c.fine_slice - 1 + c.fine_slice - 1) / c.fine_slice;
}

/// The most tokens one query of a tile of `query_tile` attends: the kept
/// slices and the widest window (W + F - 1 tokens up to the tile start, and
/// the tile itself).
[[nodiscard]] constexpr std::int64_t max_attended_tokens(const SparseAttentionConfig& c, int query_tile) {
  return std::int64_t{c.top_k_fine} * c.fine_slice + c.window + c.fine_slice - 1 + query_tile - 1;
}

}  // namespace hisparse::contract
