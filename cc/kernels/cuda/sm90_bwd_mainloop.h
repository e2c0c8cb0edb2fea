// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) producer: one thread of warpgroup 0 brings, per key tile
// of the schedule (sm90_bwd_scheduler.h), K and V once (a one-stage ring: the consumers release it when the key
// tile's last dQ GEMM has read K), then for every visited (query head, query tile) Q and dO, and the rows' lse2
// and D (bulk copies), through a two-stage TMA ring (cutlass::PipelineTmaAsync).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/sm90_bwd_traits.h"

namespace tf_flash {
namespace cuda {

template <class Traits>
struct BwdMainloopSm90 {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;
  using PipelineKV = typename Traits::PipelineKV;
  using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;

  // By the thread that issues the copies, before the pipelines are set up.
  __device__ static __forceinline__ void prefetch_descriptors(const BwdArgsSm90<Traits>& args) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
  }

  // Per key tile K and V, then Q and dO of every visited (query head, query tile). One thread.
  template <class Scheduler>
  __device__ static __forceinline__ void load(const BwdArgsSm90<Traits>& args, const Scheduler& tiles,
                                              SharedStorage& shared, PipelineKV& pipeline_kv, Pipeline& pipeline_q) {
    using namespace cute;
    const FlashBwdParams& p = args.p;
    Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch));
    Tensor mV = args.tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim_v, p.num_heads_kv, p.batch));
    Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.num_heads, p.batch));
    Tensor mdO = args.tma_do.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch));
    typename PipelineKV::PipelineState write_kv = cutlass::make_producer_start_state<PipelineKV>();
    typename Pipeline::PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    for (int n_block = tiles.first_key_tile(); n_block < tiles.num_key_tiles; n_block = tiles.next_key_tile(n_block)) {
      const BwdKeyTileSm90 t = tiles.key_tile(n_block);
      if (t.n_iter == 0) continue;  // the consumers skip it too
      load_kv(args, tiles, shared, mK, mV, n_block, pipeline_kv, write_kv);
      for (int it = tiles.next_to_load(t, 0); it < t.n_iter; it = tiles.next_to_load(t, it + 1)) {
        load_query_tile(args, tiles, shared, mQ, mdO, tiles.head(t, it), tiles.query_tile(t, it), pipeline_q, write);
      }
    }
  }

  // K and V of key tile n_block, once the consumers are done with the previous key tile's.
  template <class Scheduler, class TensorK, class TensorV, class State>
  __device__ static __forceinline__ void load_kv(const BwdArgsSm90<Traits>& args, const Scheduler& tiles,
                                                 SharedStorage& shared, TensorK const& mK, TensorV const& mV,
                                                 int n_block, PipelineKV& pipeline_kv, State& write_kv) {
    using namespace cute;
    Tensor sK = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutK{});
    Tensor gK = local_tile(mK(_, _, tiles.h_kv, tiles.b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, _0{}));
    Tensor gV = local_tile(mV(_, _, tiles.h_kv, tiles.b), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, _0{}));
    auto k_parts = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    pipeline_kv.producer_acquire(write_kv);  // the consumers are done with the previous key tile's K and V
    BarrierType& kv_full = *pipeline_kv.producer_get_barrier(write_kv);
    copy(args.tma_k.with(kv_full), get<0>(k_parts), get<1>(k_parts));
    copy(args.tma_v.with(kv_full), get<0>(v_parts), get<1>(v_parts));
    ++write_kv;
  }

  // Q, dO, lse2 and D of query tile m_tile of head h into the next free stage.
  template <class Scheduler, class TensorQ, class TensordO, class State>
  __device__ static __forceinline__ void load_query_tile(const BwdArgsSm90<Traits>& args, const Scheduler& tiles,
                                                         SharedStorage& shared, TensorQ const& mQ, TensordO const& mdO,
                                                         int h, int m_tile, Pipeline& pipeline_q, State& write) {
    using namespace cute;
    const FlashBwdParams& p = args.p;
    const BwdScratch& s = args.s;
    const int b = tiles.b;
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.d_o.begin()), typename Traits::SmemLayoutQ{});
    Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_tile, _0{}));
    Tensor gdO = local_tile(mdO(_, _, h, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_tile, _0{}));
    auto q_parts = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto do_parts = tma_partition(args.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
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
};

}  // namespace cuda
}  // namespace tf_flash
