// What the CUDA kernels support, stated once for the forward and the backward (launch.h says where
// each device's support lives). The argument rules common to CPU and GPU (scale, window, block sizes,
// dropout rate, lengths) are checked before, by FillParams; repeated here only where a kernel would
// misbehave without them. Nothing here includes CuTe.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/float32_kernels.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {
namespace {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

std::string compiled_headdims() {
  std::string list;
  for (int d : kListedHeadDims) {
    if (tf_flash_round_headdim(d) == d) list += (list.empty() ? "" : ", ") + std::to_string(d);
  }
  return list;
}

// The tensor-core families (float16, bfloat16; float32 staged to float16): their compiled head dims and
// 16-byte rows.
std::string check_supported_tensor_core(const FlashFwdParams& p, const std::string& kernels) {
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim_v <= 0 || p.head_dim_v % 8 != 0)
    return kernels + " needs head dims that are positive multiples of 8 (received head_dim=" +
           std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) + ")";
  if (tf_flash_kernel_headdim(p) == 0)
    return kernels + " has no kernel for head_dim=" + std::to_string(p.head_dim) + ", head_dim_v=" +
           std::to_string(p.head_dim_v) + " (compiled head dims: " + compiled_headdims() +
           "; smaller head dims run in the next larger kernel)";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                             p.k_row_stride,   p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                             p.v_head_stride,  p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0)
      return kernels + " needs q/k/v/out strides that are multiples of 8 elements (received stride " +
             std::to_string(s) + ")";
  }
  return "";
}

// The full-float32 kernels (float32_kernels.cu): any head dim up to their largest, any strides, and the
// shared memory of their head dim bucket (the backward runs the forward's kernel too, and needs more).
std::string check_supported_float32(const FlashFwdParams& p, const std::string& kernels, Direction direction) {
  if (p.head_dim <= 0 || p.head_dim > float32_max_head_dim() || p.head_dim_v <= 0 ||
      p.head_dim_v > float32_max_head_dim())
    return kernels + " in full float32 supports head dims 1.." + std::to_string(float32_max_head_dim()) +
           " (received head_dim=" + std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) +
           ")";
  const int needed = float32_shared_bytes(p, direction);
  int device = 0, available = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&available, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
      needed > available)
    return kernels + " in full float32 needs " + std::to_string(needed / 1024) + " KiB of shared memory per " +
           "block at head_dim=" + std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) +
           "; this GPU gives " + std::to_string(available / 1024) + " KiB (TF's TF32 switch on runs float32 on " +
           "the tensor-core kernels)";
  return "";
}

// fp8 (e4m3) inputs: the Hopper forward only, rows of 16 bytes (the TMA's), no dropout, and the descales given.
std::string check_supported_fp8(const FlashFwdParams& p, Direction direction) {
  if (direction != Direction::kForward)
    return "FP8 (float8_e4m3fn) inputs have a forward only: there is no FP8 gradient (received a backward call)";
  if (p.head_dim <= 0 || p.head_dim % 16 != 0 || p.head_dim_v <= 0 || p.head_dim_v % 16 != 0)
    return "FP8 (float8_e4m3fn) inputs need head dims that are positive multiples of 16 (received head_dim=" +
           std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) + ")";
  const int64_t input_strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                                   p.k_row_stride,   p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                                   p.v_head_stride};
  for (int64_t s : input_strides) {
    if (s % 16 != 0)
      return "FP8 (float8_e4m3fn) inputs need q/k/v strides that are multiples of 16 elements (received stride " +
             std::to_string(s) + ")";
  }
  for (int64_t s : {p.o_batch_stride, p.o_row_stride, p.o_head_stride}) {
    if (s % 8 != 0)
      return "FP8 (float8_e4m3fn) inputs need output strides that are multiples of 8 elements (received stride " +
             std::to_string(s) + ")";
  }
  if (p.dropout_rate != 0.f)
    return "FP8 (float8_e4m3fn) inputs take no dropout (received dropout_rate=" + std::to_string(p.dropout_rate) + ")";
  if (p.q_descale == nullptr || p.k_descale == nullptr || p.v_descale == nullptr)
    return "FP8 (float8_e4m3fn) inputs need q_descale, k_descale and v_descale";
  return hopper_fp8_forward_refusal(p);
}

}  // namespace

std::string check_supported(const FlashFwdParams& p, DType dtype, Direction direction) {
  const std::string kernels = direction == Direction::kForward ? "the CUDA forward" : "the CUDA backward";
  if (dtype != DType::kFloat32 && dtype != DType::kFloat16 && dtype != DType::kBFloat16 &&
      dtype != DType::kFloat8E4M3)
    return kernels + " supports float32, float16, bfloat16 and (forward, Hopper) float8_e4m3fn inputs only " +
           "(received dtype=" + dtype_name(dtype) + ")";
  const std::string reason =
      dtype == DType::kFloat32 ? check_supported_float32(p, kernels, direction)
      : dtype == DType::kFloat8E4M3 ? check_supported_fp8(p, direction)
                                    : check_supported_tensor_core(p, kernels);
  if (!reason.empty()) return reason;
  if (p.num_heads_kv <= 0 || p.num_heads % p.num_heads_kv != 0)
    return "num_heads must be a multiple of num_heads_kv (received num_heads=" + std::to_string(p.num_heads) +
           ", num_heads_kv=" + std::to_string(p.num_heads_kv) + ")";
  if (p.num_heads > 65535 || p.batch > 65535)  // grid dimensions y and z
    return kernels + " supports at most 65535 heads and 65535 batch entries (received num_heads=" +
           std::to_string(p.num_heads) + ", batch=" + std::to_string(p.batch) + ")";
  // FillParams' rules, repeated because a kernel would divide by zero or mis-scale without them (the
  // harness in tests/cuda_harness calls the kernels without FillParams).
  if (p.block_mask.data != nullptr && (p.block_q <= 0 || p.block_k <= 0))
    return "block_mask needs positive block sizes (received block_q=" + std::to_string(p.block_q) +
           ", block_k=" + std::to_string(p.block_k) + ")";
  if (!(p.dropout_rate >= 0.f && p.dropout_rate < 1.f))
    return "dropout_rate must be in [0, 1) (received " + std::to_string(p.dropout_rate) + ")";
  return "";
}

}  // namespace cuda
}  // namespace tf_flash
