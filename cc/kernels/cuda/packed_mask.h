// attn_mask as the Hopper kernels read it: one bit per entry, packed by a pass that runs before each kernel
// into device memory of the caller's (the forward's FlashFwdParams::mask_workspace, sized by
// flash_fwd_cuda_workspace_bytes; the backward's scratch, bwd_launch.h). The sm_80 family reads the boolean
// mask itself, a byte per entry staged through shared memory: what costs it 3-10x its unmasked time; here a
// consumer thread loads one word per row of its accumulator and tile. The words follow a wgmma accumulator's
// columns: the thread at lane % 4 == q holds columns 8 i + 2 q + e (e < 2) of its tile, which are bits 2 i + e of
// word q.
//  - Forward (queries x keys): per (mask plane, mask row, chunk of 128 keys) four 32-bit words; a 64-key tile
//    is half a chunk (bits 0-15 or 16-31).
//  - Backward (keys x queries, the S^T tile): per (mask plane, key, chunk of 64 queries) four 16-bit words.
//  - Both: a summary per (mask plane, group of 64 rows, chunk of 128 keys), bit 0 some entry True, bit 1 every
//    entry True (rows and keys inside the tensor): tiles with none are skipped, tiles with all are not masked.
//  - Forward only: value flags per (batch, kv head, 64 keys), 1 when V holds a non-finite value there: only
//    those tiles pay the exact zeroing of the value rows no query of the tile sees (0 x NaN must not reach the
//    output).
// Broadcast axes of the mask (stride 0) stay broadcast: a [B, 1, 1, Sk] key mask packs one row per batch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

constexpr int kMaskChunkKeys = 128;  // keys per summary entry, and per four words of the forward's bits
constexpr int kMaskRowGroup = 64;    // rows per summary entry, and per four words of the backward's bits
constexpr int kValueFlagKeys = 64;   // keys per value flag: the smallest Hopper key tile

enum MaskSummary : uint8_t { kMaskSomeVisible = 1, kMaskAllVisible = 2 };
enum class MaskPacking { kForward, kBackward };

struct PackedMaskLayout {
  MaskPacking packing;
  int64_t batches = 0, heads = 0, rows = 0;  // the mask's own extents (1 on a broadcast axis)
  int64_t keys = 0, key_chunks = 0, row_groups = 0, value_tiles = 0;
  int64_t summary_offset = 0, value_flags_offset = 0, bytes = 0;

  TF_FLASH_HOST_DEVICE PackedMaskLayout(const FlashFwdParams& p, MaskPacking packing_) : packing(packing_) {
    const BroadcastBoolMask& m = p.attn_mask;
    batches = m.batch_stride != 0 ? p.batch : 1;
    heads = m.head_stride != 0 ? p.num_heads : 1;
    rows = m.row_stride != 0 ? p.seqlen_q : 1;
    keys = p.seqlen_k;
    key_chunks = (keys + kMaskChunkKeys - 1) / kMaskChunkKeys;
    row_groups = (rows + kMaskRowGroup - 1) / kMaskRowGroup;
    const int64_t planes = batches * heads;
    const bool forward = packing == MaskPacking::kForward;
    summary_offset = forward ? planes * rows * key_chunks * 16 : planes * keys * row_groups * 8;
    value_flags_offset = round16(summary_offset + planes * row_groups * key_chunks);
    value_tiles = forward ? (keys + kValueFlagKeys - 1) / kValueFlagKeys : 0;
    bytes = round16(value_flags_offset + int64_t(p.batch) * p.num_heads_kv * value_tiles);
  }
  static TF_FLASH_HOST_DEVICE int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }
  // pack_attention_mask runs for these params: its grids within CUDA's limits, and (forward) V's rows 16-byte
  // aligned for the pass that flags non-finite values.
  bool packable(const FlashFwdParams& p) const {
    constexpr int64_t kMaxGridYZ = 65535, kMaxGridX = 2147483647;
    if (row_groups > kMaxGridYZ || batches * heads > kMaxGridYZ || key_chunks > kMaxGridX) return false;
    return packing != MaskPacking::kForward ||
           (p.head_dim_v % 8 == 0 && p.v_row_stride % 8 == 0 && p.v_head_stride % 8 == 0 && p.v_batch_stride % 8 == 0 &&
            value_tiles <= kMaxGridX && p.num_heads_kv <= kMaxGridYZ && p.batch <= kMaxGridYZ);
  }

  TF_FLASH_HOST_DEVICE int64_t plane(int b, int h) const {
    return (batches > 1 ? b : 0) * heads + (heads > 1 ? h : 0);
  }
  // Forward: 32-bit word q of (row, key chunk); rows past the mask's own (a broadcast row axis) read row 0.
  TF_FLASH_HOST_DEVICE int64_t word_index(int64_t plane_index, int64_t row, int64_t chunk, int q) const {
    return ((plane_index * rows + (rows > 1 ? row : 0)) * key_chunks + chunk) * 4 + q;
  }
  // Backward: 16-bit word q of (key, row group); a broadcast row axis has one group.
  TF_FLASH_HOST_DEVICE int64_t word_index_t(int64_t plane_index, int64_t key, int64_t group, int q) const {
    return ((plane_index * keys + key) * row_groups + (rows > 1 ? group : 0)) * 4 + q;
  }
  TF_FLASH_HOST_DEVICE int64_t summary_index(int64_t plane_index, int64_t row_group, int64_t chunk) const {
    return (plane_index * row_groups + (rows > 1 ? row_group : 0)) * key_chunks + chunk;
  }
  TF_FLASH_HOST_DEVICE int64_t value_flag_index(int b, int h_kv, int num_heads_kv, int64_t tile) const {
    return (int64_t(b) * num_heads_kv + h_kv) * value_tiles + tile;
  }
};

// Packs p.attn_mask into `workspace` as `layout` says (the forward also flags V's non-finite tiles), on
// `stream`. Fails with cudaErrorInvalidValue, launching nothing, without a workspace or where layout.packable(p) is
// false (the family choice asks it first, and runs the sm_80 family then). bfloat16: V's 16-bit type, else float16;
// scan_values false (fp8 V, which the scan does not read) flags every value tile, which is never wrong (the
// kernel then zeroes the value rows no row sees in every tile the mask hides part of).
cudaError_t pack_attention_mask(const FlashFwdParams& p, const PackedMaskLayout& layout, void* workspace,
                                bool bfloat16, cudaStream_t stream, bool scan_values = true);

}  // namespace cuda
}  // namespace tf_flash
