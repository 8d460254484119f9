// The host side of batched_topk, activation_topk and gated_gemv needs no
// device: the temp-size queries and every argument check answer before any
// CUDA call, so they are CPU tests.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "hisparse/select/activation_topk.cuh"
#include "hisparse/select/batched_topk.cuh"
#include "hisparse/select/topk.cuh"

using namespace hisparse;

TEST_CASE("batched_topk sizes its temp storage without a device", "[select][topk]") {
  std::size_t bytes = 0;
  // Warp and single-block paths need no scratch (1 byte, so a null pointer stays a query).
  REQUIRE(select::batched_topk(nullptr, bytes, nullptr, 256, nullptr, 32768, 256, 32, nullptr, nullptr) ==
          status::success);
  CHECK(bytes == 1);
  REQUIRE(select::batched_topk(nullptr, bytes, nullptr, 4096, nullptr, 8192, 4096, 64, nullptr, nullptr) ==
          status::success);
  CHECK(bytes == 1);
  // Chunked rows: two ping-pong buffers of rows * chunks * k keys, plus alignment room.
  REQUIRE(select::batched_topk(nullptr, bytes, nullptr, 65536, nullptr, 1024, 65536, 64, nullptr, nullptr) ==
          status::success);
  CHECK(bytes == 2 * 1024 * 16 * 64 * sizeof(select::topk_key) + 256);
}

TEST_CASE("batched_topk rejects bad arguments before touching the device", "[select][topk][errors]") {
  std::size_t bytes = 0;
  auto call = [&](int rows, int n, int k, std::int64_t stride) {
    return select::batched_topk(nullptr, bytes, nullptr, stride, nullptr, rows, n, k, nullptr, nullptr);
  };
  CHECK(call(0, 16, 1, 16) == status::invalid_argument);
  CHECK(call(4, 0, 1, 16) == status::invalid_argument);
  CHECK(call(4, 16, 0, 16) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("k 0"));
  CHECK(call(4, 16, 2049, 16) == status::invalid_argument);
  CHECK(call(4, 16, 4, 15) == status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("row_stride"));
  // Too little temp, and null buffers, are caught on the second call.
  float dummy = 0;
  std::size_t small = 8;
  CHECK(select::batched_topk(&dummy, small, &dummy, 65536, nullptr, 4, 65536, 64, &dummy, nullptr) ==
        status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("temp storage"));
  std::size_t one = 1;
  CHECK(select::batched_topk(&dummy, one, nullptr, 16, nullptr, 4, 16, 4, &dummy, nullptr) ==
        status::invalid_argument);
  CHECK_THAT(last_error(), Catch::Contains("null"));
}

TEST_CASE("activation_topk and gated_gemv reject bad arguments before touching the device", "[select][gating][errors]") {
  // Never dereferenced: every call below fails its checks first.
  auto* a = reinterpret_cast<const __half*>(std::uintptr_t{256});
  auto* gate = reinterpret_cast<const float*>(std::uintptr_t{512});
  auto* idx = reinterpret_cast<std::int32_t*>(std::uintptr_t{1024});
  auto* vals = reinterpret_cast<__half*>(std::uintptr_t{2048});
  auto* counts = reinterpret_cast<std::int32_t*>(std::uintptr_t{4096});
  using select::gating_rule;
  auto call = [&](int rows, int n, std::int64_t stride, int k_max, gating_rule rule, float t, const std::int32_t* k,
                  const __half* a_ptr = nullptr) {
    return select::activation_topk(a_ptr == nullptr ? a : a_ptr, stride, gate, rows, n, rule, k, t, k_max, idx, vals,
                                   counts);
  };
  auto fails = [](status s, const char* why) {
    CHECK(s == status::invalid_argument);
    CHECK_THAT(last_error(), Catch::Contains(why));
  };
  fails(call(0, 8, 8, 2, gating_rule::top_k, 0, nullptr), "rows >= 1");
  fails(call(1, 0, 8, 2, gating_rule::top_k, 0, nullptr), "n >= 1");
  fails(call(1, (1 << 30) + 1, std::int64_t{1} << 31, 2, gating_rule::top_k, 0, nullptr), "2^30");
  fails(call(1, 8, 7, 2, gating_rule::top_k, 0, nullptr), "row_stride");
  fails(call(1, 8, 8, 0, gating_rule::top_k, 0, nullptr), "k_max");
  fails(call(1, 8, 8, 9, gating_rule::top_k, 0, nullptr), "k_max");
  fails(call(1, 8, 8, 2, gating_rule::threshold, std::nanf(""), nullptr), "NaN");
  fails(call(1, 8, 8, 2, gating_rule::threshold, 1.0f, counts), "per-row K");
  CHECK(select::activation_topk<__half, float>(nullptr, 8, gate, 1, 8, gating_rule::top_k, nullptr, 0, 2, idx, vals,
                                               counts) == status::invalid_argument);

  auto* w = reinterpret_cast<const __half*>(std::uintptr_t{8192});
  auto* y = reinterpret_cast<float*>(std::uintptr_t{16384});
  std::size_t bytes = 0;
  auto gemv = [&](void* temp, std::size_t& b, std::int64_t ld, int n, int outs, int k_max, int rows) {
    return select::gated_gemv<__half, __half>(temp, b, w, ld, n, outs, idx, vals, k_max, counts, rows, y);
  };
  fails(gemv(nullptr, bytes, 8, 8, 8, 2, 0), "rows");
  fails(gemv(nullptr, bytes, 8, 8, 8, 2, 9), "rows");
  fails(gemv(nullptr, bytes, 7, 8, 8, 2, 1), "ld_w");
  fails(gemv(nullptr, bytes, 8, 8, 8, 9, 1), "k_max");
  fails(gemv(nullptr, bytes, 8, 65535 * 128 + 1, 8, 2, 1), "65535 ranges");  // the grid's y limit
  REQUIRE(gemv(nullptr, bytes, 8, 65535 * 128, 8, 2, 1) == status::success);
  // The query: one fp32 partial per (column range of 128, row, output).
  REQUIRE(gemv(nullptr, bytes, 4096, 14336, 4096, 7168, 8) == status::success);
  CHECK(bytes == std::size_t{112} * 8 * 4096 * sizeof(float));
  std::size_t short_bytes = bytes - 1;
  fails(gemv(reinterpret_cast<void*>(std::uintptr_t{32768}), short_bytes, 4096, 14336, 4096, 7168, 8), "smaller");
  // Partial sums are stored as floats: temp must be float-aligned.
  fails(gemv(reinterpret_cast<void*>(std::uintptr_t{32770}), bytes, 4096, 14336, 4096, 7168, 8), "float-aligned");
}
