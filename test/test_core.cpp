// core/: status and errors, dtype conversions, tensor views.
#include <catch2/catch.hpp>

#include <cmath>
#include <type_traits>
#include <vector>

#include "hisparse/core/dtype.hpp"
#include "hisparse/core/status.hpp"
#include "hisparse/core/tensor_view.hpp"

using namespace hisparse;

namespace {
status failing_cuda_call() {
  HISPARSE_CUDA_TRY(cudaErrorInvalidValue);
  return status::success;
}
status nested() {
  HISPARSE_TRY(failing_cuda_call());
  return status::internal_error;  // not reached
}
}  // namespace

TEST_CASE("status names are distinct and stable", "[core]") {
  CHECK(std::string(to_string(status::success)) == "success");
  CHECK(std::string(to_string(status::invalid_argument)) == "invalid argument");
  CHECK(std::string(to_string(status::out_of_memory)) == "out of memory");
  CHECK(std::string(to_string(status::cuda_error)) == "CUDA error");
}

TEST_CASE("error carries the code and the reason", "[core]") {
  const error e(status::unsupported, "head_dim 96");
  CHECK(e.code() == status::unsupported);
  CHECK(std::string(e.what()) == "unsupported: head_dim 96");
}

TEST_CASE("CUDA failures become a status with file, line and call", "[core]") {
  CHECK(nested() == status::cuda_error);
  CHECK_THAT(last_error(), Catch::Contains("test_core.cpp") && Catch::Contains("cudaErrorInvalidValue") &&
                               Catch::Contains("failed"));
  CHECK_THROWS_AS(throw_if_error(nested()), error);
  CHECK_THROWS_WITH([] { HISPARSE_CUDA_CHECK(cudaErrorMemoryAllocation); }(),
                    Catch::Contains("cudaErrorMemoryAllocation"));
  CHECK_NOTHROW(throw_if_error(status::success));
}

TEST_CASE("fail records the reason for last_error", "[core]") {
  const status s = fail(status::out_of_memory, "pool exhausted");
  CHECK(s == status::out_of_memory);
  CHECK(last_error() == "pool exhausted");
  CHECK_THROWS_WITH(throw_if_error(s), "out of memory: pool exhausted");
}

TEST_CASE("dtype sizes, names and tags agree", "[core]") {
  CHECK(size_of(dtype::bf16) == sizeof(__nv_bfloat16));
  CHECK(size_of(dtype::fp16) == sizeof(__half));
  CHECK(size_of(dtype::fp32) == 4);
  CHECK(size_of(dtype::fp64) == 8);
  CHECK(name_of(dtype::bf16) == "bf16");
  STATIC_REQUIRE(dtype_of_v<bf16_t::type> == bf16_t::id);
  STATIC_REQUIRE(dtype_of_v<const __half> == dtype::fp16);
  STATIC_REQUIRE(is_element_type_v<float>);
  STATIC_REQUIRE_FALSE(is_element_type_v<int>);
}

TEST_CASE("narrowing conversions round to nearest even", "[core]") {
  // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7.
  CHECK(round_to<__nv_bfloat16>(1.0f + 0x1.0p-8f) == 1.0f);
  CHECK(round_to<__nv_bfloat16>(1.0f + 3 * 0x1.0p-8f) == 1.0f + 0x1.0p-6f);
  // fp16 keeps 11 significant bits.
  CHECK(round_to<__half>(1.0f + 0x1.0p-11f) == 1.0f);
  CHECK(round_to<__half>(2049.0f) == 2048.0f);
  CHECK(round_to<float>(0.1f) == 0.1f);
  for (const float x : {0.5f, -3.25f, 1024.0f}) {
    CHECK(to_double(from_float<__nv_bfloat16>(x)) == x);
    CHECK(to_float(from_float<__half>(x)) == x);
  }
  CHECK(std::isnan(to_float(from_float<__nv_bfloat16>(NAN))));
  CHECK(std::isinf(to_float(from_float<__half>(1e6f))));  // overflows fp16's range
}

TEST_CASE("contiguous tensor views index row-major", "[core]") {
  std::vector<int> buf(2 * 3 * 4);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<int>(i) + 1;
  const auto v = tensor_view<int, 3>::contiguous(buf.data(), 2, 3, 4);
  CHECK(v.size() == 24);
  CHECK(v.stride(0) == 12);
  CHECK(v.stride(1) == 4);
  CHECK(v.stride(2) == 1);
  CHECK(v.is_contiguous());
  CHECK(v(1, 2, 3) == 24);
  CHECK(v(0, 1, 0) == 5);
  CHECK(v.row(1, 0) == buf.data() + 12);
  const tensor_view<const int, 3> cv = v;
  CHECK(cv(1, 0, 2) == 15);
  STATIC_REQUIRE(std::is_trivially_copyable_v<tensor_view<const int, 3>>);
}

TEST_CASE("strided tensor views see transposed and sliced data", "[core]") {
  std::vector<float> buf(6 * 5);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i) + 0.5f;
  auto m = tensor_view<float, 2>::contiguous(buf.data(), 6, 5);
  tensor_view<float, 2> t;  // transpose
  t.data = buf.data();
  t.extents[0] = 5; t.extents[1] = 6;
  t.strides[0] = 1; t.strides[1] = 5;
  CHECK_FALSE(t.is_contiguous());
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 5; ++j) REQUIRE(t(j, i) == m(i, j));
  tensor_view<float, 2> every_other = m;  // rows 0, 2, 4
  every_other.extents[0] = 3;
  every_other.strides[0] = 10;
  CHECK(every_other(2, 1) == m(4, 1));
}
