// See decode_selection_bf16.cu. bf16 queries over FP8 (e4m3) pages.
#include "hisparse/attention/decode.cuh"

HISPARSE_DECODE_ATTENTION_INSTANCE(, __nv_bfloat16, ::hisparse::kv::fp8_e4m3)
