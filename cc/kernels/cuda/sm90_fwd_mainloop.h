// The Hopper forward's producer warpgroup: one thread's TMA loads of each query tile's Q and of the K and V tiles
// its rows see into the pipelines' shared-memory stages (FwdMainloopSm90), and, for fp8, three warps that transpose
// each V stage into V^T's (FwdValueTransposeSm90).
#pragma once

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/sm90_fwd_scheduler.h"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// One thread issues every copy; K of tile j goes out before V of tile j + 1, the order in which the consumers
// need them. Q has a barrier of its own (barrier_q), and barrier_q_free tells when its buffer is free again.
template <class Traits>
struct FwdMainloopSm90 {
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  const FlashFwdParams& p;
  const typename Traits::TmaQ& tma_q;
  const typename Traits::TmaK& tma_k;
  const typename Traits::TmaV& tma_v;
  typename Traits::SharedStorage& shared;
  Pipeline& pipeline_k;
  Pipeline& pipeline_v;

  // The loads of every tile the scheduler gives this CTA, with the key tiles `mask` keeps.
  template <class Scheduler, class Mask>
  __device__ __forceinline__ void run(const Scheduler& scheduler, const Mask& mask) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{});
    Tensor mQ = tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.num_heads, p.batch));
    Tensor mK = tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch));
    using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    // Before a Q load, the consumers' next phase of barrier_q_free: they arrive once per tile with work that
    // follows a use of Q's buffer (a tile with work; without kOwnOutputBuffer, any earlier tile, whose O went
    // through that buffer), and cannot arrive again before the Q that follows is here, so no phase completes unseen.
    int q_free_waits = 0;
    bool q_buffer_used = false;
    FwdTileWork w;
    for (int wave = 0; scheduler.next(wave, w); ++wave) {
      mask.narrow_to_documents(w);
      const int n_block_min = w.keys.tile_begin;
      const int n_first = mask.next_tile(w.keys.tile_end, n_block_min);
      const bool has_work = n_first >= n_block_min;
      Tensor gQ = local_tile(mQ(_, _, w.h, w.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
      Tensor gK = local_tile(mK(_, _, w.h_kv, w.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      // (TMA) for Q, (TMA, tile) and (TMA, stage) for K and V: the copy engine moves a whole mode 0.
      auto q_parts = tma_partition(tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = [&] {
        if constexpr (Traits::kTransposeV) {  // V's rows, as K's, into the stages the transposing warps read
          Tensor sV = make_tensor(make_smem_ptr(shared.v_rows.begin()), typename Traits::SmemLayoutVRows{});
          Tensor mV = tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim_v, p.num_heads_kv, p.batch));
          Tensor gV = local_tile(mV(_, _, w.h_kv, w.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
          return tma_partition(tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        } else {  // V seen transposed, (head dim, key), straight into the consumers' stages
          Tensor sVt = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutVt{});
          Tensor mVt = tma_v.get_tma_tensor(make_shape(p.head_dim_v, p.seqlen_k, p.num_heads_kv, p.batch));
          Tensor gVt = local_tile(mVt(_, _, w.h_kv, w.b), Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));
          return tma_partition(tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
        }
      }();
      auto load_k = [&](int n) {
        pipeline_k.producer_acquire(write);
        copy(tma_k.with(*pipeline_k.producer_get_barrier(write)), get<0>(k_parts)(_, n),
             get<1>(k_parts)(_, write.index()));
      };
      auto load_v = [&](int n, PipelineState state) {
        pipeline_v.producer_acquire(state);
        copy(tma_v.with(*pipeline_v.producer_get_barrier(state)), get<0>(v_parts)(_, n),
             get<1>(v_parts)(_, state.index()));
      };
      if (!has_work) {
        q_buffer_used |= !Traits::kOwnOutputBuffer;  // its epilogue writes zeros to O through Q's buffer
        continue;
      }
      int n = n_first;
      load_k(n);  // as soon as a stage is free: before the consumers are done with the last Q
      if (q_buffer_used) shared.barrier_q_free.wait(q_free_waits++ % 2);
      q_buffer_used = true;
      shared.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
      copy(tma_q.with(reinterpret_cast<BarrierType&>(shared.barrier_q)), get<0>(q_parts), get<1>(q_parts));
      PipelineState write_v = write;
      ++write;
      for (int next = mask.next_tile(n, n_block_min); next >= n_block_min;
           n = next, next = mask.next_tile(n, n_block_min)) {
        load_k(next);
        load_v(n, write_v);
        write_v = write;
        ++write;
      }
      load_v(n, write_v);
    }
  }
};

// fp8 (Traits::kTransposeV): warps 1-3 of the producer warpgroup turn each V stage the TMA filled (key rows, head
// dim contiguous) into V^T's stage (head-dim rows, keys contiguous in fp8_value_key_of_slot's order), which the
// consumers read through pipeline_vt. Per 16 keys x 32 head dims, one ldmatrix.trans (as 16-bit pairs) gives a
// thread the bytes of keys 2q, 2q + 1 (and 8 more) at head dims 2r, 2r + 1, exactly the 4 keys of slots 4q .. 4q + 3
// (fp8_value_key_of_slot): two byte permutes make V^T rows 2r and 2r + 1, and one stmatrix writes them. In place of
// a V^T pass before the kernel, which read and wrote V once more per call (most of the memory traffic of a decoding
// step).
template <class Traits>
struct FwdValueTransposeSm90 {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kWarps = Traits::kTransposeThreads / 32;
  // (16 keys, 32 head dims) blocks of a stage: one ldmatrix.x4 and one stmatrix.x4 each.
  static constexpr int kKeyGroups = kBlockN / 16, kDimGroups = kHeadDim / 32, kBlocks = kKeyGroups * kDimGroups;
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "whole 16 x 32 blocks");

  typename Traits::SharedStorage& shared;
  Pipeline& pipeline_v;
  Pipeline& pipeline_vt;

  // The same key tiles as FwdMainloopSm90::run loads V for, in the same order.
  template <class Scheduler, class Mask>
  __device__ __forceinline__ void run(const Scheduler& scheduler, const Mask& mask) {
    using namespace cute;
    Tensor sV = make_tensor(make_smem_ptr(shared.v_rows.begin()), typename Traits::SmemLayoutVRows{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutVt{});
    const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32) - 1;  // warps 1-3
    // ldmatrix: lanes 8i .. 8i + 7 address matrix i's 8 rows: keys +8 for matrices 1 and 3, head dims +16 for 2 and 3.
    const int src_key = lane % 8 + 8 * (lane / 8 % 2), src_dim = 16 * (lane / 16);
    // stmatrix: matrix i holds V^T rows 2r (i even) or 2r + 1 (i odd), r = 0..7, of head dims +16 for i >= 2.
    const int dst_dim = 16 * (lane / 16) + 2 * (lane % 8) + lane / 8 % 2;
    PipelineState read;  // V's stages, as the consumers of pipeline_v
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    FwdTileWork w;
    for (int wave = 0; scheduler.next(wave, w); ++wave) {
      mask.narrow_to_documents(w);
      const int n_block_min = w.keys.tile_begin;
      for (int n = mask.next_tile(w.keys.tile_end, n_block_min); n >= n_block_min; n = mask.next_tile(n, n_block_min)) {
        pipeline_v.consumer_wait(read);
        pipeline_vt.producer_acquire(write);
        Tensor rows = sV(_, _, read.index());
        Tensor rows_t = sVt(_, _, write.index());
#pragma unroll 1  // the 24 registers of the producer warpgroup: one block's addresses live at a time
        for (int block = warp; block < kBlocks; block += kWarps) {
          const int key0 = block / kDimGroups * 16, dim0 = block % kDimGroups * 32;
          uint32_t a0, a1, a2, a3;  // (keys 2q, 2q + 1 | +8) x (head dims 2r, 2r + 1), bytes key-major
          SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const uint128_t*>(&rows(key0 + src_key, dim0 + src_dim)), a0, a1,
                                  a2, a3);
          SM90_U32x4_STSM_N::copy(__byte_perm(a0, a1, 0x6420), __byte_perm(a0, a1, 0x7531),
                                  __byte_perm(a2, a3, 0x6420), __byte_perm(a2, a3, 0x7531),
                                  *reinterpret_cast<uint128_t*>(&rows_t(dim0 + dst_dim, key0)));
        }
        cutlass::arch::fence_view_async_shared();  // the writes visible to the consumers' wgmma (async proxy)
        cutlass::arch::ClusterBarrier::arrive(pipeline_vt.producer_get_barrier(write));  // one of the 96 arrivals
        pipeline_v.consumer_release(read);
        ++read;
        ++write;
      }
    }
  }
};

}  // namespace cuda
}  // namespace tf_flash
