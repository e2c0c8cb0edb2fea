// Forward instantiation: fp16, head dim 64 (see fwd_kernel.h).
#include "cc/kernels/cuda/fwd_launch.h"

#if TF_FLASH_HEADDIM_COMPILED(64)
namespace tf_flash {
namespace cuda {
template cudaError_t run_flash_fwd<cutlass::half_t, 64>(const FlashFwdParams&, cudaStream_t);
}  // namespace cuda
}  // namespace tf_flash
#endif
