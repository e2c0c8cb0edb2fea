// Definition of run_flash_fwd: grid, shared memory and the choice of variant (plain, dropout, masks).
#pragma once

#include <cuda_runtime.h>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/static_switch.h"

namespace tf_flash {
namespace cuda {

template <class Traits, bool kMasks, bool kDropout>
cudaError_t launch_flash_fwd(const FlashFwdParams& params, cudaStream_t stream) {
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads,
                  params.batch * params.num_splits);
  const int smem = Traits::kSmemBytes + (kMasks ? Traits::kMaskSmemBytes : 0);
  auto kernel = &flash_fwd_kernel<Traits, kMasks, kDropout>;
  // Always raised: static shared memory (the block-mask tile table) counts against the default 48 KB.
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

template <class Element, int kHeadDim>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream) {
  using Config = FwdConfig<kHeadDim, Element>;
  if (params.batch == 0 || params.seqlen_q == 0 || params.num_heads == 0) return cudaSuccess;
  // Soft-capping runs in the general variant (the others carry none of its code).
  const bool masks = has_element_masks(params) || params.softcap > 0.f;
  const bool dropout = params.dropout_rate > 0.f;
  using Traits = typename Config::Traits;
  if (masks) {  // dropout off at rate 0
    // Blocks that do not hold whole 128-row tiles take 64-row ones (64 x 64 blocks: skipped or run unmasked
    // whole instead of masked per element, 6x faster at 16k); the rest keeps 128 rows (attn_mask, key masks
    // and tile-sized blocks measure faster there).
    const bool fine_blocks = params.block_mask.data != nullptr &&
                             (params.block_q % Traits::kBlockM != 0 || params.block_k % Traits::kBlockN != 0);
    return fine_blocks ? launch_flash_fwd<typename Config::MaskedTraits, true, true>(params, stream)
                       : launch_flash_fwd<Traits, true, true>(params, stream);
  }
  return dropout ? launch_flash_fwd<Traits, false, true>(params, stream)
                 : launch_flash_fwd<Traits, false, false>(params, stream);
}

}  // namespace cuda
}  // namespace tf_flash
