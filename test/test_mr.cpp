// mr/: every resource and adaptor models the concept; the adaptors count and
// limit exactly; device resources work with a device and fail clearly without.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine_resource.hpp"
#include "gpu_test.hpp"
#include "hisparse/mr/device_pool_resource.hpp"
#include "hisparse/mr/limiting_adaptor.hpp"
#include "hisparse/mr/new_delete_resource.hpp"
#include "hisparse/mr/pinned_host_resource.hpp"
#include "hisparse/mr/resource.hpp"
#include "hisparse/mr/statistics_adaptor.hpp"

using namespace hisparse;

namespace {
bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % mr::kAlignment == 0; }
}  // namespace

// Types that almost model the concept (named namespace: only their
// declarations are used, which an anonymous one would warn about).
namespace probes {
struct missing_deallocate {
  static constexpr bool device_accessible = false;
  static constexpr bool host_accessible = true;
  void* allocate(std::size_t, cudaStream_t) { return nullptr; }
  friend bool operator==(const missing_deallocate&, const missing_deallocate&) { return true; }
};
struct missing_equality {
  static constexpr bool device_accessible = false;
  static constexpr bool host_accessible = true;
  void* allocate(std::size_t, cudaStream_t) { return nullptr; }
  void deallocate(void*, std::size_t, cudaStream_t) {}
};
struct runtime_flags {  // flags must be compile-time constants
  static inline bool device_accessible = false;
  static inline bool host_accessible = true;
  void* allocate(std::size_t, cudaStream_t) { return nullptr; }
  void deallocate(void*, std::size_t, cudaStream_t) {}
  friend bool operator==(const runtime_flags&, const runtime_flags&) { return true; }
};
struct wrong_allocate_result {
  static constexpr bool device_accessible = false;
  static constexpr bool host_accessible = true;
  int allocate(std::size_t, cudaStream_t) { return 0; }
  void deallocate(void*, std::size_t, cudaStream_t) {}
  friend bool operator==(const wrong_allocate_result&, const wrong_allocate_result&) { return true; }
};
}  // namespace probes

TEST_CASE("every shipped resource and adaptor models mr::resource", "[mr]") {
  using host = mr::new_delete_resource;
  STATIC_REQUIRE(mr::resource<host>);
  STATIC_REQUIRE(mr::resource<mr::pinned_host_resource>);
  STATIC_REQUIRE(mr::resource<mr::device_pool_resource>);
  STATIC_REQUIRE(mr::resource<mr::statistics_adaptor<host>>);
  STATIC_REQUIRE(mr::resource<mr::limiting_adaptor<host>>);
  STATIC_REQUIRE(mr::resource<mr::limiting_adaptor<mr::statistics_adaptor<mr::device_pool_resource>>>);
  STATIC_REQUIRE(mr::resource<test::engine_resource<host>>);
  STATIC_REQUIRE(mr::resource<test::null_resource>);

  // Who may touch the memory, and adaptors say what their upstream says.
  STATIC_REQUIRE(mr::host_resource<host>);
  STATIC_REQUIRE_FALSE(mr::device_resource<host>);
  STATIC_REQUIRE(mr::device_resource<mr::device_pool_resource>);
  STATIC_REQUIRE_FALSE(mr::host_resource<mr::device_pool_resource>);
  STATIC_REQUIRE(mr::device_resource<mr::pinned_host_resource>);
  STATIC_REQUIRE(mr::host_resource<mr::pinned_host_resource>);
  STATIC_REQUIRE(mr::device_resource<mr::statistics_adaptor<mr::device_pool_resource>>);
  STATIC_REQUIRE_FALSE(mr::device_resource<mr::limiting_adaptor<host>>);
  STATIC_REQUIRE(mr::host_resource<mr::limiting_adaptor<mr::statistics_adaptor<host>>>);

  STATIC_REQUIRE_FALSE(mr::resource<probes::missing_deallocate>);
  STATIC_REQUIRE_FALSE(mr::resource<probes::missing_equality>);
  STATIC_REQUIRE_FALSE(mr::resource<probes::runtime_flags>);
  STATIC_REQUIRE_FALSE(mr::resource<probes::wrong_allocate_result>);
  STATIC_REQUIRE_FALSE(mr::resource<int>);

  // Owning resources are move-only; adaptors hold a count, so they stay put.
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<mr::device_pool_resource>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<mr::device_pool_resource>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<mr::statistics_adaptor<host>>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<mr::limiting_adaptor<host>>);
}

TEST_CASE("new_delete_resource returns aligned, distinct, writable memory", "[mr]") {
  mr::new_delete_resource r;
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256},
                                  std::size_t{4097}, std::size_t{1} << 20}) {
    void* p = r.allocate(bytes, nullptr);
    INFO("bytes " << bytes);
    REQUIRE(p != nullptr);
    CHECK(aligned(p));
    for (const auto& [q, n] : blocks) CHECK(p != q);
    std::memset(p, 0xA5, bytes);
    blocks.emplace_back(p, bytes);
  }
  for (const auto& [p, n] : blocks) r.deallocate(p, n, nullptr);
  CHECK(mr::new_delete_resource{} == r);
}

TEST_CASE("statistics_adaptor counts current, peak and total bytes", "[mr]") {
  mr::new_delete_resource host;
  mr::statistics_adaptor stats(host);
  CHECK(&stats.upstream() == &host);
  CHECK(stats.stats().current_bytes == 0);

  void* a = stats.allocate(1000, nullptr);
  void* b = stats.allocate(3000, nullptr);
  auto s = stats.stats();
  CHECK(s.current_bytes == 4000);
  CHECK(s.peak_bytes == 4000);
  CHECK(s.total_bytes == 4000);
  CHECK(s.allocations == 2);
  CHECK(s.current_allocations == 2);

  stats.deallocate(b, 3000, nullptr);
  void* c = stats.allocate(500, nullptr);
  s = stats.stats();
  CHECK(s.current_bytes == 1500);
  CHECK(s.peak_bytes == 4000);  // the peak remembers
  CHECK(s.total_bytes == 4500);
  CHECK(s.allocations == 3);
  CHECK(s.deallocations == 1);
  CHECK(s.current_allocations == 2);

  stats.deallocate(a, 1000, nullptr);
  stats.deallocate(c, 500, nullptr);
  s = stats.stats();
  CHECK(s.current_bytes == 0);
  CHECK(s.peak_bytes == 4000);
  CHECK(s.deallocations == 3);
  CHECK(s.current_allocations == 0);

  // Equality is identity: another adaptor on the same upstream keeps its own count.
  mr::statistics_adaptor other(host);
  CHECK(stats == stats);
  CHECK_FALSE(stats == other);
}

TEST_CASE("statistics_adaptor does not count failed allocations", "[mr]") {
  mr::new_delete_resource host;
  mr::limiting_adaptor limited(host, 1024);
  mr::statistics_adaptor stats(limited);
  void* p = stats.allocate(1024, nullptr);
  CHECK_THROWS_AS(stats.allocate(1, nullptr), error);
  const auto s = stats.stats();
  CHECK(s.allocations == 1);
  CHECK(s.current_bytes == 1024);
  CHECK(s.total_bytes == 1024);
  stats.deallocate(p, 1024, nullptr);
  CHECK(stats.stats().current_bytes == 0);
}

TEST_CASE("limiting_adaptor refuses above its limit without calling upstream", "[mr]") {
  mr::new_delete_resource host;
  test::engine_resource counted(host);
  mr::limiting_adaptor limited(counted, 10'000);
  CHECK(limited.limit() == 10'000);
  CHECK(&limited.upstream() == &counted);

  void* a = limited.allocate(6'000, nullptr);
  void* b = limited.allocate(4'000, nullptr);  // exactly at the limit is fine
  CHECK(limited.used() == 10'000);
  CHECK(counted.allocate_calls == 2);

  try {
    (void)limited.allocate(1, nullptr);
    FAIL("allocation above the limit succeeded");
  } catch (const error& e) {
    CHECK(e.code() == status::out_of_memory);
    CHECK_THAT(e.what(), Catch::Contains("requested 1 bytes") && Catch::Contains("10000 bytes in use") &&
                             Catch::Contains("limit of 10000 bytes"));
  }
  CHECK(counted.allocate_calls == 2);  // the upstream never saw the request
  CHECK(limited.used() == 10'000);

  limited.deallocate(b, 4'000, nullptr);
  CHECK(limited.used() == 6'000);
  void* c = limited.allocate(3'000, nullptr);  // freeing made room
  CHECK(limited.used() == 9'000);
  CHECK_THROWS_AS(limited.allocate(SIZE_MAX, nullptr), error);  // no wrap-around
  limited.deallocate(a, 6'000, nullptr);
  limited.deallocate(c, 3'000, nullptr);
  CHECK(limited.used() == 0);
  CHECK(counted.bytes_in_use == 0);
  CHECK(counted.deallocate_calls == 3);
}

TEST_CASE("adaptors keep exact counts under concurrent use", "[mr]") {
  mr::new_delete_resource host;
  mr::statistics_adaptor stats(host);
  constexpr int kThreads = 4, kRounds = 2000;
  constexpr std::size_t kBytes = 512;
  // Exactly two blocks per thread: a race that let two threads reserve the
  // same headroom would make some thread's allocation throw.
  mr::limiting_adaptor limited(stats, kThreads * 2 * kBytes);
  std::atomic<int> refusals{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        try {
          void* p = limited.allocate(kBytes, nullptr);
          void* q = limited.allocate(kBytes, nullptr);
          limited.deallocate(p, kBytes, nullptr);
          limited.deallocate(q, kBytes, nullptr);
        } catch (const error&) {
          ++refusals;  // a leaked block would show in the counts below too
        }
      }
    });
  for (auto& th : threads) th.join();
  CHECK(refusals.load() == 0);
  const auto s = stats.stats();
  CHECK(s.allocations == kThreads * kRounds * 2);
  CHECK(s.deallocations == s.allocations);
  CHECK(s.current_bytes == 0);
  CHECK(s.peak_bytes <= limited.limit());
  CHECK(limited.used() == 0);
}

TEST_CASE("device resources allocate with a device and fail clearly without one", "[mr]") {
  if (!test::have_gpu()) {
    // No device here: construction and allocation throw hisparse::error with
    // the runtime's reason, never crash or return null.
    try {
      mr::device_pool_resource pool;
      FAIL("device_pool_resource constructed without a device");
    } catch (const error& e) {
      CHECK(e.code() == status::cuda_error);
      CHECK_THAT(e.what(), Catch::Contains("failed"));
    }
    mr::pinned_host_resource pinned;
    CHECK_THROWS_AS(pinned.allocate(4096, nullptr), error);
    return;
  }
  mr::device_pool_resource pool;
  cudaStream_t stream = nullptr;
  HISPARSE_CUDA_CHECK(cudaStreamCreate(&stream));
  void* p = pool.allocate(std::size_t{1} << 20, stream);
  CHECK(aligned(p));
  HISPARSE_CUDA_CHECK(cudaMemsetAsync(p, 0, std::size_t{1} << 20, stream));
  pool.deallocate(p, std::size_t{1} << 20, stream);
  try {
    (void)pool.allocate(std::size_t{1} << 50, stream);  // a petabyte: no device has it
    FAIL("a petabyte allocation succeeded");
  } catch (const error& e) {
    CHECK(e.code() == status::out_of_memory);
    CHECK_THAT(e.what(), Catch::Contains(std::to_string(std::size_t{1} << 50)));
  }
  CHECK(cudaGetLastError() == cudaSuccess);  // the failure did not linger
  mr::device_pool_resource moved(std::move(pool));
  void* q = moved.allocate(256, stream);
  moved.deallocate(q, 256, stream);
  HISPARSE_CUDA_CHECK(cudaStreamSynchronize(stream));

  mr::pinned_host_resource pinned;
  auto* h = static_cast<unsigned char*>(pinned.allocate(4096, stream));
  CHECK(aligned(h));
  h[4095] = 7;
  pinned.deallocate(h, 4096, stream);
  HISPARSE_CUDA_CHECK(cudaStreamDestroy(stream));
}
