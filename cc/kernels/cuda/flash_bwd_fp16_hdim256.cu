// Backward instantiation: fp16, head dim 256.
#include "cc/kernels/cuda/bwd_kernel.h"
#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/static_switch.h"

#if TF_FLASH_HEADDIM_COMPILED(256)
template cudaError_t tf_flash::bwd::run_flash_bwd<cutlass::half_t, 256>(const tf_flash::FlashBwdParams&, cudaStream_t);
#endif
