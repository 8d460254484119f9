#pragma once
// Runtime values to compile-time constants: each names the kernels'
// instantiations once, so a stage does not repeat the switch.

#include <type_traits>

#include "hisparse/config.hpp"
#include "hisparse/core/macros.hpp"

namespace hisparse {

/// Calls f(std::integral_constant<int, D>) for D = head_dim (64, 128 or 256;
/// the caller has validated it, anything else runs 256).
template <class F>
decltype(auto) dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 256>{});
  }
}

/// Calls f(std::integral_constant<fine_summary, K>) for K = kind (validated).
template <class F>
decltype(auto) dispatch_fine_summary(fine_summary kind, F&& f) {
  switch (kind) {
    case fine_summary::mean_bf16: return f(std::integral_constant<fine_summary, fine_summary::mean_bf16>{});
    case fine_summary::key_bounds: return f(std::integral_constant<fine_summary, fine_summary::key_bounds>{});
    default: return f(std::integral_constant<fine_summary, fine_summary::mean>{});
  }
}

}  // namespace hisparse
