// Batched top-k: hisparse::select::batched_topk against CUB's segmented sorts
// (merge-based and radix), which answer the same question by sorting every
// row and keeping its first k. All three read the same random-normal scores,
// rotated over enough copies that repeated iterations miss the 60 MB L2.
// GBps is read-once bandwidth (rows * n * 4 bytes / time); floor_us is the
// time that read takes at the H200's 4.8 TB/s.
#include <benchmark/benchmark.h>

#include "bench_main.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "hisparse/select/batched_topk.cuh"
#include "hisparse/select/topk.cuh"
#include "workload/synthetic.hpp"
#include "bench_support.hpp"

namespace {

using hisparse::bench::device_array;
using hisparse::bench::event_timer;
using hisparse::bench::median;

using namespace hisparse;
constexpr double kHbmBytesPerSecond = 4.8e12;

/// The inputs of one (rows, n): `copies` identical copies of the scores and
/// of the column indices 0..n-1 of every row (CUB's sort values), and the
/// segment offsets. Built once and shared by every benchmark of that shape.
struct shape_inputs {
  std::size_t elems = 0, copies = 0;
  device_array<float> scores;
  device_array<int> columns;
  device_array<int> begin_offsets, end_offsets;

  shape_inputs(int rows, int n)
      : elems(static_cast<std::size_t>(rows) * n),
        copies(std::max<std::size_t>(1, (std::size_t{256} << 20) / (elems * sizeof(float)))),
        scores(elems * copies),
        columns(elems * copies),
        begin_offsets(static_cast<std::size_t>(rows)),
        end_offsets(static_cast<std::size_t>(rows)) {
    std::vector<float> host(elems);
    workload::splitmix64 rng(7);
    for (auto& x : host) x = static_cast<float>(rng.normal());
    std::vector<int> cols(elems);
    for (std::size_t i = 0; i < elems; ++i) cols[i] = static_cast<int>(i % static_cast<std::size_t>(n));
    for (std::size_t c = 0; c < copies; ++c) {
      HISPARSE_CUDA_CHECK(
          cudaMemcpy(scores.ptr + c * elems, host.data(), elems * sizeof(float), cudaMemcpyHostToDevice));
      HISPARSE_CUDA_CHECK(
          cudaMemcpy(columns.ptr + c * elems, cols.data(), elems * sizeof(int), cudaMemcpyHostToDevice));
    }
    std::vector<int> begin(static_cast<std::size_t>(rows)), end(begin.size());
    for (int r = 0; r < rows; ++r) {
      begin[static_cast<std::size_t>(r)] = r * n;
      end[static_cast<std::size_t>(r)] = (r + 1) * n;
    }
    HISPARSE_CUDA_CHECK(
        cudaMemcpy(begin_offsets.ptr, begin.data(), begin.size() * sizeof(int), cudaMemcpyHostToDevice));
    HISPARSE_CUDA_CHECK(cudaMemcpy(end_offsets.ptr, end.data(), end.size() * sizeof(int), cudaMemcpyHostToDevice));
  }
  [[nodiscard]] const float* scores_copy(std::size_t it) const { return scores.ptr + (it % copies) * elems; }
  [[nodiscard]] const int* columns_copy(std::size_t it) const { return columns.ptr + (it % copies) * elems; }
};

const shape_inputs& inputs_for(int rows, int n) {
  static std::map<std::pair<int, int>, std::unique_ptr<shape_inputs>> cache;
  auto& slot = cache[{rows, n}];
  if (!slot) slot = std::make_unique<shape_inputs>(rows, n);
  return *slot;
}


/// Times `op(iteration)` once per benchmark iteration (after one untimed
/// warm-up call) and reports the counters every top-k benchmark shares.
template <class Op>
void time_iterations(benchmark::State& state, int rows, int n, Op&& op) {
  op(std::size_t{0});
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  event_timer timer;
  std::vector<double> times;
  std::size_t it = 1;
  for (auto _ : state) {
    const double t = timer.seconds([&] { op(it); });
    state.SetIterationTime(t);
    times.push_back(t);
    ++it;
  }
  const double bytes = static_cast<double>(rows) * n * sizeof(float);
  const double t = median(times);
  state.counters["median_us"] = t * 1e6;
  state.counters["GBps"] = bytes / t * 1e-9;
  state.counters["floor_us"] = bytes / kHbmBytesPerSecond * 1e6;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

/// Untimed sanity check: the share of rows (of input copy 0) whose top-k
/// indices, as `run_topk` leaves them in `indices`, equal the first k columns
/// of CUB's stable radix sort (ties to the lower column, as top-k breaks them).
template <class Run>
double rows_matching_cub(const shape_inputs& in, int rows, int n, int k, const std::int32_t* indices, Run&& run_topk) {
  run_topk();
  device_array<float> keys_out(in.elems);
  device_array<int> columns_out(in.elems);
  std::size_t bytes = 0;
  const auto items = static_cast<int>(in.elems);
  HISPARSE_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, in.scores_copy(0), keys_out.ptr, in.columns_copy(0), columns_out.ptr, items, rows,
      in.begin_offsets.ptr, in.end_offsets.ptr));
  device_array<unsigned char> temp(bytes);
  HISPARSE_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      temp.ptr, bytes, in.scores_copy(0), keys_out.ptr, in.columns_copy(0), columns_out.ptr, items, rows,
      in.begin_offsets.ptr, in.end_offsets.ptr));
  const std::size_t kk = std::min(k, n);
  std::vector<int> want(static_cast<std::size_t>(rows) * kk);
  std::vector<std::int32_t> got(static_cast<std::size_t>(rows) * k);
  HISPARSE_CUDA_CHECK(cudaMemcpy2D(want.data(), kk * sizeof(int), columns_out.ptr,
                                   static_cast<std::size_t>(n) * sizeof(int), kk * sizeof(int),
                                   static_cast<std::size_t>(rows), cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(got.data(), indices, got.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  int matching = 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r)
    matching += std::equal(want.begin() + r * kk, want.begin() + (r + 1) * kk, got.begin() + r * k) ? 1 : 0;
  return static_cast<double>(matching) / rows;
}

void BM_hisparse_topk(benchmark::State& state) {
  const auto rows = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
             k = static_cast<int>(state.range(2));
  const shape_inputs& in = inputs_for(rows, n);
  device_array<float> values(static_cast<std::size_t>(rows) * k);
  device_array<std::int32_t> indices(static_cast<std::size_t>(rows) * k);
  std::size_t temp_bytes = 0;
  throw_if_error(select::batched_topk(nullptr, temp_bytes, in.scores.ptr, n, nullptr, rows, n, k, values.ptr,
                                      indices.ptr));
  device_array<unsigned char> temp(temp_bytes);
  time_iterations(state, rows, n, [&](std::size_t it) {
    throw_if_error(select::batched_topk(temp.ptr, temp_bytes, in.scores_copy(it), n, nullptr, rows, n, k,
                                        values.ptr, indices.ptr));
  });
  state.counters["temp_MB"] = static_cast<double>(temp_bytes) * 1e-6;
  state.counters["rows_matching_cub"] = rows_matching_cub(in, rows, n, k, indices.ptr, [&] {
    throw_if_error(select::batched_topk(temp.ptr, temp_bytes, in.scores_copy(0), n, nullptr, rows, n, k,
                                        values.ptr, indices.ptr));
  });
}

/// CUB sorts every row (pairs: score, column) descending; the first k of
/// each sorted row are the top-k. Only the sort is timed.
template <bool Radix>
void run_cub_sort(benchmark::State& state) {
  const auto rows = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1));
  const shape_inputs& in = inputs_for(rows, n);
  const auto items = static_cast<int>(in.elems);
  device_array<float> keys_out(in.elems);
  device_array<int> values_out(in.elems);
  auto sort = [&](void* temp, std::size_t& bytes, std::size_t it) {
    if constexpr (Radix)
      HISPARSE_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
          temp, bytes, in.scores_copy(it), keys_out.ptr, in.columns_copy(it), values_out.ptr, items, rows,
          in.begin_offsets.ptr, in.end_offsets.ptr));
    else
      HISPARSE_CUDA_CHECK(cub::DeviceSegmentedSort::SortPairsDescending(
          temp, bytes, in.scores_copy(it), keys_out.ptr, in.columns_copy(it), values_out.ptr, items, rows,
          in.begin_offsets.ptr, in.end_offsets.ptr));
  };
  std::size_t temp_bytes = 0;
  sort(nullptr, temp_bytes, 0);
  device_array<unsigned char> temp(temp_bytes);
  time_iterations(state, rows, n, [&](std::size_t it) { sort(temp.ptr, temp_bytes, it); });
  state.counters["temp_MB"] = static_cast<double>(temp_bytes) * 1e-6;
}

void BM_cub_segmented_sort(benchmark::State& state) { run_cub_sort<false>(state); }
void BM_cub_segmented_radix_sort(benchmark::State& state) { run_cub_sort<true>(state); }

/// (rows, n, k): decode-sized rows, prefill-sized rows, long rows, short
/// rows with small k, long rows with the largest k.
constexpr std::array<std::array<std::int64_t, 3>, 5> kShapes{{
    {32768, 256, 32}, {8192, 4096, 64}, {1024, 65536, 64}, {4096, 1024, 16}, {128, 65536, 2048}}};

void topk_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "n", "k"});
  for (const auto& shape : kShapes) b->Args({shape[0], shape[1], shape[2]});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(BM_hisparse_topk)->Apply(topk_shapes);
BENCHMARK(BM_cub_segmented_sort)->Apply(topk_shapes);
BENCHMARK(BM_cub_segmented_radix_sort)->Apply(topk_shapes);
int main(int argc, char** argv) { return hisparse::bench::run_main(argc, argv, {}, [](const auto&) {}); }
