// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) consumer math, warpgroups 1 and 2 (each 64 keys of the
// tile, or with kSplitHeadDim half the head dim), their dK, dV accumulators in registers. Per visited query tile,
// with wgmma:
//   S^T = K Q^T and dP^T = V dO^T (both operands from shared memory),
//   P^T and dS^T from them (BwdSoftmaxGradSm90, with BwdMaskSm90's hidden entries),
//   dV += P^T dO (P^T from registers), dS^T to shared memory, then dQ_tile = dS K (the two warpgroups split
//   the head dim, or 128 query rows) and dK += dS^T Q (dS^T from registers); while dK's GEMM runs, each
//   warpgroup stages its dQ in shared memory, and the next step, once its first GEMMs are issued, adds it to
//   the fp32 dQ accumulator with one TMA reduce-add (the copy engine does the atomics).
// Head dim 256 (BwdTraitsSm90::kSplitHeadDim) takes 64-key tiles whose warpgroups split the head dim instead of
// the keys: each computes S^T and dP^T for half the query columns, P^T and dS^T go to shared memory, and each
// runs dQ, dV and dK over its half of the head dim from there; dQ goes by atomics from registers.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/sm90_bwd_scheduler.h"
#include "cc/kernels/cuda/sm90_bwd_softmax.h"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/cuda/sm90_common.cuh"

namespace tf_flash {
namespace cuda {

// kSplitHeadDim: the A operand of dV's and dK's GEMMs from shared memory, (MMA, MMA_M, MMA_K, buffer); else
// unused.
template <bool kSplitHeadDim, class ThrMma, class Smem>
__device__ __forceinline__ auto split_head_dim_fragment_a(ThrMma& thr, Smem const& smem) {
  if constexpr (kSplitHeadDim) return thr.partition_fragment_A(smem);
  else return 0;
}

// kGeneral: soft-capping and dropout (its Softmax, BwdSoftmaxGradSm90, whose constants the kernel holds);
// kSplitHeadDim (the traits): the GEMMs' split and dQ by atomics. The masks are the Mask argument's (BwdMaskSm90),
// the schedule the Scheduler's; dK and dV accumulate in the kernel's registers (acc_dk, acc_dv).
template <class Traits, bool kGeneral>
struct BwdConsumerSm90 {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kMmaThreads = Traits::kMmaThreads;
  static constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
  // The dropout mask of a tile (bit mi * kCols + ni, 1: kept) is drawn while the tensor cores are busy: one tile
  // ahead, during the previous tile's dV, dK and dQ GEMMs (kDropoutDrawAhead), or during the tile's own dP GEMM.
  static constexpr bool kDrawAhead = Traits::kDropoutDrawAhead;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  using TiledMmaSdP = typename Traits::TiledMmaSdP;
  using TiledMmadKV = typename Traits::TiledMmadKV;
  using TiledMmadQ = typename Traits::TiledMmadQ;
  using Softmax = BwdSoftmaxGradSm90<Traits, kGeneral>;

  // ---- Types of the views, fragments and copies below (each named by what it is built from) ----
  template <class T, class Layout>
  using SmemTensor = decltype(cute::make_tensor(cute::make_smem_ptr(static_cast<T*>(nullptr)), Layout{}));
  // A shared-memory view written from registers (sdSt, sPtW, the dQ staging).
  template <class T, class Layout>
  using SmemTensorW = decltype(cute::as_position_independent_swizzle_tensor(std::declval<SmemTensor<T, Layout>>()));
  template <class TiledMma>
  using ThrMma = decltype(std::declval<TiledMma&>().get_thread_slice(0));
  template <class TiledMma, class Smem>
  using FragA = decltype(std::declval<ThrMma<TiledMma>&>().partition_fragment_A(std::declval<Smem&>()));
  template <class TiledMma, class Smem>
  using FragB = decltype(std::declval<ThrMma<TiledMma>&>().partition_fragment_B(std::declval<Smem&>()));
  using SmemQ = SmemTensor<Element, typename Traits::SmemLayoutQ>;
  using SmemQt = SmemTensor<Element, typename Traits::SmemLayoutQt>;
  using SmemK = SmemTensor<Element, typename Traits::SmemLayoutK>;
  using SmemKt = SmemTensor<Element, typename Traits::SmemLayoutKt>;
  using SmemdS = SmemTensor<Element, typename Traits::SmemLayoutdS>;
  using SmemPdSt = SmemTensor<Element, typename Traits::SmemLayoutPdSt>;
  using FragPdSt = decltype(split_head_dim_fragment_a<kSplitHeadDim>(std::declval<ThrMma<TiledMmadKV>&>(),
                                                                      std::declval<SmemPdSt&>()));
  using AccdKV = decltype(cute::partition_fragment_C(std::declval<TiledMmadKV&>(),
                                                     cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using CoordS = decltype(std::declval<ThrMma<TiledMmaSdP>&>().partition_C(
      cute::make_identity_tensor(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{})));
  using CoordSRowCol = decltype(cute::make_tensor(std::declval<CoordS&>().data(),
                                                  gmma_acc_rowcol(std::declval<CoordS&>().layout())));
  using CopydS = decltype(cute::make_tiled_copy_C(cute::Copy_Atom<cute::UniversalCopy<uint32_t>, Element>{},
                                                  std::declval<TiledMmaSdP&>()));
  using CopydQ = decltype(cute::make_tiled_copy_C(cute::Copy_Atom<cute::UniversalCopy<uint64_t>, float>{},
                                                  std::declval<TiledMmadQ&>()));
  template <class TiledCopy>
  using ThrCopy = decltype(std::declval<TiledCopy&>().get_thread_slice(0));
  using StageddQ = decltype(std::declval<ThrCopy<CopydQ>&>().partition_D(
      std::declval<SmemTensorW<float, typename Traits::SmemLayoutdQ>&>()));
  using SmemdQPart = SmemTensor<float, typename Traits::SmemLayoutdQPart>;
  using GmemdQ = decltype(std::declval<typename Traits::TmadQ const&>().get_tma_tensor(
      cute::make_shape(int32_t(0), int32_t(0), int32_t(0))));
  // (key row, query column) inside the S^T tile of each accumulator element; one visibility bit per element.
  static constexpr int kRows = decltype(cute::size<0>(std::declval<CoordSRowCol&>()))::value;
  static constexpr int kCols = decltype(cute::size<1>(std::declval<CoordSRowCol&>()))::value;
  static_assert(kRows * kCols <= 64, "one visibility bit per element");
  using TileBits = std::conditional_t<kRows * kCols <= 32, uint32_t, uint64_t>;  // bit mi * kCols + ni

  const BwdArgsSm90<Traits>& args;
  const int mma_tidx;
  TiledMmaSdP mma_sdp;
  TiledMmadKV mma_dkv;
  TiledMmadQ mma_dq;
  ThrMma<TiledMmaSdP> thr_sdp;
  ThrMma<TiledMmadKV> thr_dkv;
  ThrMma<TiledMmadQ> thr_dq;
  FragA<TiledMmaSdP, SmemK> tSrK;
  FragB<TiledMmaSdP, SmemQ> tSrQ;  // (MMA, MMA_N, MMA_K, stage)
  FragA<TiledMmaSdP, SmemK> tdPrV;
  FragB<TiledMmaSdP, SmemQ> tdPrdO;  // (MMA, MMA_N, MMA_K, stage)
  FragB<TiledMmadKV, SmemQt> tdVrdO;  // (MMA, MMA_N, MMA_K, stage)
  FragB<TiledMmadKV, SmemQt> tdKrQ;   // (MMA, MMA_N, MMA_K, stage)
  FragA<TiledMmadQ, SmemdS> tdQrdS;   // (MMA, MMA_M, MMA_K, buffer)
  FragB<TiledMmadQ, SmemKt> tdQrK;
  FragPdSt tdVsP, tdKsdS;
  CoordSRowCol cS_rc;
  CopydS copy_ds;
  ThrCopy<CopydS> thr_copy_ds;
  // dQ staging: this consumer's part, reduce-added by its first thread.
  const int consumer;
  const bool dq_issuer;
  CopydQ copy_dq;
  ThrCopy<CopydQ> thr_copy_dq;
  StageddQ tdQsdQ;
  SmemdQPart sdQ_part;
  // (query rows, head dim, (split, batch, head)): this CTA's dQ accumulator is its split's, whose first plane
  // (tiles.dq_plane0()) is computed where it is used: held here, it is a register live across the query tiles
  // (d64 general + attn_mask: 8 bytes more spills).
  GmemdQ mdQ;
  // dS^T and the dQ staging are written from registers through views with the swizzle in their layouts (position
  // independent), not in the pointer: a swizzled pointer is computed as an integer, which loses the shared address
  // space and makes the stores generic (ST.E with 64-bit addresses, dQ's 8-byte stores split in two).
  SmemTensorW<Element, typename Traits::SmemLayoutdSt> sdSt;
  // kSplitHeadDim: P^T, written like dS^T, and both read by dV's and dK's GEMMs.
  SmemTensorW<Element, typename Traits::SmemLayoutPdSt> sPtW;
  PipelineState read;
  int buffer = 0;  // the dS buffer, alternating per visited tile (across key tiles too: see kDsReady)
  // The dQ tile staged at the end of a step is reduce-added in the next one, after its S^T and dP^T GEMMs
  // are issued: by then its st.shared have completed, so the fence does not wait for them behind the dK
  // GEMM's shared-memory reads (+5-13% at head dim 128, +4-6% at 64).
  int staged_h = -1, staged_m0 = 0;  // staged_h < 0: nothing staged

  template <class Scheduler>
  __device__ __forceinline__ BwdConsumerSm90(const BwdArgsSm90<Traits>& arguments, SharedStorage& shared,
                                             const Scheduler& tiles, int tidx, int consumer_index)
      : args(arguments),
        mma_tidx(tidx),
        thr_sdp(mma_sdp.get_thread_slice(tidx)),
        thr_dkv(mma_dkv.get_thread_slice(tidx)),
        thr_dq(mma_dq.get_thread_slice(tidx)),
        tSrK(thr_sdp.partition_fragment_A(smem<typename Traits::SmemLayoutK>(shared.k.begin()))),
        tSrQ(thr_sdp.partition_fragment_B(smem<typename Traits::SmemLayoutQ>(shared.q.begin()))),
        tdPrV(thr_sdp.partition_fragment_A(smem<typename Traits::SmemLayoutK>(shared.v.begin()))),
        tdPrdO(thr_sdp.partition_fragment_B(smem<typename Traits::SmemLayoutQ>(shared.d_o.begin()))),
        tdVrdO(thr_dkv.partition_fragment_B(smem<typename Traits::SmemLayoutQt>(shared.d_o.begin()))),
        tdKrQ(thr_dkv.partition_fragment_B(smem<typename Traits::SmemLayoutQt>(shared.q.begin()))),
        tdQrdS(thr_dq.partition_fragment_A(smem<typename Traits::SmemLayoutdS>(shared.ds.begin()))),
        tdQrK(thr_dq.partition_fragment_B(smem<typename Traits::SmemLayoutKt>(shared.k.begin()))),
        tdVsP(split_head_dim_fragment_a<kSplitHeadDim>(thr_dkv,
                                                       smem<typename Traits::SmemLayoutPdSt>(p_smem(shared)))),
        tdKsdS(split_head_dim_fragment_a<kSplitHeadDim>(thr_dkv,
                                                        smem<typename Traits::SmemLayoutPdSt>(shared.ds.begin()))),
        cS_rc(coordinates(thr_sdp)),
        thr_copy_ds(copy_ds.get_thread_slice(tidx)),
        consumer(consumer_index),
        dq_issuer(tidx % 128 == 0),
        thr_copy_dq(copy_dq.get_thread_slice(tidx)),
        tdQsdQ(thr_copy_dq.partition_D(cute::as_position_independent_swizzle_tensor(
            smem<typename Traits::SmemLayoutdQ>(shared.dq.begin())))),
        sdQ_part(smem<typename Traits::SmemLayoutdQPart>(
            shared.dq.begin() + consumer_index * cute::cosize_v<typename Traits::SmemLayoutdQPart>)),
        mdQ(arguments.tma_dq.get_tma_tensor(cute::make_shape(int32_t(arguments.s.sq_pad), int32_t(kHeadDim),
                                                             arguments.s.dq_splits * arguments.p.batch *
                                                                 arguments.p.num_heads))),
        sdSt(cute::as_position_independent_swizzle_tensor(smem<typename Traits::SmemLayoutdSt>(shared.ds.begin()))),
        sPtW(cute::as_position_independent_swizzle_tensor(smem<typename Traits::SmemLayoutPdSt>(p_smem(shared)))) {}

  template <class Layout, class T>
  __device__ static __forceinline__ SmemTensor<T, Layout> smem(T* ptr) {
    return cute::make_tensor(cute::make_smem_ptr(ptr), Layout{});
  }
  // kSplitHeadDim: P^T's two buffers in place of the dQ staging.
  __device__ static __forceinline__ Element* p_smem(SharedStorage& shared) {
    return reinterpret_cast<Element*>(shared.dq.begin());
  }
  __device__ static __forceinline__ CoordSRowCol coordinates(ThrMma<TiledMmaSdP>& thr) {
    CoordS cS = thr.partition_C(cute::make_identity_tensor(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}));
    return cute::make_tensor(cS.data(), gmma_acc_rowcol(cS.layout()));
  }

  // A dK or dV accumulator of a key tile (the kernel's: see there).
  __device__ __forceinline__ AccdKV make_accumulator() {
    return cute::partition_fragment_C(mma_dkv, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{});
  }

  template <class Scheduler>
  __device__ __forceinline__ uint32_t draw_keep(const Scheduler& tiles, const Softmax& softmax, const BwdKeyTileSm90& t,
                                                int it) const {
    return softmax.draw_keep(cS_rc, tiles.b, tiles.head(t, it), tiles.query_tile(t, it) * kBlockM, t.n0);
  }

  // Every visited query tile of key tile t (its K and V in shared memory), into acc_dk, acc_dv and the dQ
  // accumulator.
  template <class Mask, class Scheduler>
  __device__ __forceinline__ void run_key_tile(const Scheduler& tiles, const Softmax& softmax, const BwdKeyTileSm90& t,
                                               SharedStorage& shared, Pipeline& pipeline_q, AccdKV& acc_dk,
                                               AccdKV& acc_dv) {
    staged_h = -1, staged_m0 = 0;
    int it = tiles.next_visible(t, 0);
    uint32_t keep_next = kDrawAhead && softmax.has_dropout && it < t.n_iter ? draw_keep(tiles, softmax, t, it) : 0u;
    for (; it < t.n_iter; buffer ^= 1) {
      run_query_tile<Mask>(tiles, softmax, t, it, keep_next, shared, pipeline_q, acc_dk, acc_dv);
      it = tiles.next_visible(t, it + 1);
    }
    if (staged_h >= 0) reduce_add_staged_dq(tiles);  // the key tile's last dQ
    // The staging buffer must outlive the last reduce-add's read; deterministic, the next key tile's
    // reduce-adds into this accumulator must follow this tile's: wait for their writes too.
    if (dq_issuer) {
      if (args.s.deterministic) {
        tma_store_wait_writes();
      } else {
        cute::tma_store_wait<0>();
      }
    }
  }

  // One query tile, iteration it of key tile t; keep_next: its dropout bits if drawn ahead, then the next's.
  template <class Mask, class Scheduler>
  __device__ __forceinline__ void run_query_tile(const Scheduler& tiles, const Softmax& softmax,
                                                 const BwdKeyTileSm90& t, int it,
                                                 uint32_t& keep_next, SharedStorage& shared, Pipeline& pipeline_q,
                                                 AccdKV& acc_dk, AccdKV& acc_dv) {
    using namespace cute;
    const int n0 = t.n0;
    const int h = tiles.head(t, it);
    const int m0 = tiles.query_tile(t, it) * kBlockM;
    uint32_t keep = keep_next;
    uint32_t mask_bits;  // bit mi * kCols + ni
    const bool element_masked = Mask::load_element_mask(tiles, h, m0, n0, cS_rc, mma_tidx, mask_bits);
    const int stage = read.index();
    pipeline_q.consumer_wait(read);
    Mask::zero_unseen_query_rows(tiles, shared, stage, m0, mma_tidx);

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    warpgroup_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    warpgroup_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    if (staged_h >= 0) reduce_add_staged_dq(tiles);  // the previous step's dQ
    warpgroup_wait<1>();  // S^T done

    // Invisible entries (tiles across a boundary only) become P = dS = 0 by replacement.
    const TileBits hidden = Mask::template apply<TileBits>(tiles, m0, n0, cS_rc, element_masked, mask_bits);
    if constexpr (kGeneral) {
      if (!kDrawAhead && softmax.has_dropout) keep = draw_keep(tiles, softmax, t, it);  // while dP^T is computed
    }
    softmax.apply(acc_s, acc_dp, cS_rc, hidden, keep, shared.lse2[stage], shared.dvec[stage]);
    Mask::zero_unseen_queries(tiles, shared, stage, cS_rc, hidden, element_masked, mma_tidx);  // segment ids only

    if constexpr (kSplitHeadDim) {
      split_head_dim_gemms(tiles, acc_s, acc_dp, stage, h, m0, acc_dk, acc_dv);
    } else {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      issue_dkv_dq_gemms(acc_s, acc_dp, acc_dq, stage, acc_dk, acc_dv);
      if (kDrawAhead && softmax.has_dropout) {
        const int ahead = tiles.next_visible(t, it + 1);
        if (ahead < t.n_iter) keep_next = draw_keep(tiles, softmax, t, ahead);
      }
      warpgroup_wait<1>();  // dV and dQ done (dK still running)
      copy(copy_dq, thr_copy_dq.retile_S(acc_dq), tdQsdQ);
      staged_h = h, staged_m0 = m0;
    }
    warpgroup_wait<0>();  // dK done: this stage of Q and dO is free
    pipeline_q.consumer_release(read);
    ++read;
  }

  // dV += P^T dO (P^T from registers); dS^T to shared memory for dQ = dS K; then dK += dS^T Q, issued
  // after the dQ GEMM so that it runs while dQ is staged for its reduce-add.
  template <class AccS, class AccdP, class AccdQ>
  __device__ __forceinline__ void issue_dkv_dq_gemms(AccS const& acc_s, AccdP const& acc_dp, AccdQ& acc_dq,
                                                     int stage, AccdKV& acc_dk, AccdKV& acc_dv) {
    using namespace cute;
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tdVrP = make_tensor(rP.data(), gmma_acc_as_a_operand(rP.layout()));
    warpgroup_gemm<false>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), acc_dv);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    copy(copy_ds, thr_copy_ds.retile_S(rdS), thr_copy_ds.partition_D(sdSt(_, _, buffer)));
    cutlass::arch::fence_view_async_shared();
    if (dq_issuer) tma_store_wait<0>();  // the previous tile's dQ reduce-add has read the staging buffer
    named_sync(kMmaThreads, BwdSm90Barrier::kDsReady);

    // dQ_tile = dS K (unscaled: the conversion kernel applies the scale), then into the accumulator.
    warpgroup_gemm<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrK, acc_dq);
    Tensor tdKrdS = make_tensor(rdS.data(), gmma_acc_as_a_operand(rdS.layout()));
    warpgroup_gemm<false>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), acc_dk);
  }

  // kSplitHeadDim: P^T and dS^T to shared memory (each warpgroup its query columns); once both are there,
  // dQ = dS K (issued first, so that its atomics run under the others), dV += P^T dO and dK += dS^T Q.
  template <class Scheduler, class AccS, class AccdP>
  __device__ __forceinline__ void split_head_dim_gemms(const Scheduler& tiles, AccS const& acc_s,
                                                       AccdP const& acc_dp, int stage, int h, int m0,
                                                       AccdKV& acc_dk, AccdKV& acc_dv) {
    using namespace cute;
    const FlashBwdParams& p = args.p;
    const BwdScratch& s = args.s;
    Tensor rP = convert_fragment<Element>(acc_s);
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
        make_gmem_ptr(s.dq_accum +
                      (int64_t(tiles.dq_plane0() + tiles.b * p.num_heads + h) * s.sq_pad + m0) * kHeadDim),
        Shape<Int<kBlockM>, Int<kHeadDim>>{}, Stride<Int<kHeadDim>, _1>{});
    Tensor tdQgdQ = thr_dq.partition_C(gdQ);
    atomic_add_dq(acc_dq, tdQgdQ);
  }

  // The dQ part staged by the previous step, added to the accumulator by one TMA reduce-add.
  template <class Scheduler>
  __device__ __forceinline__ void reduce_add_staged_dq(const Scheduler& tiles) {
    using namespace cute;
    cutlass::arch::fence_view_async_shared();
    named_sync(128, BwdSm90Barrier::kdQStaged, consumer);
    if (dq_issuer) {
      constexpr int kPartRows = Traits::kdQPartRows;
      Tensor gdQ = local_tile(mdQ(_, _, tiles.dq_plane0() + tiles.b * args.p.num_heads + staged_h),
                              Shape<Int<kPartRows>, Int<Traits::kdQPartCols>>{},
                              Traits::kdQSplitRows ? make_coord(staged_m0 / kPartRows + consumer, 0)
                                                   : make_coord(staged_m0 / kPartRows, consumer));
      auto dq_parts = tma_partition(args.tma_dq, _0{}, Layout<_1>{}, group_modes<0, 2>(sdQ_part),
                                    group_modes<0, 2>(gdQ));
      copy(args.tma_dq, get<1>(dq_parts), get<0>(dq_parts));  // (gmem, smem) parts: smem -> gmem
      tma_store_arrive();
    }
    staged_h = -1;
  }
};

}  // namespace cuda
}  // namespace tf_flash
