// The paged KV cache and the decode step as torch ops. A cache is a C++
// object (a memory pool, the paged cache, and the planned sparse_attention_op)
// kept in a registry and named by an integer handle; Python's PagedKVCache
// owns it through the plain C functions at the end (setup and teardown are
// not on the step's path and are never traced). The step ops take the handle
// plus tensors: `lengths` ([sequences, layers] int32, a copy of the cache's
// token counts) is written by the append and read by the decode, so
// torch.compile sees the order between them.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <span>
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
  coarse_summary coarse;
  std::int64_t max_prefill_tokens;  ///< queries a prefill call may hold (0: no prefill)
  int max_prefill_tiles;            ///< the query tiles they can span
  std::int64_t max_host_bytes;      ///< the host tier for offloaded pages (0: none)
};

/// Where a decode step also writes its selection (all three or none):
/// [batch][kv_heads][top_k_fine] slice ids, [batch][kv_heads] counts, [batch] window starts.
struct kept_outputs {
  std::int32_t* slices = nullptr;
  std::int32_t* counts = nullptr;
  std::int32_t* window_begin = nullptr;
};

/// Prefill segments travel to the device as a kernel's parameters: the
/// values are captured with the launch, so a graph replays the segments it
/// was captured with, and no host buffer has to outlive the call.
constexpr int kSegmentsPerLaunch = 64;  // 64 x 20 B, within the 4 KB of parameters every GPU takes
struct segment_batch {
  select::prefill_segment segs[kSegmentsPerLaunch];
};
static_assert(sizeof(segment_batch) + sizeof(void*) + sizeof(int) <= 4096, "the parameters every GPU takes");
__global__ void write_segments(select::prefill_segment* dst, segment_batch batch, int count) {
  if (static_cast<int>(threadIdx.x) < count) dst[threadIdx.x] = batch.segs[threadIdx.x];
}

class cache_base {
 public:
  virtual ~cache_base() = default;
  virtual ScalarType dtype() const = 0;
  virtual int add_sequence(std::int64_t reserved) = 0;
  virtual void free_sequence(int slot, cudaStream_t stream) = 0;
  /// offload_async (to_host) or fetch_async of complete slices.
  virtual void move(int slot, int layer, std::span<const std::int32_t> slices, bool to_host, cudaStream_t stream) = 0;
  virtual std::int64_t host_pages() const = 0;
  virtual std::int64_t length(int slot, int layer) const = 0;
  virtual void append(int layer, const std::vector<kv::append_segment>& segs, const void* k, const void* v,
                      cudaStream_t stream) = 0;
  virtual void decode(preset_id preset, const void* q, const std::int32_t* slots, int batch, int layer, void* out,
                      float* lse, const kept_outputs& kept, cudaStream_t stream) = 0;
  /// segs: slot, q_begin and num_queries set; checked against the stored
  /// lengths and laid out here; q holds their q_rows queries in order.
  virtual void prefill(preset_id preset, std::vector<select::prefill_segment>& segs, int layer, const void* q,
                       std::int64_t q_rows, void* out, float* lse, cudaStream_t stream) = 0;
  virtual const std::int32_t* device_lengths() const = 0;
  virtual bool serves(preset_id id) const = 0;
  virtual bool serves_prefill(preset_id id) const = 0;
  virtual int kept_width(preset_id id) const = 0;  ///< top_k_fine of a served preset
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
    in.max_prefill_tiles = s.max_prefill_tiles;
    throw_if_error(op_.init(in));
    if (s.max_prefill_tiles > 0) segments_.allocate(sizeof(select::prefill_segment) * s.max_sequences);
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
  void move(int slot, int layer, std::span<const std::int32_t> slices, bool to_host, cudaStream_t stream) override {
    throw_if_error(to_host ? cache_.offload_async(slot, layer, slices, stream)
                           : cache_.fetch_async(slot, layer, slices, stream));
  }
  std::int64_t host_pages() const override { return cache_.host_pages_used(); }
  std::int64_t length(int slot, int layer) const override { return cache_.length(slot, layer); }
  void append(int layer, const std::vector<kv::append_segment>& segs, const void* k, const void* v,
              cudaStream_t stream) override {
    check(cache_.append_async(layer, segs, static_cast<const T*>(k), static_cast<const T*>(v), stream), "cache_append");
  }
  void decode(preset_id preset, const void* q, const std::int32_t* slots, int batch, int layer, void* out, float* lse,
              const kept_outputs& kept, cudaStream_t stream) override {
    typename sparse_attention_op<T, pool_t>::forward_arguments f;
    f.preset = preset;
    f.queries = static_cast<const T*>(q);
    f.slots = slots;
    f.batch = batch;
    f.layer = layer;
    f.out = static_cast<T*>(out);
    f.lse = lse;
    check(op_.forward(f, stream), "cache_decode");
    if (kept.slices == nullptr) return;
    const auto& sel = op_.op(preset);
    const std::size_t rows = static_cast<std::size_t>(batch) * shape.kv_heads;
    const std::size_t width = static_cast<std::size_t>(kept_width(preset));
    const auto copy = [&](std::int32_t* dst, const std::int32_t* src, std::size_t n) {
      HISPARSE_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(std::int32_t), cudaMemcpyDeviceToDevice, stream));
    };
    copy(kept.slices, sel.kept_slices(), rows * width);
    copy(kept.counts, sel.num_slices(), rows);
    copy(kept.window_begin, sel.window_begin(), static_cast<std::size_t>(batch));
  }
  void prefill(preset_id preset, std::vector<select::prefill_segment>& segs, int layer, const void* q,
               std::int64_t q_rows, void* out, float* lse, cudaStream_t stream) override {
    STD_TORCH_CHECK(op_.serves_prefill(preset), "hisparse.cache_prefill: this cache has no prefill for the preset",
                    shape.max_prefill_tiles == 0 ? " (made with max_prefill_tokens = 0)" : "");
    STD_TORCH_CHECK(segs.size() <= static_cast<std::size_t>(shape.max_sequences),
                    "hisparse.cache_prefill: at most max_sequences = ", shape.max_sequences, " chunks a call");
    STD_TORCH_CHECK(q_rows <= shape.max_prefill_tokens, "hisparse.cache_prefill: ", q_rows,
                    " queries, more than the cache was made for (max_prefill_tokens = ", shape.max_prefill_tokens, ")");
    std::int32_t max_end = 0;
    for (const auto& g : segs) {
      STD_TORCH_CHECK(g.slot >= 0 && g.slot < shape.max_sequences && cache_.active(g.slot),
                      "hisparse.cache_prefill: slot ", g.slot, " holds no sequence");
      const std::int64_t end = std::int64_t{g.q_begin} + g.num_queries;
      STD_TORCH_CHECK(end <= cache_.length(g.slot, layer), "hisparse.cache_prefill: slot ", g.slot,
                      "'s queries end at token ", end, " but layer ", layer, " stores ", cache_.length(g.slot, layer),
                      " (append a chunk's keys and values before its prefill)");
      max_end = std::max(max_end, static_cast<std::int32_t>(end));
    }
    int tiles = 0;
    check(select::layout_prefill_segments(segs.data(), static_cast<int>(segs.size()), op_.query_tile(preset), tiles),
          "cache_prefill");
    const std::int64_t rows = std::int64_t{segs.back().query_offset} + segs.back().num_queries;
    STD_TORCH_CHECK(rows == q_rows, "hisparse.cache_prefill: the chunks hold ", rows, " queries, q has ", q_rows);
    STD_TORCH_CHECK(tiles <= shape.max_prefill_tiles, "hisparse.cache_prefill: internal: ", tiles,
                    " query tiles past the planned ", shape.max_prefill_tiles);
    for (std::size_t first = 0; first < segs.size(); first += kSegmentsPerLaunch) {
      const int n = static_cast<int>(std::min<std::size_t>(kSegmentsPerLaunch, segs.size() - first));
      segment_batch batch{};
      std::copy_n(segs.begin() + static_cast<std::ptrdiff_t>(first), n, batch.segs);
      write_segments<<<1, kSegmentsPerLaunch, 0, stream>>>(segments_.get() + first, batch, n);
      HISPARSE_CUDA_CHECK(cudaGetLastError());
    }
    typename sparse_attention_op<T, pool_t>::prefill_forward_arguments f;
    f.preset = preset;
    f.queries = static_cast<const T*>(q);
    f.segments = segments_.get();
    f.num_segments = static_cast<int>(segs.size());
    f.num_tiles = tiles;
    f.max_end = max_end;
    f.layer = layer;
    f.out = static_cast<T*>(out);
    f.lse = lse;
    check(op_.forward(f, stream), "cache_prefill");
  }
  const std::int32_t* device_lengths() const override { return cache_.ref().lengths; }
  bool serves(preset_id id) const override { return op_.serves(id); }
  bool serves_prefill(preset_id id) const override { return op_.serves_prefill(id); }
  int kept_width(preset_id id) const override { return op_.op(id).config().top_k_fine; }

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
    o.coarse_summary = s.coarse;
    o.topk_cache_slices = s.topk_cache_slices;
    o.max_host_bytes = static_cast<std::size_t>(s.max_host_bytes);
    return o;
  }

  /// The prefill segments' device buffer, given back to the pool when the
  /// cache goes (a refused free is dropped, as ~paged_kv_cache does: a
  /// destructor cannot report it).
  struct segment_buffer {
    pool_t* pool;
    select::prefill_segment* ptr = nullptr;
    std::size_t bytes = 0;
    void allocate(std::size_t n) {
      ptr = static_cast<select::prefill_segment*>(pool->allocate(n, nullptr));
      bytes = n;
    }
    select::prefill_segment* get() const { return ptr; }
    ~segment_buffer() {
      try {
        if (ptr != nullptr) pool->deallocate(ptr, bytes, nullptr);
      } catch (...) {
      }
    }
  };

  pool_t pool_;  // first: the cache, the op and the segments give their memory back to it
  kv::paged_kv_cache<T, pool_t> cache_;
  sparse_attention_op<T, pool_t> op_;
  segment_buffer segments_{&pool_};  ///< [max_sequences], the last prefill call's layout
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

preset_id preset_named(const std::string& name, const char* op) {
  static const std::vector<std::pair<preset_id, std::string>> presets = preset_registry{}.list();
  for (const auto& [id, n] : presets)
    if (n == name) return id;
  std::string known;
  for (const auto& [id, n] : presets) known += (known.empty() ? "" : ", ") + n;
  STD_TORCH_CHECK(false, "hisparse.", op, ": unknown preset name '", name, "' (known: ", known, ")");
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

/// The checks every decode op makes; returns the preset.
preset_id check_decode(const Tensor& lengths, const cache_base& c, std::int64_t layer, const Tensor& q,
                       const Tensor& slots, const std::string& preset, const char* op) {
  check_lengths(lengths, c, op);
  expect(q, op, "q", 3, c.dtype());
  expect_contiguous(q, op, "q");
  expect_on_cache_device(q, c, op, "q");
  STD_TORCH_CHECK(q.size(1) == c.shape.q_heads && q.size(2) == c.shape.head_dim, "hisparse.", op,
                  ": q must be [batch, q_heads = ", c.shape.q_heads, ", head_dim = ", c.shape.head_dim, "]");
  expect(slots, op, "slots", 1, ScalarType::Int);
  expect_contiguous(slots, op, "slots");
  expect_on_cache_device(slots, c, op, "slots");
  STD_TORCH_CHECK(slots.size(0) == q.size(0), "hisparse.", op, ": one slot per query row");
  STD_TORCH_CHECK(layer >= 0 && layer < c.shape.layers, "hisparse.", op, ": layer ", layer, " outside [0, ",
                  c.shape.layers, ")");
  const preset_id id = preset_named(preset, op);
  STD_TORCH_CHECK(c.serves(id), "hisparse.", op, ": this cache cannot serve preset '", preset,
                  "' (its slice/block sizes or fine summary differ)");
  return id;
}

/// An output tensor the caller passed: its shape, dtype, density and device.
void expect_output(const Tensor& t, const cache_base& c, const char* op, const char* what,
                   std::initializer_list<std::int64_t> sizes, ScalarType type) {
  expect(t, op, what, static_cast<int>(sizes.size()), type);
  expect_contiguous(t, op, what);
  expect_on_cache_device(t, c, op, what);
  int d = 0;
  for (const std::int64_t n : sizes) {
    STD_TORCH_CHECK(t.size(d) == n, "hisparse.", op, ": ", what, "'s dimension ", d, " must be ", n, " (got ",
                    t.size(d), ")");
    ++d;
  }
}

void run_decode(cache_base& c, preset_id id, std::int64_t layer, const Tensor& q, const Tensor& slots, Tensor& out,
                Tensor& lse, const kept_outputs& kept) {
  if (q.size(0) == 0) return;
  torch::stable::accelerator::DeviceGuard guard(c.shape.device);
  c.decode(id, q.data_ptr(), data<const std::int32_t>(slots), static_cast<int>(q.size(0)), static_cast<int>(layer),
           out.data_ptr(), data<float>(lse), kept, current_stream(q));
}

std::tuple<Tensor, Tensor> cache_decode(Tensor lengths, std::int64_t handle, std::int64_t layer, Tensor q, Tensor slots,
                                        std::string preset) {
  cache_base& c = find(handle, "cache_decode");
  const preset_id id = check_decode(lengths, c, layer, q, slots, preset, "cache_decode");
  Tensor out = torch::stable::empty_like(q);
  Tensor lse = torch::stable::new_empty(q, {q.size(0), q.size(1)}, ScalarType::Float);
  run_decode(c, id, layer, q, slots, out, lse, {});
  return {out, lse};
}

void cache_decode_out(Tensor lengths, std::int64_t handle, std::int64_t layer, Tensor q, Tensor slots,
                      std::string preset, Tensor out, Tensor lse) {
  cache_base& c = find(handle, "cache_decode_out");
  const preset_id id = check_decode(lengths, c, layer, q, slots, preset, "cache_decode_out");
  expect_output(out, c, "cache_decode_out", "out", {q.size(0), q.size(1), q.size(2)}, c.dtype());
  expect_output(lse, c, "cache_decode_out", "lse", {q.size(0), q.size(1)}, ScalarType::Float);
  // The step reads q and slots while its CTAs write out and lse (all
  // contiguous, checked above, so a span is its first byte and its size).
  struct span {
    const char* p;
    std::size_t n;
  };
  const std::size_t rows = static_cast<std::size_t>(q.size(0)) * c.shape.q_heads, half = sizeof(std::uint16_t);
  const span q_s{static_cast<const char*>(q.data_ptr()), rows * c.shape.head_dim * half};
  const span slots_s{static_cast<const char*>(slots.data_ptr()), static_cast<std::size_t>(q.size(0)) * 4};
  const span out_s{static_cast<const char*>(out.data_ptr()), q_s.n}, lse_s{static_cast<const char*>(lse.data_ptr()), rows * 4};
  const auto overlap = [](span a, span b) { return a.n > 0 && b.n > 0 && a.p < b.p + b.n && b.p < a.p + a.n; };
  STD_TORCH_CHECK(!overlap(out_s, q_s) && !overlap(out_s, slots_s) && !overlap(lse_s, q_s) &&
                      !overlap(lse_s, slots_s) && !overlap(out_s, lse_s),
                  "hisparse.cache_decode_out: out and lse must not overlap each other, q or slots");
  run_decode(c, id, layer, q, slots, out, lse, {});
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cache_decode_kept(Tensor lengths, std::int64_t handle,
                                                                     std::int64_t layer, Tensor q, Tensor slots,
                                                                     std::string preset) {
  cache_base& c = find(handle, "cache_decode_kept");
  const preset_id id = check_decode(lengths, c, layer, q, slots, preset, "cache_decode_kept");
  const std::int64_t batch = q.size(0), heads = c.shape.kv_heads;
  Tensor out = torch::stable::empty_like(q);
  Tensor lse = torch::stable::new_empty(q, {batch, q.size(1)}, ScalarType::Float);
  Tensor kept = torch::stable::new_empty(q, {batch, heads, c.kept_width(id)}, ScalarType::Int);
  Tensor counts = torch::stable::new_empty(q, {batch, heads}, ScalarType::Int);
  Tensor window = torch::stable::new_empty(q, {batch}, ScalarType::Int);
  run_decode(c, id, layer, q, slots, out, lse,
             {data<std::int32_t>(kept), data<std::int32_t>(counts), data<std::int32_t>(window)});
  return {out, lse, kept, counts, window};
}

std::tuple<Tensor, Tensor> cache_prefill(Tensor lengths, std::int64_t handle, std::int64_t layer, Tensor q,
                                         std::vector<std::int64_t> slots, std::vector<std::int64_t> q_begins,
                                         std::vector<std::int64_t> counts, std::string preset) {
  cache_base& c = find(handle, "cache_prefill");
  check_lengths(lengths, c, "cache_prefill");
  expect(q, "cache_prefill", "q", 3, c.dtype());
  expect_contiguous(q, "cache_prefill", "q");
  expect_on_cache_device(q, c, "cache_prefill", "q");
  STD_TORCH_CHECK(q.size(1) == c.shape.q_heads && q.size(2) == c.shape.head_dim,
                  "hisparse.cache_prefill: q must be [queries, q_heads = ", c.shape.q_heads,
                  ", head_dim = ", c.shape.head_dim, "]");
  STD_TORCH_CHECK(slots.size() == q_begins.size() && slots.size() == counts.size(),
                  "hisparse.cache_prefill: one first position and one query count per sequence");
  STD_TORCH_CHECK(layer >= 0 && layer < c.shape.layers, "hisparse.cache_prefill: layer ", layer, " outside [0, ",
                  c.shape.layers, ")");
  const preset_id id = preset_named(preset, "cache_prefill");
  std::vector<select::prefill_segment> segs(slots.size());
  constexpr std::int64_t kMax = 0x7FFFFFFF;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    STD_TORCH_CHECK(slots[i] >= 0 && slots[i] < c.shape.max_sequences && q_begins[i] >= 0 && q_begins[i] <= kMax &&
                        counts[i] >= 1 && counts[i] <= kMax,
                    "hisparse.cache_prefill: chunk ", i, " (slot ", slots[i], ", first ", q_begins[i], ", queries ",
                    counts[i], ") is out of range");
    segs[i].slot = static_cast<std::int32_t>(slots[i]);
    segs[i].q_begin = static_cast<std::int32_t>(q_begins[i]);
    segs[i].num_queries = static_cast<std::int32_t>(counts[i]);
  }
  Tensor out = torch::stable::empty_like(q);
  Tensor lse = torch::stable::new_empty(q, {q.size(0), q.size(1)}, ScalarType::Float);
  if (segs.empty()) {
    STD_TORCH_CHECK(q.size(0) == 0, "hisparse.cache_prefill: no chunks, but q has ", q.size(0), " queries");
    return {out, lse};
  }
  torch::stable::accelerator::DeviceGuard guard(c.shape.device);
  c.prefill(id, segs, static_cast<int>(layer), q.data_ptr(), q.size(0), out.data_ptr(), data<float>(lse),
            current_stream(q));
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

/// Query tiles a prefill call of `tokens` queries in up to `chunks` chunks
/// can need: each chunk starts on a tile and may end inside one (and holds
/// a query at least).
int prefill_tiles_for(std::int64_t tokens, int chunks) {
  if (tokens == 0) return 0;
  int m = kMaxQueryTile;
  for (const auto& p : kBuiltinPresets) m = std::min(m, p.config.query_tile);
  return static_cast<int>((tokens + m - 1) / m + std::min<std::int64_t>(chunks, tokens));
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
  m.def("cache_decode_out(Tensor lengths, int cache, int layer, Tensor q, Tensor slots, str preset, "
        "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("cache_decode_kept(Tensor lengths, int cache, int layer, Tensor q, Tensor slots, str preset) -> "
        "(Tensor out, Tensor lse, Tensor kept, Tensor kept_counts, Tensor window_begin)");
  m.def("cache_prefill(Tensor lengths, int cache, int layer, Tensor q, int[] slots, int[] q_begins, int[] counts, "
        "str preset) -> (Tensor out, Tensor lse)");
}

STABLE_TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  using namespace hisparse::torch_ops;
  m.impl("cache_append", TORCH_BOX(&cache_append));
  m.impl("cache_decode", TORCH_BOX(&cache_decode));
  m.impl("cache_decode_out", TORCH_BOX(&cache_decode_out));
  m.impl("cache_decode_kept", TORCH_BOX(&cache_decode_kept));
  m.impl("cache_prefill", TORCH_BOX(&cache_prefill));
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
/// coarse_summary: 0 mean, 1 key_bounds.
/// max_prefill_tokens: the most queries one prefill call holds (0: decode only).
/// max_host_bytes: pinned host memory offloaded pages may take (0: none).
__attribute__((visibility("default"))) std::int64_t hisparse_cache_create(
    int device, int dtype, int layers, int kv_heads, int head_dim, int q_heads, int max_sequences,
    std::int64_t max_context, int fine_slice, int coarse_block, int fine_summary, int coarse_summary,
    int topk_cache_slices, std::int64_t max_prefill_tokens, std::int64_t max_host_bytes) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&]() -> std::int64_t {
        if (max_prefill_tokens < 0 || max_prefill_tokens > (std::int64_t{1} << 30))
          throw hisparse::error(hisparse::status::invalid_argument, "max_prefill_tokens must be in [0, 2^30]");
        if (max_host_bytes < 0)
          throw hisparse::error(hisparse::status::invalid_argument, "max_host_bytes must be >= 0");
        const cache_shape s{device,
                            layers,
                            kv_heads,
                            head_dim,
                            q_heads,
                            max_sequences,
                            max_context,
                            fine_slice,
                            coarse_block,
                            topk_cache_slices,
                            static_cast<hisparse::fine_summary>(fine_summary),
                            static_cast<hisparse::coarse_summary>(coarse_summary),
                            max_prefill_tokens,
                            prefill_tiles_for(max_prefill_tokens, max_sequences),
                            max_host_bytes};
        if (!hisparse::is_valid(s.summary)) throw hisparse::error(hisparse::status::invalid_argument, "unknown fine_summary");
        if (!hisparse::is_valid(s.coarse))
          throw hisparse::error(hisparse::status::invalid_argument, "unknown coarse_summary");
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

/// Moves n complete slices of (slot, layer) to the host tier (to_host != 0) or
/// back, stream-ordered on `stream`.
__attribute__((visibility("default"))) int hisparse_cache_move(std::int64_t handle, int slot, int layer,
                                                               const std::int32_t* slices, std::int64_t n,
                                                               int to_host, void* stream) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&] {
        cache_base& c = find(handle, to_host != 0 ? "offload" : "fetch");
        if (n < 0 || (n > 0 && slices == nullptr))
          throw hisparse::error(hisparse::status::invalid_argument, "offload/fetch: bad slice list");
        on_device(c.shape.device, [&] {
          c.move(slot, layer, std::span<const std::int32_t>(slices, static_cast<std::size_t>(n)), to_host != 0,
                 static_cast<cudaStream_t>(stream));
          return 0;
        });
        return 0;
      },
      -1);
}

__attribute__((visibility("default"))) std::int64_t hisparse_cache_host_pages(std::int64_t handle) {
  using namespace hisparse::torch_ops;
  return guarded([&] { return find(handle, "host_pages").host_pages(); }, std::int64_t{-1});
}

/// top_k_fine of a preset the cache serves (the width of its kept slices), else -1.
__attribute__((visibility("default"))) int hisparse_cache_kept_width(std::int64_t handle, const char* preset) {
  using namespace hisparse::torch_ops;
  return guarded(
      [&] {
        const cache_base& c = find(handle, "kept_width");
        const hisparse::preset_id id = preset_named(preset, "kept_width");
        return c.serves(id) ? c.kept_width(id) : -1;
      },
      -1);
}

__attribute__((visibility("default"))) std::int64_t hisparse_cache_length(std::int64_t handle, int slot, int layer) {
  using namespace hisparse::torch_ops;
  return guarded([&] { return find(handle, "length").length(slot, layer); }, std::int64_t{-1});
}

}  // extern "C"
