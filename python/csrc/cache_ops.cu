// The paged KV cache and the decode step as torch ops. A cache is a C++
// object (a memory pool, the paged cache, and the planned sparse_attention_op)
// kept in a registry and named by an integer handle; Python's PagedKVCache
// owns it through the plain C functions at the end (setup and teardown are
// not on the step's path and are never traced). The step ops take the handle
// plus tensors: `lengths` ([sequences, layers] int32, a copy of the cache's
// token counts) is written by the append and read by the decode, so
// torch.compile sees the order between them.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <hisparse/kv/paged_kv_cache.cuh>
#include <hisparse/mr/device_pool_resource.hpp>
#include <hisparse/runtime/sparse_attention_op.cuh>

#include "common.hpp"

namespace hisparse::torch_ops {
namespace {

using pool_t = mr::device_pool_resource;

struct cache_shape {
  int device, layers, kv_heads, head_dim, q_heads, max_sequences;
  std::int64_t max_context;
  int fine_slice, coarse_block, topk_cache_slices;
  fine_summary summary;
};

class cache_base {
 public:
  virtual ~cache_base() = default;
  virtual ScalarType dtype() const = 0;
  virtual int add_sequence(std::int64_t reserved) = 0;
  virtual void free_sequence(int slot, cudaStream_t stream) = 0;
  virtual std::int64_t length(int slot, int layer) const = 0;
  virtual void append(int layer, const std::vector<kv::append_segment>& segs, const void* k, const void* v,
                      cudaStream_t stream) = 0;
  virtual void decode(preset_id preset, const void* q, const std::int32_t* slots, int batch, int layer, void* out,
                      float* lse, cudaStream_t stream) = 0;
  virtual const std::int32_t* device_lengths() const = 0;
  virtual bool serves(preset_id id) const = 0;
  cache_shape shape{};
};

template <class T>
class cache_impl final : public cache_base {
 public:
  explicit cache_impl(const cache_shape& s)
      : pool_(s.device), cache_(pool_, options(s)) {
    shape = s;
    typename sparse_attention_op<T, pool_t>::init_arguments in;
    in.resource = &pool_;
    in.cache = cache_.ref();
    in.max_batch = s.max_sequences;
    in.num_q_heads = s.q_heads;
    throw_if_error(op_.init(in));
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the cache's and the op's zeroing are done
  }
  ScalarType dtype() const override {
    return std::is_same_v<T, __nv_bfloat16> ? ScalarType::BFloat16 : ScalarType::Half;
  }
  int add_sequence(std::int64_t reserved) override {
    int slot = -1;
    throw_if_error(cache_.add_sequence(reserved, slot));
    return slot;
  }
  void free_sequence(int slot, cudaStream_t stream) override { throw_if_error(cache_.free_sequence(slot, stream)); }
  std::int64_t length(int slot, int layer) const override { return cache_.length(slot, layer); }
  void append(int layer, const std::vector<kv::append_segment>& segs, const void* k, const void* v,
              cudaStream_t stream) override {
    check(cache_.append_async(layer, segs, static_cast<const T*>(k), static_cast<const T*>(v), stream), "cache_append");
  }
  void decode(preset_id preset, const void* q, const std::int32_t* slots, int batch, int layer, void* out, float* lse,
              cudaStream_t stream) override {
    typename sparse_attention_op<T, pool_t>::forward_arguments f;
    f.preset = preset;
    f.queries = static_cast<const T*>(q);
    f.slots = slots;
    f.batch = batch;
    f.layer = layer;
    f.out = static_cast<T*>(out);
    f.lse = lse;
    check(op_.forward(f, stream), "cache_decode");
  }
  const std::int32_t* device_lengths() const override { return cache_.ref().lengths; }
  bool serves(preset_id id) const override { return op_.serves(id); }

 private:
  static kv::paged_kv_cache_options options(const cache_shape& s) {
    kv::paged_kv_cache_options o;
    o.num_layers = s.layers;
    o.num_kv_heads = s.kv_heads;
    o.head_dim = s.head_dim;
    o.fine_slice = s.fine_slice;
    o.coarse_block = s.coarse_block;
    o.max_sequences = s.max_sequences;
    o.max_context = s.max_context;
    o.fine_summary = s.summary;
    o.topk_cache_slices = s.topk_cache_slices;
    return o;
  }

  pool_t pool_;  // first: the cache and the op give their memory back to it
  kv::paged_kv_cache<T, pool_t> cache_;
  sparse_attention_op<T, pool_t> op_;
};

struct registry {
  std::mutex mutex;
  std::map<std::int64_t, std::unique_ptr<cache_base>> caches;
  std::int64_t next = 1;
};

registry& caches() {
  // Never destroyed: caches still open at exit are left to the process's
  // end, not freed by a static destructor after the CUDA runtime is gone.
  static registry* r = new registry;
  return *r;
}

cache_base& find(std::int64_t handle, const char* op) {
  registry& r = caches();
  const std::lock_guard lock(r.mutex);
  const auto it = r.caches.find(handle);
  STD_TORCH_CHECK(it != r.caches.end(), "hisparse.", op, ": no cache with handle ", handle, " (closed?)");
  return *it->second;
}

preset_id preset_named(const std::string& name) {
  static const std::vector<std::pair<preset_id, std::string>> presets = preset_registry{}.list();
  for (const auto& [id, n] : presets)
    if (n == name) return id;
  std::string known;
  for (const auto& [id, n] : presets) known += (known.empty() ? "" : ", ") + n;
  STD_TORCH_CHECK(false, "hisparse.cache_decode: unknown preset name '", name, "' (known: ", known, ")");
  return preset_id::standard;
}

void expect_on_cache_device(const Tensor& t, const cache_base& c, const char* op, const char* what) {
  STD_TORCH_CHECK(t.is_cuda() && t.get_device_index() == c.shape.device, "hisparse.", op, ": ", what,
                  " must be on cuda:", c.shape.device, ", the cache's device");
}

void copy_lengths(const cache_base& c, Tensor& lengths, cudaStream_t stream) {
  const std::size_t bytes = sizeof(std::int32_t) * static_cast<std::size_t>(c.shape.max_sequences) * c.shape.layers;
  HISPARSE_CUDA_CHECK(cudaMemcpyAsync(lengths.data_ptr(), c.device_lengths(), bytes, cudaMemcpyDeviceToDevice, stream));
}

void check_lengths(const Tensor& lengths, const cache_base& c, const char* op) {
  expect(lengths, op, "lengths", 2, ScalarType::Int);
  expect_contiguous(lengths, op, "lengths");
  STD_TORCH_CHECK(lengths.size(0) == c.shape.max_sequences && lengths.size(1) == c.shape.layers, "hisparse.", op,
                  ": lengths must be [max_sequences, layers] = [", c.shape.max_sequences, ", ", c.shape.layers, "]");
  expect_on_cache_device(lengths, c, op, "lengths");
}

void cache_append(Tensor lengths, std::int64_t handle, std::int64_t layer, std::vector<std::int64_t> slots,
                  std::vector<std::int64_t> counts, Tensor k, Tensor v) {
  cache_base& c = find(handle, "cache_append");
  check_lengths(lengths, c, "cache_append");
  for (const Tensor* t : {&k, &v}) {
    const char* what = t == &k ? "k" : "v";
    expect(*t, "cache_append", what, 3, c.dtype());
    expect_contiguous(*t, "cache_append", what);
    expect_on_cache_device(*t, c, "cache_append", what);
    STD_TORCH_CHECK(t->size(1) == c.shape.kv_heads && t->size(2) == c.shape.head_dim, "hisparse.cache_append: ", what,
                    " must be [rows, kv_heads = ", c.shape.kv_heads, ", head_dim = ", c.shape.head_dim, "]");
  }
  STD_TORCH_CHECK(k.size(0) == v.size(0), "hisparse.cache_append: k and v must have the same rows");
  STD_TORCH_CHECK(slots.size() == counts.size(), "hisparse.cache_append: one row count per sequence");
  std::vector<kv::append_segment> segs;
  std::int64_t row = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    STD_TORCH_CHECK(counts[i] >= 1 && counts[i] <= (std::int64_t{1} << 30), "hisparse.cache_append: row counts must be in [1, 2^30]");
    segs.push_back({static_cast<int>(slots[i]), static_cast<std::int32_t>(row), static_cast<std::int32_t>(counts[i])});
    row += counts[i];
    STD_TORCH_CHECK(row <= (std::int64_t{1} << 31) - 1, "hisparse.cache_append: more than 2^31 - 1 rows");
  }
  STD_TORCH_CHECK(row == k.size(0), "hisparse.cache_append: the row counts add up to ", row, ", k has ", k.size(0),
                  " rows");
  STD_TORCH_CHECK(layer >= 0 && layer < c.shape.layers, "hisparse.cache_append: layer ", layer, " outside [0, ",
                  c.shape.layers, ")");
  torch::stable::accelerator::DeviceGuard guard(c.shape.device);
  const cudaStream_t stream = current_stream(k);
  c.append(static_cast<int>(layer), segs, k.data_ptr(), v.data_ptr(), stream);
  copy_lengths(c, lengths, stream);
}

std::tuple<Tensor, Tensor> cache_decode(Tensor lengths, std::int64_t handle, std::int64_t layer, Tensor q, Tensor slots,
                                        std::string preset) {
  cache_base& c = find(handle, "cache_decode");
  check_lengths(lengths, c, "cache_decode");
  expect(q, "cache_decode", "q", 3, c.dtype());
  expect_contiguous(q, "cache_decode", "q");
  expect_on_cache_device(q, c, "cache_decode", "q");
  STD_TORCH_CHECK(q.size(1) == c.shape.q_heads && q.size(2) == c.shape.head_dim,
                  "hisparse.cache_decode: q must be [batch, q_heads = ", c.shape.q_heads,
                  ", head_dim = ", c.shape.head_dim, "]");
  expect(slots, "cache_decode", "slots", 1, ScalarType::Int);
  expect_contiguous(slots, "cache_decode", "slots");
  expect_on_cache_device(slots, c, "cache_decode", "slots");
  STD_TORCH_CHECK(slots.size(0) == q.size(0), "hisparse.cache_decode: one slot per query row");
  const preset_id id = preset_named(preset);
  STD_TORCH_CHECK(c.serves(id), "hisparse.cache_decode: this cache cannot serve preset '", preset,
                  "' (its slice/block sizes or fine summary differ)");
  Tensor out = torch::stable::empty_like(q);
  Tensor lse = torch::stable::new_empty(q, {q.size(0), q.size(1)}, ScalarType::Float);
  if (q.size(0) == 0) return {out, lse};
  torch::stable::accelerator::DeviceGuard guard(c.shape.device);
  c.decode(id, q.data_ptr(), data<const std::int32_t>(slots), static_cast<int>(q.size(0)), static_cast<int>(layer),
           out.data_ptr(), data<float>(lse), current_stream(q));
  return {out, lse};
}

thread_local std::string c_api_error;

template <class F>
std::invoke_result_t<F&> guarded(F&& f, std::invoke_result_t<F&> on_error) noexcept {
  try {
    return f();
  } catch (const std::exception& e) {
    c_api_error = e.what();
  } catch (...) {
    c_api_error = "unknown error";
  }
  return on_error;
}

/// Runs f with `device` current, restoring the caller's device after.
template <class F>
auto on_device(int device, F&& f) {
  int previous = 0;
  HISPARSE_CUDA_CHECK(cudaGetDevice(&previous));
  HISPARSE_CUDA_CHECK(cudaSetDevice(device));
  struct restore {
    int d;
    ~restore() { (void)cudaSetDevice(d); }
  } r{previous};
  return f();
}

}  // namespace
}  // namespace hisparse::torch_ops

STABLE_TORCH_LIBRARY_FRAGMENT(hisparse, m) {
  m.def("cache_append(Tensor(a!) lengths, int cache, int layer, int[] slots, int[] counts, Tensor k, Tensor v) -> ()");
  m.def("cache_decode(Tensor lengths, int cache, int layer, Tensor q, Tensor slots, str preset) -> "
        "(Tensor out, Tensor lse)");
}

STABLE_TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  using namespace hisparse::torch_ops;
  m.impl("cache_append", TORCH_BOX(&cache_append));
  m.impl("cache_decode", TORCH_BOX(&cache_decode));
}

// ---- the C interface PagedKVCache (python/hisparse/cache.py) calls --------------
// Each returns a negative value (or null) on failure; hisparse_last_error()
// then says why.
using hisparse::torch_ops::caches;
using hisparse::torch_ops::guarded;

extern "C" {

__attribute__((visibility("default"))) const char* hisparse_last_error() {
  return hisparse::torch_ops::c_api_error.c_str();
}

/// dtype: 0 bfloat16, 1 float16. fine_summary: 0 mean, 1 mean_bf16, 2 key_bounds.
__attribute__((visibility("default"))) std::int64_t hisparse_cache_create(
    int device, int dtype, int layers, int kv_heads, int head_dim, int q_heads, int max_sequences,
    std::int64_t max_context, int fine_slice, int coarse_block, int fine_summary, int topk_cache_slices) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&]() -> std::int64_t {
        const cache_shape s{device,     layers,           kv_heads,          head_dim,
                            q_heads,    max_sequences,    max_context,       fine_slice,
                            coarse_block, topk_cache_slices, static_cast<hisparse::fine_summary>(fine_summary)};
        if (!hisparse::is_valid(s.summary)) throw hisparse::error(hisparse::status::invalid_argument, "unknown fine_summary");
        if (q_heads < 1 || q_heads % kv_heads != 0)
          throw hisparse::error(hisparse::status::invalid_argument, "q_heads must be a positive multiple of kv_heads");
        std::unique_ptr<cache_base> c = on_device(device, [&]() -> std::unique_ptr<cache_base> {
          if (dtype == 0) return std::make_unique<cache_impl<__nv_bfloat16>>(s);
          if (dtype == 1) return std::make_unique<cache_impl<__half>>(s);
          throw hisparse::error(hisparse::status::invalid_argument, "the cache stores bfloat16 or float16");
        });
        registry& r = caches();
        const std::lock_guard lock(r.mutex);
        const std::int64_t h = r.next++;
        r.caches.emplace(h, std::move(c));
        return h;
      },
      -1);
}

__attribute__((visibility("default"))) int hisparse_cache_destroy(std::int64_t handle) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&] {
        std::unique_ptr<cache_base> c;
        {
          registry& r = caches();
          const std::lock_guard lock(r.mutex);
          const auto it = r.caches.find(handle);
          if (it == r.caches.end()) throw hisparse::error(hisparse::status::invalid_argument, "no such cache");
          c = std::move(it->second);
          r.caches.erase(it);
        }
        on_device(c->shape.device, [&] { c.reset(); return 0; });  // waits for the cache's last work
        return 0;
      },
      -1);
}

__attribute__((visibility("default"))) int hisparse_cache_add_sequence(std::int64_t handle, std::int64_t reserved) {
  using namespace hisparse::torch_ops;
  return guarded([&] { return find(handle, "add_sequence").add_sequence(reserved); }, -1);
}

__attribute__((visibility("default"))) int hisparse_cache_free_sequence(std::int64_t handle, int slot, void* stream) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&] {
        cache_base& c = find(handle, "free_sequence");
        on_device(c.shape.device, [&] { c.free_sequence(slot, static_cast<cudaStream_t>(stream)); return 0; });
        return 0;
      },
      -1);
}

__attribute__((visibility("default"))) std::int64_t hisparse_cache_length(std::int64_t handle, int slot, int layer) {
  using namespace hisparse::torch_ops;
  return guarded([&] { return find(handle, "length").length(slot, layer); }, std::int64_t{-1});
}

}  // extern "C"
