#pragma once
// The runtime description of hierarchical sparse attention (DESIGN.md
// section 1), its validation, the shape of the attention problem, and the
// preset registry through which a serving engine names a configuration with
// one small integer per request.
//
// `SparseAttentionConfig` is a structural type: the same struct that a
// serving engine fills at run time is the non-type template parameter of
// `selection_policy<Cfg>`, and `validate()` is constexpr, so the compile-time
// checks and the run-time checks are one function.

#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"

namespace hisparse {

// Limits. Token positions are int32 everywhere (index lists, page tables);
// keeping contexts at or below 2^30 tokens leaves headroom for `p + M`,
// `p0 - W` and slice arithmetic without any overflow check in kernels.
inline constexpr std::int64_t kMaxContext = std::int64_t{1} << 30;
inline constexpr int kMaxTopK = 2048;           ///< widest top-k the selection kernels take
inline constexpr int kMaxWindow = 1 << 20;
inline constexpr int kMaxCoarseBlock = 1 << 20;
/// Queries one prefill tile holds: the rows of one CTA's score GEMM.
inline constexpr int kMaxQueryTile = 64;
inline constexpr int kMaxHeads = 1024;
/// Candidates one selection stage ranks (its scores stay in one CTA's shared
/// memory): the blocks of a sequence, so at most 4096 * coarse_block tokens
/// of context, and the slices of the kept blocks, top_k_coarse * C / F.
inline constexpr int kMaxCandidates = 4096;

/// Every way a configuration or problem can be invalid. The enumerator names
/// are what a failed compile-time check prints, so they say the rule.
enum class config_error : std::uint8_t {
  none = 0,
  window_must_be_in_1_to_kMaxWindow,
  coarse_block_must_be_in_1_to_kMaxCoarseBlock,
  fine_slice_must_be_positive,
  fine_slice_must_divide_coarse_block,
  top_k_coarse_must_be_in_1_to_kMaxTopK,
  top_k_fine_must_be_in_1_to_kMaxTopK,
  top_k_fine_must_not_exceed_slices_of_kept_blocks,
  fine_candidates_must_not_exceed_kMaxCandidates,
  query_tile_must_be_in_1_to_kMaxQueryTile,
  fine_summary_must_be_mean_mean_bf16_or_key_bounds,
  coarse_summary_must_be_mean_or_key_bounds,
  refresh_every_must_be_in_1_to_kMaxWindow,
  refresh_min_cosine_must_be_in_minus_1_to_1,
  num_q_heads_must_be_in_1_to_kMaxHeads,
  num_kv_heads_must_be_in_1_to_kMaxHeads,
  num_q_heads_must_be_a_multiple_of_num_kv_heads,
  head_dim_must_be_64_128_or_256,
};

/// The field a `config_error` is about, and the rule it breaks, in words.
struct config_error_info {
  std::string_view field;
  std::string_view rule;
};

[[nodiscard]] constexpr config_error_info describe(config_error e) noexcept {
  switch (e) {
    case config_error::none: return {"", "valid"};
    case config_error::window_must_be_in_1_to_kMaxWindow:
      return {"window", "must be in [1, 2^20]"};
    case config_error::coarse_block_must_be_in_1_to_kMaxCoarseBlock:
      return {"coarse_block", "must be in [1, 2^20]"};
    case config_error::fine_slice_must_be_positive: return {"fine_slice", "must be positive"};
    case config_error::fine_slice_must_divide_coarse_block:
      return {"fine_slice", "must divide coarse_block"};
    case config_error::top_k_coarse_must_be_in_1_to_kMaxTopK:
      return {"top_k_coarse", "must be in [1, 2048]"};
    case config_error::top_k_fine_must_be_in_1_to_kMaxTopK:
      return {"top_k_fine", "must be in [1, 2048]"};
    case config_error::top_k_fine_must_not_exceed_slices_of_kept_blocks:
      return {"top_k_fine",
              "must not exceed top_k_coarse * coarse_block / fine_slice (the candidate slices)"};
    case config_error::fine_candidates_must_not_exceed_kMaxCandidates:
      return {"top_k_coarse",
              "times coarse_block / fine_slice (the fine stage's candidates) must be at most 4096, "
              "what one selection stage ranks"};
    case config_error::query_tile_must_be_in_1_to_kMaxQueryTile:
      return {"query_tile", "must be in [1, 64] (the queries one prefill CTA holds)"};
    case config_error::fine_summary_must_be_mean_mean_bf16_or_key_bounds:
      return {"fine_summary", "must be mean, mean_bf16 or key_bounds"};
    case config_error::coarse_summary_must_be_mean_or_key_bounds:
      return {"coarse_summary", "must be mean or key_bounds"};
    case config_error::refresh_every_must_be_in_1_to_kMaxWindow:
      return {"refresh.every", "must be in [1, 2^20]"};
    case config_error::refresh_min_cosine_must_be_in_minus_1_to_1:
      return {"refresh.min_cosine", "must be in [-1, 1]"};
    case config_error::num_q_heads_must_be_in_1_to_kMaxHeads:
      return {"num_q_heads", "must be in [1, 1024]"};
    case config_error::num_kv_heads_must_be_in_1_to_kMaxHeads:
      return {"num_kv_heads", "must be in [1, 1024]"};
    case config_error::num_q_heads_must_be_a_multiple_of_num_kv_heads:
      return {"num_q_heads", "must be a multiple of num_kv_heads"};
    case config_error::head_dim_must_be_64_128_or_256:
      return {"head_dim", "must be 64, 128 or 256"};
  }
  return {"?", "unknown error"};
}

/// What the decode fine filter scores a candidate slice by, and so which
/// per-slice summary the cache keeps for it beside its fp32 key sums (which
/// the blocks and prefill always read). Scores are fp32 in every case.
///  * mean: (sum_g q_g) . mean key, DESIGN.md section 1's contract.
///  * mean_bf16: the same mean from the slice's fp32 key sum rounded to bf16
///    (round to nearest even) when the cache stores it: half the bytes of
///    the decode step's bandwidth-bound phase, at the price of the rounding.
///  * key_bounds: with Q = sum_g q_g and [lo_d, hi_d] the slice's key range
///    in dimension d (`key_bounds_word`: bf16, rounded outward), sum_d Q_d b_d
///    with b_d = hi_d where Q_d >= 0, else lo_d: an upper bound of Q . k over
///    the slice's keys (IEEE products: 0 * inf is NaN). A mean dilutes one
///    strong key 64-fold; a bound does not. As many bytes as fp32 means.
/// Blocks always score their means, and prefill selection scores the fp32
/// means whatever the config names: the kind is the decode fine filter's.
enum class fine_summary : std::uint8_t { mean = 0, mean_bf16 = 1, key_bounds = 2 };

/// Whether `s` is one of the kinds above (a cast can make any byte).
[[nodiscard]] constexpr bool is_valid(fine_summary s) noexcept {
  return s == fine_summary::mean || s == fine_summary::mean_bf16 || s == fine_summary::key_bounds;
}

[[nodiscard]] constexpr std::string_view name_of(fine_summary s) noexcept {
  switch (s) {
    case fine_summary::mean: return "mean";
    case fine_summary::mean_bf16: return "mean_bf16";
    case fine_summary::key_bounds: return "key_bounds";
  }
  return "?";
}

/// What the coarse filter scores a candidate block by (DESIGN.md section 1,
/// step 4).
///  * mean: (sum_g q_g) . the mean of the block's far keys: the contract.
///  * key_bounds: fine_summary::key_bounds' upper bound over the block's far
///    keys' range in each dimension (the range of its far slices' ranges):
///    one strong key is not diluted 1024-fold, as it is in a block mean.
///    The decode selection reads the cache's block bounds (a cache built
///    with paged_kv_cache_options::coarse_summary key_bounds), beside
///    fine_summary key_bounds only; the prefill selection rejects it.
enum class coarse_summary : std::uint8_t { mean = 0, key_bounds = 1 };

[[nodiscard]] constexpr bool is_valid(coarse_summary s) noexcept {
  return s == coarse_summary::mean || s == coarse_summary::key_bounds;
}

[[nodiscard]] constexpr std::string_view name_of(coarse_summary s) noexcept {
  switch (s) {
    case coarse_summary::mean: return "mean";
    case coarse_summary::key_bounds: return "key_bounds";
  }
  return "?";
}

/// When a decode step may reuse its TopK cache entry -- the selection an
/// earlier query of the same sequence and KV head made -- instead of
/// selecting: it selects afresh once the query is `every` positions past
/// the one that selected (or before it: a stale entry), and whenever the
/// group-summed query's cosine to the selecting one falls below
/// `min_cosine`. A reused selection attends the cached slices and the
/// query's own window (the window moves every step; slices that left it
/// since the selection wait for the next one). The default (every step) is
/// DESIGN.md section 1's contract. On the GPU any other rule needs a cache
/// that keeps TopK entries (kv::paged_kv_cache_options::topk_cache_slices).
///
/// `late`: a step attends its entry as it stands (its own window added)
/// and its verdict, with the selection it may make, serves the next step,
/// so the step does not wait for its selection. The entry is the one the
/// last late step left (or an on-time step wrote); a step whose entry is
/// empty, another config's or made after its query attends on time.
struct refresh_rule {
  int every = 1;
  float min_cosine = -1.0f;  ///< -1: no cosine test
  bool late = false;

  /// Whether every verdict selects afresh (a late rule still attends the
  /// entry the step before left).
  [[nodiscard]] constexpr bool every_step() const noexcept { return every == 1; }
  /// Whether steps read and write TopK entries.
  [[nodiscard]] constexpr bool keeps_entries() const noexcept { return every != 1 || late; }
  friend constexpr bool operator==(const refresh_rule&, const refresh_rule&) = default;
};

/// Hierarchical sparse attention, as DESIGN.md section 1 defines it. The
/// defaults are the field's: a 512-token window, 1024-token blocks of which
/// 32 are kept, 64-token slices of which 16 are kept (about 1.5K tokens per
/// query at any context length). Scores and their sort are always fp32.
struct SparseAttentionConfig {
  int window = 512;         ///< W: tokens always attended (aligned down to a slice)
  int coarse_block = 1024;  ///< C: tokens per coarse block
  int fine_slice = 64;      ///< F: tokens per fine slice; divides C
  int top_k_coarse = 32;    ///< blocks kept per (query tile, KV head)
  int top_k_fine = 16;      ///< slices kept per (query tile, KV head)
  int query_tile = 64;      ///< M: prefill queries sharing one selection (decode uses 1)
  /// What the decode fine filter scores slices by (above).
  hisparse::fine_summary fine_summary = hisparse::fine_summary::mean;
  /// What the coarse filter scores blocks by (above).
  hisparse::coarse_summary coarse_summary = hisparse::coarse_summary::mean;
  /// When a decode step may reuse an earlier step's selection (above).
  refresh_rule refresh{};

  [[nodiscard]] constexpr config_error validate() const noexcept {
    if (window < 1 || window > kMaxWindow) return config_error::window_must_be_in_1_to_kMaxWindow;
    if (coarse_block < 1 || coarse_block > kMaxCoarseBlock)
      return config_error::coarse_block_must_be_in_1_to_kMaxCoarseBlock;
    if (fine_slice < 1) return config_error::fine_slice_must_be_positive;
    if (coarse_block % fine_slice != 0) return config_error::fine_slice_must_divide_coarse_block;
    if (top_k_coarse < 1 || top_k_coarse > kMaxTopK)
      return config_error::top_k_coarse_must_be_in_1_to_kMaxTopK;
    if (top_k_fine < 1 || top_k_fine > kMaxTopK)
      return config_error::top_k_fine_must_be_in_1_to_kMaxTopK;
    if (static_cast<std::int64_t>(top_k_fine) > fine_candidates())
      return config_error::top_k_fine_must_not_exceed_slices_of_kept_blocks;
    if (fine_candidates() > kMaxCandidates) return config_error::fine_candidates_must_not_exceed_kMaxCandidates;
    if (query_tile < 1 || query_tile > kMaxQueryTile)
      return config_error::query_tile_must_be_in_1_to_kMaxQueryTile;
    if (!is_valid(fine_summary))
      return config_error::fine_summary_must_be_mean_mean_bf16_or_key_bounds;
    if (!is_valid(coarse_summary)) return config_error::coarse_summary_must_be_mean_or_key_bounds;
    if (refresh.every < 1 || refresh.every > kMaxWindow) return config_error::refresh_every_must_be_in_1_to_kMaxWindow;
    if (!(refresh.min_cosine >= -1.0f && refresh.min_cosine <= 1.0f))
      return config_error::refresh_min_cosine_must_be_in_minus_1_to_1;
    return config_error::none;
  }

  [[nodiscard]] constexpr int slices_per_block() const noexcept {
    return coarse_block / fine_slice;
  }
  /// The fine stage's most candidates: every slice of the kept blocks.
  [[nodiscard]] constexpr std::int64_t fine_candidates() const noexcept {
    return static_cast<std::int64_t>(top_k_coarse) * (coarse_block / fine_slice);
  }

  friend constexpr bool operator==(const SparseAttentionConfig&,
                                   const SparseAttentionConfig&) = default;
};

/// Heads and head size of one attention layer.
struct attention_shape {
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;

  [[nodiscard]] constexpr config_error validate() const noexcept {
    if (num_q_heads < 1 || num_q_heads > kMaxHeads)
      return config_error::num_q_heads_must_be_in_1_to_kMaxHeads;
    if (num_kv_heads < 1 || num_kv_heads > kMaxHeads)
      return config_error::num_kv_heads_must_be_in_1_to_kMaxHeads;
    if (num_q_heads % num_kv_heads != 0)
      return config_error::num_q_heads_must_be_a_multiple_of_num_kv_heads;
    if (head_dim != 64 && head_dim != 128 && head_dim != 256)
      return config_error::head_dim_must_be_64_128_or_256;
    return config_error::none;
  }

  /// G: query heads per KV head (valid shapes only).
  [[nodiscard]] constexpr int group_size() const noexcept { return num_q_heads / num_kv_heads; }

  friend constexpr bool operator==(const attention_shape&, const attention_shape&) = default;
};

namespace detail {
inline std::string field_values(const SparseAttentionConfig& c) {
  return "window=" + std::to_string(c.window) + " coarse_block=" + std::to_string(c.coarse_block) +
         " fine_slice=" + std::to_string(c.fine_slice) +
         " top_k_coarse=" + std::to_string(c.top_k_coarse) +
         " top_k_fine=" + std::to_string(c.top_k_fine) +
         " query_tile=" + std::to_string(c.query_tile) +
         " fine_summary=" + std::string(name_of(c.fine_summary)) +
         " coarse_summary=" + std::string(name_of(c.coarse_summary)) +
         " refresh.every=" + std::to_string(c.refresh.every) +
         " refresh.min_cosine=" + std::to_string(c.refresh.min_cosine) +
         " refresh.late=" + (c.refresh.late ? "true" : "false");
}
inline std::string field_values(const attention_shape& s) {
  return "num_q_heads=" + std::to_string(s.num_q_heads) +
         " num_kv_heads=" + std::to_string(s.num_kv_heads) +
         " head_dim=" + std::to_string(s.head_dim);
}
template <class T>
status report(const T& value, std::string_view type_name) {
  const config_error e = value.validate();
  if (e == config_error::none) return status::success;
  const config_error_info info = describe(e);
  return fail(status::invalid_argument, std::string(type_name) + "." + std::string(info.field) +
                                            " " + std::string(info.rule) + " (got " +
                                            field_values(value) + ")");
}
}  // namespace detail

/// Validates and, on failure, records a reason naming the field and the rule.
[[nodiscard]] inline status check(const SparseAttentionConfig& c) {
  return detail::report(c, "SparseAttentionConfig");
}
[[nodiscard]] inline status check(const attention_shape& s) {
  return detail::report(s, "attention_shape");
}

/// Checks everything about a batch before any work: the config, the shape,
/// a non-empty batch, and every context length in [1, kMaxContext] (a query
/// always sees at least its own key, and int32 token indices cannot overflow)
/// and of at most kMaxCandidates coarse blocks.
[[nodiscard]] inline status check_problem(const SparseAttentionConfig& c, const attention_shape& s,
                                          std::span<const std::int64_t> context_lengths) {
  HISPARSE_TRY(check(c));
  HISPARSE_TRY(check(s));
  if (context_lengths.empty())
    return fail(status::invalid_argument, "batch is empty: need at least one sequence");
  for (std::size_t i = 0; i < context_lengths.size(); ++i) {
    const std::int64_t t = context_lengths[i];
    if (t < 1 || t > kMaxContext)
      return fail(status::invalid_argument,
                  "context length of sequence " + std::to_string(i) + " is " + std::to_string(t) +
                      ": must be in [1, 2^30] (token indices are int32)");
    if ((t + c.coarse_block - 1) / c.coarse_block > kMaxCandidates)
      return fail(status::invalid_argument,
                  "context length of sequence " + std::to_string(i) + " is " + std::to_string(t) +
                      ": more than " + std::to_string(kMaxCandidates) + " coarse blocks of " +
                      std::to_string(c.coarse_block) +
                      " tokens (what one selection stage ranks)");
  }
  return status::success;
}

/// Host convenience: throws hisparse::error naming the field and the rule.
inline void require_valid(const SparseAttentionConfig& c) { throw_if_error(check(c)); }
inline void require_valid(const attention_shape& s) { throw_if_error(check(s)); }

// ---------------------------------------------------------------------------
// Presets: a serving engine passes one byte per request, not a dictionary.

enum class preset_id : std::uint8_t {
  standard = 0,      ///< the field's defaults: 512 / 1024 / 64 / 32 / 16
  high_recall = 1,   ///< twice the kept slices for retrieval-heavy prompts
  short_context = 2, ///< smaller blocks for contexts of 8K-32K tokens
  standard_bf16_summaries = 3,  ///< standard, the decode fine filter on bf16 slice summaries
  standard_key_bounds = 4,  ///< standard, the decode fine filter on slice key bounds
  key_bounds_both = 5,      ///< standard, both decode filters on key bounds (blocks and slices)
  first_user_id = 128,  ///< ids from here on are free for an engine's own presets
};

struct preset {
  preset_id id;
  std::string_view name;
  SparseAttentionConfig config;
};

/// The presets every registry starts with. Why these values: `standard` is
/// DESIGN.md section 1 (about 1.5K tokens attended per query); `high_recall`
/// keeps 64 blocks / 32 slices (about 2.5K tokens) for workloads whose far
/// attention is spread over more needles; `short_context` halves the block
/// and slice so short prompts still have enough candidates to choose from;
/// `standard_bf16_summaries` and `standard_key_bounds` are `standard` with
/// the decode fine filter on another fine_summary (a cache that keeps it
/// serves them; prefill scores fp32 means under both); `key_bounds_both`
/// ranks blocks by their key bounds too (decode only: a cache with both
/// kinds of bounds; single-token needles far from the window are found
/// where block means dilute them, docs/PERF_NOTES.md).
inline constexpr preset kBuiltinPresets[] = {
    {preset_id::standard, "standard", SparseAttentionConfig{}},
    {preset_id::high_recall, "high_recall", SparseAttentionConfig{512, 1024, 64, 64, 32, 64}},
    {preset_id::short_context, "short_context", SparseAttentionConfig{256, 512, 32, 32, 16, 64}},
    {preset_id::standard_bf16_summaries, "standard_bf16_summaries",
     SparseAttentionConfig{512, 1024, 64, 32, 16, 64, fine_summary::mean_bf16}},
    {preset_id::standard_key_bounds, "standard_key_bounds",
     SparseAttentionConfig{512, 1024, 64, 32, 16, 64, fine_summary::key_bounds}},
    {preset_id::key_bounds_both, "key_bounds_both",
     SparseAttentionConfig{512, 1024, 64, 32, 16, 64, fine_summary::key_bounds, coarse_summary::key_bounds}},
};

static_assert([] {
  for (const preset& p : kBuiltinPresets)
    if (p.config.validate() != config_error::none) return false;
  return true;
}(), "a built-in preset is invalid");

/// Maps preset ids to validated configs. Starts with the built-ins; an engine
/// adds its own under ids >= preset_id::first_user_id. Lookups are read-only
/// and may run concurrently; `add` is not synchronized with them.
class preset_registry {
 public:
  preset_registry() {
    for (const preset& p : kBuiltinPresets) entries_.emplace(p.id, entry{std::string(p.name), p.config});
  }

  /// Registers a user preset; rejects built-in ids, duplicates and invalid
  /// configs without changing the registry.
  [[nodiscard]] status add(preset_id id, std::string_view name, const SparseAttentionConfig& c) {
    if (id < preset_id::first_user_id)
      return fail(status::invalid_argument,
                  "preset id " + std::to_string(static_cast<int>(id)) +
                      " is reserved for built-in presets: user ids start at 128");
    if (entries_.count(id) != 0)
      return fail(status::invalid_argument,
                  "preset id " + std::to_string(static_cast<int>(id)) + " is already registered");
    HISPARSE_TRY(check(c));
    entries_.emplace(id, entry{std::string(name), c});
    return status::success;
  }

  [[nodiscard]] bool contains(preset_id id) const { return entries_.count(id) != 0; }

  /// The config of a preset; throws hisparse::error for an unknown id.
  [[nodiscard]] const SparseAttentionConfig& get(preset_id id) const {
    const auto it = entries_.find(id);
    if (it == entries_.end())
      throw error(status::invalid_argument,
                  "unknown preset id " + std::to_string(static_cast<int>(id)));
    return it->second.config;
  }

  /// The id of the preset with this name; throws for an unknown name.
  [[nodiscard]] preset_id find(std::string_view name) const {
    for (const auto& [id, e] : entries_)
      if (e.name == name) return id;
    throw error(status::invalid_argument, "unknown preset name '" + std::string(name) + "'");
  }

  [[nodiscard]] std::vector<std::pair<preset_id, std::string>> list() const {
    std::vector<std::pair<preset_id, std::string>> out;
    for (const auto& [id, e] : entries_) out.emplace_back(id, e.name);
    return out;
  }

 private:
  struct entry {
    std::string name;
    SparseAttentionConfig config;
  };
  std::map<preset_id, entry> entries_;
};

}  // namespace hisparse
