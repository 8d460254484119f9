// See decode_selection_bf16.cu.
#include "hisparse/select/prefill_selection.cuh"

HISPARSE_SELECT_PREFILL_INSTANCE(, __half)
