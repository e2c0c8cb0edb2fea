// Declarations shared by the backward instantiation files (flash_bwd_hdim*_*.cu) and the dispatcher
// (flash_bwd_api.cu). Only CUDA runtime types here; the kernels live in bwd_kernel.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// One explicit instantiation per (dtype, head dim), each in its own .cu so they compile in parallel.
// Element is cutlass::half_t or cutlass::bfloat16_t. The backward's three kernels (bwd_kernel.h), kernel 2 of
// `dkdv_family` (family.h's choice: kSm80 or kSm90).
template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const FlashBwdParams& params, KernelFamily dkdv_family, cudaStream_t stream);

// Rows of the lse/D/dQ-accumulator scratch are padded to a multiple of this (>= every kBlockM).
constexpr int kScratchRowPad = 128;

inline int64_t padded_rows(int64_t seqlen_q) {
  return (seqlen_q + kScratchRowPad - 1) / kScratchRowPad * kScratchRowPad;
}

// The deterministic backward's dQ accumulators (one per CTA of a (kv head, batch)) take at most this much
// scratch, unless one accumulator alone is larger.
constexpr int64_t kMaxDeterministicDqBytes = int64_t(1) << 30;

// Keys per tile of kernel 2, the same in both families (their traits assert it): 64 at head dim 256, where a
// thread's dK and dV accumulators would not fit in registers over 128 keys, else 128.
constexpr int bwd_key_tile(int kernel_headdim) { return kernel_headdim == 256 ? 64 : 128; }

// dQ accumulators: 1 (atomics from every key tile's CTA into one), or, deterministic, one per CTA, each CTA
// of a (kv head, batch) looping over every splits-th key tile into its own accumulator (both families' kernel 2:
// bwd_kernel.h, bwd_kernel_sm90.h; bwd_dkdv_ctas).
// The split count minimizes the estimated time, waves x key tiles per CTA (one CTA per SM: the kernel's
// launch bounds), smallest on ties: with 32 (kv head, batch) units on 132 SMs, 4 splits run 128 CTAs in
// one wave where 5 would run 160 in two. Bounded by the key tiles (bwd_key_tile) and by
// kMaxDeterministicDqBytes. A function of the shapes and the device only, so that equal inputs on one
// device are summed in the same order.
inline int bwd_dq_splits(const FlashBwdParams& p) {
  if (!p.deterministic) return 1;
  int device = 0, sms = 1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 1;
  }
  const int64_t units = int64_t(p.batch) * p.num_heads_kv;
  const int key_tile = bwd_key_tile(tf_flash_kernel_headdim(p));
  const int64_t key_tiles = (int64_t(p.seqlen_k) + key_tile - 1) / key_tile;
  const int64_t accum_bytes =
      int64_t(p.batch) * p.num_heads * padded_rows(p.seqlen_q) * tf_flash_kernel_headdim(p) * int64_t(sizeof(float));
  int64_t max_splits = key_tiles < 2 * int64_t(sms) ? key_tiles : 2 * int64_t(sms);
  if (accum_bytes > 0 && max_splits > kMaxDeterministicDqBytes / accum_bytes)
    max_splits = kMaxDeterministicDqBytes / accum_bytes;
  if (units <= 0 || max_splits < 1) return 1;
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t splits = 1; splits <= max_splits; ++splits) {
    const int64_t waves = (units * splits + sms - 1) / sms;
    const int64_t cost = waves * ((key_tiles + splits - 1) / splits);
    if (cost < best_cost) best = splits, best_cost = cost;
  }
  return int(best);
}

// The packed attn_mask of the Hopper backward (packed_mask.h), where that kernel takes the params (family.h). Else 0.
inline int64_t bwd_mask_bytes(const FlashBwdParams& p) {
  if (p.attn_mask.data == nullptr || !hopper_backward_takes(p)) return 0;
  return PackedMaskLayout(p, MaskPacking::kBackward).bytes;
}

// Scratch: dQ accumulators [splits, B, H, Sq_pad, headdim] then lse2 and D, [B, H, Sq_pad] each, all float32;
// then the packed attn_mask (bwd_mask_bytes; Sq_pad keeps it 16-byte aligned).
inline int64_t bwd_scratch_bytes(const FlashBwdParams& p) {
  const int64_t rows = int64_t(p.batch) * p.num_heads * padded_rows(p.seqlen_q);
  return rows * (int64_t(bwd_dq_splits(p)) * tf_flash_kernel_headdim(p) + 2) * int64_t(sizeof(float)) +
         bwd_mask_bytes(p);
}

// Where those pieces live in params.scratch, as the kernels of both backward families see them.
struct BwdScratch {
  float* dq_accum;  // [dq_splits, B, H, Sq_pad, dq_cols]: one dQ accumulator per split (bwd_dq_splits)
  float* lse2;      // [B, H, Sq_pad]  lse * log2(e); +inf where P must be 0
  float* dvec;      // [B, H, Sq_pad]  rowsum(dO * O) - d_lse
  int64_t sq_pad;
  int dq_cols;      // the kernel's head dim: max(head_dim, head_dim_v) rounded up to a compiled one
  bool deterministic;  // one dQ accumulator per CTA (dq_splits CTAs per (kv head, batch)), no race
  int dq_splits;       // 1 unless deterministic
  int64_t dq_split_stride;
  uint8_t* mask;       // the packed attn_mask (bwd_mask_bytes), or nullptr
};

inline BwdScratch bwd_scratch_layout(const FlashBwdParams& p) {
  const int64_t sq_pad = padded_rows(p.seqlen_q);
  const int64_t rows = int64_t(p.batch) * p.num_heads * sq_pad;
  BwdScratch s;
  s.dq_cols = tf_flash_kernel_headdim(p);
  s.deterministic = p.deterministic;
  s.dq_splits = bwd_dq_splits(p);
  s.dq_split_stride = rows * s.dq_cols;
  s.dq_accum = p.scratch;
  s.lse2 = p.scratch + s.dq_splits * s.dq_split_stride;
  s.dvec = s.lse2 + rows;
  s.sq_pad = sq_pad;
  s.mask = bwd_mask_bytes(p) > 0 ? reinterpret_cast<uint8_t*>(s.dvec + rows) : nullptr;
  return s;
}

// CTAs of kernel 2 per (kv head, batch), in either family: one per key tile, or, deterministic, one per split
// (each running its key tiles in turn).
inline int bwd_dkdv_ctas(const BwdScratch& s, int num_key_tiles) {
  return s.deterministic && s.dq_splits < num_key_tiles ? s.dq_splits : num_key_tiles;
}

// Kernel 2 on the Hopper family (bwd_kernel_sm90.h), for the params hopper_backward_takes accepts; defined in
// bwd_launch_sm90.h, instantiated in flash_bwd_sm90_<dtype>_hdim<d>.cu.
template <class Element, int kHeadDim>
cudaError_t run_bwd_dkdv_sm90(const FlashBwdParams& p, const BwdScratch& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
