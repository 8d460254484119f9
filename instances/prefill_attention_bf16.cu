// See decode_selection_bf16.cu.
#include "hisparse/attention/prefill.cuh"

HISPARSE_PREFILL_ATTENTION_INSTANCE(, __nv_bfloat16)
