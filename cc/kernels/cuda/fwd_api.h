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

// The Hopper family (fwd_kernel_sm90.h), for the head dims below, with attn_mask when params.mask_workspace
// holds room for its packed bits (flash_fwd_cuda_workspace_bytes) and block masks of whole tiles only
// (cuda_entry.cu chooses). Returns cudaErrorNoKernelImageForDevice, launching nothing, when the library holds
// no sm_90a code for it (or the kernel's table of key tiles, one byte per tile, would not fit in shared
// memory, or attn_mask has no workspace).
constexpr bool hopper_forward_headdim(int d) { return d == 64 || d == 128 || d == 256; }
// Keys per tile of the Hopper forward (run_flash_fwd_sm90 asserts it against its tile configurations).
constexpr int hopper_forward_key_tile(int d) { return d == 256 ? 64 : 128; }
// Block masks the Hopper forward takes: each query tile (128 rows under a block mask) inside one query block
// and each key tile inside one key block, so that a tile is shown or hidden whole (finer blocks need the
// sm_80 family's element-wise check).
inline bool hopper_forward_takes_block_mask(const FlashFwdParams& p, int head_dim) {
  return p.block_mask.data == nullptr ||
         (p.block_q % 128 == 0 && p.block_k % hopper_forward_key_tile(head_dim) == 0);
}
template <class Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FlashFwdParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
