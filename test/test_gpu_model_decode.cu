// model_decode: every layer's decode step replayed from one graph gives, bit
// for bit, what each layer's hierarchical_decode gives run alone; the graph
// follows the cache as it grows (appends between replays, a slice boundary
// crossed) and the queries its hook writes; bad use is refused. The
// two-stage layer pipeline, its stages on two streams of one device, gives
// what the same stages give run one after another.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/runtime/layer_pipeline.cuh"
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

/// A cache of `layers` layers for `sequences` sequences of up to `context`
/// tokens, with cfg's slice and block sizes.
kv::paged_kv_cache_options cache_options(const SparseAttentionConfig& cfg, int layers, int sequences,
                                         std::int32_t context) {
  kv::paged_kv_cache_options o;
  o.num_layers = layers;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.fine_slice = cfg.fine_slice;
  o.coarse_block = cfg.coarse_block;
  o.max_sequences = sequences;
  o.max_context = context;
  return o;
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
  const auto o = cache_options(cfg, kLayers, batch, 17000 + kGrowth);
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

TEST_CASE("layer_pipeline: two stages on two streams equal the stages run in turn", "[gpu][runtime][pipeline]") {
  HISPARSE_REQUIRE_GPU();
  const SparseAttentionConfig cfg{128, 256, 32, 4, 8, 64};
  const std::vector<std::int32_t> lengths{3000, 9001};
  const int batch = static_cast<int>(lengths.size());
  constexpr int kStageLayers = 2, kSteps = 5;
  mr::device_pool_resource pool;
  workload::splitmix64 rng(23);
  cudaStream_t streams[5] = {};
  for (auto& s : streams) HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const cudaStream_t serial = streams[4];

  // Each stage its own cache (its own layers), as on its own device.
  const auto o = cache_options(cfg, kStageLayers, batch, 9001);
  using cache_t = kv::paged_kv_cache<bf16, mr::device_pool_resource>;
  cache_t cache0(pool, o), cache1(pool, o);
  std::vector<int> slots;
  for (const auto len : lengths) {
    int s0 = -1, s1 = -1;
    REQUIRE(cache0.add_sequence(o.max_context, s0) == status::success);
    REQUIRE(cache1.add_sequence(o.max_context, s1) == status::success);
    REQUIRE(s0 == s1);
    slots.push_back(s0);
    for (cache_t* c : {&cache0, &cache1})
      for (int l = 0; l < kStageLayers; ++l) {
        const std::size_t n = static_cast<std::size_t>(len) * kKvHeads * kDim;
        device_buffer<bf16> k(normal_bf16(n, rng)), v(normal_bf16(n, rng));
        REQUIRE(c->append_async(l, std::vector<kv::append_segment>{{s0, 0, len}}, k.ptr, v.ptr, serial) ==
                status::success);
        HISPARSE_CUDA_CHECK(cudaStreamSynchronize(serial));
      }
  }
  const device_buffer<std::int32_t> d_slots(std::vector<std::int32_t>(slots.begin(), slots.end()));
  const std::size_t per_layer = static_cast<std::size_t>(batch) * kQHeads * kDim;
  const std::size_t hidden = per_layer * sizeof(bf16);
  const auto initial = normal_bf16(per_layer * kStageLayers, rng);
  device_buffer<bf16> q0(initial), q1(normal_bf16(per_layer * kStageLayers, rng)), out0(per_layer * kStageLayers),
      out1(per_layer * kStageLayers);

  auto arguments = [&](const cache_t& c, bf16* q, bf16* out) {
    model_decode_arguments<bf16> a;
    a.queries = q;
    a.slots = d_slots.ptr;
    a.batch = batch;
    a.layers = kStageLayers;
    a.num_q_heads = kQHeads;
    a.cache = c.ref();
    a.out = out;
    return a;
  };
  const auto a0 = arguments(cache0, q0.ptr, out0.ptr), a1 = arguments(cache1, q1.ptr, out1.ptr);
  model_decode<bf16> stage0(cfg), stage1(cfg);
  std::size_t bytes = 0;
  REQUIRE(stage0.workspace_bytes(a0, bytes) == status::success);
  device_buffer<char> w0(bytes), w1(bytes);
  REQUIRE(stage0.warm_up(a0, w0.ptr, bytes, streams[0]) == status::success);
  REQUIRE(stage1.warm_up(a1, w1.ptr, bytes, streams[2]) == status::success);

  // Stage 0's last output is stage 1's first query; stage 1's last output is
  // stage 0's next first query.
  pipeline_transfer forward{out0.ptr + per_layer * (kStageLayers - 1), q1.ptr, hidden, nullptr};
  pipeline_transfer feedback{out1.ptr + per_layer * (kStageLayers - 1), q0.ptr, hidden, nullptr};

  // What kSteps steps give, each piece after the last on one stream.
  q0.upload(initial, serial);
  for (int t = 0; t < kSteps; ++t) {
    REQUIRE(stage0.replay(serial) == status::success);
    HISPARSE_CUDA_CHECK(cudaMemcpyAsync(forward.dst, forward.src, hidden, cudaMemcpyDeviceToDevice, serial));
    REQUIRE(stage1.replay(serial) == status::success);
    HISPARSE_CUDA_CHECK(cudaMemcpyAsync(feedback.dst, feedback.src, hidden, cudaMemcpyDeviceToDevice, serial));
  }
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(serial));
  const auto want0 = out0.download(), want1 = out1.download();
  bool finite = true;
  for (const bf16 x : want1) finite = finite && std::isfinite(__bfloat162float(x));
  REQUIRE(finite);

  mr::pinned_host_resource pinned;
  for (const bool staged : {false, true}) {
    INFO((staged ? "staged through pinned host memory" : "direct copies"));
    void* host_f = staged ? pinned.allocate(hidden, nullptr) : nullptr;
    void* host_b = staged ? pinned.allocate(hidden, nullptr) : nullptr;
    forward.host = host_f;
    feedback.host = host_b;
    q0.upload(initial, serial);
    out0.poison(serial);
    out1.poison(serial);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(serial));
    layer_pipeline<bf16> pipe;
    REQUIRE(pipe.plan({0, &stage0, streams[0], streams[1]}, {0, &stage1, streams[2], streams[3]}, forward,
                      feedback) == status::success);
    for (int t = 0; t < kSteps; ++t) REQUIRE(pipe.step() == status::success);  // no host wait between steps
    REQUIRE(pipe.synchronize() == status::success);
    CHECK(pipe.steps() == kSteps);
    CHECK(same_bits(out0.download(), want0));
    CHECK(same_bits(out1.download(), want1));
    if (staged) {
      pinned.deallocate(host_f, hidden, nullptr);
      pinned.deallocate(host_b, hidden, nullptr);
    }
  }

  SECTION("bad plans are refused") {
    layer_pipeline<bf16> pipe;
    CHECK(pipe.step() == status::invalid_argument);
    model_decode<bf16> unplanned(cfg);
    CHECK(pipe.plan({0, &unplanned, streams[0], streams[1]}, {0, &stage1, streams[2], streams[3]}, forward) ==
          status::invalid_argument);
    CHECK(pipe.plan({0, &stage0, streams[0], streams[0]}, {0, &stage1, streams[2], streams[3]}, forward) ==
          status::invalid_argument);
    CHECK(pipe.plan({0, &stage0, streams[0], streams[1]}, {0, &stage1, streams[0], streams[3]}, forward) ==
          status::invalid_argument);
    CHECK(pipe.plan({0, &stage0, streams[0], streams[1]}, {0, &stage1, streams[2], streams[3]}, {}) ==
          status::invalid_argument);
    CHECK(pipe.plan({0, &stage0, streams[0], streams[1]}, {0, &stage1, streams[2], streams[3]},
                    {nullptr, q1.ptr, hidden, nullptr}) == status::invalid_argument);
    CHECK(pipe.step() == status::invalid_argument);  // still unplanned
  }
  for (auto& s : streams) HISPARSE_CUDA_CHECK(cudaStreamDestroy(s));
}
