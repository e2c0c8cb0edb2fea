// Runtime-to-compile-time dispatch for the CUDA kernels. Each macro turns a runtime value into a
// constexpr visible inside the lambda body that follows, e.g.
//   BOOL_SWITCH(params.causal, kCausal, [&] { run<kCausal>(params); });
// Which head dims are compiled is decided here, once, for the forward and the backward.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cutlass/numeric_types.h"

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

// The kernels are compiled for these head dims (the key head dim and the value head dim both round up to
// one of them; the unused columns are zero-filled). Define TF_FLASH_CUDA_REDUCED (CI) to compile only 64
// and 128: everything else is then reported as unsupported instead of failing to link.
#ifdef TF_FLASH_CUDA_REDUCED
#define TF_FLASH_HEADDIM_COMPILED(d) ((d) == 64 || (d) == 128)
#else
#define TF_FLASH_HEADDIM_COMPILED(d) ((d) == 32 || (d) == 64 || (d) == 96 || (d) == 128 || (d) == 256)
#endif

// Smallest compiled head dim >= d, or 0 when d exceeds the largest one.
constexpr int tf_flash_round_headdim(int d) {
  return d <= 32 && TF_FLASH_HEADDIM_COMPILED(32)     ? 32
         : d <= 64 && TF_FLASH_HEADDIM_COMPILED(64)   ? 64
         : d <= 96 && TF_FLASH_HEADDIM_COMPILED(96)   ? 96
         : d <= 128 && TF_FLASH_HEADDIM_COMPILED(128) ? 128
         : d <= 256 && TF_FLASH_HEADDIM_COMPILED(256) ? 256
                                                       : 0;
}

// The compiled head dim that runs params p, forward and backward: max(head_dim, head_dim_v) rounded up.
inline int tf_flash_kernel_headdim(const tf_flash::FlashFwdParams& p) {
  return tf_flash_round_headdim(p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v);
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

// ROUNDED must be the result of tf_flash_round_headdim (a compiled head dim) or 0, which runs nothing.
#define HEADDIM_SWITCH(ROUNDED, CONST_NAME, ...)                          \
  [&] {                                                                 \
    switch (ROUNDED) {                                                  \
      case 32: { constexpr static int CONST_NAME = 32; return __VA_ARGS__(); }   \
      case 64: { constexpr static int CONST_NAME = 64; return __VA_ARGS__(); }   \
      case 96: { constexpr static int CONST_NAME = 96; return __VA_ARGS__(); }   \
      case 128: { constexpr static int CONST_NAME = 128; return __VA_ARGS__(); } \
      default: { constexpr static int CONST_NAME = 256; return __VA_ARGS__(); } \
    }                                                                   \
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
    HEADDIM_SWITCH(tf_flash_kernel_headdim(p), kHeadDim, [&] {
      if constexpr (TF_FLASH_HEADDIM_COMPILED(kHeadDim)) {
        err = launch(Element{}, std::integral_constant<int, kHeadDim>{});
      }
    });
  });
  return err;
}

// The kernels' global accesses are 16-byte vectors.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace cuda
}  // namespace tf_flash
