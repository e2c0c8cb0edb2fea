// The passes of packed_mask.h: attn_mask -> bits and tile summaries, V -> non-finite tile flags.
#include "cc/kernels/cuda/packed_mask.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace tf_flash {
namespace cuda {
namespace {

constexpr int kPackThreads = 256;  // 8 warps x 8 rows: one 64-row group of one chunk per CTA

// Grid (chunk, row group, plane). Each warp reads 8 rows of the chunk, 4 keys per lane (128 contiguous
// bytes where the keys are), and lanes 0-3 assemble the four words from ballots: lane l holds keys 4 l + j,
// which are bit 2 (l / 2) + e of word 2 (l % 2) + j / 2 with e = j % 2.
__global__ void __launch_bounds__(kPackThreads) pack_mask_kernel(const FlashFwdParams p, const PackedMaskLayout layout) {
  const int64_t chunk = blockIdx.x, group = blockIdx.y, plane = blockIdx.z;
  const BroadcastBoolMask& m = p.attn_mask;
  const bool* base = m.data + (plane / layout.heads) * m.batch_stride + (plane % layout.heads) * m.head_stride;
  uint32_t* words = static_cast<uint32_t*>(p.mask_workspace);
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int64_t col0 = chunk * kMaskChunkKeys + 4 * lane;
  bool any = false, all = true;
  for (int r = 0; r < 8; ++r) {
    const int64_t row = group * kMaskRowGroup + warp * 8 + r;
    if (row >= layout.rows) break;  // uniform over the warp
    const bool* src = base + row * m.row_stride;
    uint32_t shown = 0;  // bit j: key col0 + j
    for (int j = 0; j < 4; ++j) {
      if (col0 + j < p.seqlen_k) {
        const bool v = src[(col0 + j) * m.col_stride];
        shown |= uint32_t(v) << j;
        any |= v;
        all &= v;
      }
    }
    uint32_t ballot[4];
    for (int j = 0; j < 4; ++j) ballot[j] = __ballot_sync(0xffffffffu, (shown >> j) & 1u);
    if (lane < 4) {
      const int q = lane;
      uint32_t word = 0;
      for (int i = 0; i < 16; ++i)
        for (int e = 0; e < 2; ++e) word |= ((ballot[2 * (q % 2) + e] >> (2 * i + q / 2)) & 1u) << (2 * i + e);
      words[layout.word_index(plane, row, chunk, q)] = word;
    }
  }
  any = __syncthreads_or(any);
  all = __syncthreads_and(all);
  if (threadIdx.x == 0) {
    static_cast<uint8_t*>(p.mask_workspace)[layout.summary_offset + layout.summary_index(plane, group, chunk)] =
        (any ? kMaskSomeVisible : 0) | (all ? kMaskAllVisible : 0);
  }
}

// Grid (64-key tile, kv head, batch): 1 where V holds a non-finite value (all exponent bits set), else 0.
// Rows of head_dim_v elements, 16-byte aligned (the Hopper forward's own requirement).
__global__ void __launch_bounds__(256) flag_value_tiles_kernel(const FlashFwdParams p, const PackedMaskLayout layout,
                                                               uint32_t exponent_bits) {
  const int64_t tile = blockIdx.x;
  const int h_kv = blockIdx.y, b = blockIdx.z;
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  const int vectors = p.head_dim_v / 8;
  const uint32_t pair_bits = exponent_bits | (exponent_bits << 16);
  bool bad = false;
  for (int idx = int(threadIdx.x); idx < kValueFlagKeys * vectors; idx += blockDim.x) {
    const int64_t key = tile * kValueFlagKeys + idx / vectors;
    if (key >= p.seqlen_k) break;
    const uint4 x = *reinterpret_cast<const uint4*>(v + key * p.v_row_stride + (idx % vectors) * 8);
    for (uint32_t w : {x.x, x.y, x.z, x.w}) {
      const uint32_t e = w & pair_bits;
      bad |= (e & 0xFFFFu) == exponent_bits || (e >> 16) == exponent_bits;
    }
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    static_cast<uint8_t*>(p.mask_workspace)[layout.value_flags_offset +
                                            layout.value_flag_index(b, h_kv, p.num_heads_kv, tile)] = bad;
  }
}

}  // namespace

cudaError_t pack_attention_mask(const FlashFwdParams& p, bool bfloat16, cudaStream_t stream) {
  const PackedMaskLayout layout(p);
  const int64_t planes = layout.batches * layout.heads;
  constexpr int64_t kMaxGridYZ = 65535, kMaxGridX = 2147483647;
  if (p.mask_workspace == nullptr || p.head_dim_v % 8 != 0 || p.v_row_stride % 8 != 0 || p.v_head_stride % 8 != 0 ||
      p.v_batch_stride % 8 != 0 || layout.row_groups > kMaxGridYZ || planes > kMaxGridYZ ||
      layout.chunks > kMaxGridX || layout.value_tiles > kMaxGridX || p.num_heads_kv > kMaxGridYZ ||
      p.batch > kMaxGridYZ)
    return cudaErrorInvalidValue;
  if (layout.chunks == 0 || planes == 0 || layout.rows == 0) return cudaSuccess;
  pack_mask_kernel<<<dim3(unsigned(layout.chunks), unsigned(layout.row_groups), unsigned(planes)), kPackThreads, 0,
                     stream>>>(p, layout);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.batch == 0 || p.num_heads_kv == 0) return err;
  const uint32_t exponent_bits = bfloat16 ? 0x7F80u : 0x7C00u;
  flag_value_tiles_kernel<<<dim3(unsigned(layout.value_tiles), unsigned(p.num_heads_kv), unsigned(p.batch)), 256, 0,
                            stream>>>(p, layout, exponent_bits);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_flash
