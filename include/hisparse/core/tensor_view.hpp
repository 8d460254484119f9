#pragma once
// Non-owning strided tensor views. Trivially copyable, so they pass by value
// into kernels; extents and strides are int64 so no view of a 256K-token
// cache can overflow its offsets (int32 is reserved for token indices).

#include <cstdint>
#include <type_traits>

#include "hisparse/core/macros.hpp"

namespace hisparse {

template <class T, int Rank>
struct tensor_view {
  static_assert(Rank >= 1, "tensor_view needs at least one dimension");
  using element_type = T;
  static constexpr int rank = Rank;

  T* data = nullptr;
  // Plain arrays rather than std::array: std::array's accessors are not
  // __device__, and kernels index these.
  std::int64_t extents[Rank] = {};
  std::int64_t strides[Rank] = {};  ///< in elements, not bytes

  /// A contiguous (row-major) view over `data` with the given extents.
  template <class... Ext>
  HISPARSE_HOST_DEVICE static constexpr tensor_view contiguous(T* data, Ext... ext) {
    static_assert(sizeof...(Ext) == Rank, "tensor_view::contiguous: give Rank extents");
    tensor_view v;
    v.data = data;
    const std::int64_t e[] = {static_cast<std::int64_t>(ext)...};
    for (int i = 0; i < Rank; ++i) v.extents[i] = e[i];
    std::int64_t stride = 1;
    for (int i = Rank - 1; i >= 0; --i) {
      v.strides[i] = stride;
      stride *= v.extents[i];
    }
    return v;
  }

  HISPARSE_HOST_DEVICE constexpr std::int64_t extent(int i) const { return extents[i]; }
  HISPARSE_HOST_DEVICE constexpr std::int64_t stride(int i) const { return strides[i]; }

  HISPARSE_HOST_DEVICE constexpr std::int64_t size() const {
    std::int64_t n = 1;
    for (int i = 0; i < Rank; ++i) n *= extents[i];
    return n;
  }

  HISPARSE_HOST_DEVICE constexpr bool is_contiguous() const {
    std::int64_t stride = 1;
    for (int i = Rank - 1; i >= 0; --i) {
      if (extents[i] != 1 && strides[i] != stride) return false;
      stride *= extents[i];
    }
    return true;
  }

  template <class... Idx>
  HISPARSE_HOST_DEVICE constexpr std::int64_t offset(Idx... idx) const {
    static_assert(sizeof...(Idx) == Rank, "tensor_view: wrong number of indices");
    const std::int64_t i[] = {static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (int d = 0; d < Rank; ++d) off += i[d] * strides[d];
    return off;
  }

  template <class... Idx>
  HISPARSE_HOST_DEVICE constexpr T& operator()(Idx... idx) const {
    return data[offset(idx...)];
  }

  /// Pointer to the innermost row at the given leading indices (the last
  /// dimension must be contiguous for the row to be usable as a span).
  template <class... Idx>
  HISPARSE_HOST_DEVICE constexpr T* row(Idx... idx) const {
    static_assert(sizeof...(Idx) == Rank - 1, "tensor_view::row: give Rank-1 indices");
    return data + offset(idx..., 0);
  }

  /// Implicit view-of-const conversion.
  template <class U = T>
    requires(!std::is_const_v<U>)
  HISPARSE_HOST_DEVICE constexpr operator tensor_view<const U, Rank>() const {
    tensor_view<const U, Rank> v;
    v.data = data;
    for (int i = 0; i < Rank; ++i) {
      v.extents[i] = extents[i];
      v.strides[i] = strides[i];
    }
    return v;
  }
};

static_assert(std::is_trivially_copyable_v<tensor_view<float, 3>>);

}  // namespace hisparse
