// model_decode: every layer's decode step replayed from one graph gives, bit
// for bit, what each layer's hierarchical_decode gives run alone; the graph
// follows the cache as it grows (appends between replays, a slice boundary
// crossed) and the queries its hook writes; bad use is refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/runtime/model_decode.cuh"
#include "workload/synthetic.hpp"

using namespace hisparse;
using test::device_buffer;
using bf16 = __nv_bfloat16;

namespace {
constexpr int kLayers = 3, kQHeads = 8, kKvHeads = 2, kDim = 128;

std::vector<bf16> normal_bf16(std::size_t n, workload::splitmix64& rng) {
  std::vector<bf16> x(n);
  for (auto& e : x) e = __float2bfloat16(static_cast<float>(rng.normal()));
  return x;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
}  // namespace

TEST_CASE("model_decode replays every layer's step from one graph", "[gpu][runtime]") {
  HISPARSE_REQUIRE_GPU();
  // Small blocks and slices so that selection really chooses at these lengths.
  const SparseAttentionConfig cfg{128, 256, 32, 4, 8, 64};
  const std::vector<std::int32_t> lengths{3000, 17000, 9001};
  const int batch = static_cast<int>(lengths.size());
  constexpr int kGrowth = 70;  // decode appends between replays: crosses a slice boundary
  mr::device_pool_resource pool;
  kv::paged_kv_cache_options o;
  o.num_layers = kLayers;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.fine_slice = cfg.fine_slice;
  o.coarse_block = cfg.coarse_block;
  o.max_sequences = batch;
  o.max_context = 17000 + kGrowth;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(pool, o);
  workload::splitmix64 rng(11);
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<int> slots;
  for (const auto len : lengths) {
    int slot = -1;
    REQUIRE(cache.add_sequence(o.max_context, slot) == status::success);
    slots.push_back(slot);
    for (int l = 0; l < kLayers; ++l) {  // every layer its own keys and values
      const std::size_t n = static_cast<std::size_t>(len) * kKvHeads * kDim;
      device_buffer<bf16> k(normal_bf16(n, rng)), v(normal_bf16(n, rng));
      REQUIRE(cache.append_async(l, std::vector<kv::append_segment>{{slot, 0, len}}, k.ptr, v.ptr, stream) ==
              status::success);
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }
  const device_buffer<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  const std::size_t per_layer = static_cast<std::size_t>(batch) * kQHeads * kDim;
  const std::size_t lse_per_layer = static_cast<std::size_t>(batch) * kQHeads;
  device_buffer<bf16> staged(per_layer * kLayers), queries(per_layer * kLayers), out(per_layer * kLayers),
      expected_out(per_layer * kLayers);
  device_buffer<float> lse(lse_per_layer * kLayers), expected_lse(lse_per_layer * kLayers);

  model_decode_arguments<bf16> args;
  args.queries = queries.ptr;
  args.slots = d_slots.ptr;
  args.batch = batch;
  args.layers = kLayers;
  args.num_q_heads = kQHeads;
  args.cache = cache.ref();
  args.out = out.ptr;
  args.lse = lse.ptr;
  // The hook stands in for an engine's projections: layer l's queries are
  // written inside the graph, just before layer l's step.
  const model_decode<bf16>::layer_hook write_queries = [&](int l, cudaStream_t s) {
    HISPARSE_CUDA_TRY(cudaMemcpyAsync(queries.ptr + l * per_layer, staged.ptr + l * per_layer,
                                      per_layer * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
    return status::success;
  };

  model_decode<bf16> step(cfg);
  std::size_t bytes = 0;
  REQUIRE(step.workspace_bytes(args, bytes) == status::success);
  device_buffer<char> workspace(bytes);
  staged.upload(normal_bf16(per_layer * kLayers, rng), stream);
  warm_up_times times;
  REQUIRE(step.warm_up(args, workspace.ptr, bytes, stream, write_queries, &times) == status::success);
  CHECK(step.layers() == kLayers);
  CHECK(times.plan_ms >= 0.0);
  CHECK(times.capture_ms > 0.0);

  // Each layer alone, eagerly, on the staged queries: what the graph must give.
  device_buffer<char> alone_workspace(bytes);
  auto check_against_each_layer = [&] {
    out.poison(stream);
    lse.poison(stream);
    REQUIRE(step.replay(stream) == status::success);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    expected_out.poison(stream);
    expected_lse.poison(stream);
    for (int l = 0; l < kLayers; ++l) {
      auto a = args.layer(l);
      a.queries = staged.ptr + l * per_layer;
      a.out = expected_out.ptr + l * per_layer;
      a.lse = expected_lse.ptr + l * lse_per_layer;
      hierarchical_decode<bf16> alone(cfg);
      REQUIRE(alone.plan(a, alone_workspace.ptr, bytes, stream) == status::success);
      REQUIRE(alone.run(stream) == status::success);
      const std::size_t rows = static_cast<std::size_t>(batch) * kKvHeads;
      std::vector<std::int32_t> kept(rows * cfg.top_k_fine), kept_graph(kept.size());
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(kept.data(), alone.kept_slices(), kept.size() * 4, cudaMemcpyDeviceToHost,
                                          stream));
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(kept_graph.data(), step.layer(l).kept_slices(), kept.size() * 4,
                                          cudaMemcpyDeviceToHost, stream));
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      CHECK(kept == kept_graph);  // each layer's kept slices outlive the step
    }
    const auto got = out.download(), want = expected_out.download();
    const auto got_lse = lse.download(), want_lse = expected_lse.download();
    CHECK(same_bits(got, want));
    CHECK(same_bits(got_lse, want_lse));
    bool finite = true;
    for (const float x : got_lse) finite = finite && std::isfinite(x);
    CHECK(finite);  // no poison left: every layer and row written
  };
  check_against_each_layer();

  SECTION("the graph follows appends and new queries") {
    for (int t = 0; t < kGrowth; ++t)
      for (int l = 0; l < kLayers; ++l) {
        const std::size_t n = static_cast<std::size_t>(batch) * kKvHeads * kDim;
        device_buffer<bf16> k(normal_bf16(n, rng)), v(normal_bf16(n, rng));
        REQUIRE(cache.append_decode_async(l, slots, k.ptr, v.ptr, stream) == status::success);
        HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
    staged.upload(normal_bf16(per_layer * kLayers, rng), stream);
    check_against_each_layer();
  }

  SECTION("bad use is refused") {
    auto too_many = args;
    too_many.layers = kLayers + 1;
    CHECK(step.can_implement(too_many) == status::invalid_argument);
    auto none = args;
    none.layers = 0;
    CHECK(step.can_implement(none) == status::invalid_argument);
    model_decode<bf16> fresh(cfg);
    CHECK(fresh.run(stream) == status::invalid_argument);
    CHECK(fresh.replay(stream) == status::invalid_argument);
    CHECK(fresh.capture(stream) == status::invalid_argument);
    CHECK(fresh.plan(args, workspace.ptr, bytes - 1, stream) == status::invalid_argument);
    REQUIRE(fresh.plan(args, workspace.ptr, bytes, stream) == status::success);
    CHECK(fresh.replay(stream) == status::invalid_argument);  // planned, not captured
    CHECK(fresh.capture(nullptr) == status::invalid_argument);
    // A hook's failure ends the capture and is reported; the stream stays usable.
    const model_decode<bf16>::layer_hook failing = [](int l, cudaStream_t) {
      return l == 1 ? status::internal_error : status::success;
    };
    CHECK(fresh.capture(stream, failing) == status::internal_error);
    CHECK(fresh.replay(stream) == status::invalid_argument);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    REQUIRE(step.replay(stream) == status::success);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
