// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) tile schedule: which key tiles a CTA runs, and per key
// tile the query tiles it visits. The producer and the consumers walk the same schedule, so that they agree
// on the order of the pipelines' stages without talking.
#pragma once

#include <cstdint>

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// A key tile's work: the query tiles that see some of its keys (mask.h), for each query head of the group,
// iteration it = (head in group) * n_m + (query tile - m_begin).
// With segment ids, key_ids: the {min, max} of the tile's valid keys' ids (the producer's test of a query tile).
struct BwdKeyTileSm90 {
  int n_block, n0, m_begin, n_m, n_iter;
  SegmentSpan key_ids;
};

// A query tile's entry in the segment variant's table (BwdSchedulerSm90::make_tile_table).
enum class BwdTileState : uint8_t {
  kHidden = 0,         // no shared document: skipped by the producer and the consumers
  kShown = 1,          // one document on both sides: no entry is hidden by the ids
  kElementMasked = 2,  // a border: masked entry by entry by q_id[row] == kv_id[col]
};

// One CTA per (key tile, kv head, batch); with the deterministic dQ, the CTA of split i of (kv head, batch) runs
// key tiles i, i + splits, ... (bwd_dq_splits) in turn, into dQ accumulator i.
// kGeneral: block masks (tiles of False blocks are skipped). The element masks: attn_mask (query tiles it hides whole
// are skipped; its summaries also tell the mask part which tiles it hides in part), or segment ids (the query tiles
// of the key tile's documents only, and among those the table's: see make_tile_table).
template <class Traits, bool kGeneral, ElementMask kElementMask>
struct BwdSchedulerSm90 {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  static constexpr bool kAttnMask = kElementMask == ElementMask::kAttnMask;
  static constexpr bool kSegments = kElementMask == ElementMask::kSegments;
  using KeyTile = BwdKeyTileSm90;

  const FlashBwdParams& p;
  const BwdScratch& s;
  const int h_kv, b;
  const int num_key_tiles;
  const int group;  // query heads per kv head
  const int64_t q_len, kv_len;
  const bool has_element_mask;  // the variant's element mask is on (attn_mask given, or segment ids)
  const PackedMaskLayout mask_layout;
  // Segment ids: the current key tile's table, a byte per query tile (BwdTileState, indexed by the query tile),
  // after the shared storage and the mask part's words of seen query rows (sm90_backward_table_bytes).
  uint8_t* const tile_state;

  __device__ __forceinline__ BwdSchedulerSm90(const FlashBwdParams& params, const BwdScratch& scratch, char* smem_buf)
      : p(params),
        s(scratch),
        h_kv(blockIdx.y),
        b(blockIdx.z),
        num_key_tiles((params.seqlen_k + kBlockN - 1) / kBlockN),
        group(params.num_heads / params.num_heads_kv),
        q_len(valid_q_len(params, int(blockIdx.z))),
        kv_len(valid_kv_len(params, int(blockIdx.z))),
        has_element_mask(kAttnMask ? params.attn_mask.data != nullptr : kSegments && params.q_segment_ids != nullptr),
        mask_layout(params, MaskPacking::kBackward),
        tile_state(kSegments ? reinterpret_cast<uint8_t*>(smem_buf + sizeof(typename Traits::SharedStorage) +
                                                          kBlockM / 32 * sizeof(uint32_t))
                             : nullptr) {
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
    int m_end = int((query_rows.end + kBlockM - 1) / kBlockM);
    if constexpr (kSegments) {
      // The query tiles of the key tile's documents (mask.h; a binary search where the ids are sorted), as the
      // sm_80 backward narrows them.
      const int64_t col_end = int64_t(t.n0) + kBlockN < kv_len ? int64_t(t.n0) + kBlockN : kv_len;
      const TileRange docs = segment_query_tiles(p, b, t.n0, col_end, kBlockM);
      t.m_begin = t.m_begin > docs.begin ? t.m_begin : docs.begin;
      m_end = m_end < docs.end ? m_end : docs.end;
      if (col_end > t.n0) t.key_ids = segment_span(p.kv_segment_bounds, p.seqlen_k, b, t.n0, col_end);
    }
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

  // Segment ids: how they cover query tile m_tile of key tile t (mask.h's block_coverage over the valid rows and
  // keys; no block mask comes with them, hopper_backward_takes, so the head does not matter).
  __device__ __forceinline__ BlockCoverage segment_coverage(const KeyTile& t, int m_tile) const {
    const int64_t m0 = int64_t(m_tile) * kBlockM, n0 = t.n0;
    return block_coverage(p, b, 0, m0, m0 + kBlockM < q_len ? m0 + kBlockM : q_len, n0,
                          n0 + kBlockN < kv_len ? n0 + kBlockN : kv_len);
  }

  // Segment ids: the table of key tile t, its query tiles' coverage, by the consumers (tid of threads) before the
  // key tile's first query tile; the caller synchronizes them before and after. One byte per tile, so that the
  // consumers' loops read one shared byte where the producer, a step ahead, searches the bounds itself.
  __device__ __forceinline__ void make_tile_table(const KeyTile& t, int tid, int threads) const {
    for (int i = tid; i < t.n_m; i += threads) {
      const BlockCoverage c = segment_coverage(t, t.m_begin + i);
      tile_state[t.m_begin + i] = uint8_t(!c.any  ? BwdTileState::kHidden
                                          : c.all ? BwdTileState::kShown
                                                  : BwdTileState::kElementMasked);
    }
  }
  __device__ __forceinline__ BwdTileState segment_state(int m_tile) const { return BwdTileState(tile_state[m_tile]); }

  // The first iteration from it on whose tile something is visible (t.n_iter: none), for the consumers.
  // Block-sparse (the general variant; hopper_backward_takes (family.cu): every tile inside one block): tiles
  // of False blocks are skipped by the producer and the consumers alike. The plain variant visits every tile
  // (the check cost it 1-2% at head dim 64, bf16 and fp16). Segment ids: the tiles the table does not hide.
  __device__ __forceinline__ int next_visible(const KeyTile& t, int it) const {
    if constexpr (kSegments) {
      for (; it < t.n_iter && segment_state(query_tile(t, it)) == BwdTileState::kHidden; ++it) {
      }
    } else if constexpr (kGeneral || kAttnMask) {
      const bool has_block_mask = kGeneral && p.block_mask.data != nullptr;
      if (!has_block_mask && !has_element_mask) return it;
      for (; it < t.n_iter; ++it) {
        const int h = head(t, it), m_tile = query_tile(t, it);
        if (has_block_mask && !block_visible(p, b, h, m_tile * kBlockM / p.block_q, t.n0 / p.block_k)) continue;
        if (has_element_mask && !(mask_summary(h, m_tile, t.n0) & kMaskSomeVisible)) continue;
        break;
      }
    }
    return it;
  }

  // next_visible for the producer, which runs ahead of the consumers' table: with segment ids it asks the bounds
  // whether the query tile's ids meet the key tile's (block_coverage's `any`, with the key tile's span found once:
  // the whole test in the producer's 24 registers spills), else it reads what the consumers read.
  __device__ __forceinline__ int next_to_load(const KeyTile& t, int it) const {
    if constexpr (kSegments) {
      for (; it < t.n_iter; ++it) {
        const int64_t m0 = int64_t(query_tile(t, it)) * kBlockM;
        const SegmentSpan rows =
            segment_span(p.q_segment_bounds, p.seqlen_q, b, m0, m0 + kBlockM < q_len ? m0 + kBlockM : q_len);
        if (rows.max >= t.key_ids.min && t.key_ids.max >= rows.min) break;
      }
      return it;
    } else {
      return next_visible(t, it);
    }
  }

  // The first plane of this CTA's dQ accumulator, (split, batch, head) (bwd_launch.h): its split's.
  __device__ __forceinline__ int dq_plane0() const {
    return s.deterministic ? int(blockIdx.x) * p.batch * p.num_heads : 0;
  }
};

}  // namespace cuda
}  // namespace tf_flash
