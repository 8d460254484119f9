#pragma once
// The memory-resource concept (DESIGN.md section 3). Nothing in HiSparse calls
// cudaMalloc on its own: whatever allocates takes a resource, so a serving
// engine can hand the library the pool that already owns its GPU. A resource
// is a concept, not a virtual base, so a call through it is an ordinary
// (inlinable) call and an engine's type needs no HiSparse base class.
//
// The contract, written down once; every resource and adaptor follows it.
//
//  * `r.allocate(bytes, s)` returns memory that work on stream `s` may use at
//    once; work on any other stream may use it only after that stream has
//    synchronized with `s` (an event, or a full synchronization).
//  * `r.deallocate(p, bytes, s)` may be called while work on `s` that uses `p`
//    is still queued: the memory is reused only after that work. Work on other
//    streams that uses `p` must be ordered before that point on `s` by the
//    caller. `bytes` is the size passed to the matching allocate.
//  * A synchronous resource ignores the stream: its memory is usable anywhere
//    as soon as allocate returns. One whose memory the device can reach still
//    keeps the deallocate rule above (it waits for `s` before freeing).
//  * allocate never returns null. On failure it throws
//    `hisparse::error(status::out_of_memory, reason)`, the reason naming the
//    size; any other runtime failure is `hisparse::error(status::cuda_error)`.
//    A request for 0 bytes returns a valid pointer that must be deallocated
//    like any other.
//  * Every pointer is aligned to at least kAlignment (256) bytes: the
//    alignment cudaMalloc guarantees, enough for any vector access and for the
//    TMA, so fixed-size pages that are multiples of it stay aligned too.
//  * `a == b` is true when memory allocated from `a` may be deallocated
//    through `b`.
//  * `R::device_accessible` / `R::host_accessible` say, at compile time, who
//    may dereference the memory, so a kernel cannot be handed host-only memory
//    by accident.
//
// Resources are not copied by the containers that use them: a container
// keeps a reference, and the resource must outlive it.

#include <concepts>
#include <cstddef>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "hisparse/core/macros.hpp"

namespace hisparse::mr {

/// Alignment of every pointer a resource returns (see the contract above).
inline constexpr std::size_t kAlignment = 256;

/// A type that allocates and frees memory under the contract above.
template <class R>
concept resource = std::equality_comparable<R> &&
    requires(R& r, void* p, std::size_t bytes, cudaStream_t stream) {
      { r.allocate(bytes, stream) } -> std::same_as<void*>;
      r.deallocate(p, bytes, stream);
      // Compile-time constants, so the checks below can be static.
      typename std::bool_constant<R::device_accessible>;
      typename std::bool_constant<R::host_accessible>;
      requires std::same_as<std::remove_cv_t<decltype(R::device_accessible)>, bool>;
      requires std::same_as<std::remove_cv_t<decltype(R::host_accessible)>, bool>;
    };

/// A resource whose memory kernels may read and write.
template <class R>
concept device_resource = resource<R> && R::device_accessible;

/// A resource whose memory host code may read and write.
template <class R>
concept host_resource = resource<R> && R::host_accessible;

}  // namespace hisparse::mr
