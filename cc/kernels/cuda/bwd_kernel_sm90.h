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
// dropout_keep_bits_transposed) and the skipping of False blocks. The element-mask variants (kElementMask, each
// plain and general) add attn_mask, packed to a bit per entry before the kernel (packed_mask.h): query tiles it
// hides whole are skipped, tiles it hides in part are masked by the packed bits; or packed-document segment ids:
// each key tile visits the query tiles of its documents only, and among them a table (made per key tile from
// mask.h's block_coverage on the segment bounds) skips those sharing no document, runs those inside one document
// unmasked and masks the borders by q_id[row] == kv_id[col].
// Visibility is mask.h's (causal, window, lengths, attn_mask, segment ids, and block masks whose blocks hold whole
// tiles): query tiles that see no key of the tile are never visited, tiles that straddle a boundary are masked per
// element (by replacement: P = dS = 0). Keys no valid query sees and query rows past q_len are zeroed in shared
// memory (0 x NaN must not reach a GEMM), and with segment ids the Q and dO rows no key of a border tile sees.
// Other block masks, and segment ids with attn_mask or a block mask, run in the sm_80 family (family.cu chooses).
//
// The kernel below only sets up the shared storage, the barriers and the pipelines and composes the parts, each
// in its own header: the traits, arguments and named barriers (sm90_bwd_traits.h); the schedule, which key tiles
// a CTA runs and which query tiles each visits (BwdSchedulerSm90, sm90_bwd_scheduler.h); the producer's TMA loads
// (BwdMainloopSm90, sm90_bwd_mainloop.h); the mask, hidden entries of S^T and zeroed rows in shared memory
// (BwdMaskSm90, sm90_bwd_mask.h); the consumers' GEMMs and dQ (BwdConsumerSm90, sm90_bwd_consumer.h) with their
// element-wise P^T and dS^T (BwdSoftmaxGradSm90, sm90_bwd_softmax.h); and the dK, dV stores (BwdEpilogueSm90,
// sm90_bwd_epilogue.h). A new variant (another element mask, say) is a template argument of the parts it changes
// only: a new visibility rule goes to the mask (and to the scheduler where it skips tiles), a new element-wise term
// to BwdSoftmaxGradSm90, a new split of the GEMMs to the traits and the consumer. Segment ids are the example: the
// scheduler narrows and tables the query tiles, the mask compares the ids and zeroes the unseen query rows.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/sm90_bwd_consumer.h"
#include "cc/kernels/cuda/sm90_bwd_epilogue.h"
#include "cc/kernels/cuda/sm90_bwd_mainloop.h"
#include "cc/kernels/cuda/sm90_bwd_mask.h"
#include "cc/kernels/cuda/sm90_bwd_scheduler.h"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/cuda/sm90_common.cuh"

namespace tf_flash {
namespace cuda {

// kGeneral: soft-capping, dropout and block masks (run-time switches inside), kept out of the plain
// variant's registers; kElementMask: attn_mask or segment ids, with either (their code and registers kept out of
// the others').
template <class Traits, bool kGeneral, ElementMask kElementMask = ElementMask::kNone>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_dkdv_kernel_sm90(const __grid_constant__ BwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Scheduler = BwdSchedulerSm90<Traits, kGeneral, kElementMask>;
  using Mainloop = BwdMainloopSm90<Traits>;
  using Mask = BwdMaskSm90<Traits, kElementMask>;
  using Consumer = BwdConsumerSm90<Traits, kGeneral>;
  using Epilogue = BwdEpilogueSm90<Traits>;
  using Pipeline = typename Traits::Pipeline;
  using PipelineKV = typename Traits::PipelineKV;
  constexpr int kMmaThreads = Traits::kMmaThreads;

  extern __shared__ __align__(1024) char smem_buf[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const Scheduler tiles(args.p, args.s, smem_buf);

  const int warp_group = int(threadIdx.x) / 128;
  if (threadIdx.x == 0) Mainloop::prefetch_descriptors(args);
  PipelineKV pipeline_kv(shared.pipeline_kv, tma_pipeline_params<PipelineKV>(Traits::kTmaBytesKV, kMmaThreads),
                         cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipeline_q(shared.pipeline_q, tma_pipeline_params<Pipeline>(Traits::kTmaBytesQdO, kMmaThreads),
                      cute::Shape<cute::_1, cute::_1, cute::_1>{});
  __syncthreads();  // barriers initialized

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x == 0) Mainloop::load(args, tiles, shared, pipeline_kv, pipeline_q);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
    const int mma_tidx = int(threadIdx.x) - 128;
    Consumer consumer(args, shared, tiles, mma_tidx, warp_group - 1);
    // The key tile's dK and dV, apart from the consumer's state: the compiler keeps a local object in registers
    // only once every access to it is at a known offset, which for these arrays is after their loops are
    // unrolled; inside the consumer they would hold its scalars back with them (the plain d64 kernel: 20 bytes
    // of spills with them inside, 8 outside). The element-wise step's constants are apart too (inside, the
    // compiler computed dropout's threshold twice).
    typename Consumer::AccdKV acc_dk = consumer.make_accumulator();
    typename Consumer::AccdKV acc_dv = consumer.make_accumulator();
    const typename Consumer::Softmax softmax(args.p);
    typename PipelineKV::PipelineState read_kv;
    for (int n_block = tiles.first_key_tile(); n_block < tiles.num_key_tiles; n_block = tiles.next_key_tile(n_block)) {
      const BwdKeyTileSm90 t = tiles.key_tile(n_block);
      cute::clear(acc_dk);
      cute::clear(acc_dv);
      if (t.n_iter > 0) {
        Mask::make_tile_table(tiles, shared, t, mma_tidx);  // segment ids only
        pipeline_kv.consumer_wait(read_kv);
        Mask::zero_unseen_keys(tiles, shared, t.n0, mma_tidx);
        consumer.template run_key_tile<Mask>(tiles, softmax, t, shared, pipeline_q, acc_dk, acc_dv);
        pipeline_kv.consumer_release(read_kv);  // the dQ GEMMs have read K: the producer may load the next tile
        ++read_kv;
      }
      Epilogue::store(args.p, tiles.b, tiles.h_kv, t.n0, consumer.thr_dkv, acc_dk, acc_dv);
    }
  }
#endif
}

}  // namespace cuda
}  // namespace tf_flash
