// The Hopper forward's mask: which key tiles a query tile runs and which of their scores and value rows it
// hides. The visibility rules are mask.h's (causal, window, lengths: mask_scores); on top of them the tile
// table of block masks, attn_mask and segment ids (one byte per key tile, made once per CTA), the element masks
// of the tiles the table marks (attn_mask's packed bits, packed_mask.h, or a bit per score from the segment ids)
// and the zeroing of value rows that no row sees. FwdMaskSm90 is the CTA's part (the
// table, read by the producer and the consumers); FwdMaskSm90::QueryTile is one consumer thread's view of one
// query tile, whose `apply` masks a tile of scores.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"

#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_fwd_scheduler.h"
#include "cc/kernels/cuda/sm90_fwd_traits.h"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// A key tile's entry in the forward's tile table.
enum TileState : uint8_t {
  kTileHidden = 0,           // skipped
  kTileShown = 1,            // processed; the element mask, if any, shows all of it
  kTileElementMasked = 2,    // the element mask hides part of it: masked entry by entry
  kTileValuesNonFinite = 4,  // with kTileElementMasked: V may hold a non-finite value in it
};

// The tile table (the general variant of the 128-row tiles, and the element-mask variants): one byte per key
// tile, TileState, made once per CTA after the shared storage (launch_flash_fwd_sm90 sizes it) from the block
// mask's row (family.cu's hopper_forward_takes: the query tile lies in one query block, each key tile
// in one key block), from attn_mask's summaries (packed_mask.h) or from the segment ids' bounds (mask.h's
// block_coverage). Hidden tiles are skipped by the producer and the consumers alike; the loops then read one
// shared byte per tile. (Per-consumer blocks of 64 rows, masking a tile whole for one consumer, cost the d64
// kernel of three consumers 400-800 bytes of spills.)
template <class Traits, bool kGeneral, ElementMask kElementMask>
struct FwdMaskSm90 {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kMmaThreads = Traits::kMmaThreads;
  static constexpr bool kAttnMask = kElementMask == ElementMask::kAttnMask;
  static constexpr bool kSegments = kElementMask == ElementMask::kSegments;
  static constexpr bool kTileTable = (kGeneral || kElementMask != ElementMask::kNone) && kBlockM == 128;
  static_assert(kElementMask == ElementMask::kNone || kTileTable, "element masks run on the 128-row tiles");
  // After the shared storage: what each consumer warp's rows see of a tile (zero_unseen_values); with segment ids
  // the key tiles of the query tile's documents (document_tiles); then the table.
  static constexpr int kSeenWords = Traits::kMmaThreads / 32 * 4;
  static constexpr int kDocumentWords = kSegments ? 2 : 0;
  static_assert((kSeenWords + kDocumentWords) * 4 ==
                    sm90_forward_table_bytes(Traits::kMmaWarpGroups, kBlockN, /*seqlen_k=*/0, kSegments),
                "the launcher and the family choice size this layout by sm90_forward_table_bytes");

  // has_element_mask: the variant's element mask is on (attn_mask given, or segment ids).
  const bool has_block_mask, has_element_mask, has_table;
  uint32_t* const seen_words;
  uint8_t* const tile_state;

  __device__ __forceinline__ FwdMaskSm90(const FlashFwdParams& p, char* smem_buf)
      : has_block_mask(kGeneral && kTileTable && p.block_mask.data != nullptr),
        has_element_mask(kAttnMask ? p.attn_mask.data != nullptr : kSegments && p.q_segment_ids != nullptr),
        has_table(has_block_mask || has_element_mask),
        seen_words(reinterpret_cast<uint32_t*>(smem_buf + sizeof(typename Traits::SharedStorage))),
        tile_state(reinterpret_cast<uint8_t*>(seen_words + kSeenWords + kDocumentWords)) {}

  // Segment ids: the key tiles [begin, end) of the query tile's documents (inside its structural range), which
  // make_segment_tile_table writes once per CTA, so that the loops span only those (narrow_to_documents) and
  // neither the producer nor the consumers search the bounds again.
  __device__ __forceinline__ int* document_tiles() const { return reinterpret_cast<int*>(seen_words + kSeenWords); }

  // The table of the CTA's one tile, by all the CTA's threads (the caller syncs them before it is read). Static,
  // with the mask's fields as arguments: as a member function reading them through `this`, its loop over the row
  // groups is unrolled less (the d256 general attn_mask kernel: 1.1% fewer instructions, other machine code).
  static __device__ __forceinline__ void make_tile_table(const FlashFwdParams& p, const FwdTileWork& first,
                                                         bool has_block_mask, bool has_element_mask,
                                                         uint8_t* tile_state) {
    const PackedMaskLayout layout(p, MaskPacking::kForward);
    const uint8_t* summary = static_cast<const uint8_t*>(p.mask_workspace) + layout.summary_offset;
    const uint8_t* value_flags = static_cast<const uint8_t*>(p.mask_workspace) + layout.value_flags_offset;
    const int64_t plane = layout.plane(first.b, first.h);
    const int64_t m0 = first.m0;
    const int64_t group_begin = layout.rows > 1 ? m0 / kMaskRowGroup : 0;
    const int64_t group_end = layout.rows > 1 ? (m0 + kBlockM + kMaskRowGroup - 1) / kMaskRowGroup : 1;
    for (int n = first.keys.tile_begin + int(threadIdx.x); n < first.keys.tile_end; n += Traits::kNThreads) {
      uint8_t state = kTileShown;
      if (has_block_mask && !mask_at(p.block_mask, first.b, first.h, m0 / p.block_q, n / (p.block_k / kBlockN)))
        state = kTileHidden;
      if (state != kTileHidden && has_element_mask) {
        const int64_t chunk = int64_t(n) * kBlockN / kMaskChunkKeys;
        bool any = false, all = true;
        for (int64_t g = group_begin; g < group_end && g < layout.row_groups; ++g) {
          const uint8_t s = summary[layout.summary_index(plane, g, chunk)];
          any |= (s & kMaskSomeVisible) != 0;
          all &= (s & kMaskAllVisible) != 0;
        }
        if (!any) state = kTileHidden;
        if (any && !all) {
          state |= kTileElementMasked;
          for (int64_t t = int64_t(n) * kBlockN / kValueFlagKeys;
               t < (int64_t(n) + 1) * kBlockN / kValueFlagKeys && t < layout.value_tiles; ++t)
            if (value_flags[layout.value_flag_index(first.b, first.h_kv, p.num_heads_kv, t)])
              state |= kTileValuesNonFinite;
        }
      }
      tile_state[n] = state;
    }
  }

  // The segment variant's table: each key tile of the query tile's documents (mask.h's segment_key_tiles, by a
  // binary search over the key bounds where the ids are sorted) gets block_coverage's answer over the tile's
  // valid rows and keys (the segment ids and, in the general variant, the block mask): no overlap hidden, one
  // document on both sides shown, else masked entry by entry. V's finiteness there is unknown (another
  // document's values may be anything), so masked tiles take the exact rule (kTileValuesNonFinite). Every
  // thread searches (the same loads: one latency, no extra barrier); thread 0 writes the range.
  static __device__ __forceinline__ void make_segment_tile_table(const FlashFwdParams& p, const FwdTileWork& first,
                                                                 uint8_t* tile_state, int* document_tiles) {
    const int64_t row_end = first.m0 + kBlockM < first.q_len ? first.m0 + kBlockM : first.q_len;
    const TileRange docs = segment_key_tiles(p, first.b, first.m0, row_end, kBlockN);
    const int begin = first.keys.tile_begin > docs.begin ? first.keys.tile_begin : docs.begin;
    const int end = first.keys.tile_end < docs.end ? first.keys.tile_end : docs.end;
    if (threadIdx.x == 0) {
      document_tiles[0] = begin;
      document_tiles[1] = end;
    }
    for (int n = begin + int(threadIdx.x); n < end; n += Traits::kNThreads) {
      const int64_t n0 = int64_t(n) * kBlockN;
      const int64_t col_end = n0 + kBlockN < first.kv_len ? n0 + kBlockN : first.kv_len;
      const BlockCoverage c = block_coverage(p, first.b, first.h, first.m0, row_end, n0, col_end);
      tile_state[n] = !c.any  ? uint8_t(kTileHidden)
                      : c.all ? uint8_t(kTileShown)
                              : uint8_t(kTileShown | kTileElementMasked | kTileValuesNonFinite);
    }
  }

  // The key tiles a query tile's loops span: w's structural range, narrowed with segment ids to the documents'
  // (make_segment_tile_table; empty where they meet none). Other variants keep w's.
  __device__ __forceinline__ void narrow_to_documents(FwdTileWork& w) const {
    if constexpr (kSegments) {
      w.keys.tile_begin = document_tiles()[0];
      w.keys.tile_end = document_tiles()[1];
    }
  }

  // The next key tile to process below n (tiles run from the last one down), past the table's hidden ones.
  __device__ __forceinline__ int next_tile(int n, int n_block_min) const {
    for (--n; has_table && n >= n_block_min && tile_state[n] == kTileHidden; --n) {
    }
    return n;
  }
  __device__ __forceinline__ uint8_t state_of(int n) const { return has_table ? tile_state[n] : uint8_t(kTileShown); }
  __device__ __forceinline__ bool element_masked(uint8_t state) const {
    return has_element_mask && (state & kTileElementMasked);
  }
  // A tile that the element mask hides in part while V may hold a non-finite value there (attn_mask: where
  // packed_mask.h's value flags say so; segment ids: always) takes the exact rule: the
  // softmax of the tile publishes the keys each consumer warp's rows see (publish_seen_keys), and before
  // its P V the value rows no row of the tile sees are zeroed. Two barriers over the consumers: only such
  // tiles pay them.
  __device__ __forceinline__ bool needs_exact_zeroing(int n) const {
    constexpr uint8_t kBoth = kTileElementMasked | kTileValuesNonFinite;
    return has_element_mask && (tile_state[n] & kBoth) == kBoth;
  }

  // One consumer thread's mask of one query tile; cS_rc: (row, column) in the score tile of each accumulator
  // element, in the accumulator's row/column view.
  template <class CoordRC>
  struct QueryTile {
    static constexpr int kRows = decltype(cute::size<0>(std::declval<CoordRC>()))::value;
    // Copies rather than references of the CTA's mask and of the coordinates, and the params passed to each call
    // rather than kept here: kept in this object, they reach the optimizer later as what they are (the producer's
    // loop of the plain d128 kernel is then not unrolled, mask_scores reloads the params row by row, and the plain
    // d128 consumers spill 12-20 bytes more).
    const FwdMaskSm90 mask;
    const CoordRC cS_rc;
    // This thread among the consumers' (the warpgroups after the producer's), from threadIdx.x at each use: a
    // copy kept here stays live beside threadIdx.x (the d128 attn_mask consumers then spill one pointer more).
    static __device__ __forceinline__ int mma_tidx() { return int(threadIdx.x) - 128; }
    const int64_t q_len, kv_len, m0;
    const KeyRange first_row;
    // Tiles n with lo_unmasked <= n < hi_unmasked are visible to every valid row in full.
    const int hi_unmasked, lo_unmasked;
    // Keys no row of the tile sees, [0, first_row.begin) and [keys_end, seqlen_k), may hold anything
    // (NaN in padding): their V rows are zeroed in shared memory, since P = 0 there and 0 x NaN is NaN.
    // Past seqlen_k the TMA has zero-filled already.
    const int64_t keys_end;
    // attn_mask: this thread's words of the packed mask (packed_mask.h: lane % 4 picks the word), rows r and
    // r + 8; rows past the tensor's read row 0 (their range hides them anyway).
    const uint32_t* mask_words[kRows];
    // Segment ids: this thread's rows' ids (r and r + 8; rows past the tensor take 0: their output is not
    // written, and rows past q_len count for no key), read once per query tile, and the entry's key ids.
    int32_t row_ids[kRows];
    const int32_t* key_ids;

    __device__ __forceinline__ QueryTile(const FwdMaskSm90& mask, const FlashFwdParams& p, const FwdTileWork& w,
                                         const CoordRC& cS_rc)
        : mask(mask), cS_rc(cS_rc), q_len(w.q_len), kv_len(w.kv_len), m0(w.m0),
          first_row(w.keys.first_row),
          hi_unmasked(int(w.keys.first_row.end / kBlockN)),
          lo_unmasked(int((w.keys.last_row.begin + kBlockN - 1) / kBlockN)),
          keys_end(w.keys.last_row.end < w.kv_len ? w.keys.last_row.end : w.kv_len) {
      if constexpr (kSegments) {
        key_ids = p.kv_segment_ids + int64_t(w.b) * p.seqlen_k;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int64_t row = m0 + cute::get<0>(cS_rc(mi, 0));
          row_ids[mi] = row < p.seqlen_q ? p.q_segment_ids[int64_t(w.b) * p.seqlen_q + row] : 0;
        }
      }
      if (kAttnMask && mask.has_element_mask) {
        const PackedMaskLayout layout(p, MaskPacking::kForward);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int64_t row = m0 + cute::get<0>(cS_rc(mi, 0));
          mask_words[mi] = static_cast<const uint32_t*>(p.mask_workspace) +
                           layout.word_index(layout.plane(w.b, w.h), row < p.seqlen_q ? row : 0, 0, mma_tidx() % 4);
        }
      }
    }

    // Bit ni of bits[mi]: the mask at (row mi, column ni) of the accumulator's row/column view (column ni is key
    // 8 (ni / 2) + 2 (lane % 4) + ni % 2 of the tile); a 64-key tile is half a chunk's word. Segment ids: the
    // row's id equals the key's, keys past kv_len 0 (their range hides them, and the ids end at seqlen_k).
    __device__ __forceinline__ void load_mask_bits(int n, uint32_t (&bits)[kRows]) const {
      if constexpr (kSegments) {
        const int64_t n0 = int64_t(n) * kBlockN;
        const int32_t* ids = key_ids + n0;
        const int keys = int(kv_len - n0 < kBlockN ? kv_len - n0 : kBlockN);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) bits[mi] = 0;
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(cS_rc); ++ni) {
          const int col = cute::get<1>(cS_rc(0, ni));
          const int32_t id = col < keys ? ids[col] : 0;
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) bits[mi] |= uint32_t(col < keys && id == row_ids[mi]) << ni;
        }
        return;
      }
      const int64_t word = int64_t(n) * kBlockN / kMaskChunkKeys * 4;
      const int shift = int64_t(n) * kBlockN % kMaskChunkKeys / 4;
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) bits[mi] = mask_words[mi][word] >> shift;
    }
    __device__ __forceinline__ bool tile_masked(int n) const { return !(n < hi_unmasked && n >= lo_unmasked); }
    __device__ __forceinline__ int next_tile(int n, int n_block_min) const { return mask.next_tile(n, n_block_min); }
    __device__ __forceinline__ uint8_t state_of(int n) const { return mask.state_of(n); }
    __device__ __forceinline__ bool element_masked(uint8_t state) const { return mask.element_masked(state); }

    // Hides the invisible scores of key tile n (s_rc: the accumulator's row/column view; p: the kernel's params,
    // those this object was made with): the rows' key ranges
    // where the tile is not inside all of them, attn_mask's bits where the table says it hides part of the tile.
    template <class Scores>
    __device__ __forceinline__ void apply(const FlashFwdParams& p, Scores& s_rc, int n, uint8_t state,
                                          const uint32_t (&bits)[kRows]) const {
      if (tile_masked(n)) {
        mask_scores<false, kBlockN>(s_rc, cS_rc, p, m0, int64_t(n) * kBlockN, q_len, kv_len, false, nullptr);
      }
      if (mask.element_masked(state)) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < cute::size<1>(s_rc); ++ni)
            if (!((bits[mi] >> ni) & 1u)) s_rc(mi, ni) = -INFINITY;
        }
        if (state & kTileValuesNonFinite) publish_seen_keys(s_rc);
      }
    }

    // The keys some valid row of this warp sees in the masked scores (bit ni: column ni of lane % 4), one word
    // per lane % 4 into seen_words, for zero_values_no_row_sees. Rows past q_len do not count: their mask rows
    // may show keys no query sees. (A score -inf from the inputs counts as unseen: its P is 0 for every row,
    // so zeroing its value row changes nothing.)
    template <class Scores>
    __device__ __forceinline__ void publish_seen_keys(const Scores& s_rc) const {
      bool valid[kRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) valid[mi] = m0 + cute::get<0>(cS_rc(mi, 0)) < q_len;
      uint32_t seen = 0;
      CUTE_UNROLL
      for (int ni = 0; ni < cute::size<1>(s_rc); ++ni) {
        bool any = false;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) any |= valid[mi] && s_rc(mi, ni) != -INFINITY;
        seen |= uint32_t(any) << ni;
      }
      seen |= __shfl_xor_sync(0xffffffffu, seen, 4);  // lanes of one lane % 4 hold the same columns
      seen |= __shfl_xor_sync(0xffffffffu, seen, 8);
      seen |= __shfl_xor_sync(0xffffffffu, seen, 16);
      if (mma_tidx() % 32 < 4) mask.seen_words[mma_tidx() / 32 * 4 + mma_tidx() % 32] = seen;
    }

    // The exact rule (needs_exact_zeroing): zeroes the rows of V's stage that no row of the query tile sees.
    template <class Pipeline, class PipelineState, class SmemVt>
    __device__ __forceinline__ void zero_values_no_row_sees(Pipeline& pipeline_v, PipelineState stage,
                                                            SmemVt& sVt) const {
      using namespace cute;
      pipeline_v.consumer_wait(stage);
      named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);  // every warp published its rows' keys
      static_assert(kMmaThreads % kBlockN == 0, "whole threads per key");
      constexpr int kThreadsPerKey = kMmaThreads / kBlockN, kDimsPerThread = kHeadDim / kThreadsPerKey;
      const int key = mma_tidx() / kThreadsPerKey, part = mma_tidx() % kThreadsPerKey;
      const int word = key % 8 / 2, bit = key / 8 * 2 + key % 2;  // packed_mask.h's column order
      uint32_t seen = 0;
      CUTE_UNROLL
      for (int i = 0; i < kSeenWords / 4; ++i) seen |= mask.seen_words[i * 4 + word] >> bit;
      if (!(seen & 1u)) {
        Tensor sV = sVt(_, _, stage.index());
#pragma unroll 1
        for (int d = part * kDimsPerThread; d < (part + 1) * kDimsPerThread; ++d)
          sV(d, Traits::value_slot_of_key(key)) = Element(0);
      }
      cutlass::arch::fence_view_async_shared();  // visible to the tensor cores (async proxy)
      named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);  // and seen_words free for the next such tile
    }
    // Before the P V of key tile n: zeroes the value rows in V's stage that no row sees (the edges of the
    // tile's key ranges, or the exact rule). Uniform over the consumers.
    template <class Pipeline, class PipelineState, class SmemVt>
    __device__ __forceinline__ void zero_unseen_values(const FlashFwdParams& p, int n, Pipeline& pipeline_v,
                                                       PipelineState stage, SmemVt& sVt) const {
      using namespace cute;
      if (mask.needs_exact_zeroing(n)) return zero_values_no_row_sees(pipeline_v, stage, sVt);
      const int64_t n0 = int64_t(n) * kBlockN;
      const int lo = int(first_row.begin - n0 > 0 ? first_row.begin - n0 : 0);
      const int64_t hi64 = keys_end - n0 < kBlockN ? keys_end - n0 : kBlockN;
      const int hi = n0 + kBlockN > p.seqlen_k && keys_end == p.seqlen_k ? kBlockN : int(hi64);
      if (lo == 0 && hi == kBlockN) return;  // uniform over both consumers: every row of the stage is seen
      pipeline_v.consumer_wait(stage);
      Tensor sV = sVt(_, _, stage.index());
      for (int i = mma_tidx(); i < kHeadDim * kBlockN; i += kMmaThreads) {
        const int slot = i / kHeadDim, d = i % kHeadDim, key = Traits::value_key_of_slot(slot);
        if (key < lo || key >= hi) sV(d, slot) = Element(0);
      }
      cutlass::arch::fence_view_async_shared();  // visible to the tensor cores (async proxy)
      named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);
    }
    // zero_unseen_values inside the loop over the key tiles, where only the first tile (an edge) and tiles of the
    // exact rule can hold value rows no row sees; the last tile, the other edge, is zeroed after the loop.
    template <class Pipeline, class PipelineState, class SmemVt>
    __device__ __forceinline__ void zero_unseen_values_in_loop(const FlashFwdParams& p, int n, int n_first,
                                                               Pipeline& pipeline_v,
                                                               PipelineState stage, SmemVt& sVt) const {
      if (n == n_first || mask.needs_exact_zeroing(n)) zero_unseen_values(p, n, pipeline_v, stage, sVt);
    }
  };
};

}  // namespace cuda
}  // namespace tf_flash
