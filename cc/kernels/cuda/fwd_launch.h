// Definition of run_flash_fwd: grid, shared memory and the plain/general variant choice.
#pragma once

#include <cuda_runtime.h>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/static_switch.h"

namespace tf_flash {
namespace cuda {

template <class Element, int kHeadDim>
cudaError_t run_flash_fwd(const FlashFwdParams& params, cudaStream_t stream) {
  using Traits = typename FwdConfig<kHeadDim, Element>::Traits;
  if (params.batch == 0 || params.seqlen_q == 0 || params.num_heads == 0) return cudaSuccess;
  const dim3 grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.num_heads, params.batch);
  const bool general =
      params.attn_mask.data != nullptr || params.block_mask.data != nullptr || params.dropout_rate > 0.f;
  return BOOL_SWITCH(general, kGeneral, [&] {
    constexpr int smem = Traits::kSmemBytes + (kGeneral ? Traits::kMaskSmemBytes : 0);
    auto kernel = &flash_fwd_kernel<Traits, kGeneral>;
    // Always raised: static shared memory (the block-mask tile table) counts against the default 48 KB.
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    kernel<<<grid, Traits::kNThreads, smem, stream>>>(params);
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace tf_flash
