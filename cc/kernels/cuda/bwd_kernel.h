// FlashAttention-2 backward for sm_80 and later (mma.sync m16n8k16, ldmatrix, cp.async), written with CuTe.
//
// Three kernels on the caller's stream, all workspace in params.scratch (see bwd_launch.h):
//   1. bwd_preprocess: D_i = rowsum(dO_i * O_i) - d_lse_i, lse pre-multiplied by log2(e) (-inf, and every
//      row >= q_len, become +inf so that P = exp2(s - lse2) is exactly 0 there), dQ accumulator zeroed.
//   2. bwd_dkdv: one CTA per (key tile, kv head, batch). K_j, V_j stay in shared memory; the CTA walks the
//      query tiles of every query head of its GQA group (the group loop is inside the CTA, so dK/dV of a kv
//      head are summed in registers, no extra scratch) and per tile recomputes S = Q K^T, P = exp(S - lse),
//      dP = dO V^T, dS = P (dP - D), then dV += P^T dO, dQ_i += dS K with fp32 atomics (8-byte reds on
//      sm_90), dK += dS^T Q. Q/dO/lse/D of the next tile are fetched with cp.async while the current one is
//      computed (with a single buffer, d256: while dQ is).
//   3. bwd_convert_dq: dQ accumulator * scale -> output dtype.
// Where family.h chooses the Hopper family, kernel 2 is its own (bwd_kernel_sm90.h).
// Masks follow cc/kernels/flash/mask.h: tiles wholly outside the causal/window/length range are never
// visited, element masks are applied only on tiles that straddle a boundary (or when attn_mask / an
// unaligned block_mask is given); block_mask tiles whose blocks are all False are never loaded. Dropout
// regenerates the forward's Philox mask (philox.h). Head dims: max(head_dim, head_dim_v) rounds up
// to the compiled kHeadDim; the padded columns are zero-filled on load and never stored.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/family.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"

namespace tf_flash {
namespace cuda {

using namespace cute;

// Tile shapes and layouts of the dK/dV kernel, derived from (head dim, tiles, warps, dtype).
//   kAtomMSdP: warps along M for S = Q K^T and dP = dO V^T ([kBlockM, kBlockN]).
//   kAtomNdKV: warps along N for dK, dV ([kBlockN, kHeadDim]).
//   kAtomMdQ:  warps along M for dQ ([kBlockM, kHeadDim]).
//   kStages:   Q/dO/lse/D buffers. 2: the next query tile is fetched during the whole iteration; 1 (d256,
//              to fit 163 KB): only once the dK GEMM is done, during the dQ GEMM and its atomics.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomMSdP, int kAtomNdKV, int kAtomMdQ,
          typename Element_, int kStages_ = 2>
struct BwdTraits : TileConfig<kHeadDim_, kBlockM_, kBlockN_, kNWarps_, Element_> {
  using Base = TileConfig<kHeadDim_, kBlockM_, kBlockN_, kNWarps_, Element_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static_assert(kStages == 1 || kStages == 2, "one or two Q/dO buffers");
  static_assert(kBlockM <= kScratchRowPad && kScratchRowPad % kBlockM == 0, "scratch padding");
  static_assert(kBlockN == bwd_key_tile(kHeadDim), "bwd_dq_splits counts tiles of bwd_key_tile keys");

  using Atom = typename Base::MmaAtom;
  // The N permutation of 16 per warp lets one ldmatrix.x4 feed two n8 MMAs.
  template <int WarpsM>
  using Mma = TiledMMA<Atom, Layout<Shape<Int<WarpsM>, Int<kNWarps / WarpsM>, _1>>,
                       Tile<Int<16 * WarpsM>, Int<16 * kNWarps / WarpsM>, _16>>;
  // S and dP: each warp owns runs of 32 adjacent columns (four n8 atoms), the unit of one dropout draw
  // (philox.h): logical column c + 8 w + 8 W r (atom column c, warp w of W, repeat r) -> c + 32 w + 8 r.
  static constexpr int kWarpsNSdP = kNWarps / kAtomMSdP;
  using TiledMmaSdP =
      TiledMMA<Atom, Layout<Shape<Int<kAtomMSdP>, Int<kWarpsNSdP>, _1>>,
               Tile<Int<16 * kAtomMSdP>, Layout<Shape<_8, Int<kWarpsNSdP>, _4>, Stride<_1, _32, _8>>, _16>>;
  using TiledMmadKV = Mma<kAtomNdKV>;
  using TiledMmadQ = Mma<kAtomMdQ>;
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (32 * kWarpsNSdP) == 0, "SdP tiling");
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * kNWarps / kAtomNdKV) == 0, "dKV tiling");
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * kNWarps / kAtomMdQ) == 0, "dQ tiling");

  using SmemLayoutAtom = typename Base::SmemLayoutAtom;
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Transposed views (same memory): Qt(d, m) = Q(m, d), Kt(d, n) = K(n, d).
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  static constexpr int kPBlockN = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(Swizzle<kPBlockN == 32 ? 2 : 3, 3, 3>{},
                                                 Layout<Shape<_8, Int<kPBlockN>>, Stride<Int<kPBlockN>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt =
      decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Shared memory (elements): Q, dO x kStages, K, V, P, dS; then floats: lse2, D x kStages.
  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static constexpr int kPElems = kBlockM * kBlockN;
  static constexpr int kSmemBytes = int(sizeof(Element)) * (2 * kStages * kQElems + 2 * kKVElems + 2 * kPElems) +
                                    2 * kStages * kBlockM * int(sizeof(float));
};

// ---- Kernel 1: D = rowsum(dO * O) - d_lse, lse2, zero dQ accumulator. 8 threads per (b, h, row). ----
template <typename Element>
__global__ void __launch_bounds__(128) bwd_preprocess_kernel(const FlashBwdParams p, BwdScratch s) {
  const int row = blockIdx.x * 16 + threadIdx.x / 8;
  const int lane8 = threadIdx.x % 8;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = int64_t(b) * p.num_heads + h;
  const int64_t q_len = valid_q_len(p, b);
  float acc = 0.f;
  if (row < q_len) {
    const Element* o = static_cast<const Element*>(p.out) + b * p.o_batch_stride + row * p.o_row_stride +
                       h * p.o_head_stride;
    const Element* d_o = static_cast<const Element*>(p.d_out) + b * p.o_batch_stride + row * p.o_row_stride +
                         h * p.o_head_stride;
    for (int c = lane8 * 8; c < p.head_dim_v; c += 64) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  acc += __shfl_xor_sync(0xffffffffu, acc, 4);
  if (row >= s.sq_pad) return;
  const int64_t r = bh * s.sq_pad + row;
  if (lane8 == 0) {
    float lse2 = INFINITY, dval = 0.f;
    if (row < q_len) {
      const float lse = p.lse[bh * p.seqlen_q + row];
      // One rounding from the forward's (max * scale_log2 + log2(sum)) * ln(2) back to base 2 (fwd_kernel.h).
      lse2 = lse == -INFINITY ? INFINITY : float(double(lse) * 1.4426950408889634);
      dval = acc - (p.d_lse ? p.d_lse[bh * p.seqlen_q + row] : 0.f);
    }
    s.lse2[r] = lse2;
    s.dvec[r] = dval;
  }
  for (int split = 0; split < s.dq_splits; ++split) {
    float4* dq = reinterpret_cast<float4*>(s.dq_accum + split * s.dq_split_stride + r * s.dq_cols);
    for (int c = lane8; c < s.dq_cols / 4; c += 8) dq[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// ---- Kernel 3: dQ = scale * (sum of the split accumulators, in split order), in the output dtype. 8
// elements per thread. ----
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(128) bwd_convert_dq_kernel(const FlashBwdParams p, BwdScratch s) {
  constexpr int kThreadsPerRow = kHeadDim / 8;
  constexpr int kRowsPerBlock = 128 / kThreadsPerRow;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int c = (threadIdx.x % kThreadsPerRow) * 8;
  const int h = blockIdx.y, b = blockIdx.z;
  if (row >= p.seqlen_q || c >= p.head_dim) return;
  const float* src = s.dq_accum + ((int64_t(b) * p.num_heads + h) * s.sq_pad + row) * kHeadDim + c;
  float4 a = reinterpret_cast<const float4*>(src)[0];
  float4 z = reinterpret_cast<const float4*>(src)[1];
  for (int split = 1; split < s.dq_splits; ++split) {  // a fixed order: deterministic
    const float4* part = reinterpret_cast<const float4*>(src + split * s.dq_split_stride);
    const float4 pa = part[0], pz = part[1];
    a = make_float4(a.x + pa.x, a.y + pa.y, a.z + pa.z, a.w + pa.w);
    z = make_float4(z.x + pz.x, z.y + pz.y, z.z + pz.z, z.w + pz.w);
  }
  const float sc = p.scale;
  uint4 out;
  out.x = pack_float2<Element>(a.x * sc, a.y * sc);
  out.y = pack_float2<Element>(a.z * sc, a.w * sc);
  out.z = pack_float2<Element>(z.x * sc, z.y * sc);
  out.w = pack_float2<Element>(z.z * sc, z.w * sc);
  Element* dst = static_cast<Element*>(p.d_q) + b * p.q_batch_stride + row * p.q_row_stride + h * p.q_head_stride + c;
  *reinterpret_cast<uint4*>(dst) = out;
}

// ---- The steps of bwd_dkdv_tile, each inlined into it (the kernel is register-bound) ----

// The forward's dropout keep bits of this thread's entries of the tile at (m0, n0), one bit per entry of
// the S accumulator (bit mi * cols + ni). One Philox call holds the draws of one m16 row block and four
// adjacent n8 column groups (philox.h), which TiledMmaSdP gives each warp as MMA_N atoms 4c .. 4c + 3.
template <int kWords, class ScoresRC, class CoordRC>
__device__ __forceinline__ void dropout_keep_bits(uint32_t (&keep_mask)[kWords], ScoresRC const& S,
                                                  CoordRC const& coord_rc, const FlashFwdParams& p, uint64_t bh,
                                                  int m0, int n0, uint32_t threshold2) {
  using namespace cute;
  constexpr int kM = decltype(size<0>(S))::value / 2, kCols = decltype(size<1>(S))::value;
  static_assert(kCols % 8 == 0, "a dropout draw spans four n8 column groups");
  CUTE_UNROLL
  for (int i = 0; i < kWords; ++i) keep_mask[i] = 0;
  for_each_dropout_draw<kM, kCols / 8>(dropout_seed(p), bh, m0, n0, coord_rc, [&](int m, int c, const Philox4& draws) {
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      const uint32_t bits = dropout_keep_bits4(draws.x[w], threshold2);  // (r, j = 0, 1), (r + 8, j = 0, 1)
      const int idx0 = 2 * m * kCols + 2 * (4 * c + w), idx1 = idx0 + kCols;
      keep_mask[idx0 / 32] |= (bits & 3u) << (idx0 % 32);
      keep_mask[idx1 / 32] |= (bits >> 2) << (idx1 % 32);
    }
  });
}

template <int kWords>
__device__ __forceinline__ bool kept(const uint32_t (&keep_mask)[kWords], int idx) {
  return (keep_mask[idx / 32] >> (idx % 32)) & 1u;
}

// The key mask (an attn_mask with one row for every query, e.g. padding [B, 1, 1, Sk]) at this thread's
// columns of the tile at n0, bit ni for column ni: read once per tile instead of once per entry.
template <class CoordRC>
__device__ __forceinline__ uint64_t key_mask_columns(CoordRC const& coord_rc, const FlashFwdParams& p, int b, int h,
                                                     int n0) {
  using namespace cute;
  static_assert(decltype(size<1>(coord_rc))::value <= 64, "one bit per column of this thread");
  uint64_t bits = 0;
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(coord_rc); ++ni) {
    const int col = n0 + get<1>(coord_rc(0, ni));
    if (col < p.seqlen_k && mask_at(p.attn_mask, b, h, 0, col)) bits |= uint64_t(1) << ni;
  }
  return bits;
}

// Scores S (rows x columns) of the tile at (m0, n0) -> the forward's probabilities P = exp2(S scale_log2 -
// lse2), 0 where masked (need_mask: the tile is not fully visible structurally, or element masks apply;
// key_mask: the element masks are the key mask whose columns key_columns holds);
// with dropout also Pd = P Z / keep_prob for dV.
template <bool kMasks, bool kDropout, int kBlockN, int kWords, class ScoresRC, class CoordRC>
__device__ __forceinline__ void probabilities(ScoresRC& S, ScoresRC& Pd, CoordRC const& coord_rc,
                                              const float* lse2, const FlashFwdParams& p, int b, int h, int m0,
                                              int n0, int64_t q_len, int64_t kv_len, bool need_mask,
                                              bool element_masks, bool key_mask, uint64_t key_columns,
                                              float scale_log2, const uint32_t (&keep_mask)[kWords],
                                              float keep_scale) {
  using namespace cute;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(S); ++mi) {
    const int r = get<0>(coord_rc(mi, 0));
    const int row = m0 + r;
    const float l2 = lse2[r];
    // This row's visible columns of the tile (mask.h, 64-bit), then a 32-bit test per element.
    const TileSpan span =
        need_mask ? visible_span_in_tile(p, row, q_len, kv_len, n0, kBlockN) : TileSpan{0, kBlockN};
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(S); ++ni) {
      const int c = get<1>(coord_rc(0, ni));
      // The forward's exponent (fwd_kernel.h); never above 0, so a rounding of lse cannot make P > 1
      // (at |logits| where the float32 lse carries no fraction, P of the row max is then exactly 1).
      float pv = fast_exp2(fminf(S(mi, ni) * scale_log2 - l2, 0.f));
      if (need_mask) {
        bool vis = c >= span.lo && c < span.hi;
        if constexpr (kMasks) {
          if (vis && element_masks)
            vis = key_mask ? ((key_columns >> ni) & 1) != 0 : element_visible(p, b, h, row, n0 + c);
        }
        if (!vis) pv = 0.f;
      }
      S(mi, ni) = pv;
      if constexpr (kDropout) Pd(mi, ni) = kept(keep_mask, mi * size<1>(S) + ni) ? pv * keep_scale : 0.f;
    }
  }
}

// dP (rows x columns) -> dS = P (dP - D), through the tanh when soft-capped; with dropout dP is masked and
// scaled as P was. Exactly 0 where P is: a value row this query cannot see may have made dP NaN there.
template <bool kDropout, bool kSoftcap, int kWords, class ScoresRC, class CoordRC>
__device__ __forceinline__ void scores_gradient(ScoresRC& dP, ScoresRC const& P, ScoresRC const& dTanh,
                                                CoordRC const& coord_rc, const float* dvec,
                                                const uint32_t (&keep_mask)[kWords], float keep_scale) {
  using namespace cute;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(dP); ++mi) {
    const float dv = dvec[get<0>(coord_rc(mi, 0))];
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dP); ++ni) {
      float dpv = dP(mi, ni);
      if constexpr (kDropout) dpv = kept(keep_mask, mi * size<1>(dP) + ni) ? dpv * keep_scale : 0.f;
      float ds = P(mi, ni) == 0.f ? 0.f : P(mi, ni) * (dpv - dv);
      if constexpr (kSoftcap) ds *= dTanh(mi, ni);
      dP(mi, ni) = ds;
    }
  }
}

// Epilogue: dK * scale and dV in the output dtype through shared memory (the K/V buffers) to 16-byte
// global stores of the rows < seqlen_k and columns < head_dim (dK) / head_dim_v (dV).
template <class Traits, class AccDkv, class SmemKV>
__device__ __forceinline__ void store_dk_dv(AccDkv& acc_dk, AccDkv const& acc_dv, SmemKV& sK, SmemKV& sV,
                                            typename Traits::TiledMmadKV const& mma_dkv, const FlashBwdParams& p,
                                            int b, int h_kv, int n0, int tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  cp_async_wait<0>();
  __syncthreads();
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  auto copy_dkv = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dkv);
  auto thr_cdkv = copy_dkv.get_thread_slice(tid);
  copy(copy_dkv, thr_cdkv.retile_S(rdK), thr_cdkv.partition_D(sK));
  copy(copy_dkv, thr_cdkv.retile_S(rdV), thr_cdkv.partition_D(sV));
  __syncthreads();

  Element* dk_ptr = static_cast<Element*>(p.d_k) + b * p.k_batch_stride + h_kv * p.k_head_stride +
                    int64_t(n0) * p.k_row_stride;
  Element* dv_ptr = static_cast<Element*>(p.d_v) + b * p.v_batch_stride + h_kv * p.v_head_stride +
                    int64_t(n0) * p.v_row_stride;
  Tensor gdK = make_tensor(make_gmem_ptr(dk_ptr), TileKV{}, make_stride(p.k_row_stride, _1{}));
  Tensor gdV = make_tensor(make_gmem_ptr(dv_ptr), TileKV{}, make_stride(p.v_row_stride, _1{}));
  typename Traits::GmemTiledCopyStore gmem_store;
  auto store_thr = gmem_store.get_thread_slice(tid);
  store_tile(gmem_store, store_thr, sK, gdK, p.seqlen_k - n0, p.head_dim);
  store_tile(gmem_store, store_thr, sV, gdV, p.seqlen_k - n0, p.head_dim_v);
}

// ---- Kernel 2: dK, dV of one key tile; dQ by atomics. ----
// kMasks: element-wise attn_mask / block_mask code compiled in; kDropout: Philox dropout. The plain variant
// has neither (that code alone costs the d128 kernel ~1 KB of register spills) but still skips the tiles of
// a block_mask whose blocks are multiples of the tiles (each tile then lies in one block).
// kSoftcap (general variant only): scores soft-capped as in the forward, dS through the tanh.
// One key tile n_block of (kv head blockIdx.y, batch blockIdx.z); dQ goes to the accumulator dq_accum.
template <typename Traits, bool kMasks, bool kDropout, bool kSoftcap>
__device__ __forceinline__ void bwd_dkdv_tile(const FlashBwdParams& p, const BwdScratch& s, const int n_block,
                                              float* const dq_accum) {
  static_assert(kMasks || !kSoftcap, "soft-capping lives in the general variant");
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem_raw[];
  Element* smem_q = reinterpret_cast<Element*>(smem_raw);          // kStages stages
  Element* smem_do = smem_q + Traits::kStages * Traits::kQElems;   // kStages stages
  Element* smem_k = smem_do + Traits::kStages * Traits::kQElems;
  Element* smem_v = smem_k + Traits::kKVElems;
  Element* smem_p = smem_v + Traits::kKVElems;
  Element* smem_ds = smem_p + Traits::kPElems;
  float* smem_lse = reinterpret_cast<float*>(smem_ds + Traits::kPElems);  // kStages stages
  float* smem_d = smem_lse + Traits::kStages * kBlockM;                   // kStages stages

  const int tid = threadIdx.x;
  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBlockN;
  const int group = p.num_heads / p.num_heads_kv;
  const int q_len = int(valid_q_len(p, b));
  const int kv_len = int(valid_kv_len(p, b));

  // Query tiles that can see this key tile (mask.h).
  const IndexRange query_rows = query_range_of_keys(p, n0, int64_t(n0) + kBlockN, q_len, kv_len);
  const TileRange document_tiles = segment_query_tiles(p, b, n0, min(n0 + kBlockN, kv_len), kBlockM);
  const int m_begin = max(int(query_rows.begin / kBlockM), document_tiles.begin);
  const int m_end = min(int((query_rows.end + kBlockM - 1) / kBlockM), document_tiles.end);
  const int n_m = max(0, m_end - m_begin);
  const int n_iter = n_m * group;

  // Block-sparse: a tile is visited when any block it overlaps is True; a tile overlapping several blocks
  // also gets the element-wise block check.
  const bool has_block_mask = p.block_mask.data != nullptr;
  const bool tile_in_one_kblock = !has_block_mask || (n0 / p.block_k == (n0 + kBlockN - 1) / p.block_k);
  // Segment ids skip tiles as block masks do, and mask per entry the tiles that hold a document border.
  const bool has_segment_ids = kMasks && has_segments(p);
  auto tile_visible = [&](int it) -> bool {
    if (!has_block_mask && !has_segment_ids) return true;
    const int h = h_kv * group + it / n_m;
    const int m0 = (m_begin + it % n_m) * kBlockM;
    return block_coverage(p, b, h, m0, min(m0 + kBlockM, q_len), n0, min(n0 + kBlockN, kv_len)).any;
  };
  auto next_visible = [&](int it) -> int {
    while (it < n_iter && !tile_visible(it)) ++it;
    return it;
  };

  // ---- global tiles ----
  const Element* k_ptr = static_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride +
                         int64_t(n0) * p.k_row_stride;
  const Element* v_ptr = static_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride +
                         int64_t(n0) * p.v_row_stride;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  Tensor gK = make_tensor(make_gmem_ptr(k_ptr), TileKV{}, make_stride(p.k_row_stride, _1{}));
  Tensor gV = make_tensor(make_gmem_ptr(v_ptr), TileKV{}, make_stride(p.v_row_stride, _1{}));

  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPdSt{});
  auto sQ_at = [&](int st) {
    return make_tensor(make_smem_ptr(smem_q + st * Traits::kQElems), typename Traits::SmemLayoutQ{});
  };
  auto sdO_at = [&](int st) {
    return make_tensor(make_smem_ptr(smem_do + st * Traits::kQElems), typename Traits::SmemLayoutQ{});
  };
  auto sQt_at = [&](int st) {
    return make_tensor(make_smem_ptr(smem_q + st * Traits::kQElems), typename Traits::SmemLayoutQt{});
  };
  auto sdOt_at = [&](int st) {
    return make_tensor(make_smem_ptr(smem_do + st * Traits::kQElems), typename Traits::SmemLayoutQt{});
  };

  typename Traits::GmemTiledCopyLoad gmem_load;
  auto gmem_thr = gmem_load.get_thread_slice(tid);

  // Issue the loads of iteration `it` (query head h, tile m0) into stage st.
  auto load_q_do = [&](int it, int st) {
    const int h = h_kv * group + it / n_m;
    const int m0 = (m_begin + it % n_m) * kBlockM;
    const Element* q_ptr = static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
                           int64_t(m0) * p.q_row_stride;
    const Element* do_ptr = static_cast<const Element*>(p.d_out) + b * p.o_batch_stride + h * p.o_head_stride +
                            int64_t(m0) * p.o_row_stride;
    Tensor gQ = make_tensor(make_gmem_ptr(q_ptr), TileQ{}, make_stride(p.q_row_stride, _1{}));
    Tensor gdO = make_tensor(make_gmem_ptr(do_ptr), TileQ{}, make_stride(p.o_row_stride, _1{}));
    Tensor sQ = sQ_at(st);
    Tensor sdO = sdO_at(st);
    partition_and_copy_tile_async(gmem_load, gmem_thr, gQ, sQ, q_len - m0, p.head_dim);
    partition_and_copy_tile_async(gmem_load, gmem_thr, gdO, sdO, q_len - m0, p.head_dim_v);
    const int64_t r = (int64_t(b) * p.num_heads + h) * s.sq_pad + m0;
    if (tid < kBlockM) {
      SM80_CP_ASYNC_CACHEALWAYS<float>::copy(s.lse2[r + tid], smem_lse[st * kBlockM + tid]);
    } else if (tid < 2 * kBlockM) {
      SM80_CP_ASYNC_CACHEALWAYS<float>::copy(s.dvec[r + tid - kBlockM], smem_d[st * kBlockM + tid - kBlockM]);
    }
  };

  // ---- MMA partitions ----
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  auto copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_a_sdp = copy_a_sdp.get_thread_slice(tid);
  auto thr_b_sdp = copy_b_sdp.get_thread_slice(tid);
  auto thr_a_dkv = copy_a_dkv.get_thread_slice(tid);
  auto thr_b_dkv = copy_b_dkv.get_thread_slice(tid);
  auto thr_a_dq = copy_a_dq.get_thread_slice(tid);
  auto thr_b_dq = copy_b_dq.get_thread_slice(tid);

  Tensor sQ0 = sQ_at(0);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ0);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sQ0);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tSsK = thr_b_sdp.partition_S(sK);
  Tensor tdPsV = thr_b_sdp.partition_S(sV);

  Tensor sPtFlat = make_tensor(make_smem_ptr(smem_p), get_nonswizzle_portion(typename Traits::SmemLayoutPdSt{}));
  Tensor sQtFlat = make_tensor(make_smem_ptr(smem_q), get_nonswizzle_portion(typename Traits::SmemLayoutQt{}));
  Tensor sKtFlat = make_tensor(make_smem_ptr(smem_k), get_nonswizzle_portion(typename Traits::SmemLayoutKt{}));
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtFlat);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sQtFlat);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sPtFlat);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtFlat);
  Tensor tdVsPt = thr_a_dkv.partition_S(sPt);
  Tensor tdKsdSt = thr_a_dkv.partition_S(sdSt);

  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtFlat);
  Tensor tdQsdS = thr_a_dq.partition_S(sdS);
  Tensor tdQsKt = thr_b_dq.partition_S(sKt);

  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(tid);
  Tensor tPsP = thr_pds.partition_D(sP);
  Tensor tPsdS = thr_pds.partition_D(sdS);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // (row, col) inside the tile of each S accumulator.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  const float scale_log2 = softmax_scale_log2(p);  // the forward's factor (mask.h)
  const float softcap_in = kSoftcap ? softcap_input_scale(p) : 0.f;
  const bool has_attn_mask = kMasks && p.attn_mask.data != nullptr;
  // A key mask (one row for every query) is read per tile, not per entry (a padding mask cost ~4x the plain
  // kernel's time); with a block mask the per-entry check stays.
  const bool key_mask = has_attn_mask && p.attn_mask.row_stride == 0 && p.block_mask.data == nullptr;
  const uint32_t threshold2 = kDropout ? dropout_threshold(p.dropout_rate) * 0x10001u : 0u;
  const float keep_scale = kDropout ? dropout_keep_scale(p.dropout_rate) : 1.f;

  // ---- prologue ----
  // Keys that no valid query sees (beyond kv_len, or beyond q_len - 1 + right) load as zeros: NaN padding
  // there would reach dQ = dS K and dP = dO V^T as 0 x NaN.
  const int64_t keys_end = key_range_of_rows(p, 0, q_len, q_len, kv_len).end;
  const int keys_in_tile = int(keys_end - n0 < kBlockN ? keys_end - n0 : kBlockN);
  int it = next_visible(0);
  if (it < n_iter) {
    partition_and_copy_tile_async(gmem_load, gmem_thr, gK, sK, keys_in_tile, p.head_dim);
    partition_and_copy_tile_async(gmem_load, gmem_thr, gV, sV, keys_in_tile, p.head_dim_v);
    load_q_do(it, 0);
  }
  cp_async_fence();

  // General variant: keys hidden from every query by attn_mask / block_mask are zeroed in shared memory
  // too, once the tile has landed, but only when the K or V tile holds a non-finite value (a rare case
  // that pays one extra sweep over the masks of this key tile's queries).
  __shared__ uint32_t key_seen[kBlockN / 32];
  bool first_iteration = true;

  int stage = 0;
  for (; it < n_iter;) {
    const int h = h_kv * group + it / n_m;
    const int m0 = (m_begin + it % n_m) * kBlockM;
    const int it_next = next_visible(it + 1);
    cp_async_wait<0>();
    __syncthreads();
    if (Traits::kStages == 2 && it_next < n_iter) load_q_do(it_next, stage ^ 1);
    cp_async_fence();
    if constexpr (kMasks) {
      if (first_iteration) {
        hide_unseen_keys<Traits::kNThreads, kBlockN, kHeadDim>(
            sK, sV, key_seen, p, b, h_kv * group, group, n0, keys_end, q_len, kv_len, tid,
            [](bool pred) { return __syncthreads_or(pred) != 0; }, [] { __syncthreads(); });
      }
    }
    first_iteration = false;

    Tensor sQ = sQ_at(stage);
    Tensor sdO = sdO_at(stage);
    Tensor sQt = sQt_at(stage);
    Tensor sdOt = sdOt_at(stage);
    const float* lse2 = smem_lse + stage * kBlockM;
    const float* dvec = smem_d + stage * kBlockM;

    // S = Q K^T; P = exp(scale S - lse) (0 where masked) goes to shared memory before dP = dO V^T is
    // computed, so the stores overlap that GEMM. With dropout dV uses P Z / keep_prob, and dP is masked and
    // scaled the same way (the keep bits are kept in registers between the two loops).
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem_smem(mma_sdp, acc_s, tSrQ, tSrK, thr_a_sdp.partition_S(sQ), tSsK, copy_a_sdp, copy_b_sdp, thr_a_sdp,
                   thr_b_sdp);
    // Soft-capping: the forward's operations (fwd_kernel.h); d(capped)/d(raw) = scale (1 - tanh^2), the
    // scale applied with dK's and dQ's.
    Tensor acc_dtanh = make_tensor_like(acc_s);
    if constexpr (kSoftcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const float t = tanhf(acc_s(i) * softcap_in);
        acc_s(i) = p.softcap * t;
        acc_dtanh(i) = 1.f - t * t;
      }
    }
    Tensor S = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dTanh = make_tensor(acc_dtanh.data(), acc_rowcol(acc_dtanh.layout()));
    const bool need_mask = has_attn_mask ||
                           (kMasks && has_block_mask &&
                            !(tile_in_one_kblock && m0 / p.block_q == (m0 + kBlockM - 1) / p.block_q)) ||
                           (has_segment_ids && !block_coverage(p, b, h, m0, min(m0 + kBlockM, q_len), n0,
                                                              min(n0 + kBlockN, kv_len)).all) ||
                           !tile_fully_visible(p, m0, m0 + kBlockM, n0, int64_t(n0) + kBlockN, q_len, kv_len);
    constexpr int kFrag = decltype(size(acc_s))::value;
    uint32_t keep_mask[(kFrag + 31) / 32];  // bit mi * cols + ni: entry kept by dropout
    if constexpr (kDropout) {
      dropout_keep_bits(keep_mask, S, tScS_rc, p, uint64_t(b) * p.num_heads + h, m0, n0, threshold2);
    }
    Tensor acc_pd = make_tensor_like(acc_s);  // P Z / keep_prob for dV (dropout only)
    Tensor Pd = make_tensor(acc_pd.data(), acc_rowcol(acc_pd.layout()));
    const uint64_t key_columns = key_mask ? key_mask_columns(tScS_rc, p, b, h, n0) : 0;
    probabilities<kMasks, kDropout, kBlockN>(S, Pd, tScS_rc, lse2, p, b, h, m0, n0, q_len, kv_len, need_mask,
                                             has_attn_mask || has_block_mask || has_segment_ids, key_mask,
                                             key_columns, scale_log2,
                                             keep_mask, keep_scale);
    Tensor rP = [&] {
      if constexpr (kDropout) return convert_fragment<Element>(acc_pd);
      else return convert_fragment<Element>(acc_s);
    }();
    copy(copy_pds, thr_pds.retile_S(rP), tPsP);

    // dP = dO V^T, dS = P (dP - D)
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem_smem(mma_sdp, acc_dp, tdPrdO, tdPrV, thr_a_sdp.partition_S(sdO), tdPsV, copy_a_sdp, copy_b_sdp,
                   thr_a_sdp, thr_b_sdp);
    Tensor dP = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    scores_gradient<kDropout, kSoftcap>(dP, S, dTanh, tScS_rc, dvec, keep_mask, keep_scale);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(rdS), tPsdS);
    __syncthreads();

    // dV += P^T dO
    gemm_smem_smem(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, thr_b_dkv.partition_S(sdOt), copy_a_dkv, copy_b_dkv,
                   thr_a_dkv, thr_b_dkv);

    if constexpr (Traits::kStages == 1) {
      // One buffer: dK goes first, so that the next tile's loads overlap the dQ GEMM and its atomics (which
      // read only dS and K).
      gemm_smem_smem(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, thr_b_dkv.partition_S(sQt), copy_a_dkv, copy_b_dkv,
                     thr_a_dkv, thr_b_dkv);
      __syncthreads();
      if (it_next < n_iter) load_q_do(it_next, 0);
      cp_async_fence();
    }

    // dQ += dS K (unscaled; kernel 3 applies the softmax scale)
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_dq);
    gemm_smem_smem(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_a_dq, copy_b_dq, thr_a_dq, thr_b_dq);
    float* dq_ptr = dq_accum + ((int64_t(b) * p.num_heads + h) * s.sq_pad + m0) * kHeadDim;
    Tensor gdQ = make_tensor(make_gmem_ptr(dq_ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                             Stride<Int<kHeadDim>, _1>{});
    Tensor tdQgdQ = thr_dq.partition_C(gdQ);
    atomic_add_dq(acc_dq, tdQgdQ);

    if constexpr (Traits::kStages == 2) {
      // dK += dS^T Q after the atomics were issued, so that they drain under these MMAs.
      gemm_smem_smem(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, thr_b_dkv.partition_S(sQt), copy_a_dkv, copy_b_dkv,
                     thr_a_dkv, thr_b_dkv);
    }

    stage = Traits::kStages == 2 ? stage ^ 1 : 0;
    it = it_next;
  }

  // ---- epilogue: dK * scale, dV through shared memory (K/V buffers) to global, rows < seqlen_k ----
  store_dk_dv<Traits>(acc_dk, acc_dv, sK, sV, mma_dkv, p, b, h_kv, n0, tid);
}

// Key tiles blockIdx.x, blockIdx.x + gridDim.x, ... of (kv head, batch). Default: one tile per CTA, dQ by
// atomics into one accumulator (their order varies from run to run). Deterministic: gridDim.x = dq_splits
// CTAs, each with its own accumulator that only its threads add to, each dQ element always by the same
// thread, in program order; kernel 3 sums the splits in a fixed order.
template <typename Traits, bool kMasks, bool kDropout, bool kSoftcap = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_dkdv_kernel(const FlashBwdParams p, BwdScratch s) {
  const int num_tiles = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  float* const dq_accum = s.dq_accum + (s.deterministic ? blockIdx.x * s.dq_split_stride : 0);
  for (int n_block = blockIdx.x; n_block < num_tiles; n_block += gridDim.x) {
    bwd_dkdv_tile<Traits, kMasks, kDropout, kSoftcap>(p, s, n_block, dq_accum);
    __syncthreads();  // the next tile's loads overwrite the shared memory this one's epilogue read
  }
}

// Head-dim specific tile choice (H100/A100; <= 163 KB shared memory so one config serves sm_80 and sm_90).
template <typename Element, int kHeadDim>
struct BwdConfig;
template <typename Element>
struct BwdConfig<Element, 32> {
  using Traits = BwdTraits<32, 128, 128, 8, 4, 4, 4, Element>;
};
template <typename Element>
struct BwdConfig<Element, 64> {  // 128 x 128 tiles: 201 vs 176 TFLOP/s for 64 x 128 (H100, bf16, b4 s4k)
  using Traits = BwdTraits<64, 128, 128, 8, 4, 4, 4, Element>;
};
template <typename Element>
struct BwdConfig<Element, 96> {
  using Traits = BwdTraits<96, 64, 128, 8, 2, 4, 4, Element>;
};
template <typename Element>
struct BwdConfig<Element, 128> {
  using Traits = BwdTraits<128, 64, 128, 8, 2, 4, 2, Element>;
};
// 64 x 64 tiles with one Q/dO buffer (145 KB; two would need 209 KB). kBlockN 64 keeps the dK, dV
// accumulators at 128 registers per thread; a 32-row query tile cannot give 8 warps whole 16 x 32 S blocks
// (the dropout draw unit, TiledMmaSdP).
template <typename Element>
struct BwdConfig<Element, 256> {
  using Traits = BwdTraits<256, 64, 64, 8, 4, 2, 2, Element, 1>;
};

template <typename Element, int kHeadDim>
cudaError_t run_flash_bwd(const FlashBwdParams& p, KernelFamily dkdv_family, cudaStream_t stream) {
  using Traits = typename BwdConfig<Element, kHeadDim>::Traits;
  static_assert(Traits::kSmemBytes <= 163 * 1024, "sm_80 allows at most 163 KB of shared memory per block");
  const BwdScratch s = bwd_scratch_layout(p);
  if (p.seqlen_q > 0) {
    dim3 grid(unsigned((s.sq_pad + 15) / 16), unsigned(p.num_heads), unsigned(p.batch));
    bwd_preprocess_kernel<Element><<<grid, 128, 0, stream>>>(p, s);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  auto launch_convert_dq = [&]() -> cudaError_t {
    if (p.seqlen_q == 0) return cudaSuccess;
    constexpr int kRowsPerBlock = 128 / (kHeadDim / 8);
    dim3 grid(unsigned((p.seqlen_q + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(p.num_heads), unsigned(p.batch));
    bwd_convert_dq_kernel<Element, kHeadDim><<<grid, 128, 0, stream>>>(p, s);
    return cudaGetLastError();
  };
  if (p.seqlen_k > 0) {  // with seqlen_q == 0 it visits no tile and writes dK = dV = 0
    constexpr int smem = Traits::kSmemBytes;
    const int num_tiles = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    dim3 grid(unsigned(bwd_dkdv_ctas(s, num_tiles)), unsigned(p.num_heads_kv), unsigned(p.batch));
    auto launch = [&](auto kernel) -> cudaError_t {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      kernel<<<grid, Traits::kNThreads, smem, stream>>>(p, s);
      return cudaGetLastError();
    };
    const bool masks = p.attn_mask.data != nullptr || has_segments(p) ||
                       (p.block_mask.data != nullptr &&
                        (p.block_q % Traits::kBlockM != 0 || p.block_k % Traits::kBlockN != 0));
    const bool dropout = p.dropout_rate > 0.f;
    const bool softcap = p.softcap > 0.f;
    if constexpr (TF_FLASH_HEADDIM_SM90(kHeadDim)) {
      if (dkdv_family == KernelFamily::kSm90) {
        const cudaError_t e = run_bwd_dkdv_sm90<Element, kHeadDim>(p, s, stream);
        if (e != cudaSuccess) return e;
        backward_sm90_launches.fetch_add(1, std::memory_order_relaxed);
        return launch_convert_dq();
      }
    }
    cudaError_t e = softcap ? (dropout ? launch(bwd_dkdv_kernel<Traits, true, true, true>)
                                       : launch(bwd_dkdv_kernel<Traits, true, false, true>))
                    : masks ? (dropout ? launch(bwd_dkdv_kernel<Traits, true, true>)
                                       : launch(bwd_dkdv_kernel<Traits, true, false>))
                            : (dropout ? launch(bwd_dkdv_kernel<Traits, false, true>)
                                       : launch(bwd_dkdv_kernel<Traits, false, false>));
    if (e != cudaSuccess) return e;
    backward_sm80_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return launch_convert_dq();
}

}  // namespace cuda
}  // namespace tf_flash
