#pragma once
// Which complete slices of a (sequence, layer) stay on the device when part
// of the cache lives in the host tier (paged_kv_cache::offload_async). A
// step reads an offloaded slice it keeps over PCIe, exactly but ~100x
// slower per byte than from HBM, so a step costs what it misses
// (docs/PERF_NOTES.md, host offload). The policy: after each step the engine
// reports what it kept (`observe`, from decode_kept), and `plan` answers
//  * fetch: the slices the last observed step kept from the host, so a
//    slice a drifting stream starts to keep misses once;
//  * offload: while more than `device_slices` complete slices are on the
//    device, the least recently kept ones leave (never kept first, then the
//    oldest kept; ties to the lower slice), except the window's last
//    `window_slices` and any kept in the last `keep_steps` steps.
// Host only, no device work: `rebalance` hands the plans of one or many
// (slot, layer) pairs to the cache in one batch each way, whose moves are
// stream-ordered.

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hisparse/core/status.hpp"

namespace hisparse {

namespace detail {
/// The plans' shared rule: appends to `out` (empty) up to `excess` of the
/// items [0, n) that `gone(i)` does not exclude, least recently kept first,
/// in ascending order: never kept (`kept_at(i) < 0`) in index order -- so a
/// plan usually stops at the last one it takes instead of ranking them all --
/// then by (last kept step, index), none kept after step `newest`.
template <class KeptAt, class Gone>
void least_recently_kept(std::int32_t n, std::int64_t excess, std::int64_t newest, KeptAt&& kept_at, Gone&& gone,
                         std::vector<std::int32_t>& out) {
  for (std::int32_t i = 0; i < n && static_cast<std::int64_t>(out.size()) < excess; ++i)
    if (kept_at(i) < 0 && !gone(i)) out.push_back(i);
  const std::int64_t left = excess - static_cast<std::int64_t>(out.size());
  if (left <= 0) return;
  std::vector<std::pair<std::int64_t, std::int32_t>> candidates;  // (last kept step, item)
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int64_t at = kept_at(i);
    if (at >= 0 && at <= newest && !gone(i)) candidates.emplace_back(at, i);
  }
  const auto take =
      static_cast<std::ptrdiff_t>(std::min<std::int64_t>(left, static_cast<std::int64_t>(candidates.size())));
  std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end());
  for (std::ptrdiff_t k = 0; k < take; ++k) out.push_back(candidates[static_cast<std::size_t>(k)].second);
  std::sort(out.begin(), out.end());
}
}  // namespace detail

struct residency_options {
  std::int32_t device_slices = 0;  ///< complete slices of one (sequence, layer) the device holds at most
  std::int32_t window_slices = 9;  ///< the last complete slices never offloaded (the decode window's 8 and one)
  int keep_steps = 1;              ///< slices kept in this many recent steps are never offloaded
};

/// What `plan` asks the cache to move for one (sequence, layer), in slice order.
struct residency_moves {
  std::vector<std::int32_t> fetch;    ///< host -> device
  std::vector<std::int32_t> offload;  ///< device -> host
};

class residency_policy {
 public:
  explicit residency_policy(residency_options o) : opt_(o) {
    if (o.device_slices < 0 || o.window_slices < 0 || o.keep_steps < 1)
      throw error(status::invalid_argument,
                  "residency_options: device_slices and window_slices must be >= 0, keep_steps >= 1");
  }

  [[nodiscard]] const residency_options& options() const noexcept { return opt_; }

  /// Step `step` (increasing per (slot, layer)) of (slot, layer) kept
  /// `kept`: slice ids of any of its KV heads, negatives (unused entries)
  /// ignored, repeats allowed.
  [[nodiscard]] status observe(int slot, int layer, std::int64_t step, std::span<const std::int32_t> kept) {
    auto& e = entries_[{slot, layer}];
    if (step < e.step)
      return fail(status::invalid_argument, "residency_policy::observe: step " + std::to_string(step) +
                                                " is before the last one observed (" + std::to_string(e.step) + ")");
    e.step = step;
    e.last.clear();
    for (const std::int32_t s : kept) {
      if (s < 0) continue;
      if (static_cast<std::size_t>(s) >= e.kept_at.size()) e.kept_at.resize(static_cast<std::size_t>(s) + 1, -1);
      e.kept_at[static_cast<std::size_t>(s)] = step;
      e.last.push_back(s);
    }
    std::sort(e.last.begin(), e.last.end());
    e.last.erase(std::unique(e.last.begin(), e.last.end()), e.last.end());
    return status::success;
  }

  /// The moves for (slot, layer), which holds `complete` complete slices;
  /// `on_host(slice)` says where a slice lives now (the cache's residency),
  /// `host_slices` how many of them are on the host where the caller knows
  /// (else, -1, they are counted). Never-kept slices rank first, so a plan
  /// usually stops at the last one it offloads instead of ranking them all.
  template <class OnHost>
  [[nodiscard]] residency_moves plan(int slot, int layer, std::int32_t complete, OnHost&& on_host,
                                     std::int64_t host_slices = -1) const {
    residency_moves m;
    const auto it = entries_.find({slot, layer});
    const entry none{};
    const entry& e = it == entries_.end() ? none : it->second;
    for (const std::int32_t s : e.last)
      if (s < complete && on_host(s)) m.fetch.push_back(s);
    if (host_slices < 0) {
      host_slices = 0;
      for (std::int32_t s = 0; s < complete; ++s) host_slices += on_host(s) ? 1 : 0;
    }
    const std::int64_t on_device = complete - host_slices + static_cast<std::int64_t>(m.fetch.size());
    const std::int64_t excess = on_device - opt_.device_slices;
    if (excess <= 0) return m;
    detail::least_recently_kept(
        std::max(0, complete - opt_.window_slices), excess, e.step - opt_.keep_steps,
        [&](std::int32_t s) { return kept_at(e, s); }, on_host, m.offload);
    return m;
  }

  /// Forgets a freed sequence's history (every layer).
  void forget(int slot) {
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->first.first == slot ? entries_.erase(it) : std::next(it);
  }

 private:
  struct entry {
    std::int64_t step = -1;
    std::vector<std::int64_t> kept_at;  ///< per slice: the last step that kept it, -1 never
    std::vector<std::int32_t> last;     ///< what the last observed step kept, ascending
  };
  static std::int64_t kept_at(const entry& e, std::int32_t s) {
    return static_cast<std::size_t>(s) < e.kept_at.size() ? e.kept_at[static_cast<std::size_t>(s)] : -1;
  }

  residency_options opt_;
  std::map<std::pair<int, int>, entry> entries_;
};

/// Plans (slot, layer) and applies it to a paged_kv_cache: offloads first
/// (their pages return to the pool), then fetches, on `stream`.
template <class Cache, class Stream>
[[nodiscard]] status rebalance(const residency_policy& policy, Cache& cache, int slot, int layer, Stream stream,
                               residency_moves* moved = nullptr) {
  const std::pair<int, int> pair{slot, layer};
  std::vector<residency_moves> m;
  HISPARSE_TRY(rebalance(policy, cache, std::span<const std::pair<int, int>>(&pair, 1), stream,
                         moved != nullptr ? &m : nullptr));
  if (moved != nullptr) *moved = std::move(m.front());
  return status::success;
}

/// The same for many (slot, layer) pairs, each listed once: every plan,
/// then one batched offload and one batched fetch (the cache's
/// offload_async / fetch_async over slice lists), so a step's policy costs
/// a few API calls. `moved`, if given, gets each pair's moves in order. A
/// pair the cache does not hold fails the call (its status, nothing moved).
template <class Cache, class Stream>
[[nodiscard]] status rebalance(const residency_policy& policy, Cache& cache,
                               std::span<const std::pair<int, int>> pairs, Stream stream,
                               std::vector<residency_moves>* moved = nullptr) {
  using list = typename Cache::slice_list;
  std::vector<residency_moves> plans;
  plans.reserve(pairs.size());
  std::vector<list> offload, fetch;
  try {
    for (const auto& [slot, layer] : pairs) {
      const auto complete = static_cast<std::int32_t>(cache.length(slot, layer) / cache.options().fine_slice);
      // A slice retention evicted (evict_async) is off the device for good:
      // never offloaded, and not counted against the device budget.
      const auto where = cache.residency_of(slot, layer);
      plans.push_back(policy.plan(
          slot, layer, complete, [&](std::int32_t s) { return where.on_host(s) || where.evicted(s); },
          std::int64_t{where.host_slices()} + where.evicted_slices()));
    }
  } catch (const error& e) {  // a slot not in use or a layer out of range: nothing moved
    return fail(e.code(), std::string("rebalance: ") + e.what());
  }
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    if (!plans[i].offload.empty()) offload.push_back(list{pairs[i].first, pairs[i].second, plans[i].offload});
    if (!plans[i].fetch.empty()) fetch.push_back(list{pairs[i].first, pairs[i].second, plans[i].fetch});
  }
  if (!offload.empty()) HISPARSE_TRY(cache.offload_async(std::span<const list>(offload), stream));
  if (!fetch.empty()) HISPARSE_TRY(cache.fetch_async(std::span<const list>(fetch), stream));
  if (moved != nullptr) *moved = std::move(plans);
  return status::success;
}

}  // namespace hisparse
