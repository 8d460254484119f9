// The 64-bit top-k keys order (score, index) pairs exactly as the contract
// (and reference::select_top_k) does: checked on the host, where the same
// header compiles.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/select/topk_keys.hpp"
#include "workload/synthetic.hpp"
#include "test_support.hpp"

using namespace hisparse;

namespace {
/// Ids of the k best by sorting keys, ascending (the reference's output form).
std::vector<std::int32_t> top_by_keys(const std::vector<float>& s, int k) {
  std::vector<select::topk_key> keys;
  for (std::size_t i = 0; i < s.size(); ++i) keys.push_back(select::make_key(s[i], static_cast<std::int32_t>(i)));
  std::sort(keys.rbegin(), keys.rend());
  std::vector<std::int32_t> ids;
  for (int i = 0; i < std::min<int>(k, static_cast<int>(keys.size())); ++i) ids.push_back(select::key_index(keys[i]));
  std::sort(ids.begin(), ids.end());
  return ids;
}
std::vector<std::int32_t> top_by_reference(const std::vector<float>& s, int k) {
  std::vector<double> d(s.begin(), s.end());
  std::vector<std::int32_t> ids(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) ids[i] = static_cast<std::int32_t>(i);
  return reference::select_top_k(d, ids, k).kept;
}
}  // namespace

TEST_CASE("top-k keys rank like the reference on random and adversarial rows", "[select][keys]") {
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng.below(300));
    std::vector<float> s(static_cast<std::size_t>(n));
    const int kind = trial % 5;
    for (auto& x : s) {
      const double u = rng.uniform();
      if (kind == 0) x = static_cast<float>(rng.normal());
      else if (kind == 1) x = static_cast<float>(rng.below(4)) - 1.5f;  // heavy ties
      else if (kind == 2) x = u < 0.2 ? nan : u < 0.4 ? -inf : u < 0.5 ? inf : static_cast<float>(rng.normal());
      else if (kind == 3) x = u < 0.5 ? 0.0f : -0.0f;  // -0 == +0: ties by index
      else x = -static_cast<float>(rng.below(3)) * 1e-38f;  // tiny negatives and zeros
    }
    for (const int k : {1, 3, 16, n}) {
      INFO("trial " << trial << " n " << n << " k " << k);
      REQUIRE(top_by_keys(s, k) == top_by_reference(s, k));
    }
  }
}

TEST_CASE("top-k keys keep indices and reserve zero for padding", "[select][keys]") {
  CHECK(select::key_index(select::make_key(1.5f, 0)) == 0);
  CHECK(select::key_index(select::make_key(-2.0f, 123456)) == 123456);
  CHECK(select::key_index(select::kNoCandidate) == -1);
  // Even the lowest-ranked real candidate (NaN, highest index) beats padding.
  CHECK(select::make_key(std::numeric_limits<float>::quiet_NaN(), (1 << 30) - 1) > select::kNoCandidate);
  CHECK(select::make_key(-std::numeric_limits<float>::infinity(), 0) >
        select::make_key(std::numeric_limits<float>::quiet_NaN(), 0));
  CHECK(select::make_key(0.0f, 5) == select::make_key(-0.0f, 5));
}

TEST_CASE("from_ordered_bits inverts ordered_bits on every kind of number", "[select][keys]") {
  const float special[] = {0.0f,
                           1.0f,
                           -1.0f,
                           std::numeric_limits<float>::denorm_min(),
                           -std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::lowest(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
  for (const float x : special) {
    INFO(x);
    CHECK(select::from_ordered_bits(select::ordered_bits(x)) == x);
  }
  // -0 ranks as +0 and comes back as +0.
  CHECK(!std::signbit(select::from_ordered_bits(select::ordered_bits(-0.0f))));
  workload::splitmix64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const auto bits = static_cast<std::uint32_t>(rng.next());
    float x;
    std::memcpy(&x, &bits, sizeof x);
    if (std::isnan(x) || x == 0.0f) continue;
    REQUIRE(select::from_ordered_bits(select::ordered_bits(x)) == x);
  }
}
