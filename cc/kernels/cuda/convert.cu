// flash_cuda_convert: a grid-stride elementwise cast (see convert.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/convert.h"

namespace tf_flash {
namespace {

__device__ __forceinline__ float load_as_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

__device__ __forceinline__ void store_from_float(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(p)[i] = x; break;
    case DType::kFloat16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
  }
}

__global__ void convert_kernel(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_from_float(dst, dst_dtype, i, load_as_float(src, src_dtype, i));
}

}  // namespace

int flash_cuda_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, void* stream) {
  if (n <= 0) return int(cudaSuccess);
  if (src_dtype != DType::kFloat32 && dst_dtype != DType::kFloat32 && src_dtype != dst_dtype)
    return int(cudaErrorInvalidValue);
  const int threads = 256;
  const int64_t blocks64 = (n + threads - 1) / threads;
  const int blocks = int(blocks64 < 132 * 32 ? blocks64 : 132 * 32);
  convert_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(src, src_dtype, dst, dst_dtype, n);
  return int(cudaGetLastError());
}

}  // namespace tf_flash
