// A GPU decode step from outside the library: a memory pool, a paged KV
// cache, a prompt appended, and the composed sparse step with this program's
// own selection policy and attention tile, beside the dense step on the same
// cache. Without a CUDA device it says so and exits 0.
#include <cmath>
#include <cstdio>
#include <vector>

#include <hisparse/kv/paged_kv_cache.cuh>
#include <hisparse/mr/device_pool_resource.hpp>
#include <hisparse/policy/selection_policy.hpp>
#include <hisparse/runtime/hierarchical_attention.cuh>

using namespace hisparse;
using bf16 = __nv_bfloat16;

// 32-token slices in 512-token blocks; keep 16 blocks, then 8 slices, and a
// 256-token window. Its rules are checked at compile time.
using my_policy = selection_policy<SparseAttentionConfig{256, 512, 32, 16, 8, 64}>;
// 32 rows of K/V a stage (16 a warp, 2 warps), 4 stages in flight.
inline constexpr tile_policy my_tile{1, 32, 2, 4};

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("consumer_decode: no GPU: skipped\n");
    return 0;
  }
  constexpr int kBatch = 4, kQHeads = 32, kKvHeads = 8, kDim = 128, kPrompt = 20000;
  mr::device_pool_resource pool;
  kv::paged_kv_cache_options o;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kDim;
  o.fine_slice = my_policy::kFineSlice;
  o.coarse_block = my_policy::kCoarseBlock;
  o.max_sequences = kBatch;
  o.max_context = kPrompt;
  kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(pool, o);

  // One prompt's K and V (the same for every sequence here), and the queries.
  std::vector<bf16> kv_host(std::size_t{kPrompt} * kKvHeads * kDim), q_host(std::size_t{kBatch} * kQHeads * kDim);
  unsigned seed = 1;
  auto uniform = [&] { return static_cast<float>((seed = seed * 1664525u + 1013904223u) >> 8) * 0x1p-24f - 0.5f; };
  for (auto& x : kv_host) x = __float2bfloat16(uniform());
  for (auto& x : q_host) x = __float2bfloat16(4.0f * uniform());
  const std::size_t out_bytes = q_host.size() * sizeof(bf16);
  auto* kv_dev = static_cast<bf16*>(pool.allocate(kv_host.size() * sizeof(bf16), nullptr));
  auto* q_dev = static_cast<bf16*>(pool.allocate(out_bytes, nullptr));
  auto* out_dev = static_cast<bf16*>(pool.allocate(2 * out_bytes, nullptr));
  auto* slots_dev = static_cast<std::int32_t*>(pool.allocate(kBatch * sizeof(std::int32_t), nullptr));
  HISPARSE_CUDA_CHECK(cudaMemcpy(kv_dev, kv_host.data(), kv_host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  HISPARSE_CUDA_CHECK(cudaMemcpy(q_dev, q_host.data(), out_bytes, cudaMemcpyHostToDevice));
  std::vector<std::int32_t> slots(kBatch);
  for (auto& s : slots) {
    int slot = 0;
    throw_if_error(cache.add_sequence(kPrompt, slot));
    throw_if_error(cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, kPrompt}}, kv_dev, kv_dev));
    s = slot;
  }
  HISPARSE_CUDA_CHECK(cudaMemcpy(slots_dev, slots.data(), kBatch * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  // Plan once (sizes, checks, workspace), run as often as wanted (capturable).
  decode_step_arguments<bf16> args{q_dev, slots_dev, kBatch, 0, kQHeads, cache.ref(), out_dev};
  hierarchical_attention<my_policy, my_tile> sparse;
  dense_decode<bf16, my_tile> dense;
  std::size_t sparse_bytes = 0, dense_bytes = 0;
  throw_if_error(sparse.workspace_bytes(args, sparse_bytes));
  auto dense_args = args;
  dense_args.out = out_dev + q_host.size();
  throw_if_error(dense.workspace_bytes(dense_args, dense_bytes));
  void* sparse_ws = pool.allocate(sparse_bytes, nullptr);
  void* dense_ws = pool.allocate(dense_bytes, nullptr);
  throw_if_error(sparse.plan(args, sparse_ws, sparse_bytes));
  throw_if_error(dense.plan(dense_args, dense_ws, dense_bytes));
  throw_if_error(sparse.run());
  throw_if_error(dense.run());
  std::vector<bf16> out(2 * q_host.size());
  HISPARSE_CUDA_CHECK(cudaMemcpy(out.data(), out_dev, out.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < q_host.size(); ++i) {
    const double s = __bfloat162float(out[i]), d = __bfloat162float(out[q_host.size() + i]);
    diff = std::fmax(diff, std::fabs(s - d));
    norm = std::fmax(norm, std::fabs(d));
  }
  std::printf("consumer_decode: %d x %d tokens, sparse vs dense: max |diff| %.3g of max |out| %.3g\n", kBatch,
              kPrompt, diff, norm);
  pool.deallocate(kv_dev, kv_host.size() * sizeof(bf16), nullptr);  // before the pool goes
  pool.deallocate(q_dev, out_bytes, nullptr);
  pool.deallocate(out_dev, 2 * out_bytes, nullptr);
  pool.deallocate(slots_dev, kBatch * sizeof(std::int32_t), nullptr);
  pool.deallocate(sparse_ws, sparse_bytes, nullptr);
  pool.deallocate(dense_ws, dense_bytes, nullptr);
  return std::isfinite(diff) && std::isfinite(norm) ? 0 : 1;
}
