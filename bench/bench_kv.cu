// Paged KV cache: append throughput (decode and prefill) against a
// device-to-device copy of the same bytes timed in the same run, the cost of
// summary maintenance, and page pool allocate/free throughput.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <vector>

#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/new_delete_resource.hpp"
#include "workload/synthetic.hpp"
#include "bench_main.hpp"
#include "bench_support.hpp"

namespace {

using hisparse::bench::event_timer;
using hisparse::bench::median;

using namespace hisparse;
using bf16 = __nv_bfloat16;
constexpr int kHeads = 8, kDim = 128;  // the 7B GQA model

struct gpu_buffers {
  bf16* src = nullptr;   // K rows then V rows, random
  bf16* copy_dst = nullptr;
  std::size_t elems = 0;
  explicit gpu_buffers(std::size_t n) : elems(n) {
    std::vector<bf16> host(n);
    workload::splitmix64 rng(7);
    for (auto& x : host) x = from_float<bf16>(static_cast<float>(rng.normal()));
    HISPARSE_CUDA_CHECK(cudaMalloc(&src, n * sizeof(bf16)));
    HISPARSE_CUDA_CHECK(cudaMalloc(&copy_dst, n * sizeof(bf16)));
    HISPARSE_CUDA_CHECK(cudaMemcpy(src, host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
  }
  ~gpu_buffers() {
    cudaFree(src);
    cudaFree(copy_dst);
  }
};

/// Appends `tokens` tokens to each of `batch` sequences per iteration (one
/// layer), cycling the sequences when they fill up, and times the same bytes
/// through cudaMemcpyAsync device-to-device for the in-run baseline.
/// summaries: 0 none, 1 the fp32 sums, 2 those and the mean_bf16 fine
/// summary, 3 the fp32 sums and the key_bounds one.
void run_append(benchmark::State& state, int batch, std::int32_t tokens, int summaries) {
  const std::int64_t per_seq = std::max<std::int64_t>(std::int64_t{tokens} * 4, 8192);
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kHeads;
  o.head_dim = kDim;
  o.max_sequences = batch;
  o.max_context = per_seq;
  o.maintain_summaries = summaries != 0;
  o.fine_summary = summaries == 2   ? fine_summary::mean_bf16
                   : summaries == 3 ? fine_summary::key_bounds
                                    : fine_summary::mean;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, o);
  const std::size_t rows = static_cast<std::size_t>(batch) * tokens;
  const std::size_t elems = rows * kHeads * kDim;
  // Source rotates over enough copies to defeat the 60 MB L2.
  const std::size_t copies = std::max<std::size_t>(1, (std::size_t{256} << 20) / (2 * elems * sizeof(bf16)));
  gpu_buffers buf(2 * elems * copies);
  std::vector<int> slots(static_cast<std::size_t>(batch));
  for (auto& s : slots) throw_if_error(cache.add_sequence(per_seq, s));
  std::vector<kv::append_segment> segs;
  for (int i = 0; i < batch; ++i) segs.push_back({slots[i], i * tokens, tokens});
  event_timer timer;
  std::vector<double> append_s, copy_s;
  std::size_t it = 0;
  for (auto _ : state) {
    if (cache.length(slots[0], 0) + tokens > per_seq) {  // full: recycle (untimed)
      for (auto& s : slots) {
        throw_if_error(cache.free_sequence(s));
        throw_if_error(cache.add_sequence(per_seq, s));
      }
    }
    const bf16* k = buf.src + (it % copies) * 2 * elems;
    const bf16* v = k + elems;
    const double t = timer.seconds([&] { throw_if_error(cache.append_async(0, segs, k, v, nullptr)); });
    const double c = timer.seconds([&] {
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(buf.copy_dst, k, 2 * elems * sizeof(bf16), cudaMemcpyDeviceToDevice));
    });
    state.SetIterationTime(t);
    append_s.push_back(t);
    copy_s.push_back(c);
    ++it;
  }
  const double bytes = 2.0 * 2.0 * static_cast<double>(elems) * sizeof(bf16);  // K+V, read + write
  const double ta = median(append_s), tc = median(copy_s);
  state.counters["median_us"] = ta * 1e6;
  state.counters["GBps"] = bytes / ta * 1e-9;
  state.counters["copy_GBps"] = bytes / tc * 1e-9;
  state.counters["pct_of_copy"] = 100.0 * tc / ta;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

void BM_append_decode(benchmark::State& state) {
  run_append(state, static_cast<int>(state.range(0)), 1, static_cast<int>(state.range(1)));
}
void BM_append_prefill(benchmark::State& state) {
  run_append(state, 1, static_cast<std::int32_t>(state.range(0)), static_cast<int>(state.range(1)));
}

/// The cost of keeping summaries, measured A/B in one run: two caches, one
/// with summaries and one without, appended alternately (order flipped every
/// iteration) from the same inputs, so clock and thermal drift cancel.
void BM_summary_overhead(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const auto tokens = static_cast<std::int32_t>(state.range(1));
  const std::int64_t per_seq = std::max<std::int64_t>(std::int64_t{tokens} * 4, 8192);
  mr::device_pool_resource device;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kHeads;
  o.head_dim = kDim;
  o.max_sequences = batch;
  o.max_context = per_seq;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> with(device, o);
  o.maintain_summaries = false;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> without(device, o);
  const std::size_t elems = static_cast<std::size_t>(batch) * tokens * kHeads * kDim;
  const std::size_t copies = std::max<std::size_t>(1, (std::size_t{256} << 20) / (2 * elems * sizeof(bf16)));
  gpu_buffers buf(2 * elems * copies);
  std::vector<int> slots(static_cast<std::size_t>(batch));
  for (auto& s : slots) {
    throw_if_error(with.add_sequence(per_seq, s));
    int other = 0;
    throw_if_error(without.add_sequence(per_seq, other));
  }
  std::vector<kv::append_segment> segs;
  for (int i = 0; i < batch; ++i) segs.push_back({slots[i], i * tokens, tokens});
  event_timer timer;
  std::vector<double> t_with, t_without;
  std::size_t it = 0;
  auto append = [&](auto& cache, const bf16* k) {
    if (cache.length(slots[0], 0) + tokens > per_seq)
      for (auto& s : slots) {
        throw_if_error(cache.free_sequence(s));
        throw_if_error(cache.add_sequence(per_seq, s));
      }
    return timer.seconds([&] { throw_if_error(cache.append_async(0, segs, k, k + elems, nullptr)); });
  };
  for (auto _ : state) {
    const bf16* k = buf.src + (it % copies) * 2 * elems;
    if (it % 2 == 0) {
      t_with.push_back(append(with, k));
      t_without.push_back(append(without, k));
    } else {
      t_without.push_back(append(without, k));
      t_with.push_back(append(with, k));
    }
    state.SetIterationTime(t_with.back());
    ++it;
  }
  const double a = median(t_with), b = median(t_without);
  state.counters["with_us"] = a * 1e6;
  state.counters["without_us"] = b * 1e6;
  state.counters["overhead_pct"] = 100.0 * (a / b - 1.0);
}

/// Page pool allocate/free throughput: pages per second through the free
/// list, for a steady state of 8 sequences growing and shrinking.
void BM_page_pool_alloc_free(benchmark::State& state) {
  mr::new_delete_resource host;
  kv::page_pool_options po;
  po.page_bytes = 4096;
  po.chunk_bytes = 1 << 20;
  po.reserve_pages = 1 << 16;
  kv::page_pool<mr::new_delete_resource> pool(host, po);
  const auto batch = static_cast<std::size_t>(state.range(0));
  std::vector<kv::page_id> ids(batch);
  for (auto _ : state) {
    throw_if_error(pool.allocate(ids));
    throw_if_error(pool.deallocate(ids));
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(2 * batch));
}

}  // namespace

BENCHMARK(BM_append_decode)->ArgNames({"B", "summaries"})
    ->ArgsProduct({{1, 8, 32}, {0, 1, 2, 3}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_append_prefill)->ArgNames({"T", "summaries"})
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {0, 1, 2, 3}})->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_summary_overhead)->ArgNames({"B", "T"})
    ->Args({1, 1})->Args({8, 1})->Args({32, 1})->Args({1, 4096})->Args({1, 16384})->Args({1, 65536})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_page_pool_alloc_free)->ArgName("pages")->Arg(1)->Arg(16)->Arg(256);
int main(int argc, char** argv) { return hisparse::bench::run_main(argc, argv, {}, [](const auto&) {}); }
