#pragma once
// Test helpers: what a paged cache holds for one (sequence, layer), copied to
// the host through its device view (kv::paged_kv_ref), the way a kernel
// finds it. Synchronous (the whole device), for tests only.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/kv/fp8.hpp"
#include "hisparse/kv/paged_kv_ref.hpp"

namespace hisparse::test {

/// The stored length of (slot, layer), as the kernels read it.
inline std::int32_t device_length(const kv::summary_ref& r, int slot, int layer) {
  HISPARSE_CUDA_CHECK(cudaDeviceSynchronize());
  std::int32_t len = -1;
  HISPARSE_CUDA_CHECK(cudaMemcpy(&len, r.lengths + r.seq_layer(slot, layer), sizeof(len), cudaMemcpyDeviceToHost));
  return len;
}

/// Keys and values as contiguous [length][kv_heads][head_dim].
template <class T>
void download_kv(const kv::paged_kv_ref<T>& r, int slot, int layer, std::vector<T>& keys, std::vector<T>& values) {
  const std::int64_t len = device_length(r, slot, layer);
  const int F = r.fine_slice, H = r.kv_heads, D = r.head_dim;
  const std::int64_t slices = (len + F - 1) / F;
  std::vector<T*> pages(static_cast<std::size_t>(slices));
  HISPARSE_CUDA_CHECK(cudaMemcpy(pages.data(), r.page_table + r.table_index(r.seq_layer(slot, layer), 0),
                                 pages.size() * sizeof(T*), cudaMemcpyDeviceToHost));
  keys.assign(static_cast<std::size_t>(len * H * D), T{});
  values.assign(keys.size(), T{});
  for (std::int64_t sl = 0; sl < slices; ++sl) {
    const std::int64_t rows = std::min<std::int64_t>(F, len - sl * F);
    for (int h = 0; h < H; ++h)
      for (int kv = 0; kv < 2; ++kv) {
        T* dst = (kv == 0 ? keys : values).data() + (sl * F * H + h) * D;
        const T* src = pages[static_cast<std::size_t>(sl)] + h * r.head_tile_elems() + kv * r.value_offset();
        HISPARSE_CUDA_CHECK(cudaMemcpy2D(dst, sizeof(T) * H * D, src, sizeof(T) * D, sizeof(T) * D,
                                         static_cast<std::size_t>(rows), cudaMemcpyDeviceToHost));
      }
  }
}

/// FP8 pages (kv/fp8.hpp): every stored row's codes and scale, as
/// [length][kv_heads][head_dim] codes and [length][kv_heads] scales.
inline void download_fp8_kv(const kv::paged_kv_ref<kv::fp8_e4m3>& r, int slot, int layer,
                            std::vector<kv::fp8_e4m3> (&codes)[2], std::vector<float> (&scales)[2]) {
  const std::int64_t len = device_length(r, slot, layer);
  const int F = r.fine_slice, H = r.kv_heads, D = r.head_dim;
  const std::int64_t slices = (len + F - 1) / F;
  std::vector<kv::fp8_e4m3*> pages(static_cast<std::size_t>(slices));
  HISPARSE_CUDA_CHECK(cudaMemcpy(pages.data(), r.page_table + r.table_index(r.seq_layer(slot, layer), 0),
                                 pages.size() * sizeof(pages[0]), cudaMemcpyDeviceToHost));
  const std::size_t page_bytes = static_cast<std::size_t>(r.page_elems()) + 2 * H * F * sizeof(float);
  std::vector<unsigned char> page(page_bytes);
  for (int kv = 0; kv < 2; ++kv) {
    codes[kv].assign(static_cast<std::size_t>(len * H * D), kv::fp8_e4m3{});
    scales[kv].assign(static_cast<std::size_t>(len * H), 0.0f);
  }
  for (std::int64_t sl = 0; sl < slices; ++sl) {
    HISPARSE_CUDA_CHECK(cudaMemcpy(page.data(), pages[static_cast<std::size_t>(sl)], page_bytes, cudaMemcpyDeviceToHost));
    const auto* p = reinterpret_cast<const kv::fp8_e4m3*>(page.data());
    for (std::int64_t t = sl * F; t < std::min(len, (sl + 1) * F); ++t)
      for (int h = 0; h < H; ++h)
        for (int kv = 0; kv < 2; ++kv) {
          const std::int64_t row = (kv * H + h) * F + (t - sl * F);
          std::memcpy(codes[kv].data() + (t * H + h) * D, p + row * D, static_cast<std::size_t>(D));
          std::memcpy(&scales[kv][static_cast<std::size_t>(t * H + h)], page.data() + r.page_elems() + row * 4, 4);
        }
  }
}

/// The fp32 slice sums [ceil(length/F)][kv_heads][head_dim] and block sums
/// [ceil(length/C)][kv_heads][head_dim], and the stored length.
inline void download_summaries(const kv::summary_ref& r, int slot, int layer, std::vector<float>& slice_sums,
                               std::vector<float>& block_sums, std::int32_t& length) {
  length = device_length(r, slot, layer);
  const std::int64_t seq_layer = r.seq_layer(slot, layer);
  slice_sums.resize(static_cast<std::size_t>((length + r.fine_slice - 1) / r.fine_slice * r.row_stride()));
  block_sums.resize(static_cast<std::size_t>((length + r.coarse_block - 1) / r.coarse_block * r.row_stride()));
  HISPARSE_CUDA_CHECK(cudaMemcpy(slice_sums.data(), r.slice_sums + r.slice_row(seq_layer, 0),
                                 slice_sums.size() * sizeof(float), cudaMemcpyDeviceToHost));
  HISPARSE_CUDA_CHECK(cudaMemcpy(block_sums.data(), r.block_sums + r.block_row(seq_layer, 0),
                                 block_sums.size() * sizeof(float), cudaMemcpyDeviceToHost));
}

/// The cache's fine summary rows of kind K, [ceil(length/F)][kv_heads]
/// [head_dim]; throws unless the cache keeps them.
template <fine_summary K>
std::vector<typename kv::fine_summary_traits<K>::element> download_fine_rows(const kv::summary_ref& r, int slot,
                                                                             int layer) {
  if (!r.keeps(K))
    throw error(status::invalid_argument, "the cache keeps no " + std::string(name_of(K)) + " rows");
  const std::int64_t len = device_length(r, slot, layer);
  std::vector<typename kv::fine_summary_traits<K>::element> rows(
      static_cast<std::size_t>((len + r.fine_slice - 1) / r.fine_slice * r.row_stride()));
  HISPARSE_CUDA_CHECK(cudaMemcpy(rows.data(), r.template rows<K>() + r.slice_row(r.seq_layer(slot, layer), 0),
                                 rows.size() * sizeof(rows[0]), cudaMemcpyDeviceToHost));
  return rows;
}

/// The cache's block key bounds, [ceil(length/C)][kv_heads][head_dim];
/// throws unless the cache keeps them.
inline std::vector<std::uint32_t> download_block_bounds(const kv::summary_ref& r, int slot, int layer) {
  if (!r.keeps(coarse_summary::key_bounds)) throw error(status::invalid_argument, "the cache keeps no block bounds");
  const std::int64_t len = device_length(r, slot, layer);
  std::vector<std::uint32_t> rows(static_cast<std::size_t>((len + r.coarse_block - 1) / r.coarse_block * r.row_stride()));
  HISPARSE_CUDA_CHECK(cudaMemcpy(rows.data(), r.block_bounds + r.block_row(r.seq_layer(slot, layer), 0),
                                 rows.size() * sizeof(rows[0]), cudaMemcpyDeviceToHost));
  return rows;
}

}  // namespace hisparse::test
