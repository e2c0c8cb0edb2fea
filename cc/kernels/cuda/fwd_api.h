// Declaration of the per-(dtype, head dim) forward launchers. Each one is defined once, in its own
// flash_fwd_<dtype>_hdim<d>.cu, so that the instantiations compile in parallel; this header is all
// that cuda_entry.cu needs to see.
#pragma once

#include <cuda_runtime.h>

#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// Launches the forward kernel for kHeadDim (>= head_dim and head_dim_v) on `stream`; returns the launch
// status. Element is cutlass::half_t or cutlass::bfloat16_t.
template <class Element, int kHeadDim>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream);

// The Hopper family (fwd_kernel_sm90.h), for the head dims below, without element masks or block masks
// (cuda_entry.cu's hopper_forward_runs chooses). Returns cudaErrorNoKernelImageForDevice, launching
// nothing, when the library holds no sm_90a code for it.
constexpr bool hopper_forward_headdim(int d) { return d == 64 || d == 128 || d == 256; }
template <class Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FlashFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
