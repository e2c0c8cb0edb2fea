// The run-time choice between the two CUDA kernel families, shared by the forward and the backward: the
// Hopper family (sm_90a: TMA, wgmma, warp specialization) on sm_90 GPUs, the sm_80 family elsewhere and
// for the inputs the Hopper kernels do not take. Definitions in family.cu.
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

// Launches by family, for flash_cuda_kernel_counts (launch.h).
extern std::atomic<int64_t> forward_sm80_launches, forward_sm90_launches, backward_sm80_launches,
    backward_sm90_launches, forward_float32_launches, backward_float32_launches;

}  // namespace cuda
}  // namespace tf_flash
