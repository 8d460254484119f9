// HiSparse demo: hierarchical sparse attention on a synthetic long-context
// decode workload (DESIGN.md section 1, the 7B GQA model's shapes).
//
// With a GPU: a batch of requests (8 by default) per context length in a
// paged bf16 KV cache; one decode step of the sparse operator (selection +
// attention, replayed from a CUDA graph) against the dense baseline (the same
// attention kernel over every token) on the same cache: per-step latency,
// speed-up, tokens attended per query, attention-mass recall (exp(lse_sparse
// - lse_dense): the dense softmax mass of the attended tokens) and the
// output's relative error against dense.
// Then the prefill of request 0's whole prompt: the composed sparse prefill
// (selection + attention) against the dense causal attention, timed with
// the prompt's own keys as its queries (query head h taking KV head h / G's);
// the mass recall over its last query tile, whose queries are the
// workload's (it anchors recency and needles at the prompt's end, so the
// earlier positions do not have its statistics).
// Without a GPU (or with --cpu): the fp64 CPU reference of the decode step,
// per context (a whole-prompt prefill is too long for it).
//
// --ceiling (CPU, either way): how close that recall is to what any
// selection of the same budget could reach on this workload. For each
// request (query i at position T - 1, as above) and KV head, from the
// per-token dense softmax masses of the group's query heads:
//   selection  the mass on the window plus the preset's kept slices
//              (reference::decode): the demo's mass recall;
//   slices     the window plus the top_k_fine far slices of most group mass:
//              the most any selection of whole slices can reach;
//   tokens     the most massive N tokens of each query head, N = what the
//              selection attends: the most any selection of N tokens can.
// --misses adds, per request and KV head, every far slice the selection
// left out that holds more than ten times the group mass of the least it
// kept, with the workload's needle tokens in each.
//
// --coarse key_bounds scores blocks by their far keys' ranges instead of
// their means (config.hpp, coarse_summary; with a GPU, decode only: the
// prefill rows are left out);
// --needle-span N makes the workload's needles N tokens long (32).
//
// --stream STEPS (CPU): a TopK cache study. Request 0 decodes STEPS steps
// whose queries drift slowly (the workload's drift_steps, --drift N, 16);
// per step and KV head a refresh rule either selects afresh or reuses its
// cached selection (reference::reused_selection); a rule "a step late"
// attends the entry as it stood before the step's verdict. Per rule: the
// share of (step, KV head) pairs that attended a cached selection, and the
// mass recall against selecting afresh every step. --retain N,... adds
// retention at those far-block budgets (runtime/retention.hpp): after each
// step the policy observes what the step kept and drops far blocks down to
// N; a step selects over the resident blocks only (reference::decode with
// the evicted blocks). Per budget: the far blocks resident at the end, and
// the mass recall against selecting afresh over every block.
//
//   hisparse_demo [--contexts 32768,262144] [--batch 8] [--seed N] [--preset standard] [--cpu]
//                 [--ceiling] [--misses] [--coarse mean|key_bounds] [--needle-span N]
//                 [--stream STEPS [--drift N] [--retain N,...]]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/config.hpp"
#include "hisparse/kv/paged_kv_cache.cuh"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/reference/sparse_attention.hpp"
#include "hisparse/runtime/hierarchical_attention.cuh"
#include "hisparse/runtime/hierarchical_prefill.cuh"
#include "hisparse/runtime/retention.hpp"
#include "workload/synthetic.hpp"

namespace {

struct options {
  std::vector<std::int64_t> contexts;  // default: 8K-128K on the CPU, 32K-256K on a GPU
  int batch = 8;
  std::uint64_t seed = 2026;
  std::string preset = "standard";
  bool cpu = false;
  bool ceiling = false;  // the recall ceilings instead of a step
  bool misses = false;   // and the slices the selection missed
  std::string coarse;    // coarse_summary by name; empty: the preset's
  int needle_span = 0;   // tokens per needle; 0: the workload's default
  int stream = 0;        // > 0: the TopK cache study over this many decode steps
  int drift = 16;        // the stream's drift_steps
  std::vector<std::int64_t> retain;  // the stream study's retention budgets (far blocks)
};

/// The workload of one context: its length, the model's shape, the run's
/// seed and needle span (the caller sets how many queries).
hisparse::workload::synthetic_options workload_options(const options& opt, const hisparse::attention_shape& shape,
                                                       std::int64_t ctx) {
  hisparse::workload::synthetic_options wo;
  wo.context = ctx;
  wo.shape = shape;
  wo.seed = opt.seed + static_cast<std::uint64_t>(ctx);
  if (opt.needle_span > 0) wo.needle_span = opt.needle_span;
  return wo;
}

/// "a,b,c" as numbers.
std::vector<std::int64_t> parse_list(const std::string& list) {
  std::vector<std::int64_t> v;
  for (std::size_t pos = 0; pos <= list.size();) {
    const std::size_t comma = std::min(list.find(',', pos), list.size());
    v.push_back(std::stoll(list.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return v;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--contexts" && has_value) {
      o.contexts = parse_list(argv[++i]);
    } else if (arg == "--seed" && has_value) {
      o.seed = std::stoull(argv[++i]);
    } else if (arg == "--preset" && has_value) {
      o.preset = argv[++i];
    } else if (arg == "--batch" && has_value) {
      o.batch = std::stoi(argv[++i]);
    } else if (arg == "--cpu") {
      o.cpu = true;
    } else if (arg == "--ceiling") {
      o.ceiling = true;
    } else if (arg == "--misses") {
      o.ceiling = o.misses = true;
    } else if (arg == "--coarse" && has_value) {
      o.coarse = argv[++i];
    } else if (arg == "--needle-span" && has_value) {
      o.needle_span = std::stoi(argv[++i]);
    } else if (arg == "--stream" && has_value) {
      o.stream = std::stoi(argv[++i]);
    } else if (arg == "--drift" && has_value) {
      o.drift = std::stoi(argv[++i]);
    } else if (arg == "--retain" && has_value) {
      o.retain = parse_list(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--contexts 8192,32768] [--batch N] [--seed N] [--preset NAME] [--cpu] [--ceiling] "
                   "[--misses] [--coarse mean|key_bounds] [--needle-span N] [--stream STEPS [--drift N] [--retain N,...]]\n",
                   argv[0]);
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

template <class T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n) { HISPARSE_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T))); }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  void upload(const T* host, std::size_t n) {
    HISPARSE_CUDA_CHECK(cudaMemcpy(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(std::size_t n) const {
    std::vector<T> h(n);
    HISPARSE_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void run_cpu(const options& opt, const hisparse::SparseAttentionConfig& cfg, const hisparse::attention_shape& shape) {
  using namespace hisparse;
  std::printf("path: CPU fp64 reference\n\n");
  std::printf("%10s %12s %10s %12s %12s %10s\n", "context", "attended/q", "fraction", "mass recall",
              "rel. error", "cpu s");
  for (const std::int64_t ctx : opt.contexts) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(workload_options(opt, shape, ctx));
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
}

/// Median seconds of `f` (which enqueues work on `stream`) over `n` runs.
template <class F>
double time_median(cudaStream_t stream, int n, F&& f) {
  cudaEvent_t a, b;
  HISPARSE_CUDA_CHECK(cudaEventCreate(&a));
  HISPARSE_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    HISPARSE_CUDA_CHECK(cudaEventRecord(a, stream));
    f();
    HISPARSE_CUDA_CHECK(cudaEventRecord(b, stream));
    HISPARSE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    HISPARSE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// q[t][qh] = k[t][qh / group]: a prompt's own keys as its queries.
template <class T>
__global__ void keys_as_queries(const T* k, T* q, std::int64_t tokens, int q_heads, int group, int dim) {
  const std::int64_t n = tokens * q_heads * dim;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t t = i / (std::int64_t{q_heads} * dim);
    const int qh = static_cast<int>(i / dim % q_heads), d = static_cast<int>(i % dim);
    q[i] = k[(t * (q_heads / group) + qh / group) * dim + d];
  }
}

struct prefill_figures {
  std::int64_t context = 0;
  double sparse_s = 0, select_s = 0, dense_s = 0, recall = 0;
};

/// Runs a planned sparse prefill and the dense one over the same segment and
/// returns the mean over its (query, head) rows of exp(lse_sparse - lse_dense):
/// the dense softmax mass of what the sparse one attended.
template <class Sparse, class Dense>
double prefill_recall(const Sparse& sparse, const Dense& dense, const device_array<float>& lse_sparse,
                      const device_array<float>& lse_dense, std::size_t rows, cudaStream_t stream) {
  throw_if_error(sparse.run(stream));
  throw_if_error(dense.run(stream));
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto ls = lse_sparse.download(rows), ld = lse_dense.download(rows);
  double recall = 0;
  for (std::size_t i = 0; i < rows; ++i) recall += std::exp(static_cast<double>(ls[i]) - ld[i]);
  return recall / static_cast<double>(rows);
}

/// The whole prompt of `slot` (ctx tokens, keys at `keys` on the device):
/// sparse prefill against dense causal prefill, timed with the prompt's own
/// keys as its queries (the time does not depend on the values); the recall
/// over its last query tile with the workload's queries (`tail`, host,
/// [rows][Hq][D]: the workload anchors its recency and needles at the end
/// of the prompt, so only the last positions have its statistics).
prefill_figures prefill_row(const hisparse::SparseAttentionConfig& cfg, const hisparse::attention_shape& shape,
                            const hisparse::kv::paged_kv_ref<__nv_bfloat16>& cache, int slot, std::int64_t ctx,
                            const __nv_bfloat16* keys, const std::vector<__nv_bfloat16>& tail, cudaStream_t stream) {
  using namespace hisparse;
  using bf16 = __nv_bfloat16;
  const int Hq = shape.num_q_heads, D = shape.head_dim;
  const std::size_t rows = static_cast<std::size_t>(ctx) * Hq;
  device_array<bf16> q(rows * D), out_sparse(rows * D), out_dense(rows * D);
  device_array<float> lse_sparse(rows), lse_dense(rows);
  keys_as_queries<<<1024, 256, 0, stream>>>(keys, q.ptr, ctx, Hq, shape.group_size(), D);
  HISPARSE_CUDA_CHECK(cudaGetLastError());
  // The whole prompt, then its last tile: two calls of the same operators.
  const auto tail_begin = static_cast<std::int32_t>((ctx - 1) / cfg.query_tile * cfg.query_tile);
  const auto tail_n = static_cast<std::int32_t>(ctx) - tail_begin;
  std::vector<select::prefill_segment> segs{{slot, 0, static_cast<std::int32_t>(ctx), 0, 0},
                                            {slot, tail_begin, tail_n, 0, 0}};
  int tiles = 0, tail_tiles = 0;
  throw_if_error(select::layout_prefill_segments(segs.data(), 1, cfg.query_tile, tiles));
  throw_if_error(select::layout_prefill_segments(segs.data() + 1, 1, cfg.query_tile, tail_tiles));
  device_array<select::prefill_segment> d_segs(2);
  d_segs.upload(segs.data(), 2);
  prefill_step_arguments<bf16> a;
  a.queries = q.ptr;
  a.segments = d_segs.ptr;
  a.num_segments = 1;
  a.num_tiles = tiles;
  a.max_end = static_cast<std::int32_t>(ctx);
  a.num_q_heads = Hq;
  a.cache = cache;
  a.out = out_sparse.ptr;
  a.lse = lse_sparse.ptr;
  hierarchical_prefill<bf16> sparse(cfg);
  std::size_t bytes = 0;
  throw_if_error(sparse.workspace_bytes(a, bytes));
  device_array<char> ws(bytes);
  throw_if_error(sparse.plan(a, ws.ptr, bytes));
  a.out = out_dense.ptr;
  a.lse = lse_dense.ptr;
  dense_prefill<bf16> dense(cfg.query_tile);
  throw_if_error(dense.plan(a));
  prefill_figures f;
  f.context = ctx;
  throw_if_error(sparse.run(stream));  // warm-up
  f.sparse_s = time_median(stream, 5, [&] { throw_if_error(sparse.run(stream)); });
  f.select_s = sparse.runs_dense() ? 0.0 : time_median(stream, 5, [&] { throw_if_error(sparse.run_selection(stream)); });
  f.dense_s = time_median(stream, ctx > 65536 ? 1 : 3, [&] { throw_if_error(dense.run(stream)); });

  const std::size_t tail_rows = static_cast<std::size_t>(tail_n) * Hq;
  q.upload(tail.data(), tail_rows * D);
  a.segments = d_segs.ptr + 1;
  a.num_tiles = tail_tiles;
  a.out = out_sparse.ptr;
  a.lse = lse_sparse.ptr;
  throw_if_error(sparse.rebind(a));
  a.out = out_dense.ptr;
  a.lse = lse_dense.ptr;
  throw_if_error(dense.plan(a));
  f.recall = prefill_recall(sparse, dense, lse_sparse, lse_dense, tail_rows, stream);
  return f;
}

void run_gpu(const options& opt, const hisparse::SparseAttentionConfig& cfg, const hisparse::attention_shape& shape) {
  using namespace hisparse;
  using bf16 = __nv_bfloat16;
  cudaDeviceProp prop{};
  HISPARSE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int B = opt.batch, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads, D = shape.head_dim;
  std::printf("path: GPU (%s); %d requests per context: one synthetic sequence per context in %d cache slots,\n"
              "a different query (different far needles) per request\n\n",
              prop.name, B, B);
  std::printf("%9s %6s %11s %12s %11s %9s %12s %11s %8s\n", "context", "batch", "attended/q", "sparse step",
              "dense", "speed-up", "mass recall", "rel. error", "gen s");
  constexpr int kReplays = 20;
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<prefill_figures> prefills;
  for (const std::int64_t ctx : opt.contexts) {
    const auto t0 = std::chrono::steady_clock::now();
    auto wo = workload_options(opt, shape, ctx);
    // The decode rows take the first B queries; the prefill's last tile up
    // to query_tile of them (the first B are the same either way).
    wo.num_queries = std::min<std::int64_t>(ctx, std::max(B, cfg.query_tile));
    const auto w = workload::make_synthetic_workload<bf16>(wo);
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    mr::device_pool_resource device;
    kv::paged_kv_cache_options co;
    co.num_kv_heads = Hkv;
    co.head_dim = D;
    co.fine_slice = cfg.fine_slice;
    co.coarse_block = cfg.coarse_block;
    co.max_sequences = B;
    co.max_context = ctx;
    co.fine_summary = cfg.fine_summary;  // what the preset's decode filters read
    co.coarse_summary = cfg.coarse_summary;
    kv::paged_kv_cache<bf16, mr::device_pool_resource> cache(device, co);
    device_array<bf16> k(w.keys.size()), v(w.values.size());
    k.upload(w.keys.data(), w.keys.size());
    v.upload(w.values.data(), w.values.size());
    std::vector<std::int32_t> slots;
    for (int b = 0; b < B; ++b) {
      int slot = 0;
      throw_if_error(cache.add_sequence(ctx, slot));
      slots.push_back(slot);
      throw_if_error(cache.append_async(0, std::vector<kv::append_segment>{{slot, 0, static_cast<std::int32_t>(ctx)}},
                                        k.ptr, v.ptr, stream));
    }
    device_array<std::int32_t> d_slots(slots.size());
    d_slots.upload(slots.data(), slots.size());
    const std::size_t rows = static_cast<std::size_t>(B) * Hq;
    device_array<bf16> q(rows * D), out_sparse(rows * D), out_dense(rows * D);
    q.upload(w.queries.data(), rows * D);  // query i of the workload is request i's, at position T - 1
    device_array<float> lse_sparse(rows), lse_dense(rows);

    decode_step_arguments<bf16> a;
    a.queries = q.ptr;
    a.slots = d_slots.ptr;
    a.batch = B;
    a.num_q_heads = Hq;
    a.cache = cache.ref();
    hierarchical_decode<bf16> sparse(cfg);
    dense_decode<bf16> dense;
    a.out = out_sparse.ptr;
    a.lse = lse_sparse.ptr;
    std::size_t sparse_bytes = 0, dense_bytes = 0;
    throw_if_error(sparse.workspace_bytes(a, sparse_bytes));
    void* sparse_ws = device.allocate(sparse_bytes, stream);
    throw_if_error(sparse.plan(a, sparse_ws, sparse_bytes, stream));
    a.out = out_dense.ptr;
    a.lse = lse_dense.ptr;
    throw_if_error(dense.workspace_bytes(a, dense_bytes));
    void* dense_ws = device.allocate(dense_bytes, stream);
    throw_if_error(dense.plan(a, dense_ws, dense_bytes, stream));

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < kReplays; ++i) throw_if_error(sparse.run(stream));
    HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double sparse_s =
        time_median(stream, 11, [&] { HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }) / kReplays;
    const double dense_s = time_median(stream, 5, [&] { throw_if_error(dense.run(stream)); });
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));

    const auto os = out_sparse.download(rows * D), od = out_dense.download(rows * D);
    const auto ls = lse_sparse.download(rows), ld = lse_dense.download(rows);
    std::vector<double> sparse_out, dense_out;
    for (std::size_t i = 0; i < os.size(); ++i) {
      sparse_out.push_back(to_double(os[i]));
      dense_out.push_back(to_double(od[i]));
    }
    double recall = 0;
    for (std::size_t i = 0; i < rows; ++i) recall += std::exp(static_cast<double>(ls[i]) - ld[i]);
    recall /= static_cast<double>(rows);
    std::vector<std::int32_t> num(static_cast<std::size_t>(B) * Hkv), ws(static_cast<std::size_t>(B));
    HISPARSE_CUDA_CHECK(cudaMemcpy(num.data(), sparse.num_slices(), num.size() * 4, cudaMemcpyDeviceToHost));
    HISPARSE_CUDA_CHECK(cudaMemcpy(ws.data(), sparse.window_begin(), ws.size() * 4, cudaMemcpyDeviceToHost));
    double attended = 0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Hkv; ++h)
        attended += static_cast<double>(num[static_cast<std::size_t>(b * Hkv + h)]) * cfg.fine_slice +
                    static_cast<double>(ctx - ws[static_cast<std::size_t>(b)]);
    attended /= static_cast<double>(B * Hkv);
    std::printf("%9lld %6d %11.0f %9.1f us %8.0f us %8.1fx %12.4f %11.2e %8.1f\n", static_cast<long long>(ctx), B,
                attended, sparse_s * 1e6, dense_s * 1e6, dense_s / sparse_s, recall,
                relative_error(sparse_out, dense_out), gen_s);
    HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
    device.deallocate(sparse_ws, sparse_bytes, stream);
    device.deallocate(dense_ws, dense_bytes, stream);
    HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    // The workload's queries as the prompt's last positions (the first
    // `tail` of them; the decode rows above used the first B).
    const std::int64_t tail = ctx - (ctx - 1) / cfg.query_tile * cfg.query_tile;
    std::vector<bf16> tail_q(w.queries.begin(), w.queries.begin() + tail * Hq * D);
    if (cfg.coarse_summary == coarse_summary::mean)  // the prefill selection ranks blocks by means only
      prefills.push_back(prefill_row(cfg, shape, cache.ref(), slots[0], ctx, k.ptr, tail_q, stream));
  }
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
  if (prefills.empty()) return;
  std::printf("\nprefill of request 0's whole prompt, one sequence (timed with its own keys as queries; mass\n"
              "recall over its last query tile, with the workload's queries, anchored at the prompt's end):\n");
  std::printf("%9s %13s %13s %11s %9s %12s\n", "context", "sparse", "(selection)", "dense", "speed-up",
              "mass recall");
  for (const auto& f : prefills)
    std::printf("%9lld %10.2f ms %10.2f ms %8.1f ms %8.1fx %12.4f\n", static_cast<long long>(f.context),
                f.sparse_s * 1e3, f.select_s * 1e3, f.dense_s * 1e3, f.dense_s / f.sparse_s, f.recall);
}

struct recalls {
  double selection = 0, slices = 0, tokens = 0, window = 0;
  int rows = 0;
};

/// The dense softmax mass of every token [0, p] for query row i of w's
/// queries, query head qh (fp64).
std::vector<double> token_mass(const hisparse::workload::synthetic_workload<__nv_bfloat16>& w,
                               const std::vector<float>& keys, std::int64_t i, int qh, std::int64_t p) {
  const auto& s = w.options.shape;
  const int dim = s.head_dim, h = qh / s.group_size();
  std::vector<double> q(static_cast<std::size_t>(dim));
  for (int d = 0; d < dim; ++d)
    q[static_cast<std::size_t>(d)] =
        hisparse::to_double(w.queries[static_cast<std::size_t>((i * s.num_q_heads + qh) * dim + d)]);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  std::vector<double> m(static_cast<std::size_t>(p + 1));
  double top = -HUGE_VAL;
  for (std::int64_t t = 0; t <= p; ++t) {
    const float* k = &keys[static_cast<std::size_t>((t * s.num_kv_heads + h) * dim)];
    double x = 0;
    for (int d = 0; d < dim; ++d) x += q[static_cast<std::size_t>(d)] * k[d];
    m[static_cast<std::size_t>(t)] = x * scale;
    top = std::max(top, x * scale);
  }
  double z = 0;
  for (double& x : m) z += (x = std::exp(x - top));
  for (double& x : m) x /= z;
  return m;
}

/// Adds one request's (query position T - 1) recalls, every KV head.
void add_request(const hisparse::SparseAttentionConfig& cfg, const hisparse::attention_shape& shape,
                 const hisparse::workload::synthetic_workload<__nv_bfloat16>& w, const std::vector<float>& keys,
                 int request, bool misses, recalls& r) {
  using namespace hisparse;
  const std::int64_t T = w.options.context;
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, dim = shape.head_dim, group = shape.group_size();
  const int F = cfg.fine_slice;
  reference::sequence<__nv_bfloat16> seq = w.sequence();
  seq.queries = tensor_view<const __nv_bfloat16, 3>::contiguous(
      w.queries.data() + static_cast<std::size_t>(request) * hq * dim, 1, hq, dim);
  seq.q_begin = T - 1;
  const auto sparse = reference::decode(cfg, shape, seq);
  const std::int64_t ws = sparse.tiles[0].window_begin, far_slices = ws / F;
  std::vector<std::vector<double>> mass(static_cast<std::size_t>(group));
  for (int h = 0; h < hkv; ++h) {
    for (int g = 0; g < group; ++g) mass[static_cast<std::size_t>(g)] = token_mass(w, keys, request, h * group + g, T - 1);
    // Group mass of every far slice: what a shared slice selection keeps.
    std::vector<double> slice_mass(static_cast<std::size_t>(far_slices), 0.0);
    for (std::int64_t s = 0; s < far_slices; ++s)
      for (const auto& m : mass)
        for (std::int64_t t = s * F; t < (s + 1) * F; ++t)
          slice_mass[static_cast<std::size_t>(s)] += m[static_cast<std::size_t>(t)];
    const auto& kept = sparse.tiles[0].slices[static_cast<std::size_t>(h)].kept;
    std::vector<double> best = slice_mass;
    const std::size_t k = std::min(kept.size(), best.size());
    std::partial_sort(best.begin(), best.begin() + static_cast<std::ptrdiff_t>(k), best.end(), std::greater<>());
    double kept_mass = 0, best_mass = 0;
    for (const auto s : kept) kept_mass += slice_mass[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < k; ++i) best_mass += best[i];
    if (misses && !kept.empty()) {
      double least = HUGE_VAL;
      for (const auto s : kept) least = std::min(least, slice_mass[static_cast<std::size_t>(s)]);
      for (std::int64_t s = 0; s < far_slices; ++s) {
        const double m = slice_mass[static_cast<std::size_t>(s)];
        if (m <= 10 * least || std::find(kept.begin(), kept.end(), s) != kept.end()) continue;
        int needle_tokens = 0;
        for (const std::int64_t begin : w.needle_begin[static_cast<std::size_t>(h)])
          for (std::int64_t t = begin; t < begin + w.options.needle_span; ++t) needle_tokens += t / F == s ? 1 : 0;
        std::printf("  T %lld request %d KV head %d: missed slice %lld, mass %.5f a head (%d needle tokens); "
                    "least kept %.6f\n",
                    static_cast<long long>(T), request, h, static_cast<long long>(s), m / group, needle_tokens,
                    least / group);
      }
    }
    const std::int64_t attended = (T - ws) + static_cast<std::int64_t>(kept.size()) * F;
    for (const auto& m : mass) {
      const double window = std::accumulate(m.begin() + ws, m.end(), 0.0);
      std::vector<double> sorted = m;
      std::nth_element(sorted.begin(), sorted.begin() + attended, sorted.end(), std::greater<>());
      r.tokens += std::accumulate(sorted.begin(), sorted.begin() + attended, 0.0);
      r.selection += window;
      r.slices += window;
      r.window += window;
      ++r.rows;
    }
    r.selection += kept_mass;  // summed over the group: its share of each head's average
    r.slices += best_mass;
  }
}

void run_ceiling(const options& opt, const hisparse::SparseAttentionConfig& cfg,
                 const hisparse::attention_shape& shape) {
  using namespace hisparse;
  std::printf("recall ceilings (CPU, fp64): %d requests per context, needles of %d tokens; efficiency:\n"
              "selection / (window + best slices); far: the same over the far mass (without the window)\n\n",
              opt.batch, opt.needle_span > 0 ? opt.needle_span : workload::synthetic_options{}.needle_span);
  std::printf("%9s %12s %22s %22s %11s %8s\n", "context", "selection", "window + best slices", "best tokens per head",
              "efficiency", "far");
  for (const std::int64_t ctx : opt.contexts) {
    auto wo = workload_options(opt, shape, ctx);
    wo.num_queries = opt.batch;
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(wo);
    std::vector<float> keys(w.keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = to_float(w.keys[i]);
    recalls r;
    for (int b = 0; b < opt.batch; ++b) add_request(cfg, shape, w, keys, b, opt.misses, r);
    std::printf("%9lld %12.4f %22.4f %22.4f %11.4f %8.4f\n", static_cast<long long>(ctx), r.selection / r.rows,
                r.slices / r.rows, r.tokens / r.rows, r.selection / r.slices,
                (r.selection - r.window) / (r.slices - r.window));
  }
}

}  // namespace

/// A refresh rule of the study: the config's (hisparse::refresh_rule), or
/// refreshing where the coarse filter's kept blocks changed.
struct study_rule {
  const char* name;
  hisparse::refresh_rule rule;
  bool on_coarse_change = false;
  // A step late: a step attends its entry as it stood before the step's own
  // verdict (the selection running beside the attention, for the next
  // step); only an empty entry waits for its selection.
  bool late = false;
};

void run_stream(const options& opt, const hisparse::SparseAttentionConfig& cfg,
                const hisparse::attention_shape& shape) {
  using namespace hisparse;
  constexpr int kNever = 1 << 30;
  const std::vector<study_rule> rules{{"every step", {1}},
                                      {"every 4 steps", {4}},
                                      {"every 16 steps", {16}},
                                      {"every 64 steps", {64}},
                                      {"cosine < 0.99", {kNever, 0.99f}},
                                      {"cosine < 0.95", {kNever, 0.95f}},
                                      {"cosine < 0.90", {kNever, 0.90f}},
                                      {"coarse blocks changed", {kNever}, true},
                                      {"every step, a step late", {1}, false, true},
                                      {"cosine < 0.90, a step late", {kNever, 0.90f}, false, true}};
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, dim = shape.head_dim, group = shape.group_size();
  std::printf("TopK cache study (CPU, fp64): request 0, %d decode steps, queries drifting over %d steps\n\n",
              opt.stream, opt.drift);
  for (const std::int64_t ctx : opt.contexts) {
    auto wo = workload_options(opt, shape, ctx);
    wo.num_queries = opt.stream;
    wo.drift_steps = opt.drift;
    const auto w = workload::make_synthetic_workload<__nv_bfloat16>(wo);
    std::vector<float> keys(w.keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = to_float(w.keys[i]);
    std::vector<std::vector<reference::topk_cache_entry>> cache(
        rules.size(), std::vector<reference::topk_cache_entry>(static_cast<std::size_t>(hkv)));
    std::vector<double> recall(rules.size(), 0.0);
    std::vector<std::int64_t> reuses(rules.size(), 0);
    double fresh_recall = 0;
    // Retention: one policy and evicted set per budget (the far blocks of
    // request 0, every KV head's kept slices observed).
    std::vector<retention_policy> retained;
    for (const std::int64_t n : opt.retain) retained.emplace_back(cfg, retention_options{static_cast<std::int32_t>(n), 1});
    std::vector<std::vector<std::int32_t>> evicted(opt.retain.size());
    std::vector<double> retained_recall(opt.retain.size(), 0.0);
    for (int i = 0; i < opt.stream; ++i) {
      const std::int64_t p = ctx - opt.stream + i;  // step i's query position: the cache holds [0, p]
      reference::sequence<__nv_bfloat16> seq;
      seq.keys = tensor_view<const __nv_bfloat16, 3>::contiguous(w.keys.data(), p + 1, hkv, dim);
      seq.values = tensor_view<const __nv_bfloat16, 3>::contiguous(w.values.data(), p + 1, hkv, dim);
      seq.queries = tensor_view<const __nv_bfloat16, 3>::contiguous(
          w.queries.data() + static_cast<std::size_t>(i) * hq * dim, 1, hq, dim);
      seq.q_begin = p;
      const auto fresh = reference::decode(cfg, shape, seq).tiles[0];
      std::vector<reference::tile_selection> kept_retained;
      for (std::size_t k = 0; k < retained.size(); ++k)
        kept_retained.push_back(reference::decode(cfg, shape, seq, evicted[k]).tiles[0]);
      for (int h = 0; h < hkv; ++h) {
        std::vector<std::vector<double>> mass;
        std::vector<double> qsum(static_cast<std::size_t>(dim), 0.0);
        for (int g = 0; g < group; ++g) {
          mass.push_back(token_mass(w, keys, i, h * group + g, p));
          for (int d = 0; d < dim; ++d) qsum[static_cast<std::size_t>(d)] += to_double(seq.queries(0, h * group + g, d));
        }
        auto recall_of = [&](const reference::tile_selection& t) {
          double r = 0;
          for (const std::int64_t pos : reference::attended_positions(t, h, p, cfg))
            for (const auto& m : mass) r += m[static_cast<std::size_t>(pos)];
          return r / group;
        };
        fresh_recall += recall_of(fresh);
        for (std::size_t k = 0; k < rules.size(); ++k) {
          auto& c = cache[k][static_cast<std::size_t>(h)];
          const auto& rule = rules[k];
          bool refresh = reference::refresh_due(rule.rule, c, qsum, p);
          if (!refresh && rule.on_coarse_change)
            refresh = fresh.blocks[static_cast<std::size_t>(h)].kept != c.tile.blocks[static_cast<std::size_t>(h)].kept;
          const bool late = rule.late && c.position >= 0;
          if (late) recall[k] += recall_of(reference::reused_selection(c.tile, p, cfg));
          if (refresh) {
            c.tile = fresh;
            c.qsum = qsum;
            c.position = p;
          }
          if (!refresh || late) ++reuses[k];
          if (!late) recall[k] += recall_of(reference::reused_selection(c.tile, p, cfg));
        }
        for (std::size_t k = 0; k < retained.size(); ++k) retained_recall[k] += recall_of(kept_retained[k]);
      }
      // The policy sees what this step kept and drops blocks before the next.
      for (std::size_t k = 0; k < retained.size(); ++k) {
        std::vector<std::int32_t> kept;
        for (const auto& sl : kept_retained[k].slices) kept.insert(kept.end(), sl.kept.begin(), sl.kept.end());
        throw_if_error(retained[k].observe(0, 0, i, kept));
        const auto& gone = evicted[k];
        auto is_gone = [&](std::int32_t b) { return std::binary_search(gone.begin(), gone.end(), b); };
        const auto drop = retained[k].plan(0, 0, p + 2, is_gone, static_cast<std::int32_t>(gone.size()));
        evicted[k].insert(evicted[k].end(), drop.begin(), drop.end());
        std::sort(evicted[k].begin(), evicted[k].end());
      }
    }
    const double pairs = static_cast<double>(opt.stream) * hkv;
    std::printf("context %lld: selecting afresh every step, mean recall %.4f\n", static_cast<long long>(ctx),
                fresh_recall / pairs);
    std::printf("  %-28s %8s %12s %14s\n", "refresh rule", "reused", "mean recall", "against fresh");
    for (std::size_t k = 0; k < rules.size(); ++k)
      std::printf("  %-28s %8.3f %12.4f %14.4f\n", rules[k].name, static_cast<double>(reuses[k]) / pairs,
                  recall[k] / pairs, recall[k] / fresh_recall);
    if (!retained.empty()) {
      const std::int32_t far = evictable_blocks(cfg, ctx);
      std::printf("  %-28s %8s %12s %14s\n", "retention (far blocks)", "resident", "mean recall", "against fresh");
      for (std::size_t k = 0; k < retained.size(); ++k) {
        const std::string name = "keep " + std::to_string(opt.retain[k]) + " of " + std::to_string(far);
        std::printf("  %-28s %8lld %12.4f %14.4f\n", name.c_str(),
                    static_cast<long long>(far - static_cast<std::int64_t>(evicted[k].size())),
                    retained_recall[k] / pairs, retained_recall[k] / fresh_recall);
      }
    }
  }
}

int main(int argc, char** argv) try {
  using namespace hisparse;
  options opt = parse(argc, argv);
  const preset_registry presets;
  SparseAttentionConfig cfg = presets.get(presets.find(opt.preset));
  if (opt.coarse == "key_bounds") {
    cfg.coarse_summary = coarse_summary::key_bounds;
  } else if (!opt.coarse.empty() && opt.coarse != "mean") {
    throw error(status::invalid_argument, "--coarse must be mean or key_bounds");
  }
  if (opt.needle_span < 0) throw error(status::invalid_argument, "--needle-span must be >= 1");
  if (opt.stream < 0 || opt.drift < 1) throw error(status::invalid_argument, "--stream and --drift must be >= 1");
  for (const std::int64_t n : opt.retain)
    if (n < cfg.top_k_coarse)
      throw error(status::invalid_argument, "--retain: each budget must be >= the preset's top_k_coarse (" +
                                                std::to_string(cfg.top_k_coarse) + ")");
  const attention_shape shape{32, 8, 128};  // the 7B GQA model of the reference deployment
  const bool gpu = !opt.cpu && have_gpu();
  if (opt.contexts.empty())
    opt.contexts = gpu ? std::vector<std::int64_t>{32768, 131072, 262144} : std::vector<std::int64_t>{8192, 32768, 131072};
  if (opt.batch < 1) throw error(status::invalid_argument, "--batch must be >= 1");
  for (const std::int64_t ctx : opt.contexts)
    if (ctx < 1 || ctx > kMaxContext) throw error(status::invalid_argument, "--contexts must be in [1, 2^30]");

  std::printf("HiSparse demo: decode, %d query heads / %d KV heads, head_dim %d, bf16 KV\n",
              shape.num_q_heads, shape.num_kv_heads, shape.head_dim);
  std::printf("preset '%s': window %d, blocks %d (keep %d, by %s), slices %d (keep %d, by %s)\n",
              opt.preset.c_str(), cfg.window, cfg.coarse_block, cfg.top_k_coarse,
              std::string(name_of(cfg.coarse_summary)).c_str(), cfg.fine_slice, cfg.top_k_fine,
              std::string(name_of(cfg.fine_summary)).c_str());
  if (opt.stream > 0)
    run_stream(opt, cfg, shape);
  else if (opt.ceiling)
    run_ceiling(opt, cfg, shape);
  else if (gpu)
    run_gpu(opt, cfg, shape);
  else
    run_cpu(opt, cfg, shape);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "hisparse_demo: %s\n", e.what());
  return 1;
}
