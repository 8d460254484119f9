#pragma once
// Which far blocks of a (sequence, layer) stay on the device when the cache
// keeps only part of its KV and drops the rest (paged_kv_cache::evict_async:
// the pages go back to the pool, the block's summary rows become NaN so the
// coarse filter ranks it last). Lossy where offload is exact: an evicted
// block is never attended again. What makes it safe to use:
//  * only far blocks are evicted -- blocks that end before the block holding
//    the decode window's start -- so the window and the partial block the
//    coarse filter scores from slice sums stay whole, and appends never
//    touch an evicted block;
//  * at least top_k_coarse far blocks stay, so the coarse filter always
//    fills its top-k with resident blocks and no evicted block's slice is
//    ever a fine candidate (an evicted block's rows are NaN, ranked below
//    every number);
//  * a block whose slices a recent step kept stays (keep_steps), so a
//    step's kept set loses nothing it kept lately; evicting a block none of
//    whose slices were kept can only let a better block into the coarse
//    top-k.
// The policy: after each step the engine reports what it kept (`observe`,
// the step's kept slice lists), and `plan` answers the far blocks to evict
// while more than `device_blocks` are resident: never kept first (lowest
// block first), then the least recently kept. Host only, no device work:
// `retain` hands the plans of many (slot, layer) pairs to the cache in one
// batch.

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/contract.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/runtime/residency.hpp"

namespace hisparse {

struct retention_options {
  /// Far blocks of one (sequence, layer) the device keeps at most; at least
  /// the config's top_k_coarse.
  std::int32_t device_blocks = 0;
  int keep_steps = 1;  ///< blocks with a slice kept in this many recent steps are never evicted
};

/// The far blocks of a (sequence, layer) of `length` tokens under `cfg`:
/// [0, far_blocks) end before the block holding the decode window's start
/// (the query at length - 1), so they may be evicted. Grows with length.
[[nodiscard]] constexpr std::int32_t evictable_blocks(const SparseAttentionConfig& cfg, std::int64_t length) {
  if (length < 1) return 0;
  const std::int64_t ws = contract::window_begin(length - 1, cfg.window, cfg.fine_slice);
  return static_cast<std::int32_t>(ws / cfg.coarse_block);
}

class retention_policy {
 public:
  retention_policy(const SparseAttentionConfig& cfg, retention_options o) : cfg_(cfg), opt_(o) {
    require_valid(cfg);
    if (o.device_blocks < cfg.top_k_coarse || o.keep_steps < 1)
      throw error(status::invalid_argument,
                  "retention_options: device_blocks must be >= the config's top_k_coarse (" +
                      std::to_string(cfg.top_k_coarse) + "; got " + std::to_string(o.device_blocks) +
                      ") and keep_steps >= 1");
  }

  [[nodiscard]] const SparseAttentionConfig& config() const noexcept { return cfg_; }
  [[nodiscard]] const retention_options& options() const noexcept { return opt_; }

  /// Step `step` (increasing per (slot, layer)) of (slot, layer) kept the
  /// slices `kept` (of any KV head; negatives ignored, repeats allowed).
  [[nodiscard]] status observe(int slot, int layer, std::int64_t step, std::span<const std::int32_t> kept) {
    auto& e = entries_[{slot, layer}];
    if (step < e.step)
      return fail(status::invalid_argument, "retention_policy::observe: step " + std::to_string(step) +
                                                " is before the last one observed (" + std::to_string(e.step) + ")");
    e.step = step;
    const std::int32_t spb = cfg_.slices_per_block();
    for (const std::int32_t s : kept) {
      if (s < 0) continue;
      const auto b = static_cast<std::size_t>(s / spb);
      if (b >= e.kept_at.size()) e.kept_at.resize(b + 1, -1);
      e.kept_at[b] = step;
    }
    return status::success;
  }

  /// The far blocks of (slot, layer), `length` tokens, to evict (ascending):
  /// `evicted(b)` says whether block b is gone already, `evicted_blocks`
  /// how many are (all of them far).
  template <class Evicted>
  [[nodiscard]] std::vector<std::int32_t> plan(int slot, int layer, std::int64_t length, Evicted&& evicted,
                                               std::int32_t evicted_blocks) const {
    std::vector<std::int32_t> out;
    const std::int32_t far = evictable_blocks(cfg_, length);
    const std::int64_t excess = std::int64_t{far} - evicted_blocks - opt_.device_blocks;
    if (excess <= 0) return out;
    const auto it = entries_.find({slot, layer});
    const entry none{};
    const entry& e = it == entries_.end() ? none : it->second;
    detail::least_recently_kept(
        far, excess, e.step - opt_.keep_steps, [&](std::int32_t b) { return kept_at(e, b); }, evicted, out);
    return out;
  }

  /// Forgets a freed sequence's history (every layer).
  void forget(int slot) {
    for (auto it = entries_.begin(); it != entries_.end();)
      it = it->first.first == slot ? entries_.erase(it) : std::next(it);
  }

 private:
  struct entry {
    std::int64_t step = -1;
    std::vector<std::int64_t> kept_at;  ///< per block: the last step that kept one of its slices, -1 never
  };
  static std::int64_t kept_at(const entry& e, std::int32_t b) {
    return static_cast<std::size_t>(b) < e.kept_at.size() ? e.kept_at[static_cast<std::size_t>(b)] : -1;
  }

  SparseAttentionConfig cfg_;
  retention_options opt_;
  std::map<std::pair<int, int>, entry> entries_;
};

/// Plans every (slot, layer) pair (each listed once) and evicts the blocks
/// in one batch (paged_kv_cache::evict_async, stream-ordered). `evicted`, if
/// given, gets each pair's blocks in order. A pair the cache does not hold
/// fails the call (its status, nothing evicted).
template <class Cache, class Stream>
[[nodiscard]] status retain(const retention_policy& policy, Cache& cache, std::span<const std::pair<int, int>> pairs,
                            Stream stream, std::vector<std::vector<std::int32_t>>* evicted = nullptr) {
  using list = typename Cache::block_list;
  std::vector<std::vector<std::int32_t>> plans;
  plans.reserve(pairs.size());
  std::vector<list> lists;
  const std::int32_t spb = policy.config().slices_per_block();
  try {
    for (const auto& [slot, layer] : pairs) {
      const auto where = cache.residency_of(slot, layer);
      plans.push_back(policy.plan(
          slot, layer, cache.length(slot, layer), [&](std::int32_t b) { return where.evicted(b * spb); },
          where.evicted_slices() / spb));
    }
  } catch (const error& e) {  // a slot not in use or a layer out of range: nothing evicted
    return fail(e.code(), std::string("retain: ") + e.what());
  }
  for (std::size_t i = 0; i < pairs.size(); ++i)
    if (!plans[i].empty()) lists.push_back(list{pairs[i].first, pairs[i].second, plans[i]});
  if (!lists.empty()) HISPARSE_TRY(cache.evict_async(std::span<const list>(lists), policy.config(), stream));
  if (evicted != nullptr) *evicted = std::move(plans);
  return status::success;
}

}  // namespace hisparse
