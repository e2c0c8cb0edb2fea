// Split-KV (FlashFwdParams::num_splits): which key tiles each run of a query tile takes, where the runs'
// outputs go, and their merge. Shared by the CPU kernel, both CUDA families and the runner
// (flash_attention_params.cc: FlashFwdCudaSplitWorkspaceBytes, which the XLA lowering sizes its result by).
#pragma once

#include <cmath>
#include <cstdint>

#include "cc/kernels/flash/params.h"

namespace tf_flash {

// Run `split` of num_splits takes an even share of the query tile's visible key tiles [tile_begin, tile_end)
// (not of the cache: entries filled to different lengths split their own keys evenly). Empty where there are
// fewer tiles than runs; such a run writes O 0 and lse -inf, which the merge weighs 0.
TF_FLASH_HOST_DEVICE void narrow_to_split(int num_splits, int split, int& tile_begin, int& tile_end) {
  if (num_splits <= 1 || tile_end <= tile_begin) return;
  const int per_split = (tile_end - tile_begin + num_splits - 1) / num_splits;
  const int begin = tile_begin + split * per_split;
  tile_end = begin + per_split < tile_end ? begin + per_split : tile_end;
  tile_begin = begin;
}

// The batch entry of run `split` of entry b in the runs' outputs.
TF_FLASH_HOST_DEVICE int64_t split_entry(const FlashFwdParams& p, int split, int b) {
  return int64_t(split) * p.batch + b;
}

// The runs' outputs in the workspace: O in the output dtype (the GPU kernels' 16-bit one), then lse, each
// 256-byte aligned.
struct SplitWorkspace {
  int64_t lse_offset = 0, bytes = 0;
  SplitWorkspace(const FlashFwdParams& p, int element_bytes) {
    const int64_t rows = int64_t(p.num_splits) * p.batch * p.num_heads * p.seqlen_q;
    lse_offset = (rows * p.head_dim_v * element_bytes + 255) / 256 * 256;
    bytes = p.num_splits > 1 ? lse_offset + rows * int64_t(sizeof(float)) : 0;
  }
};

// The params of the split launch: out and lse at the runs' outputs in `workspace`, contiguous.
inline FlashFwdParams split_run_params(const FlashFwdParams& p, void* workspace, int element_bytes) {
  FlashFwdParams run = p;
  const SplitWorkspace layout(p, element_bytes);
  run.out = workspace;
  run.lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + layout.lse_offset);
  run.o_head_stride = p.head_dim_v;
  run.o_row_stride = int64_t(p.num_heads) * p.head_dim_v;
  run.o_batch_stride = int64_t(p.seqlen_q) * run.o_row_stride;
  return run;
}

// The merged lse of one row from its runs' lse (`stride` apart): -inf where no run saw a key. float32, as the
// kernels' own softmax.
TF_FLASH_HOST_DEVICE float merge_split_lse(const float* lse, int64_t stride, int num_splits) {
  float max_lse = -INFINITY;
  for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, lse[s * stride]);
  if (max_lse == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (int s = 0; s < num_splits; ++s) sum += expf(lse[s * stride] - max_lse);
  return max_lse + logf(sum);
}

// A run's weight in the merged output: exp(its lse - the merged lse), 0 where either is -inf.
TF_FLASH_HOST_DEVICE float split_weight(float run_lse, float lse) {
  return run_lse == -INFINITY ? 0.f : expf(run_lse - lse);
}

}  // namespace tf_flash
