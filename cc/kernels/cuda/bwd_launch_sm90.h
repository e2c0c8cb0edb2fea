// Definition of run_bwd_dkdv_sm90: TMA descriptors, grid and variant of the Hopper backward's dK/dV kernel
// (bwd_kernel_sm90.h).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cc/kernels/cuda/bwd_kernel_sm90.h"
#include "cc/kernels/cuda/bwd_launch.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_tile_size.h"

namespace tf_flash {
namespace cuda {

// One instantiation of kernel 2: the TMA descriptors of its tiles, then the grid.
template <class Traits, bool kGeneral, ElementMask kElementMask>
cudaError_t launch_bwd_dkdv_sm90(const FlashBwdParams& p, const BwdScratch& s, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  auto kernel = &bwd_dkdv_kernel_sm90<Traits, kGeneral, kElementMask>;
  BwdArgsSm90<Traits> args;
  args.p = p;
  args.s = s;
  using TileQ = Shape<Int<Traits::kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<Traits::kBlockN>, Int<kHeadDim>>;
  const auto smem_q = take<0, 2>(typename Traits::SmemLayoutQ{});
  auto view = [&](const void* ptr, int rows, int dim, int heads, int64_t row_stride, int64_t head_stride,
                  int64_t batch_stride) {
    return tma_gmem_view<Element>(ptr, rows, dim, heads, p.batch, row_stride, head_stride, batch_stride);
  };
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                             view(p.q, p.seqlen_q, p.head_dim, p.num_heads, p.q_row_stride, p.q_head_stride,
                                  p.q_batch_stride),
                             smem_q, TileQ{}, _1{});
  args.tma_do = make_tma_copy(SM90_TMA_LOAD{},
                              view(p.d_out, p.seqlen_q, p.head_dim_v, p.num_heads, p.o_row_stride, p.o_head_stride,
                                   p.o_batch_stride),
                              smem_q, TileQ{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{},
                             view(p.k, p.seqlen_k, p.head_dim, p.num_heads_kv, p.k_row_stride, p.k_head_stride,
                                  p.k_batch_stride),
                             typename Traits::SmemLayoutK{}, TileK{}, _1{});
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{},
                             view(p.v, p.seqlen_k, p.head_dim_v, p.num_heads_kv, p.v_row_stride, p.v_head_stride,
                                  p.v_batch_stride),
                             typename Traits::SmemLayoutK{}, TileK{}, _1{});
  // dQ accumulator rows of (split, batch, head) (split * batch + b) * num_heads + h start at that times sq_pad.
  args.tma_dq = make_tma_copy(
      SM90_TMA_REDUCE_ADD{},
      make_tensor(make_gmem_ptr(s.dq_accum),
                  make_shape(int32_t(s.sq_pad), int32_t(kHeadDim), s.dq_splits * int32_t(p.batch) * p.num_heads),
                  make_stride(int64_t(kHeadDim), _1{}, s.sq_pad * kHeadDim)),
      typename Traits::SmemLayoutdQPart{}, Shape<Int<Traits::kdQPartRows>, Int<Traits::kdQPartCols>>{}, _1{});
  // Segment ids add the words of a border tile's seen query rows and the table of query tiles after the shared
  // storage (sm90_bwd_mask.h, sm90_bwd_scheduler.h; hopper_backward_takes checked that they fit). The runner
  // computed the ids' bounds before the launch.
  int smem = Traits::kSmemBytes;
  if constexpr (kElementMask == ElementMask::kSegments)
    smem += int(sm90_backward_table_bytes(Traits::kBlockM, p.seqlen_q));
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int num_key_tiles = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const dim3 grid(bwd_dkdv_ctas(s, num_key_tiles), p.num_heads_kv, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

template <class Element, int kHeadDim>
cudaError_t run_bwd_dkdv_sm90(const FlashBwdParams& p, const BwdScratch& s, cudaStream_t stream) {
  using Traits = BwdTraitsSm90<kHeadDim, Element, sm90_backward_tiles(kHeadDim, /*plain=*/false).block_m>;
  using PlainTraits = BwdTraitsSm90<kHeadDim, Element, sm90_backward_tiles(kHeadDim, /*plain=*/true).block_m>;
  static_assert(Traits::kBlockN == sm90_backward_tiles(kHeadDim, false).block_n &&
                    PlainTraits::kBlockN == sm90_backward_tiles(kHeadDim, true).block_n,
                "hopper_backward_takes checks block masks against sm90_backward_tiles");
  static_assert(Traits::kSmemBytes == sm90_backward_smem_bytes(kHeadDim, false, sizeof(Element)) &&
                    PlainTraits::kSmemBytes == sm90_backward_smem_bytes(kHeadDim, true, sizeof(Element)),
                "hopper_backward_takes sizes the segment ids' table by sm90_backward_smem_bytes");
  constexpr ElementMask kNone = ElementMask::kNone, kAttn = ElementMask::kAttnMask,
                           kSegments = ElementMask::kSegments;
  const bool general = p.dropout_rate > 0.f || p.softcap > 0.f || p.block_mask.data != nullptr;
  if (p.attn_mask.data != nullptr) {  // packed into the scratch first (bwd_mask_bytes)
    const cudaError_t err = pack_attention_mask(p, PackedMaskLayout(p, MaskPacking::kBackward), s.mask,
                                                std::is_same_v<Element, cutlass::bfloat16_t>, stream);
    if (err != cudaSuccess) return err;
    return general ? launch_bwd_dkdv_sm90<Traits, true, kAttn>(p, s, stream)
                   : launch_bwd_dkdv_sm90<Traits, false, kAttn>(p, s, stream);
  }
  if (has_segments(p)) {  // never with attn_mask or a block mask (hopper_backward_takes)
    return general ? launch_bwd_dkdv_sm90<Traits, true, kSegments>(p, s, stream)
                   : launch_bwd_dkdv_sm90<Traits, false, kSegments>(p, s, stream);
  }
  return general ? launch_bwd_dkdv_sm90<Traits, true, kNone>(p, s, stream)
                 : launch_bwd_dkdv_sm90<PlainTraits, false, kNone>(p, s, stream);
}

}  // namespace cuda
}  // namespace tf_flash
