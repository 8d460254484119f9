// The retention policy on the host: its plans against the rule checked
// directly (far blocks only, the budget, recently kept blocks, never kept
// first then least recently kept), and a drifting stream driven through
// `retain` on a stand-in cache that enforces evict_async's rules: no plan
// asks for a block the cache would refuse, the resident far blocks never
// exceed the budget once it can be met, and no block a recent step kept is
// dropped.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "hisparse/runtime/retention.hpp"
#include "workload/synthetic.hpp"

using namespace hisparse;

namespace {

/// The part of paged_kv_cache that `retain` uses, with evict_async's checks.
struct fake_cache {
  struct block_list {
    int slot = 0;
    int layer = 0;
    std::span<const std::int32_t> blocks;
  };
  struct view {
    const std::vector<bool>* gone;  // per slice
    int spb;
    bool evicted(std::int32_t s) const {
      return static_cast<std::size_t>(s) < gone->size() && (*gone)[static_cast<std::size_t>(s)];
    }
    std::int32_t evicted_slices() const { return static_cast<std::int32_t>(std::count(gone->begin(), gone->end(), true)); }
  };
  SparseAttentionConfig cfg;
  std::map<std::pair<int, int>, std::int64_t> lengths;
  std::map<std::pair<int, int>, std::vector<bool>> gone;  // per (slot, layer): per slice
  int calls = 0;

  std::int64_t length(int slot, int layer) const { return lengths.at({slot, layer}); }
  view residency_of(int slot, int layer) const {
    const auto it = gone.find({slot, layer});
    if (it == gone.end()) throw error(status::invalid_argument, "no such (slot, layer)");  // as paged_kv_cache does
    return {&it->second, cfg.slices_per_block()};
  }
  status evict_async(std::span<const block_list> lists, const SparseAttentionConfig& c, int) {
    ++calls;
    REQUIRE(c == cfg);
    std::set<std::pair<int, int>> seen;
    const int spb = cfg.slices_per_block();
    for (const auto& l : lists) {
      REQUIRE(seen.insert({l.slot, l.layer}).second);  // each pair once a batch
      const std::int32_t far = evictable_blocks(cfg, length(l.slot, l.layer));
      auto& g = gone.at({l.slot, l.layer});
      for (const std::int32_t b : l.blocks) {
        REQUIRE(b >= 0);
        REQUIRE(b < far);                                        // far blocks only
        REQUIRE_FALSE(g[static_cast<std::size_t>(b) * spb]);     // plans drop only what is resident
        for (int j = 0; j < spb; ++j) g[static_cast<std::size_t>(b) * spb + j] = true;
      }
      REQUIRE(far - residency_of(l.slot, l.layer).evicted_slices() / spb >= cfg.top_k_coarse);
    }
    return status::success;
  }
};

}  // namespace

TEST_CASE("evictable blocks end before the block holding the decode window's start", "[retention]") {
  const SparseAttentionConfig c{};  // W 512, F 64, C 1024
  CHECK(evictable_blocks(c, 0) == 0);
  CHECK(evictable_blocks(c, 1024) == 0);
  // ws = 1536 at length 2048 (query 2047): block 1 holds ws, block 0 is far.
  CHECK(evictable_blocks(c, 2048) == 1);
  CHECK(evictable_blocks(c, 2560) == 2);  // ws = 2048 starts block 2
  CHECK(evictable_blocks(c, 2559) == 1);
  CHECK(evictable_blocks(c, 262144) == 255);
  CHECK(contract::evictable_blocks<std::int64_t>(262144, 512, 64, 1024) == 255);
}

TEST_CASE("retention plans keep the budget and recent blocks, and drop never-kept blocks first, then the oldest",
          "[retention]") {
  workload::splitmix64 rng(23);
  const SparseAttentionConfig cfg{};
  const int spb = cfg.slices_per_block();
  for (int trial = 0; trial < 200; ++trial) {
    INFO("trial " << trial);
    const std::int64_t length = 40 * 1024 + static_cast<std::int64_t>(rng.next() % (60 * 1024));
    const std::int32_t far = evictable_blocks(cfg, length);
    retention_options o;
    o.device_blocks = cfg.top_k_coarse + static_cast<std::int32_t>(rng.next() % 16);
    o.keep_steps = 1 + static_cast<int>(rng.next() % 3);
    retention_policy policy(cfg, o);
    std::vector<std::int64_t> kept_at(static_cast<std::size_t>(far), -1);
    const int steps = 1 + static_cast<int>(rng.next() % 6);
    for (int st = 0; st < steps; ++st) {
      std::vector<std::int32_t> kept;
      for (int i = 0; i < 48; ++i) {
        const auto slice = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(far * spb));
        kept.push_back(slice);
        kept_at[static_cast<std::size_t>(slice / spb)] = st;
      }
      kept.push_back(-1);  // unused entries are ignored
      REQUIRE(policy.observe(0, 0, st, kept) == status::success);
    }
    std::vector<bool> evicted(static_cast<std::size_t>(far), false);
    std::int32_t already = 0;
    for (std::int32_t b = 0; b < far; ++b)
      if (rng.next() % 8 == 0 && far - already > o.device_blocks + 4) evicted[static_cast<std::size_t>(b)] = true, ++already;
    const auto out = policy.plan(0, 0, length, [&](std::int32_t b) { return evicted[static_cast<std::size_t>(b)]; },
                                 already);
    REQUIRE(std::is_sorted(out.begin(), out.end()));
    REQUIRE(std::adjacent_find(out.begin(), out.end()) == out.end());
    // Kept by one of the last keep_steps steps: never evicted.
    auto recent = [&](std::int32_t b) {
      const std::int64_t at = kept_at[static_cast<std::size_t>(b)];
      return at >= 0 && at > steps - 1 - o.keep_steps;
    };
    std::int64_t protected_blocks = 0;
    for (std::int32_t b = 0; b < far; ++b) protected_blocks += !evicted[static_cast<std::size_t>(b)] && recent(b);
    for (const std::int32_t b : out) {
      REQUIRE(b >= 0);
      REQUIRE(b < far);
      REQUIRE_FALSE(evicted[static_cast<std::size_t>(b)]);
      REQUIRE_FALSE(recent(b));
    }
    const std::int64_t resident = far - already;
    const std::int64_t want = std::max<std::int64_t>(0, resident - o.device_blocks);
    // As many as the budget asks, unless only recently kept blocks are left.
    CHECK(static_cast<std::int64_t>(out.size()) == std::min(want, resident - protected_blocks));
    // Never kept before kept; among kept, older before newer.
    const std::set<std::int32_t> dropped(out.begin(), out.end());
    for (std::int32_t b = 0; b < far; ++b) {
      if (evicted[static_cast<std::size_t>(b)] || dropped.count(b)) continue;
      if (recent(b)) continue;
      const std::int64_t kb = kept_at[static_cast<std::size_t>(b)];
      for (const std::int32_t d : out) CHECK(kept_at[static_cast<std::size_t>(d)] <= kb);
    }
  }
}

TEST_CASE("a drifting stream through retain: far blocks only, the budget holds, recent blocks stay", "[retention]") {
  fake_cache cache;
  const SparseAttentionConfig cfg = cache.cfg;
  const int spb = cfg.slices_per_block();
  retention_options o;
  o.device_blocks = 40;
  o.keep_steps = 2;
  retention_policy policy(cfg, o);
  std::vector<std::pair<int, int>> pairs;
  for (int slot = 0; slot < 3; ++slot)
    for (int layer = 0; layer < 2; ++layer) {
      pairs.emplace_back(slot, layer);
      cache.lengths[{slot, layer}] = 100 * 1024 + 37 * slot;
      cache.gone[{slot, layer}].assign(static_cast<std::size_t>(cache.lengths[{slot, layer}] / 64 + 64), false);
    }
  workload::splitmix64 rng(5);
  std::map<std::pair<int, int>, std::vector<std::vector<std::int32_t>>> history;
  for (int st = 0; st < 40; ++st) {
    for (const auto& pair : pairs) {
      // The stream keeps slices around a centre that drifts one block a step,
      // and grows by one token a step.
      const std::int64_t len = ++cache.lengths[pair];
      const std::int32_t far = evictable_blocks(cfg, len);
      const auto& gone = cache.gone.at(pair);
      std::vector<std::int32_t> kept;
      for (int i = 0; i < 16; ++i) {
        const auto b = static_cast<std::int32_t>((st + static_cast<std::int32_t>(rng.next() % 8)) % far);
        const std::int32_t s = b * spb + static_cast<std::int32_t>(rng.next() % spb);
        if (!gone[static_cast<std::size_t>(s)]) kept.push_back(s);  // a step keeps resident slices only
      }
      REQUIRE(policy.observe(pair.first, pair.second, st, kept) == status::success);
      history[pair].push_back(kept);
    }
    std::vector<std::vector<std::int32_t>> dropped;
    REQUIRE(retain(policy, cache, pairs, 0, &dropped) == status::success);
    REQUIRE(dropped.size() == pairs.size());
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto& pair = pairs[i];
      const std::int32_t far = evictable_blocks(cfg, cache.lengths[pair]);
      CHECK(far - cache.residency_of(pair.first, pair.second).evicted_slices() / spb <= o.device_blocks);
      // Nothing kept in the last keep_steps steps was dropped.
      const auto& h = history[pair];
      for (std::size_t k = h.size() >= 2 ? h.size() - 2 : 0; k < h.size(); ++k)
        for (const std::int32_t s : h[k])
          CHECK(std::find(dropped[i].begin(), dropped[i].end(), s / spb) == dropped[i].end());
    }
  }
  CHECK(cache.calls >= 1);
  // A pair the cache does not hold: the status says so, and nothing is evicted.
  const auto before = cache.gone;
  const int calls = cache.calls;
  pairs.emplace_back(9, 0);
  CHECK(retain(policy, cache, pairs, 0) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("retain") && Catch::Contains("no such (slot, layer)"));
  CHECK(cache.gone == before);
  CHECK(cache.calls == calls);
}

TEST_CASE("retention policy: bad options and out-of-order steps are refused, forget drops a sequence",
          "[retention]") {
  const SparseAttentionConfig cfg{};
  CHECK_THROWS_AS(retention_policy(cfg, {cfg.top_k_coarse - 1, 1}), error);
  CHECK_THROWS_AS(retention_policy(cfg, {cfg.top_k_coarse, 0}), error);
  SparseAttentionConfig bad = cfg;
  bad.fine_slice = 48;  // does not divide the block
  CHECK_THROWS_AS(retention_policy(bad, {64, 1}), error);
  retention_policy policy(cfg, {cfg.top_k_coarse, 1});
  const std::vector<std::int32_t> kept{16 * 5};
  REQUIRE(policy.observe(1, 0, 3, kept) == status::success);
  CHECK(policy.observe(1, 0, 2, kept) == status::invalid_argument);
  const std::int64_t length = 64 * 1024;  // 63 far blocks
  auto none = [](std::int32_t) { return false; };
  auto out = policy.plan(1, 0, length, none, 0);
  REQUIRE(out.size() == 63 - 32);
  CHECK(std::find(out.begin(), out.end(), 5) == out.end());  // kept by the last step
  policy.forget(1);
  out = policy.plan(1, 0, length, none, 0);
  CHECK(out.front() == 0);
  CHECK(std::find(out.begin(), out.end(), 5) != out.end());  // forgotten: block 5 was never kept
  // Within budget: nothing.
  CHECK(policy.plan(1, 0, 32 * 1024 + 600, none, 0).empty());
}
