// Hopper (sm_90a) dK/dV kernel of the backward (kernel 2 of bwd_kernel.h's three; the preprocess and the
// dQ conversion are shared with the sm_80 family, and so is the scratch layout, bwd_launch.h). One CTA per
// (key tile of 128, 64 at head dim 256; kv head, batch) runs three warpgroups: the producer (one thread) brings
// K and V once and, for every query tile (64 rows; 128 in the plain variant at head dim 64) of every query head
// of the GQA group, Q and dO (and the rows' lse2 and D, bulk copies) through a two-stage TMA ring
// (cutlass::PipelineTmaAsync); each of the two consumer warpgroups owns 64 keys (at d256 half the head dim) and
// keeps their dK, dV accumulators in registers. With the deterministic dQ, the CTA of split i of (kv head,
// batch) runs key tiles i, i + splits, ... (bwd_dq_splits) in turn, into dQ accumulator i. Per query tile,
// with wgmma:
//   S^T = K Q^T and dP^T = V dO^T (both operands from shared memory),
//   P^T = exp2(S^T scale_log2 - lse2), dS^T = P^T (dP^T - D) (lse2, D from the preprocess),
//   dV += P^T dO (P^T from registers), dS^T to shared memory, then dQ_tile = dS K (the two warpgroups split
//   the head dim, or 128 query rows) and dK += dS^T Q (dS^T from registers); while dK's GEMM runs, each
//   warpgroup stages its dQ in shared memory, and the next step, once its first GEMMs are issued, adds it to
//   the fp32 dQ accumulator with one TMA reduce-add (the copy engine does the atomics).
// Head dim 256 (BwdTraitsSm90::kSplitHeadDim) takes 64-key tiles whose warpgroups split the head dim instead of
// the keys: each computes S^T and dP^T for half the query columns, P^T and dS^T go to shared memory, and each
// runs dQ, dV and dK over its half of the head dim from there; dQ goes by atomics from registers.
// The general variant adds soft-capping (the forward's tanh; P, dS and the tanh's derivative in one pass),
// dropout (the forward's Philox draws, philox.h, taken for the transposed tile:
// dropout_keep_bits_transposed) and the skipping of False blocks; the masked variant (kAttnMask) also
// attn_mask, packed to a bit per entry before the kernel (packed_mask.h): query tiles it hides whole are
// skipped, tiles it hides in part are masked by the packed bits.
// Visibility is mask.h's (causal, window, lengths, attn_mask, and block masks whose blocks hold whole tiles):
// query tiles that see no key of the tile are never visited, tiles that straddle a boundary are masked per
// element (by replacement: P = dS = 0). Keys no valid query sees and query rows past q_len are zeroed in shared
// memory (0 x NaN must not reach a GEMM). Other block masks run in the sm_80 family (family.cu chooses).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/flash/mask.h"
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
  kRowsZeroed = 0,  // both consumers zeroed the unseen rows of a tile in shared memory
  kDsReady = 1,     // both consumers wrote their dS^T rows (and the previous dQ reduce-adds read theirs)
  kdQStaged = 2,    // a consumer's dQ part is in shared memory; kdQStaged + i for consumer i
};

// Zeroes rows [lo, hi) of a (rows, head dim) shared-memory tile, cooperatively over `threads` threads; the
// caller fences (fence_view_async_shared) and synchronizes before a GEMM reads the tile.
template <int kHeadDim, class Tile>
__device__ __forceinline__ void zero_tile_rows(Tile&& tile, int lo, int hi, int tid, int threads) {
  using Element = typename std::decay_t<Tile>::value_type;
  for (int i = tid; i < (hi - lo) * kHeadDim; i += threads) tile(lo + i / kHeadDim, i % kHeadDim) = Element(0);
}

// The forward's dropout keep bits of this thread's entries of the S^T tile (keys x queries) at (n0, m0):
// bit mi * kCols + ni of the accumulator's row/column view, where ni = 2g + (query & 1) for n8 group g.
// philox.h lays the draws out for (query, key) fragments; in the transposed tile a thread holds keys r and
// r + 8 of its warp's 16 and the query pairs (2t, 2t + 1) of every n8 group, so one Philox call holds
// entries of two lanes (r even and odd: lane and lane ^ 4). Each lane draws the calls of its own query
// parity and passes the other lane its bits with one shuffle: 4 calls per 32 entries, twice the forward's
// rate (the other warp of the 32-key call draws it too).
template <int kCols, class CoordRC>
__device__ __forceinline__ uint32_t dropout_keep_bits_transposed(CoordRC const& cS_rc, const DropoutSeed& seed,
                                                                 uint64_t batch_head, int m0, int n0,
                                                                 uint32_t threshold2) {
  using namespace cute;
  static_assert(kCols % 4 == 0 && 2 * kCols <= 32, "rows r, r + 8; whole 16-query call blocks; one bit each");
  const int key0 = n0 + get<0>(cS_rc(0, 0));   // key r (mi 0); key r + 8 (mi 1) shares its Philox call
  const int query0 = m0 + get<1>(cS_rc(0, 0));  // query 2t of n8 group 0
  const int parity = key0 & 1;
  // Philox words hold n8 key groups: key r's is 0 or 2 (r < 8 in a 16-key warp slice), r + 8's the next.
  const bool high_words = ((key0 >> 3) & 3) != 0;
  // dropout_keep_bits4 gives bit 2 * (query row half) + (key & 1); in the call of query parity `parity`
  // this lane's keys are the bits of that parity, which are also their places in the result (ni = 2g + parity).
  const uint32_t own = parity ? 0xAu : 0x5u;
  uint32_t keep = 0, other = 0;  // other: lane ^ 4's entries, at the places of their key parity
  CUTE_UNROLL
  for (int block = 0; block < kCols / 4; ++block) {  // 16 queries per call: n8 groups 2 block, 2 block + 1
    const Philox4 draws = dropout_draws(seed, batch_head, query0 + 16 * block + parity, key0);
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const uint32_t bits = dropout_keep_bits4(high_words ? draws.x[2 + mi] : draws.x[mi], threshold2);
      keep |= (bits & own) << (mi * kCols + 4 * block);
      other |= (bits & (own ^ 0xFu)) << (mi * kCols + 4 * block);
    }
  }
  // Lane ^ 4 drew the other query parity: its bits for this lane sit at this lane's key parity; each moves to
  // its neighbour, the place of that query parity.
  const uint32_t theirs = __shfl_xor_sync(0xffffffffu, other, 4);
  return keep | ((theirs & 0x55555555u) << 1) | ((theirs >> 1) & 0x55555555u);
}

// kGeneral: soft-capping, dropout and block masks (run-time switches inside), kept out of the plain
// variant's registers; kAttnMask: attn_mask, with either (its code and registers kept out of both others').
template <class Traits, bool kGeneral, bool kAttnMask = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_dkdv_kernel_sm90(const __grid_constant__ BwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kMmaThreads = Traits::kMmaThreads;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_buf[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const FlashBwdParams& p = args.p;
  const BwdScratch& s = args.s;

  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int num_key_tiles = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const int group = p.num_heads / p.num_heads_kv;
  const int64_t q_len = valid_q_len(p, b), kv_len = valid_kv_len(p, b);
  // A key tile's work: the query tiles that see some of its keys (mask.h), for each query head of the group,
  // iteration it = (head in group) * n_m + (query tile - m_begin).
  struct KeyTile {
    int n_block, n0, m_begin, n_m, n_iter;
  };
  auto key_tile = [&](int n_block) {
    KeyTile t;
    t.n_block = n_block;
    t.n0 = n_block * kBlockN;
    const IndexRange query_rows = query_range_of_keys(p, t.n0, int64_t(t.n0) + kBlockN, q_len, kv_len);
    t.m_begin = int(query_rows.begin / kBlockM);
    const int m_end = int((query_rows.end + kBlockM - 1) / kBlockM);
    t.n_m = m_end > t.m_begin ? m_end - t.m_begin : 0;
    t.n_iter = t.n_m * group;
    return t;
  };
  // Block-sparse (the general variant; hopper_backward_takes (family.cu): every tile inside one block): tiles
  // of False blocks are skipped by the producer and the consumers alike. The plain variant visits every tile
  // (the check cost it 1-2% at head dim 64, bf16 and fp16).
  // attn_mask (the masked variant): its packing (packed_mask.h, in the scratch), whose summaries are per (64
  // queries, 128 keys): this kernel's tiles, or (kSplitHeadDim) two of them, which then share one.
  static_assert(!kAttnMask || (kBlockM == kMaskRowGroup && kMaskChunkKeys % kBlockN == 0), "a summary per tile");
  const bool has_attn_mask = kAttnMask && p.attn_mask.data != nullptr;
  const PackedMaskLayout mask_layout(p, MaskPacking::kBackward);
  auto mask_summary = [&](int h, int m_tile, int n0) {
    return s.mask[mask_layout.summary_offset +
                  mask_layout.summary_index(mask_layout.plane(b, h), m_tile, n0 / kMaskChunkKeys)];
  };
  auto next_visible = [&](const KeyTile& t, int it) {
    if constexpr (kGeneral || kAttnMask) {
      const bool has_block_mask = kGeneral && p.block_mask.data != nullptr;
      if (!has_block_mask && !has_attn_mask) return it;
      for (; it < t.n_iter; ++it) {
        const int h = h_kv * group + it / t.n_m, m_tile = t.m_begin + it % t.n_m;
        if (has_block_mask && !block_visible(p, b, h, m_tile * kBlockM / p.block_q, t.n0 / p.block_k)) continue;
        if (has_attn_mask && !(mask_summary(h, m_tile, t.n0) & kMaskSomeVisible)) continue;
        break;
      }
    }
    return it;
  };

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.d_o.begin()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.d_o.begin()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(shared.ds.begin()), typename Traits::SmemLayoutdS{});
  // dS^T and the dQ staging are written from registers through views with the swizzle in their layouts (position
  // independent), not in the pointer: a swizzled pointer is computed as an integer, which loses the shared address
  // space and makes the stores generic (ST.E with 64-bit addresses, dQ's 8-byte stores split in two).
  Tensor sdSt = as_position_independent_swizzle_tensor(
      make_tensor(make_smem_ptr(shared.ds.begin()), typename Traits::SmemLayoutdSt{}));
  // kSplitHeadDim: P^T, written like dS^T, and both read by dV's and dK's GEMMs.
  constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
  Element* const p_smem = reinterpret_cast<Element*>(shared.dq.begin());
  Tensor sPtW = as_position_independent_swizzle_tensor(
      make_tensor(make_smem_ptr(p_smem), typename Traits::SmemLayoutPdSt{}));
  Tensor sPt = make_tensor(make_smem_ptr(p_smem), typename Traits::SmemLayoutPdSt{});
  Tensor sdStA = make_tensor(make_smem_ptr(shared.ds.begin()), typename Traits::SmemLayoutPdSt{});

  const int warp_group = int(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
  }
  using PipelineKV = typename Traits::PipelineKV;
  PipelineKV pipeline_kv(shared.pipeline_kv, tma_pipeline_params<PipelineKV>(Traits::kTmaBytesKV, kMmaThreads),
                         Shape<_1, _1, _1>{});
  Pipeline pipeline_q(shared.pipeline_q, tma_pipeline_params<Pipeline>(Traits::kTmaBytesQdO, kMmaThreads),
                      Shape<_1, _1, _1>{});
  __syncthreads();  // barriers initialized

  if (warp_group == 0) {
    // ---- Producer: per key tile K and V, then Q and dO of every (query head, query tile) ----
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x == 0) {
      using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
      Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch));
      Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim_v, p.num_heads_kv, p.batch));
      Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.num_heads, p.batch));
      Tensor mdO = args.tma_do.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch));
      typename PipelineKV::PipelineState write_kv = cutlass::make_producer_start_state<PipelineKV>();
      PipelineState write = cutlass::make_producer_start_state<Pipeline>();
      for (int n_block = blockIdx.x; n_block < num_key_tiles; n_block += gridDim.x) {
        const KeyTile t = key_tile(n_block);
        if (t.n_iter == 0) continue;  // the consumers skip it too
        Tensor gK = local_tile(mK(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
        Tensor gV = local_tile(mV(_, _, h_kv, b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
        auto k_parts = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto v_parts = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        pipeline_kv.producer_acquire(write_kv);  // the consumers are done with the previous key tile's K and V
        BarrierType& kv_full = *pipeline_kv.producer_get_barrier(write_kv);
        copy(args.tma_k.with(kv_full), get<0>(k_parts), get<1>(k_parts));
        copy(args.tma_v.with(kv_full), get<0>(v_parts), get<1>(v_parts));
        ++write_kv;
        for (int it = next_visible(t, 0); it < t.n_iter; it = next_visible(t, it + 1)) {
          const int h = h_kv * group + it / t.n_m;
          const int m_tile = t.m_begin + it % t.n_m;
          Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_tile, _0{}));
          Tensor gdO = local_tile(mdO(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_tile, _0{}));
          auto q_parts = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto do_parts =
              tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
          pipeline_q.producer_acquire(write);
          BarrierType& full = *pipeline_q.producer_get_barrier(write);
          copy(args.tma_q.with(full), get<0>(q_parts), get<1>(q_parts)(_, write.index()));
          copy(args.tma_do.with(full), get<0>(do_parts), get<1>(do_parts)(_, write.index()));
          // The scratch's rows are padded to whole tiles (kScratchRowPad): the copies stay inside it, 16-byte
          // aligned as bulk copies need (the scratch is, and so are its lse2 and D offsets).
          const int64_t row0 = (int64_t(b) * p.num_heads + h) * s.sq_pad + int64_t(m_tile) * kBlockM;
          SM90_BULK_COPY_G2S::copy(s.lse2 + row0, reinterpret_cast<uint64_t*>(&full), shared.lse2[write.index()],
                                   kBlockM * sizeof(float));
          SM90_BULK_COPY_G2S::copy(s.dvec + row0, reinterpret_cast<uint64_t*>(&full), shared.dvec[write.index()],
                                   kBlockM * sizeof(float));
          ++write;
        }
      }
    }
  } else {
    // ---- Consumers ----
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
    const int mma_tidx = int(threadIdx.x) - 128;
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(mma_tidx);
    auto thr_dkv = mma_dkv.get_thread_slice(mma_tidx);
    auto thr_dq = mma_dq.get_thread_slice(mma_tidx);
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);    // (MMA, MMA_N, MMA_K, stage)
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);    // (MMA, MMA_M, MMA_K, buffer)
    Tensor tdQrK = thr_dq.partition_fragment_B(sKt);
    // kSplitHeadDim: A of dV's and dK's GEMMs from shared memory, (MMA, MMA_M, MMA_K, buffer).
    auto tdVsP = [&] {
      if constexpr (kSplitHeadDim) return thr_dkv.partition_fragment_A(sPt);
      else return 0;
    }();
    auto tdKsdS = [&] {
      if constexpr (kSplitHeadDim) return thr_dkv.partition_fragment_A(sdStA);
      else return 0;
    }();
    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    // (key row, query column) inside the S^T tile of each accumulator element.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor cS_rc = make_tensor(cS.data(), gmma_acc_rowcol(cS.layout()));
    constexpr int kRows = decltype(size<0>(cS_rc))::value, kCols = decltype(size<1>(cS_rc))::value;
    static_assert(kRows * kCols <= 64, "one visibility bit per element");
    using TileBits = std::conditional_t<kRows * kCols <= 32, uint32_t, uint64_t>;  // bit mi * kCols + ni
    auto copy_ds = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, Element>{}, mma_sdp);
    auto thr_copy_ds = copy_ds.get_thread_slice(mma_tidx);
    // dQ staging: this consumer's part, reduce-added by its first thread.
    const int consumer = warp_group - 1;
    const bool dq_issuer = mma_tidx % 128 == 0;
    auto copy_dq = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint64_t>, float>{}, mma_dq);
    auto thr_copy_dq = copy_dq.get_thread_slice(mma_tidx);
    Tensor tdQsdQ = thr_copy_dq.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared.dq.begin()), typename Traits::SmemLayoutdQ{})));
    using SmemLayoutdQPart = typename Traits::SmemLayoutdQPart;
    Tensor sdQ_part =
        make_tensor(make_smem_ptr(shared.dq.begin() + consumer * cosize_v<SmemLayoutdQPart>), SmemLayoutdQPart{});
    // (query rows, head dim, (split, batch, head)): this CTA's dQ accumulator is its split's (bwd_launch.h).
    Tensor mdQ = args.tma_dq.get_tma_tensor(
        make_shape(int32_t(s.sq_pad), int32_t(kHeadDim), s.dq_splits * p.batch * p.num_heads));
    const int dq_plane0 = s.deterministic ? int(blockIdx.x) * p.batch * p.num_heads : 0;
    const float scale_log2 = softmax_scale_log2(p);  // the forward's factor (mask.h)
    const bool has_softcap = kGeneral && p.softcap > 0.f;
    const float softcap_in = has_softcap ? softcap_input_scale(p) : 0.f;
    const bool has_dropout = kGeneral && p.dropout_rate > 0.f;
    const uint32_t threshold2 = has_dropout ? dropout_threshold(p.dropout_rate) * 0x10001u : 0u;
    const float keep_scale = has_dropout ? dropout_keep_scale(p.dropout_rate) : 1.f;
    const DropoutSeed seed = has_dropout ? dropout_seed(p) : DropoutSeed{0, 0, 0};

    typename PipelineKV::PipelineState read_kv;
    PipelineState read;
    int buffer = 0;  // the dS buffer, alternating per visited tile (across key tiles too: see kDsReady)
    for (int n_block = blockIdx.x; n_block < num_key_tiles; n_block += gridDim.x) {
      const KeyTile t = key_tile(n_block);
      const int n0 = t.n0;
      clear(acc_dk);
      clear(acc_dv);
      if (t.n_iter > 0) {
        pipeline_kv.consumer_wait(read_kv);
        // Keys that no valid query sees, and query rows past q_len, may hold anything (NaN padding); past the
        // tensors' ends the TMA has zero-filled already.
        const int64_t keys_end = key_range_of_rows(p, 0, q_len, q_len, kv_len).end;
        const int key_lo = int(keys_end - n0 < kBlockN ? (keys_end - n0 > 0 ? keys_end - n0 : 0) : kBlockN);
        const int key_hi = int(p.seqlen_k - n0 < kBlockN ? p.seqlen_k - n0 : kBlockN);
        if (key_lo < key_hi) {
          zero_tile_rows<kHeadDim>(sK, key_lo, key_hi, mma_tidx, kMmaThreads);
          zero_tile_rows<kHeadDim>(sV, key_lo, key_hi, mma_tidx, kMmaThreads);
          cutlass::arch::fence_view_async_shared();
          named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
        }
        if (has_attn_mask) {
          // Keys attn_mask hides from every query of the group may hold anything too (zeroed where the tile
          // holds a non-finite value).
          hide_unseen_keys<kMmaThreads, kBlockN, kHeadDim>(
              sK, sV, shared.key_seen, p, b, h_kv * group, group, n0, keys_end, q_len, kv_len, mma_tidx,
              [](bool pred) { return named_sync_or(kMmaThreads, BwdSm90Barrier::kRowsZeroed, pred); },
              [] {
                cutlass::arch::fence_view_async_shared();
                named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
              });
        }

        // The dropout mask of a tile (bit mi * kCols + ni, 1: kept) is drawn while the tensor cores are busy:
        // one tile ahead, during the previous tile's dV, dK and dQ GEMMs (kDropoutDrawAhead), or during the
        // tile's own dP GEMM.
        constexpr bool kDrawAhead = Traits::kDropoutDrawAhead;
        auto draw_keep = [&](int it) -> uint32_t {
          if constexpr (kGeneral) {  // only the general variant drops (64-query tiles: 32 entries a thread)
            const int h = h_kv * group + it / t.n_m, m0 = (t.m_begin + it % t.n_m) * kBlockM;
            return dropout_keep_bits_transposed<kCols>(cS_rc, seed, uint64_t(b) * p.num_heads + h, m0, n0, threshold2);
          }
          return 0u;
        };
        // The dQ tile staged at the end of a step is reduce-added in the next one, after its S^T and dP^T GEMMs
        // are issued: by then its st.shared have completed, so the fence does not wait for them behind the dK
        // GEMM's shared-memory reads (+5-13% at head dim 128, +4-6% at 64).
        int staged_h = -1, staged_m0 = 0;  // staged_h < 0: nothing staged
        auto reduce_add_staged_dq = [&] {
          cutlass::arch::fence_view_async_shared();
          named_sync(128, BwdSm90Barrier::kdQStaged, consumer);
          if (dq_issuer) {
            constexpr int kPartRows = Traits::kdQPartRows;
            Tensor gdQ = local_tile(mdQ(_, _, dq_plane0 + b * p.num_heads + staged_h),
                                    Shape<Int<kPartRows>, Int<Traits::kdQPartCols>>{},
                                    Traits::kdQSplitRows ? make_coord(staged_m0 / kPartRows + consumer, 0)
                                                         : make_coord(staged_m0 / kPartRows, consumer));
            auto dq_parts = tma_partition(args.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sdQ_part),
                                          group_modes<0, 2>(gdQ));
            copy(args.tma_dq, get<1>(dq_parts), get<0>(dq_parts));  // (gmem, smem) parts: smem -> gmem
            tma_store_arrive();
          }
          staged_h = -1;
        };
        int it = next_visible(t, 0);
        uint32_t keep_next = kDrawAhead && has_dropout && it < t.n_iter ? draw_keep(it) : 0u;
        for (; it < t.n_iter; buffer ^= 1) {
          const int h = h_kv * group + it / t.n_m;
          const int m0 = (t.m_begin + it % t.n_m) * kBlockM;
          uint32_t keep = keep_next;
          // attn_mask over part of the tile: this thread's packed words (keys r and r + 8; keys past the tensor
          // read key 0, hidden by their range), loaded now, used after the S^T GEMM.
          const bool element_masked = has_attn_mask && !(mask_summary(h, m0 / kBlockM, n0) & kMaskAllVisible);
          uint32_t mask_bits = 0;  // bit mi * kCols + ni
          if constexpr (kAttnMask) {
            // A word holds the thread's columns of all 64 queries (packed_mask.h), two bits per n8 group; with
            // kSplitHeadDim the warpgroup's 32 queries are one byte of it.
            static_assert(kRows == 2 && (kCols == 16 || kCols == 8), "a 16-bit word or a byte per row");
            if (element_masked) {
              const uint16_t* words = reinterpret_cast<const uint16_t*>(s.mask);
              const int64_t plane = mask_layout.plane(b, h);
              const int first_bit = 2 * (get<1>(cS_rc(0, 0)) / 8);
              CUTE_UNROLL
              for (int mi = 0; mi < kRows; ++mi) {
                const int64_t key = n0 + get<0>(cS_rc(mi, 0));
                const uint32_t word = words[mask_layout.word_index_t(plane, key < p.seqlen_k ? key : 0,
                                                                     m0 / kBlockM, mma_tidx % 4)];
                mask_bits |= ((word >> first_bit) & ((1u << kCols) - 1u)) << (mi * kCols);
              }
            }
          }
          const int stage = read.index();
          pipeline_q.consumer_wait(read);
          // lse2 and D of this thread's query columns, read where they are used.
          const float* stage_lse2 = shared.lse2[stage];
          const float* stage_dvec = shared.dvec[stage];
          auto lse2 = [&](int ni) { return stage_lse2[get<1>(cS_rc(0, ni))]; };
          auto dvec = [&](int ni) { return stage_dvec[get<1>(cS_rc(0, ni))]; };
          const int64_t q_lo = q_len - m0, q_hi = p.seqlen_q - m0 < kBlockM ? p.seqlen_q - m0 : kBlockM;
          if (q_lo < q_hi) {  // uniform: both consumers see the same tile
            zero_tile_rows<kHeadDim>(sQ(_, _, stage), int(q_lo), int(q_hi), mma_tidx, kMmaThreads);
            zero_tile_rows<kHeadDim>(sdO(_, _, stage), int(q_lo), int(q_hi), mma_tidx, kMmaThreads);
            cutlass::arch::fence_view_async_shared();
            named_sync(kMmaThreads, BwdSm90Barrier::kRowsZeroed);
          }

          Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
          warpgroup_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
          warpgroup_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
          if (staged_h >= 0) reduce_add_staged_dq();  // the previous step's dQ
          warpgroup_wait<1>();  // S^T done

          // Invisible entries (tiles across a boundary only) become P = dS = 0 by replacement.
          Tensor S = make_tensor(acc_s.data(), gmma_acc_rowcol(acc_s.layout()));
          Tensor dP = make_tensor(acc_dp.data(), gmma_acc_rowcol(acc_dp.layout()));
          const bool need_mask = !tile_fully_visible(p, m0, m0 + kBlockM, n0, int64_t(n0) + kBlockN, q_len, kv_len);
          TileBits hidden = 0;
          if (need_mask) {
            CUTE_UNROLL
            for (int ni = 0; ni < kCols; ++ni) {
              const TileSpan span = visible_span_in_tile(p, m0 + get<1>(cS_rc(0, ni)), q_len, kv_len, n0, kBlockN);
              CUTE_UNROLL
              for (int mi = 0; mi < kRows; ++mi) {
                const int key = get<0>(cS_rc(mi, 0));
                if (key < span.lo || key >= span.hi) hidden |= TileBits(1) << (mi * kCols + ni);
              }
            }
          }
          if (element_masked) hidden |= TileBits(~mask_bits);
          if constexpr (!kGeneral) {
            CUTE_UNROLL
            for (int mi = 0; mi < kRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                // Never above 0 (bwd_kernel.h's probabilities): a rounded lse must not make P > 1. Leaving out
                // this clamp and the selects below in tiles that need neither (under a warp vote) measures
                // 0.91-1.0 of this: d64 spills more, d128 runs 4-9% slower from 4k.
                const float prob = fast_exp2(fminf(S(mi, ni) * scale_log2 - lse2(ni), 0.f));
                S(mi, ni) = (hidden >> (mi * kCols + ni)) & 1u ? 0.f : prob;
              }
            }
            warpgroup_wait<0>();  // dP^T done
            CUTE_UNROLL
            for (int mi = 0; mi < kRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                const float ds = S(mi, ni) * (dP(mi, ni) - dvec(ni));
                dP(mi, ni) = (hidden >> (mi * kCols + ni)) & 1u ? 0.f : ds;
              }
            }
          } else {
            // The dropout mask and the tanh of soft-capping while dP^T is computed; then P and dS in one pass, so
            // that the tanh needs no second register array.
            if (!kDrawAhead && has_dropout) keep = draw_keep(it);
            if (has_softcap) {
              CUTE_UNROLL
              for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanhf(acc_s(i) * softcap_in);
            }
            warpgroup_wait<0>();  // dP^T done
            CUTE_UNROLL
            for (int mi = 0; mi < kRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                const int bit = mi * kCols + ni;
                // Soft-capping: the forward's capped score (fwd_kernel_sm90.h); d(capped)/d(raw) = 1 - tanh^2,
                // the scale applied with dK's and dQ's.
                float score = S(mi, ni), dtanh = 1.f;
                if (has_softcap) {
                  dtanh = 1.f - score * score;
                  score = p.softcap * score;
                }
                const float prob = fast_exp2(fminf(score * scale_log2 - lse2(ni), 0.f));
                const bool kept = (keep >> bit) & 1u;
                // With dropout, dP is masked and scaled as P was in the forward (bwd_kernel.h's scores_gradient),
                // and dV takes the dropped probabilities P Z / keep_prob.
                const float dpv = has_dropout ? (kept ? dP(mi, ni) * keep_scale : 0.f) : dP(mi, ni);
                float ds = prob * (dpv - dvec(ni));
                if (has_softcap) ds *= dtanh;
                const bool hid = (hidden >> bit) & 1u;
                dP(mi, ni) = hid ? 0.f : ds;
                S(mi, ni) = hid || (has_dropout && !kept) ? 0.f : (has_dropout ? prob * keep_scale : prob);
              }
            }
          }

          Tensor rP = convert_fragment<Element>(acc_s);
          if constexpr (kSplitHeadDim) {
            // P^T and dS^T to shared memory (each warpgroup its query columns); once both are there, dQ = dS K
            // (issued first, so that its atomics run under the others), dV += P^T dO and dK += dS^T Q.
            Tensor rdS = convert_fragment<Element>(acc_dp);
            copy(copy_ds, thr_copy_ds.retile_S(rP), thr_copy_ds.partition_D(sPtW(_, _, buffer)));
            copy(copy_ds, thr_copy_ds.retile_S(rdS), thr_copy_ds.partition_D(sdSt(_, _, buffer)));
            cutlass::arch::fence_view_async_shared();
            named_sync(kMmaThreads, BwdSm90Barrier::kDsReady);
            Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
            warpgroup_gemm<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrK, acc_dq);
            warpgroup_gemm<false>(mma_dkv, tdVsP(_, _, _, buffer), tdVrdO(_, _, _, stage), acc_dv);
            warpgroup_gemm<false>(mma_dkv, tdKsdS(_, _, _, buffer), tdKrQ(_, _, _, stage), acc_dk);
            warpgroup_wait<2>();  // dQ done
            // Rows past seqlen_q land in the scratch's padding (kScratchRowPad), which nothing reads.
            Tensor gdQ = make_tensor(
                make_gmem_ptr(s.dq_accum + (int64_t(dq_plane0 + b * p.num_heads + h) * s.sq_pad + m0) * kHeadDim),
                Shape<Int<kBlockM>, Int<kHeadDim>>{}, Stride<Int<kHeadDim>, _1>{});
            Tensor tdQgdQ = thr_dq.partition_C(gdQ);
            atomic_add_dq(acc_dq, tdQgdQ);
          } else {
            // dV += P^T dO (P^T from registers); dS^T to shared memory for dQ = dS K; then dK += dS^T Q, issued
            // after the dQ GEMM so that it runs while dQ is staged for its reduce-add.
            Tensor tdVrP = make_tensor(rP.data(), gmma_acc_as_a_operand(rP.layout()));
            warpgroup_gemm<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
            Tensor rdS = convert_fragment<Element>(acc_dp);
            copy(copy_ds, thr_copy_ds.retile_S(rdS), thr_copy_ds.partition_D(sdSt(_, _, buffer)));
            cutlass::arch::fence_view_async_shared();
            if (dq_issuer) tma_store_wait<0>();  // the previous tile's dQ reduce-add has read the staging buffer
            named_sync(kMmaThreads, BwdSm90Barrier::kDsReady);

            // dQ_tile = dS K (unscaled: the conversion kernel applies the scale), then into the accumulator.
            Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
            warpgroup_gemm<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrK, acc_dq);
            Tensor tdKrdS = make_tensor(rdS.data(), gmma_acc_as_a_operand(rdS.layout()));
            warpgroup_gemm<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
            if (kDrawAhead && has_dropout) {
              const int ahead = next_visible(t, it + 1);
              if (ahead < t.n_iter) keep_next = draw_keep(ahead);
            }
            warpgroup_wait<1>();  // dV and dQ done (dK still running)
            copy(copy_dq, thr_copy_dq.retile_S(acc_dq), tdQsdQ);
            staged_h = h, staged_m0 = m0;
          }
          warpgroup_wait<0>();  // dK done: this stage of Q and dO is free
          pipeline_q.consumer_release(read);
          ++read;
          it = next_visible(t, it + 1);
        }
        if (staged_h >= 0) reduce_add_staged_dq();  // the key tile's last dQ
        // The staging buffer must outlive the last reduce-add's read; deterministic, the next key tile's
        // reduce-adds into this accumulator must follow this tile's: wait for their writes too.
        if (dq_issuer) {
          if (s.deterministic) {
            tma_store_wait_writes();
          } else {
            tma_store_wait<0>();
          }
        }
        pipeline_kv.consumer_release(read_kv);  // the dQ GEMMs have read K: the producer may load the next tile
        ++read_kv;
      }

      // ---- Epilogue: dK * scale and dV in the output dtype, rows < seqlen_k, columns < head_dim (_v) ----
      Tensor cD = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
      Element* dk_ptr = static_cast<Element*>(p.d_k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
      Element* dv_ptr = static_cast<Element*>(p.d_v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dk); i += 2) {  // (even, odd) column pairs: one 4-byte store each
        const int64_t key = n0 + get<0>(cD(i));
        const int col = get<1>(cD(i));
        if (key >= p.seqlen_k) continue;
        if (col < p.head_dim)
          *reinterpret_cast<uint32_t*>(dk_ptr + key * p.k_row_stride + col) =
              pack_float2<Element>(acc_dk(i) * p.scale, acc_dk(i + 1) * p.scale);
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(dv_ptr + key * p.v_row_stride + col) =
              pack_float2<Element>(acc_dv(i), acc_dv(i + 1));
      }
    }
  }
#endif
}

}  // namespace cuda
}  // namespace tf_flash
