// Definition of run_flash_fwd_sm90: TMA descriptors, grid and shared memory of the Hopper forward.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/cuda/fwd_kernel_sm90.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/static_switch.h"

namespace tf_flash {
namespace cuda {

// Tile choices per head dim (H100: 227 KB of shared memory; two stages of K and V): Traits, and
// BandedTraits for windowed attention and causal attention over fewer than 4k keys
// (run_flash_fwd_sm90), whose diagonal tiles waste more in larger query tiles.
// Wider key tiles are slower: d128 with 160 keys spills registers (non-causal 4k: 497 against 594 TFLOP/s), and
// 160 or 176 keys as one wgmma a k-slice (CuTe's extended shapes) or 192 keys, for unmasked non-causal work, run
// 0.69-0.93x at 512-4k tokens and 0.98-1.00x at 8k-16k (one P buffer beside a wider S, 148-404 bytes of spills).
// Head dim 64 non-causal runs three consumers (192 query rows): with two, each K/V tile feeds too few GEMM rows
// (bf16 16k: 420 against 350 TFLOP/s, 2k: 356 against 305; key tiles of 96 or 64 are slower). Causal keeps two
// below 4k keys (three: 1k 164 against 197 TFLOP/s) and takes three from 4k on (8k: 366 against 315).
template <int kHeadDim, class Element> struct FwdConfigSm90;
template <class E> struct FwdConfigSm90<64, E> {
  // Three or four K/V stages measure no faster than two.
  using Traits = FwdTraitsSm90<64, 128, 2, E, 3>;
  using BandedTraits = FwdTraitsSm90<64, 128, 2, E, 2>;
};
template <class E> struct FwdConfigSm90<128, E> {
  using Traits = FwdTraitsSm90<128, 128, 2, E>;
  using BandedTraits = Traits;
};
template <class E> struct FwdConfigSm90<256, E> {
  using Traits = FwdTraitsSm90<256, 64, 2, E>;
  using BandedTraits = Traits;
};

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
  s.tiles = int64_t(s.m_blocks) * pairs;
  const int64_t kv_bytes = int64_t(p.seqlen_k) * (p.head_dim + p.head_dim_v) * int64_t(sizeof(typename Traits::Element));
  const int64_t kv_heads = by_l2 ? std::max<int64_t>(1, kL2Bytes / std::max<int64_t>(kv_bytes, 1)) : 1;
  s.group_pairs = int(std::min<int64_t>({pairs, kv_heads * (p.num_heads / p.num_heads_kv), INT32_MAX}));
  return s;
}

template <class Traits>
cudaError_t launch_flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  const bool general = p.softcap > 0.f || p.dropout_rate > 0.f || p.block_mask.data != nullptr;
  auto kernel = general ? &flash_fwd_kernel_sm90<Traits, true> : &flash_fwd_kernel_sm90<Traits, false>;
  static const bool has_code = has_sm90a_code(&flash_fwd_kernel_sm90<Traits, false>) &&
                               has_sm90a_code(&flash_fwd_kernel_sm90<Traits, true>);
  if (p.attn_mask.data != nullptr) {
    if constexpr (Traits::kBlockM == 128) {
      static const bool has_masked_code = has_sm90a_code(&flash_fwd_kernel_sm90<Traits, false, true>) &&
                                          has_sm90a_code(&flash_fwd_kernel_sm90<Traits, true, true>);
      if (!has_masked_code) return cudaErrorNoKernelImageForDevice;
      kernel = general ? &flash_fwd_kernel_sm90<Traits, true, true> : &flash_fwd_kernel_sm90<Traits, false, true>;
    } else {
      return cudaErrorInvalidValue;  // run_flash_fwd_sm90 chooses 128-row tiles
    }
  }
  if (!has_code) return cudaErrorNoKernelImageForDevice;
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
  // V transposed: (head dim, rows, heads, batch).
  Tensor v_t = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v)),
                           make_shape(p.head_dim_v, p.seqlen_k, p.num_heads_kv, p.batch),
                           make_stride(_1{}, p.v_row_stride, p.v_head_stride, p.v_batch_stride));
  args.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v_t, take<0, 2>(typename Traits::SmemLayoutVt{}),
                             Shape<Int<kHeadDim>, Int<Traits::kBlockN>>{}, _1{});
  args.tma_o = make_tma_copy(SM90_TMA_STORE{},
                             make_tensor(make_gmem_ptr(static_cast<Element*>(p.out)),
                                         make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch),
                                         make_stride(p.o_row_stride, _1{}, p.o_head_stride, p.o_batch_stride)),
                             typename Traits::SmemLayoutOWarpGroup{}, Shape<_64, Int<kHeadDim>>{}, _1{});

  // Block masks and attn_mask add the kernel's tile table (a byte per key tile) and the consumers' words of
  // seen keys after the shared storage; keys too many for the table (some millions) run in the sm_80 family.
  // attn_mask is packed first (packed_mask.h), on the same stream.
  int smem = Traits::kSmemBytes;
  if (p.block_mask.data != nullptr || p.attn_mask.data != nullptr) {
    if (Traits::kBlockM != 128) return cudaErrorInvalidValue;  // run_flash_fwd_sm90 chooses 128-row tiles
    const int64_t key_tiles = (int64_t(p.seqlen_k) + Traits::kBlockN - 1) / Traits::kBlockN;
    const int64_t table_bytes = Traits::kMmaThreads / 32 * 4 * int64_t(sizeof(uint32_t)) + key_tiles;
    int device = 0, max_smem = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    if (smem + table_bytes > max_smem) return cudaErrorNoKernelImageForDevice;
    smem += int(table_bytes);
    if (p.attn_mask.data != nullptr) {
      err = pack_attention_mask(p, PackedMaskLayout(p, MaskPacking::kForward), p.mask_workspace,
                                std::is_same_v<Element, cutlass::bfloat16_t>, stream);
      // Invalid: no workspace, or a grid too large for the pass: the sm_80 family runs it.
      if (err == cudaErrorInvalidValue) return cudaErrorNoKernelImageForDevice;
      if (err != cudaSuccess) return err;
    }
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  // One CTA per SM (the kernel holds all of an SM's registers), each running its share of the query tiles, or a
  // CTA per tile, which the hardware hands out as CTAs finish: where the kernel makes a tile table (once per CTA),
  // and under a causal mask over more than 4k keys, whose tiles differ too much for the static schedule (bf16 d128
  // 16k: 368 against 483 TFLOP/s). On the H100 persistent CTAs gain most where tiles are short (d128 512 / 1k
  // tokens: 381 / 456 against 345 / 439 TFLOP/s with a CTA per tile), and with them query tiles go head after head
  // (heads grouped for L2 cost up to 7% at d128 4k); a CTA per causal tile goes in the L2 groups (d256 8k: 550
  // against 510 head after head). Persistent CTAs taking long causal tiles from a counter (a dynamic schedule)
  // measure even at d64 / d128 and 0.92-0.94x at d256 8k / 16k: the hardware's hand-out already is one.
  const bool tile_table = p.block_mask.data != nullptr || p.attn_mask.data != nullptr;
  const bool long_causal = p.causal && p.seqlen_k > 4096;
  const bool persistent = !tile_table && !long_causal && device_sm_count() > 0;
  args.schedule = make_fwd_schedule<Traits>(p, /*by_l2=*/p.causal && !persistent);
  const int64_t ctas = persistent ? std::min<int64_t>(args.schedule.tiles, device_sm_count()) : args.schedule.tiles;
  if (ctas > std::numeric_limits<int>::max()) return cudaErrorNoKernelImageForDevice;  // the sm_80 family runs it
  kernel<<<dim3(unsigned(ctas)), Traits::kNThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// Causal attention over at least this many keys runs on Config::Traits.
inline constexpr int kMinCausalKeysOnTraits = 4096;

template <class Element, int kHeadDim>
cudaError_t run_flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  using Config = FwdConfigSm90<kHeadDim, Element>;
  static_assert(Config::Traits::kBlockN == hopper_forward_key_tile(kHeadDim) &&
                    Config::BandedTraits::kBlockN == hopper_forward_key_tile(kHeadDim) &&
                    Config::BandedTraits::kBlockM == 128,
                "hopper_forward_takes_block_mask assumes these tiles");
  if constexpr (!std::is_same_v<typename Config::Traits, typename Config::BandedTraits>) {
    // Windows, and causal attention over short keys, leave too few key tiles per query tile for the
    // taller tile of Traits to pay off; causal from 4k keys on gains from it (d64, H100: 4k / 8k / 16k
    // keys 310 / 360 / 372 against 294 / 323 / 342 TFLOP/s).
    // Block masks and attn_mask take the 128-row tiles (the tile table: a block mask's query tile lies in one
    // query block, fwd_api.h).
    const bool windowed = p.window_left >= 0 || p.window_right >= 0;
    const bool short_causal = p.causal && p.seqlen_k < kMinCausalKeysOnTraits;
    if (windowed || short_causal || p.block_mask.data != nullptr || p.attn_mask.data != nullptr)
      return launch_flash_fwd_sm90<typename Config::BandedTraits>(p, stream);
  }
  return launch_flash_fwd_sm90<typename Config::Traits>(p, stream);
}

}  // namespace cuda
}  // namespace tf_flash
