// Entry points of the framework-free kernels. The OpKernels (cc/kernels/flash_attention_kernels.cc)
// fill a params struct and call one of these; nothing below them sees TensorFlow.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "cc/kernels/flash/params.h"

namespace tf_flash {

// kFloat8E4M3: the Hopper forward only (FlashFwdParams' descale fields; no CPU kernels, no backward).
enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };

// ---- CPU (cc/kernels/cpu/) ----
// Runs work(begin, end) over [0, total) on the caller's thread pool; cost_per_unit is a rough cycle count.
using ParallelFor = std::function<void(int64_t total, int64_t cost_per_unit,
                                       const std::function<void(int64_t, int64_t)>& work)>;

void flash_fwd_cpu(const FlashFwdParams& params, DType dtype, const ParallelFor& parallel_for);
// The CPU kernels' path in this process, "avx512_bf16", "avx512" or "avx2" (cc/kernels/cpu/cpu_isa.h: chosen
// once from the CPU's features; TF_FLASH_CPU_ISA names one to force): what build_info reports as cpu_isa.
const char* flash_cpu_isa_name();

// Bytes of float32 scratch the CPU backward wants in params.scratch (dQ partial sums and D = rowsum(dO*O)).
int64_t flash_bwd_cpu_scratch_bytes(const FlashBwdParams& params, int num_threads);
void flash_bwd_cpu(const FlashBwdParams& params, DType dtype, int num_threads, const ParallelFor& parallel_for);

// Segment ids (params.h: q_segment_ids): the int32 elements of the bounds of ids [batch, seqlen], a
// {min, max} pair per kSegmentBlock rows and a flag per entry, 0 where its ids never decrease (mask.h:
// segment_tiles), which the runners fill before every launch (here on the host, flash_cuda_segment_bounds
// on the device).
inline int64_t segment_bounds_elements(int batch, int64_t seqlen) {
  return int64_t{batch} * (2 * ((seqlen + kSegmentBlock - 1) / kSegmentBlock) + 1);
}
void segment_bounds_cpu(const int32_t* ids, int batch, int64_t seqlen, int32_t* bounds);

// ---- CUDA (cc/kernels/cuda/), compiled only with nvcc; stream is a cudaStream_t ----
// What each device supports is stated in one place per device: the CPU kernels run every input that
// FillParams (cc/kernels/flash_attention_params.cc) accepts, which also holds the argument rules common to
// both devices (scale finite and >= 0, window, block sizes, dropout rate, lengths); the CUDA kernels add
// the limits of cuda::check_supported (cc/kernels/cuda/support.cu): dtypes, head dims, strides, grid size.
enum class Direction { kForward, kBackward };
namespace cuda {
// Empty string when the CUDA kernels of `direction` (the backward needs the forward's too) run these
// params, else the reason, naming the value received.
std::string check_supported(const FlashFwdParams& params, DType dtype, Direction direction);
}  // namespace cuda
int64_t flash_bwd_cuda_scratch_bytes(const FlashBwdParams& params, DType dtype);
// Bytes of device memory the forward wants in params.mask_workspace (0: none), for the kernel family that
// will run it on the current device: the Hopper forward's packed attn_mask (a bit per entry).
int64_t flash_fwd_cuda_workspace_bytes(const FlashFwdParams& params, DType dtype);
// The same for a call with an attn_mask whichever family runs it (no device asked; data pointers unread): what
// the XLA lowering sizes a result by before the device is known.
int64_t flash_fwd_cuda_mask_workspace_bytes(const FlashFwdParams& params);
// Bytes of device memory an fp8 forward wants in params.value_transposed (0 for other dtypes): V^T as
// [batch, kv heads, head_dim_v, seqlen_k rounded up to 16], keys contiguous (cc/kernels/cuda/fwd_launch_sm90.h).
int64_t flash_fwd_cuda_value_transpose_bytes(const FlashFwdParams& params, DType dtype);
// Return a cudaError_t as int (0 = success) so this header needs no CUDA include. float32 runs on the
// full-float32 kernels (CUDA cores; what params.allow_tf32 false asks for); float16 and bfloat16 on the
// tensor-core families. TF32-grade float32 is float16 staged by the caller (below).
int flash_fwd_cuda(const FlashFwdParams& params, DType dtype, void* stream);
int flash_bwd_cuda(const FlashBwdParams& params, DType dtype, void* stream);
const char* flash_cuda_error_string(int error);
int flash_cuda_segment_bounds(const int32_t* ids, int batch, int64_t seqlen, int32_t* bounds, void* stream);
// Kernel launches of this process by family (the Hopper family on sm_90 GPUs for the params it takes,
// else sm_80's, cc/kernels/cuda/family.h; the full-float32 kernels): what tests read to prove which ran.
struct CudaKernelCounts {
  int64_t forward_sm80 = 0, forward_sm90 = 0, backward_sm80 = 0, backward_sm90 = 0;
  int64_t forward_float32 = 0, backward_float32 = 0;
};
CudaKernelCounts flash_cuda_kernel_counts();
// float32 through float16 operands at float32's range. Each float32 input is staged times a power of two
// the device chooses from the inputs' largest finite magnitudes (no host sync), and each output is copied
// back times the power of two that undoes it. float16's 10-bit mantissa is TF32's: TF32-grade precision
// with float32's range per tensor. Q, K, V and dO are each brought to a largest magnitude in [2, 4):
// Q 2^-nq, K 2^-nk, V and the backward's input O 2^-nv, dO 2^-ndo; d_lse, which enters D beside
// rowsum(dO O), takes dP's 2^-(ndo + nv) (in the backward nv grows where d_lse would pass 4 there). The
// scores' scale takes 2^(nq + nk) (FlashFwdParams::scale_exponent_device), and by the linearity of each
// GEMM the outputs are O 2^nv, dV 2^ndo, dQ 2^(ndo + nv + nk), dK 2^(ndo + nv + nq). So |S| < 16 d and
// |dP| < 16 dv, and dS, the one intermediate the kernels round to float16 that can grow, stays below
// (32 dv + 4) / (1 - dropout rate) even with every product aligned (float16's 65504: any rate up to 0.87
// at dv 256).
enum class StageRole : int {
  kQuery, kKey, kValue, kOutGrad, kLseGrad, kOutput, kQueryGrad, kKeyGrad, kValueGrad, kCount
};
struct StagePlan {  // device memory, filled by flash_cuda_stage_plan
  static constexpr int kInputs = 5;          // Q, K, V, dO, d_lse
  uint32_t magnitude_bits[kInputs];          // largest finite |x| of each (float bits: order as integers)
  int32_t exponent[int(StageRole::kCount)];  // the power of two each role's copy multiplies by
  int32_t scale_exponent;                    // for FlashFwdParams::scale_exponent_device
};

// Fills `plan` (device memory) from the float32 tensors of the given element counts, on `stream`:
// q, k, v, and in the backward d_out and d_lse (null when absent).
struct StageInputs {
  const void* data[StagePlan::kInputs];
  int64_t size[StagePlan::kInputs];
};
int flash_cuda_stage_plan(const StageInputs& inputs, StagePlan* plan, void* stream);

// Copies `rows` contiguous rows of src_dim elements into rows of dst_dim elements (cropping, or padding
// with zeros), converting the element type: how float32 and head dims that are not multiples of 8 reach
// the float16/bfloat16 kernels. With a plan each element is multiplied by the power of two of `role` on
// the way (finite values saturate at the destination type's largest); without (null), it only converts.
int flash_cuda_stage_rows(const void* src, DType src_type, int src_dim, void* dst, DType dst_type, int dst_dim,
                          int64_t rows, const StagePlan* plan, StageRole role, void* stream);

}  // namespace tf_flash
