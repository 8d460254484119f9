// How close the selection's attention-mass recall is to the best any
// selection of the same budget could do, on the demo's synthetic workload
// (CPU, fp64 masses from the bf16 keys; the demo's seeds and queries).
//
// For each of `batch` requests (query i of the workload at position T - 1,
// as hisparse_demo places them) and each KV head, with per-token dense
// softmax masses of the group's query heads:
//   selection  the mass on the window plus the preset's kept slices
//              (reference::decode), averaged over query heads: the demo's
//              "mass recall";
//   slices     the window plus the top_k_fine far slices of most group mass:
//              the ceiling of any selection that keeps whole slices;
//   tokens     the most massive N tokens of each query head, N = what the
//              selection attends: the ceiling of any selection of N tokens.
//
// --misses also lists, per request and KV head, every far slice the
// selection left out that holds more than ten times the group mass of the
// least it kept, with the workload's needle tokens in each.
//
//   recall_ceiling [--contexts 32768,131072,262144] [--batch 8] [--seed 2026] [--preset standard] [--misses]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/workload/synthetic.hpp"

namespace {

struct options {
  std::vector<std::int64_t> contexts{32768, 131072, 262144};
  int batch = 8;
  std::uint64_t seed = 2026;  // hisparse_demo's default
  std::string preset = "standard";
  bool misses = false;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--contexts" && has_value) {
      o.contexts.clear();
      const std::string list = argv[++i];
      for (std::size_t at = 0; at < list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        o.contexts.push_back(std::stoll(list.substr(at, comma - at)));
        at = comma + 1;
      }
    } else if (arg == "--batch" && has_value) {
      o.batch = std::stoi(argv[++i]);
    } else if (arg == "--seed" && has_value) {
      o.seed = std::stoull(argv[++i]);
    } else if (arg == "--preset" && has_value) {
      o.preset = argv[++i];
    } else if (arg == "--misses") {
      o.misses = true;
    } else {
      std::fprintf(stderr, "usage: %s [--contexts 32768,262144] [--batch N] [--seed N] [--preset NAME] [--misses]\n",
                   argv[0]);
      std::exit(arg == "--help" ? 0 : 2);
    }
  }
  return o;
}

struct recalls {
  double selection = 0, slices = 0, tokens = 0;
  int rows = 0;
};

/// Adds one request's (query position T - 1) recalls, every KV head.
void add_request(const hisparse::SparseAttentionConfig& cfg, const hisparse::attention_shape& shape,
                 const hisparse::workload::synthetic_workload<__nv_bfloat16>& w, const std::vector<float>& keys,
                 int request, bool misses, recalls& r) {
  using namespace hisparse;
  const std::int64_t T = w.options.context;
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, dim = shape.head_dim, group = shape.group_size();
  const int F = cfg.fine_slice;
  reference::sequence<__nv_bfloat16> seq = w.sequence();
  seq.queries = tensor_view<const __nv_bfloat16, 3>::contiguous(
      w.queries.data() + static_cast<std::size_t>(request) * hq * dim, 1, hq, dim);
  seq.q_begin = T - 1;
  const auto sparse = reference::decode(cfg, shape, seq);
  const std::int64_t ws = sparse.tiles[0].window_begin, far_slices = ws / F;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  std::vector<std::vector<double>> mass(static_cast<std::size_t>(group),
                                        std::vector<double>(static_cast<std::size_t>(T)));
  for (int h = 0; h < hkv; ++h) {
    for (int g = 0; g < group; ++g) {
      std::vector<double> q(static_cast<std::size_t>(dim));
      for (int d = 0; d < dim; ++d) q[static_cast<std::size_t>(d)] = to_double(seq.queries(0, h * group + g, d));
      auto& m = mass[static_cast<std::size_t>(g)];
      double top = -HUGE_VAL;
      for (std::int64_t t = 0; t < T; ++t) {
        const float* k = &keys[static_cast<std::size_t>((t * hkv + h) * dim)];
        double s = 0;
        for (int d = 0; d < dim; ++d) s += q[static_cast<std::size_t>(d)] * k[d];
        m[static_cast<std::size_t>(t)] = s * scale;
        top = std::max(top, s * scale);
      }
      double z = 0;
      for (double& x : m) z += (x = std::exp(x - top));
      for (double& x : m) x /= z;
    }
    // Group mass of every far slice: what a shared slice selection keeps.
    std::vector<double> slice_mass(static_cast<std::size_t>(far_slices), 0.0);
    for (std::int64_t s = 0; s < far_slices; ++s)
      for (const auto& m : mass)
        for (std::int64_t t = s * F; t < (s + 1) * F; ++t)
          slice_mass[static_cast<std::size_t>(s)] += m[static_cast<std::size_t>(t)];
    const auto& kept = sparse.tiles[0].slices[static_cast<std::size_t>(h)].kept;
    std::vector<double> best = slice_mass;
    const std::size_t k = std::min(kept.size(), best.size());
    std::partial_sort(best.begin(), best.begin() + static_cast<std::ptrdiff_t>(k), best.end(), std::greater<>());
    double kept_mass = 0, best_mass = 0;
    for (const auto s : kept) kept_mass += slice_mass[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < k; ++i) best_mass += best[i];
    if (misses && !kept.empty()) {
      double least = HUGE_VAL;
      for (const auto s : kept) least = std::min(least, slice_mass[static_cast<std::size_t>(s)]);
      for (std::int64_t s = 0; s < far_slices; ++s) {
        const double m = slice_mass[static_cast<std::size_t>(s)];
        if (m <= 10 * least || std::find(kept.begin(), kept.end(), s) != kept.end()) continue;
        int needle_tokens = 0;
        for (const std::int64_t begin : w.needle_begin[static_cast<std::size_t>(h)])
          for (std::int64_t t = begin; t < begin + w.options.needle_span; ++t) needle_tokens += t / F == s ? 1 : 0;
        std::printf("  T %lld request %d KV head %d: missed slice %lld, mass %.5f a head (%d needle tokens); "
                    "least kept %.6f\n",
                    static_cast<long long>(T), request, h, static_cast<long long>(s), m / group, needle_tokens,
                    least / group);
      }
    }
    const std::int64_t attended = (T - ws) + static_cast<std::int64_t>(kept.size()) * F;
    for (const auto& m : mass) {
      const double window = std::accumulate(m.begin() + ws, m.end(), 0.0);
      std::vector<double> sorted = m;
      std::nth_element(sorted.begin(), sorted.begin() + attended, sorted.end(), std::greater<>());
      r.tokens += std::accumulate(sorted.begin(), sorted.begin() + attended, 0.0);
      r.selection += window;
      r.slices += window;
      ++r.rows;
    }
    r.selection += kept_mass;  // summed over the group: its share of each head's average
    r.slices += best_mass;
  }
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace hisparse;
  const options opt = parse(argc, argv);
  const preset_registry presets;
  const SparseAttentionConfig cfg = presets.get(presets.find(opt.preset));
  const attention_shape shape{32, 8, 128};
  std::printf("preset '%s', %d requests per context, seed %llu (hisparse_demo's workload)\n", opt.preset.c_str(),
              opt.batch, static_cast<unsigned long long>(opt.seed));
  std::printf("%9s %12s %22s %22s\n", "context", "selection", "window + best slices", "best tokens per head");
  for (const std::int64_t ctx : opt.contexts) {
    workload::synthetic_options wo;
    wo.context = ctx;
    wo.shape = shape;
    wo.num_queries = opt.batch;
    wo.seed = opt.seed + static_cast<std::uint64_t>(ctx);
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(wo);
    std::vector<float> keys(w.keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = to_float(w.keys[i]);
    recalls r;
    for (int b = 0; b < opt.batch; ++b) add_request(cfg, shape, w, keys, b, opt.misses, r);
    std::printf("%9lld %12.4f %22.4f %22.4f\n", static_cast<long long>(ctx), r.selection / r.rows,
                r.slices / r.rows, r.tokens / r.rows);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "recall_ceiling: %s\n", e.what());
  return 1;
}
