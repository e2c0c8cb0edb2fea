// FlashAttention-2 style forward kernel (tf_flash's own, written on CuTe): one CTA per (query tile,
// head, batch) keeps its Q tile in shared memory and streams the visible K/V tiles through it with
// cp.async, K of the next tile loading while P V of this one runs and V loading while Q K^T runs;
// ldmatrix feeds mma.sync (SM80 atoms, also run on sm_90); the online softmax lives in registers with
// fp32 accumulation. Tiles entirely hidden by causal / window / lengths (and by block_mask in the
// general variant) are never loaded; masks are evaluated per element only on tiles that straddle a
// boundary or carry an element mask (staged through shared memory once per tile).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/numeric_types.h"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace cuda {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, class Element_>
struct FwdTraits : TileConfig<kHeadDim_, kBlockM_, kBlockN_, kNWarps_, Element_> {
  using Base = TileConfig<kHeadDim_, kBlockM_, kBlockN_, kNWarps_, Element_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
  static_assert(kBlockM == 16 * kNWarps || kBlockM == 32 * kNWarps || kBlockM == 64 * kNWarps,
                "each warp owns 16, 32 or 64 query rows");
  static_assert(kBlockN % 16 == 0, "key tile must be a multiple of 16");

  // Warps stacked along M; the N tile of 16 lets one ldmatrix.x4 feed two n8 atoms.
  using TiledMma =
      cute::TiledMMA<typename Base::MmaAtom, cute::Layout<cute::Shape<cute::Int<kNWarps>, cute::_1, cute::_1>>,
                     cute::Tile<cute::Int<16 * kNWarps>, cute::_16, cute::_16>>;

  using SmemLayoutAtom = typename Base::SmemLayoutAtom;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as (head dim, key) for the B operand of P V, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;  // the output tile reuses Q's shared memory
  using SmemCopyAtomO = cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>;
  static_assert(kBlockM % (Base::kNThreads / Base::kGmemThreadsPerRow) == 0 &&
                kBlockN % (Base::kNThreads / Base::kGmemThreadsPerRow) == 0, "whole tiles per copy");

  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kHeadDim * int(sizeof(Element));
  // The general variant stages each tile's attn_mask (one byte per entry) after Q, K and V.
  static constexpr int kMaskSmemBytes = kBlockM * kBlockN;
};

// Tile choices per head dim (H100/A100: 4 warps keep ~230 registers/thread for 2 CTAs per SM; head dim
// 256 needs 8 warps to hold its 128 x 256 output accumulator). MaskedTraits: the general variant's under a
// block mask whose blocks do not hold whole Traits tiles (run_flash_fwd): 64 rows, spill-free.
template <int kHeadDim, class Element> struct FwdConfig;
template <class E> struct FwdConfig<32, E> {
  using Traits = FwdTraits<32, 128, 128, 4, E>;
  using MaskedTraits = FwdTraits<32, 64, 128, 4, E>;
};
template <class E> struct FwdConfig<64, E> {
  using Traits = FwdTraits<64, 128, 128, 4, E>;
  using MaskedTraits = FwdTraits<64, 64, 128, 4, E>;
};
template <class E> struct FwdConfig<96, E> {
  using Traits = FwdTraits<96, 128, 64, 4, E>;
  using MaskedTraits = FwdTraits<96, 64, 64, 4, E>;
};
template <class E> struct FwdConfig<128, E> {
  using Traits = FwdTraits<128, 128, 64, 4, E>;
  using MaskedTraits = FwdTraits<128, 64, 64, 4, E>;
};
template <class E> struct FwdConfig<256, E> {
  using Traits = FwdTraits<256, 128, 64, 8, E>;
  using MaskedTraits = Traits;
};

// ---- The steps of flash_fwd_kernel, each inlined into it (the kernel is register-bound) ----

// Stages the element masks (attn_mask, and block_mask when it covers the tile only in part) of the score
// tile at (m0, n0) into mask_tile, one byte per entry, cooperatively: coalesced loads, 4 bytes at a time
// where the layout allows, block indices divided once per 4 columns. Returns the key columns of this
// thread's word column (tidx % (kBlockN / 4)) that some of its rows sees (also structurally), four per word.
// key_mask: attn_mask is a key mask (one row for every query, e.g. padding [B, 1, 1, Sk]) and no block
// covers the tile in part: only row 0 is staged (mask_scores reads it for every row), trimmed to the union
// [keys_begin, keys_end) of the rows' visible keys.
template <class Traits>
__device__ __forceinline__ uint32_t stage_element_masks(const FlashFwdParams& p, int b, int h, int64_t m0,
                                                        int64_t n0, int64_t q_len, int64_t kv_len, bool has_attn,
                                                        bool partial_blocks, bool partial_segments, bool key_mask,
                                                        int64_t keys_begin,
                                                        int64_t keys_end, uint8_t* mask_tile, int tidx) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  const BroadcastBoolMask& am = p.attn_mask;
  const bool* mask_bh = has_attn ? am.data + b * am.batch_stride + h * am.head_stride : nullptr;
  constexpr int kWordsPerRow = kBlockN / 4;
  static_assert(Traits::kNThreads % kWordsPerRow == 0, "each thread stages one word column");
  uint32_t seen = 0;  // this thread's word column, OR over its rows
  const int staged_rows = key_mask ? 1 : kBlockM;
  for (int idx = tidx; idx < staged_rows * kWordsPerRow; idx += Traits::kNThreads) {
    const int r = idx / kWordsPerRow, c = (idx % kWordsPerRow) * 4;
    const int64_t row = m0 + r, col = n0 + c;
    uint32_t word = 0;
    if (row < q_len) {
      if (has_attn) {
        const bool* src = mask_bh + row * am.row_stride + col * am.col_stride;
        if (am.col_stride == 1 && col + 4 <= kv_len && (reinterpret_cast<uintptr_t>(src) & 3) == 0) {
          word = *reinterpret_cast<const uint32_t*>(src) & 0x01010101u;
        } else {
          for (int t = 0; t < 4; ++t)
            if (col + t < kv_len && src[t * am.col_stride]) word |= 1u << (8 * t);
        }
      } else {
        for (int t = 0; t < 4; ++t)
          if (col + t < kv_len) word |= 1u << (8 * t);
      }
      if (partial_blocks && word != 0) {
        const int64_t qb = row / p.block_q;
        int64_t kb = col / p.block_k;
        int64_t kb_end = (kb + 1) * p.block_k;  // first column of the next block
        bool vis = mask_at(p.block_mask, b, h, qb, kb);
        // Rolled: unrolled, its 64-bit divisions cost the general variant ~100 bytes of spills (d128).
#pragma unroll 1
        for (int t = 0; t < 4 && col + t < kv_len; ++t) {  // bytes past kv_len are 0 already
          if (col + t >= kb_end) {
            kb = (col + t) / p.block_k;
            kb_end = (kb + 1) * p.block_k;
            vis = mask_at(p.block_mask, b, h, qb, kb);
          }
          if (!vis) word &= ~(0xFFu << (8 * t));
        }
      }
      if (partial_segments && word != 0) {
        const int32_t row_id = p.q_segment_ids[int64_t(b) * p.seqlen_q + row];
        const int32_t* key_ids = p.kv_segment_ids + int64_t(b) * p.seqlen_k + col;
        for (int t = 0; t < 4 && col + t < kv_len; ++t)
          if (key_ids[t] != row_id) word &= ~(0xFFu << (8 * t));
      }
    }
    if (word != 0) {  // what the row (a key mask: some row) sees structurally, for col_seen
      const KeyRange range = key_mask ? KeyRange{keys_begin, keys_end} : key_range(p, row, q_len, kv_len);
      for (int t = 0; t < 4; ++t)
        if (col + t < range.begin || col + t >= range.end) word &= ~(0xFFu << (8 * t));
    }
    seen |= word;
    *reinterpret_cast<uint32_t*>(mask_tile + r * kBlockN + c) = word;
  }
  return seen;
}

// Zeroes the rows [lo, hi) of the V tile that no row of the query tile sees (col_seen bytes 0): P is 0
// there, and 0 x NaN (garbage in masked-out values) must not reach the output. Uniform over the CTA.
template <class Traits, class SmemV>
__device__ __forceinline__ void zero_unseen_value_rows(SmemV& sV, const uint32_t* seen_words, int lo, int hi,
                                                       int tidx) {
  using Element = typename Traits::Element;
  bool any_unseen = false;
  for (int c = lo; c < hi; ++c) any_unseen |= ((seen_words[c / 4] >> (8 * (c % 4))) & 1u) == 0;
  if (!any_unseen) return;  // uniform: every thread read the same words
  for (int c = lo; c < hi; ++c) {
    if (((seen_words[c / 4] >> (8 * (c % 4))) & 1u) == 0) {
      for (int d = tidx; d < Traits::kHeadDim; d += Traits::kNThreads) sV(c, d) = Element(0);
    }
  }
  __syncthreads();
}

// Sets the invisible scores of the tile at (m0, n0) to -inf: each row's structural span (mask.h), then,
// when `staged`, the element masks staged in mask_tile (rows mask_row_stride apart: 0 for a key mask).
template <bool kElementMasks, int kBlockN, class Scores, class CoordRC>
__device__ __forceinline__ void mask_scores(Scores& s, CoordRC const& coord_rc, const FlashFwdParams& p, int64_t m0,
                                            int64_t n0, int64_t q_len, int64_t kv_len, bool staged,
                                            const uint8_t* mask_tile, int mask_row_stride = kBlockN) {
  using namespace cute;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row_in_tile = get<0>(coord_rc(mi, 0));
    // Column bounds relative to this tile, so that the per-element test is 32-bit.
    const TileSpan span = visible_span_in_tile(p, m0 + row_in_tile, q_len, kv_len, n0, kBlockN);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      const int col = get<1>(coord_rc(0, ni));
      bool visible = col >= span.lo && col < span.hi;
      if constexpr (kElementMasks) {
        if (visible && staged) visible = mask_tile[row_in_tile * mask_row_stride + col] != 0;
      }
      if (!visible) s(mi, ni) = -INFINITY;
    }
  }
}

// The sm_80 forward exponentiates s * scale_log2 - max * scale_log2, one FMA per score, while
// |max * scale_log2| stays below this (the rounding of max * scale_log2 is then <= 2^-15). That rounding grows
// with the logits, to hundreds at |logits| ~ 1e9, and 2^hundreds overflows P (issue #16): a warp with a
// larger row max first subtracts the max from its scores, exactly as (s - max) * scale_log2. The vote costs the
// head-dim-64 forward 2-4% against the FMA alone (H100, either family). The Hopper forward's plain and attn_mask
// variants vote likewise (exponentiate<true>); its general variants always subtract (fwd_kernel_sm90.h says why).
constexpr float kFmaExponentLimit = 1024.f;

// The running max and sum of this thread's score rows, base 2 (softmax_scale_log2).
template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows], row_sum[kRows];

  __device__ __forceinline__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
  }

  // max(running max, this thread's scores of row mi), as two interleaved chains (more independent
  // instructions for a latency-bound kernel).
  template <class Scores>
  __device__ __forceinline__ float thread_row_max(Scores const& s, int mi) const {
    constexpr int kCols = decltype(cute::size<1>(s))::value;
    float a = row_max[mi], c = s(mi, 0);
    CUTE_UNROLL
    for (int ni = 1; ni < kCols; ni += 2) {
      a = fmaxf(a, s(mi, ni));
      if (ni + 1 < kCols) c = fmaxf(c, s(mi, ni + 1));
    }
    return fmaxf(a, c);
  }

  // Row max -> the exponents' reference (0 for a row that saw only -inf: its scores then give 0).
  static __device__ __forceinline__ float reference(float mx) { return mx != -INFINITY ? mx : 0.f; }

  // Whether any row of this warp has |ref * scale_log2| >= kFmaExponentLimit. A warp vote, taken as soon
  // as the row maxima are known so that its latency overlaps other work.
  static __device__ __forceinline__ bool any_large(const float (&ref)[kRows], float scale_log2) {
    bool large = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) large |= fabsf(ref[mi] * scale_log2) >= kFmaExponentLimit;
    return __any_sync(0xffffffffu, large);
  }

  // s -> 2^((s - ref) scale_log2) and the running sums (rescaled by correction); `shift`: subtract ref
  // from the scores first (kFmaExponentLimit). The sums as two interleaved partial chains per row.
  // Every ex2 on MUFU: FlashAttention-4's emulation of a share of them by a cubic on the FMA pipe makes the d64
  // Hopper forward slower in proportion (1/8 of them: 0.95-0.98, 1/4: 0.93-0.95, 1/2: 0.86), its MUFU not being the
  // limit. The sums stay FADDs: summing P on the tensor cores instead (P times a tile of ones beside the P V GEMM)
  // halves the d64 forward's FADDs yet runs 0.94-1.07 there (bf16 0.94-1.00), 0.90-0.98 at d128 non-causal, and
  // sums the rounded 16-bit P. kOffsetLog2: P times 2^kOffsetLog2, and so the sums (the fp8 forward's, whose
  // e4m3 P would lose small probabilities below its subnormals).
  template <int kOffsetLog2 = 0, class Scores>
  __device__ __forceinline__ void exponentiate_rows(Scores& s, const float (&ref)[kRows],
                                                    const float (&correction)[kRows], float scale_log2,
                                                    bool shift) {
    constexpr int kCols = decltype(cute::size<1>(s))::value;
    float ref_scaled[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) ref_scaled[mi] = ref[mi] * scale_log2;
    if (__builtin_expect(shift, 0)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) s(mi, ni) -= ref[mi];
        ref_scaled[mi] = 0.f;
      }
    }
    if constexpr (kOffsetLog2 != 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) ref_scaled[mi] -= float(kOffsetLog2);
    }
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float sum0 = 0.f, sum1 = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ni += 2) {
        s(mi, ni) = fast_exp2(s(mi, ni) * scale_log2 - ref_scaled[mi]);
        s(mi, ni + 1) = fast_exp2(s(mi, ni + 1) * scale_log2 - ref_scaled[mi]);
        sum0 += s(mi, ni);
        sum1 += s(mi, ni + 1);
      }
      row_sum[mi] = row_sum[mi] * correction[mi] + (sum0 + sum1);
    }
  }

  // Scores s (rows x columns) -> unnormalized probabilities: new running max, the running sum rescaled,
  // exponentiate. acc_o is rescaled only when some row's max moved in this warp (after the first tiles it
  // rarely does). kMask: rows may be entirely -inf. All rows' max first: more independent instructions for
  // a latency-bound kernel.
  template <bool kMask, class Scores, class AccO>
  __device__ __forceinline__ void update(Scores& s, AccO& acc_o_rc, float scale_log2, bool first) {
    using namespace cute;
    float correction[kRows], ref[kRows], mx[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) mx[mi] = thread_row_max(s, mi);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      mx[mi] = quad_max(mx[mi]);
      ref[mi] = kMask ? reference(mx[mi]) : mx[mi];
    }
    const bool shift = any_large(ref, scale_log2);
    bool rescale = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      // (old - new max) * scale_log2 <= 0 in any magnitude: the factor never passes 1.
      correction[mi] = first ? 1.f : fast_exp2((row_max[mi] - ref[mi]) * scale_log2);
      rescale |= correction[mi] != 1.f;
      row_max[mi] = mx[mi];
    }
    exponentiate_rows(s, ref, correction, scale_log2, shift);
    if (__builtin_expect(__any_sync(0xffffffffu, rescale), 0)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) *= correction[mi];
      }
    }
  }

  // update() in two steps, for a kernel whose O accumulator is still being written by an asynchronous GEMM
  // when the scores arrive (the Hopper forward): the new running max and each row's correction factor for
  // O (applied by the caller once its GEMM is done), then the exponentials and the running sum. kVote: one FMA
  // per score unless some row of the warp passes kFmaExponentLimit (update()'s vote); else always as
  // (s - max) * scale_log2. Rows may be entirely -inf.
  // Lazily: a row keeps its reference max until a tile raises it by more than kLazyRescaleLog2 powers of two
  // (FlashAttention-4's conditional rescaling), so P stays <= 2^kLazyRescaleLog2 and O and the row sum need no
  // rescaling until then; after a row's first tiles that is rare. The exponents, the sums and the lse all use
  // the reference, so the result is the same softmax. O's rescale costs one FMUL per element of O per key tile
  // (per score 0.5 / 1 / 4 at d64 / d128 / d256): rescaling only when needed makes the Hopper forward 4-9% faster
  // at d256 through TF and 0-4% at d128. Returns whether O must be rescaled: a warp vote (uniform, for a branch).
  // kLazyLog2: that threshold (0: rescale whenever a row's max rises, the fp8 forward's, whose P must stay within
  // e4m3's range after its offset).
  static constexpr float kLazyRescaleLog2 = 8.f;
  template <int kLazyLog2 = int(kLazyRescaleLog2), class Scores>
  __device__ __forceinline__ bool rescale_max(Scores const& s, float (&correction)[kRows], float scale_log2,
                                              bool first) {
    bool moved = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const float mx = quad_max(thread_row_max(s, mi));
      // Kept also where both are -inf (the difference is NaN).
      const bool keep = !first && !((mx - row_max[mi]) * scale_log2 > float(kLazyLog2));
      correction[mi] = first || keep ? 1.f : fast_exp2((row_max[mi] - reference(mx)) * scale_log2);
      if (!keep) row_max[mi] = mx;
      moved |= !keep && !first;
    }
    return __any_sync(0xffffffffu, moved);
  }
  template <bool kVote, int kOffsetLog2 = 0, class Scores>
  __device__ __forceinline__ void exponentiate(Scores& s, const float (&correction)[kRows], float scale_log2) {
    float ref[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) ref[mi] = reference(row_max[mi]);
    exponentiate_rows<kOffsetLog2>(s, ref, correction, scale_log2,
                                   /*shift=*/kVote ? any_large(ref, scale_log2) : true);
  }
};

// Dropout on the 16-bit probabilities rP of the tile at (m0, n0), two per register, after the normalizer
// was taken, as in dropout(softmax(s)) @ v. One Philox call holds this thread's draws for one m16 row
// block and four adjacent n8 column groups (philox.h): MMA_N atoms 4c .. 4c + 3, since the warp's columns
// are contiguous and n0 is a multiple of 32.
template <int kBlockN, class FragP, class CoordRC>
__device__ __forceinline__ void apply_dropout(FragP& rP, CoordRC const& coord_rc, const FlashFwdParams& p,
                                              uint64_t batch_head, int64_t m0, int64_t n0, uint32_t drop_threshold) {
  using namespace cute;
  constexpr int kM = decltype(size<1>(rP))::value, kN = decltype(size<2>(rP))::value;
  static_assert(kN % 4 == 0 && kBlockN % 32 == 0, "a dropout draw spans four n8 column groups");
  Tensor pairs = recast<uint32_t>(rP);  // 1-D index half + 2 * (m + kM * n)
  static_assert(decltype(size(pairs))::value * 2 == decltype(size(rP))::value, "16-bit pairs");
  const uint32_t threshold2 = drop_threshold * 0x10001u;
  for_each_dropout_draw<kM, kN / 4>(dropout_seed(p), batch_head, m0, n0, coord_rc,
                                    [&](int m, int c, const Philox4& draws) {
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half)
        pairs(half + 2 * (m + kM * (4 * c + w))) &= dropout_keep_mask_x2(draws.x[w], half, threshold2);
    }
  });
}

// Epilogue, part 1: acc_o / row sum (times the dropout keep scale) and lse per valid row; rows past q_len
// or that saw nothing get 0 and lse -inf.
template <int kRows, class AccO, class CoordRC>
__device__ __forceinline__ void normalize_and_write_lse(AccO& acc_o_rc, const OnlineSoftmax<kRows>& softmax,
                                                        CoordRC const& coord_rc, const FlashFwdParams& p, int64_t m0,
                                                        int64_t q_len, uint64_t batch_head, float scale_log2,
                                                        float keep_scale) {
  using namespace cute;
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const float sum = quad_sum(softmax.row_sum[mi]);
    const int64_t row = m0 + get<0>(coord_rc(mi, 0));
    const bool valid = row < q_len && sum > 0.f;
    const float inv = valid ? keep_scale / sum : 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc_o_rc); ++ni) acc_o_rc(mi, ni) = valid ? acc_o_rc(mi, ni) * inv : 0.f;
    if (p.lse != nullptr && get<1>(coord_rc(0, 0)) == 0 && row < p.seqlen_q) {
      // lse = (max * scale_log2 + log2(sum)) * ln(2), rounded once: the backward rebuilds the exponents'
      // reference max * scale_log2 + log2(sum) from it with one more rounding (bwd_preprocess_kernel).
      const double lse2 = double(softmax.row_max[mi]) * double(scale_log2) + double(log2f(sum));
      p.lse[int64_t(batch_head) * p.seqlen_q + row] = valid ? float(lse2 * 0.6931471805599453) : -INFINITY;
    }
  }
}

// Epilogue, part 2: O in the output dtype through shared memory (sO, Q's buffer, once no warp reads Q) to
// 16-byte global stores of the rows < seqlen_q and columns < head_dim_v.
template <class Traits, class AccO, class SmemO, class GmemO>
__device__ __forceinline__ void store_output(AccO const& acc_o, SmemO& sO, GmemO& gO,
                                             typename Traits::TiledMma const& tiled_mma, const FlashFwdParams& p,
                                             int64_t m0, int tidx) {
  using namespace cute;
  using Element = typename Traits::Element;
  Tensor rO = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_o = smem_copy_o.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_o.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_o.partition_D(sO);
  cp_async_wait<0>();
  __syncthreads();  // no warp still reads Q
  copy(smem_copy_o, taccOrO, taccOsO);
  __syncthreads();

  typename Traits::GmemTiledCopyStore gmem_copy_o;
  auto gmem_thr_copy_o = gmem_copy_o.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_o.partition_S(sO);
  Tensor tOgO = gmem_thr_copy_o.partition_D(gO);
  Tensor tOcO = gmem_thr_copy_o.partition_D(make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}));
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_copy_o, tOsO, tOrO);
  copy_predicated(gmem_copy_o, tOrO, tOgO, tOcO, p.seqlen_q - m0, p.head_dim_v);
}

// Variants: the plain one handles causal, window, lengths, GQA and any sequence lengths. kMasks adds
// block_mask (tiles whose blocks are all False are skipped, tiles entirely True run unmasked, mixed
// tiles are masked per element) and attn_mask (read per element); kDropout adds dropout. Dropout
// alone has its own variant: the mask code costs registers (and ~9% at d128) that it does not need.
template <class Traits, bool kMasks, bool kDropout>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_fwd_kernel(const FlashFwdParams p) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem[];

  // Heaviest query tiles (the last ones under a causal mask) are scheduled first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z % p.batch;
  const int split = blockIdx.z / p.batch;  // split-KV's run (gridDim.z = batch x num_splits)
  const int tidx = threadIdx.x;

  const int64_t q_len = valid_q_len(p, b);
  const int64_t kv_len = valid_kv_len(p, b);
  const int64_t m0 = int64_t(m_block) * kBlockM;
  const int64_t m_valid_end = m0 + kBlockM < q_len ? m0 + kBlockM : q_len;

  // Key tiles any valid row of this query tile can see.
  const QueryTileKeys tile_keys = query_tile_keys(p, m0, kBlockM, kBlockN, q_len, kv_len);
  const KeyRange first_row = tile_keys.first_row, last_row = tile_keys.last_row;
  const TileRange document_tiles = segment_key_tiles(p, b, m0, m_valid_end, kBlockN);
  int n_block_min = max(tile_keys.tile_begin, document_tiles.begin);
  int n_block_max = min(tile_keys.tile_end, document_tiles.end);
  narrow_to_split(p.num_splits, split, n_block_min, n_block_max);
  const int64_t out_entry = split_entry(p, split, b);  // b, or this run's output with split-KV

  const int h_kv = h / (p.num_heads / p.num_heads_kv);
  const Element* q_ptr = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const Element* k_ptr = static_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v_ptr = static_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  Element* o_ptr = static_cast<Element*>(p.out) + out_entry * p.o_batch_stride + h * p.o_head_stride;

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(int64_t(p.seqlen_q), Int<kHeadDim>{}),
                          make_stride(p.q_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, TileQ{}, make_coord(m_block, 0));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(int64_t(p.seqlen_k), Int<kHeadDim>{}),
                          make_stride(p.k_row_stride, _1{}));
  Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));  // (BN, D, n)
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(int64_t(p.seqlen_k), Int<kHeadDim>{}),
                          make_stride(p.v_row_stride, _1{}));
  Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(int64_t(p.seqlen_q), Int<kHeadDim>{}),
                          make_stride(p.o_row_stride, _1{}));
  Tensor gO = local_tile(mO, TileQ{}, make_coord(m_block, 0));

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

  typename Traits::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr_copy = gmem_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(TileKV{}));

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, TileQ{});

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  // (row, column) inside the score tile of each accumulator element, viewed as rows x columns.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;

  // Block-mask and segment-id state of the key tiles: computed once per CTA, in parallel, into a shared table of
  // flags (bit 0: some block visible, bit 1: all visible), so that skipping runs of hidden tiles costs
  // no global reads; tiles past the table's end are looked up directly.
  constexpr int kTileTable = kMasks ? 1024 : 1;
  __shared__ uint8_t tile_flags[kTileTable];
  auto coverage_global = [&](int n_block) -> BlockCoverage {
    const int64_t n0 = int64_t(n_block) * kBlockN;
    const int64_t n_end = n0 + kBlockN < kv_len ? n0 + kBlockN : kv_len;
    return block_coverage(p, b, h, m0, m_valid_end, n0, n_end);
  };
  // Block masks and segment ids skip tiles (the other variants get neither).
  const bool has_tile_masks = kMasks && (p.block_mask.data != nullptr || has_segments(p));
  if (has_tile_masks) {
    for (int n = n_block_min + tidx; n < n_block_max && n < kTileTable; n += Traits::kNThreads) {
      const BlockCoverage c = coverage_global(n);
      tile_flags[n] = uint8_t((c.any ? 1 : 0) | (c.all ? 2 : 0));
    }
    __syncthreads();
  }
  auto coverage = [&](int n_block) -> BlockCoverage {
    if (!has_tile_masks) return BlockCoverage{true, true};
    if (n_block < kTileTable) {
      const int f = tile_flags[n_block];
      return BlockCoverage{(f & 1) != 0, (f & 2) != 0};
    }
    return coverage_global(n_block);
  };
  auto next_visible = [&](int n_block) -> int {  // the next tile to process below n_block
    int n = n_block - 1;
    if (has_tile_masks)
      while (n >= n_block_min && !coverage(n).any) --n;
    return n;
  };

  // Only the keys some valid row of this tile can see, [first_row.begin, last_row.end) (the union of the
  // rows' ranges, contiguous), and the valid query rows are loaded; the rest is zero-filled, so that NaN or
  // Inf in padding (beyond the lengths, outside the window or the causal triangle) never reaches P V.
  // Positions relative to a tile's first row (int: sequence lengths are int).
  const int64_t keys_end = last_row.end < kv_len ? last_row.end : kv_len;
  auto load_k = [&](int n) {
    copy_tile_async(gmem_copy, tKgK(_, _, _, n), tKsK, tKVcKV, int(keys_end - int64_t(n) * kBlockN), p.head_dim,
                    int(first_row.begin - int64_t(n) * kBlockN));
  };
  auto load_v = [&](int n) {
    copy_tile_async(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, int(keys_end - int64_t(n) * kBlockN),
                    p.head_dim_v, int(first_row.begin - int64_t(n) * kBlockN));
  };
  copy_tile_async(gmem_copy, tQgQ, tQsQ, tQcQ, int(q_len - m0), p.head_dim);
  int n_block = next_visible(n_block_max);
  if (n_block >= n_block_min) load_k(n_block);
  cp_async_fence();

  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  OnlineSoftmax<kRows> softmax;
  // Scores are scaled in the exponent: p = 2^(s * scale * log2(e) - max * scale * log2(e)).
  const float scale_log2 = softmax_scale_log2(p);
  // Soft-capping (general variant only): s -> softcap * tanh(s * scale / softcap), then unscaled.
  const bool has_softcap = kMasks && p.softcap > 0.f;
  const float softcap_in = has_softcap ? softcap_input_scale(p) : 0.f;
  const uint32_t drop_threshold = kDropout ? dropout_threshold(p.dropout_rate) : 0u;
  const bool has_dropout = kDropout && p.dropout_rate > 0.f;
  const uint64_t batch_head = uint64_t(b) * p.num_heads + h;

  // One K/V tile. kMask: evaluate the masks per element (tiles that straddle a boundary of some valid
  // row's key range; in the general variant also every tile under an attn_mask or a partly visible
  // block_mask); instantiated twice so that the hot unmasked path carries none of that code.
  // Key columns of a staged tile that some row sees, four per word (bytes 0/1), double-buffered by staged
  // tile parity: a buffer is cleared one staged tile before it is filled again, with barriers between.
  constexpr int kSeenWords = kMasks ? kBlockN / 4 : 1;
  __shared__ uint32_t col_seen[2][kSeenWords];
  int seen_parity = 0;
  if constexpr (kMasks) {
    for (int i = tidx; i < 2 * kSeenWords; i += Traits::kNThreads) col_seen[i / kSeenWords][i % kSeenWords] = 0;
  }

  bool first = true;
  auto step = [&](auto mask_tag, const BlockCoverage cover) __attribute__((always_inline)) {
    constexpr bool kMask = decltype(mask_tag)::value;
    const int64_t n0 = int64_t(n_block) * kBlockN;
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K tile landed; every warp is done reading V of the previous tile
    load_v(n_block);
    cp_async_fence();

    gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, smem_thr_copy_q,
                   smem_thr_copy_k);

    const int n_next = next_visible(n_block);
    if constexpr (kMasks) {
      if (has_softcap) {  // the same operations as the backward's (bwd_kernel.h)
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) = p.softcap * tanhf(acc_s(i) * softcap_in);
      }
    }
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));

    // Element masks are evaluated once per tile entry into a byte tile in shared memory that the barrier
    // below publishes to every warp.
    uint8_t* const mask_tile = reinterpret_cast<uint8_t*>(smem) + Traits::kSmemBytes;
    bool staged = false, key_mask = false;
    if constexpr (kMasks && kMask) {
      const bool has_attn = p.attn_mask.data != nullptr;
      const bool partial = !cover.all;
      staged = has_attn || partial;
      // A key mask stages one row instead of kBlockM (with kBlockM rows a padding mask costs ~10x the plain kernel).
      key_mask = has_attn && p.attn_mask.row_stride == 0 && !partial;
      if (staged) {
        const uint32_t seen = stage_element_masks<Traits>(
            p, b, h, m0, n0, q_len, kv_len, has_attn, partial && p.block_mask.data != nullptr,
            partial && has_segments(p), key_mask, first_row.begin, keys_end, mask_tile, tidx);
        if (seen != 0) atomicOr(&col_seen[seen_parity][tidx % (kBlockN / 4)], seen);
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V tile landed; every warp is done reading this K tile; the mask tile is stored
    if (n_next >= n_block_min) load_k(n_next);
    cp_async_fence();

    if constexpr (kMasks && kMask) {
      if (staged) {
        const int lo = int(first_row.begin - n0 > 0 ? first_row.begin - n0 : 0);
        const int hi = int(keys_end - n0 < kBlockN ? keys_end - n0 : kBlockN);
        zero_unseen_value_rows<Traits>(sV, col_seen[seen_parity], lo, hi, tidx);
        for (int i = tidx; i < kSeenWords; i += Traits::kNThreads) col_seen[seen_parity ^ 1][i] = 0;
        seen_parity ^= 1;
      }
    }
    if constexpr (kMask)
      mask_scores<kMasks, kBlockN>(s, tScS_rc, p, m0, n0, q_len, kv_len, staged, mask_tile, key_mask ? 0 : kBlockN);

    softmax.template update<kMask>(s, acc_o_rc, scale_log2, first);
    first = false;

    Tensor rP = convert_fragment<Element>(acc_s);
    if constexpr (kDropout) {
      if (has_dropout) apply_dropout<kBlockN>(rP, tScS_rc, p, batch_head, m0, n0, drop_threshold);
    }
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
    gemm_reg_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, smem_thr_copy_v);

    n_block = n_next;
  };

  {
    // Tiles n with lo_unmasked <= n < hi_unmasked are visible to every valid row in full, unless a
    // block_mask or attn_mask hides some of their entries.
    const int hi_unmasked = int(first_row.end / kBlockN);
    const int lo_unmasked = int((last_row.begin + kBlockN - 1) / kBlockN);
    if constexpr (kMasks) {
      const bool elem_masks = p.attn_mask.data != nullptr;
      while (n_block >= n_block_min) {
        const BlockCoverage cover = coverage(n_block);
        if (n_block < hi_unmasked && n_block >= lo_unmasked && cover.all && !elem_masks) step(std::false_type{}, cover);
        else step(std::true_type{}, cover);
      }
    } else {
      while (n_block >= n_block_min) {
        if (n_block < hi_unmasked && n_block >= lo_unmasked) step(std::false_type{}, BlockCoverage{true, true});
        else step(std::true_type{}, BlockCoverage{true, true});
      }
    }
  }

  // Epilogue: normalize, write lse, stage O through shared memory for 16-byte global stores.
  const float keep_scale = has_dropout ? dropout_keep_scale(p.dropout_rate) : 1.f;
  normalize_and_write_lse(acc_o_rc, softmax, tScS_rc, p, m0, q_len, uint64_t(out_entry) * p.num_heads + h,
                          scale_log2, keep_scale);
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  store_output<Traits>(acc_o, sO, gO, tiled_mma, p, m0, tidx);
}

}  // namespace cuda
}  // namespace tf_flash
