// Must NOT compile: test/CMakeLists.txt checks that the diagnostic names the
// rule that the policy below breaks.
#include "hisparse/policy/selection_policy.hpp"

#if defined(HISPARSE_EXPECT_fine_slice_must_divide_coarse_block)
using broken = hisparse::selection_policy<hisparse::SparseAttentionConfig{512, 1024, 96}>;
#elif defined(HISPARSE_EXPECT_score_type_must_be_fp32_or_wider)
using broken = hisparse::selection_policy<
    hisparse::SparseAttentionConfig{512, 1024, 64, 32, 16, 64, hisparse::dtype::bf16}>;
#endif

int main() { return broken::kWindow; }
