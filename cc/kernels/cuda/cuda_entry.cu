// CUDA entry points of launch.h for the forward direction: flash_fwd_cuda, which chooses the kernel
// family (Hopper or sm_80) at run time, flash_cuda_kernel_counts and flash_cuda_error_string. The
// backward entry points live in flash_bwd_api.cu, the support check of both in support.cu. Nothing here
// includes CuTe: the kernels are reached through fwd_api.h.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

std::atomic<int64_t> forward_sm80_launches{0}, forward_sm90_launches{0}, backward_sm80_launches{0};

namespace {

// Compute capability major of the current device, read once per device.
int device_major() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> majors[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  int major = majors[device].load(std::memory_order_relaxed);
  if (major == 0) {
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
    majors[device].store(major, std::memory_order_relaxed);
  }
  return major;
}

// TF_FLASH_CUDA_FORWARD=sm80 keeps the forward on the sm_80 family on every GPU (comparisons, bisecting).
bool hopper_forward_allowed() {
  static const bool allowed = [] {
    const char* choice = std::getenv("TF_FLASH_CUDA_FORWARD");
    return choice == nullptr || std::strcmp(choice, "sm80") != 0;
  }();
  return allowed;
}

// What the Hopper forward takes: an sm_90 GPU, head dims 64/128/256, no element or block masks, no
// dropout, no soft-capping (those run in the sm_80 family).
bool hopper_forward_runs(const FlashFwdParams& p) {
  const int d = tf_flash_kernel_headdim(p);
  return (d == 64 || d == 128 || d == 256) && p.attn_mask.data == nullptr && p.block_mask.data == nullptr &&
         p.dropout_rate == 0.f && p.softcap == 0.f && hopper_forward_allowed() && device_major() == 9;
}

}  // namespace
}  // namespace cuda

int flash_fwd_cuda(const FlashFwdParams& p, DType dtype, void* stream_ptr) {
  if (!cuda::check_supported(p, dtype, Direction::kForward).empty()) return int(cudaErrorInvalidValue);
  if (!cuda::aligned16(p.q) || !cuda::aligned16(p.k) || !cuda::aligned16(p.v) || !cuda::aligned16(p.out))
    return int(cudaErrorMisalignedAddress);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::hopper_forward_runs(p)) {
    const cudaError_t err = cuda::dispatch_kernel(p, dtype, [&](auto element, auto head_dim) {
      constexpr int kHeadDim = decltype(head_dim)::value;
      if constexpr (kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256) {
        return cuda::run_flash_fwd_sm90<decltype(element), kHeadDim>(p, stream);
      } else {
        return cudaErrorNoKernelImageForDevice;
      }
    });
    if (err != cudaErrorNoKernelImageForDevice) {  // else: no sm_90a code in this build
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

CudaKernelCounts flash_cuda_kernel_counts() {
  return CudaKernelCounts{cuda::forward_sm80_launches.load(), cuda::forward_sm90_launches.load(),
                          cuda::backward_sm80_launches.load()};
}

const char* flash_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tf_flash
