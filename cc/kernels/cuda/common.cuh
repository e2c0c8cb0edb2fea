// The device toolkit of the tf_flash CUDA kernels, forward and backward: accumulator layout views,
// warp-quad reductions, fp32 -> fp16/bf16 conversion, shared-memory GEMM loops with ldmatrix
// double-buffering and predicated cp.async tile copies. The visibility rules are mask.h's, the dropout
// draws philox.h's (with the device fast path of philox_device.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"

#include "cc/kernels/cuda/philox_device.cuh"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"

namespace tf_flash {
namespace cuda {

// ---- What the forward's and the backward's tile configurations share ----
// Tile sizes; the SM80 m16n8k16 MMA atom of the element type (also run on sm_90); shared-memory rows of 64
// (or 32) elements, XOR-swizzled in 8-row atoms so that ldmatrix (plain and transposed) and the 16-byte
// cp.async stores hit distinct banks; global <-> shared copies in 16-byte vectors, kGmemThreadsPerRow
// threads per row (cp.async with zero-fill in, plain stores out).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, class Element_>
struct TileConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "head dim must be a multiple of 32");
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>,
                "16-bit elements");

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32F16F16F32_TN>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32BF16BF16F32_TN>>;

  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSmemRowElems == 64 ? 3 : 2, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRowElems>>, cute::Stride<cute::Int<kSmemRowElems>, cute::_1>>{}));
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  static constexpr int kGmemThreadsPerRow = kSmemRowElems / 8;  // 8 elements per 16-byte vector
  static_assert(kNThreads % kGmemThreadsPerRow == 0, "whole rows per thread block");
  using GmemThreadLayout =
      cute::Layout<cute::Shape<cute::Int<kNThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemTiledCopyLoad = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
  using GmemTiledCopyStore = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      cute::Layout<cute::Shape<cute::_1, cute::_8>>{}));
};

// ---- Layout views of an SM80 m16n8k16 accumulator fragment, shape ((2,2), MMA_M, MMA_N) ----
// Row/column view: ((2, MMA_M), (2, MMA_N)); mode-0 of the fragment is (column pair, row half).
template <class Layout>
__host__ __device__ constexpr auto acc_rowcol(Layout layout) {
  static_assert(decltype(cute::size<0>(layout))::value == 4, "expected an m16n8 accumulator");
  static_assert(decltype(cute::rank(layout))::value == 3, "expected (MMA, MMA_M, MMA_N)");
  auto split = cute::logical_divide(layout, cute::Shape<cute::_2>{});  // ((2,2), M, N)
  return cute::make_layout(cute::make_layout(cute::get<0, 1>(split), cute::get<1>(split)),
                           cute::make_layout(cute::get<0, 0>(split), cute::get<2>(split)));
}

// The accumulator of S = Q K^T reused as the A operand of P V (m16n8k16: two n8 atoms form one k16
// slice): ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N / 2).
template <class Layout>
__host__ __device__ constexpr auto acc_as_a_operand(Layout layout) {
  using X = cute::Underscore;
  static_assert(decltype(cute::size<2>(layout))::value % 2 == 0, "MMA_N must be even");
  auto split = cute::logical_divide(layout, cute::Shape<X, X, cute::_2>{});  // (4, M, (2, N/2))
  return cute::make_layout(cute::make_layout(cute::get<0>(split), cute::get<2, 0>(split)),
                           cute::get<1>(split), cute::get<2, 1>(split));
}

// ---- Reductions over the 4 threads of a quad that share one accumulator row ----
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// 2^x on the special-function unit (flushes denormals; the softmax never needs them).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats -> one register of two 16-bit values (round to nearest).
template <class To>
__device__ __forceinline__ uint32_t pack_float2(float a, float b) {
  static_assert(std::is_same_v<To, cutlass::half_t> || std::is_same_v<To, cutlass::bfloat16_t>, "16-bit element");
  if constexpr (std::is_same_v<To, cutlass::half_t>) {
    const __half2 h = __floats2half2_rn(a, b);
    return reinterpret_cast<const uint32_t&>(h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return reinterpret_cast<const uint32_t&>(h);
  }
}

// fp32 register tensor -> register tensor of To with the same (static) layout, converted in pairs.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  constexpr int N = decltype(cute::size(src))::value;
  using From = typename Engine::value_type;
  cutlass::NumericArrayConverter<To, From, N> convert;
  auto converted = convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
  auto dst = cute::make_tensor<To>(src.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) = converted;
  return dst;
}

// fp32 register tensor -> an existing register tensor of To over the same offsets (a layout that regroups
// src's modes, such as a wgmma accumulator seen as an A operand), one register of two values at a time.
// (Converting into a new tensor and copying it element by element makes the compiler take each register's
// 16-bit halves apart and put them back: ~160 more instructions per tile in the Hopper forward at d128.)
template <class Engine, class Layout, class EngineOut, class LayoutOut>
__device__ __forceinline__ void convert_fragment_into(cute::Tensor<Engine, Layout> const& src,
                                                      cute::Tensor<EngineOut, LayoutOut>& dst) {
  using From = typename Engine::value_type;
  using To = typename EngineOut::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  static_assert(N % 2 == 0 && decltype(cute::cosize(dst.layout()))::value == N, "the same offsets, in pairs");
  cutlass::NumericArrayConverter<To, From, 2> convert;
  const auto* in = reinterpret_cast<const cutlass::Array<From, 2>*>(src.data());
  auto* out = reinterpret_cast<cutlass::Array<To, 2>*>(dst.data());
  CUTE_UNROLL
  for (int i = 0; i < N / 2; ++i) out[i] = convert(in[i]);
}

// ---- GEMM loops over the k-slices of shared-memory operands, loading slice i+1 (ldmatrix) while the
// tensor cores work on slice i ----
template <class TiledMma, class Acc, class FragA, class FragB, class SmemA, class SmemB, class CopyA,
          class CopyB, class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_smem_smem(TiledMma& tiled_mma, Acc& acc, FragA& frag_a, FragB& frag_b,
                                               SmemA const& smem_a, SmemB const& smem_b, CopyA const& copy_a,
                                               CopyB const& copy_b, ThrCopyA const& thr_copy_a,
                                               ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_a_view = thr_copy_a.retile_D(frag_a);
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  copy(copy_a, smem_a(_, _, _0{}), frag_a_view(_, _, _0{}));
  copy(copy_b, smem_b(_, _, _0{}), frag_b_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(frag_a); ++i) {
    if (i + 1 < size<2>(frag_a)) {
      copy(copy_a, smem_a(_, _, i + 1), frag_a_view(_, _, i + 1));
      copy(copy_b, smem_b(_, _, i + 1), frag_b_view(_, _, i + 1));
    }
    gemm(tiled_mma, frag_a(_, _, i), frag_b(_, _, i), acc);
  }
}

// A already in registers (the probabilities P), B from shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_reg_smem(TiledMma& tiled_mma, Acc& acc, FragA const& frag_a, FragB& frag_b,
                                              SmemB const& smem_b, CopyB const& copy_b,
                                              ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  copy(copy_b, smem_b(_, _, _0{}), frag_b_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(frag_a); ++i) {
    if (i + 1 < size<2>(frag_a)) copy(copy_b, smem_b(_, _, i + 1), frag_b_view(_, _, i + 1));
    gemm(tiled_mma, frag_a(_, _, i), frag_b(_, _, i), acc);
  }
}

// ---- Global -> shared tile copy with cp.async; rows >= rows_left or columns >= cols are zero-filled
// (the zero-size form of the instruction reads no global bytes for them). `coord` is the identity
// tensor partitioned like src: each 16-byte chunk's (row, column) inside the tile. One predicated
// instruction per chunk: cheaper than branching between a predicated and an unpredicated copy. ----
// Rows before rows_begin (may be negative: none) are zero-filled too: keys that no query of the tile sees,
// whose NaN padding would otherwise reach P V as 0 x NaN.
template <class ZfillCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_tile_async(ZfillCopy const& zfill_copy, Src const& src, Dst& dst,
                                                Coord const& coord, int rows_left, int cols, int rows_begin = 0) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const int row = get<0>(coord(0, m, 0));
    const bool row_ok = row < rows_left && row >= rows_begin;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      const bool ok = row_ok && get<1>(coord(0, m, k)) < cols;
      copy(zfill_copy.with(ok), src(_, m, k), dst(_, m, k));
    }
  }
}

// The same copy on whole tiles: `src` (global) and `dst` (shared) are partitioned here by `thr_copy`, a
// thread slice of `zfill_copy`.
template <class ZfillCopy, class ThrCopy, class Src, class Dst>
__device__ __forceinline__ void partition_and_copy_tile_async(ZfillCopy const& zfill_copy, ThrCopy const& thr_copy,
                                                              Src const& src, Dst& dst, int rows_left, int cols) {
  auto dst_part = thr_copy.partition_D(dst);
  copy_tile_async(zfill_copy, thr_copy.partition_S(src), dst_part,
                  thr_copy.partition_S(cute::make_identity_tensor(cute::shape(src))), rows_left, cols);
}

// ---- Predicated tile stores: only the chunks of rows < rows_left and columns < cols ----
// src, dst and coord (the identity tensor of the tile) partitioned alike by one thread slice of tiled_copy.
template <class TiledCopy, class Src, class Dst, class Coord>
__device__ __forceinline__ void copy_predicated(TiledCopy const& tiled_copy, Src const& src, Dst& dst,
                                                Coord const& coord, int64_t rows_left, int cols) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    if (get<0>(coord(0, m, 0)) < rows_left) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(dst); ++k) {
        if (get<1>(coord(0, m, k)) < cols) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

// A shared-memory tile to global memory, partitioned here by thr_copy (a thread slice of tiled_copy).
template <class TiledCopy, class ThrCopy, class Src, class Dst>
__device__ __forceinline__ void store_tile(TiledCopy const& tiled_copy, ThrCopy const& thr_copy, Src const& src,
                                           Dst& dst, int64_t rows_left, int cols) {
  auto dst_part = thr_copy.partition_D(dst);
  copy_predicated(tiled_copy, thr_copy.partition_S(src), dst_part,
                  thr_copy.partition_D(cute::make_identity_tensor(cute::shape(dst))), rows_left, cols);
}

// dQ accumulator (global, fp32) += this thread's part of acc_dq, by atomics: on sm_90 the accumulator's
// (even, odd) column pairs are adjacent in memory, one 8-byte red per pair. 16-byte reds (lanes trading a column
// pair, half the requests) measure 0.98-1.00 of this at d256: the L2 counts the sectors written, not the
// requests.
template <class AccDq, class GmemDq>
__device__ __forceinline__ void atomic_add_dq(AccDq const& acc_dq, GmemDq& tdQgdQ) {
  using namespace cute;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(decltype(size<0, 0>(acc_dq))::value == 2, "C fragment pairs");
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 2)
    atomicAdd(reinterpret_cast<float2*>(&tdQgdQ(i)), make_float2(acc_dq(i), acc_dq(i + 1)));
#else
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) atomicAdd(&tdQgdQ(i), acc_dq(i));
#endif
}

// ---- Dropout: the Philox draws of this thread's entries of a score tile (philox.h's layout) ----
// Calls draw(m, c, draws) for each MMA row block m < kMmaM and each group c < kGroups of four adjacent n8
// column atoms (4c .. 4c + 3), with the draws of the thread's entries there. coord_rc: the score tile's
// identity tensor partitioned like the accumulator, in acc_rowcol's (row, column) view; tile_row0 and
// tile_col0 place the tile (Index: int where positions fit, else int64_t).
template <int kMmaM, int kGroups, class Index, class CoordRC, class Draw>
__device__ __forceinline__ void for_each_dropout_draw(const DropoutSeed& seed, uint64_t batch_head, Index tile_row0,
                                                      Index tile_col0, CoordRC const& coord_rc, Draw&& draw) {
  CUTE_UNROLL
  for (int m = 0; m < kMmaM; ++m) {
    const Index row = tile_row0 + cute::get<0>(coord_rc(2 * m, 0));
    CUTE_UNROLL
    for (int c = 0; c < kGroups; ++c) {
      const Index col = tile_col0 + cute::get<1>(coord_rc(0, 8 * c));
      draw(m, c, dropout_draws(seed, batch_head, row, col));
    }
  }
}

// The backward of both families, first visit of a K/V tile under attn_mask / block_mask: when the tile holds a
// non-finite value (a rare case that pays one extra sweep over the masks of this key tile's queries), zeroes the
// keys those masks hide from every valid query of the GQA group, so that no 0 x NaN reaches dQ = dS K or
// dP = dO V^T. kThreads threads (tid < kThreads) take part; sync_or(pred) is their barrier returning whether
// any passed true, sync() their plain barrier (the Hopper kernel's also fences the zeroed rows for wgmma).
template <int kThreads, int kBlockN, int kHeadDim, class SmemKV, class SyncOr, class Sync>
__device__ __forceinline__ void hide_unseen_keys(SmemKV& sK, SmemKV& sV, uint32_t* key_seen, const FlashFwdParams& p,
                                                 int b, int h_first, int group, int n0, int64_t keys_end,
                                                 int64_t q_len, int64_t kv_len, int tid, SyncOr&& sync_or,
                                                 Sync&& sync) {
  using Element = typename SmemKV::value_type;
  bool bad = false;
  for (int idx = tid; idx < kBlockN * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim, d = idx % kHeadDim;
    bad |= !isfinite(float(sK(r, d))) || !isfinite(float(sV(r, d)));
  }
  if (!sync_or(bad)) return;
  for (int i = tid; i < kBlockN / 32; i += kThreads) key_seen[i] = 0;
  sync();
  constexpr int kRowLanes = kThreads / kBlockN > 0 ? kThreads / kBlockN : 1;
  for (int idx = tid; idx < kBlockN * kRowLanes; idx += kThreads) {
    const int c = idx % kBlockN, lane = idx / kBlockN;
    const int64_t col = int64_t(n0) + c;
    bool seen = false;
    for (int hh = h_first; hh < h_first + group && !seen && col < keys_end; ++hh) {
      for (int64_t row = lane; row < q_len && !seen; row += kRowLanes) seen = visible(p, b, hh, row, col, q_len, kv_len);
    }
    if (seen) atomicOr(&key_seen[c / 32], 1u << (c % 32));
  }
  sync();
  for (int idx = tid; idx < kBlockN * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim, d = idx % kHeadDim;
    if (!((key_seen[r / 32] >> (r % 32)) & 1u)) {
      sK(r, d) = Element(0);
      sV(r, d) = Element(0);
    }
  }
  sync();
}

}  // namespace cuda
}  // namespace tf_flash
