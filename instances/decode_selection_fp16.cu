// See decode_selection_bf16.cu.
#include "hisparse/select/decode_selection.cuh"

HISPARSE_SELECT_DECODE_INSTANCE(, __half)
