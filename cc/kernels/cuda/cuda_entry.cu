// CUDA entry points of launch.h for the forward direction: flash_fwd_cuda, which runs the kernel family that
// family.h chooses, and flash_cuda_error_string. The backward entry points live in flash_bwd_api.cu, the support
// check of both in support.cu. Nothing here includes CuTe: the kernels are reached through fwd_api.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/float32_kernels.h"
#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace {

// Whether the tensor-core families run these params split (FlashFwdParams::num_splits): a workspace for the
// runs' outputs; no block masks, segment ids or dropout (their tile tables and draws follow the whole call;
// attn_mask's bits and tile table are read by the keys' places, so a run reads its own); and grids both
// families can launch (the sm_80 family's gridDim.z is batch x runs; a Hopper CTA per tile counts query tiles
// of at least 64 rows x runs).
bool runs_split(const FlashFwdParams& p) {
  const int64_t query_tiles = (int64_t(p.seqlen_q) + 63) / 64 * p.batch * p.num_heads;
  return p.num_splits > 1 && p.split_workspace != nullptr && p.block_mask.data == nullptr && !has_segments(p) &&
         p.dropout_rate == 0.f &&
         int64_t(p.batch) * p.num_splits <= 65535 && query_tiles * p.num_splits <= INT32_MAX;
}

}  // namespace

// The caller has checked the params with cuda::check_supported (flash_attention_params.cc, the harnesses).
int flash_fwd_cuda(const FlashFwdParams& params, DType dtype, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // The call whole, unless the tensor-core families split it below.
  FlashFwdParams p = params;
  p.num_splits = 1;
  const cuda::KernelFamily family = cuda::choose_family(p, dtype, Direction::kForward);
  if (family == cuda::KernelFamily::kFloat32) {
    const cudaError_t err = cuda::run_flash_fwd_float32(p, stream);
    if (err == cudaSuccess) cuda::forward_float32_launches.fetch_add(1, std::memory_order_relaxed);
    return int(err);
  }
  if (!cuda::aligned16(p.q) || !cuda::aligned16(p.k) || !cuda::aligned16(p.v) || !cuda::aligned16(p.out))
    return int(cudaErrorMisalignedAddress);
  // Split-KV: the kernel writes its runs' outputs (16-bit, fp8's output dtype too) into the workspace, and
  // merge_splits gives the call's.
  const bool split = runs_split(params);
  const FlashFwdParams run = split ? split_run_params(params, params.split_workspace, 2) : p;
  if (dtype == DType::kFloat8E4M3) {  // the Hopper forward only (check_supported: hopper_fp8_forward_refusal)
    if (p.seqlen_k == 0) return int(cuda::empty_keys_fp8(p, stream));
    cudaError_t err = cudaErrorInvalidValue;
    cuda::visit_headdim(tf_flash_fp8_kernel_headdim(p), [&](auto head_dim) {
      constexpr int kHeadDim = decltype(head_dim)::value;
      if constexpr (TF_FLASH_HEADDIM_SM90(kHeadDim) && TF_FLASH_HEADDIM_COMPILED(kHeadDim)) {
        err = p.out_float16 ? cuda::run_flash_fwd_sm90_fp8<cutlass::half_t, kHeadDim>(run, stream)
                            : cuda::run_flash_fwd_sm90_fp8<cutlass::bfloat16_t, kHeadDim>(run, stream);
      }
    });
    if (split && err == cudaSuccess) {
      err = p.out_float16 ? cuda::merge_splits<cutlass::half_t>(params, run, stream)
                          : cuda::merge_splits<cutlass::bfloat16_t>(params, run, stream);
    }
    if (err == cudaSuccess) cuda::forward_sm90_launches.fetch_add(1, std::memory_order_relaxed);
    return int(err);
  }
  const bool hopper = family == cuda::KernelFamily::kSm90;
  cudaError_t err = cuda::dispatch_kernel(run, dtype, [&](auto element, auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    if constexpr (TF_FLASH_HEADDIM_SM90(kHeadDim)) {
      if (hopper) return cuda::run_flash_fwd_sm90<decltype(element), kHeadDim>(run, stream);
    }
    return cuda::run_flash_fwd<decltype(element), kHeadDim>(run, stream);
  });
  if (split && err == cudaSuccess) {
    err = dtype == DType::kBFloat16 ? cuda::merge_splits<cutlass::bfloat16_t>(params, run, stream)
                                    : cuda::merge_splits<cutlass::half_t>(params, run, stream);
  }
  if (err == cudaSuccess) {
    (hopper ? cuda::forward_sm90_launches : cuda::forward_sm80_launches).fetch_add(1, std::memory_order_relaxed);
  }
  return int(err);
}

int64_t flash_fwd_cuda_workspace_bytes(const FlashFwdParams& p, DType dtype) {
  const int element_bytes = dtype == DType::kFloat8E4M3 ? 1 : 2;
  if (p.attn_mask.data == nullptr || dtype == DType::kFloat32 || !cuda::hopper_forward_takes(p, false, element_bytes))
    return 0;
  return flash_fwd_cuda_mask_workspace_bytes(p);
}

int64_t flash_fwd_cuda_mask_workspace_bytes(const FlashFwdParams& p) {
  return cuda::PackedMaskLayout(p, cuda::MaskPacking::kForward).bytes;
}

int64_t flash_fwd_cuda_value_transpose_bytes(const FlashFwdParams& p, DType dtype) {
  if (dtype != DType::kFloat8E4M3) return 0;
  return int64_t(p.batch) * p.num_heads_kv * p.head_dim_v * cuda::fp8_value_keys(p);  // one byte each
}

const char* flash_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tf_flash
