// The CPU path's cost: one decode step of the fp64 reference (selection +
// attention over the kept tokens) against the fp64 dense baseline, on the
// synthetic workload, for the 7B GQA model's shapes.
#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include "hisparse/reference/sparse_attention.hpp"
#include "workload/synthetic.hpp"

namespace {

using namespace hisparse;

const workload::synthetic_workload<__nv_bfloat16>& cached_workload(std::int64_t context) {
  static std::int64_t cached_context = -1;
  static workload::synthetic_workload<__nv_bfloat16> w;
  if (cached_context != context) {
    workload::synthetic_options o;
    o.context = context;
    o.shape = {32, 8, 128};
    w = workload::make_synthetic_workload<__nv_bfloat16>(o);
    cached_context = context;
  }
  return w;
}

void BM_reference_sparse_decode(benchmark::State& state) {
  const auto& w = cached_workload(state.range(0));
  const SparseAttentionConfig cfg;
  for (auto _ : state) benchmark::DoNotOptimize(reference::decode(cfg, w.options.shape, w.sequence()));
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(state.range(0)),
                                                      benchmark::Counter::kIsIterationInvariantRate);
}

void BM_reference_dense_decode(benchmark::State& state) {
  const auto& w = cached_workload(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(reference::dense_attention(w.options.shape, w.sequence()));
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(state.range(0)),
                                                      benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_reference_sparse_decode)->ArgName("T")->Arg(8192)->Arg(65536)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_reference_dense_decode)->ArgName("T")->Arg(8192)->Arg(65536)->Unit(benchmark::kMillisecond);
int main(int argc, char** argv) { return hisparse::bench::run_main(argc, argv, {}, [](const auto&) {}); }
