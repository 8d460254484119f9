// The standard instances the project's tests, benchmarks and examples link
// instead of compiling them in each of their own files
// (HISPARSE_EXTERN_TEMPLATES, include/hisparse/core/macros.hpp).
#include "hisparse/select/decode_selection.cuh"

HISPARSE_SELECT_DECODE_INSTANCE(, __nv_bfloat16)
