// Backward entry points of launch.h: flash_bwd_cuda and flash_bwd_cuda_scratch_bytes. The family choice is
// family.h's, the dispatch static_switch.h's, both shared with the forward (cuda_entry.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/float32_kernels.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"

namespace tf_flash {
int64_t flash_bwd_cuda_scratch_bytes(const FlashBwdParams& params, DType dtype) {
  return dtype == DType::kFloat32 ? cuda::bwd_float32_scratch_bytes(params) : cuda::bwd_scratch_bytes(params);
}

// The caller has checked the params with cuda::check_supported (flash_attention_params.cc, the harnesses).
int flash_bwd_cuda(const FlashBwdParams& p, DType dtype, void* stream_ptr) {
  const cuda::KernelFamily family = cuda::choose_family(p, dtype, Direction::kBackward);
  if (family == cuda::KernelFamily::kFloat32) {
    const cudaError_t err = cuda::run_flash_bwd_float32(p, static_cast<cudaStream_t>(stream_ptr));
    if (err == cudaSuccess) cuda::backward_float32_launches.fetch_add(1, std::memory_order_relaxed);
    return int(err);
  }
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out), p.d_out, static_cast<const void*>(p.d_q),
                          static_cast<const void*>(p.d_k), static_cast<const void*>(p.d_v),
                          static_cast<const void*>(p.scratch)}) {
    if (!cuda::aligned16(ptr)) return int(cudaErrorMisalignedAddress);
  }
  if (p.batch == 0 || p.num_heads == 0) return int(cudaSuccess);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  return int(cuda::dispatch_kernel(p, dtype, [&](auto element, auto head_dim) {
    return cuda::run_flash_bwd<decltype(element), decltype(head_dim)::value>(p, family, stream);  // counts its launches
  }));
}

}  // namespace tf_flash
