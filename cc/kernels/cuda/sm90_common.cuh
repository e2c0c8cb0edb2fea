// What both Hopper kernels (fwd_kernel_sm90.h, bwd_kernel_sm90.h) share: the host-side checks and TMA views of
// their launchers, the layout views of a wgmma accumulator, one warpgroup GEMM, the TMA pipeline's parameters
// and the named barriers.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cutlass/arch/barrier.h"
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/pipeline/sm90_pipeline.hpp"

namespace tf_flash {
namespace cuda {

// The element mask a variant reads inside the tiles it runs (a template argument of each kernel and of the parts
// it changes): none, attn_mask's packed bits (packed_mask.h) or packed-document segment ids (a bit per score from
// q_segment_ids[row] == kv_segment_ids[col]). The family predicates (family.cu) send a call with both, and in the
// backward segment ids with a block mask, to the sm_80 family.
enum class ElementMask { kNone, kAttnMask, kSegments };

// ---- Host side of the launchers ----
// True when `kernel` runs from sm_90a machine code on the current device. The kernel bodies exist only in
// that code: a library built without sm_90a (or a GPU that runs another target's code) answers false, and
// the caller runs the sm_80 family instead. Asked once per kernel.
template <class Kernel>
bool has_sm90a_code(Kernel kernel) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.binaryVersion == 90 && attributes.ptxVersion == 90;
}

// A [batch, rows, heads, dim] tensor as the TMA descriptors see it: (rows, dim, heads, batch), dim
// contiguous.
template <class Element>
auto tma_gmem_view(const void* ptr, int rows, int dim, int heads, int batch, int64_t row_stride,
                   int64_t head_stride, int64_t batch_stride) {
  using namespace cute;
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(rows, dim, heads, batch),
                     make_stride(row_stride, _1{}, head_stride, batch_stride));
}

// ---- Layout views of a wgmma accumulator, shape ((2, 2, N/8), MMA_M, MMA_N) ----
// Row/column view: ((2, MMA_M), (2, N/8, MMA_N)); mode 0 of the fragment is (column pair, row half, n8 group).
template <class Layout>
__host__ __device__ constexpr auto gmma_acc_rowcol(Layout layout) {
  static_assert(decltype(cute::rank<0>(layout))::value == 3, "expected a wgmma accumulator");
  return cute::make_layout(cute::make_layout(cute::get<0, 1>(layout), cute::get<1>(layout)),
                           cute::make_layout(cute::get<0, 0>(layout), cute::get<0, 2>(layout), cute::get<2>(layout)));
}

// The accumulator of S reused as the register A operand of P V: two n8 groups form one k16 slice,
// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, N/16 * MMA_N).
template <class Layout>
__host__ __device__ constexpr auto gmma_acc_as_a_operand(Layout layout) {
  auto groups = cute::logical_divide(cute::get<0, 2>(layout), cute::Tile<cute::_2>{});  // ((2, N/16))
  return cute::make_layout(
      cute::make_layout(cute::get<0, 0>(layout), cute::get<0, 1>(layout), cute::get<0, 0>(groups)),
      cute::get<1>(layout), cute::coalesce(cute::make_layout(cute::get<0, 1>(groups), cute::get<2>(layout))));
}

// The accumulator of S as the 8-bit A operand of P V (fp8): k32 slices of four 4-byte registers,
// ((2, 2, N/8), MMA_M, MMA_N) -> ((4, 2, 2), MMA_M, N/32 * MMA_N), compact (CuTe's ALayout_64x32: k + 1, row + 8,
// k + 16). fp8_operand_from_probabilities fills it from S (sm90_fwd_traits.h says in which key order).
template <class Layout>
__host__ __device__ constexpr auto gmma_acc_as_fp8_a_operand(Layout layout) {
  using namespace cute;
  constexpr int kGroups = decltype(size<0, 2>(layout))::value * decltype(size<2>(layout))::value;
  static_assert(kGroups % 4 == 0, "whole k32 slices");
  return make_layout(make_shape(Shape<_4, _2, _2>{}, size<1>(layout), Int<kGroups / 4>{}));
}

// Converts S's probabilities (a wgmma accumulator of N/8 column groups, values in [0, 1]) to the fp8 A operand
// `p` (gmma_acc_as_fp8_a_operand). In each 16 values of S (four column groups: column pair 2t, 2t + 1 of group g
// at 4g + {0, 1} for row r, 4g + {2, 3} for row r + 8) the registers take, in order, row r's pairs of groups 0 and
// 1, row r + 8's, row r's of groups 2 and 3, row r + 8's: the A fragment's rows, with P's keys in the slot order
// of fp8_value_key_of_slot (sm90_fwd_traits.h). A renaming of registers, no data moves between threads.
template <class FragS, class FragP>
__device__ __forceinline__ void fp8_operand_from_probabilities(const FragS& s, FragP& p) {
  using namespace cute;
  using Element = typename FragP::value_type;
  static_assert(sizeof(Element) == 1 && decltype(size(s))::value == decltype(size(p))::value &&
                    decltype(size(s))::value % 16 == 0, "fp8 operand of the whole accumulator");
  cutlass::NumericArrayConverter<Element, float, 4, cutlass::FloatRoundStyle::round_to_nearest> convert;
  uint32_t* regs = reinterpret_cast<uint32_t*>(raw_pointer_cast(p.data()));
  CUTE_UNROLL
  for (int c = 0; c < decltype(size(s))::value / 16; ++c) {
    CUTE_UNROLL
    for (int r = 0; r < 4; ++r) {
      cutlass::Array<float, 4> in;
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) in[j] = s(16 * c + 8 * (r / 2) + 2 * (r % 2) + (j < 2 ? j : j + 2));
      const cutlass::Array<Element, 4> out = convert(in);
      regs[4 * c + r] = reinterpret_cast<const uint32_t&>(out);
    }
  }
}

// The accumulator as the sm_80 family's (values, MMA_M, MMA_N) of m16n8 atoms: ((2, 2), MMA_M, N/8), for
// code written for mma.sync fragments (apply_dropout). One wgmma atom along N (MMA_N == 1).
template <class Layout>
__host__ __device__ constexpr auto gmma_acc_as_mma_atoms(Layout layout) {
  static_assert(decltype(cute::size<2>(layout))::value == 1, "one wgmma atom along N");
  return cute::make_layout(cute::make_layout(cute::get<0, 0>(layout), cute::get<0, 1>(layout)), cute::get<1>(layout),
                           cute::get<0, 2>(layout));
}

// Issues one warpgroup GEMM (all k-slices of a and b into c) and commits it as one batch; the caller
// waits with warpgroup_wait. kZeroInit: c = a b, else c += a b.
template <bool kZeroInit, class TiledMma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& tiled_mma, FragA const& a, FragB const& b, FragC& c) {
  using namespace cute;
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<FragA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  tiled_mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(tiled_mma, a(_, _, k), b(_, _, k), c);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<FragA&>(a));
}

// Params of a TMA pipeline as both Hopper kernels run it: warpgroup 0 produces (thread 0 issues the copies
// and arms each stage for transaction_bytes), the `consumers` threads of the other warpgroups release.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipeline_params(uint32_t transaction_bytes, int consumers) {
  typename Pipeline::Params params;
  params.role = threadIdx.x < 128 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.transaction_bytes = transaction_bytes;
  params.is_leader = threadIdx.x == 0;
  params.num_consumers = consumers;
  return params;
}


template <class BarrierId>
__device__ __forceinline__ void named_sync(int threads, BarrierId id, int offset = 0) {
  cutlass::arch::NamedBarrier::sync(threads, uint32_t(id) + offset);
}
template <class BarrierId>
__device__ __forceinline__ void named_arrive(int threads, BarrierId id, int offset = 0) {
  cutlass::arch::NamedBarrier::arrive(threads, uint32_t(id) + offset);
}
// named_sync that also returns whether any of the threads passed pred = true (bar.red.or).
template <class BarrierId>
__device__ __forceinline__ bool named_sync_or(int threads, BarrierId id, bool pred) {
  const uint32_t barrier = uint32_t(id) + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(barrier), "r"(uint32_t(threads))
      : "memory");
  return any != 0;
}
// Waits until this thread's TMA stores and reduce-adds have been written (tma_store_wait waits only until
// they have read their shared-memory source).
__device__ __forceinline__ void tma_store_wait_writes() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }


}  // namespace cuda
}  // namespace tf_flash
