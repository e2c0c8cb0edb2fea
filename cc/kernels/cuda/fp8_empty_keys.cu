// An fp8 (e4m3) forward without keys (fwd_api.h: empty_keys_fp8). Nothing here includes CuTe.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {
namespace {

__global__ void fill_kernel(float* data, int64_t n, float value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = value;
}

}  // namespace

cudaError_t empty_keys_fp8(const FlashFwdParams& p, cudaStream_t stream) {
  // O [B, Sq, H, Dv], contiguous as FillParams lays it out (16-bit elements); lse [B, H, Sq].
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.num_heads;
  if (rows == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(p.out, 0, size_t(rows * p.head_dim_v * 2), stream);
  if (err != cudaSuccess || p.lse == nullptr) return err;
  const unsigned blocks = unsigned(rows / 256 + 1 < 1024 ? rows / 256 + 1 : 1024);
  fill_kernel<<<blocks, 256, 0, stream>>>(p.lse, rows, -INFINITY);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_flash
