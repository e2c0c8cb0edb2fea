// Hopper (sm_90a) forward kernel, tf_flash's second CUDA family (FlashAttention-3's design, our code):
// a persistent CTA per SM runs query tiles (64 x kMmaWarpGroups rows of one head and batch) one after another
// (FwdScheduleSm90) with a producer warpgroup and two or three consumer warpgroups. The producer (one thread
// of warpgroup 0) brings each tile's Q and the visible K/V tiles into a ring of kStages shared-memory stages
// with the bulk tensor copy engine (TMA), each stage guarded by mbarriers (cutlass::PipelineTmaAsync); it keeps
// 24 registers so that the consumers get the rest (setmaxnreg). Each consumer owns 64 query rows and runs
// wgmma: S = Q K^T from shared memory, O += P V with P from registers. Inside a warpgroup the softmax of tile
// j overlaps the P V GEMM of tile j + 1 (tiles run from the last key tile down; where the registers allow, P
// alternates between two register buffers so that nothing waits for that GEMM before the softmax); between the
// warpgroups named barriers take turns issuing GEMMs (ping-pong, round robin with three), so that one's softmax
// runs while another's GEMMs do. Each consumer's O leaves through shared memory by TMA store while the next tile
// starts.
//
// Visibility is mask.h's, as in the sm_80 family: causal, window, lengths, GQA/MQA, Dv != D, any sequence
// lengths (TMA zero-fills past the tensor's end). The general variant (kGeneral) adds soft-capping,
// dropout (the sm_80 family's Philox draws: a wgmma accumulator holds, per warp, the m16n8 pattern of
// mma.sync, so the same positions get the same draws and the sm_80 backward recomputes the same mask),
// block masks whose blocks hold whole tiles (family.cu's hopper_forward_takes). attn_mask, packed to a
// bit per entry before the kernel (packed_mask.h), and packed-document segment ids have variants of their own
// (kElementMask, each plain and general). Finer blocks, and attn_mask with segment ids, run in the sm_80 family
// (family.cu chooses, at run time).
//
// The kernel below only sets up the shared storage, the barriers and the pipelines and composes the parts, each
// in a header of its own: sm90_fwd_traits.h (FwdTraitsSm90: tiles, layouts, TMA copies, shared storage; the named
// barriers), sm90_fwd_scheduler.h (which tile a CTA runs in each wave), sm90_fwd_mainloop.h (the producer's TMA
// loads), sm90_fwd_mask.h (which key tiles run, the scores and value rows they hide: tile table, element-mask bits,
// mask.h's rules), sm90_fwd_consumer.h (S = Q K^T, softmax, dropout, P V and their loops) and
// sm90_fwd_epilogue.h (normalize, lse, O's TMA store). A new variant (another element mask, say) is a template argument of
// the parts it changes, most often the mask alone, passed down from the kernel's. The parts the consumers run hold
// copies, or references to the params and the shared storage, never to the kernel's local objects, and take the
// params and tma_o as arguments where holding them cost registers (each part says what it measured): registers and
// spills stay the unsplit kernel's.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_fwd_consumer.h"
#include "cc/kernels/cuda/sm90_fwd_epilogue.h"
#include "cc/kernels/cuda/sm90_fwd_mainloop.h"
#include "cc/kernels/cuda/sm90_fwd_mask.h"
#include "cc/kernels/cuda/sm90_fwd_scheduler.h"
#include "cc/kernels/cuda/sm90_fwd_traits.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// Kernel arguments: the params, the TMA descriptors (built on the host: they hold the pointers) and the
// schedule.
template <class Traits>
struct FwdArgsSm90 {
  FlashFwdParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;
  FwdScheduleSm90 schedule;
};

// kGeneral: soft-capping, dropout and block masks (run-time switches inside), kept out of the plain variant's
// registers; kElementMask (128-row tiles): attn_mask or segment ids, with either, kept out of both others' (the
// exact zeroing of value rows cost the general variant 16-28 bytes of spills at head dim 128). Segment ids skip
// and show key tiles by their bounds (the tile table over the query tile's documents) and compare ids only in
// the tiles where a document begins or ends.
//
// Persistent: each CTA runs the query tiles args.schedule gives it, one after another. The K/V ring, the
// ping-pong turns and Q's barrier carry on from tile to tile, so the producer loads the next tile's first K
// (and, once the consumers are done with Q, its Q) while the consumers finish a tile, and a tile's O store
// overlaps the next tile's work. With a tile table (block masks, element masks) the launcher gives each CTA one
// tile (the table is made before the roles split).
template <class Traits, bool kGeneral, ElementMask kElementMask = ElementMask::kNone>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel_sm90(const __grid_constant__ FwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename Traits::Pipeline;
  using Mask = FwdMaskSm90<Traits, kGeneral, kElementMask>;
  using Consumer = FwdConsumerSm90<Traits, kGeneral, kElementMask>;
  constexpr int kMmaThreads = Traits::kMmaThreads;

  extern __shared__ __align__(1024) char smem_buf[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const FlashFwdParams& p = args.p;
  // The element-mask variants always have a tile table, so one tile per CTA.
  const FwdTileSchedulerSm90<Traits, kElementMask != ElementMask::kNone> scheduler(args.schedule, p);
  const Mask mask(p, smem_buf);
  FwdTileWork first;
  if (mask.has_table && scheduler.tile_work(0, first)) {
    if constexpr (kElementMask == ElementMask::kSegments)
      Mask::make_segment_tile_table(p, first, mask.tile_state, mask.document_tiles());
    else
      Mask::make_tile_table(p, first, mask.has_block_mask, mask.has_element_mask, mask.tile_state);
  }

  const int warp_group = int(threadIdx.x) / 128;
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_o.get_tma_descriptor());
    shared.barrier_q.init(1);
    shared.barrier_q_free.init(kMmaThreads);
  }
  const auto pipeline_params = tma_pipeline_params<Pipeline>(Traits::kTmaBytesKV, kMmaThreads);
  Pipeline pipeline_k(shared.pipeline_k, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipeline_v(shared.pipeline_v, pipeline_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  __syncthreads();  // barriers and the tile table initialized

  if (warp_group == 0) {
    // Producer: one thread of warpgroup 0 (setmaxnreg gives the consumers the registers).
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    FwdMainloopSm90<Traits>{p, args.tma_q, args.tma_k, args.tma_v, shared, pipeline_k, pipeline_v}.run(scheduler,
                                                                                                        mask);
  } else {
    // Consumers: the other branch of this if/else (setmaxnreg moves registers between branches).
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
    const int mma_tidx = int(threadIdx.x) - 128;
    const int wg = warp_group - 1;
    // The ping-pong (FwdConsumerSm90): warpgroup 0 issues first.
    if (wg == 0) named_arrive(Consumer::kIssueThreads, Sm90Barrier::kIssueWg0, 0);
    Consumer consumer(p, shared, pipeline_k, pipeline_v, mma_tidx, wg);
    FwdEpilogueSm90<Traits> epilogue(p, shared, mma_tidx, wg);
    FwdTileWork w;
    for (int wave = 0; scheduler.next(wave, w); ++wave) {
      mask.narrow_to_documents(w);
      typename Consumer::Tile tile(w, mask, p);
      const typename Mask::template QueryTile<typename Consumer::CoordRC> tile_mask(mask, p, w, consumer.cS_rc);
      consumer.begin_tile(w);
      if (tile.has_work()) {
        epilogue.free_q_buffer(wave);
        consumer.run(tile, tile_mask);
      }
      const uint64_t out_batch_head = uint64_t(split_entry(p, w.split, w.b)) * p.num_heads + w.h;
      epilogue.store(args.tma_o, tile.tOrO, tile.softmax, consumer.cS_rc, consumer.mma_pv, w, out_batch_head,
                     consumer.scale_log2, consumer.output_scale(w), wave);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace cuda
}  // namespace tf_flash
