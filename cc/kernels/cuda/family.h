// The run-time choice between the two CUDA kernel families, shared by the forward and the backward: the
// Hopper family (sm_90a: TMA, wgmma, warp specialization) on sm_90 GPUs, the sm_80 family elsewhere and
// for the inputs the Hopper kernels do not take. Definitions in cuda_entry.cu.
#pragma once

#include <atomic>
#include <cstdint>

namespace tf_flash {
namespace cuda {

// True on an sm_90 GPU (the current device) unless TF_FLASH_CUDA_FAMILY=sm80 was set when the process
// first asked (comparisons, bisecting). A library without sm_90a code still falls back: each Hopper
// launcher reports cudaErrorNoKernelImageForDevice, launching nothing.
bool hopper_family_allowed();

// Streaming multiprocessors of the current device (read once per device; 0 if CUDA cannot tell).
int device_sm_count();

// True unless TF_FLASH_SM90_FORWARD_SCHEDULE=tiles was set when the process first asked: the Hopper
// forward then launches a CTA per query tile instead of one persistent CTA per SM (comparisons, bisecting).
bool hopper_forward_persistent();

// Launches by family, for flash_cuda_kernel_counts (launch.h).
extern std::atomic<int64_t> forward_sm80_launches, forward_sm90_launches, backward_sm80_launches,
    backward_sm90_launches, forward_float32_launches, backward_float32_launches;

}  // namespace cuda
}  // namespace tf_flash
