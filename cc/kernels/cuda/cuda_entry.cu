// CUDA entry points of launch.h for the forward direction: flash_fwd_cuda and flash_cuda_error_string.
// The backward entry points live in flash_bwd_api.cu, the support check of both in support.cu. Nothing
// here includes CuTe: the kernels are reached through fwd_api.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
int flash_fwd_cuda(const FlashFwdParams& p, DType dtype, void* stream_ptr) {
  if (!cuda::check_supported(p, dtype, Direction::kForward).empty()) return int(cudaErrorInvalidValue);
  if (!cuda::aligned16(p.q) || !cuda::aligned16(p.k) || !cuda::aligned16(p.v) || !cuda::aligned16(p.out))
    return int(cudaErrorMisalignedAddress);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  return int(cuda::dispatch_kernel(p, dtype, [&](auto element, auto head_dim) {
    return cuda::run_flash_fwd<decltype(element), decltype(head_dim)::value>(p, stream);
  }));
}

const char* flash_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tf_flash
