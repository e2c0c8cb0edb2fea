// CUDA entry points of launch.h for the forward direction and the shared support check:
// flash_fwd_cuda, flash_cuda_unsupported, flash_cuda_error_string. The backward entry points live in
// flash_bwd_api.cu. Nothing here includes CuTe: the kernels are reached through fwd_api.h.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

std::string compiled_headdims() {
  std::string list;
  for (int d : {32, 64, 96, 128, 256}) {
    if (tf_flash_round_headdim(d) == d) list += (list.empty() ? "" : ", ") + std::to_string(d);
  }
  return list;
}

std::string flash_fwd_cuda_unsupported(const FlashFwdParams& p, DType dtype) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
    return std::string("the CUDA kernels support float16 and bfloat16 inputs only (received dtype=") +
           dtype_name(dtype) + ")";
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim_v <= 0 || p.head_dim_v % 8 != 0)
    return "the CUDA forward needs head dims that are positive multiples of 8 (received head_dim=" +
           std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) + ")";
  const int d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  if (tf_flash_round_headdim(d) == 0)
    return "the CUDA forward has no kernel for head_dim=" + std::to_string(p.head_dim) +
           ", head_dim_v=" + std::to_string(p.head_dim_v) + " (compiled head dims: " +
           compiled_headdims() + "; smaller head dims run in the next larger kernel)";
  if (p.num_heads_kv <= 0 || p.num_heads % p.num_heads_kv != 0)
    return "num_heads must be a multiple of num_heads_kv (received num_heads=" + std::to_string(p.num_heads) +
           ", num_heads_kv=" + std::to_string(p.num_heads_kv) + ")";
  if (p.num_heads > 65535 || p.batch > 65535)
    return "the CUDA forward supports at most 65535 heads and 65535 batch entries (received num_heads=" +
           std::to_string(p.num_heads) + ", batch=" + std::to_string(p.batch) + ")";
  if (!(p.scale >= 0.f) || !std::isfinite(p.scale))
    return "the CUDA forward needs a finite scale >= 0 (received scale=" + std::to_string(p.scale) + ")";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                             p.k_row_stride,   p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                             p.v_head_stride,  p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0)
      return "the CUDA forward needs q/k/v/out strides that are multiples of 8 elements (received stride " +
             std::to_string(s) + ")";
  }
  if (p.block_mask.data != nullptr && (p.block_q <= 0 || p.block_k <= 0))
    return "block_mask needs positive block sizes (received block_q=" + std::to_string(p.block_q) +
           ", block_k=" + std::to_string(p.block_k) + ")";
  if (!(p.dropout_rate >= 0.f && p.dropout_rate < 1.f))
    return "dropout_rate must be in [0, 1) (received " + std::to_string(p.dropout_rate) + ")";
  return "";
}

}  // namespace

std::string flash_cuda_unsupported(const FlashFwdParams& params, DType dtype, bool backward) {
  std::string reason = flash_fwd_cuda_unsupported(params, dtype);
  if (reason.empty() && backward) reason = flash_bwd_cuda_unsupported(params, dtype);
  return reason;
}

int flash_fwd_cuda(const FlashFwdParams& p, DType dtype, void* stream_ptr) {
  if (!flash_fwd_cuda_unsupported(p, dtype).empty()) return int(cudaErrorInvalidValue);
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.out))
    return int(cudaErrorMisalignedAddress);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int rounded = tf_flash_round_headdim(p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v);
  cudaError_t err = cudaErrorInvalidValue;
  FP16_BF16_SWITCH(dtype, Element, [&] {
    HEADDIM_SWITCH(rounded, kHeadDim, [&] {
      if constexpr (TF_FLASH_HEADDIM_COMPILED(kHeadDim)) err = cuda::run_flash_fwd<Element, kHeadDim>(p, stream);
    });
  });
  return int(err);
}

const char* flash_cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tf_flash
