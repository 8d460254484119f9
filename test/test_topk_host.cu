// batched_topk's host side needs no device: the temp-size query and every
// argument check answer before any CUDA call, so they are CPU tests.
#include <catch2/catch.hpp>

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
