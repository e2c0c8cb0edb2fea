// The mask passes that run before the kernels: attn_mask -> bits and tile summaries, V -> non-finite tile
// flags (packed_mask.h), segment ids -> their bounds per kSegmentBlock rows (launch.h).
#include "cc/kernels/cuda/packed_mask.h"

#include "cc/kernels/flash/launch.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace tf_flash {
namespace cuda {
namespace {

constexpr int kPackThreads = 256;

// Grid (key chunk, row group, plane): one 64 x 128 tile of the mask per CTA, read into shared memory (each
// thread 32 bytes of one row), then each thread assembles its words of the packing, and the CTA its summary.
template <MaskPacking kPacking>
__global__ void __launch_bounds__(kPackThreads) pack_mask_kernel(const FlashFwdParams p, const PackedMaskLayout layout,
                                                                 uint8_t* workspace) {
  __shared__ uint8_t tile[kMaskRowGroup][kMaskChunkKeys];
  const int64_t chunk = blockIdx.x, group = blockIdx.y, plane = blockIdx.z;
  const BroadcastBoolMask& m = p.attn_mask;
  const bool* base = m.data + (plane / layout.heads) * m.batch_stride + (plane % layout.heads) * m.head_stride;
  const int tid = int(threadIdx.x);
  bool any = false, all = true;
  {
    const int r = tid / 4, c0 = tid % 4 * 32;
    const int64_t row = group * kMaskRowGroup + r, key0 = chunk * kMaskChunkKeys + c0;
    const bool* src = base + row * m.row_stride + key0 * m.col_stride;
    if (row < layout.rows && key0 + 32 <= layout.keys && m.col_stride == 1 &&
        reinterpret_cast<uintptr_t>(src) % 16 == 0) {
      // Contiguous and aligned (the common case): two 16-byte loads, the warp's rows in 128-byte segments.
      uint4 bytes[2] = {reinterpret_cast<const uint4*>(src)[0], reinterpret_cast<const uint4*>(src)[1]};
      const uint8_t* shown = reinterpret_cast<const uint8_t*>(bytes);
      for (int c = 0; c < 32; ++c) {
        tile[r][c0 + c] = shown[c] != 0;
        any |= shown[c] != 0;
        all &= shown[c] != 0;
      }
    } else {
      for (int c = 0; c < 32; ++c) {
        const bool inside = row < layout.rows && key0 + c < layout.keys;
        const bool shown = inside && src[c * m.col_stride];
        tile[r][c0 + c] = shown;
        any |= shown;
        all &= shown || !inside;
      }
    }
  }
  __syncthreads();
  if constexpr (kPacking == MaskPacking::kForward) {  // row tid / 4, word tid % 4: keys 8 i + 2 q + e
    const int r = tid / 4, q = tid % 4;
    const int64_t row = group * kMaskRowGroup + r;
    if (row < layout.rows) {
      uint32_t word = 0;
      for (int i = 0; i < 16; ++i)
        for (int e = 0; e < 2; ++e) word |= uint32_t(tile[r][8 * i + 2 * q + e]) << (2 * i + e);
      reinterpret_cast<uint32_t*>(workspace)[layout.word_index(plane, row, chunk, q)] = word;
    }
  } else {  // key c, word q: rows 8 i + 2 q + e of the group (a broadcast row axis: row 0 for all)
    for (int idx = tid; idx < kMaskChunkKeys * 4; idx += kPackThreads) {
      const int c = idx / 4, q = idx % 4;
      const int64_t key = chunk * kMaskChunkKeys + c;
      if (key >= layout.keys) break;
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i)
        for (int e = 0; e < 2; ++e) word |= uint32_t(tile[layout.rows > 1 ? 8 * i + 2 * q + e : 0][c]) << (2 * i + e);
      reinterpret_cast<uint16_t*>(workspace)[layout.word_index_t(plane, key, group, q)] = uint16_t(word);
    }
  }
  any = __syncthreads_or(any);
  all = __syncthreads_and(all);
  if (tid == 0) {
    workspace[layout.summary_offset + layout.summary_index(plane, group, chunk)] =
        (any ? kMaskSomeVisible : 0) | (all ? kMaskAllVisible : 0);
  }
}

// Grid (64-key tile, kv head, batch): 1 where V holds a non-finite value (all exponent bits set), else 0.
// Rows of head_dim_v elements, 16-byte aligned (the Hopper forward's own requirement).
__global__ void __launch_bounds__(256) flag_value_tiles_kernel(const FlashFwdParams p, const PackedMaskLayout layout,
                                                               uint8_t* workspace, uint32_t exponent_bits) {
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
    workspace[layout.value_flags_offset + layout.value_flag_index(b, h_kv, p.num_heads_kv, tile)] = bad;
  }
}

// One thread per kSegmentBlock rows: {min, max} of their ids, and the entry's flag set where they (or the
// step to the next block) decrease (launch.h: segment bounds; the flags start at 0).
__global__ void segment_bounds_kernel(const int32_t* ids, int64_t seqlen, int64_t blocks_per_row, int64_t total,
                                      int32_t* bounds) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t b = i / blocks_per_row, begin = (i % blocks_per_row) * kSegmentBlock;
  const int64_t end = begin + kSegmentBlock < seqlen ? begin + kSegmentBlock : seqlen;
  const int32_t* row = ids + b * seqlen;
  int32_t lo = row[begin], hi = row[begin];
  bool sorted = true;
  for (int64_t j = begin + 1; j < end; ++j) {
    lo = min(lo, row[j]);
    hi = max(hi, row[j]);
    sorted &= row[j - 1] <= row[j];
  }
  if (end < seqlen) sorted &= row[end - 1] <= row[end];
  bounds[2 * i] = lo;
  bounds[2 * i + 1] = hi;
  if (!sorted) bounds[2 * total + b] = 1;
}

}  // namespace

cudaError_t pack_attention_mask(const FlashFwdParams& p, const PackedMaskLayout& layout, void* workspace,
                                bool bfloat16, cudaStream_t stream, bool scan_values) {
  const int64_t planes = layout.batches * layout.heads;
  const bool forward = layout.packing == MaskPacking::kForward;
  if (workspace == nullptr || !layout.packable(p)) return cudaErrorInvalidValue;  // the family choice asked first
  if (layout.key_chunks == 0 || planes == 0 || layout.rows == 0) return cudaSuccess;
  uint8_t* bytes = static_cast<uint8_t*>(workspace);
  const dim3 grid(unsigned(layout.key_chunks), unsigned(layout.row_groups), unsigned(planes));
  if (forward) {
    pack_mask_kernel<MaskPacking::kForward><<<grid, kPackThreads, 0, stream>>>(p, layout, bytes);
  } else {
    pack_mask_kernel<MaskPacking::kBackward><<<grid, kPackThreads, 0, stream>>>(p, layout, bytes);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !forward || p.batch == 0 || p.num_heads_kv == 0) return err;
  if (!scan_values) {
    return cudaMemsetAsync(bytes + layout.value_flags_offset, 1,
                           size_t(int64_t(p.batch) * p.num_heads_kv * layout.value_tiles), stream);
  }
  const uint32_t exponent_bits = bfloat16 ? 0x7F80u : 0x7C00u;
  flag_value_tiles_kernel<<<dim3(unsigned(layout.value_tiles), unsigned(p.num_heads_kv), unsigned(p.batch)), 256, 0,
                            stream>>>(p, layout, bytes, exponent_bits);
  return cudaGetLastError();
}

}  // namespace cuda

int flash_cuda_segment_bounds(const int32_t* ids, int batch, int64_t seqlen, int32_t* bounds, void* stream) {
  const int64_t blocks_per_row = (seqlen + kSegmentBlock - 1) / kSegmentBlock;
  const int64_t total = int64_t{batch} * blocks_per_row;
  if (total == 0) return cudaSuccess;
  const cudaError_t err = cudaMemsetAsync(bounds + 2 * total, 0, sizeof(int32_t) * batch,
                                          static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return err;
  constexpr int kThreads = 256;
  cuda::segment_bounds_kernel<<<unsigned((total + kThreads - 1) / kThreads), kThreads, 0,
                                static_cast<cudaStream_t>(stream)>>>(ids, seqlen, blocks_per_row, total, bounds);
  return cudaGetLastError();
}

}  // namespace tf_flash
