// The one interface of every tf_flash kernel, CPU and CUDA: plain data, no framework types.
// All strides are in elements and 64-bit (b*s*h*d passes 2^31 at long context).
#pragma once

#include <cstdint>

// Functions of the shared headers (mask.h, philox.h) compile for host and device under nvcc.
#if defined(__CUDACC__)
#define TF_FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TF_FLASH_HOST_DEVICE inline
#endif

namespace tf_flash {

// Rows per entry of the segment bounds (FlashFwdParams::q_segment_bounds). Kernel tiles are multiples of it;
// a tile that is not still gets a correct (wider) range.
constexpr int kSegmentBlock = 16;

// A boolean tensor broadcast to [batch, heads, rows, cols]: a stride of 0 repeats that axis.
struct BroadcastBoolMask {
  const bool* data = nullptr;  // nullptr: no mask
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
};

struct FlashFwdParams {
  // Layout [batch, seq, heads, dim]: q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv].
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // [B, Sq, H, Dv], dtype of q (fp8 inputs: bfloat16 or float16, out_float16)
  float* lse = nullptr;  // [B, H, Sq], natural log; -inf for a row that sees nothing

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int batch = 0, seqlen_q = 0, seqlen_k = 0;
  int num_heads = 0, num_heads_kv = 0;  // num_heads % num_heads_kv == 0 (GQA/MQA)
  int head_dim = 0, head_dim_v = 0;
  float scale = 1.f;  // applied to the scores before the max
  // When set (device memory: float32 inputs staged to float16 on the GPU, launch.h), the scores' scale
  // is scale * 2^(*scale_exponent_device): Q and K were normalized by powers of two the device chose.
  // The scale that dQ and dK carry stays `scale` (the staging undoes the rest on the way out).
  const int32_t* scale_exponent_device = nullptr;
  // Logit soft-capping (Gemma 2, FlashAttention-2): scaled scores s -> softcap * tanh(s / softcap) before
  // the softmax; 0 = off.
  float softcap = 0.f;

  // Masks, all combined by AND.
  bool causal = false;    // query i sees keys j <= i (top-left aligned; bottom_right moves row i)
  int window_left = -1;   // query i sees keys i-left .. i+right; -1 = unlimited on that side
  int window_right = -1;
  const int32_t* q_lengths = nullptr;   // [B] valid query prefix; nullptr = all valid
  const int32_t* kv_lengths = nullptr;  // [B] valid key prefix; nullptr = all valid
  BroadcastBoolMask attn_mask;          // element mask [B, H, Sq, Sk], True = attend
  BroadcastBoolMask block_mask;         // [B, H, num_q_blocks, num_k_blocks], False = skip block
  int block_q = 128, block_k = 128;     // the blocks block_mask describes
  int num_q_blocks = 0, num_k_blocks = 0;
  // Packed documents: query row i sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j]
  // ([B, Sq] and [B, Sk], contiguous; both nullptr = off). The kernels skip and run tiles whole by the
  // ids' range over each kSegmentBlock rows (segment_bounds, [B, ceil(S / kSegmentBlock)] pairs of
  // {min, max}), which the runner computes from the ids before the launch (segment_bounds_cpu / _cuda).
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const int32_t* q_segment_bounds = nullptr;
  const int32_t* kv_segment_bounds = nullptr;
  // Row i of this call is row i + query_offset of the attention: causal and window place a row there, and
  // dropout draws there, so that a slice of the queries against all the keys gives those rows of the
  // whole call (context parallelism, tf_flash/parallel.py). Lengths and element masks stay in this call's
  // rows. >= 0; a multiple of 16 with dropout (one Philox call holds rows r and r + 8 of 16, philox.h).
  int64_t query_offset = 0;
  // Bottom-right alignment of causal and window: row i of entry b is position i + kv_len(b) - seqlen_q, so
  // that the seqlen_q queries are the last positions of the entry's valid keys (new tokens against a KV
  // cache filled to kv_lengths[b]). Rows whose position is negative see nothing.
  bool bottom_right = false;
  // Rows that share one position, 2^position_shift of them: row i is position i >> position_shift (before
  // query_offset and the bottom-right shift), and seqlen_q >> position_shift positions make the bottom-right
  // alignment. The decode path packs the query heads of one KV head token by token into one tile this way
  // (tf_flash/_decode.py), so that causal rows of several new tokens keep their diagonals. A shift, not a
  // divisor: a division in the masks' per-row code costs the Hopper forward registers and spills. 0 with
  // dropout, q_lengths and the element masks read by row (a key mask, one row for all, is read as it is).
  int position_shift = 0;
  // Split-KV (the decode path, tf_flash/_decode.py): the visible key tiles of each (batch, head, query tile) are
  // cut into num_splits runs of consecutive tiles, each a thread block of its own, so that few query tiles
  // still fill the GPU; the runs' outputs merge by their lse in float32 (split_kv.h). A request: a kernel
  // that cannot split (block masks, segment ids, dropout, fp8, the float32 kernels) runs the call whole, and
  // the merge gives the same attention up to the rounding of the runs' outputs to the output dtype. Inside
  // a kernel num_splits > 1 means out and lse point at the runs' outputs, split_entry(split, b) of them
  // (contiguous [num_splits * batch, seqlen_q, heads, head_dim_v] and [num_splits * batch, heads,
  // seqlen_q]), which flash_fwd_cuda sets up in split_workspace (FlashFwdCudaSplitWorkspaceBytes of it).
  int num_splits = 1;
  void* split_workspace = nullptr;

  // Dropout on the probabilities; the mask is philox(seed, b, h, i, j), never stored.
  float dropout_rate = 0.f;
  uint64_t seed = 0, seed_offset = 0;
  // When set, the CUDA kernels read seed and offset from this device buffer instead (XLA on the GPU, where
  // the seed is an operand in device memory: reading it on the host would wait for the stream).
  const int64_t* seed_device = nullptr;

  // Bit-identical results for identical inputs on one device: the GPU backward then sums dQ in a fixed
  // order instead of by float atomics (the CPU always does; so does every forward).
  bool deterministic = false;

  // TF's TF32 switch (tf.config.experimental.enable_tensor_float_32_execution), read when the op runs as TF's
  // own GPU matmuls read it. On the GPU, float32 runs on float16 tensor-core operands at float32's range
  // (TF32 grade, launch.h) while it is on, and on the full-float32 kernels (CUDA cores) when it is off.
  bool allow_tf32 = true;

  // Device memory of flash_fwd_cuda_workspace_bytes (launch.h), when that asks for some: the Hopper forward
  // packs attn_mask there before it runs (cc/kernels/cuda/packed_mask.h). Without it that forward leaves
  // element masks to the sm_80 family.
  void* mask_workspace = nullptr;

  // FP8 (e4m3) inputs, which only the Hopper forward runs (launch.h: DType::kFloat8E4M3). Dequantization
  // factors, float32 in device memory: the factor of batch entry b and kv head h is
  // descale[b * descale_batch_stride + h * descale_head_stride] (both strides 0: one factor per tensor). The
  // kernel folds q_descale * k_descale into the scores' scale (and so into lse) and multiplies O by v_descale,
  // so that it computes the attention of the dequantized inputs.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t descale_batch_stride = 0, descale_head_stride = 0;
  bool out_float16 = false;  // an fp8 forward's output dtype: float16, else bfloat16
  // Device memory of flash_fwd_cuda_value_transpose_bytes (launch.h): an fp8 forward writes V^T there before
  // it runs (8-bit wgmma operands must be K-major, and V's keys are not contiguous).
  void* value_transposed = nullptr;
};

struct FlashBwdParams : FlashFwdParams {
  const void* d_out = nullptr;  // [B, Sq, H, Dv], strides as out
  void* d_q = nullptr;          // [B, Sq, H, D], strides as q
  void* d_k = nullptr;          // [B, Sk, Hkv, D], strides as k
  void* d_v = nullptr;          // [B, Sk, Hkv, Dv], strides as v
  const float* d_lse = nullptr; // [B, H, Sq] gradient into lse; nullptr = zero
  float* scratch = nullptr;     // device-specific workspace (dQ accumulators, D = rowsum(dO*O))
};

}  // namespace tf_flash
