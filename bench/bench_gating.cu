// Activation top-k gating and the gated GEMV (select/activation_topk.cuh).
//
// BM_activation_topk: rows of bf16 activations (N(0, 1)) under an fp32 gate
// (uniform in [0.25, 1.25]), K a share of the row, over enough copies that
// every launch reads HBM. floor_us is the bytes it must move (A read once,
// indices and values written) at the H200's 4.8 TB/s. scripts/torch_gating.py
// times torch.topk on scores of the same shape for the ratio.
//
// BM_gated_gemv: y = W[:, idx] vals for W^T [n][outs] bf16, each of `rows`
// rows keeping `keep_pct`% of its columns (its own random top-k), against
// cuBLAS's dense GEMV of the same shape (bf16 in, fp32 accumulate and out)
// timed alternately in the same loop; both over copies of W that miss the
// L2. speedup = dense_us / gated_us; union_pct is the share of W's columns
// some row keeps (what the gated GEMV reads).
#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cublas_v2.h>

#include "bench_support.hpp"
#include "hisparse/select/activation_topk.cuh"
#include "workload/synthetic.hpp"

namespace {

using hisparse::bench::device_array;
using hisparse::bench::event_timer;
using hisparse::bench::median;
using namespace hisparse;
using bf16 = __nv_bfloat16;

constexpr double kHbmBytesPerSecond = 4.8e12;

std::vector<float> host_gate(int n, std::uint64_t seed) {
  workload::splitmix64 rng(seed);
  std::vector<float> g(static_cast<std::size_t>(n));
  for (auto& x : g) x = static_cast<float>(0.25 + rng.uniform());
  return g;
}

void BM_activation_topk(benchmark::State& state) {
  const auto rows = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  const int k = static_cast<int>(static_cast<std::int64_t>(n) * state.range(2) / 100);
  const double in_bytes = static_cast<double>(rows) * n * sizeof(bf16);
  const int copies = bench::cold_copies(in_bytes, in_bytes);
  const std::size_t elems = static_cast<std::size_t>(rows) * n;
  device_array<bf16> a(elems * copies);
  bench::fill_normal(a.ptr, elems * copies, 11);
  device_array<float> gate(host_gate(n, 12));
  const std::size_t slots = static_cast<std::size_t>(rows) * k;
  device_array<std::int32_t> idx(slots), counts(static_cast<std::size_t>(rows));
  device_array<bf16> vals(slots);
  event_timer timer;
  auto launch = [&](int copy) {
    throw_if_error(select::activation_topk(a.ptr + elems * copy, n, gate.ptr, rows, n, select::gating_rule::top_k,
                                           nullptr, 0.0f, k, idx.ptr, vals.ptr, counts.ptr));
  };
  for (int c = 0; c < copies; ++c) launch(c);  // warm-up
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> times;
  int it = 0;
  for (auto _ : state) {
    const double t = timer.seconds([&] { launch(it % copies); });
    state.SetIterationTime(t);
    times.push_back(t);
    ++it;
  }
  const double bytes = in_bytes + n * sizeof(float) + static_cast<double>(slots) * (sizeof(std::int32_t) + sizeof(bf16));
  const double t = median(times);
  state.counters["median_us"] = t * 1e6;
  state.counters["GBps"] = bytes / t * 1e-9;
  state.counters["floor_us"] = bytes / kHbmBytesPerSecond * 1e6;
  state.counters["k"] = k;
  state.counters["copies"] = copies;
}

void BM_gated_gemv(benchmark::State& state) {
  const auto rows = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
             outs = static_cast<int>(state.range(2));
  const int k = static_cast<int>(static_cast<std::int64_t>(n) * state.range(3) / 100);
  const double w_bytes = static_cast<double>(n) * outs * sizeof(bf16);
  const int copies = bench::cold_copies(w_bytes, w_bytes);
  const std::size_t w_elems = static_cast<std::size_t>(n) * outs;
  device_array<bf16> w(w_elems * copies);
  bench::fill_normal(w.ptr, w_elems * copies, 21);
  // Each row's own top-k of random activations: independent kept sets.
  device_array<bf16> a(static_cast<std::size_t>(rows) * n);
  bench::fill_normal(a.ptr, static_cast<std::size_t>(rows) * n, 22);
  device_array<float> gate(host_gate(n, 23));
  const std::size_t slots = static_cast<std::size_t>(rows) * k;
  device_array<std::int32_t> idx(slots), counts(static_cast<std::size_t>(rows));
  device_array<bf16> vals(slots);
  throw_if_error(select::activation_topk(a.ptr, n, gate.ptr, rows, n, select::gating_rule::top_k, nullptr, 0.0f, k,
                                         idx.ptr, vals.ptr, counts.ptr));
  std::size_t temp_bytes = 0;
  throw_if_error(select::gated_gemv(nullptr, temp_bytes, w.ptr, outs, n, outs, idx.ptr, vals.ptr, k, counts.ptr, rows,
                                    static_cast<float*>(nullptr)));
  device_array<unsigned char> temp(temp_bytes);
  device_array<float> y(static_cast<std::size_t>(rows) * outs), y_dense(static_cast<std::size_t>(rows) * outs);

  // The columns some row keeps.
  std::vector<std::int32_t> host_idx(slots);
  HISPARSE_CUDA_CHECK(cudaMemcpy(host_idx.data(), idx.ptr, slots * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  std::vector<char> used(static_cast<std::size_t>(n), 0);
  for (const auto i : host_idx)
    if (i >= 0) used[static_cast<std::size_t>(i)] = 1;
  const double union_share = static_cast<double>(std::count(used.begin(), used.end(), 1)) / n;

  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    state.SkipWithError("cublasCreate failed");
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  // Column-major: y (outs x rows) = W (outs x n, ld outs: W^T [n][outs] row-major) times A^T (n x rows).
  auto dense = [&](int copy) {
    const auto st = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, outs, rows, n, &one, w.ptr + w_elems * copy,
                                 CUDA_R_16BF, outs, a.ptr, CUDA_R_16BF, n, &zero, y_dense.ptr, CUDA_R_32F, outs,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) throw error(status::cuda_error, "cublasGemmEx failed");
  };
  auto gated = [&](int copy) {
    throw_if_error(select::gated_gemv(temp.ptr, temp_bytes, w.ptr + w_elems * copy, outs, n, outs, idx.ptr, vals.ptr,
                                      k, counts.ptr, rows, y.ptr));
  };
  for (int c = 0; c < copies; ++c) {  // warm-up
    dense(c);
    gated(c);
  }
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  event_timer timer;
  std::vector<double> gated_times, dense_times;
  int it = 0;
  for (auto _ : state) {
    const double t = timer.seconds([&] { gated(it % copies); });
    dense_times.push_back(timer.seconds([&] { dense((it + 1) % copies); }));
    state.SetIterationTime(t);
    gated_times.push_back(t);
    ++it;
  }
  cublasDestroy(handle);
  const double tg = median(gated_times), td = median(dense_times);
  state.counters["gated_us"] = tg * 1e6;
  state.counters["dense_us"] = td * 1e6;
  state.counters["speedup"] = td / tg;
  state.counters["union_pct"] = 100.0 * union_share;
  state.counters["gated_floor_us"] = union_share * w_bytes / kHbmBytesPerSecond * 1e6;
  state.counters["dense_floor_us"] = w_bytes / kHbmBytesPerSecond * 1e6;
  state.counters["temp_MB"] = static_cast<double>(temp_bytes) * 1e-6;
}

}  // namespace

BENCHMARK(BM_activation_topk)
    ->ArgNames({"rows", "n", "k_pct"})
    ->Args({4096, 14336, 25})
    ->Args({4096, 14336, 50})
    ->Args({4096, 14336, 10})
    ->Args({1, 14336, 25})
    ->Args({8, 14336, 50})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_gated_gemv)
    ->ArgNames({"rows", "n", "outs", "keep_pct"})
    ->Args({1, 14336, 4096, 50})
    ->Args({2, 14336, 4096, 50})
    ->Args({4, 14336, 4096, 50})
    ->Args({8, 14336, 4096, 50})
    ->Args({1, 14336, 4096, 25})
    ->Args({1, 14336, 4096, 100})
    ->Args({1, 4096, 14336, 50})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) { return hisparse::bench::run_main(argc, argv, {}, [](const auto&) {}); }
