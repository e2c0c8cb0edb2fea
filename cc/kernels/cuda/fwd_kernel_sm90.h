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
// block masks whose blocks hold whole tiles (fwd_api.h's hopper_forward_takes_block_mask) and attn_mask,
// packed to a bit per entry before the kernel (packed_mask.h). Finer blocks run in the sm_80 family
// (cuda_entry.cu chooses, at run time).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

template <int kHeadDim_, int kBlockN_, int kStages_, class Element_, int kMmaWarpGroups_ = 2>
struct FwdTraitsSm90 {
  using Element = Element_;
  static constexpr int kMmaWarpGroups = kMmaWarpGroups_;  // each owns 64 query rows
  static_assert(kMmaWarpGroups == 2 || kMmaWarpGroups == 3, "two or three consumer warpgroups");
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64 * kMmaWarpGroups, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kMmaThreads = 128 * kMmaWarpGroups;
  static constexpr int kNThreads = kMmaThreads + 128;  // and the producer warpgroup
  // 24 * 128 + 240 * 256 and 24 * 128 + 160 * 384 <= 64K registers
  static constexpr int kProducerRegs = 24, kMmaRegs = kMmaWarpGroups == 2 ? 240 : 160;
  static_assert(kHeadDim % 64 == 0, "128-byte swizzled rows of 64 elements");
  static_assert(kBlockN % 16 == 0, "key tile: whole k-slices of P V");

  using TileQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TilePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<kMmaWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpGroups{}));
  // V stays as loaded (key rows, head dim contiguous): the B operand of P V is then head-dim-major (MN).
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TilePV, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpGroups{}));

  using SmemLayoutQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // (head dim, key, stage): the same bytes as a K-major (key, head dim) tile, seen transposed.
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{}, cute::Step<cute::_2, cute::_1, cute::_3>{}));

  // Global tensors as the TMA sees them: (rows, head dim, heads, batch), head dim contiguous; V transposed.
  using GmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using GmemStrideVt = cute::Stride<cute::_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStride{}),
      cute::take<0, 2>(SmemLayoutK{}), cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, cute::make_tensor(cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{}, GmemStrideVt{}),
      cute::take<0, 2>(SmemLayoutVt{}), cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::_1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V stage

  // O leaves through shared memory and one TMA store per consumer (its 64 rows; rows and columns past the
  // tensor are not written). It has a buffer of its own where that fits beside Q and the K/V stages, so that
  // the next tile's Q loads while this tile's O is stored; else (head dim 256) it takes Q's buffer, each
  // consumer its own rows, which only its own GEMMs read.
  static constexpr bool kOwnOutputBuffer = 2 * kTmaBytesQ + 2 * kStages * kTmaBytesKV <= 200 * 1024;
  using SmemLayoutO = SmemLayoutQ;
  // One consumer's rows of O (the first 64; a consumer's own are these, moved by whole swizzle periods).
  using SmemLayoutOWarpGroup = decltype(cute::composition(
      SmemLayoutO{},
      cute::Layout<cute::Shape<cute::_64, cute::Int<kHeadDim>>, cute::Stride<cute::_1, cute::Int<kBlockM>>>{}));
  using TmaO = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}),
      SmemLayoutOWarpGroup{}, cute::Shape<cute::_64, cute::Int<kHeadDim>>{}, cute::_1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  struct SharedStorage {
    // 128-byte swizzled tiles want 1024-byte alignment (the swizzle pattern's period).
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutQ>> q;  // and O without kOwnOutputBuffer
    alignas(1024) cute::ArrayEngine<Element, kOwnOutputBuffer ? cute::cosize_v<SmemLayoutO> : 8> o;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutVt>> v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    cutlass::arch::ClusterBarrier barrier_q_free;  // the consumer threads are done with a tile's Q
    typename Pipeline::SharedStorage pipeline_k, pipeline_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};


// Which query tiles each CTA of the Hopper forward runs. Tiles go in the order (group of heads, query tile from
// the last down, (batch, head) in the group): the last query tiles are the heaviest under a causal mask, and a
// group holds the heads of one kv head or (make_fwd_schedule) those whose K and V fit in L2 together, which the
// CTAs running at one time then share. CTA c
// of `ctas` takes tile c of each wave of `ctas` tiles, counted from the wave's end in odd waves, so that heavy
// and light tiles even out over the CTAs: a static schedule, with no counter to reset before each launch. With
// a CTA per tile (ctas == tiles) it is the launch order.
struct FwdScheduleSm90 {
  int m_blocks = 1;     // query tiles per (batch, head)
  int num_heads = 1;
  int group_pairs = 1;  // (batch, head) pairs per group
  int64_t tiles = 0;    // m_blocks x batch x heads
  struct Tile {
    int m_block, h, b;
  };
  __host__ __device__ int64_t index(int64_t wave, int cta, int ctas) const {
    return wave * ctas + (wave % 2 == 0 ? cta : ctas - 1 - cta);
  }
  __host__ __device__ Tile tile(int64_t i) const {
    const int64_t group_tiles = int64_t(group_pairs) * m_blocks;
    const int64_t group = i / group_tiles, r = i - group * group_tiles;
    const int64_t pairs_left = tiles / m_blocks - group * group_pairs;
    const int64_t pairs_here = pairs_left < group_pairs ? pairs_left : group_pairs;
    const int64_t m_rank = r / pairs_here;
    const int64_t pair = group * group_pairs + (r - m_rank * pairs_here);
    return Tile{int(m_blocks - 1 - m_rank), int(pair % num_heads), int(pair / num_heads)};
  }
};

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

// Named barriers of the forward kernel (ids after CUTLASS's reserved ones).
enum class Sm90Barrier : uint32_t {
  kIssueWg0 = 0,  // warpgroup 0 may issue its GEMMs (ping-pong); kIssueWg0 + i for consumer i (up to 3)
  kValueRowsZeroed = 3,  // every consumer zeroed the unseen rows of a V stage (or published what its rows see)
  kOutputWg0 = 4,  // a consumer's output rows are in shared memory; kOutputWg0 + i for consumer i
};
// A key tile's entry in the forward's tile table.
enum TileState : uint8_t {
  kTileHidden = 0,           // skipped
  kTileShown = 1,            // processed; attn_mask, if any, shows all of it
  kTileElementMasked = 2,    // attn_mask hides part of it: masked entry by entry
  kTileValuesNonFinite = 4,  // with kTileElementMasked: V holds a non-finite value in it
};

// kGeneral: soft-capping, dropout and block masks (run-time switches inside), kept out of the plain variant's
// registers; kAttnMask (128-row tiles): attn_mask, with either, kept out of both others' (its exact zeroing
// of value rows cost the general variant 16-28 bytes of spills at head dim 128).
//
// Persistent: each CTA runs the query tiles args.schedule gives it, one after another. The K/V ring, the
// ping-pong turns and Q's barrier carry on from tile to tile, so the producer loads the next tile's first K
// (and, once the consumers are done with Q, its Q) while the consumers finish a tile, and a tile's O store
// overlaps the next tile's work. With a tile table (block masks, attn_mask) the launcher gives each CTA one
// tile (the table is made before the roles split).
template <class Traits, bool kGeneral, bool kAttnMask = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel_sm90(const __grid_constant__ FwdArgsSm90<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kMmaThreads = Traits::kMmaThreads;
  // Two register buffers of P (see the consumers' loop) where the registers allow: two consumers (240 each) at
  // head dims up to 128, in the plain variant (bytes of spills with two buffers: d256 plain 192, d128 with dropout
  // or masks more than with one). The softmax then overlaps the consumer's own P V: non-causal d128 runs 2-9% faster
  // than with one buffer at every length (b4 s4k h16: 0.87 against 0.91 ms, the tensor pipe 71% active against 66%).
  constexpr bool kDoubleBufferP = Traits::kMmaWarpGroups == 2 && kHeadDim <= 128 && !kGeneral && !kAttnMask;
  // One FMA per score under a warp vote (fwd_kernel.h's kFmaExponentLimit) in the plain and attn_mask variants,
  // rather than (s - max) * scale_log2 always: one floating-point instruction fewer per score, where FADD and FMUL
  // are 40% of the d64 forward's instructions (d64 forward +1-4% through TF, d128 +1-2%, d256 +3-12%; attn_mask
  // and key masks +3-12%). The general variants (dropout, soft-capping, block masks) always subtract the max: the
  // vote makes dropout 6-9% slower there and block-sparse work -2..+5%.
  constexpr bool kExponentVote = !kGeneral;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_buf[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_buf);
  const FlashFwdParams& p = args.p;
  const FwdScheduleSm90& schedule = args.schedule;
  const int cta = int(blockIdx.x), ctas = int(gridDim.x);

  // A query tile and the key tiles some valid row of it sees (the same rule as the sm_80 family).
  struct TileWork {
    int m_block, h, b, h_kv;
    int64_t q_len, kv_len, m0;
    QueryTileKeys keys;
  };
  // The attn_mask variant always has a tile table, so one tile per CTA (the loops then carry nothing over).
  constexpr int kMaxWaves = kAttnMask ? 1 : std::numeric_limits<int>::max();
  auto tile_work = [&](int wave, TileWork& w) {  // false once this CTA has no more tiles
    const int64_t i = schedule.index(wave, cta, ctas);
    if (i >= schedule.tiles) return false;
    const FwdScheduleSm90::Tile t = schedule.tile(i);
    w.m_block = t.m_block;
    w.h = t.h;
    w.b = t.b;
    w.h_kv = t.h / (p.num_heads / p.num_heads_kv);
    w.q_len = valid_q_len(p, t.b);
    w.kv_len = valid_kv_len(p, t.b);
    w.m0 = int64_t(t.m_block) * kBlockM;
    w.keys = query_tile_keys(p, w.m0, kBlockM, kBlockN, w.q_len, w.kv_len);
    return true;
  };

  // The tile table (the general variant of the 128-row tiles): one byte per key tile, TileState, made once per
  // CTA after the shared storage (launch_flash_fwd_sm90 sizes it) from the block mask's row (fwd_api.h's
  // hopper_forward_takes_block_mask: the query tile lies in one query block, each key tile in one key block)
  // and from attn_mask's summaries (packed_mask.h). Hidden tiles are skipped by the producer and the
  // consumers alike; the loops then read one shared byte per tile. (Per-consumer blocks of 64 rows, masking
  // a tile whole for one consumer, cost the d64 kernel of three consumers 400-800 bytes of spills.)
  constexpr bool kTileTable = (kGeneral || kAttnMask) && kBlockM == 128;
  static_assert(!kAttnMask || kTileTable, "attn_mask runs on the 128-row tiles");
  const bool has_block_mask = kGeneral && kTileTable && p.block_mask.data != nullptr;
  const bool has_attn_mask = kAttnMask && p.attn_mask.data != nullptr;
  const bool has_table = has_block_mask || has_attn_mask;
  // After the shared storage: what each consumer warp's rows see of a tile (zero_unseen_values), then the table.
  constexpr int kSeenWords = Traits::kMmaThreads / 32 * 4;
  uint32_t* const seen_words = reinterpret_cast<uint32_t*>(smem_buf + sizeof(typename Traits::SharedStorage));
  uint8_t* const tile_state = reinterpret_cast<uint8_t*>(seen_words + kSeenWords);
  TileWork first;
  if (has_table && tile_work(0, first)) {
    const PackedMaskLayout layout(p, MaskPacking::kForward);
    const uint8_t* summary = static_cast<const uint8_t*>(p.mask_workspace) + layout.summary_offset;
    const uint8_t* value_flags = static_cast<const uint8_t*>(p.mask_workspace) + layout.value_flags_offset;
    const int64_t plane = layout.plane(first.b, first.h);
    const int64_t m0 = first.m0;
    const int64_t group_begin = layout.rows > 1 ? m0 / kMaskRowGroup : 0;
    const int64_t group_end = layout.rows > 1 ? (m0 + kBlockM + kMaskRowGroup - 1) / kMaskRowGroup : 1;
    for (int n = first.keys.tile_begin + int(threadIdx.x); n < first.keys.tile_end; n += Traits::kNThreads) {
      uint8_t state = kTileShown;
      if (has_block_mask && !mask_at(p.block_mask, first.b, first.h, m0 / p.block_q, n / (p.block_k / kBlockN)))
        state = kTileHidden;
      if (state != kTileHidden && has_attn_mask) {
        const int64_t chunk = int64_t(n) * kBlockN / kMaskChunkKeys;
        bool any = false, all = true;
        for (int64_t g = group_begin; g < group_end && g < layout.row_groups; ++g) {
          const uint8_t s = summary[layout.summary_index(plane, g, chunk)];
          any |= (s & kMaskSomeVisible) != 0;
          all &= (s & kMaskAllVisible) != 0;
        }
        if (!any) state = kTileHidden;
        if (any && !all) {
          state |= kTileElementMasked;
          for (int64_t t = int64_t(n) * kBlockN / kValueFlagKeys;
               t < (int64_t(n) + 1) * kBlockN / kValueFlagKeys && t < layout.value_tiles; ++t)
            if (value_flags[layout.value_flag_index(first.b, first.h_kv, p.num_heads_kv, t)])
              state |= kTileValuesNonFinite;
        }
      }
      tile_state[n] = state;
    }
  }
  // The next key tile to process below n (tiles run from the last one down), past the table's hidden ones.
  auto next_tile = [&](int n, int n_block_min) {
    for (--n; has_table && n >= n_block_min && tile_state[n] == kTileHidden; --n) {
    }
    return n;
  };

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutVt{});

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
  Pipeline pipeline_k(shared.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(shared.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barriers and the tile table initialized

  if (warp_group == 0) {
    // ---- Producer: one thread issues every copy; K of tile j goes out before V of tile j + 1, the order
    // in which the consumers need them ----
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    Tensor mQ = args.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.num_heads, p.batch));
    Tensor mK = args.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.num_heads_kv, p.batch));
    Tensor mVt = args.tma_v.get_tma_tensor(make_shape(p.head_dim_v, p.seqlen_k, p.num_heads_kv, p.batch));
    using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    // Before a Q load, the consumers' next phase of barrier_q_free: they arrive once per tile with work that
    // follows a use of Q's buffer (a tile with work; without kOwnOutputBuffer, any earlier tile, whose O went
    // through that buffer), and cannot arrive again before the Q that follows is here, so no phase completes unseen.
    int q_free_waits = 0;
    bool q_buffer_used = false;
    TileWork w;
    for (int wave = 0; wave < kMaxWaves && tile_work(wave, w); ++wave) {
      const int n_block_min = w.keys.tile_begin;
      const int n_first = next_tile(w.keys.tile_end, n_block_min);
      const bool has_work = n_first >= n_block_min;
      Tensor gQ = local_tile(mQ(_, _, w.h, w.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, _0{}));
      Tensor gK = local_tile(mK(_, _, w.h_kv, w.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      Tensor gVt = local_tile(mVt(_, _, w.h_kv, w.b), Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));
      // (TMA) for Q, (TMA, tile) and (TMA, stage) for K and V: the copy engine moves a whole mode 0.
      auto q_parts = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
      auto load_k = [&](int n) {
        pipeline_k.producer_acquire(write);
        copy(args.tma_k.with(*pipeline_k.producer_get_barrier(write)), get<0>(k_parts)(_, n),
             get<1>(k_parts)(_, write.index()));
      };
      auto load_v = [&](int n, PipelineState state) {
        pipeline_v.producer_acquire(state);
        copy(args.tma_v.with(*pipeline_v.producer_get_barrier(state)), get<0>(v_parts)(_, n),
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
      copy(args.tma_q.with(reinterpret_cast<BarrierType&>(shared.barrier_q)), get<0>(q_parts), get<1>(q_parts));
      PipelineState write_v = write;
      ++write;
      for (int next = next_tile(n, n_block_min); next >= n_block_min; n = next, next = next_tile(n, n_block_min)) {
        load_k(next);
        load_v(n, write_v);
        write_v = write;
        ++write;
      }
      load_v(n, write_v);
    }
  } else {
    // ---- Consumers: the other branch of this if/else (setmaxnreg moves registers between branches) ----
    cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
    const int mma_tidx = int(threadIdx.x) - 128;
    const int wg = warp_group - 1;  // consumer wg: query rows 64 wg .. 64 wg + 63 of the tile
    const bool output_leader = mma_tidx % 128 == 0;  // issues this consumer's TMA stores of O
    // Ping-pong: consumer wg issues after the one before it (its barrier counts that one's arrival and its
    // own wait: 2 x 128 threads), then lets the next one issue. Every consumer runs the same key tiles, so the
    // turns carry on across query tiles.
    constexpr int kIssueThreads = 2 * 128;
    const int next_wg = wg + 1 == Traits::kMmaWarpGroups ? 0 : wg + 1;
    if (wg == 0) named_arrive(kIssueThreads, Sm90Barrier::kIssueWg0, 0);  // warpgroup 0 issues first
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(mma_tidx);
    auto thr_pv = mma_pv.get_thread_slice(mma_tidx);
    // Q, S's A operand, stays put across the loops, and so do its wgmma descriptors, in registers. Rebuilt at each
    // GEMM instead, they would spare the d128 and d256 variants their spills (20-44 and 72-124 bytes), yet the d128
    // forward then runs even to 2% slower through TF (+1-4% in the harness) and d64 1-3% slower.
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);   // (MMA, MMA_N, MMA_K, stage)
    // (row, column) inside the score tile of each accumulator element.
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS_rc = make_tensor(cS.data(), gmma_acc_rowcol(cS.layout()));
    constexpr int kRows = decltype(size<0>(cS_rc))::value;
    const float scale_log2 = softmax_scale_log2(p);
    const bool has_softcap = kGeneral && p.softcap > 0.f;
    const float softcap_in = has_softcap ? softcap_input_scale(p) : 0.f;
    const bool has_dropout = kGeneral && p.dropout_rate > 0.f;
    const uint32_t drop_threshold = has_dropout ? dropout_threshold(p.dropout_rate) : 0u;
    const float keep_scale = has_dropout ? dropout_keep_scale(p.dropout_rate) : 1.f;

    PipelineState read;  // the K/V ring, carried across query tiles
    int q_loads = 0;     // query tiles of this CTA with work so far: barrier_q's phase
    // barrier_q_free: each consumer thread arrives once done with a tile's Q (after its last P V), or, where O
    // goes through Q's buffer, at the start of each tile with work but the CTA's first tile, once the stores of
    // the tiles before have read the buffer; the producer waits for that before loading the next Q. (Freeing it
    // after a tile's last S instead, so that the next Q loads during the last softmax and P V, measures even at
    // d64 and d128.)
    TileWork w;
    for (int wave = 0; wave < kMaxWaves && tile_work(wave, w); ++wave) {
      const int h = w.h, b = w.b;
      const int64_t q_len = w.q_len, kv_len = w.kv_len, m0 = w.m0;
      const KeyRange first_row = w.keys.first_row, last_row = w.keys.last_row;
      const int n_block_min = w.keys.tile_begin;
      const int n_first = next_tile(w.keys.tile_end, n_block_min);
      const bool has_work = n_first >= n_block_min;
      const uint64_t batch_head = uint64_t(b) * p.num_heads + h;
      Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor tOrP = make_tensor<Element>(gmma_acc_as_a_operand(tSrS.layout()));
      Tensor tOrP2 = make_tensor<Element>(tOrP.layout());  // kDoubleBufferP's second buffer
      Tensor s_rc = make_tensor(tSrS.data(), gmma_acc_rowcol(tSrS.layout()));
      Tensor o_rc = make_tensor(tOrO.data(), gmma_acc_rowcol(tOrO.layout()));
      OnlineSoftmax<kRows> softmax;
      clear(tOrO);
      // attn_mask: this thread's words of the packed mask (packed_mask.h: lane % 4 picks the word), rows r and
      // r + 8; rows past the tensor's read row 0 (their range hides them anyway).
      const uint32_t* mask_words[kRows];
      if (has_attn_mask) {
        const PackedMaskLayout layout(p, MaskPacking::kForward);
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          const int64_t row = m0 + get<0>(cS_rc(mi, 0));
          mask_words[mi] = static_cast<const uint32_t*>(p.mask_workspace) +
                           layout.word_index(layout.plane(b, h), row < p.seqlen_q ? row : 0, 0, mma_tidx % 4);
        }
      }
      // Bit ni of bits[mi]: the mask at (row mi, column ni) of the accumulator's row/column view (column ni is key
      // 8 (ni / 2) + 2 (lane % 4) + ni % 2 of the tile); a 64-key tile is half a chunk's word.
      auto load_mask_bits = [&](int n, uint32_t(&bits)[kRows]) {
        const int64_t word = int64_t(n) * kBlockN / kMaskChunkKeys * 4;
        const int shift = int64_t(n) * kBlockN % kMaskChunkKeys / 4;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) bits[mi] = mask_words[mi][word] >> shift;
      };
      auto state_of = [&](int n) { return has_table ? tile_state[n] : uint8_t(kTileShown); };
      auto element_masked = [&](uint8_t state) { return has_attn_mask && (state & kTileElementMasked); };

      if (has_work) {
        // Tiles n with lo_unmasked <= n < hi_unmasked are visible to every valid row in full.
        const int hi_unmasked = int(first_row.end / kBlockN);
        const int lo_unmasked = int((last_row.begin + kBlockN - 1) / kBlockN);
        // Keys no row of the tile sees, [0, first_row.begin) and [keys_end, seqlen_k), may hold anything
        // (NaN in padding): their V rows are zeroed in shared memory, since P = 0 there and 0 x NaN is NaN.
        // Past seqlen_k the TMA has zero-filled already.
        const int64_t keys_end = last_row.end < kv_len ? last_row.end : kv_len;
        // A tile that attn_mask hides in part while V holds a non-finite value there takes the exact rule: the
        // softmax of the tile publishes the keys each consumer warp's rows see (publish_seen_keys), and before
        // its P V the value rows no row of the tile sees are zeroed. Two barriers over the consumers: only such
        // tiles pay them.
        auto needs_exact_zeroing = [&](int n) {
          constexpr uint8_t kBoth = kTileElementMasked | kTileValuesNonFinite;
          return has_attn_mask && (tile_state[n] & kBoth) == kBoth;
        };
        auto zero_values_no_row_sees = [&](int n, PipelineState stage) {
          pipeline_v.consumer_wait(stage);
          named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);  // every warp published its rows' keys
          static_assert(kMmaThreads % kBlockN == 0, "whole threads per key");
          constexpr int kThreadsPerKey = kMmaThreads / kBlockN, kDimsPerThread = kHeadDim / kThreadsPerKey;
          const int key = mma_tidx / kThreadsPerKey, part = mma_tidx % kThreadsPerKey;
          const int word = key % 8 / 2, bit = key / 8 * 2 + key % 2;  // packed_mask.h's column order
          uint32_t seen = 0;
          CUTE_UNROLL
          for (int i = 0; i < kSeenWords / 4; ++i) seen |= seen_words[i * 4 + word] >> bit;
          if (!(seen & 1u)) {
            Tensor sV = sVt(_, _, stage.index());
#pragma unroll 1
            for (int d = part * kDimsPerThread; d < (part + 1) * kDimsPerThread; ++d) sV(d, key) = Element(0);
          }
          cutlass::arch::fence_view_async_shared();  // visible to the tensor cores (async proxy)
          named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);  // and seen_words free for the next such tile
        };
        auto zero_unseen_values = [&](int n, PipelineState stage) {
          if (needs_exact_zeroing(n)) return zero_values_no_row_sees(n, stage);
          const int64_t n0 = int64_t(n) * kBlockN;
          const int lo = int(first_row.begin - n0 > 0 ? first_row.begin - n0 : 0);
          const int64_t hi64 = keys_end - n0 < kBlockN ? keys_end - n0 : kBlockN;
          const int hi = n0 + kBlockN > p.seqlen_k && keys_end == p.seqlen_k ? kBlockN : int(hi64);
          if (lo == 0 && hi == kBlockN) return;  // uniform over both consumers: every row of the stage is seen
          pipeline_v.consumer_wait(stage);
          Tensor sV = sVt(_, _, stage.index());
          for (int i = mma_tidx; i < kHeadDim * kBlockN; i += kMmaThreads) {
            const int key = i / kHeadDim, d = i % kHeadDim;
            if (key < lo || key >= hi) sV(d, key) = Element(0);
          }
          cutlass::arch::fence_view_async_shared();  // visible to the tensor cores (async proxy)
          named_sync(kMmaThreads, Sm90Barrier::kValueRowsZeroed);
        };

        if constexpr (!Traits::kOwnOutputBuffer) {
          // O of the tiles before, in Q's buffer, read out by their stores: the producer may load this tile's Q.
          // (Arriving here rather than after the epilogue keeps the epilogues of tiles without work, which write
          // to the buffer too, before the next Q; a first tile without work, too, which the producer waits for.)
          if (wave > 0) {
            if (output_leader) tma_store_wait<0>();
            named_sync(128, Sm90Barrier::kOutputWg0, wg);
            shared.barrier_q_free.arrive();
          }
        }
        shared.barrier_q.wait(q_loads % 2);
        ++q_loads;

        auto tile_masked = [&](int n) { return !(n < hi_unmasked && n >= lo_unmasked); };
        // The keys some valid row of this warp sees in the masked scores (bit ni: column ni of lane % 4), one word
        // per lane % 4 into seen_words, for zero_values_no_row_sees. Rows past q_len do not count: their mask rows
        // may show keys no query sees. (A score -inf from the inputs counts as unseen: its P is 0 for every row,
        // so zeroing its value row changes nothing.)
        auto publish_seen_keys = [&]() {
          bool valid[kRows];
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) valid[mi] = m0 + get<0>(cS_rc(mi, 0)) < q_len;
          uint32_t seen = 0;
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(s_rc); ++ni) {
            bool any = false;
            CUTE_UNROLL
            for (int mi = 0; mi < kRows; ++mi) any |= valid[mi] && s_rc(mi, ni) != -INFINITY;
            seen |= uint32_t(any) << ni;
          }
          seen |= __shfl_xor_sync(0xffffffffu, seen, 4);  // lanes of one lane % 4 hold the same columns
          seen |= __shfl_xor_sync(0xffffffffu, seen, 8);
          seen |= __shfl_xor_sync(0xffffffffu, seen, 16);
          if (mma_tidx % 32 < 4) seen_words[mma_tidx / 32 * 4 + mma_tidx % 32] = seen;
        };
        // Scores of tile n -> unnormalized probabilities; `correction` rescales O for the new running max, where
        // `rescale_o` (warp-uniform) says it must.
        float correction[kRows];
        bool rescale_o = true;
        auto softmax_of_tile = [&](int n, bool first_tile, uint8_t state, const uint32_t(&bits)[kRows])
                                   __attribute__((always_inline)) {
          if (has_softcap) {  // the same operations as the sm_80 kernels' (fwd_kernel.h, bwd_kernel.h)
            CUTE_UNROLL
            for (int i = 0; i < size(tSrS); ++i) tSrS(i) = p.softcap * tanhf(tSrS(i) * softcap_in);
          }
          if (tile_masked(n)) {
            mask_scores<false, kBlockN>(s_rc, cS_rc, p, m0, int64_t(n) * kBlockN, q_len, kv_len, false, nullptr);
          }
          if (element_masked(state)) {
            CUTE_UNROLL
            for (int mi = 0; mi < kRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < size<1>(s_rc); ++ni)
                if (!((bits[mi] >> ni) & 1u)) s_rc(mi, ni) = -INFINITY;
            }
            if (state & kTileValuesNonFinite) publish_seen_keys();
          }
          rescale_o = softmax.rescale_max(s_rc, correction, scale_log2, first_tile);
          softmax.template exponentiate<kExponentVote>(s_rc, correction, scale_log2);
        };
        // Probabilities of tile n (after the row sums took them, as in dropout(softmax(s)) @ v) -> P operand.
        auto probabilities_to_operand = [&](int n, auto& rP) __attribute__((always_inline)) {
          convert_fragment_into(tSrS, rP);
          if (has_dropout) {
            Tensor rP_atoms = make_tensor(rP.data(), gmma_acc_as_mma_atoms(tSrS.layout()));
            apply_dropout<kBlockN>(rP_atoms, cS_rc, p, batch_head, m0, int64_t(n) * kBlockN, drop_threshold);
          }
        };
        auto rescale_output = [&]() __attribute__((always_inline)) {
          if (!rescale_o) return;
          CUTE_UNROLL
          for (int mi = 0; mi < size<0>(o_rc); ++mi) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(o_rc); ++ni) o_rc(mi, ni) *= correction[mi];
          }
        };

        int n = n_first;
        // The mask bits of a tile are loaded before its S is waited for (their latency hides behind the GEMM).
        uint8_t state = state_of(n);
        uint32_t bits[kRows] = {};
        if (element_masked(state)) load_mask_bits(n, bits);
        // First tile: S, softmax, P (no P V yet).
        pipeline_k.consumer_wait(read);
        warpgroup_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
        warpgroup_wait<0>();
        pipeline_k.consumer_release(read);
        softmax_of_tile(n, true, state, bits);
        probabilities_to_operand(n, tOrP);

        // Each step issues S = Q K^T of tile n and O += P V of the tile before (n_prev) together; the softmax of S
        // runs while the tensor cores do P V.
        int n_prev = n;  // the tile whose P V is next
        // The start of a step: value rows of n_prev's V stage zeroed where needed (only edge tiles, and tiles of
        // the exact rule: see above; uniform over the consumers), tile's mask bits, then its S = Q K^T issued in
        // this consumer's ping-pong turn.
        auto issue_scores = [&](int tile, PipelineState read_v) __attribute__((always_inline)) {
          if (n_prev == n_first || needs_exact_zeroing(n_prev)) zero_unseen_values(n_prev, read_v);
          state = state_of(tile);
          if (element_masked(state)) load_mask_bits(tile, bits);
          pipeline_k.consumer_wait(read);
          named_sync(kIssueThreads, Sm90Barrier::kIssueWg0, wg);
          warpgroup_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
        };
        if constexpr (kDoubleBufferP) {
          // P of tile n goes to the register buffer that the P V in flight does not read, so a step never waits
          // for its P V: the next step's first wait finds it done, and only then is O rescaled (by n_prev's
          // factor, before the P V that adds n_prev's part). With one buffer the new P overwrites the registers P V
          // reads, and ptxas places the wait for P V before the softmax (it does, in every variant): the softmax
          // then overlaps only the other consumers' GEMMs.
          PipelineState read_v_done;  // the V stage of the P V in flight
          bool pv_in_flight = false;
          auto step = [&](auto& p_cur, auto& p_next) __attribute__((always_inline)) {
            const int tile = next_tile(n_prev, n_block_min);
            if (tile < n_block_min) return false;
            PipelineState read_v = read;  // tile n_prev
            ++read;
            warpgroup_wait<0>();  // the P V before (issued a softmax ago)
            if (pv_in_flight) pipeline_v.consumer_release(read_v_done);
            issue_scores(tile, read_v);
            rescale_output();
            pipeline_v.consumer_wait(read_v);
            warpgroup_gemm<false>(mma_pv, p_cur, tOrV(_, _, _, read_v.index()), tOrO);
            named_arrive(kIssueThreads, Sm90Barrier::kIssueWg0, next_wg);
            read_v_done = read_v;
            pv_in_flight = true;
            warpgroup_wait<1>();  // S done
            pipeline_k.consumer_release(read);
            softmax_of_tile(tile, false, state, bits);
            probabilities_to_operand(tile, p_next);
            n_prev = tile;
            return true;
          };
          bool p_in_second = false;  // P of n_prev is in tOrP2
          while (step(tOrP, tOrP2)) {
            if (!step(tOrP2, tOrP)) {
              p_in_second = true;
              break;
            }
          }
          warpgroup_wait<0>();  // also before tOrP is written: the last P V may read it
          if (pv_in_flight) pipeline_v.consumer_release(read_v_done);
          if (p_in_second) copy(tOrP2, tOrP);
          rescale_output();
        } else {
          // One buffer: after the softmax, the wait for P V; then O is rescaled by the change of the running max
          // and P becomes n's.
          for (n = next_tile(n, n_block_min); n >= n_block_min; n_prev = n, n = next_tile(n, n_block_min)) {
            PipelineState read_v = read;  // tile n_prev
            ++read;
            issue_scores(n, read_v);
            pipeline_v.consumer_wait(read_v);
            warpgroup_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
            named_arrive(kIssueThreads, Sm90Barrier::kIssueWg0, next_wg);
            warpgroup_wait<1>();  // S done
            pipeline_k.consumer_release(read);
            softmax_of_tile(n, false, state, bits);
            warpgroup_wait<0>();  // P V done
            pipeline_v.consumer_release(read_v);
            probabilities_to_operand(n, tOrP);
            rescale_output();
          }
        }
        // The last P V (tile n_prev), outside the ping-pong.
        zero_unseen_values(n_prev, read);
        pipeline_v.consumer_wait(read);
        warpgroup_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
        warpgroup_wait<0>();
        pipeline_v.consumer_release(read);
        ++read;
        if constexpr (Traits::kOwnOutputBuffer) shared.barrier_q_free.arrive();  // the producer may load the next Q
      }

      // ---- Epilogue: normalize, lse, then O through shared memory to this consumer's TMA store ----
      normalize_and_write_lse(o_rc, softmax, cS_rc, p, m0, q_len, batch_head, scale_log2, keep_scale);
      if (wave > 0) {  // the previous tile's store has read this consumer's rows of sO
        if (output_leader) tma_store_wait<0>();
        named_sync(128, Sm90Barrier::kOutputWg0, wg);
      }
      Tensor sO = make_tensor(make_smem_ptr(Traits::kOwnOutputBuffer ? shared.o.begin() : shared.q.begin()),
                              typename Traits::SmemLayoutO{});
      Tensor rO = convert_fragment<Element>(tOrO);
      auto smem_copy_o = make_tiled_copy_C(Copy_Atom<UniversalCopy<uint32_t>, Element>{}, mma_pv);
      auto smem_thr_copy_o = smem_copy_o.get_thread_slice(mma_tidx);
      copy(smem_copy_o, smem_thr_copy_o.retile_S(rO), smem_thr_copy_o.partition_D(sO));
      cutlass::arch::fence_view_async_shared();  // visible to the TMA (async proxy)
      named_sync(128, Sm90Barrier::kOutputWg0, wg);
      if (output_leader) {
        Tensor mO = args.tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim_v, p.num_heads, p.batch));
        Tensor gO = local_tile(mO(_, _, h, b), Shape<_64, Int<kHeadDim>>{},
                               make_coord(Traits::kMmaWarpGroups * w.m_block + wg, _0{}));
        Tensor sO_rows = local_tile(sO, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, _0{}));
        auto o_parts = tma_partition(args.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO_rows), group_modes<0, 2>(gO));
        copy(args.tma_o, get<1>(o_parts), get<0>(o_parts));
        tma_store_arrive();
      }
    }
    if (output_leader) tma_store_wait<0>();  // shared memory stays until the last store has read it
  }
#endif
}

}  // namespace cuda
}  // namespace tf_flash
