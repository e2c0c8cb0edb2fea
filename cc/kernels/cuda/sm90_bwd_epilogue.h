// The Hopper backward dK/dV kernel's (bwd_kernel_sm90.h) epilogue: a key tile's dK and dV, from the consumers'
// registers to the outputs.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cc/kernels/cuda/common.cuh"
#include "cc/kernels/cuda/sm90_bwd_traits.h"
#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

template <class Traits>
struct BwdEpilogueSm90 {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  // dK * scale and dV in the output dtype, rows < seqlen_k, columns < head_dim (_v), of the key tile at n0 of kv
  // head h_kv, batch b; thr_dkv: this thread's slice of the dK/dV GEMM, whose accumulators acc_dk, acc_dv are.
  template <class ThrMma, class Acc>
  __device__ static __forceinline__ void store(const FlashBwdParams& p, int b, int h_kv, int n0, ThrMma const& thr_dkv,
                                               Acc const& acc_dk, Acc const& acc_dv) {
    using namespace cute;
    Tensor cD = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Element* dk_ptr = static_cast<Element*>(p.d_k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
    Element* dv_ptr = static_cast<Element*>(p.d_v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); i += 2) {  // (even, odd) column pairs: one 4-byte store each
      const int64_t key = n0 + get<0>(cD(i));
      const int col = get<1>(cD(i));
      if (key >= p.seqlen_k) continue;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dk_ptr + key * p.k_row_stride + col) =
            pack_float2<Element>(acc_dk(i) * p.scale, acc_dk(i + 1) * p.scale);
      if (col < p.head_dim_v)
        *reinterpret_cast<uint32_t*>(dv_ptr + key * p.v_row_stride + col) =
            pack_float2<Element>(acc_dv(i), acc_dv(i + 1));
    }
  }
};

}  // namespace cuda
}  // namespace tf_flash
