// See decode_selection_bf16.cu.
#include "hisparse/attention/decode.cuh"

HISPARSE_DECODE_ATTENTION_INSTANCE(, __nv_bfloat16, __nv_bfloat16)
