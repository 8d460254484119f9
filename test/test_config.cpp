// config.hpp and policy/: validation names the field and the rule; presets;
// compile-time policies share the runtime checks.
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/policy/selection_policy.hpp"
#include "hisparse/policy/tile_policy.hpp"

using namespace hisparse;

TEST_CASE("the default config is DESIGN.md's", "[config]") {
  constexpr SparseAttentionConfig c;
  STATIC_REQUIRE(c.validate() == config_error::none);
  CHECK(c.window == 512);
  CHECK(c.coarse_block == 1024);
  CHECK(c.fine_slice == 64);
  CHECK(c.top_k_coarse == 32);
  CHECK(c.top_k_fine == 16);
  CHECK(c.slices_per_block() == 16);
  CHECK(c.fine_summary == fine_summary::mean);
  CHECK(c.fine_candidates() == 512);
  CHECK(check(c) == status::success);
}

TEST_CASE("every invalid config field is rejected with its name", "[config]") {
  struct bad_case {
    const char* field;
    std::function<void(SparseAttentionConfig&)> mutate;
  };
  const std::vector<bad_case> cases{
      {"window", [](auto& c) { c.window = 0; }},
      {"window", [](auto& c) { c.window = kMaxWindow + 1; }},
      {"coarse_block", [](auto& c) { c.coarse_block = -1024; }},
      {"coarse_block", [](auto& c) { c.coarse_block = kMaxCoarseBlock * 2; }},
      {"fine_slice", [](auto& c) { c.fine_slice = 0; }},
      {"fine_slice", [](auto& c) { c.fine_slice = 96; }},  // 1024 % 96 != 0
      {"top_k_coarse", [](auto& c) { c.top_k_coarse = 0; }},
      {"top_k_coarse", [](auto& c) { c.top_k_coarse = kMaxTopK + 1; }},
      {"top_k_fine", [](auto& c) { c.top_k_fine = -3; }},
      {"top_k_fine", [](auto& c) { c.top_k_coarse = 1; c.top_k_fine = 17; }},
      {"query_tile", [](auto& c) { c.query_tile = 0; }},
      {"query_tile", [](auto& c) { c.query_tile = 1000; }},
      {"query_tile", [](auto& c) { c.query_tile = kMaxQueryTile + 1; }},  // more than a prefill CTA holds
      {"fine_summary", [](auto& c) { c.fine_summary = static_cast<fine_summary>(7); }},
      {"coarse_summary", [](auto& c) { c.coarse_summary = static_cast<coarse_summary>(2); }},
      {"refresh.every", [](auto& c) { c.refresh.every = 0; }},
      {"refresh.min_cosine", [](auto& c) { c.refresh.min_cosine = 1.5f; }},
      {"refresh.min_cosine", [](auto& c) { c.refresh.min_cosine = std::nanf(""); }},
      // More fine candidates than one selection stage ranks: 4096-token blocks of 16-token slices.
      {"top_k_coarse", [](auto& c) { c.coarse_block = 4096; c.fine_slice = 16; }},
      {"top_k_coarse", [](auto& c) { c.top_k_coarse = 257; }},  // 257 * 16 = 4112 candidates
  };
  for (const auto& bc : cases) {
    SparseAttentionConfig c;
    bc.mutate(c);
    INFO("field " << bc.field);
    CHECK(c.validate() != config_error::none);
    CHECK(describe(c.validate()).field == bc.field);
    REQUIRE(check(c) == status::invalid_argument);
    CHECK_THAT(last_error(), Catch::StartsWith(std::string("SparseAttentionConfig.") + bc.field));
    CHECK_THROWS_WITH(require_valid(c), Catch::Contains(bc.field));
  }
}

TEST_CASE("every invalid attention shape is rejected with its name", "[config]") {
  CHECK(check(attention_shape{32, 8, 128}) == status::success);
  CHECK(attention_shape{32, 8, 128}.group_size() == 4);
  const std::vector<std::pair<attention_shape, std::string>> cases{
      {{0, 1, 64}, "num_q_heads"},   {{32, 0, 64}, "num_kv_heads"},
      {{32, 6, 64}, "num_q_heads must be a multiple"}, {{32, 8, 96}, "head_dim"},
      {{32, 8, 512}, "head_dim"},    {{4096, 8, 64}, "num_q_heads"},
  };
  for (const auto& [shape, what] : cases) {
    INFO(what);
    REQUIRE(check(shape) == status::invalid_argument);
    CHECK_THAT(last_error(), Catch::Contains(what));
  }
}

TEST_CASE("check_problem rejects empty batches and overflowing contexts", "[config]") {
  const SparseAttentionConfig c;
  const attention_shape s;
  CHECK(check_problem(c, s, std::vector<std::int64_t>{1, 262144}) == status::success);
  CHECK(check_problem(c, s, {}) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("batch is empty"));
  CHECK(check_problem(c, s, std::vector<std::int64_t>{5, 0}) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("sequence 1"));
  CHECK(check_problem(c, s, std::vector<std::int64_t>{kMaxContext + 1}) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("int32"));
  CHECK(check_problem(c, attention_shape{32, 8, 100}, std::vector<std::int64_t>{8}) ==
        status::invalid_argument);
  // At most kMaxCandidates coarse blocks a sequence: 4M tokens at C = 1024.
  CHECK(check_problem(c, s, std::vector<std::int64_t>{std::int64_t{kMaxCandidates} * 1024}) == status::success);
  CHECK(check_problem(c, s, std::vector<std::int64_t>{std::int64_t{kMaxCandidates} * 1024 + 1}) ==
        status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("more than 4096 coarse blocks"));
}

TEST_CASE("the preset registry maps ids to validated configs", "[config]") {
  preset_registry reg;
  CHECK(reg.get(preset_id::standard) == SparseAttentionConfig{});
  CHECK(reg.get(preset_id::high_recall).top_k_fine == 32);
  CHECK(reg.find("short_context") == preset_id::short_context);
  // standard with the decode fine filter on bf16 slice sums, nothing else.
  SparseAttentionConfig bf16_sums;
  bf16_sums.fine_summary = fine_summary::mean_bf16;
  CHECK(reg.get(preset_id::standard_bf16_summaries) == bf16_sums);
  CHECK(reg.find("standard_bf16_summaries") == preset_id::standard_bf16_summaries);
  // standard with the decode fine filter on slice key bounds, nothing else.
  SparseAttentionConfig bounds;
  bounds.fine_summary = fine_summary::key_bounds;
  CHECK(reg.get(preset_id::standard_key_bounds) == bounds);
  CHECK(reg.find("standard_key_bounds") == preset_id::standard_key_bounds);
  CHECK(reg.list().size() == std::size(kBuiltinPresets));
  CHECK_THROWS_WITH(reg.get(static_cast<preset_id>(77)), Catch::Contains("unknown preset id 77"));
  CHECK_THROWS_WITH(reg.find("nope"), Catch::Contains("unknown preset name"));
}

TEST_CASE("engines add presets under user ids only, and only valid ones", "[config]") {
  preset_registry reg;
  const auto mine = static_cast<preset_id>(200);
  SparseAttentionConfig c;
  c.top_k_fine = 8;
  CHECK(reg.add(preset_id::standard, "clash", c) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("reserved"));
  REQUIRE(reg.add(mine, "tight", c) == status::success);
  CHECK(reg.get(mine).top_k_fine == 8);
  CHECK(reg.add(mine, "again", c) == status::invalid_argument);
  SparseAttentionConfig bad;
  bad.window = 0;
  CHECK(reg.add(static_cast<preset_id>(201), "bad", bad) == status::invalid_argument);
  CHECK_FALSE(reg.contains(static_cast<preset_id>(201)));
}

TEST_CASE("selection policies carry the config as compile-time values", "[policy]") {
  using p = default_selection_policy;
  STATIC_REQUIRE(p::kWindow == 512);
  STATIC_REQUIRE(p::kSlicesPerBlock == 16);
  STATIC_REQUIRE(p::kMaxAttended == 16 * 64 + 512 + 63 + 63);
  STATIC_REQUIRE(p::kFineSummary == fine_summary::mean);
  using bounds = selection_policy<SparseAttentionConfig{256, 512, 32, 8, 8, 16, fine_summary::key_bounds}>;
  STATIC_REQUIRE(bounds::kFineSummary == fine_summary::key_bounds);
  STATIC_REQUIRE(is_selection_policy<bounds>::value);
  STATIC_REQUIRE_FALSE(is_selection_policy<int>::value);
  // A runtime config matches its instantiation with ==, the dispatcher's test.
  CHECK(preset_registry{}.get(preset_id::standard) == p::config);
}

TEST_CASE("a policy's selection shape fixes its widths and sizes, and matches only its own numbers", "[policy]") {
  using shape = policy_shape<default_selection_policy>;
  STATIC_REQUIRE(shape::kTopKCoarse == 32);
  STATIC_REQUIRE(shape::kTopKFine == 16);
  STATIC_REQUIRE(shape::kFineSlice == 64);
  STATIC_REQUIRE(shape::kCoarseBlock == 1024);
  STATIC_REQUIRE_FALSE(shape::kDynamic);
  STATIC_REQUIRE(dynamic_selection_shape::kDynamic);
  SparseAttentionConfig c{};
  CHECK(shape::matches(c));
  CHECK(dynamic_selection_shape::matches(c));
  c.window = 2048;  // not part of the shape
  CHECK(shape::matches(c));
  for (auto change : {+[](SparseAttentionConfig& x) { x.top_k_coarse = 64; },
                      +[](SparseAttentionConfig& x) { x.top_k_fine = 8; },
                      +[](SparseAttentionConfig& x) { x.fine_slice = 32; },
                      +[](SparseAttentionConfig& x) { x.coarse_block = 2048; }}) {
    SparseAttentionConfig other{};
    change(other);
    CHECK_FALSE(shape::matches(other));
    CHECK(dynamic_selection_shape::matches(other));
  }
  // The summaries it was built for, too.
  SparseAttentionConfig bounds{};
  bounds.fine_summary = fine_summary::key_bounds;
  CHECK_FALSE(shape::matches(bounds));
  using both = policy_shape<selection_policy<kBuiltinPresets[5].config>>;
  STATIC_REQUIRE(both::kFineSummary == static_cast<int>(fine_summary::key_bounds));
  STATIC_REQUIRE(both::kCoarseSummary == static_cast<int>(coarse_summary::key_bounds));
  bounds.coarse_summary = coarse_summary::key_bounds;
  CHECK(both::matches(bounds));
  // Only the fixed fields are compared.
  CHECK(selection_shape<0, 8>::matches(SparseAttentionConfig{512, 1024, 64, 64, 8, 64}));
}

TEST_CASE("dispatch maps a built-in preset id to its compile-time policy", "[policy]") {
  for (const auto& preset : kBuiltinPresets) {
    INFO(preset.name);
    SparseAttentionConfig seen{};
    seen.window = -1;
    REQUIRE(dispatch(preset.id, [&](auto policy) {
              using P = decltype(policy);
              STATIC_REQUIRE(is_selection_policy<P>::value);
              seen = P::config;
              return status::success;
            }) == status::success);
    CHECK(seen == preset.config);
  }
  // What the callable returns comes back; an unknown id calls nothing.
  CHECK(dispatch(preset_id::high_recall, [](auto) { return status::unsupported; }) == status::unsupported);
  bool called = false;
  CHECK(dispatch(static_cast<preset_id>(200), [&](auto) {
          called = true;
          return status::success;
        }) == status::invalid_argument);
  CHECK_FALSE(called);
  CHECK_THAT(last_error(), Catch::Contains("not a built-in preset"));
}

TEST_CASE("tile policies validate their fields", "[policy]") {
  STATIC_REQUIRE(tile_policy{}.validate() == tile_error::none);
  STATIC_REQUIRE(valid_tile_policy_v<tile_policy{64, 64, 4, 2}>);
  CHECK(tile_policy{64, 40, 4, 2}.validate() == tile_error::block_kv_must_be_a_positive_multiple_of_16);
  CHECK(tile_policy{64, 64, 0, 2}.validate() == tile_error::warps_must_be_in_1_to_16);
  CHECK(tile_policy{0, 64, 4, 2}.validate() == tile_error::block_q_must_be_in_1_to_256);
  CHECK(tile_policy{64, 64, 4, 9}.validate() == tile_error::stages_must_be_in_1_to_8);
  CHECK(tile_policy{64, 64, 8, 2}.threads() == 256);
  // The decode attention's own rules, checked where a class names the tile.
  STATIC_REQUIRE(valid_decode_tile_v<tile_policy{1, 64, 4, 3}>);
  CHECK(tile_policy{1, 64, 4, 3}.validate_decode() == tile_error::none);
  CHECK(tile_policy{2, 64, 4, 3}.validate_decode() == tile_error::decode_block_q_must_be_1);
  CHECK(tile_policy{1, 48, 3, 3}.validate_decode() == tile_error::decode_warps_must_be_1_2_4_or_8);
  CHECK(tile_policy{1, 32, 4, 3}.validate_decode() == tile_error::decode_block_kv_must_be_16_times_warps);
  CHECK(tile_policy{1, 40, 4, 3}.validate_decode() == tile_error::block_kv_must_be_a_positive_multiple_of_16);
}
