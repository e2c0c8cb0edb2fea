// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) mask: which entries of an S^T tile (keys x queries) are
// hidden, and the shared-memory rows that must not reach a GEMM.
// Visibility is mask.h's (causal, window, lengths, attn_mask, segment ids, and block masks whose blocks hold whole
// tiles; the scheduler, sm90_bwd_scheduler.h, skips the query tiles that see no key of the tile): tiles that
// straddle a boundary are masked per element, by replacement (P = dS = 0, in the consumer's pass over P and dS).
// Keys no valid query sees and query rows past q_len are zeroed in shared memory (0 x NaN must not reach a GEMM),
// and with segment ids, in a border tile, the Q and dO rows no key of the tile sees.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_bwd_scheduler.h"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/flash/mask.h"

namespace tf_flash {
namespace cuda {

// Zeroes rows [lo, hi) of a (rows, head dim) shared-memory tile, cooperatively over `threads` threads; the
// caller fences (fence_view_async_shared) and synchronizes before a GEMM reads the tile.
template <int kHeadDim, class Tile>
__device__ __forceinline__ void zero_tile_rows(Tile&& tile, int lo, int hi, int tid, int threads) {
  using Element = typename std::decay_t<Tile>::value_type;
  for (int i = tid; i < (hi - lo) * kHeadDim; i += threads) tile(lo + i / kHeadDim, i % kHeadDim) = Element(0);
}

// A consumer thread's entries of the S^T tile are those of cS_rc, its (key row, query column) coordinates in the
// accumulator's row/column view; bit mi * kCols + ni of a TileBits stands for entry (mi, ni).
// The element mask: attn_mask, packed to a bit per entry before the kernel (packed_mask.h): tiles it hides in part
// are masked by the packed bits; or segment ids: the tiles the scheduler's table marks as borders are masked by
// q_id[row] == kv_id[col], and their Q and dO rows that no key of the tile sees are zeroed (zero_unseen_queries).
template <class Traits, ElementMask kElementMask>
struct BwdMaskSm90 {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kMmaThreads = Traits::kMmaThreads;
  static constexpr bool kAttnMask = kElementMask == ElementMask::kAttnMask;
  static constexpr bool kSegments = kElementMask == ElementMask::kSegments;
  using SharedStorage = typename Traits::SharedStorage;
  static_assert(!kSegments || kBlockM == 64, "a border tile's seen query rows: two 32-bit words");

  // Segment ids: the words of the query rows a border tile's keys see (a bit per row), right after the shared
  // storage (then the scheduler's table: sm90_backward_table_bytes). Zero between border tiles.
  __device__ static __forceinline__ uint32_t* seen_query_words(SharedStorage& shared) {
    return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(&shared) + sizeof(SharedStorage));
  }

  // Segment ids, before key tile t's first query tile (its K and V may still be on their way): the scheduler's table
  // of its query tiles, between two barriers of the consumers (the first: both are done with the previous key
  // tile's table). The words of seen query rows start at zero.
  template <class Scheduler>
  __device__ static __forceinline__ void make_tile_table(const Scheduler& tiles, SharedStorage& shared,
                                                         const BwdKeyTileSm90& t, int mma_tidx) {
    if constexpr (kSegments) {
      named_sync(kMmaThreads, BwdSm90Barrier::kTileTable);
      tiles.make_tile_table(t, mma_tidx, kMmaThreads);
      if (mma_tidx < kBlockM / 32) seen_query_words(shared)[mma_tidx] = 0;
      named_sync(kMmaThreads, BwdSm90Barrier::kTileTable);
    }
  }

  // Once per key tile, before its first GEMM: keys that no valid query sees, and query rows past q_len, may hold
  // anything (NaN padding); past the tensors' ends the TMA has zero-filled already.
  template <class Scheduler>
  __device__ static __forceinline__ void zero_unseen_keys(const Scheduler& tiles, SharedStorage& shared, int n0,
                                                          int mma_tidx) {
    using namespace cute;
    const FlashBwdParams& p = tiles.p;
    Tensor sK = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutK{});
    const int64_t keys_end = key_range_of_rows(p, 0, tiles.q_len, tiles.q_len, tiles.kv_len).end;
    const int key_lo = int(keys_end - n0 < kBlockN ? (keys_end - n0 > 0 ? keys_end - n0 : 0) : kBlockN);
    const int key_hi = int(p.seqlen_k - n0 < kBlockN ? p.seqlen_k - n0 : kBlockN);
    if (key_lo < key_hi) {
      zero_tile_rows<kHeadDim>(sK, key_lo, key_hi, mma_tidx, kMmaThreads);
      zero_tile_rows<kHeadDim>(sV, key_lo, key_hi, mma_tidx, kMmaThreads);
      cutlass::arch::fence_view_async_shared();
      named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
    }
    if (tiles.has_element_mask) {
      // Keys the element mask (attn_mask, segment ids) hides from every query of the group may hold anything too
      // (zeroed where the tile holds a non-finite value).
      hide_unseen_keys<kMmaThreads, kBlockN, kHeadDim>(
          sK, sV, shared.key_seen, p, tiles.b, tiles.h_kv * tiles.group, tiles.group, n0, keys_end, tiles.q_len,
          tiles.kv_len, mma_tidx,
          [](bool pred) { return named_sync_or(kMmaThreads, BwdSm90Barrier::kRowsZeroed, pred); },
          [] {
            cutlass::arch::fence_view_async_shared();
            named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
          });
    }
  }

  // Whether the element mask hides part of the tile; if so, this thread's bits of it into mask_bits (bit
  // mi * kCols + ni, 1: visible), loaded before the tile's Q and dO arrive, used after the S^T GEMM (apply).
  // attn_mask: the packed words (keys r and r + 8; keys past the tensor read key 0, hidden by their range).
  // Segment ids: a tile the table marks as a border compares the ids of the thread's keys and query columns;
  // positions past the tensors count as another document.
  template <class Scheduler, class CoordRC>
  __device__ static __forceinline__ bool load_element_mask(const Scheduler& tiles, int h, int m0, int n0,
                                                           CoordRC const& cS_rc, int mma_tidx, uint32_t& mask_bits) {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(cS_rc))::value, kCols = decltype(size<1>(cS_rc))::value;
    mask_bits = 0;
    if constexpr (kAttnMask) {
      // A word holds the thread's columns of all 64 queries (packed_mask.h), two bits per n8 group; with
      // kSplitHeadDim the warpgroup's 32 queries are one byte of it. The words are read inside the summary's
      // branch: with the summary tested into a bool first, the mask pointer and the plane are computed twice per
      // tile.
      static_assert(kRows == 2 && (kCols == 16 || kCols == 8), "a 16-bit word or a byte per row");
      if (tiles.has_element_mask && !(tiles.mask_summary(h, m0 / kBlockM, n0) & kMaskAllVisible)) {
        const FlashBwdParams& p = tiles.p;
        const uint16_t* words = reinterpret_cast<const uint16_t*>(tiles.s.mask);
        const int64_t plane = tiles.mask_layout.plane(tiles.b, h);
        const int first_bit = 2 * (get<1>(cS_rc(0, 0)) / 8);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int64_t key = n0 + get<0>(cS_rc(mi, 0));
          const uint32_t word = words[tiles.mask_layout.word_index_t(plane, key < p.seqlen_k ? key : 0,
                                                                     m0 / kBlockM, mma_tidx % 4)];
          mask_bits |= ((word >> first_bit) & ((1u << kCols) - 1u)) << (mi * kCols);
        }
        return true;
      }
    } else if constexpr (kSegments) {
      static_assert(kRows * kCols <= 32, "a bit per entry in mask_bits");
      if (tiles.segment_state(m0 / kBlockM) == BwdTileState::kElementMasked) {
        const FlashBwdParams& p = tiles.p;
        const int32_t* q_ids = p.q_segment_ids + int64_t(tiles.b) * p.seqlen_q;
        const int32_t* kv_ids = p.kv_segment_ids + int64_t(tiles.b) * p.seqlen_k;
        bool key_in[kRows];
        int32_t key_id[kRows];
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int key = n0 + get<0>(cS_rc(mi, 0));
          key_in[mi] = key < p.seqlen_k;
          key_id[mi] = key_in[mi] ? kv_ids[key] : 0;
        }
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          const int row = m0 + get<1>(cS_rc(0, ni));
          const bool row_in = row < p.seqlen_q;
          const int32_t id = row_in ? q_ids[row] : 0;
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi)
            mask_bits |= uint32_t(row_in && key_in[mi] && id == key_id[mi]) << (mi * kCols + ni);
        }
        return true;
      }
    }
    return false;
  }

  // Query rows [q_len, seqlen_q) of a stage's Q and dO tiles, once they have arrived.
  template <class Scheduler>
  __device__ static __forceinline__ void zero_unseen_query_rows(const Scheduler& tiles, SharedStorage& shared,
                                                                int stage, int m0, int mma_tidx) {
    using namespace cute;
    const FlashBwdParams& p = tiles.p;
    const int64_t q_lo = tiles.q_len - m0, q_hi = p.seqlen_q - m0 < kBlockM ? p.seqlen_q - m0 : kBlockM;
    if (q_lo < q_hi) {  // uniform: both consumers see the same tile
      Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(shared.d_o.begin()), typename Traits::SmemLayoutQ{});
      zero_tile_rows<kHeadDim>(sQ(_, _, stage), int(q_lo), int(q_hi), mma_tidx, kMmaThreads);
      zero_tile_rows<kHeadDim>(sdO(_, _, stage), int(q_lo), int(q_hi), mma_tidx, kMmaThreads);
      cutlass::arch::fence_view_async_shared();
      named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
    }
  }

  // Segment ids, a border tile (element_masked), once both consumers' S^T and dP^T GEMMs are done (the softmax step
  // waited for them): the Q and dO rows that no key of the tile sees are zeroed before dV's and dK's GEMMs read
  // them, since another document's rows may hold anything and 0 x NaN would reach dK = dS^T Q and dV = P^T dO (the
  // forward zeroes the value rows no row of a tile sees the same way). hidden: this thread's hidden entries
  // (apply). Each warp ORs its query columns with a visible entry into the shared words, a barrier, the rows are
  // zeroed, another barrier (after which the words are cleared, before the tile's dS barrier orders that before
  // their next use). Only border tiles pay the two barriers. (Before the S^T GEMM, recomputing hidden, the d128
  // kernel spills as much and runs 14% more instructions.)
  template <class Scheduler, class TileBits, class CoordRC>
  __device__ static __forceinline__ void zero_unseen_queries(const Scheduler& tiles, SharedStorage& shared, int stage,
                                                             CoordRC const& cS_rc, TileBits hidden,
                                                             bool element_masked, int mma_tidx) {
    if constexpr (kSegments) {
      using namespace cute;
      constexpr int kRows = decltype(size<0>(cS_rc))::value, kCols = decltype(size<1>(cS_rc))::value;
      if (!element_masked) return;  // the same for the whole CTA (the table)
      const int col0 = get<1>(cS_rc(0, 0));
      uint64_t seen = 0;  // relative to col0 (a constant shift per column)
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        uint32_t any = 0;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) any |= ~uint32_t(hidden >> (mi * kCols + ni)) & 1u;
        seen |= uint64_t(any) << (get<1>(cS_rc(0, ni)) - col0);
      }
      seen <<= col0;
      uint32_t lo = uint32_t(seen), hi = uint32_t(seen >> 32);
      CUTE_UNROLL
      for (int offset = 16; offset > 0; offset /= 2) {
        lo |= __shfl_xor_sync(0xffffffffu, lo, offset);
        hi |= __shfl_xor_sync(0xffffffffu, hi, offset);
      }
      uint32_t* words = seen_query_words(shared);
      if (mma_tidx % 32 == 0) {
        if (lo != 0u) atomicOr(&words[0], lo);
        if (hi != 0u) atomicOr(&words[1], hi);
      }
      named_sync(kMmaThreads, BwdSm90Barrier::kQueriesSeen);
      const uint64_t unseen = ~(uint64_t(words[0]) | uint64_t(words[1]) << 32);
      if (unseen != 0) {
        // 16-byte stores: the 128-byte swizzle moves 16-byte chunks whole.
        Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(shared.d_o.begin()), typename Traits::SmemLayoutQ{});
        constexpr int kChunks = kHeadDim / 8;
        for (int i = mma_tidx; i < kBlockM * kChunks; i += kMmaThreads) {
          const int r = i / kChunks, c = i % kChunks * 8;
          if ((unseen >> r) & 1u) {
            *reinterpret_cast<uint4*>(&sQ(r, c, stage)) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(&sdO(r, c, stage)) = make_uint4(0u, 0u, 0u, 0u);
          }
        }
        cutlass::arch::fence_view_async_shared();
      }
      named_sync(kMmaThreads, BwdSm90Barrier::kQueriesSeen);
      if (mma_tidx < kBlockM / 32) words[mma_tidx] = 0;
    }
  }

  // The entries of the tile at (m0, n0) that this thread must hide (bit mi * kCols + ni, 1: hidden): those outside
  // mask.h's visible span (tiles across a boundary only), and those the element mask hides (load_element_mask's answers).
  template <class TileBits, class Scheduler, class CoordRC>
  __device__ static __forceinline__ TileBits apply(const Scheduler& tiles, int m0, int n0, CoordRC const& cS_rc,
                                                   bool element_masked, uint32_t mask_bits) {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(cS_rc))::value, kCols = decltype(size<1>(cS_rc))::value;
    const FlashBwdParams& p = tiles.p;
    const bool need_mask =
        !tile_fully_visible(p, m0, m0 + kBlockM, n0, int64_t(n0) + kBlockN, tiles.q_len, tiles.kv_len);
    TileBits hidden = 0;
    if (need_mask) {
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        const TileSpan span =
            visible_span_in_tile(p, m0 + get<1>(cS_rc(0, ni)), tiles.q_len, tiles.kv_len, n0, kBlockN);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int key = get<0>(cS_rc(mi, 0));
          if (key < span.lo || key >= span.hi) hidden |= TileBits(1) << (mi * kCols + ni);
        }
      }
    }
    if (element_masked) hidden |= TileBits(~mask_bits);
    return hidden;
  }
};

}  // namespace cuda
}  // namespace tf_flash
