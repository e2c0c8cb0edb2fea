// CUDA entry points of launch.h for the forward direction: flash_fwd_cuda, which chooses the kernel
// family (Hopper or sm_80, family.h) at run time, and flash_cuda_error_string. The backward entry points
// live in flash_bwd_api.cu, the support check of both in support.cu. Nothing here includes CuTe: the
// kernels are reached through fwd_api.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/float32_kernels.h"
#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {
namespace {

// What the Hopper forward takes besides its head dims and block masks (fwd_api.h): keys to attend to (a TMA
// descriptor has no empty dimension), no segment ids (the sm_80 family reads them). attn_mask needs the
// workspace it is packed into (the launcher falls back without one).
bool hopper_forward_runs(const FlashFwdParams& p) {
  return p.seqlen_k > 0 && !has_segments(p) && hopper_family_allowed();
}

}  // namespace
}  // namespace cuda

int flash_fwd_cuda(const FlashFwdParams& p, DType dtype, void* stream_ptr) {
  if (!cuda::check_supported(p, dtype, Direction::kForward).empty()) return int(cudaErrorInvalidValue);
  if (dtype == DType::kFloat32) {
    const cudaError_t err = cuda::run_flash_fwd_float32(p, static_cast<cudaStream_t>(stream_ptr));
    if (err == cudaSuccess) cuda::forward_float32_launches.fetch_add(1, std::memory_order_relaxed);
    return int(err);
  }
  if (!cuda::aligned16(p.q) || !cuda::aligned16(p.k) || !cuda::aligned16(p.v) || !cuda::aligned16(p.out))
    return int(cudaErrorMisalignedAddress);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::hopper_forward_runs(p)) {
    const cudaError_t err = cuda::dispatch_kernel(p, dtype, [&](auto element, auto head_dim) {
      constexpr int kHeadDim = decltype(head_dim)::value;
      if constexpr (cuda::hopper_forward_headdim(kHeadDim)) {
        if (cuda::hopper_forward_takes_block_mask(p, kHeadDim))
          return cuda::run_flash_fwd_sm90<decltype(element), kHeadDim>(p, stream);
      }
      return cudaErrorNoKernelImageForDevice;
    });
    // Else another head dim, finer blocks of a block mask, or no sm_90a code in this build.
    if (err != cudaErrorNoKernelImageForDevice) {
      if (err == cudaSuccess) cuda::forward_sm90_launches.fetch_add(1, std::memory_order_relaxed);
      return int(err);
    }
  }
  const cudaError_t err = cuda::dispatch_kernel(p, dtype, [&](auto element, auto head_dim) {
    return cuda::run_flash_fwd<decltype(element), decltype(head_dim)::value>(p, stream);
  });
  if (err == cudaSuccess) cuda::forward_sm80_launches.fetch_add(1, std::memory_order_relaxed);
  return int(err);
}

int64_t flash_fwd_cuda_workspace_bytes(const FlashFwdParams& p, DType dtype) {
  if (p.attn_mask.data == nullptr || dtype == DType::kFloat32 || !cuda::hopper_forward_runs(p)) return 0;
  const int head_dim = tf_flash_kernel_headdim(p);
  if (!cuda::hopper_forward_headdim(head_dim) || !cuda::hopper_forward_takes_block_mask(p, head_dim)) return 0;
  return cuda::PackedMaskLayout(p, cuda::MaskPacking::kForward).bytes;
}

const char* flash_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tf_flash
