// See decode_selection_bf16.cu.
#include "hisparse/attention/decode.cuh"

HISPARSE_DECODE_ATTENTION_INSTANCE(, __half, __half)
