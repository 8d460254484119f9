#pragma once
// Status codes, the library's exception, and the error-checking macros.
//
// Two error channels, one vocabulary (DESIGN.md section 5):
//  * launch functions return `[[nodiscard]] status`; the human-readable reason
//    of the most recent failure on this thread is kept in `last_error()`, the
//    way the CUDA runtime keeps its last error;
//  * host conveniences throw `hisparse::error`, which carries both the code
//    and the reason.
// Nothing here depends on NDEBUG: checks are never compiled out.

#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "hisparse/core/macros.hpp"

namespace hisparse {

enum class status : int {
  success = 0,
  invalid_argument,   ///< a caller-supplied value breaks a documented constraint
  unsupported,        ///< valid, but not implemented for this shape/dtype/arch
  out_of_memory,      ///< a resource or pool could not satisfy a request
  cuda_error,         ///< the CUDA runtime reported a failure
  internal_error,     ///< a library invariant was broken (a bug: please report)
};

[[nodiscard]] constexpr const char* to_string(status s) noexcept {
  switch (s) {
    case status::success: return "success";
    case status::invalid_argument: return "invalid argument";
    case status::unsupported: return "unsupported";
    case status::out_of_memory: return "out of memory";
    case status::cuda_error: return "CUDA error";
    case status::internal_error: return "internal error";
  }
  return "unknown status";
}

/// The exception thrown by host conveniences: a status plus the reason.
class error : public std::runtime_error {
 public:
  error(status code, const std::string& reason)
      : std::runtime_error(std::string(to_string(code)) + ": " + reason), code_(code) {}
  [[nodiscard]] status code() const noexcept { return code_; }

 private:
  status code_;
};

namespace detail {
inline std::string& last_error_slot() {
  thread_local std::string reason;
  return reason;
}
}  // namespace detail

/// Reason for the most recent non-success status returned on this thread.
[[nodiscard]] inline const std::string& last_error() { return detail::last_error_slot(); }

/// Records `reason` as this thread's last error and returns `code`, so a
/// status-returning function can write `return fail(status::..., "...")`.
[[nodiscard]] inline status fail(status code, std::string reason) {
  detail::last_error_slot() = std::move(reason);
  return code;
}

/// Turns a status into an exception (for host conveniences built on
/// status-returning functions).
inline void throw_if_error(status s) {
  if (s != status::success) throw error(s, last_error());
}

namespace detail {
inline std::string cuda_failure_reason(cudaError_t e, const char* expr, const char* file,
                                       int line) {
  return std::string(file) + ":" + std::to_string(line) + ": " + expr + " failed: " +
         cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}
}  // namespace detail

}  // namespace hisparse

/// Evaluates a CUDA runtime call; throws hisparse::error(cuda_error) with the
/// call, file and line on failure. For host conveniences.
#define HISPARSE_CUDA_CHECK(expr)                                                         \
  do {                                                                                    \
    const cudaError_t hisparse_cuda_err_ = (expr);                                        \
    if (hisparse_cuda_err_ != cudaSuccess)                                                \
      throw ::hisparse::error(::hisparse::status::cuda_error,                             \
                              ::hisparse::detail::cuda_failure_reason(                    \
                                  hisparse_cuda_err_, #expr, __FILE__, __LINE__));        \
  } while (0)

/// Evaluates a CUDA runtime call; on failure records the reason and returns
/// status::cuda_error from the enclosing status-returning function.
#define HISPARSE_CUDA_TRY(expr)                                                           \
  do {                                                                                    \
    const cudaError_t hisparse_cuda_err_ = (expr);                                        \
    if (hisparse_cuda_err_ != cudaSuccess)                                                \
      return ::hisparse::fail(::hisparse::status::cuda_error,                             \
                              ::hisparse::detail::cuda_failure_reason(                    \
                                  hisparse_cuda_err_, #expr, __FILE__, __LINE__));        \
  } while (0)

/// Propagates a non-success status from a nested status-returning call.
#define HISPARSE_TRY(expr)                                                                \
  do {                                                                                    \
    const ::hisparse::status hisparse_status_ = (expr);                                   \
    if (hisparse_status_ != ::hisparse::status::success) return hisparse_status_;         \
  } while (0)
