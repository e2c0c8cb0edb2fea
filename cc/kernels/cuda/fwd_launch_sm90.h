// Definition of run_flash_fwd_sm90: TMA descriptors, grid and shared memory of the Hopper forward.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/fwd_kernel_sm90.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/cuda/static_switch.h"

namespace tf_flash {
namespace cuda {

// The Hopper forward's schedule (FwdScheduleSm90) for these params. by_l2: a group holds the (batch, head) pairs
// of as many kv heads as fit in kL2Bytes with both K and V; else those of one kv head (query tiles of one head
// after another, as a grid of a CTA per tile ran before the schedule).
template <class Traits>
FwdScheduleSm90 make_fwd_schedule(const FlashFwdParams& p, bool by_l2) {
  constexpr int64_t kL2Bytes = int64_t(32) << 20;  // of the H100's 50 MB, what one wave's K/V may take
  FwdScheduleSm90 s;
  s.m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  s.num_heads = p.num_heads;
  const int64_t pairs = int64_t(p.batch) * p.num_heads;
  s.splits = p.num_splits;
  s.tiles = int64_t(s.m_blocks) * pairs * s.splits;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * (p.head_dim + p.head_dim_v) * int64_t(sizeof(typename Traits::Element));
  const int64_t kv_heads = by_l2 ? std::max<int64_t>(1, kL2Bytes / std::max<int64_t>(kv_bytes, 1)) : 1;
  s.group_pairs = int(std::min<int64_t>({pairs, kv_heads * (p.num_heads / p.num_heads_kv), INT32_MAX}));
  return s;
}

template <class Traits>
cudaError_t launch_flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  using OutElement = typename Traits::OutElement;
  constexpr int kHeadDim = Traits::kHeadDim;
  const bool general = p.softcap > 0.f || p.dropout_rate > 0.f || p.block_mask.data != nullptr;
  auto kernel = general ? &flash_fwd_kernel_sm90<Traits, true> : &flash_fwd_kernel_sm90<Traits, false>;
  if constexpr (Traits::kBlockM == 128) {  // sm90_forward_shape gives the element masks the 128-row tiles
    constexpr ElementMask kAttn = ElementMask::kAttnMask, kSegments = ElementMask::kSegments;
    if (p.attn_mask.data != nullptr) {
      kernel = general ? &flash_fwd_kernel_sm90<Traits, true, kAttn> : &flash_fwd_kernel_sm90<Traits, false, kAttn>;
    } else if (p.q_segment_ids != nullptr) {  // never with attn_mask (hopper_forward_takes)
      kernel = general ? &flash_fwd_kernel_sm90<Traits, true, kSegments>
                       : &flash_fwd_kernel_sm90<Traits, false, kSegments>;
    }
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return cudaSuccess;

  FwdArgsSm90<Traits> args;
  args.p = p;
  args.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view<Element>(p.q, p.seqlen_q, p.head_dim, p.num_heads, p.batch,
                                                    p.q_row_stride, p.q_head_stride, p.q_batch_stride),
                             typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<kHeadDim>>{}, _1{});
  args.tma_k = make_tma_copy(SM90_TMA_LOAD{},
                             tma_gmem_view<Element>(p.k, p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch,
                                                    p.k_row_stride, p.k_head_stride, p.k_batch_stride),
                             take<0, 2>(typename Traits::SmemLayoutK{}),
                             Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, _1{});
  // V transposed: (head dim, rows, heads, batch); fp8: V^T as transpose_values_fp8 wrote it, keys contiguous.
  if constexpr (Traits::kFp8) {
    const int64_t keys = fp8_value_keys(p);
    Tensor v_t = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.value_transposed)),
                             make_shape(p.head_dim_v, int(keys), p.num_heads_kv, p.batch),
                             make_stride(keys, _1{}, keys * p.head_dim_v, keys * p.head_dim_v * p.num_heads_kv));
    args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v_t, take<0, 2>(typename Traits::SmemLayoutVt{}),
                               Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{}, _1{});
  } else {
    Tensor v_t = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v)),
                             make_shape(p.head_dim_v, p.seqlen_k, p.num_heads_kv, p.batch),
                             make_stride(_1{}, p.v_row_stride, p.v_head_stride, p.v_batch_stride));
    args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v_t, take<0, 2>(typename Traits::SmemLayoutVt{}),
                               Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{}, _1{});
  }
  args.tma_o = make_tma_copy(SM90_TMA_STORE{},
                             make_tensor(make_gmem_ptr(static_cast<OutElement*>(p.out)),
                                         make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch * p.num_splits),
                                         make_stride(p.o_row_stride, _1{}, p.o_head_stride, p.o_batch_stride)),
                             typename Traits::SmemLayoutOWarpGroup{}, Shape<_64, Int<kHeadDim>>{}, _1{});

  // Block masks, attn_mask and segment ids add the kernel's tile table (a byte per key tile) and the consumers'
  // words of seen keys after the shared storage, segment ids also the range of their documents' key tiles
  // (FwdMaskSm90; hopper_forward_takes checked that they fit). attn_mask is packed first (packed_mask.h), on the
  // same stream; the runner computed the segment ids' bounds before the launch. V's scan for non-finite values
  // spares tiles the exact zeroing where several query tiles read each value tile; with one (a decoding step)
  // it would read V a second time, so every tile is flagged instead (only those the mask hides part of pay).
  int smem = Traits::kSmemBytes;
  if (p.block_mask.data != nullptr || p.attn_mask.data != nullptr || has_segments(p))
    smem += int(sm90_forward_table_bytes(Traits::kMmaWarpGroups, Traits::kBlockN, p.seqlen_k, has_segments(p)));
  if (p.attn_mask.data != nullptr) {
    const cudaError_t err = pack_attention_mask(p, PackedMaskLayout(p, MaskPacking::kForward), p.mask_workspace,
                                                std::is_same_v<Element, cutlass::bfloat16_t>, stream,
                                                /*scan_values=*/!Traits::kFp8 && p.seqlen_q > Traits::kBlockM);
    if (err != cudaSuccess) return err;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  // One CTA per SM (the kernel holds all of an SM's registers), each running its share of the query tiles, or a
  // CTA per tile (sm90_forward_cta_per_tile), which the hardware hands out as CTAs finish. On the H100 persistent
  // CTAs gain most where tiles are short (d128 512 / 1k tokens: 381 / 456 against 345 / 439 TFLOP/s with a CTA per
  // tile), and with them query tiles go head after head (heads grouped for L2 cost up to 7% at d128 4k); a CTA per
  // causal tile goes in the L2 groups (d256 8k: 550 against 510 head after head). Persistent CTAs taking long
  // causal tiles from a counter (a dynamic schedule) measure even at d64 / d128 and 0.92-0.94x at d256 8k / 16k:
  // the hardware's hand-out already is one.
  const bool persistent = !sm90_forward_cta_per_tile(p) && device_sm_count() > 0;
  args.schedule = make_fwd_schedule<Traits>(p, /*by_l2=*/p.causal && !persistent);
  const int64_t ctas = persistent ? std::min<int64_t>(args.schedule.tiles, device_sm_count()) : args.schedule.tiles;
  kernel<<<dim3(unsigned(ctas)), Traits::kNThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// The traits of one tile shape (sm90_tile_size.h) at head dim kHeadDim.
template <class Element, int kHeadDim, Sm90ForwardShape kShape, class OutElement = Element>
using Sm90ForwardTraits = FwdTraitsSm90<kHeadDim, sm90_forward_tiles(kHeadDim, kShape, sizeof(Element)).block_n,
                                        sm90_forward_tiles(kHeadDim, kShape, sizeof(Element)).stages, Element,
                                        sm90_forward_tiles(kHeadDim, kShape, sizeof(Element)).consumers, OutElement>;

template <class Element, int kHeadDim, class OutElement = Element>
cudaError_t run_flash_fwd_sm90_traits(const FlashFwdParams& p, cudaStream_t stream) {
  using Long = Sm90ForwardTraits<Element, kHeadDim, Sm90ForwardShape::kLong, OutElement>;
  using Banded = Sm90ForwardTraits<Element, kHeadDim, Sm90ForwardShape::kBanded, OutElement>;
  static_assert(Long::kSmemBytes == sm90_forward_smem_bytes(kHeadDim, Sm90ForwardShape::kLong, sizeof(Element),
                                                            sizeof(OutElement)) &&
                    Banded::kSmemBytes == sm90_forward_smem_bytes(kHeadDim, Sm90ForwardShape::kBanded,
                                                                  sizeof(Element), sizeof(OutElement)),
                "hopper_forward_takes sizes the tile table by sm90_forward_smem_bytes");
  static_assert(Banded::kBlockM == 128, "block masks, attn_mask and segment ids: 128-row tiles (the tile table)");
  if constexpr (std::is_same_v<Long, Banded>) {
    return launch_flash_fwd_sm90<Long>(p, stream);
  } else {
    return sm90_forward_shape(p) == Sm90ForwardShape::kBanded ? launch_flash_fwd_sm90<Banded>(p, stream)
                                                              : launch_flash_fwd_sm90<Long>(p, stream);
  }
}

template <class Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  return run_flash_fwd_sm90_traits<Element, kHeadDim>(p, stream);
}

// ---- FP8 (e4m3) ----
// V^T first (fp8_values.cu), then the kernel.
template <class OutElement, int kHeadDim>
cudaError_t run_flash_fwd_sm90_fp8(const FlashFwdParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return cudaSuccess;
  const cudaError_t err = transpose_values_fp8(p, stream);
  if (err != cudaSuccess) return err;
  return run_flash_fwd_sm90_traits<cutlass::float_e4m3_t, kHeadDim, OutElement>(p, stream);
}

}  // namespace cuda
}  // namespace tf_flash
