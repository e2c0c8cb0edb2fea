// The run-time choice of kernel family, made in one place for the forward and the backward: the full-float32
// kernels for float32 inputs, the Hopper family (sm_90a: TMA, wgmma, warp specialization) for the params it
// takes on sm_90 GPUs, and the sm_80 family for everything else. Definitions in family.cu.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

enum class KernelFamily { kFloat32, kSm80, kSm90 };

// The family that runs params p (which check_supported accepted) in `direction` on the current device. For the
// backward, the family of its dK/dV kernel (the preprocess and the dQ conversion are the sm_80 family's).
KernelFamily choose_family(const FlashFwdParams& p, DType dtype, Direction direction);

// One predicate per Hopper kernel: true where it takes p on the current device. The forward's attn_mask needs its
// workspace (flash_fwd_cuda_workspace_bytes), which `workspace_counted` = false leaves out (asked to size it).
// element_bytes: 2, or 1 for fp8 (e4m3) inputs, which no other kernel runs.
bool hopper_forward_takes(const FlashFwdParams& p, bool workspace_counted = true, int element_bytes = 2);
// Empty where the Hopper forward takes fp8 params p on the current device (hopper_forward_takes), else why not,
// naming what was received: what check_supported reports for fp8, which has no other kernel.
std::string hopper_fp8_forward_refusal(const FlashFwdParams& p);
bool hopper_backward_takes(const FlashFwdParams& p);  // the backward's params (FlashBwdParams) are these too

// Streaming multiprocessors of the current device (read once per device; 0 if CUDA cannot tell).
int device_sm_count();

// Launches by family, for flash_cuda_kernel_counts (launch.h).
extern std::atomic<int64_t> forward_sm80_launches, forward_sm90_launches, backward_sm80_launches,
    backward_sm90_launches, forward_float32_launches, backward_float32_launches;

}  // namespace cuda
}  // namespace tf_flash
