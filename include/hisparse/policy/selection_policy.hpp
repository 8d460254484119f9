#pragma once
// Compile-time selection policy. The non-type parameter is the very
// `SparseAttentionConfig` a serving engine builds at run time, so a dispatcher
// matches a runtime config to an instantiation with `==`, and an invalid
// policy fails to compile through the same `validate()` the runtime uses:
// the diagnostic names the broken rule as a `config_error` enumerator.

#include <type_traits>

#include "hisparse/config.hpp"

namespace hisparse {

namespace detail {
template <config_error E>
struct assert_valid_config {
  // On failure the compiler prints this instantiation, whose argument is the
  // enumerator naming the rule, e.g. fine_slice_must_divide_coarse_block.
  static_assert(E == config_error::none, "invalid selection policy: see the config_error above");
  static constexpr bool value = true;
};

template <dtype D> struct score_storage;
template <> struct score_storage<dtype::fp32> { using type = float; };
template <> struct score_storage<dtype::fp64> { using type = double; };
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
  /// Upper bound of tokens one query attends: kept slices plus the widest
  /// window (W + F - 1 tokens up to the tile start, plus the tile itself).
  static constexpr int kMaxAttended =
      Cfg.top_k_fine * Cfg.fine_slice + Cfg.window + Cfg.fine_slice - 1 + Cfg.query_tile - 1;
  using score_type = typename detail::score_storage<Cfg.score_type>::type;
};

template <class T> struct is_selection_policy : std::false_type {};
template <SparseAttentionConfig Cfg>
struct is_selection_policy<selection_policy<Cfg>> : std::true_type {};

/// The default policy: DESIGN.md section 1's numbers.
using default_selection_policy = selection_policy<>;

}  // namespace hisparse
