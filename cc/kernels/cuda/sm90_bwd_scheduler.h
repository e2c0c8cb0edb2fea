// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) tile schedule: which key tiles a CTA runs, and per key
// tile the query tiles it visits. The producer and the consumers walk the same schedule, so that they agree
// on the order of the pipelines' stages without talking.
#pragma once

#include <cstdint>

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// A key tile's work: the query tiles that see some of its keys (mask.h), for each query head of the group,
// iteration it = (head in group) * n_m + (query tile - m_begin).
struct BwdKeyTileSm90 {
  int n_block, n0, m_begin, n_m, n_iter;
};

// One CTA per (key tile, kv head, batch); with the deterministic dQ, the CTA of split i of (kv head, batch) runs
// key tiles i, i + splits, ... (bwd_dq_splits) in turn, into dQ accumulator i.
// kGeneral: block masks (tiles of False blocks are skipped); kAttnMask: attn_mask (query tiles it hides whole are
// skipped; its summaries also tell the mask part which tiles it hides in part).
template <class Traits, bool kGeneral, bool kAttnMask>
struct BwdSchedulerSm90 {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  using KeyTile = BwdKeyTileSm90;

  const FlashBwdParams& p;
  const BwdScratch& s;
  const int h_kv, b;
  const int num_key_tiles;
  const int group;  // query heads per kv head
  const int64_t q_len, kv_len;
  const bool has_attn_mask;
  const PackedMaskLayout mask_layout;

  __device__ __forceinline__ BwdSchedulerSm90(const FlashBwdParams& params, const BwdScratch& scratch)
      : p(params),
        s(scratch),
        h_kv(blockIdx.y),
        b(blockIdx.z),
        num_key_tiles((params.seqlen_k + kBlockN - 1) / kBlockN),
        group(params.num_heads / params.num_heads_kv),
        q_len(valid_q_len(params, int(blockIdx.z))),
        kv_len(valid_kv_len(params, int(blockIdx.z))),
        has_attn_mask(kAttnMask && params.attn_mask.data != nullptr),
        mask_layout(params, MaskPacking::kBackward) {
    // attn_mask (the masked variant): its packing (packed_mask.h, in the scratch), whose summaries are per (64
    // queries, 128 keys): this kernel's tiles, or (kSplitHeadDim) two of them, which then share one.
    static_assert(!kAttnMask || (kBlockM == kMaskRowGroup && kMaskChunkKeys % kBlockN == 0), "a summary per tile");
  }

  // This CTA's key tiles: n_block = first_key_tile(); n_block < num_key_tiles; n_block = next_key_tile(n_block).
  __device__ __forceinline__ int first_key_tile() const { return blockIdx.x; }
  __device__ __forceinline__ int next_key_tile(int n_block) const { return n_block + gridDim.x; }

  __device__ __forceinline__ KeyTile key_tile(int n_block) const {
    KeyTile t;
    t.n_block = n_block;
    t.n0 = n_block * kBlockN;
    const IndexRange query_rows = query_range_of_keys(p, t.n0, int64_t(t.n0) + kBlockN, q_len, kv_len);
    t.m_begin = int(query_rows.begin / kBlockM);
    const int m_end = int((query_rows.end + kBlockM - 1) / kBlockM);
    t.n_m = m_end > t.m_begin ? m_end - t.m_begin : 0;
    t.n_iter = t.n_m * group;
    return t;
  }
  // The query head and the query tile of iteration it.
  __device__ __forceinline__ int head(const KeyTile& t, int it) const { return h_kv * group + it / t.n_m; }
  __device__ __forceinline__ int query_tile(const KeyTile& t, int it) const { return t.m_begin + it % t.n_m; }

  // attn_mask's summary (kMaskSomeVisible, kMaskAllVisible) of query tile m_tile of head h over keys from n0.
  __device__ __forceinline__ uint8_t mask_summary(int h, int m_tile, int n0) const {
    return s.mask[mask_layout.summary_offset +
                  mask_layout.summary_index(mask_layout.plane(b, h), m_tile, n0 / kMaskChunkKeys)];
  }

  // The first iteration from it on whose tile something is visible (t.n_iter: none).
  // Block-sparse (the general variant; hopper_backward_takes (family.cu): every tile inside one block): tiles
  // of False blocks are skipped by the producer and the consumers alike. The plain variant visits every tile
  // (the check cost it 1-2% at head dim 64, bf16 and fp16).
  __device__ __forceinline__ int next_visible(const KeyTile& t, int it) const {
    if constexpr (kGeneral || kAttnMask) {
      const bool has_block_mask = kGeneral && p.block_mask.data != nullptr;
      if (!has_block_mask && !has_attn_mask) return it;
      for (; it < t.n_iter; ++it) {
        const int h = head(t, it), m_tile = query_tile(t, it);
        if (has_block_mask && !block_visible(p, b, h, m_tile * kBlockM / p.block_q, t.n0 / p.block_k)) continue;
        if (has_attn_mask && !(mask_summary(h, m_tile, t.n0) & kMaskSomeVisible)) continue;
        break;
      }
    }
    return it;
  }

  // The first plane of this CTA's dQ accumulator, (split, batch, head) (bwd_launch.h): its split's.
  __device__ __forceinline__ int dq_plane0() const {
    return s.deterministic ? int(blockIdx.x) * p.batch * p.num_heads : 0;
  }
};

}  // namespace cuda
}  // namespace tf_flash
