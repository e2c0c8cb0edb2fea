// The Hopper forward's compile-time shape (FwdTraitsSm90: tiles, GEMMs, shared-memory layouts, TMA copies and
// the shared storage) and its named barriers, which its parts (sm90_fwd_*.h) share.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

namespace tf_flash {
namespace cuda {

template <int kHeadDim_, int kBlockN_, int kStages_, class Element_, int kMmaWarpGroups_ = 2>
struct FwdTraitsSm90 {
  using Element = Element_;
  static constexpr int kMmaWarpGroups = kMmaWarpGroups_;  // each owns 64 query rows
  static_assert(kMmaWarpGroups == 2 || kMmaWarpGroups == 3, "two or three consumer warpgroups");
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64 * kMmaWarpGroups, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kMmaThreads = 128 * kMmaWarpGroups;
  static constexpr int kNThreads = kMmaThreads + 128;  // and the producer warpgroup
  // 24 * 128 + 240 * 256 and 24 * 128 + 160 * 384 <= 64K registers
  static constexpr int kProducerRegs = 24, kMmaRegs = kMmaWarpGroups == 2 ? 240 : 160;
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows of 64 elements");
  static_assert(kBlockN % 16 == 0, "key tile: whole k-slices of P V");

  using TileQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TilePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kMmaWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpGroups{}));
  // V stays as loaded (key rows, head dim contiguous): the B operand of P V is then head-dim-major (MN).
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TilePV, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpGroups{}));

  using SmemLayoutQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // (head dim, key, stage): the same bytes as a K-major (key, head dim) tile, seen transposed.
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{}, cute::Step<cute::_2, cute::_1, cute::_3>{}));

  // Global tensors as the TMA sees them: (rows, head dim, heads, batch), head dim contiguous; V transposed.
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemStrideVt = cute::Stride<cute::_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStride{}),
      cute::take<0, 2>(SmemLayoutK{}), cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStrideVt{}),
      cute::take<0, 2>(SmemLayoutVt{}), cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::_1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V stage

  // O leaves through shared memory and one TMA store per consumer (its 64 rows; rows and columns past the
  // tensor are not written). It has a buffer of its own where that fits beside Q and the K/V stages, so that
  // the next tile's Q loads while this tile's O is stored; else (head dim 256) it takes Q's buffer, each
  // consumer its own rows, which only its own GEMMs read.
  static constexpr bool kOwnOutputBuffer = 2 * kTmaBytesQ + 2 * kStages * kTmaBytesKV <= 200 * 1024;
  using SmemLayoutO = SmemLayoutQ;
  // One consumer's rows of O (the first 64; a consumer's own are these, moved by whole swizzle periods).
  using SmemLayoutOWarpGroup = decltype(cute::composition(
      SmemLayoutO{},
      cute::Layout<cute::Shape<cute::_64, cute::Int<kHeadDim>>, cute::Stride<cute::_1, cute::Int<kBlockM>>>{}));
  using TmaO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutOWarpGroup{}, cute::Shape<cute::_64, cute::Int<kHeadDim>>{}, cute::_1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  struct SharedStorage {
    // 128-byte swizzled tiles want 1024-byte alignment (the swizzle pattern's period).
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutQ>> q;  // and O without kOwnOutputBuffer
    alignas(1024) cute::ArrayEngine<Element, kOwnOutputBuffer ? cute::cosize_v<SmemLayoutO> : 8> o;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutVt>> v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    cutlass::arch::ClusterBarrier barrier_q_free;  // the consumer threads are done with a tile's Q
    typename Pipeline::SharedStorage pipeline_k, pipeline_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// Named barriers of the forward kernel (ids after CUTLASS's reserved ones).
enum class Sm90Barrier : uint32_t {
  kIssueWg0 = 0,  // warpgroup 0 may issue its GEMMs (ping-pong); kIssueWg0 + i for consumer i (up to 3)
  kValueRowsZeroed = 3,  // every consumer zeroed the unseen rows of a V stage (or published what its rows see)
  kOutputWg0 = 4,  // a consumer's output rows are in shared memory; kOutputWg0 + i for consumer i
};

}  // namespace cuda
}  // namespace tf_flash
