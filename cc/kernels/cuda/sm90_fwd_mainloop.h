// The Hopper forward's producer (warpgroup 0, one thread): the TMA loads of each query tile's Q and of the K and
// V tiles its rows see into the pipelines' shared-memory stages.
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
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutVt{});
    Tensor mQ = tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.num_heads, p.batch));
    Tensor mK = tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch));
    // fp8: V^T's keys padded to whole 16-key groups (kFp8ValueKeyAlign), whose slots are keys in another order.
    const int value_keys = Traits::kFp8 ? int(fp8_value_keys(p)) : p.seqlen_k;
    Tensor mVt = tma_v.get_tma_tensor(make_shape(p.head_dim_v, value_keys, p.num_heads_kv, p.batch));
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
      Tensor gVt = local_tile(mVt(_, _, w.h_kv, w.b), Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));
      // (TMA) for Q, (TMA, tile) and (TMA, stage) for K and V: the copy engine moves a whole mode 0.
      auto q_parts = tma_partition(tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
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

}  // namespace cuda
}  // namespace tf_flash
