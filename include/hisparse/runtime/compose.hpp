#pragma once
// Composing stages (CUTLASS's protocol: each stage says what it needs, the
// composer lays the parts out and checks every stage before any work):
// workspace_layout places the stages' workspaces one after another in one
// buffer, each part aligned; can_implement_all runs every stage's check and
// returns the first failure.

#include <array>
#include <cstddef>

#include "hisparse/core/macros.hpp"
#include "hisparse/core/status.hpp"

namespace hisparse {

/// Offsets of N parts in one workspace, each `kAlign`-byte aligned (what a
/// cp.async or a vector load needs), and the total.
template <std::size_t N>
struct workspace_layout {
  static constexpr std::size_t kAlign = 256;
  std::array<std::size_t, N> offset{};
  std::size_t total = 0;

  [[nodiscard]] static constexpr std::size_t align(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  /// Part i at the sum of the aligned sizes before it.
  [[nodiscard]] static constexpr workspace_layout of(const std::array<std::size_t, N>& bytes) {
    workspace_layout l;
    for (std::size_t i = 0; i < N; ++i) {
      l.offset[i] = l.total;
      l.total += align(bytes[i]);
    }
    return l;
  }
};

/// Calls each check (a callable returning status) in order and returns the
/// first that fails, or success: a composed operator's can_implement.
template <class... Checks>
[[nodiscard]] status can_implement_all(Checks&&... checks) {
  status result = status::success;
  (void)((result = checks(), result == status::success) && ...);
  return result;
}

}  // namespace hisparse
