// Staging copies for the GPU OpKernels: the attention kernels take float16/bfloat16 with head dims that
// are multiples of 8, so float32 tensors and other head dims go through a cast-and-pad copy on the way
// in and a cast-and-crop copy on the way out (O(N d) extra traffic against the O(N^2 d) attention).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/flash/launch.h"

namespace tf_flash {
namespace {

template <typename T> __device__ __forceinline__ float load_as_float(const void* base, int64_t i);
template <> __device__ __forceinline__ float load_as_float<float>(const void* base, int64_t i) {
  return static_cast<const float*>(base)[i];
}
template <> __device__ __forceinline__ float load_as_float<__half>(const void* base, int64_t i) {
  return __half2float(static_cast<const __half*>(base)[i]);
}
template <> __device__ __forceinline__ float load_as_float<__nv_bfloat16>(const void* base, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

template <typename T> __device__ __forceinline__ void store_float(void* base, int64_t i, float x);
template <> __device__ __forceinline__ void store_float<float>(void* base, int64_t i, float x) {
  static_cast<float*>(base)[i] = x;
}
template <> __device__ __forceinline__ void store_float<__half>(void* base, int64_t i, float x) {
  static_cast<__half*>(base)[i] = __float2half_rn(x);
}
template <> __device__ __forceinline__ void store_float<__nv_bfloat16>(void* base, int64_t i, float x) {
  static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
}

// dst[r, c] = src[r, c] for c < min(src_dim, dst_dim), 0 for the padding columns; rows are contiguous.
template <typename Src, typename Dst>
__global__ void stage_rows_kernel(const void* src, int src_dim, void* dst, int dst_dim, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / dst_dim;
    const int col = static_cast<int>(i % dst_dim);
    store_float<Dst>(dst, i, col < src_dim ? load_as_float<Src>(src, row * src_dim + col) : 0.f);
  }
}

template <typename Src>
cudaError_t launch_for_dst(const void* src, int src_dim, void* dst, DType dst_type, int dst_dim, int64_t total,
                           cudaStream_t stream) {
  const int threads = 256;
  const int64_t wanted = (total + threads - 1) / threads;
  const int blocks = static_cast<int>(wanted < 65535 * 8 ? wanted : 65535 * 8);
  switch (dst_type) {
    case DType::kFloat32:
      stage_rows_kernel<Src, float><<<blocks, threads, 0, stream>>>(src, src_dim, dst, dst_dim, total);
      break;
    case DType::kFloat16:
      stage_rows_kernel<Src, __half><<<blocks, threads, 0, stream>>>(src, src_dim, dst, dst_dim, total);
      break;
    case DType::kBFloat16:
      stage_rows_kernel<Src, __nv_bfloat16><<<blocks, threads, 0, stream>>>(src, src_dim, dst, dst_dim, total);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

int flash_cuda_stage_rows(const void* src, DType src_type, int src_dim, void* dst, DType dst_type, int dst_dim,
                          int64_t rows, void* stream_handle) {
  const int64_t total = rows * dst_dim;
  if (total == 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  switch (src_type) {
    case DType::kFloat32: return launch_for_dst<float>(src, src_dim, dst, dst_type, dst_dim, total, stream);
    case DType::kFloat16: return launch_for_dst<__half>(src, src_dim, dst, dst_type, dst_dim, total, stream);
    case DType::kBFloat16:
      return launch_for_dst<__nv_bfloat16>(src, src_dim, dst, dst_type, dst_dim, total, stream);
  }
  return 0;
}

}  // namespace tf_flash
