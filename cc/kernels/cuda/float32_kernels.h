// The full-float32 CUDA kernels (float32_kernels.cu): float32 on the CUDA cores, for TF's TF32 switch off.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// The largest head dim (key or value) they run.
int float32_max_head_dim();
// Shared memory one block of `direction`'s kernels takes for the head dims of p (the backward's are larger
// than the forward's): 68-135 KiB, more than GPUs with 99 KiB a block (sm_86, sm_89) give above head dim 64.
int float32_shared_bytes(const FlashFwdParams& p, Direction direction);

cudaError_t run_flash_fwd_float32(const FlashFwdParams& p, cudaStream_t stream);

// The backward's scratch: three float32 values per query row (its normalizers and D), no dQ accumulator.
int64_t bwd_float32_scratch_bytes(const FlashBwdParams& p);
cudaError_t run_flash_bwd_float32(const FlashBwdParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
