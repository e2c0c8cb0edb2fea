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

// The Hopper family (fwd_kernel_sm90.h), for the params family.h's hopper_forward_takes accepts (with attn_mask,
// params.mask_workspace holds room for its packed bits: flash_fwd_cuda_workspace_bytes).
template <class Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FlashFwdParams& params, cudaStream_t stream);

// The Hopper forward of fp8 (e4m3) inputs with the output in OutElement (cutlass::bfloat16_t or half_t):
// transposes V into params.value_transposed (flash_fwd_cuda_value_transpose_bytes), then runs the kernel.
template <class OutElement, int kHeadDim>
cudaError_t run_flash_fwd_sm90_fp8(const FlashFwdParams& params, cudaStream_t stream);
// That forward's first pass (fp8_values.cu): V [batch, seqlen_k, kv heads, head_dim_v] into params.value_transposed
// as V^T [batch, kv heads, head_dim_v, fp8_value_keys(params)] (sm90_tile_size.h), keys contiguous in the slot order
// of fp8_value_key_of_slot, zeros past seqlen_k.
cudaError_t transpose_values_fp8(const FlashFwdParams& params, cudaStream_t stream);
// An fp8 forward without keys (seqlen_k 0, which no TMA descriptor describes): O 0, lse -inf, as every kernel
// gives a row that sees nothing (fp8_values.cu).
cudaError_t empty_keys_fp8(const FlashFwdParams& params, cudaStream_t stream);

// Split-KV's merge (split_kv.cu): the runs' outputs of `run` (split_run_params of p) into p's out and lse, on
// `stream`. Element is cutlass::half_t or cutlass::bfloat16_t.
template <class Element>
cudaError_t merge_splits(const FlashFwdParams& p, const FlashFwdParams& run, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
