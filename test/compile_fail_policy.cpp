// Must NOT compile: test/CMakeLists.txt checks that the diagnostic names the
// rule that the policy below breaks.
#include "hisparse/policy/selection_policy.hpp"

#if defined(HISPARSE_EXPECT_fine_slice_must_divide_coarse_block)
using broken = hisparse::selection_policy<hisparse::SparseAttentionConfig{512, 1024, 96}>;
#elif defined(HISPARSE_EXPECT_fine_candidates_must_not_exceed_kMaxCandidates)
// 4096-token blocks of 16-token slices: 32 x 256 fine candidates.
using broken = hisparse::selection_policy<hisparse::SparseAttentionConfig{512, 4096, 16}>;
#elif defined(HISPARSE_EXPECT_query_tile_must_be_in_1_to_kMaxQueryTile)
using broken = hisparse::selection_policy<hisparse::SparseAttentionConfig{512, 1024, 64, 32, 16, 128}>;
#elif defined(HISPARSE_EXPECT_decode_block_kv_must_be_16_times_warps)
#include "hisparse/runtime/hierarchical_attention.cuh"
// The class alone, never run: the tile's rule still stops it.
using broken_tile = hisparse::hierarchical_attention<hisparse::default_selection_policy,
                                                     hisparse::tile_policy{1, 32, 4, 3}>;
struct broken {
  static constexpr int kWindow = sizeof(broken_tile);
};
#endif

int main() { return broken::kWindow; }
