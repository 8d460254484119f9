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
#include "hisparse/mr/resource.hpp"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/mr/new_delete_resource.hpp"
#include "hisparse/mr/statistics_adaptor.hpp"
#include "hisparse/mr/limiting_adaptor.hpp"
#include "hisparse/kv/page_pool.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/kv/paged_kv_ref.hpp"
