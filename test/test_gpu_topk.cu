// Batched top-k on the GPU against a host oracle that simply sorts (value,
// index) pairs: random rows across the warp, block and chunked paths, strided
// and length-limited rows, adversarial values (ties, infinities, NaNs, signed
// zeros, padding), rejected arguments, and replay of a captured CUDA graph.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "hisparse/select/batched_topk.cuh"
#include "hisparse/select/topk.cuh"
#include "test_support.hpp"

using namespace hisparse;

namespace {

using test::device_buffer;

constexpr float kInf = std::numeric_limits<float>::infinity();

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }


/// One batch as the API sees it: `rows` rows of `n` scores `stride` apart,
/// optionally limited by per-row lengths (stored unclamped, as a caller may
/// pass them).
struct problem {
  int rows = 0, n = 0;
  std::int64_t stride = 0;
  std::vector<float> scores;           // rows * stride
  std::vector<std::int32_t> lengths;   // empty: every row holds n entries

  problem(int r, int cols, std::int64_t row_stride)
      : rows(r), n(cols), stride(row_stride), scores(static_cast<std::size_t>(r * row_stride), kInf) {}
  [[nodiscard]] int valid(int r) const {
    return lengths.empty() ? n : std::clamp(lengths[static_cast<std::size_t>(r)], 0, n);
  }
  float& at(int r, int i) { return scores[static_cast<std::size_t>(r * stride + i)]; }
  [[nodiscard]] float at(int r, int i) const { return scores[static_cast<std::size_t>(r * stride + i)]; }
  /// Entries the rows do not own (stride gaps, past a row's length) hold
  /// +inf, which would rank first if the kernel ever read them.
  void hide_invalid() {
    for (int r = 0; r < rows; ++r)
      for (std::int64_t i = valid(r); i < stride; ++i) scores[static_cast<std::size_t>(r * stride + i)] = kInf;
  }
};

/// The contract's ranking written out plainly: numbers before NaN, larger
/// first (-0 == +0 as floats compare), equal values and NaNs by lower index.
bool ranks_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

/// Each row's valid column indices in rank order (the whole ranking, so one
/// sort serves every k).
std::vector<std::vector<std::int32_t>> oracle_order(const problem& p) {
  std::vector<std::vector<std::int32_t>> order(static_cast<std::size_t>(p.rows));
  for (int r = 0; r < p.rows; ++r) {
    auto& o = order[static_cast<std::size_t>(r)];
    o.resize(static_cast<std::size_t>(p.valid(r)));
    for (std::size_t i = 0; i < o.size(); ++i) o[i] = static_cast<std::int32_t>(i);
    std::sort(o.begin(), o.end(),
              [&](std::int32_t a, std::int32_t b) { return ranks_before(p.at(r, a), a, p.at(r, b), b); });
  }
  return order;
}

struct result {
  std::vector<float> values;          // [rows][k]
  std::vector<std::int32_t> indices;  // [rows][k]
};

/// The first disagreement with the oracle, described; empty when none.
/// Indices must match exactly, values bit for bit (any NaN matches any NaN),
/// padding must be (-inf, -1).
std::string mismatch(const problem& p, const std::vector<std::vector<std::int32_t>>& order, int k,
                     const result& got) {
  for (int r = 0; r < p.rows; ++r) {
    const auto& o = order[static_cast<std::size_t>(r)];
    for (int s = 0; s < k; ++s) {
      const auto at = static_cast<std::size_t>(r) * k + s;
      const std::int32_t idx = got.indices[at];
      const float v = got.values[at];
      const bool padding = static_cast<std::size_t>(s) >= o.size();
      const std::int32_t want = padding ? -1 : o[static_cast<std::size_t>(s)];
      const float wv = padding ? -kInf : p.at(r, want);
      if (idx == want && (same_bits(v, wv) || (std::isnan(v) && std::isnan(wv)))) continue;
      std::ostringstream what;
      what << "row " << r << " (valid " << p.valid(r) << ") slot " << s << ": got (" << v << ", " << idx
           << "), want (" << wv << ", " << want << ")" << (padding ? " padding" : "");
      return what.str();
    }
  }
  return {};
}

constexpr std::size_t kGuard = 64;  ///< poisoned elements after each output, which must stay poisoned

bool guard_intact(const std::vector<float>& values, const std::vector<std::int32_t>& indices, std::size_t used) {
  for (std::size_t i = used; i < values.size(); ++i)
    if (!same_bits(values[i], from_bits(0xFFFFFFFFu)) || indices[i] != -1) return false;
  return true;
}

/// Runs batched_topk the way a caller must: query the temp size, cudaMalloc
/// it, poison the outputs, run on `stream`, wait, download.
result run_topk(const problem& p, int k, cudaStream_t stream = nullptr) {
  device_buffer<float> scores(p.scores);
  device_buffer<std::int32_t> lengths(p.lengths);
  const std::int32_t* lens = p.lengths.empty() ? nullptr : lengths.ptr;
  const std::size_t used = static_cast<std::size_t>(p.rows) * k;
  device_buffer<float> values(used + kGuard);
  device_buffer<std::int32_t> indices(used + kGuard);
  std::size_t temp_bytes = 0;
  REQUIRE(select::batched_topk(nullptr, temp_bytes, scores.ptr, p.stride, lens, p.rows, p.n, k, values.ptr,
                               indices.ptr, stream) == status::success);
  REQUIRE(temp_bytes >= 1);
  device_buffer<unsigned char> temp(temp_bytes);
  values.poison(stream);
  indices.poison(stream);
  const status st = select::batched_topk(temp.ptr, temp_bytes, scores.ptr, p.stride, lens, p.rows, p.n, k,
                                         values.ptr, indices.ptr, stream);
  INFO(last_error());
  REQUIRE(st == status::success);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
  HISPARSE_CUDA_CHECK(cudaGetLastError());
  result got{values.download(), indices.download()};
  REQUIRE(guard_intact(got.values, got.indices, used));
  got.values.resize(used);
  got.indices.resize(used);
  return got;
}

/// Row lengths that cover every case: empty, full, beyond n, negative, short
/// (padding for most k), and anything in between.
std::vector<std::int32_t> random_lengths(int rows, int n, workload::splitmix64& rng) {
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    std::int64_t len = 0;
    switch (r % 6) {
      case 0: len = 0; break;
      case 1: len = n; break;
      case 2: len = n + 1 + rng.below(1000); break;
      case 3: len = -1 - rng.below(5); break;
      case 4: len = rng.below(std::min(n, 40) + 1); break;
      default: len = 1 + rng.below(n); break;
    }
    lengths[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(len);
  }
  return lengths;
}

/// Row patterns meant to break a radix select: ties everywhere, sorted
/// inputs, infinities, NaNs of both signs and several payloads, signed zeros,
/// denormals, neighbours one ulp apart.
constexpr int kPatterns = 14;

void fill_pattern(problem& p, int r, int pattern, workload::splitmix64& rng) {
  const std::array<float, 4> nans{from_bits(0x7FC00000u), from_bits(0xFFC00000u), from_bits(0x7FC00123u),
                                  from_bits(0xFF800001u)};
  const std::array<float, 14> specials{kInf, -kInf, 0.0f, -0.0f, std::numeric_limits<float>::denorm_min(),
                                       -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                                       -std::numeric_limits<float>::min(), std::numeric_limits<float>::max(),
                                       -std::numeric_limits<float>::max(), 1.0f, -1.0f, nans[0], nans[1]};
  for (int i = 0; i < p.n; ++i) {
    float& x = p.at(r, i);
    const auto normal = static_cast<float>(rng.normal());
    switch (pattern) {
      case 0: x = 1.5f; break;                                                   // all equal
      case 1: x = static_cast<float>(i); break;                                  // ascending
      case 2: x = static_cast<float>(p.n - i); break;                            // descending
      case 3: x = rng.below(10) != 0 ? -kInf : normal; break;                    // mostly -inf
      case 4: x = -kInf; break;                                                  // all -inf
      case 5: x = rng.below(4) == 0 ? nans[static_cast<std::size_t>(rng.below(4))] : normal; break;  // NaNs
      case 6: x = nans[static_cast<std::size_t>(rng.below(4))]; break;         // all NaN
      case 7: x = std::array<float, 4>{0.0f, -0.0f, 0.0f, rng.below(2) ? 1.0f : -1.0f}[rng.below(4)]; break;
      case 8: x = std::array<float, 4>{-1.0f, 0.25f, 2.0f, 3.0f}[rng.below(4)]; break;  // four levels
      case 9: x = 1.0f; break;                                                   // one 2.0 set below
      case 10: x = specials[static_cast<std::size_t>(rng.below(specials.size()))]; break;
      case 11: x = std::array<float, 3>{std::nextafter(1.0f, 0.0f), 1.0f, std::nextafter(1.0f, 2.0f)}[rng.below(3)];
        break;  // 1 and its neighbours, one ulp apart
      case 12: x = -std::abs(normal); break;                                     // negatives only
      default: x = rng.below(2) ? -0.0f : 0.0f; break;                           // signed zeros only
    }
  }
  if (pattern == 9) p.at(r, static_cast<int>(rng.below(p.n))) = 2.0f;
  if (pattern == 4 || pattern == 6) return;
  if (pattern == 1 || pattern == 2) {  // a few duplicates among the sorted values
    for (int d = 0; d < 3 && p.n > 1; ++d) {
      const int i = static_cast<int>(rng.below(p.n - 1));
      p.at(r, i + 1) = p.at(r, i);
    }
  }
}

void check_all_k(const problem& p, std::initializer_list<int> ks, cudaStream_t stream = nullptr) {
  const auto order = oracle_order(p);
  for (const int k : ks) {
    INFO("k " << k);
    const result got = run_topk(p, k, stream);
    REQUIRE(mismatch(p, order, k, got) == "");
  }
}

}  // namespace

TEST_CASE("batched_topk matches the host oracle on random rows (warp, block, chunked paths)", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  for (const int n : {16, 100, 128, 256, 257, 512, 513, 1000, 1024, 2048, 4096, 4097, 10000, 65536}) {
    const int rows = std::clamp(600000 / n, 9, 37);
    for (const char* layout : {"contiguous", "strided", "row_lengths"}) {
      INFO("n " << n << ", rows " << rows << ", " << layout);
      const std::int64_t stride = std::string(layout) == "contiguous" ? n : n + 1 + rng.below(7);
      problem p(rows, n, stride);
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < n; ++i) p.at(r, i) = static_cast<float>(rng.normal());
      if (std::string(layout) == "row_lengths") p.lengths = random_lengths(rows, n, rng);
      p.hide_invalid();
      if (n >= 1000)
        check_all_k(p, {1, 7, 32, 33, 64, 256, 2048});
      else
        check_all_k(p, {1, 7, 32, 33, 64, 256});
    }
  }
}

TEST_CASE("batched_topk on adversarial rows: ties, sorted inputs, infinities, NaNs, signed zeros", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  for (const int n : {40, 300, 512, 3000, 4096, 9000, 65536}) {
    for (const bool limited : {false, true}) {
      INFO("n " << n << (limited ? ", row_lengths" : ""));
      problem p(2 * kPatterns, n, n);
      for (int r = 0; r < p.rows; ++r) fill_pattern(p, r, r % kPatterns, rng);
      if (limited) p.lengths = random_lengths(p.rows, n, rng);
      p.hide_invalid();
      check_all_k(p, {1, 2, 7, 31, 32, 33, 64, 100, 2048});
    }
  }
}

TEST_CASE("batched_topk on rows whose filter leaves many tied survivors (the block's multi-pass sort)", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  // Normal scores rounded to a grid of 1 / q: the block filter's threshold
  // lands on a level shared by ~60-500 entries of a 4096 row, so its sort
  // takes one to seven 128-key passes, and most of what it orders are ties
  // that only the index breaks.
  for (const int n : {1000, 4096, 4097}) {
    for (const int q : {1, 2, 4}) {
      INFO("n " << n << ", grid 1/" << q);
      problem p(64, n, n);
      for (int r = 0; r < p.rows; ++r)
        for (int i = 0; i < n; ++i) p.at(r, i) = std::round(static_cast<float>(rng.normal()) * q) / q;
      p.hide_invalid();
      check_all_k(p, {1, 16, 33, 64});
    }
  }
}

TEST_CASE("batched_topk pads rows shorter than k with (-inf, -1)", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  struct shape {
    int n, k;
    std::vector<std::int32_t> lengths;
  };
  // warp path, block path, chunked path with one and with several reduction passes
  for (const shape& s : {shape{5, 32, {}}, shape{5, 64, {}}, shape{300, 2048, {}}, shape{100, 32, {0, 3, 100, 7}},
                         shape{5000, 2048, {0, 3, 5000, 2000}}, shape{20000, 2048, {20000, 1, 9000, 4097}}}) {
    INFO("n " << s.n << ", k " << s.k);
    const int rows = s.lengths.empty() ? 3 : static_cast<int>(s.lengths.size());
    problem p(rows, s.n, s.n);
    p.lengths = s.lengths;
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < p.valid(r); ++i) p.at(r, i) = static_cast<float>((i * 37) % 11) - 5.0f;
    const result got = run_topk(p, s.k);
    REQUIRE(mismatch(p, oracle_order(p), s.k, got) == "");
    for (int r = 0; r < rows; ++r) {
      INFO("row " << r);
      const auto first_pad = static_cast<std::size_t>(r) * s.k + static_cast<std::size_t>(std::min(p.valid(r), s.k));
      for (std::size_t i = first_pad; i < static_cast<std::size_t>(r + 1) * s.k; ++i) {
        REQUIRE(got.indices[i] == -1);
        REQUIRE(got.values[i] == -kInf);
      }
    }
  }
}

TEST_CASE("batched_topk rejects bad arguments before launching", "[gpu][topk][errors]") {
  HISPARSE_REQUIRE_GPU();
  const int rows = 4, n = 10000, k = 64;
  device_buffer<float> scores(std::vector<float>(static_cast<std::size_t>(rows) * n, 1.0f));
  device_buffer<float> values(static_cast<std::size_t>(rows) * 2049);
  device_buffer<std::int32_t> indices(static_cast<std::size_t>(rows) * 2049);
  values.poison(nullptr);
  indices.poison(nullptr);
  std::size_t needed = 0;
  REQUIRE(select::batched_topk(nullptr, needed, scores.ptr, n, nullptr, rows, n, k, values.ptr, indices.ptr) ==
          status::success);
  REQUIRE(needed > 1);  // the chunked path keeps candidate keys in temp storage
  device_buffer<unsigned char> temp(needed);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());

  auto rejected = [&](std::size_t bytes, const float* in, std::int64_t stride, int r, int cols, int kk,
                      const char* reason) {
    INFO("rows " << r << ", n " << cols << ", k " << kk << ", stride " << stride << ", temp_bytes " << bytes);
    detail::last_error_slot().clear();  // so a stale reason cannot pass for this one
    std::size_t b = bytes;
    CHECK(select::batched_topk(temp.ptr, b, in, stride, nullptr, r, cols, kk, values.ptr, indices.ptr) ==
          status::invalid_argument);
    CHECK_FALSE(last_error().empty());
    CHECK_THAT(last_error(), Catch::Contains(reason));
  };
  rejected(needed, scores.ptr, n, rows, n, 0, "[1, 2048]");
  rejected(needed, scores.ptr, n, rows, n, -1, "[1, 2048]");
  rejected(needed, scores.ptr, n, rows, n, 2049, "[1, 2048]");
  rejected(needed, scores.ptr, n, 0, n, k, "rows >= 1");
  rejected(needed, scores.ptr, n, -2, n, k, "rows >= 1");
  rejected(needed, scores.ptr, n, rows, 0, k, "1 <= n");
  rejected(needed, scores.ptr, n - 1, rows, n, k, "row_stride");
  rejected(needed, scores.ptr, -1, rows, n, k, "row_stride");
  rejected(needed - 1, scores.ptr, n, rows, n, k, "temp storage");
  rejected(0, scores.ptr, 128, rows, 100, 8, "temp storage");  // the warp path needs at least a byte too
  rejected(needed, nullptr, n, rows, n, k, "null");

  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  HISPARSE_CUDA_CHECK(cudaGetLastError());
  const auto v = values.download();
  const auto i = indices.download();
  CHECK(guard_intact(v, i, 0));  // every output byte still poisoned
}

TEST_CASE("batched_topk replays from a CUDA graph with new scores and lengths", "[gpu][topk][graph]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct shape {
    int rows, n, k;
  };
  // warp path, block path, chunked with one reduction, chunked with several
  for (const shape s : {shape{13, 300, 16}, shape{9, 2000, 64}, shape{5, 20000, 256}, shape{3, 70000, 2048}}) {
    INFO("rows " << s.rows << ", n " << s.n << ", k " << s.k);
    auto make = [&] {
      problem p(s.rows, s.n, s.n + 3);
      for (int r = 0; r < s.rows; ++r)
        for (int i = 0; i < s.n; ++i) p.at(r, i) = static_cast<float>(rng.normal());
      p.lengths = random_lengths(s.rows, s.n, rng);
      p.hide_invalid();
      return p;
    };
    const problem first = make(), second = make();
    device_buffer<float> scores(first.scores);
    device_buffer<std::int32_t> lengths(first.lengths);
    const std::size_t used = static_cast<std::size_t>(s.rows) * s.k;
    device_buffer<float> values(used + kGuard);
    device_buffer<std::int32_t> indices(used + kGuard);
    std::size_t temp_bytes = 0;
    REQUIRE(select::batched_topk(nullptr, temp_bytes, scores.ptr, first.stride, lengths.ptr, s.rows, s.n, s.k,
                                 values.ptr, indices.ptr, stream) == status::success);
    device_buffer<unsigned char> temp(temp_bytes);

    cudaGraph_t graph = nullptr;
    HISPARSE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const status st = select::batched_topk(temp.ptr, temp_bytes, scores.ptr, first.stride, lengths.ptr, s.rows, s.n,
                                           s.k, values.ptr, indices.ptr, stream);
    HISPARSE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    REQUIRE(st == status::success);
    cudaGraphExec_t exec = nullptr;
    HISPARSE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    for (const problem* p : {&first, &second}) {
      INFO((p == &first ? "inputs at capture" : "inputs changed after capture"));
      scores.upload(p->scores, stream);
      lengths.upload(p->lengths, stream);
      values.poison(stream);
      indices.poison(stream);
      HISPARSE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));
      result got{values.download(), indices.download()};
      REQUIRE(guard_intact(got.values, got.indices, used));
      got.values.resize(used);
      got.indices.resize(used);
      REQUIRE(mismatch(*p, oracle_order(*p), s.k, got) == "");
    }
    HISPARSE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    HISPARSE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}

namespace {

constexpr int kPrimThreads = 256, kPrimE = 16, kPrimSpan = kPrimThreads * kPrimE;
using prim_block = select::block_topk<kPrimThreads, kPrimE>;

/// One block per row of kPrimSpan scores: block_topk::select_scores with x[]
/// laid out as entry_offset<Vec>, every entry of the chunk loaded (those at
/// or past len[row] too, which the primitive must ignore), its keys out.
template <int Vec>
__global__ void select_scores_kernel(const float* scores, const int* lens, int k, select::topk_key* out, int* found) {
  __shared__ prim_block::TempStorage storage;
  extern __shared__ __align__(16) select::topk_key sorted[];
  const float* row = scores + static_cast<std::int64_t>(blockIdx.x) * kPrimSpan;
  const int base = Vec * static_cast<int>(threadIdx.x);
  float x[kPrimE];
  for (int j = 0; j < kPrimE; ++j) x[j] = row[base + prim_block::entry_offset<Vec>(j)];
  const int got = prim_block(storage).select_scores<Vec>(x, 0, lens[blockIdx.x], k, sorted);
  for (int i = static_cast<int>(threadIdx.x); i < k; i += kPrimThreads)
    out[static_cast<std::int64_t>(blockIdx.x) * k + i] = sorted[i];
  if (threadIdx.x == 0) found[blockIdx.x] = got;
}

}  // namespace

TEST_CASE("block_topk::select_scores ranks only the entries below len, in either layout", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  INFO("seed " << seed);
  workload::splitmix64 rng(seed);
  // Lengths through a full chunk, a part of one, a few entries, none; entries
  // past a row's length hold 1e30, which wins if the primitive ever reads
  // one. Rows of one value send the filter to the radix path.
  const std::vector<int> lens{kPrimSpan, kPrimSpan - 1, 4000, 1025, 1000, 300, 64, 33, 5, 0, kPrimSpan, 2500};
  const int rows = static_cast<int>(lens.size());
  problem p(rows, kPrimSpan, kPrimSpan);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < kPrimSpan; ++i)
      p.at(r, i) = i >= lens[static_cast<std::size_t>(r)] ? 1e30f : r % 4 == 3 ? 0.5f : static_cast<float>(rng.normal());
  p.lengths.assign(lens.begin(), lens.end());
  const auto order = oracle_order(p);
  device_buffer<float> scores(p.scores);
  device_buffer<int> lengths(lens);
  for (const int vec : {1, 4}) {
    for (const int k : {1, 33, 64, 256}) {
      INFO("layout runs of " << vec << ", k " << k);
      device_buffer<select::topk_key> out(static_cast<std::size_t>(rows) * k);
      device_buffer<int> found(static_cast<std::size_t>(rows));
      const std::size_t shared = sizeof(select::topk_key) * prim_block::scores_capacity(k);
      auto* kernel = vec == 1 ? select_scores_kernel<1> : select_scores_kernel<4>;  // at most ~21 KB of shared memory
      kernel<<<rows, kPrimThreads, shared>>>(scores.ptr, lengths.ptr, k, out.ptr, found.ptr);
      HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
      const auto keys = out.download();
      const auto counts = found.download();
      for (int r = 0; r < rows; ++r) {
        INFO("row " << r << ", len " << lens[static_cast<std::size_t>(r)]);
        const auto& o = order[static_cast<std::size_t>(r)];
        const int want = std::min<int>(k, static_cast<int>(o.size()));
        REQUIRE(counts[static_cast<std::size_t>(r)] == want);
        for (int s = 0; s < k; ++s) {
          const select::topk_key key = keys[static_cast<std::size_t>(r) * k + s];
          if (s < want) {
            REQUIRE(select::key_index(key) == o[static_cast<std::size_t>(s)]);
            REQUIRE(same_bits(select::from_ordered_bits(static_cast<std::uint32_t>(key >> 32)),
                              p.at(r, o[static_cast<std::size_t>(s)])));
          } else {
            REQUIRE(key == select::kNoCandidate);
          }
        }
      }
    }
  }
}

namespace {

__global__ void ordered_bits_kernel(const std::uint32_t* in, std::uint32_t* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = select::ordered_bits(__uint_as_float(in[i]));
}

}  // namespace

TEST_CASE("ordered_bits gives the same word on the device as on the host", "[gpu][topk]") {
  HISPARSE_REQUIRE_GPU();
  // Every 4093rd bit pattern (a prime stride: every exponent, both signs,
  // many NaN payloads) and the edges: zeros, subnormals, the smallest
  // normals, infinities, the NaNs next to them.
  std::vector<std::uint32_t> patterns;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4093) patterns.push_back(static_cast<std::uint32_t>(u));
  for (const std::uint32_t sign : {0u, 0x80000000u})
    for (const std::uint32_t m : {0x0u, 0x1u, 0x2u, 0x7FFFFFu, 0x800000u, 0x800001u, 0x3F800000u, 0x7F7FFFFFu,
                                  0x7F800000u, 0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu})
      patterns.push_back(sign | m);
  device_buffer<std::uint32_t> in(patterns);
  device_buffer<std::uint32_t> out(patterns.size());
  const int n = static_cast<int>(patterns.size());
  ordered_bits_kernel<<<(n + 255) / 256, 256>>>(in.ptr, out.ptr, n);
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = out.download();
  std::size_t wrong = 0, first = 0;
  for (std::size_t i = 0; i < patterns.size(); ++i)
    if (got[i] != select::ordered_bits(from_bits(patterns[i])) && wrong++ == 0) first = i;
  INFO(wrong << " of " << patterns.size() << " differ; the first: pattern 0x" << std::hex << patterns[first]);
  REQUIRE(wrong == 0);
}
