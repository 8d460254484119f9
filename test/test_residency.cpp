// The offload residency policy on the host: its plans against the rule
// checked directly (budget, window, recent slices, least recently kept
// first), and a drifting stream driven through `rebalance` on a stand-in
// cache: the device never holds more than the budget allows, and a slice
// the stream keeps on consecutive steps misses only once.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include "hisparse/runtime/residency.hpp"
#include "workload/synthetic.hpp"

using namespace hisparse;

namespace {

/// The part of paged_kv_cache that rebalance uses: one layer's residency.
struct fake_cache {
  enum class where { device, host };
  struct options_t {
    int fine_slice = 64;
  } opt;
  std::int64_t tokens = 0;
  std::vector<where> at;  // per complete slice
  int offload_calls = 0, fetch_calls = 0;

  const options_t& options() const { return opt; }
  std::int64_t length(int, int) const { return tokens; }
  where residency(int, int, std::int32_t s) const { return at[static_cast<std::size_t>(s)]; }
  status move(std::span<const std::int32_t> slices, where to) {
    for (const std::int32_t s : slices) {
      REQUIRE(at[static_cast<std::size_t>(s)] != to);  // plans move only what is elsewhere
      at[static_cast<std::size_t>(s)] = to;
    }
    return status::success;
  }
  status offload_async(int, int, std::span<const std::int32_t> slices, int) {
    ++offload_calls;
    return move(slices, where::host);
  }
  status fetch_async(int, int, std::span<const std::int32_t> slices, int) {
    ++fetch_calls;
    return move(slices, where::device);
  }
  std::int64_t on_device() const { return std::count(at.begin(), at.end(), where::device); }
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
