#pragma once
// Compile-time selection policy. The non-type parameter is the very
// `SparseAttentionConfig` a serving engine builds at run time, so a dispatcher
// matches a runtime config to an instantiation with `==`, and an invalid
// policy fails to compile through the same `validate()` the runtime uses:
// the diagnostic names the broken rule as a `config_error` enumerator.

#include <cstddef>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"

namespace hisparse {

namespace detail {
template <config_error E>
struct assert_valid_config {
  // On failure the compiler prints this instantiation, whose argument is the
  // enumerator naming the rule, e.g. fine_slice_must_divide_coarse_block.
  static_assert(E == config_error::none, "invalid selection policy: see the config_error above");
  static constexpr bool value = true;
};
}  // namespace detail

template <SparseAttentionConfig Cfg = SparseAttentionConfig{}>
struct selection_policy {
  static_assert(detail::assert_valid_config<Cfg.validate()>::value);

  static constexpr SparseAttentionConfig config = Cfg;
  static constexpr int kWindow = Cfg.window;
  static constexpr int kCoarseBlock = Cfg.coarse_block;
  static constexpr int kFineSlice = Cfg.fine_slice;
  static constexpr int kSlicesPerBlock = Cfg.coarse_block / Cfg.fine_slice;
  static constexpr int kTopKCoarse = Cfg.top_k_coarse;
  static constexpr int kTopKFine = Cfg.top_k_fine;
  static constexpr int kQueryTile = Cfg.query_tile;
  static constexpr fine_summary kFineSummary = Cfg.fine_summary;
  /// Upper bound of tokens one query of a tile attends (contract.hpp).
  static constexpr std::int64_t kMaxAttended = contract::max_attended_tokens(Cfg, Cfg.query_tile);
};

template <class T> struct is_selection_policy : std::false_type {};
template <SparseAttentionConfig Cfg>
struct is_selection_policy<selection_policy<Cfg>> : std::true_type {};

/// The numbers a decode selection kernel is built for: the kept widths and
/// the slice and block sizes as compile-time constants, 0 where the kernel
/// reads the config's at run time (dynamic_selection_shape, every runtime
/// config's kernel), and the summaries it scores (-1: any, chosen at run
/// time). A fixed shape lets the compiler fold the candidate arithmetic
/// (c / spb, the window start) and the rankings' k, and builds the kernels
/// of one kind of summaries, not of all of them.
template <int TopKCoarse = 0, int TopKFine = 0, int FineSlice = 0, int CoarseBlock = 0, int FineSummary = -1,
          int CoarseSummary = -1>
struct selection_shape {
  static constexpr int kTopKCoarse = TopKCoarse, kTopKFine = TopKFine, kFineSlice = FineSlice,
                       kCoarseBlock = CoarseBlock, kFineSummary = FineSummary, kCoarseSummary = CoarseSummary;
  static constexpr bool kDynamic = TopKCoarse == 0 && TopKFine == 0 && FineSlice == 0 && CoarseBlock == 0 &&
                                   FineSummary < 0 && CoarseSummary < 0;
  /// Whether a config runs on this shape's kernel.
  static constexpr bool matches(const SparseAttentionConfig& c) {
    return (TopKCoarse == 0 || c.top_k_coarse == TopKCoarse) && (TopKFine == 0 || c.top_k_fine == TopKFine) &&
           (FineSlice == 0 || c.fine_slice == FineSlice) && (CoarseBlock == 0 || c.coarse_block == CoarseBlock) &&
           (FineSummary < 0 || static_cast<int>(c.fine_summary) == FineSummary) &&
           (CoarseSummary < 0 || static_cast<int>(c.coarse_summary) == CoarseSummary);
  }
};
using dynamic_selection_shape = selection_shape<>;
/// The shape a selection_policy fixes (hierarchical_attention builds its
/// selection kernel for it).
template <class Policy>
using policy_shape =
    selection_shape<Policy::kTopKCoarse, Policy::kTopKFine, Policy::kFineSlice, Policy::kCoarseBlock,
                    static_cast<int>(Policy::config.fine_summary), static_cast<int>(Policy::config.coarse_summary)>;

/// The default policy: DESIGN.md section 1's numbers.
using default_selection_policy = selection_policy<>;

/// Calls f(selection_policy<P.config>{}) for the built-in preset P whose id
/// is `id`: a runtime preset id to the compile-time policy, over the list
/// kBuiltinPresets (f returns status for every policy). An id that names no
/// built-in preset is invalid_argument.
template <class F>
[[nodiscard]] status dispatch(preset_id id, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    status result = status::success;
    const bool found =
        ((kBuiltinPresets[I].id == id ? (result = f(selection_policy<kBuiltinPresets[I].config>{}), true) : false) ||
         ...);
    return found ? result : fail(status::invalid_argument, "dispatch: preset id " + std::to_string(static_cast<int>(id)) +
                                                              " is not a built-in preset");
  }(std::make_index_sequence<std::size(kBuiltinPresets)>{});
}

}  // namespace hisparse
