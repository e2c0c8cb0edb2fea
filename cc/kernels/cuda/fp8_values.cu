// The V^T pass of the fp8 (e4m3) Hopper forward (fwd_api.h: transpose_values_fp8). Nothing here includes CuTe.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// V^T of an fp8 forward, [batch, kv heads, head_dim_v, fp8_value_keys(p)], keys contiguous, in the slot order of
// fp8_value_key_of_slot (sm90_tile_size.h), zeros past seqlen_k: transpose_values_fp8 writes it into
// p.value_transposed (flash_fwd_cuda_value_transpose_bytes). A separate pass rather than a transpose in shared
// memory inside the kernel: it reads and writes V once more (a small share of the forward's time beside its
// Sq / 128 reads of V per head), and the kernel's producer stays the 16-bit forward's.
namespace {

constexpr int kTransposeKeys = 64, kTransposeDims = 64, kTransposeThreads = 256;

__global__ void __launch_bounds__(kTransposeThreads) transpose_values_fp8_kernel(const FlashFwdParams p, int64_t keys) {
  // V's bytes of kTransposeKeys keys x kTransposeDims dims (+4: fewer bank conflicts when read by columns).
  __shared__ uint8_t tile[kTransposeKeys][kTransposeDims + 4];
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t key0 = int64_t(blockIdx.x) * kTransposeKeys;
  const uint8_t* v = static_cast<const uint8_t*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
  uint8_t* vt = static_cast<uint8_t*>(p.value_transposed) + (int64_t(b) * p.num_heads_kv + h) * p.head_dim_v * keys;
  constexpr int kWords = kTransposeDims / 4;  // 4-byte words of a tile row
  for (int d0 = 0; d0 < p.head_dim_v; d0 += kTransposeDims) {
    // Rows of V (head_dim_v and the strides are multiples of 16 bytes: check_supported), zeros past seqlen_k.
    for (int i = threadIdx.x; i < kTransposeKeys * kWords; i += kTransposeThreads) {
      const int r = i / kWords, w = i % kWords;
      const int64_t key = key0 + r;
      const int d = d0 + 4 * w;
      uint32_t word = 0;
      if (key < p.seqlen_k && d < p.head_dim_v)
        word = *reinterpret_cast<const uint32_t*>(v + key * p.v_row_stride + d);
      *reinterpret_cast<uint32_t*>(&tile[r][4 * w]) = word;
    }
    __syncthreads();
    // Rows of V^T: 4 slots per word, each slot's key from the same 16-key group (so from this tile).
    for (int i = threadIdx.x; i < kTransposeDims * (kTransposeKeys / 4); i += kTransposeThreads) {
      const int dd = i / (kTransposeKeys / 4), w = i % (kTransposeKeys / 4);
      const int d = d0 + dd;
      const int64_t slot0 = key0 + 4 * w;
      if (d >= p.head_dim_v || slot0 >= keys) continue;
      uint32_t word = 0;
      for (int j = 0; j < 4; ++j) word |= uint32_t(tile[fp8_value_key_of_slot(4 * w + j)][dd]) << (8 * j);
      *reinterpret_cast<uint32_t*>(vt + int64_t(d) * keys + slot0) = word;
    }
    __syncthreads();
  }
}

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

cudaError_t transpose_values_fp8(const FlashFwdParams& p, cudaStream_t stream) {
  const int64_t keys = fp8_value_keys(p);
  if (keys == 0 || p.num_heads_kv == 0 || p.batch == 0) return cudaSuccess;
  if (p.value_transposed == nullptr) return cudaErrorInvalidValue;  // flash_fwd_cuda_value_transpose_bytes
  const dim3 grid(unsigned((keys + kTransposeKeys - 1) / kTransposeKeys), unsigned(p.num_heads_kv), unsigned(p.batch));
  transpose_values_fp8_kernel<<<grid, kTransposeThreads, 0, stream>>>(p, keys);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_flash
