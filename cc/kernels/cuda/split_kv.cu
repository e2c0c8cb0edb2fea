// Split-KV's merge (FlashFwdParams::num_splits): the runs' outputs of each row, weighted by exp(lse_s - lse),
// into the call's output and lse. The merged lse is merge_split_lse's (split_kv.h), in a warp's lanes.
#include <cuda_runtime.h>

#include <cstdint>

#include "cutlass/numeric_types.h"

#include "cc/kernels/cuda/fwd_api.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace cuda {
namespace {

constexpr int kRowsPerBlock = 4;  // a warp per row
constexpr int kColumns = 8;       // per lane: one 16-byte vector of the row

// One warp per row (b, h, i) of the call. The lanes first take a run each (32 at a time) for its lse, the merged
// lse and the run's weight (warp shuffles); then each lane sums 8 columns over the runs in float32, the weights
// broadcast from their lanes, the runs' loads independent of each other so that they overlap. Head dims are
// multiples of 8 here (the 16-bit kernels'), so rows are whole 16-byte vectors.
template <class Element>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    merge_splits_kernel(const FlashFwdParams p, const FlashFwdParams run) {
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = int(threadIdx.x % 32);
  const int i = int(row % p.seqlen_q);
  const int64_t batch_head = row / p.seqlen_q;  // lse's order: (b * heads + h) * seqlen_q + i
  const int h = int(batch_head % p.num_heads), b = int(batch_head / p.num_heads);
  // Run s of this row: lse at run.lse[row + s * rows], O at partial + s * partial_stride (split_entry:
  // split * batch + b).
  const float* lse_runs = run.lse + row;
  const Element* partial = static_cast<const Element*>(run.out) + b * run.o_batch_stride + i * run.o_row_stride +
                           h * run.o_head_stride;
  const int64_t partial_stride = int64_t(p.batch) * run.o_batch_stride;

  float max_lse = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) max_lse = fmaxf(max_lse, lse_runs[s * rows]);
  for (int offset = 16; offset > 0; offset /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(~0u, max_lse, offset));
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(lse_runs[s * rows] - max_lse);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
  const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);

  const int d0 = lane * kColumns;
  const bool has_columns = d0 < p.head_dim_v;
  // Every lane loads, whatever its columns and the run's weight (lanes past the head dim read column 0's vector,
  // runs of weight 0 add nothing): loads under a branch each wait for the one before, and the merge is the
  // latency of these loads.
  const Element* columns = partial + (has_columns ? d0 : 0);
  float acc[kColumns] = {};
  for (int base = 0; base < p.num_splits; base += 32) {
    const int count = p.num_splits - base < 32 ? p.num_splits - base : 32;
    const float weight = lane < count ? split_weight(lse_runs[(base + lane) * rows], lse) : 0.f;
#pragma unroll 8
    for (int j = 0; j < count; ++j) {
      const float w = __shfl_sync(~0u, weight, j);
      const uint4 bits = *reinterpret_cast<const uint4*>(columns + (base + j) * partial_stride);
      const Element* values = reinterpret_cast<const Element*>(&bits);
#pragma unroll
      for (int c = 0; c < kColumns; ++c) acc[c] += w > 0.f ? w * float(values[c]) : 0.f;
    }
  }
  if (has_columns) {
    uint4 bits;
    Element* values = reinterpret_cast<Element*>(&bits);
#pragma unroll
    for (int c = 0; c < kColumns; ++c) values[c] = Element(acc[c]);
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.out) + b * p.o_batch_stride + i * p.o_row_stride +
                              h * p.o_head_stride + d0) = bits;
  }
  if (lane == 0 && p.lse != nullptr) p.lse[row] = lse;
}

}  // namespace

template <class Element>
cudaError_t merge_splits(const FlashFwdParams& p, const FlashFwdParams& run, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.num_heads * p.seqlen_q;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  merge_splits_kernel<Element><<<dim3(unsigned(blocks)), 32 * kRowsPerBlock, 0, stream>>>(p, run);
  return cudaGetLastError();
}

template cudaError_t merge_splits<cutlass::half_t>(const FlashFwdParams&, const FlashFwdParams&, cudaStream_t);
template cudaError_t merge_splits<cutlass::bfloat16_t>(const FlashFwdParams&, const FlashFwdParams&, cudaStream_t);

}  // namespace cuda
}  // namespace tf_flash
