#pragma once
// HiSparse umbrella header: everything public. Include the narrower headers
// to keep host-only translation units light.

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/macros.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/tensor_view.hpp"
#include "hisparse/config.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/policy/tile_policy.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/workload/synthetic.hpp"
