// Forward instantiation: bf16, head dim 32 (see fwd_kernel.h).
#include "cc/kernels/cuda/fwd_launch.h"

#if TF_FLASH_HEADDIM_COMPILED(32)
namespace tf_flash {
namespace cuda {
template cudaError_t run_flash_fwd<cutlass::bfloat16_t, 32>(const FlashFwdParams&, cudaStream_t);
}  // namespace cuda
}  // namespace tf_flash
#endif
