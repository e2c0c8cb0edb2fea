// Declarations shared by the backward instantiation files (flash_bwd_hdim*_*.cu) and the dispatcher
// (flash_bwd_api.cu). Only CUDA runtime types here; the kernels live in bwd_kernel.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace bwd {

// One explicit instantiation per (dtype, head dim), each in its own .cu so they compile in parallel.
// Element is cutlass::half_t or cutlass::bfloat16_t.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const FlashBwdParams& params, cudaStream_t stream);

}  // namespace bwd

// Empty when flash_bwd_cuda has a kernel for this (dtype, head dims, features), else the reason. The
// CUDA entry's flash_cuda_unsupported(params, dtype, /*backward=*/true) should return this.
std::string flash_bwd_cuda_unsupported(const FlashFwdParams& params, DType dtype);

}  // namespace tf_flash
