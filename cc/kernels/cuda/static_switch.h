// Runtime-to-compile-time dispatch for the CUDA kernels. Each macro turns a runtime value into a
// constexpr visible inside the lambda body that follows, e.g.
//   BOOL_SWITCH(params.causal, kCausal, [&] { run<kCausal>(params); });
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cutlass/numeric_types.h"

#include "cc/kernels/cuda/headdims.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

// The kernels are compiled for the head dims of headdims.h (the key head dim and the value head dim both round
// up to one of them; the unused columns are zero-filled). Define TF_FLASH_CUDA_REDUCED (CI) to compile only the
// reduced set: everything else is then reported as unsupported instead of failing to link.
#ifdef TF_FLASH_CUDA_REDUCED
#define TF_FLASH_HEADDIM_COMPILED(d) TF_FLASH_HEADDIM_REDUCED(d)
#else
#define TF_FLASH_HEADDIM_COMPILED(d) TF_FLASH_HEADDIM_LISTED(d)
#endif

// Smallest compiled head dim >= d, or 0 when d exceeds the largest one.
constexpr int tf_flash_round_headdim(int d) {
  for (int listed : tf_flash::cuda::kListedHeadDims) {
    if (d <= listed && TF_FLASH_HEADDIM_COMPILED(listed)) return listed;
  }
  return 0;
}

// The compiled head dim that runs params p, forward and backward: max(head_dim, head_dim_v) rounded up.
inline int tf_flash_kernel_headdim(const tf_flash::FlashFwdParams& p) {
  return tf_flash_round_headdim(p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v);
}

// The compiled Hopper head dim that runs an fp8 forward (the Hopper forward is its only kernel): the smallest of
// headdims.h's Hopper head dims >= max(head_dim, head_dim_v), or 0.
inline int tf_flash_fp8_kernel_headdim(const tf_flash::FlashFwdParams& p) {
  const int d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  for (int listed : tf_flash::cuda::kListedHeadDims) {
    if (d <= listed && TF_FLASH_HEADDIM_SM90(listed) && TF_FLASH_HEADDIM_COMPILED(listed)) return listed;
  }
  return 0;
}

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

// DTYPE is a tf_flash::DType; ELEM becomes cutlass::half_t or cutlass::bfloat16_t. float32 is not a
// kernel element type (the caller reports it unsupported before dispatching).
#define FP16_BF16_SWITCH(DTYPE, ELEM, ...)               \
  [&] {                                                  \
    if ((DTYPE) == ::tf_flash::DType::kFloat16) {        \
      using ELEM = cutlass::half_t;                      \
      return __VA_ARGS__();                              \
    } else {                                             \
      using ELEM = cutlass::bfloat16_t;                  \
      return __VA_ARGS__();                              \
    }                                                    \
  }()

namespace tf_flash {
namespace cuda {

// The one head-dim and dtype dispatch of the CUDA entry points, forward and backward: runs
// launch(Element{}, std::integral_constant<int, kHeadDim>{}) for the compiled kernel of (dtype,
// tf_flash_kernel_headdim(p)) and returns its status; cudaErrorInvalidValue when none is compiled.
template <class Launch>
cudaError_t dispatch_kernel(const FlashFwdParams& p, DType dtype, Launch&& launch) {
  cudaError_t err = cudaErrorInvalidValue;
  FP16_BF16_SWITCH(dtype, Element, [&] {
    visit_headdim(tf_flash_kernel_headdim(p), [&](auto head_dim) {
      if constexpr (TF_FLASH_HEADDIM_COMPILED(decltype(head_dim)::value)) err = launch(Element{}, head_dim);
    });
  });
  return err;
}

// The kernels' global accesses are 16-byte vectors.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace cuda
}  // namespace tf_flash
