// The Hopper forward's epilogue, per consumer: O normalized and lse written, then O through shared memory to
// this consumer's TMA store (its 64 rows), which overlaps the next tile's work.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_fwd_scheduler.h"
#include "cc/kernels/cuda/sm90_fwd_traits.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace cuda {

template <class Traits>
struct FwdEpilogueSm90 {
  using OutElement = typename Traits::OutElement;
  static constexpr int kHeadDim = Traits::kHeadDim;

  const FlashFwdParams& p;
  typename Traits::SharedStorage& shared;
  const int mma_tidx;
  const int wg;
  const bool output_leader;  // issues this consumer's TMA stores of O

  __device__ __forceinline__ FwdEpilogueSm90(const FlashFwdParams& p, typename Traits::SharedStorage& shared,
                                             int mma_tidx, int wg)
      : p(p), shared(shared), mma_tidx(mma_tidx), wg(wg), output_leader(mma_tidx % 128 == 0) {}

  // Before a tile with work waits for its Q, where O goes through Q's buffer (no kOwnOutputBuffer): O of the
  // tiles before, in Q's buffer, read out by their stores: the producer may load this tile's Q. (Arriving here
  // rather than after the epilogue keeps the epilogues of tiles without work, which write to the buffer too,
  // before the next Q; a first tile without work, too, which the producer waits for.)
  __device__ __forceinline__ void free_q_buffer(int wave) {
    if constexpr (!Traits::kOwnOutputBuffer) {
      if (wave > 0) {
        if (output_leader) cute::tma_store_wait<0>();
        named_sync(128, Sm90Barrier::kOutputWg0, wg);
        shared.barrier_q_free.arrive();
      }
    }
  }

  // output_scale: the factor of O after the softmax's normalization (FwdConsumerSm90::output_scale). batch_head:
  // the row of lse (and, with split-KV, of the runs' outputs: split_entry).
  // Normalize, lse, then O (tOrO, this consumer's accumulator of wave `wave`'s tile w) through shared memory to
  // this consumer's TMA store. cS_rc: the score tile's coordinates of the accumulator's rows. tma_o comes with
  // each call (the kernel's argument) rather than kept here: kept, its address is computed once and held in
  // registers through the whole tile (8 bytes more spills in the attn_mask variant at head dim 128).
  template <class FragO, class Softmax, class CoordRC, class TiledMmaPV>
  __device__ __forceinline__ void store(const typename Traits::TmaO& tma_o, FragO& tOrO, const Softmax& softmax,
                                        const CoordRC& cS_rc, const TiledMmaPV& mma_pv, const FwdTileWork& w,
                                        uint64_t batch_head, float scale_log2, float output_scale, int wave) {
    using namespace cute;
    Tensor o_rc = make_tensor(tOrO.data(), gmma_acc_rowcol(tOrO.layout()));
    normalize_and_write_lse(o_rc, softmax, cS_rc, p, w.m0, w.q_len, batch_head, scale_log2, output_scale);
    if (wave > 0) {  // the previous tile's store has read this consumer's rows of sO
      if (output_leader) tma_store_wait<0>();
      named_sync(128, Sm90Barrier::kOutputWg0, wg);
    }
    Tensor sO = make_tensor(make_smem_ptr(output_buffer()), typename Traits::SmemLayoutO{});
    Tensor rO = convert_fragment<OutElement>(tOrO);
    auto smem_copy_o = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, OutElement>{}, mma_pv);
    auto smem_thr_copy_o = smem_copy_o.get_thread_slice(mma_tidx);
    copy(smem_copy_o, smem_thr_copy_o.retile_S(rO), smem_thr_copy_o.partition_D(sO));
    cutlass::arch::fence_view_async_shared();  // visible to the TMA (async proxy)
    named_sync(128, Sm90Barrier::kOutputWg0, wg);
    if (output_leader) {
      Tensor mO = tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch * p.num_splits));
      Tensor gO = local_tile(mO(_, _, w.h, int(split_entry(p, w.split, w.b))), Shape<_64, Int<kHeadDim>>{},
                             make_coord(Traits::kMmaWarpGroups * w.m_block + wg, _0{}));
      Tensor sO_rows = local_tile(sO, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, _0{}));
      auto o_parts = tma_partition(tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO_rows), group_modes<0, 2>(gO));
      copy(tma_o, get<1>(o_parts), get<0>(o_parts));
      tma_store_arrive();
    }
  }

  __device__ __forceinline__ typename Traits::OutElement* output_buffer() const {
    if constexpr (Traits::kOwnOutputBuffer) {
      return shared.o.begin();
    } else {
      return shared.q.begin();  // the same type (FwdTraitsSm90 asserts it)
    }
  }

  // After the last tile: shared memory stays until the last store has read it.
  __device__ __forceinline__ void finish() {
    if (output_leader) cute::tma_store_wait<0>();
  }
};

}  // namespace cuda
}  // namespace tf_flash
