// The Hopper forward's consumer math (warpgroups 1 .. kMmaWarpGroups, 64 query rows each): S = Q K^T by wgmma
// from shared memory, the masked online softmax (lazy rescaling, the exponent vote), dropout on P, and
// O += P V with P from registers, in ping-pong with the other consumers and, where the registers allow, with P
// in two register buffers.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/fwd_kernel.h"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/cuda/sm90_fwd_scheduler.h"
#include "cc/kernels/cuda/sm90_fwd_traits.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// kGeneral: soft-capping and dropout (run-time switches inside) and the max always subtracted; an element mask
// (attn_mask, segment ids): one buffer of P. The masks themselves are FwdMaskSm90's (the `mask` arguments, its
// QueryTile).
template <class Traits, bool kGeneral, ElementMask kElementMask>
struct FwdConsumerSm90 {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  // Two register buffers of P (see the loops) where the registers allow: two consumers (240 each) at
  // head dims up to 128, in the plain variant (bytes of spills with two buffers: d256 plain 192, d128 with dropout
  // or masks more than with one). The softmax then overlaps the consumer's own P V: non-causal d128 runs 2-9% faster
  // than with one buffer at every length (b4 s4k h16: 0.87 against 0.91 ms, the tensor pipe 71% active against 66%).
  static constexpr bool kDoubleBufferP =
      Traits::kMmaWarpGroups == 2 && kHeadDim <= 128 && !kGeneral && kElementMask == ElementMask::kNone;
  // One FMA per score under a warp vote (fwd_kernel.h's kFmaExponentLimit) in the plain and attn_mask variants,
  // rather than (s - max) * scale_log2 always: one floating-point instruction fewer per score, where FADD and FMUL
  // are 40% of the d64 forward's instructions (d64 forward +1-4% through TF, d128 +1-2%, d256 +3-12%; attn_mask
  // and key masks +3-12%). The general variants (dropout, soft-capping, block masks) always subtract the max: the
  // vote makes dropout 6-9% slower there and block-sparse work -2..+5%.
  static constexpr bool kExponentVote = !kGeneral;
  // fp8: P leaves for e4m3 times 2^7: e4m3's subnormals end at 2^-9, so without an offset the probabilities below
  // about 2^-9.5 of their row's max would drop out of P V while the row sums (float32) keep them; with it, those
  // below 2^-16.5. A lazy threshold of 1 keeps P within 2^(7 + 1) = 256 (e4m3's largest is 448) and rescales O
  // only where a row's max rose more than 2x: the d128 and d256 forward 1.5-3% faster than FlashAttention-3's
  // offset of 2^8, which leaves no room above P's max and rescales at every rise. run() takes the offset out of
  // the sums, output_scale out of O.
  static constexpr int kPOffsetLog2 = Traits::kFp8 ? 7 : 0;
  static constexpr int kLazyRescaleLog2 = Traits::kFp8 ? 1 : int(OnlineSoftmax<1>::kLazyRescaleLog2);
  // Ping-pong: consumer wg issues after the one before it (its barrier counts that one's arrival and its
  // own wait: 2 x 128 threads), then lets the next one issue. Every consumer runs the same key tiles, so the
  // turns carry on across query tiles.
  static constexpr int kIssueThreads = 2 * 128;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;

  template <class Layout>
  using SmemTensor = decltype(cute::make_tensor(cute::make_smem_ptr(static_cast<Element*>(nullptr)), Layout{}));
  using SmemVt = SmemTensor<typename Traits::SmemLayoutVt>;
  using ThrMmaQK = decltype(std::declval<TiledMmaQK&>().get_thread_slice(0));
  using ThrMmaPV = decltype(std::declval<TiledMmaPV&>().get_thread_slice(0));
  using FragQ = decltype(std::declval<ThrMmaQK&>().partition_fragment_A(
      std::declval<SmemTensor<typename Traits::SmemLayoutQ>&>()));
  using FragK = decltype(std::declval<ThrMmaQK&>().partition_fragment_B(
      std::declval<SmemTensor<typename Traits::SmemLayoutK>&>()));
  using FragV = decltype(std::declval<ThrMmaPV&>().partition_fragment_B(std::declval<SmemVt&>()));
  using CoordS = decltype(std::declval<ThrMmaQK&>().partition_C(
      cute::make_identity_tensor(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{})));
  using CoordRC = decltype(cute::make_tensor(std::declval<CoordS&>().data(),
                                             gmma_acc_rowcol(std::declval<CoordS&>().layout())));
  static constexpr int kRows = decltype(cute::size<0>(std::declval<CoordRC&>()))::value;
  using FragO = decltype(cute::partition_fragment_C(std::declval<TiledMmaPV&>(),
                                                    cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using FragS = decltype(cute::partition_fragment_C(std::declval<TiledMmaQK&>(),
                                                    cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // P as the A operand of P V: S's accumulator layout seen as k16 slices (16-bit), or (fp8) the 8-bit A fragments
  // that fp8_operand_from_probabilities fills.
  using FragP = decltype(cute::make_tensor<Element>(
      std::conditional_t<Traits::kFp8, decltype(gmma_acc_as_fp8_a_operand(std::declval<FragS&>().layout())),
                         decltype(gmma_acc_as_a_operand(std::declval<FragS&>().layout()))>{}));

  // One query tile's registers and key-tile loop of this consumer thread.
  struct Tile {
    const int n_block_min, n_first;  // the key tiles run from n_first down to n_block_min
    const int64_t m0;
    const uint64_t batch_head;
    FragO tOrO;
    FragS tSrS;
    FragP tOrP;
    FragP tOrP2;  // kDoubleBufferP's second buffer
    OnlineSoftmax<kRows> softmax;
    // `correction` rescales O for the new running max, where `rescale_o` (warp-uniform) says it must.
    float correction[kRows];
    bool rescale_o = true;
    int n_prev;             // the tile whose P V is next
    uint8_t state;          // the tile table's entry of the tile whose S is next
    uint32_t bits[kRows] = {};  // and its attn_mask bits (FwdMaskSm90::QueryTile::load_mask_bits)

    template <class Mask>
    __device__ __forceinline__ Tile(const FwdTileWork& w, const Mask& mask, const FlashFwdParams& p)
        : n_block_min(w.keys.tile_begin),
          n_first(mask.next_tile(w.keys.tile_end, w.keys.tile_begin)),
          m0(w.m0),
          batch_head(uint64_t(w.b) * p.num_heads + w.h) {
      cute::clear(tOrO);
    }
    __device__ __forceinline__ bool has_work() const { return n_first >= n_block_min; }
    __device__ __forceinline__ auto s_rc() { return cute::make_tensor(tSrS.data(), gmma_acc_rowcol(tSrS.layout())); }
    __device__ __forceinline__ auto o_rc() { return cute::make_tensor(tOrO.data(), gmma_acc_rowcol(tOrO.layout())); }
  };

  const FlashFwdParams& p;
  typename Traits::SharedStorage& shared;
  // Copies of the kernel's pipelines (their barriers' addresses and this thread's role): this object holds no
  // reference to a local object of the kernel, whose address would then escape into it.
  Pipeline pipeline_k;
  Pipeline pipeline_v;
  const int mma_tidx;
  const int wg;  // consumer wg: query rows 64 wg .. 64 wg + 63 of the tile
  const int next_wg;
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  SmemVt sVt;
  // Q, S's A operand, stays put across the loops, and so do its wgmma descriptors, in registers. Rebuilt at each
  // GEMM instead, they would spare the d128 and d256 variants their spills (20-44 and 72-124 bytes), yet the d128
  // forward then runs even to 2% slower through TF (+1-4% in the harness) and d64 1-3% slower.
  FragQ tSrQ;
  FragK tSrK;  // (MMA, MMA_N, MMA_K, stage)
  FragV tOrV;  // (MMA, MMA_N, MMA_K, stage)
  // (row, column) inside the score tile of each accumulator element.
  CoordRC cS_rc;
  // The scores' factors; an fp8 forward sets them per tile (begin_tile: the descales of its batch entry and kv head).
  float scale_log2;
  const bool has_softcap;
  float softcap_in;
  const bool has_dropout;
  const uint32_t drop_threshold;
  const float keep_scale;
  PipelineState read;  // the K/V ring, carried across query tiles
  int q_loads = 0;     // query tiles of this CTA with work so far: barrier_q's phase
  // barrier_q_free: each consumer thread arrives once done with a tile's Q (after its last P V), or, where O
  // goes through Q's buffer, at the start of each tile with work but the CTA's first tile, once the stores of
  // the tiles before have read the buffer (FwdEpilogueSm90::free_q_buffer); the producer waits for that before
  // loading the next Q. (Freeing it after a tile's last S instead, so that the next Q loads during the last
  // softmax and P V, measures even at d64 and d128.)

  __device__ __forceinline__ FwdConsumerSm90(const FlashFwdParams& p, typename Traits::SharedStorage& shared,
                                             const Pipeline& pipeline_k, const Pipeline& pipeline_v, int mma_tidx,
                                             int wg)
      : p(p), shared(shared), pipeline_k(pipeline_k), pipeline_v(pipeline_v), mma_tidx(mma_tidx), wg(wg),
        next_wg(wg + 1 == Traits::kMmaWarpGroups ? 0 : wg + 1),
        sVt(cute::make_tensor(cute::make_smem_ptr(shared.v.begin()), typename Traits::SmemLayoutVt{})),
        tSrQ(mma_qk.get_thread_slice(mma_tidx).partition_fragment_A(
            cute::make_tensor(cute::make_smem_ptr(shared.q.begin()), typename Traits::SmemLayoutQ{}))),
        tSrK(mma_qk.get_thread_slice(mma_tidx).partition_fragment_B(
            cute::make_tensor(cute::make_smem_ptr(shared.k.begin()), typename Traits::SmemLayoutK{}))),
        tOrV(mma_pv.get_thread_slice(mma_tidx).partition_fragment_B(sVt)),
        cS_rc(coordinates(mma_qk.get_thread_slice(mma_tidx))),
        scale_log2(softmax_scale_log2(p)),
        has_softcap(kGeneral && p.softcap > 0.f),
        softcap_in(has_softcap ? softcap_input_scale(p) : 0.f),
        has_dropout(kGeneral && !Traits::kFp8 && p.dropout_rate > 0.f),  // fp8: refused before the launch
        drop_threshold(has_dropout ? dropout_threshold(p.dropout_rate) : 0u),
        keep_scale(has_dropout ? dropout_keep_scale(p.dropout_rate) : 1.f) {}
  static __device__ __forceinline__ CoordRC coordinates(const ThrMmaQK& thr_qk) {
    auto cS = thr_qk.partition_C(cute::make_identity_tensor(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
    return cute::make_tensor(cS.data(), gmma_acc_rowcol(cS.layout()));
  }

  // The descales' element of tile w's batch entry and kv head (params.h).
  __device__ __forceinline__ int64_t descale_index(const FwdTileWork& w) const {
    return int64_t(w.b) * p.descale_batch_stride + int64_t(w.h_kv) * p.descale_head_stride;
  }
  // Before query tile w: an fp8 forward folds q_descale * k_descale of w's batch entry and kv head into the scores'
  // factors (softmax_scale_log2 and softcap_input_scale of the dequantized inputs' scores; p.scale_exponent_device
  // is never set for fp8). Nothing for 16-bit inputs.
  __device__ __forceinline__ void begin_tile(const FwdTileWork& w) {
    if constexpr (Traits::kFp8) {
      const int64_t i = descale_index(w);
      const float score_scale = p.scale * (p.q_descale[i] * p.k_descale[i]);
      if (p.softcap > 0.f) {
        softcap_in = score_scale / p.softcap;  // scale_log2 stays log2(e): the capped scores carry the scale
      } else {
        scale_log2 = fmaxf(score_scale * 1.4426950408889634f, 1e-30f);  // never 0, as softmax_scale_log2
      }
    }
  }
  // The factor of O's normalization (epilogue): the dropout's keep scale, and an fp8 forward's v_descale.
  __device__ __forceinline__ float output_scale(const FwdTileWork& w) const {
    if constexpr (Traits::kFp8) {
      return keep_scale * p.v_descale[descale_index(w)] * (1.f / float(1 << kPOffsetLog2));  // and P's offset
    } else {
      return keep_scale;
    }
  }

  // Scores of tile n -> unnormalized probabilities, and the factor that rescales O (t.correction, t.rescale_o).
  template <class MaskTile>
  __device__ __forceinline__ void softmax_of_tile(Tile& t, const MaskTile& mask, int n, bool first_tile) {
    if (has_softcap) {  // the same operations as the sm_80 kernels' (fwd_kernel.h, bwd_kernel.h)
      CUTE_UNROLL
      for (int i = 0; i < cute::size(t.tSrS); ++i) t.tSrS(i) = p.softcap * tanhf(t.tSrS(i) * softcap_in);
    }
    auto s_rc = t.s_rc();
    mask.apply(p, s_rc, n, t.state, t.bits);
    t.rescale_o = t.softmax.template rescale_max<kLazyRescaleLog2>(s_rc, t.correction, scale_log2, first_tile);
    t.softmax.template exponentiate<kExponentVote, kPOffsetLog2>(s_rc, t.correction, scale_log2);
  }
  // Probabilities of tile n (after the row sums took them, as in dropout(softmax(s)) @ v) -> P operand.
  template <class FragPOut>
  __device__ __forceinline__ void probabilities_to_operand(Tile& t, int n, FragPOut& rP) {
    using namespace cute;
    if constexpr (Traits::kFp8) {
      fp8_operand_from_probabilities(t.tSrS, rP);
    } else {
      convert_fragment_into(t.tSrS, rP);
      if (has_dropout) {
        Tensor rP_atoms = make_tensor(rP.data(), gmma_acc_as_mma_atoms(t.tSrS.layout()));
        apply_dropout<kBlockN>(rP_atoms, cS_rc, p, t.batch_head, t.m0, int64_t(n) * kBlockN, drop_threshold);
      }
    }
  }
  __device__ __forceinline__ void rescale_output(Tile& t) {
    if (!t.rescale_o) return;
    auto o_rc = t.o_rc();
    CUTE_UNROLL
    for (int mi = 0; mi < cute::size<0>(o_rc); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < cute::size<1>(o_rc); ++ni) o_rc(mi, ni) *= t.correction[mi];
    }
  }

  // The start of a step of the loops: value rows of n_prev's V stage zeroed where needed (only edge tiles, and
  // tiles of the exact rule: FwdMaskSm90; uniform over the consumers), the tile's mask bits, then its
  // S = Q K^T issued in this consumer's ping-pong turn.
  template <class MaskTile>
  __device__ __forceinline__ void issue_scores(Tile& t, const MaskTile& mask, int tile, PipelineState read_v) {
    using namespace cute;
    mask.zero_unseen_values_in_loop(p, t.n_prev, t.n_first, pipeline_v, read_v, sVt);
    t.state = mask.state_of(tile);
    if (mask.element_masked(t.state)) mask.load_mask_bits(tile, t.bits);
    pipeline_k.consumer_wait(read);
    named_sync(kIssueThreads, Sm90Barrier::kIssueWg0, wg);
    warpgroup_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), t.tSrS);
  }

  // One tile: S = Q K^T, softmax, P of the first key tile, then the loop, then the last P V.
  template <class MaskTile>
  __device__ __forceinline__ void run(Tile& t, const MaskTile& mask) {
    using namespace cute;
    shared.barrier_q.wait(q_loads % 2);
    ++q_loads;
    const int n = t.n_first;
    // The mask bits of a tile are loaded before its S is waited for (their latency hides behind the GEMM).
    t.state = mask.state_of(n);
    if (mask.element_masked(t.state)) mask.load_mask_bits(n, t.bits);
    // First tile: S, softmax, P (no P V yet).
    pipeline_k.consumer_wait(read);
    warpgroup_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), t.tSrS);
    warpgroup_wait<0>();
    pipeline_k.consumer_release(read);
    softmax_of_tile(t, mask, n, true);
    probabilities_to_operand(t, n, t.tOrP);

    // Each step issues S = Q K^T of tile n and O += P V of the tile before (n_prev) together; the softmax of S
    // runs while the tensor cores do P V.
    t.n_prev = n;
    if constexpr (kDoubleBufferP) {
      loop_double_buffered(t, mask);
    } else {
      loop_single_buffer(t, mask);
    }
    // The last P V (tile n_prev), outside the ping-pong.
    mask.zero_unseen_values(p, t.n_prev, pipeline_v, read, sVt);
    pipeline_v.consumer_wait(read);
    warpgroup_gemm<false>(mma_pv, t.tOrP, tOrV(_, _, _, read.index()), t.tOrO);
    warpgroup_wait<0>();
    pipeline_v.consumer_release(read);
    ++read;
    if constexpr (Traits::kOwnOutputBuffer) shared.barrier_q_free.arrive();  // the producer may load the next Q
    if constexpr (kPOffsetLog2 != 0) {  // the sums without P's offset, for lse; O keeps it until output_scale
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) t.softmax.row_sum[mi] *= 1.f / float(1 << kPOffsetLog2);
    }
  }

  // P of tile n goes to the register buffer that the P V in flight does not read, so a step never waits
  // for its P V: the next step's first wait finds it done, and only then is O rescaled (by n_prev's
  // factor, before the P V that adds n_prev's part). With one buffer the new P overwrites the registers P V
  // reads, and ptxas places the wait for P V before the softmax (it does, in every variant): the softmax
  // then overlaps only the other consumers' GEMMs.
  template <class MaskTile>
  __device__ __forceinline__ void loop_double_buffered(Tile& t, const MaskTile& mask) {
    PipelineState read_v_done;  // the V stage of the P V in flight
    bool pv_in_flight = false;
    bool p_in_second = false;  // P of n_prev is in tOrP2
    while (double_buffered_step(t, mask, t.tOrP, t.tOrP2, read_v_done, pv_in_flight)) {
      if (!double_buffered_step(t, mask, t.tOrP2, t.tOrP, read_v_done, pv_in_flight)) {
        p_in_second = true;
        break;
      }
    }
    cute::warpgroup_wait<0>();  // also before tOrP is written: the last P V may read it
    if (pv_in_flight) pipeline_v.consumer_release(read_v_done);
    if (p_in_second) cute::copy(t.tOrP2, t.tOrP);
    rescale_output(t);
  }
  template <class MaskTile>
  __device__ __forceinline__ bool double_buffered_step(Tile& t, const MaskTile& mask, FragP& p_cur, FragP& p_next,
                                                       PipelineState& read_v_done, bool& pv_in_flight) {
    using namespace cute;
    const int tile = mask.next_tile(t.n_prev, t.n_block_min);
    if (tile < t.n_block_min) return false;
    PipelineState read_v = read;  // tile n_prev
    ++read;
    warpgroup_wait<0>();  // the P V before (issued a softmax ago)
    if (pv_in_flight) pipeline_v.consumer_release(read_v_done);
    issue_scores(t, mask, tile, read_v);
    rescale_output(t);
    pipeline_v.consumer_wait(read_v);
    warpgroup_gemm<false>(mma_pv, p_cur, tOrV(_, _, _, read_v.index()), t.tOrO);
    named_arrive(kIssueThreads, Sm90Barrier::kIssueWg0, next_wg);
    read_v_done = read_v;
    pv_in_flight = true;
    warpgroup_wait<1>();  // S done
    pipeline_k.consumer_release(read);
    softmax_of_tile(t, mask, tile, false);
    probabilities_to_operand(t, tile, p_next);
    t.n_prev = tile;
    return true;
  }

  // One buffer: after the softmax, the wait for P V; then O is rescaled by the change of the running max
  // and P becomes n's.
  template <class MaskTile>
  __device__ __forceinline__ void loop_single_buffer(Tile& t, const MaskTile& mask) {
    using namespace cute;
    for (int n = mask.next_tile(t.n_prev, t.n_block_min); n >= t.n_block_min;
         t.n_prev = n, n = mask.next_tile(n, t.n_block_min)) {
      PipelineState read_v = read;  // tile n_prev
      ++read;
      issue_scores(t, mask, n, read_v);
      pipeline_v.consumer_wait(read_v);
      warpgroup_gemm<false>(mma_pv, t.tOrP, tOrV(_, _, _, read_v.index()), t.tOrO);
      named_arrive(kIssueThreads, Sm90Barrier::kIssueWg0, next_wg);
      warpgroup_wait<1>();  // S done
      pipeline_k.consumer_release(read);
      softmax_of_tile(t, mask, n, false);
      warpgroup_wait<0>();  // P V done
      pipeline_v.consumer_release(read_v);
      probabilities_to_operand(t, n, t.tOrP);
      rescale_output(t);
    }
  }
};

}  // namespace cuda
}  // namespace tf_flash
