#pragma once
// What every op of the extension shares: tensor checks that say what was
// wrong, the element-type mapping, the current stream, and the step from a
// library status to a Python exception. Only LibTorch's stable ABI is used
// (torch/csrc/stable), so the built extension loads on later torch releases.
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <hisparse/core/status.hpp>

namespace hisparse::torch_ops {

using Tensor = torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

/// Raises a Python RuntimeError with the library's reason for a failure.
inline void check(status s, const char* op) {
  STD_TORCH_CHECK(s == status::success, "hisparse.", op, ": ", to_string(s), ": ", last_error());
}

inline const char* name_of(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Double: return "float64";
    default: return "another dtype";
  }
}

/// Checks a tensor's rank, dtype and that its rows are dense (the last
/// dimension contiguous); `what` names it in the message.
inline void expect(const Tensor& t, const char* op, const char* what, int dim, ScalarType type) {
  STD_TORCH_CHECK(t.dim() == dim, "hisparse.", op, ": ", what, " must have ", dim, " dimensions (got ", t.dim(), ")");
  STD_TORCH_CHECK(t.scalar_type() == type, "hisparse.", op, ": ", what, " must be ", name_of(type), " (got ",
                  name_of(t.scalar_type()), ")");
  STD_TORCH_CHECK(dim == 0 || t.stride(dim - 1) == 1 || t.size(dim - 1) <= 1, "hisparse.", op, ": ", what,
                  "'s last dimension must be contiguous");
}

inline void expect_contiguous(const Tensor& t, const char* op, const char* what) {
  STD_TORCH_CHECK(t.is_contiguous(), "hisparse.", op, ": ", what, " must be contiguous");
}

inline void expect_same_device(const Tensor& a, const Tensor& b, const char* op, const char* what) {
  STD_TORCH_CHECK(a.is_cuda() == b.is_cuda() && a.get_device_index() == b.get_device_index(), "hisparse.", op,
                  ": ", what, " must be on the same device as the first input");
}

/// The stream torch would run work for `t`'s device on (captured streams
/// included), with that device made current for the launches that follow.
inline cudaStream_t current_stream(const Tensor& t) {
  void* s = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &s));
  return static_cast<cudaStream_t>(s);
}

template <class T>
T* data(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

/// Calls f with a null pointer of the CUDA element type of a 16-bit tensor.
template <class F>
decltype(auto) with_half_type(ScalarType t, const char* op, F&& f) {
  if (t == ScalarType::BFloat16) return f(static_cast<__nv_bfloat16*>(nullptr));
  STD_TORCH_CHECK(t == ScalarType::Half, "hisparse.", op, ": expected float16 or bfloat16 (got ", name_of(t), ")");
  return f(static_cast<__half*>(nullptr));
}

/// Calls f with null pointers of the activation type (fp16/bf16) and the
/// gate type (fp32/fp16/bf16) of activation top-k gating.
template <class F>
void with_gating_types(ScalarType a, ScalarType gate, const char* op, F&& f) {
  with_half_type(a, op, [&](auto* t) {
    if (gate == ScalarType::Float) return f(t, static_cast<float*>(nullptr));
    return with_half_type(gate, op, [&](auto* g) { return f(t, g); });
  });
}

}  // namespace hisparse::torch_ops
