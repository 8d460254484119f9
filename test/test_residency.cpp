// The offload residency policy on the host: its plans against the rule
// checked directly (budget, window, recent slices, least recently kept
// first), and a drifting stream driven through `rebalance` on a stand-in
// cache: the device never holds more than the budget allows, and a slice
// the stream keeps on consecutive steps misses only once.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "hisparse/runtime/residency.hpp"
#include "workload/synthetic.hpp"

using namespace hisparse;

namespace {

/// The part of paged_kv_cache that rebalance uses: the residency of each
/// (slot, layer)'s complete slices, moved by batched offloads and fetches.
struct fake_cache {
  enum class where { device, host };
  struct options_t {
    int fine_slice = 64;
  } opt;
  struct slice_list {
    int slot = 0;
    int layer = 0;
    std::span<const std::int32_t> slices;
  };
  struct view {
    const std::vector<where>* at;
    bool on_host(std::int32_t s) const { return (*at)[static_cast<std::size_t>(s)] == where::host; }
    std::int64_t host_slices() const { return std::count(at->begin(), at->end(), where::host); }
    bool evicted(std::int32_t) const { return false; }
    std::int64_t evicted_slices() const { return 0; }
  };
  std::int64_t tokens = 0;                           // every pair's length
  std::map<std::pair<int, int>, std::vector<where>> of;  // per (slot, layer): per complete slice
  std::vector<where>& at = of[{0, 0}];
  int offload_calls = 0, fetch_calls = 0;

  const options_t& options() const { return opt; }
  std::int64_t length(int, int) const { return tokens; }
  view residency_of(int slot, int layer) const {
    const auto it = of.find({slot, layer});
    if (it == of.end()) throw error(status::invalid_argument, "no such (slot, layer)");  // as paged_kv_cache does
    return {&it->second};
  }
  status move(std::span<const slice_list> lists, where to) {
    std::set<std::pair<int, int>> seen;
    for (const auto& l : lists) {
      REQUIRE(seen.insert({l.slot, l.layer}).second);  // each pair once a batch
      for (const std::int32_t s : l.slices) {
        auto& w = of.at({l.slot, l.layer})[static_cast<std::size_t>(s)];
        REQUIRE(w != to);  // plans move only what is elsewhere
        w = to;
      }
    }
    return status::success;
  }
  status offload_async(std::span<const slice_list> lists, int) {
    ++offload_calls;
    return move(lists, where::host);
  }
  status fetch_async(std::span<const slice_list> lists, int) {
    ++fetch_calls;
    return move(lists, where::device);
  }
  std::int64_t on_device(std::pair<int, int> pair = {0, 0}) const {
    const auto& v = of.at(pair);
    return std::count(v.begin(), v.end(), where::device);
  }
};

}  // namespace

TEST_CASE("residency plans keep the budget, the window and recent slices, and offload the least recently kept",
          "[residency]") {
  workload::splitmix64 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    INFO("trial " << trial);
    residency_options o;
    o.device_slices = static_cast<std::int32_t>(rng.below(120));
    o.window_slices = static_cast<std::int32_t>(rng.below(12));
    o.keep_steps = 1 + static_cast<int>(rng.below(3));
    residency_policy policy(o);
    const auto complete = static_cast<std::int32_t>(1 + rng.below(150));
    std::vector<bool> host(static_cast<std::size_t>(complete));
    for (auto&& h : host) h = rng.below(3) == 0;
    std::vector<std::int64_t> kept_at(static_cast<std::size_t>(complete) + 20, -1);
    const int steps = static_cast<int>(rng.below(6));
    std::vector<std::int32_t> last;
    for (int st = 0; st < steps; ++st) {
      std::vector<std::int32_t> kept;
      for (int i = 0; i < 12; ++i) kept.push_back(static_cast<std::int32_t>(rng.below(complete + 20)) - 2);
      REQUIRE(policy.observe(0, 3, st, kept) == status::success);
      last.clear();
      for (const auto s : kept)
        if (s >= 0) kept_at[static_cast<std::size_t>(s)] = st, last.push_back(s);
    }
    const auto m = policy.plan(0, 3, complete,
                               [&](std::int32_t s) { return static_cast<bool>(host[static_cast<std::size_t>(s)]); });
    REQUIRE(std::is_sorted(m.fetch.begin(), m.fetch.end()));
    REQUIRE(std::is_sorted(m.offload.begin(), m.offload.end()));
    // fetch: exactly the last step's kept complete slices on the host.
    std::set<std::int32_t> want_fetch;
    for (const auto s : last)
      if (s < complete && host[static_cast<std::size_t>(s)]) want_fetch.insert(s);
    REQUIRE(std::vector<std::int32_t>(want_fetch.begin(), want_fetch.end()) == m.fetch);
    // offload: eligible slices only, the least recently kept first, as many
    // as the budget needs (or every eligible one).
    const std::int64_t last_step = steps - 1;
    auto eligible = [&](std::int32_t s) {
      const std::int64_t at = kept_at[static_cast<std::size_t>(s)];
      return !host[static_cast<std::size_t>(s)] && s < complete - o.window_slices &&
             (at < 0 || at <= last_step - o.keep_steps);
    };
    for (const auto s : m.offload) REQUIRE(eligible(s));
    std::int64_t device = static_cast<std::int64_t>(want_fetch.size()), candidates = 0;
    for (std::int32_t s = 0; s < complete; ++s) {
      device += !host[static_cast<std::size_t>(s)];
      candidates += eligible(s);
    }
    const std::int64_t excess = std::max<std::int64_t>(0, device - o.device_slices);
    REQUIRE(static_cast<std::int64_t>(m.offload.size()) == std::min(excess, candidates));
    for (std::int32_t s = 0; s < complete; ++s) {
      if (!eligible(s) || std::binary_search(m.offload.begin(), m.offload.end(), s)) continue;
      for (const auto t : m.offload)  // every eligible slice left behind ranks after every one offloaded
        REQUIRE(std::make_pair(kept_at[static_cast<std::size_t>(t)], t) <
                std::make_pair(kept_at[static_cast<std::size_t>(s)], s));
    }
  }
}

TEST_CASE("a drifting stream through rebalance: the budget holds and a slice misses once", "[residency]") {
  constexpr std::int32_t kComplete = 4096, kBudget = 2048;
  fake_cache cache;
  cache.tokens = std::int64_t{kComplete} * 64 + 17;  // a partial slice at the end is not counted
  cache.at.assign(kComplete, fake_cache::where::device);
  residency_policy policy({kBudget, 9, 1});
  // Step 0 keeps nothing far: the plan offloads the oldest slices down to the budget.
  REQUIRE(policy.observe(0, 0, 0, std::vector<std::int32_t>{}) == status::success);
  residency_moves moved;
  REQUIRE(rebalance(policy, cache, 0, 0, 0, &moved) == status::success);
  REQUIRE(cache.on_device() == kBudget);
  REQUIRE(moved.offload.size() == kComplete - kBudget);
  REQUIRE(moved.offload.front() == 0);
  // Then a window of 64 kept slices that slides by 4 a step across the context.
  std::int64_t misses = 0, kept_total = 0;
  std::set<std::int32_t> missed_once;
  for (int step = 1; step <= 400; ++step) {
    std::vector<std::int32_t> kept;
    for (std::int32_t i = 0; i < 64; ++i) kept.push_back((step * 4 + i * 7) % (kComplete - 16));
    for (const auto s : kept) {
      ++kept_total;
      if (cache.at[static_cast<std::size_t>(s)] == fake_cache::where::host) {
        ++misses;
        REQUIRE(missed_once.insert(s).second);  // fetched after its first miss, and never offloaded again here
      }
    }
    REQUIRE(policy.observe(0, 0, step, kept) == status::success);
    REQUIRE(rebalance(policy, cache, 0, 0, 0) == status::success);
    REQUIRE(cache.on_device() <= kBudget);
    for (const auto s : kept) REQUIRE(cache.at[static_cast<std::size_t>(s)] == fake_cache::where::device);
    for (std::int32_t s = kComplete - 9; s < kComplete; ++s)
      REQUIRE(cache.at[static_cast<std::size_t>(s)] == fake_cache::where::device);
  }
  // Each step brings 4 new slices into a set of 64: misses stay near 4/64 of
  // what is kept, never the whole set.
  INFO("misses " << misses << " of " << kept_total);
  REQUIRE(misses < kept_total / 8);
  REQUIRE(cache.fetch_calls > 0);
}

TEST_CASE("residency policy: bad options and out-of-order steps are refused, forget drops a sequence",
          "[residency][errors]") {
  REQUIRE_THROWS_AS(residency_policy({-1, 9, 1}), error);
  REQUIRE_THROWS_AS(residency_policy({10, -1, 1}), error);
  REQUIRE_THROWS_AS(residency_policy({10, 9, 0}), error);
  residency_policy policy({0, 0, 1});
  REQUIRE(policy.observe(2, 0, 5, std::vector<std::int32_t>{3}) == status::success);
  REQUIRE(policy.observe(2, 0, 4, std::vector<std::int32_t>{3}) == status::invalid_argument);
  auto host = [](std::int32_t s) { return s == 3; };
  REQUIRE(policy.plan(2, 0, 10, host).fetch == std::vector<std::int32_t>{3});
  policy.forget(2);
  REQUIRE(policy.plan(2, 0, 10, host).fetch.empty());
  REQUIRE(policy.plan(2, 0, 10, host).offload.size() == 9);  // budget 0: every device slice but none recent
}

TEST_CASE("rebalance over many (slot, layer) pairs moves what each pair's plan says, in one batch each way",
          "[residency]") {
  constexpr std::int32_t kComplete = 600;
  workload::splitmix64 rng(23);
  fake_cache batched, single;
  batched.tokens = single.tokens = std::int64_t{kComplete} * 64;
  std::vector<std::pair<int, int>> pairs;
  for (int slot = 0; slot < 3; ++slot)
    for (int layer = 0; layer < 4; ++layer) pairs.emplace_back(slot, layer);
  for (const auto& pr : pairs) {
    std::vector<fake_cache::where> w(kComplete);
    for (auto& x : w) x = rng.below(4) == 0 ? fake_cache::where::host : fake_cache::where::device;
    batched.of[pr] = single.of[pr] = w;
  }
  residency_policy policy({150, 9, 1});
  for (int step = 0; step < 6; ++step) {
    for (const auto& [slot, layer] : pairs) {
      std::vector<std::int32_t> kept;
      for (int i = 0; i < 40; ++i) kept.push_back(static_cast<std::int32_t>(rng.below(kComplete)));
      REQUIRE(policy.observe(slot, layer, step, kept) == status::success);
    }
    std::vector<residency_moves> moved;
    const int calls = batched.offload_calls + batched.fetch_calls;
    REQUIRE(rebalance(policy, batched, std::span<const std::pair<int, int>>(pairs), 0, &moved) == status::success);
    REQUIRE(batched.offload_calls + batched.fetch_calls - calls <= 2);
    REQUIRE(moved.size() == pairs.size());
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      residency_moves one;
      REQUIRE(rebalance(policy, single, pairs[i].first, pairs[i].second, 0, &one) == status::success);
      REQUIRE(one.offload == moved[i].offload);
      REQUIRE(one.fetch == moved[i].fetch);
      REQUIRE(batched.of.at(pairs[i]) == single.of.at(pairs[i]));
      REQUIRE(batched.on_device(pairs[i]) <= 150);
    }
  }
  // A pair the cache does not hold: the status says so, and nothing moves.
  const auto before = batched.of;
  const int calls = batched.offload_calls + batched.fetch_calls;
  auto with_stranger = pairs;
  with_stranger.emplace_back(7, 0);
  CHECK(rebalance(policy, batched, std::span<const std::pair<int, int>>(with_stranger), 0) ==
        status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("rebalance") && Catch::Contains("no such (slot, layer)"));
  CHECK(batched.of == before);
  CHECK(batched.offload_calls + batched.fetch_calls == calls);
}
