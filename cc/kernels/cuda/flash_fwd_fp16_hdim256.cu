// Forward instantiation: fp16, head dim 256 (see fwd_kernel.h).
#include "cc/kernels/cuda/fwd_launch.h"

#if TF_FLASH_HEADDIM_COMPILED(256)
namespace tf_flash {
namespace cuda {
template cudaError_t run_flash_fwd<cutlass::half_t, 256>(const FlashFwdParams&, cudaStream_t);
}  // namespace cuda
}  // namespace tf_flash
#endif
