// attn_mask as the Hopper forward reads it: one bit per entry, packed by a pass that runs before the kernel
// into FlashFwdParams::mask_workspace (flash_fwd_cuda_workspace_bytes sizes it). The sm_80 family reads
// the boolean mask itself, a byte per entry staged through shared memory: what cost it 3-10x its unmasked
// time (benchmarks/results/tf_gpu_round12/); here each consumer thread loads one 32-bit word per row and
// tile. Three parts:
//  - bits: per (mask batch, mask head, mask row, chunk of 128 keys) four words laid out as a wgmma
//    accumulator holds its columns: the thread at lane % 4 == q holds keys 8 i + 2 q + e (i < 16, e < 2) of
//    a 128-key tile, which are bits 2 i + e of word q; a 64-key tile is half a chunk (bits 0-15 or 16-31).
//  - summary: per (mask plane, group of 64 rows, chunk) bit 0 some entry True, bit 1 every entry True
//    (rows and keys inside the tensor): tiles with none are skipped, tiles with all are not masked.
//  - value flags: per (batch, kv head, 64 keys) 1 when V holds a non-finite value there: only those tiles
//    pay the exact zeroing of the value rows no query of the tile sees (0 x NaN must not reach the output).
// Broadcast axes of the mask (stride 0) stay broadcast: a [B, 1, 1, Sk] key mask packs to one row per batch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

constexpr int kMaskChunkKeys = 128;  // keys per chunk of four words
constexpr int kMaskRowGroup = 64;    // rows per summary entry: one consumer warpgroup's rows
constexpr int kValueFlagKeys = 64;   // keys per value flag: the smallest Hopper key tile

enum MaskSummary : uint8_t { kMaskSomeVisible = 1, kMaskAllVisible = 2 };

struct PackedMaskLayout {
  int64_t batches = 0, heads = 0, rows = 0;  // the mask's own extents (1 on a broadcast axis)
  int64_t chunks = 0, row_groups = 0, value_tiles = 0;
  int64_t summary_offset = 0, value_flags_offset = 0, bytes = 0;

  TF_FLASH_HOST_DEVICE explicit PackedMaskLayout(const FlashFwdParams& p) {
    const BroadcastBoolMask& m = p.attn_mask;
    batches = m.batch_stride != 0 ? p.batch : 1;
    heads = m.head_stride != 0 ? p.num_heads : 1;
    rows = m.row_stride != 0 ? p.seqlen_q : 1;
    chunks = (int64_t(p.seqlen_k) + kMaskChunkKeys - 1) / kMaskChunkKeys;
    row_groups = (rows + kMaskRowGroup - 1) / kMaskRowGroup;
    value_tiles = (int64_t(p.seqlen_k) + kValueFlagKeys - 1) / kValueFlagKeys;
    const int64_t planes = batches * heads;
    summary_offset = planes * rows * chunks * 16;
    value_flags_offset = round16(summary_offset + planes * row_groups * chunks);
    bytes = round16(value_flags_offset + int64_t(p.batch) * p.num_heads_kv * value_tiles);
  }
  static TF_FLASH_HOST_DEVICE int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

  TF_FLASH_HOST_DEVICE int64_t plane(int b, int h) const {
    return (batches > 1 ? b : 0) * heads + (heads > 1 ? h : 0);
  }
  // Word q of (row, chunk): rows past the mask's own (a broadcast row axis) read row 0.
  TF_FLASH_HOST_DEVICE int64_t word_index(int64_t plane_index, int64_t row, int64_t chunk, int q) const {
    return ((plane_index * rows + (rows > 1 ? row : 0)) * chunks + chunk) * 4 + q;
  }
  TF_FLASH_HOST_DEVICE int64_t summary_index(int64_t plane_index, int64_t row_group, int64_t chunk) const {
    return (plane_index * row_groups + row_group) * chunks + chunk;
  }
  TF_FLASH_HOST_DEVICE int64_t value_flag_index(int b, int h_kv, int num_heads_kv, int64_t tile) const {
    return (int64_t(b) * num_heads_kv + h_kv) * value_tiles + tile;
  }
};

// Packs p.attn_mask into p.mask_workspace and flags V's non-finite tiles, on `stream`. Fails with
// cudaErrorInvalidValue, launching nothing, where a grid dimension would overflow (the caller then runs the
// sm_80 family).
cudaError_t pack_attention_mask(const FlashFwdParams& p, bool bfloat16, cudaStream_t stream);

}  // namespace cuda
}  // namespace tf_flash
