// HiSparse demo: hierarchical sparse attention on a synthetic long-context
// decode workload. Without a GPU it runs the fp64 CPU reference and reports,
// per context length, how many tokens a query attends, how much of the dense
// attention mass the selection keeps, and the output error against dense.
//
//   hisparse_demo [--contexts 8192,32768,131072] [--seed N] [--preset standard]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "hisparse/config.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/workload/synthetic.hpp"

namespace {

struct options {
  std::vector<std::int64_t> contexts{8192, 32768, 131072};
  std::uint64_t seed = 2026;
  std::string preset = "standard";
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--contexts" && has_value) {
      o.contexts.clear();
      std::string list = argv[++i];
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        o.contexts.push_back(std::stoll(list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else if (arg == "--seed" && has_value) {
      o.seed = std::stoull(argv[++i]);
    } else if (arg == "--preset" && has_value) {
      o.preset = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--contexts 8192,32768] [--seed N] [--preset NAME]\n", argv[0]);
      std::exit(arg == "--help" ? 0 : 2);
    }
  }
  return o;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace hisparse;
  const options opt = parse(argc, argv);
  const preset_registry presets;
  const SparseAttentionConfig cfg = presets.get(presets.find(opt.preset));
  const attention_shape shape{32, 8, 128};  // the 7B GQA model of the reference deployment

  std::printf("HiSparse demo: decode, %d query heads / %d KV heads, head_dim %d, bf16 KV\n",
              shape.num_q_heads, shape.num_kv_heads, shape.head_dim);
  std::printf("preset '%s': window %d, blocks %d (keep %d), slices %d (keep %d)\n", opt.preset.c_str(),
              cfg.window, cfg.coarse_block, cfg.top_k_coarse, cfg.fine_slice, cfg.top_k_fine);
  std::printf("path: CPU fp64 reference (no GPU path in this build)\n\n");
  std::printf("%10s %12s %10s %12s %12s %10s\n", "context", "attended/q", "fraction", "mass recall",
              "rel. error", "cpu s");
  for (const std::int64_t ctx : opt.contexts) {
    const auto t0 = std::chrono::steady_clock::now();
    workload::synthetic_options wo;
    wo.context = ctx;
    wo.shape = shape;
    wo.seed = opt.seed + static_cast<std::uint64_t>(ctx);
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(wo);
    const auto seq = w.sequence();
    const auto sparse = reference::decode(cfg, shape, seq);
    const auto dense = reference::dense_attention(shape, seq);
    const double recall = reference::mass_recall(cfg, shape, seq, sparse, dense);
    double attended = 0;
    for (const auto a : sparse.attended) attended += static_cast<double>(a);
    attended /= static_cast<double>(sparse.attended.size());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%10lld %12.0f %9.2f%% %12.4f %12.2e %10.1f\n", static_cast<long long>(ctx), attended,
                100.0 * attended / static_cast<double>(ctx), recall,
                relative_error(sparse.output, dense.output), secs);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hisparse_demo: %s\n", e.what());
  return 1;
}
