// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) compile-time shape: tiles, warpgroup GEMMs, shared-memory
// layouts and storage, TMA copies; its arguments and named barriers. Its parts (sm90_bwd_*.h) all read these.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

template <int kHeadDim_, class Element_, int kBlockM_ = 64>
struct BwdTraitsSm90 {
  using Element = Element_;
  // Head dim 256: 64 keys x 256 of dK and dV would take 256 accumulator registers a thread, so the warpgroups
  // split the head dim of dK, dV and dQ (and the query columns of S^T and dP^T) over 64-key tiles; P^T and
  // dS^T then go through shared memory (each warpgroup's GEMMs read both halves), and dQ goes to the
  // accumulator by 8-byte atomics from registers (its 64 KB fp32 staging does not fit beside two Q/dO stages).
  static constexpr bool kSplitHeadDim = kHeadDim_ == 256;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kSplitHeadDim ? 64 : 128, kStages = 2;
  static_assert(kBlockN == bwd_key_tile(kHeadDim), "bwd_dq_splits counts tiles of bwd_key_tile keys");
  static constexpr int kMmaThreads = 256, kNThreads = 384;
  static constexpr int kProducerRegs = 24, kMmaRegs = 240;
  // Dropout masks drawn one tile ahead (see the consumer loop) at head dim 64; at 128 the extra live
  // registers spill. H100, bf16, ms per backward, ahead against in the tile: b4 s4k h16 d128 7.19 / 6.75,
  // b16 s1k h12 d64 0.823 / 0.855.
  static constexpr bool kDropoutDrawAhead = kHeadDim <= 64;
  static_assert(!kSplitHeadDim || !kDropoutDrawAhead, "the kSplitHeadDim branch draws in the tile only");
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows of 64 elements");
  static_assert(kScratchRowPad % kBlockM == 0, "whole query tiles of lse2 and D in the scratch (bulk copies)");
  static_assert(!kSplitHeadDim || kBlockM == 64, "P^T and dS^T: one 128-byte swizzle row per key");

  using WarpGroupsM = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;  // each owns 64 keys
  using WarpGroupsN = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;  // each owns half the head dim
  using WarpGroupsKV = std::conditional_t<kSplitHeadDim, WarpGroupsN, WarpGroupsM>;
  // S^T = K Q^T, dP^T = V dO^T: (keys, queries, head dim), both operands K-major; each warpgroup's part.
  static constexpr int kSdPQueries = kSplitHeadDim ? kBlockM / 2 : kBlockM;
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockN>, cute::Int<kSdPQueries>, cute::Int<kHeadDim>>>(),
      WarpGroupsKV{}));
  // dV += P^T dO, dK += dS^T Q: (keys, head dim, queries), B head-dim-major; A from registers, or (kSplitHeadDim)
  // from shared memory, query-major.
  static constexpr int kdKVCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;
  using TileShapedKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kdKVCols>, cute::Int<kBlockM>>;
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      std::conditional_t<kSplitHeadDim,
                         decltype(cute::GMMA::ss_op_selector<Element, Element, float, TileShapedKV,
                                                             cute::GMMA::Major::K, cute::GMMA::Major::MN>()),
                         decltype(cute::GMMA::rs_op_selector<Element, Element, float, TileShapedKV,
                                                             cute::GMMA::Major::K, cute::GMMA::Major::MN>())>{},
      WarpGroupsKV{}));
  // dQ = dS K: (queries, head dim, keys); dS query-major, K head-dim-major. The warpgroups split 128 query rows
  // (64 each, the whole head dim: GEMMs of N = 64 rather than 32 at d64, +4-7%), or else the head dim.
  static constexpr bool kdQSplitRows = kBlockM == 128;
  static constexpr int kdQPartRows = kdQSplitRows ? 64 : kBlockM, kdQPartCols = kdQSplitRows ? kHeadDim : kHeadDim / 2;
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockM>, cute::Int<kdQPartCols>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      std::conditional_t<kdQSplitRows, WarpGroupsM, WarpGroupsN>{}));

  // Q and dO: (queries, head dim, stage), loaded by TMA; the same bytes seen as (head dim, queries, stage).
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutQt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // K and V: (keys, head dim); K also as (head dim, keys).
  using SmemLayoutK = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                    cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                    cute::Step<cute::_2, cute::_1>{}));
  // dS: (queries, keys, buffer), queries contiguous; written as dS^T (keys, queries, buffer). Two buffers:
  // one warpgroup may write the next tile's while the other still reads this one's.
  using SmemLayoutdS = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::_2>{}));
  using SmemLayoutdSt = decltype(cute::composition(
      SmemLayoutdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::_2>{},
                                        cute::Stride<cute::Int<kBlockM>, cute::_1, cute::Int<kBlockM * kBlockN>>{})));
  // kSplitHeadDim: dS^T and P^T (keys, queries, buffer) as the A operand of dK's and dV's GEMMs, query-major. With
  // 64 queries a key's row is one 128-byte swizzle row, so for dS^T these are SmemLayoutdS's bytes.
  using SmemLayoutPdSt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::_2>{}));

  // dQ of one query tile, fp32, staged for the TMA reduce-add: (queries, head dim), 128-byte swizzled rows of
  // 32 floats (conflict-free stores of the accumulator's column pairs), atoms down the rows first, in one
  // contiguous block per warpgroup (its part: half the head dim, or 64 query rows).
  using SmemLayoutdQPart = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{},
                                                        cute::Shape<cute::Int<kdQPartRows>, cute::Int<kdQPartCols>>{},
                                                        cute::Step<cute::_1, cute::_2>{}));
  using SmemLayoutdQ = decltype(cute::tile_to_shape(SmemLayoutdQPart{},
                                                    cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{},
                                                    cute::Step<cute::_1, cute::_2>{}));
  static_assert(kdQPartCols % 32 == 0, "whole 32-float swizzle atoms per warpgroup");

  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;  // (rows, head dim, heads, batch)
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemTensor = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                                GmemShape{}, GmemStride{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemLayoutQ{}),
                                            cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                            cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, cute::_1{}));
  // The dQ accumulator (bwd_launch.h's scratch) as (padded query rows, head dim, batch * heads).
  using GmemTensordQ = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<float*>(nullptr)),
                                                  cute::Shape<int32_t, int32_t, int32_t>{},
                                                  cute::Stride<int64_t, cute::_1, int64_t>{}));
  using TmadQ = decltype(cute::make_tma_copy(cute::SM90_TMA_REDUCE_ADD{}, GmemTensordQ{}, SmemLayoutdQPart{},
                                             cute::Shape<cute::Int<kdQPartRows>, cute::Int<kdQPartCols>>{},
                                             cute::_1{}));
  // One stage: Q and dO, and lse2 and D of their rows (bulk copies, so that the consumers read them from shared
  // memory when they need them instead of holding 2 kCols registers across the GEMMs, or waiting on global loads).
  static constexpr uint32_t kTmaBytesQdO = 2 * kBlockM * kHeadDim * sizeof(Element) + 2 * kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineKV = cutlass::PipelineTmaAsync<1>;  // a CTA's key tiles in turn (more than one: deterministic)
  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutQ>> d_o;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutdS>> ds;
    // The dQ staging, or with kSplitHeadDim (dQ by atomics) P^T's two buffers.
    static constexpr int kdQFloats = kSplitHeadDim ? cute::cosize_v<SmemLayoutPdSt> * sizeof(Element) / sizeof(float)
                                                   : cute::cosize_v<SmemLayoutdQ>;
    alignas(1024) cute::ArrayEngine<float, kdQFloats> dq;
    alignas(16) float lse2[kStages][kBlockM];  // bwd_launch.h's lse2 and D of the stage's query rows
    alignas(16) float dvec[kStages][kBlockM];
    typename PipelineKV::SharedStorage pipeline_kv;
    typename Pipeline::SharedStorage pipeline_q;
    uint32_t key_seen[kBlockN / 32];  // attn_mask with non-finite K or V: keys some query sees
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

template <class Traits>
struct BwdArgsSm90 {
  FlashBwdParams p;
  BwdScratch s;
  typename Traits::TmaQ tma_q, tma_do;
  typename Traits::TmaK tma_k, tma_v;
  typename Traits::TmadQ tma_dq;
};

enum class BwdSm90Barrier : uint32_t {
  kRowsZeroed = 0,   // both consumers zeroed the unseen rows of a tile in shared memory
  kDsReady = 1,      // both consumers wrote their dS^T rows (and the previous dQ reduce-adds read theirs)
  kdQStaged = 2,     // a consumer's dQ part is in shared memory; kdQStaged + i for consumer i (2 and 3)
  kTileTable = 4,    // segment ids: the key tile's table of query tiles is written (and the previous one read)
  kQueriesSeen = 5,  // segment ids, a border tile: its seen query rows are published, then their rows zeroed
};

}  // namespace cuda
}  // namespace tf_flash
