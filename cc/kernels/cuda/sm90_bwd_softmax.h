// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) element-wise step, per consumer thread, from the S^T and
// dP^T accumulators to P^T and dS^T in their place: P^T = exp2(S^T scale_log2 - lse2), dS^T = P^T (dP^T - D)
// (lse2, D from the preprocess), with the mask part's hidden entries replaced by 0, and in the general variant
// soft-capping (the forward's tanh) and dropout (the forward's Philox draws, philox.h, taken for the transposed
// tile: dropout_keep_bits_transposed).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/sm90_common.cuh"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// The forward's dropout keep bits of this thread's entries of the S^T tile (keys x queries) at (n0, m0):
// bit mi * kCols + ni of the accumulator's row/column view, where ni = 2g + (query & 1) for n8 group g.
// philox.h lays the draws out for (query, key) fragments; in the transposed tile a thread holds keys r and
// r + 8 of its warp's 16 and the query pairs (2t, 2t + 1) of every n8 group, so one Philox call holds
// entries of two lanes (r even and odd: lane and lane ^ 4). Each lane draws the calls of its own query
// parity and passes the other lane its bits with one shuffle: 4 calls per 32 entries, twice the forward's
// rate (the other warp of the 32-key call draws it too).
template <int kCols, class CoordRC>
__device__ __forceinline__ uint32_t dropout_keep_bits_transposed(CoordRC const& cS_rc, const DropoutSeed& seed,
                                                                 uint64_t batch_head, int m0, int n0,
                                                                 uint32_t threshold2) {
  using namespace cute;
  static_assert(kCols % 4 == 0 && 2 * kCols <= 32, "rows r, r + 8; whole 16-query call blocks; one bit each");
  const int key0 = n0 + get<0>(cS_rc(0, 0));   // key r (mi 0); key r + 8 (mi 1) shares its Philox call
  const int query0 = m0 + get<1>(cS_rc(0, 0));  // query 2t of n8 group 0
  const int parity = key0 & 1;
  // Philox words hold n8 key groups: key r's is 0 or 2 (r < 8 in a 16-key warp slice), r + 8's the next.
  const bool high_words = ((key0 >> 3) & 3) != 0;
  // dropout_keep_bits4 gives bit 2 * (query row half) + (key & 1); in the call of query parity `parity`
  // this lane's keys are the bits of that parity, which are also their places in the result (ni = 2g + parity).
  const uint32_t own = parity ? 0xAu : 0x5u;
  uint32_t keep = 0, other = 0;  // other: lane ^ 4's entries, at the places of their key parity
  CUTE_UNROLL
  for (int block = 0; block < kCols / 4; ++block) {  // 16 queries per call: n8 groups 2 block, 2 block + 1
    const Philox4 draws = dropout_draws(seed, batch_head, query0 + 16 * block + parity, key0);
    CUTE_UNROLL
    for (int mi = 0; mi < 2; ++mi) {
      const uint32_t bits = dropout_keep_bits4(high_words ? draws.x[2 + mi] : draws.x[mi], threshold2);
      keep |= (bits & own) << (mi * kCols + 4 * block);
      other |= (bits & (own ^ 0xFu)) << (mi * kCols + 4 * block);
    }
  }
  // Lane ^ 4 drew the other query parity: its bits for this lane sit at this lane's key parity; each moves to
  // its neighbour, the place of that query parity.
  const uint32_t theirs = __shfl_xor_sync(0xffffffffu, other, 4);
  return keep | ((theirs & 0x55555555u) << 1) | ((theirs >> 1) & 0x55555555u);
}

// kGeneral: soft-capping and dropout (run-time switches inside), kept out of the plain variant's registers.
template <class Traits, bool kGeneral>
struct BwdSoftmaxGradSm90 {
  const FlashBwdParams& p;
  const float scale_log2;  // the forward's factor (mask.h)
  const bool has_softcap;
  const float softcap_in;
  const bool has_dropout;
  const uint32_t threshold2;
  const float keep_scale;
  const DropoutSeed seed;

  __device__ __forceinline__ explicit BwdSoftmaxGradSm90(const FlashBwdParams& params)
      : p(params),
        scale_log2(softmax_scale_log2(params)),
        has_softcap(kGeneral && params.softcap > 0.f),
        softcap_in(has_softcap ? softcap_input_scale(params) : 0.f),
        has_dropout(kGeneral && params.dropout_rate > 0.f),
        threshold2(has_dropout ? dropout_threshold(params.dropout_rate) * 0x10001u : 0u),
        keep_scale(has_dropout ? dropout_keep_scale(params.dropout_rate) : 1.f),
        seed(has_dropout ? dropout_seed(params) : DropoutSeed{0, 0, 0}) {}

  // The dropout keep bits (bit mi * kCols + ni, 1: kept) of this thread's entries of the tile of query head h
  // at (m0, n0); only the general variant drops (64-query tiles: 32 entries a thread).
  template <class CoordRC>
  __device__ __forceinline__ uint32_t draw_keep(CoordRC const& cS_rc, int b, int h, int m0, int n0) const {
    if constexpr (kGeneral) {
      constexpr int kCols = decltype(cute::size<1>(cS_rc))::value;
      return dropout_keep_bits_transposed<kCols>(cS_rc, seed, uint64_t(b) * p.num_heads + h, m0, n0, threshold2);
    }
    return 0u;
  }

  // acc_s, acc_dp: S^T and dP^T (the dP^T GEMM may still run: waited for here, after what runs beside it), in
  // place of which P^T and dS^T; hidden: the entries to replace by 0 (BwdMaskSm90::apply); keep: the dropout
  // bits; stage_lse2, stage_dvec: lse2 and D of the tile's query rows, read where they are used.
  template <class TileBits, class AccS, class AccdP, class CoordRC>
  __device__ __forceinline__ void apply(AccS& acc_s, AccdP& acc_dp, CoordRC const& cS_rc, TileBits hidden,
                                        uint32_t keep, const float* stage_lse2, const float* stage_dvec) const {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(cS_rc))::value, kCols = decltype(size<1>(cS_rc))::value;
    Tensor S = make_tensor(acc_s.data(), gmma_acc_rowcol(acc_s.layout()));
    Tensor dP = make_tensor(acc_dp.data(), gmma_acc_rowcol(acc_dp.layout()));
    auto lse2 = [&](int ni) { return stage_lse2[get<1>(cS_rc(0, ni))]; };
    auto dvec = [&](int ni) { return stage_dvec[get<1>(cS_rc(0, ni))]; };
    if constexpr (!kGeneral) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          // Never above 0 (bwd_kernel.h's probabilities): a rounded lse must not make P > 1. Leaving out
          // this clamp and the selects below in tiles that need neither (under a warp vote) measures
          // 0.91-1.0 of this: d64 spills more, d128 runs 4-9% slower from 4k.
          const float prob = fast_exp2(fminf(S(mi, ni) * scale_log2 - lse2(ni), 0.f));
          S(mi, ni) = (hidden >> (mi * kCols + ni)) & 1u ? 0.f : prob;
        }
      }
      warpgroup_wait<0>();  // dP^T done
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          const float ds = S(mi, ni) * (dP(mi, ni) - dvec(ni));
          dP(mi, ni) = (hidden >> (mi * kCols + ni)) & 1u ? 0.f : ds;
        }
      }
    } else {
      // The tanh of soft-capping while dP^T is computed; then P and dS in one pass, so that the tanh needs no
      // second register array.
      if (has_softcap) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanhf(acc_s(i) * softcap_in);
      }
      warpgroup_wait<0>();  // dP^T done
      // The dropped entries as one word (none without dropout, where keep_scale is 1 and the products below are
      // exact), so that each entry tests one bit: testing has_dropout and the kept bit per entry kept the switch as
      // a predicate beside the loop's (d64 general + attn_mask 44 / 52 bytes of spills and 8024 instructions
      // against 0 / 0 and 7672 this way; d128 general 160 / 196 against 4 / 8).
      const uint32_t dropped = has_dropout ? ~keep : 0u;
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          const int bit = mi * kCols + ni;
          // Soft-capping: the forward's capped score (fwd_kernel_sm90.h); d(capped)/d(raw) = 1 - tanh^2,
          // the scale applied with dK's and dQ's.
          float score = S(mi, ni), dtanh = 1.f;
          if (has_softcap) {
            dtanh = 1.f - score * score;
            score = p.softcap * score;
          }
          const float prob = fast_exp2(fminf(score * scale_log2 - lse2(ni), 0.f));
          const bool drop = (dropped >> bit) & 1u;
          // With dropout, dP is masked and scaled as P was in the forward (bwd_kernel.h's scores_gradient),
          // and dV takes the dropped probabilities P Z / keep_prob.
          const float dpv = drop ? 0.f : dP(mi, ni) * keep_scale;
          float ds = prob * (dpv - dvec(ni));
          if (has_softcap) ds *= dtanh;
          const bool hid = (hidden >> bit) & 1u;
          dP(mi, ni) = hid ? 0.f : ds;
          S(mi, ni) = hid || drop ? 0.f : prob * keep_scale;
        }
      }
    }
  }
};

}  // namespace cuda
}  // namespace tf_flash
