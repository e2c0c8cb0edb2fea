// Declarations shared by the backward instantiation files (flash_bwd_hdim*_*.cu) and the dispatcher
// (flash_bwd_api.cu). Only CUDA runtime types here; the kernels live in bwd_kernel.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// One explicit instantiation per (dtype, head dim), each in its own .cu so they compile in parallel.
// Element is cutlass::half_t or cutlass::bfloat16_t.
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const FlashBwdParams& params, cudaStream_t stream);

// Rows of the lse/D/dQ-accumulator scratch are padded to a multiple of this (>= every kBlockM).
constexpr int kScratchRowPad = 128;

inline int64_t padded_rows(int64_t seqlen_q) {
  return (seqlen_q + kScratchRowPad - 1) / kScratchRowPad * kScratchRowPad;
}

// The deterministic backward's dQ accumulators (one per CTA of a (kv head, batch)) take at most this much
// scratch, unless one accumulator alone is larger.
constexpr int64_t kMaxDeterministicDqBytes = int64_t(1) << 30;

// dQ accumulators: 1 (atomics from every key tile's CTA into one), or, deterministic, enough CTAs per (kv
// head, batch) for one wave over the GPU's SMs, each looping over its key tiles into its own accumulator
// (bwd_kernel.h), bounded by the key tiles (of 128) and by kMaxDeterministicDqBytes. A function of the
// shapes and the device only, so that equal inputs on one device are summed in the same order.
inline int bwd_dq_splits(const FlashBwdParams& p) {
  if (!p.deterministic) return 1;
  int device = 0, sms = 1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 1;
  }
  const int64_t units = int64_t(p.batch) * p.num_heads_kv;
  const int64_t key_tiles = (int64_t(p.seqlen_k) + 127) / 128;
  const int64_t accum_bytes =
      int64_t(p.batch) * p.num_heads * padded_rows(p.seqlen_q) * tf_flash_kernel_headdim(p) * int64_t(sizeof(float));
  int64_t splits = units > 0 ? (sms + units - 1) / units : 1;
  if (splits > key_tiles) splits = key_tiles;
  if (accum_bytes > 0 && splits > kMaxDeterministicDqBytes / accum_bytes) splits = kMaxDeterministicDqBytes / accum_bytes;
  return splits < 1 ? 1 : int(splits);
}

// Scratch: dQ accumulators [splits, B, H, Sq_pad, headdim] then lse2 and D, [B, H, Sq_pad] each, all float32.
inline int64_t bwd_scratch_bytes(const FlashBwdParams& p) {
  const int64_t rows = int64_t(p.batch) * p.num_heads * padded_rows(p.seqlen_q);
  return rows * (int64_t(bwd_dq_splits(p)) * tf_flash_kernel_headdim(p) + 2) * int64_t(sizeof(float));
}

}  // namespace cuda
}  // namespace tf_flash
