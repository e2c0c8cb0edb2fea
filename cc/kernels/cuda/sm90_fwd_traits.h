// The Hopper forward's compile-time shape (FwdTraitsSm90: tiles, GEMMs, shared-memory layouts, TMA copies and
// the shared storage) and its named barriers, which its parts (sm90_fwd_*.h) share.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/sm90_tile_size.h"

namespace tf_flash {
namespace cuda {

// FP8 (e4m3): V^T and P's key order are sm90_tile_size.h's (fp8_value_key_of_slot).

// The 128-byte swizzle atom where a K-major row holds a multiple of 128 bytes, else the 64-byte one (fp8 rows
// of 64 elements).
template <class Element, int kRowElements>
using SmemAtomK = std::conditional_t<kRowElements * sizeof(Element) % 128 == 0,
                                     cute::GMMA::Layout_K_SW128_Atom<Element>, cute::GMMA::Layout_K_SW64_Atom<Element>>;

// V's stages, (head dim, key, stage) (FwdTraitsSm90::SmemLayoutVt). A template of its own so that only the layout of
// the inputs' width is made (the 16-bit one does not tile fp8's head dim 64).
template <bool kFp8, class Element, int kHeadDim, int kBlockN, int kStages>
struct SmemLayoutVtOf {  // 16-bit: the same bytes as a K-major (key, head dim) tile, seen transposed
  using type = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{}, cute::Step<cute::_2, cute::_1, cute::_3>{}));
};
template <class Element, int kHeadDim, int kBlockN, int kStages>
struct SmemLayoutVtOf<true, Element, kHeadDim, kBlockN, kStages> {  // fp8: V^T's tile as loaded, keys contiguous
  using type = decltype(cute::tile_to_shape(
      SmemAtomK<Element, kBlockN>{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{}));
};

// OutElement: O's type (Element but for fp8 inputs, whose output is bfloat16 or float16).
template <int kHeadDim_, int kBlockN_, int kStages_, class Element_, int kMmaWarpGroups_ = 2,
          class OutElement_ = Element_>
struct FwdTraitsSm90 {
  using Element = Element_;
  using OutElement = OutElement_;
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static_assert(!kFp8 || sizeof(OutElement) == 2, "fp8 inputs give a 16-bit output");
  static constexpr int kMmaWarpGroups = kMmaWarpGroups_;  // each owns 64 query rows
  static_assert(kMmaWarpGroups == 2 || kMmaWarpGroups == 3, "two or three consumer warpgroups");
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64 * kMmaWarpGroups, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kMmaThreads = 128 * kMmaWarpGroups;
  static constexpr int kNThreads = kMmaThreads + 128;  // and the producer warpgroup
  // 24 * 128 + 240 * 256 and 24 * 128 + 160 * 384 <= 64K registers
  static constexpr int kProducerRegs = 24, kMmaRegs = kMmaWarpGroups == 2 ? 240 : 160;
  static_assert(kHeadDim % 64 == 0, "swizzled rows of 64 elements");
  static_assert(kBlockN % (kFp8 ? 64 : 16) == 0, "key tile: whole k-slices of P V (fp8: whole V^T swizzle rows)");

  // The key of V's stage column `slot` (fp8_value_key_of_slot; the identity for 16-bit inputs).
  static __host__ __device__ constexpr int value_key_of_slot(int slot) {
    return kFp8 ? fp8_value_key_of_slot(slot) : slot;
  }
  static __host__ __device__ constexpr int value_slot_of_key(int key) {
    return kFp8 ? fp8_value_slot_of_key(key) : key;
  }

  using TileQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TilePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kMmaWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpGroups{}));
  // 16-bit: V stays as loaded (key rows, head dim contiguous), the B operand of P V head-dim-major (MN). fp8:
  // V^T, keys contiguous (K-major).
  static constexpr cute::GMMA::Major kMajorV = kFp8 ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TilePV, cute::GMMA::Major::K, kMajorV>(), WarpGroups{}));

  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtomK<Element, kHeadDim>{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtomK<Element, kHeadDim>{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // (head dim, key, stage) (SmemLayoutVtOf).
  using SmemLayoutVt = typename SmemLayoutVtOf<kFp8, Element, kHeadDim, kBlockN, kStages>::type;

  // Global tensors as the TMA sees them: (rows, head dim, heads, batch), head dim contiguous; V transposed
  // (head dim, keys, heads, batch): V itself (head dim contiguous) or, for fp8, V^T (keys contiguous).
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemStrideVt = std::conditional_t<kFp8, cute::Stride<int64_t, cute::_1, int64_t, int64_t>,
                                          cute::Stride<cute::_1, int64_t, int64_t, int64_t>>;
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
  static constexpr uint32_t kOutputBytes = kBlockM * kHeadDim * sizeof(OutElement);

  // O leaves through shared memory and one TMA store per consumer (its 64 rows; rows and columns past the
  // tensor are not written). It has a buffer of its own where that fits beside Q and the K/V stages, so that
  // the next tile's Q loads while this tile's O is stored; else (head dim 256) it takes Q's buffer, each
  // consumer its own rows, which only its own GEMMs read. fp8's O (16-bit) is larger than Q's buffer: always its own.
  static constexpr bool kOwnOutputBuffer = kTmaBytesQ + kOutputBytes + 2 * kStages * kTmaBytesKV <= 200 * 1024;
  static_assert(kOwnOutputBuffer || sizeof(OutElement) == sizeof(Element), "O through Q's buffer: the same bytes");
  using SmemLayoutO = std::conditional_t<
      kFp8,
      decltype(cute::tile_to_shape(SmemAtomK<OutElement, kHeadDim>{},
                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{})),
      SmemLayoutQ>;
  // One consumer's rows of O (the first 64; a consumer's own are these, moved by whole swizzle periods).
  using SmemLayoutOWarpGroup = decltype(cute::composition(
      SmemLayoutO{},
      cute::Layout<cute::Shape<cute::_64, cute::Int<kHeadDim>>, cute::Stride<cute::_1, cute::Int<kBlockM>>>{}));
  using TmaO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<OutElement*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutOWarpGroup{}, cute::Shape<cute::_64, cute::Int<kHeadDim>>{}, cute::_1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  struct SharedStorage {
    // 128-byte swizzled tiles want 1024-byte alignment (the swizzle pattern's period).
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutQ>> q;  // and O without kOwnOutputBuffer
    alignas(1024) cute::ArrayEngine<OutElement, kOwnOutputBuffer ? cute::cosize_v<SmemLayoutO> : 8> o;
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
