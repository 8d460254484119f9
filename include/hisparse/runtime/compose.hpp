#pragma once
// Composing stages (CUTLASS's protocol: each stage says what it needs, the
// composer lays the parts out and checks every stage before any work):
// workspace_layout places the stages' workspaces one after another in one
// buffer, each part aligned; can_implement_all runs every stage's check and
// returns the first failure; check_rebind_shape keeps a rebind to the
// planned shape.

#include <array>
#include <cstddef>
#include <string>

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

/// A planned operator's rebind: `a` must keep the shape `planned` had (the
/// workspace's parts and the counters the plan zeroed are laid out for it).
/// `who` names the operator in the message.
template <class Arguments>
[[nodiscard]] status check_rebind_shape(const Arguments& planned, const Arguments& a, const char* who) {
  if (a.num_q_heads == planned.num_q_heads && a.cache.kv_heads == planned.cache.kv_heads &&
      a.cache.head_dim == planned.cache.head_dim)
    return status::success;
  return fail(status::invalid_argument,
              std::string(who) + ": rebind to " + std::to_string(a.num_q_heads) + " query heads, " +
                  std::to_string(a.cache.kv_heads) + " KV heads, head_dim " + std::to_string(a.cache.head_dim) +
                  "; the plan was made for " + std::to_string(planned.num_q_heads) + ", " +
                  std::to_string(planned.cache.kv_heads) + ", " + std::to_string(planned.cache.head_dim) +
                  " (plan again)");
}

}  // namespace hisparse
