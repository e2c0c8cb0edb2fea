// Backward entry points of launch.h: flash_bwd_cuda, flash_bwd_cuda_scratch_bytes, and the support check.
#include <cuda_runtime.h>

#include <string>

#include <cutlass/numeric_types.h>

#include "cc/kernels/cuda/bwd_launch.h"

namespace tf_flash {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace

std::string flash_bwd_cuda_unsupported(const FlashFwdParams& p, DType dtype) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16)
    return "the CUDA backward supports float16 and bfloat16 inputs only (received float32)";
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim_v <= 0 || p.head_dim_v % 8 != 0)
    return "the CUDA backward needs head dims that are positive multiples of 8 (received head_dim=" +
           std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) + ")";
  if (bwd::bwd_headdim(p) == 0)
    return "the CUDA backward has no kernel for head_dim=" + std::to_string(p.head_dim) +
           ", head_dim_v=" + std::to_string(p.head_dim_v) +
           " (max of the two must round up to a compiled head dim of 32, 64, 96, 128 or 256)";
  if (p.num_heads_kv <= 0 || p.num_heads % p.num_heads_kv != 0)
    return "num_heads must be a multiple of num_heads_kv (received " + std::to_string(p.num_heads) + " and " +
           std::to_string(p.num_heads_kv) + ")";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride, p.k_row_stride,
                             p.k_head_stride,  p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.o_batch_stride,
                             p.o_row_stride,   p.o_head_stride};
  for (int64_t s : strides)
    if (s % 8 != 0) return "the CUDA backward needs strides that are multiples of 8 elements (received " +
                           std::to_string(s) + ")";
  if (p.block_mask.data && (p.block_q <= 0 || p.block_k <= 0))
    return "block_mask needs positive block sizes (received block_q=" + std::to_string(p.block_q) +
           ", block_k=" + std::to_string(p.block_k) + ")";
  return "";
}

int64_t flash_bwd_cuda_scratch_bytes(const FlashBwdParams& params) { return bwd::bwd_scratch_bytes(params); }

int flash_bwd_cuda(const FlashBwdParams& p, DType dtype, void* stream_ptr) {
  if (!flash_bwd_cuda_unsupported(p, dtype).empty()) return int(cudaErrorInvalidValue);
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.out) || !aligned16(p.d_out) ||
      !aligned16(p.d_q) || !aligned16(p.d_k) || !aligned16(p.d_v) || !aligned16(p.scratch))
    return int(cudaErrorMisalignedAddress);
  if (p.batch == 0 || p.num_heads == 0) return int(cudaSuccess);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int d = bwd::bwd_headdim(p);
  cudaError_t err = cudaErrorInvalidValue;
  auto run = [&](auto element_tag) {
    using E = decltype(element_tag);
    switch (d) {
#if TF_FLASH_HEADDIM_COMPILED(32)
      case 32: err = bwd::run_flash_bwd<E, 32>(p, stream); break;
#endif
#if TF_FLASH_HEADDIM_COMPILED(64)
      case 64: err = bwd::run_flash_bwd<E, 64>(p, stream); break;
#endif
#if TF_FLASH_HEADDIM_COMPILED(96)
      case 96: err = bwd::run_flash_bwd<E, 96>(p, stream); break;
#endif
#if TF_FLASH_HEADDIM_COMPILED(128)
      case 128: err = bwd::run_flash_bwd<E, 128>(p, stream); break;
#endif
#if TF_FLASH_HEADDIM_COMPILED(256)
      case 256: err = bwd::run_flash_bwd<E, 256>(p, stream); break;
#endif
      default: break;
    }
  };
  if (dtype == DType::kFloat16) run(cutlass::half_t{});
  else run(cutlass::bfloat16_t{});
  return int(err);
}

}  // namespace tf_flash
