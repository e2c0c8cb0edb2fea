// Full-float32 attention on the CUDA cores: what float32 inputs run on when TF's TF32 switch is off
// (tf.config.experimental.enable_tensor_float_32_execution(False), FlashFwdParams::allow_tf32 false), as
// TF's own float32 matmuls then leave the tensor cores too. Every product is a float32 FMA, nothing is
// rounded below float32, and the tensors are read where they are (no staging). The same params, mask rules
// (mask.h) and dropout draws (philox.h) as every other kernel, so every feature runs; slower than the
// tensor-core families by design (that is the precision the user asked for).
//
// Forward: one block per (query tile, head, batch), the online softmax over the visible key tiles.
// Backward, deterministic (no atomics): kernel dq per query tile (D, the rows' normalizers, dQ), then kernel
// dkdv per key tile (dK, dV over the query tiles of its kv head's group). Every score is the same chain of
// FMAs over the head dim, in order, in all three kernels: the backward's scores are the forward's bit for bit.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cc/kernels/cuda/float32_kernels.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/philox.h"

namespace tf_flash {
namespace cuda {
namespace {

constexpr float kNegInf = -INFINITY;
// Above this |lse|, half an ulp of the float32 lse would be the largest error of the recomputed
// probabilities: such query tiles recompute the forward's row max and sum (the CPU's rule, cpu/).
constexpr float kExactNormalizerLse = 64.f;

// Tiles of one head dim bucket (kDim >= max(head_dim, head_dim_v), 64, 128 or 256). A 16 x 16 thread
// grid: thread (ty, tx) owns the rows ty + 16 i of every tile it computes, so the 16 threads of a row are
// one half warp (row reductions by shuffles); of a score tile the key columns tx + 16 j, of an accumulator
// over the head dim the columns dim_col(tx, j) (runs of 4). Shared memory is read 4 floats at a time
// (LDS.128: a quarter of the instructions of scalar reads), so rows are a
// multiple of 4 floats apart, plus 4: the 8 rows a quarter warp reads at one depth fall in distinct banks.
template <int kDim>
struct Tiles {
  static_assert(kDim % 64 == 0, "head dim buckets are multiples of 64 (dim_col)");
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = kDim <= 128 ? 64 : 32;  // query rows
  static constexpr int kBlockN = kDim <= 64 ? 64 : 32;   // key columns (32 at 128: two blocks per SM fit)
  static constexpr int kRows = kBlockM / 16;              // query rows per thread
  static constexpr int kCols = kBlockN / 16;              // key columns per thread (scores), key rows (dK, dV)
  static constexpr int kDimCols = kDim / 16;              // head-dim columns per thread
  static constexpr int kStride = kDim + 4;
  static constexpr int kScoreStride = kBlockN + 4;
};

// Shared memory of one SM on the architecture being compiled (a block also takes 1 KiB of its own): A100's
// 164 KiB, Hopper's 228.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kSharedBytesPerSm = 164 * 1024;
#else
constexpr int kSharedBytesPerSm = 228 * 1024;
#endif

// Blocks per SM a kernel asks registers for (__launch_bounds__): two (128 registers a thread) where two
// blocks' shared memory fits, up to head dim 128. The loops wait on shared memory and barriers: one block
// of 8 warps left the FMA pipe 70% idle (ncu, H100), two made the step 1.22x (d64) and 1.09x (d128) faster.
// Where only one fits, asking for two would only spill.
constexpr int min_blocks(int kDim, int smem_bytes) {
  return kDim <= 128 && 2 * (smem_bytes + 1024) <= kSharedBytesPerSm ? 2 : 1;
}

// The head-dim column of accumulator entry j of thread tx: 4 consecutive columns per 64.
__device__ __forceinline__ int dim_col(int tx, int j) { return 4 * tx + 64 * (j / 4) + j % 4; }

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float at(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// rows x kDim floats of one head into shared memory (row stride kDim + 1); rows >= valid and columns >= dim
// are zeros (out-of-range rows never reach a product as garbage).
template <int kDim>
__device__ void load_rows(float* dst, const float* src, int64_t row_stride, int rows, int valid, int dim) {
  for (int i = threadIdx.x; i < rows * kDim; i += Tiles<kDim>::kThreads) {
    const int r = i / kDim, c = i % kDim;
    dst[r * Tiles<kDim>::kStride + c] = r < valid && c < dim ? src[r * row_stride + c] : 0.f;
  }
}

// acc[i][j] = sum over d < depth of A[row i][d] * B[row j][d], as one FMA chain in d order (the chain that
// makes every score, forward and backward). Rows ty + 16 i of A, tx + 16 j of B, both of stride `stride`;
// columns past depth are zeros in shared memory (load_rows), so the chain runs to a multiple of 4 unchanged.
template <int kI, int kJ>
__device__ __forceinline__ void gemm_rows(const float* a, const float* b, int stride, int depth, int ty, int tx,
                                          float (&acc)[kI][kJ]) {
#pragma unroll
  for (int i = 0; i < kI; ++i)
#pragma unroll
    for (int j = 0; j < kJ; ++j) acc[i][j] = 0.f;
  for (int d = 0; d < depth; d += 4) {
    float4 x[kI], y[kJ];
#pragma unroll
    for (int i = 0; i < kI; ++i) x[i] = lds4(a + (ty + 16 * i) * stride + d);
#pragma unroll
    for (int j = 0; j < kJ; ++j) y[j] = lds4(b + (tx + 16 * j) * stride + d);
#pragma unroll
    for (int dd = 0; dd < 4; ++dd)
#pragma unroll
      for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int j = 0; j < kJ; ++j) acc[i][j] = fmaf(at(x[i], dd), at(y[j], dd), acc[i][j]);
  }
}

// acc[i][j] += sum over k < depth of A(ty + 16 i, k) * B[k][dim_col(tx, j)]; A(r, k) = a[r * a_stride + k],
// or a[k * a_stride + r] when kTransposeA (dV = P^T dO, dK = dS^T Q). depth is a multiple of 4.
template <int kI, int kJ, bool kTransposeA>
__device__ __forceinline__ void gemm_accumulate(const float* a, int a_stride, const float* b, int b_stride, int depth,
                                                int ty, int tx, float (&acc)[kI][kJ]) {
  for (int k = 0; k < depth; k += 4) {
    float4 x[kI];
#pragma unroll
    for (int i = 0; i < kI; ++i) {
      if (kTransposeA) {
        x[i] = make_float4(a[k * a_stride + ty + 16 * i], a[(k + 1) * a_stride + ty + 16 * i],
                           a[(k + 2) * a_stride + ty + 16 * i], a[(k + 3) * a_stride + ty + 16 * i]);
      } else {
        x[i] = lds4(a + (ty + 16 * i) * a_stride + k);
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float4 y[kJ / 4];
#pragma unroll
      for (int jb = 0; jb < kJ / 4; ++jb) y[jb] = lds4(b + (k + kk) * b_stride + 4 * tx + 64 * jb);
#pragma unroll
      for (int i = 0; i < kI; ++i)
#pragma unroll
        for (int j = 0; j < kJ; ++j) acc[i][j] = fmaf(at(x[i], kk), at(y[j / 4], j % 4), acc[i][j]);
    }
  }
}

// What every kernel knows about its (batch, head): valid lengths, dropout, the kv head.
struct Head {
  int b, h, hkv;
  int64_t q_len, kv_len;
  uint64_t batch_head;
  DropoutSeed seed;
  uint32_t drop_threshold;
  float keep_scale;

  __device__ Head(const FlashFwdParams& p, int batch, int head)
      : b(batch), h(head), hkv(head / (p.num_heads / p.num_heads_kv)), q_len(valid_q_len(p, batch)),
        kv_len(valid_kv_len(p, batch)), batch_head(uint64_t(batch) * p.num_heads + head), seed(dropout_seed(p)),
        drop_threshold(dropout_threshold(p.dropout_rate)), keep_scale(dropout_keep_scale(p.dropout_rate)) {}

  // The factor dropout puts on entry (row, col): keep_scale or 0 (1 without dropout).
  __device__ float keep(const FlashFwdParams& p, int64_t row, int64_t col) const {
    if (!(p.dropout_rate > 0.f)) return 1.f;
    return dropout_keep(seed, batch_head, row, col, drop_threshold) ? keep_scale : 0.f;
  }
};

// The key tiles a query tile visits and how its element masks cover one of them (mask.h's rules).
struct KeyTile {
  bool any;   // some entry may be visible (else the tile is skipped)
  bool full;  // every valid (row, col) is visible: no per-entry test
};
__device__ KeyTile key_tile(const FlashFwdParams& p, const Head& hd, int64_t row0, int rows, int64_t col0, int cols,
                            const KeyRange& range) {
  const int64_t span = range.end - col0 < cols ? range.end - col0 : cols;
  const BlockCoverage cover = block_coverage(p, hd.b, hd.h, row0, row0 + rows, col0, col0 + span);
  const bool full = cover.all && p.attn_mask.data == nullptr &&
                    tile_fully_visible(p, row0, row0 + rows, col0, col0 + cols, hd.q_len, hd.kv_len);
  return {cover.any, full};
}

// The scores of the query tile in q_s against the key tile in k_s, as the forward computes them: the
// product chain, times scale, soft-capped, invisible entries replaced by -inf (never added to: a NaN of an
// invisible key does not survive).
template <int kDim>
__device__ void masked_scores(const FlashFwdParams& p, const Head& hd, const float* q_s, const float* k_s,
                              int64_t row0, int rows, int64_t col0, int cols, bool full, int ty, int tx,
                              float (&s)[Tiles<kDim>::kRows][Tiles<kDim>::kCols]) {
  using T = Tiles<kDim>;
  gemm_rows(q_s, k_s, T::kStride, p.head_dim, ty, tx, s);
  const float inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
#pragma unroll
  for (int i = 0; i < T::kRows; ++i) {
#pragma unroll
    for (int j = 0; j < T::kCols; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      float x = s[i][j] * p.scale;
      if (p.softcap > 0.f) x = tanhf(x * inv_softcap) * p.softcap;
      const bool in_tile = r < rows && c < cols;
      const bool vis = in_tile && (full || visible(p, hd.b, hd.h, row0 + r, col0 + c, hd.q_len, hd.kv_len));
      s[i][j] = vis ? x : kNegInf;
    }
  }
}

// dS through the soft-cap: d(softcap tanh(x / softcap)) / dx = 1 - tanh^2, tanh read back from the capped
// score (registers are what bound these kernels' occupancy).
__device__ __forceinline__ float softcap_grad(const FlashFwdParams& p, float capped) {
  const float t = capped / p.softcap;
  return 1.f - t * t;
}

// The backward's P from a (masked) score and its row's values (RowStats): 0 where the row sees nothing.
__device__ __forceinline__ float probability(float s, float ref, float inv_sum) {
  return ref == kNegInf ? 0.f : expf(s - ref) * inv_sum;
}

// dS = P (dP - D) of one entry (grad: dP with the dropout mask applied), through the soft-cap; exactly 0
// where P is: an invisible value row may have made dP NaN there, and s is -inf, whose soft-cap gradient
// would make 0 x inf. One definition for the dq and dk/dv kernels, which must agree on every dS.
__device__ __forceinline__ float score_gradient(const FlashFwdParams& p, float prob, float grad, float delta,
                                                float s) {
  if (prob == 0.f) return 0.f;
  const float ds = prob * (grad - delta);
  return p.softcap > 0.f ? ds * softcap_grad(p, s) : ds;
}

// Stores a per-thread accumulator of kAccRows x kDimCols (rows ty + 16 i, columns dim_col) times `factor`:
// rows < valid_rows from it, rows up to tile_rows as 0 (keys or queries past their lengths), columns <
// width.
template <int kDim, int kAccRows>
__device__ void store_rows(float* dst, int64_t row_stride, const float (&acc)[kAccRows][Tiles<kDim>::kDimCols],
                           float factor, int tile_rows, int valid_rows, int width, int ty, int tx) {
#pragma unroll
  for (int i = 0; i < kAccRows; ++i) {
    const int r = ty + 16 * i;
    if (r >= tile_rows) continue;
#pragma unroll
    for (int j = 0; j < Tiles<kDim>::kDimCols; ++j) {
      const int c = dim_col(tx, j);
      if (c < width) dst[r * row_stride + c] = r < valid_rows ? acc[i][j] * factor : 0.f;
    }
  }
}

// Marks in seen_s (kBlockN flags, cleared by the caller) the key columns some row of the tile sees.
template <int kDim>
__device__ void mark_seen(const float (&s)[Tiles<kDim>::kRows][Tiles<kDim>::kCols], int tx, int* seen_s) {
#pragma unroll
  for (int j = 0; j < Tiles<kDim>::kCols; ++j) {
    bool any = false;
#pragma unroll
    for (int i = 0; i < Tiles<kDim>::kRows; ++i) any |= s[i][j] != kNegInf;
    if (any) seen_s[tx + 16 * j] = 1;
  }
}

// Zeroes the rows of a K or V tile that no query row sees, so that 0 x NaN of padding never reaches a sum.
template <int kDim>
__device__ void zero_unseen_rows(float* tile_s, const int* seen_s) {
  for (int i = threadIdx.x; i < Tiles<kDim>::kBlockN * kDim; i += Tiles<kDim>::kThreads) {
    if (!seen_s[i / kDim]) tile_s[(i / kDim) * Tiles<kDim>::kStride + i % kDim] = 0.f;
  }
}

// A block's shared memory, carved in order from one buffer of kBytes: the query tile (and, backward, its
// dO), the key and value tiles, a score tile (P or dS), the backward's row values, the seen flags.
template <int kDim, bool kBackward>
struct SharedTiles {
  using T = Tiles<kDim>;
  static constexpr int kQueryTiles = kBackward ? 2 : 1;  // Q, and dO
  static constexpr int kRowValues = kBackward ? 3 : 0;   // ref, inv_sum, delta (dkdv)
  static constexpr int kFloats = kQueryTiles * T::kBlockM * T::kStride + 2 * T::kBlockN * T::kStride +
                                 T::kBlockM * T::kScoreStride + kRowValues * T::kBlockM;
  static constexpr int kBytes = int(sizeof(float)) * kFloats + int(sizeof(int)) * T::kBlockN;

  float *q, *d_out, *k, *v, *scores, *ref, *inv_sum, *delta;  // d_out and the row values: backward only
  int* seen;

  __device__ explicit SharedTiles(float* base)
      : q(base),
        d_out(q + T::kBlockM * T::kStride),
        k(q + kQueryTiles * T::kBlockM * T::kStride),
        v(k + T::kBlockN * T::kStride),
        scores(v + T::kBlockN * T::kStride),
        ref(scores + T::kBlockM * T::kScoreStride),
        inv_sum(ref + T::kBlockM),
        delta(inv_sum + T::kBlockM),
        seen(reinterpret_cast<int*>(base + kFloats)) {}
};
template <int kDim>
constexpr int fwd_smem_bytes() { return SharedTiles<kDim, false>::kBytes; }
template <int kDim>
constexpr int bwd_smem_bytes() { return SharedTiles<kDim, true>::kBytes; }

// Every bucket fits the 163 KiB an sm_80 block may use.
static_assert(fwd_smem_bytes<256>() <= 163 * 1024 && fwd_smem_bytes<128>() <= 163 * 1024, "shared memory");
static_assert(bwd_smem_bytes<256>() <= 163 * 1024 && bwd_smem_bytes<128>() <= 163 * 1024, "shared memory");

template <int kDim>
__global__ void __launch_bounds__(256, min_blocks(kDim, fwd_smem_bytes<kDim>()))
    flash_fwd_float32_kernel(const FlashFwdParams p) {
  using T = Tiles<kDim>;
  extern __shared__ __align__(16) float smem[];
  const SharedTiles<kDim, false> sm(smem);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const Head hd(p, blockIdx.z, blockIdx.y);
  const int64_t row0 = int64_t{blockIdx.x} * T::kBlockM;
  const int tile_rows = int(clamp_len(p.seqlen_q - row0, T::kBlockM));
  const int rows = int(clamp_len(hd.q_len - row0, tile_rows));
  const float* q = static_cast<const float*>(p.q) + hd.b * p.q_batch_stride + row0 * p.q_row_stride +
                   int64_t{hd.h} * p.q_head_stride;
  const float* k = static_cast<const float*>(p.k) + hd.b * p.k_batch_stride + int64_t{hd.hkv} * p.k_head_stride;
  const float* v = static_cast<const float*>(p.v) + hd.b * p.v_batch_stride + int64_t{hd.hkv} * p.v_head_stride;
  float* out = static_cast<float*>(p.out) + hd.b * p.o_batch_stride + row0 * p.o_row_stride +
               int64_t{hd.h} * p.o_head_stride;
  float* lse = p.lse + (int64_t{hd.b} * p.num_heads + hd.h) * p.seqlen_q + row0;

  float o[T::kRows][T::kDimCols] = {}, m[T::kRows], l[T::kRows];
#pragma unroll
  for (int i = 0; i < T::kRows; ++i) m[i] = kNegInf, l[i] = 0.f;
  if (rows > 0) {
    load_rows<kDim>(sm.q, q, p.q_row_stride, T::kBlockM, rows, p.head_dim);
    const KeyRange range = key_range_of_rows(p, row0, row0 + rows, hd.q_len, hd.kv_len);
    for (int64_t col0 = range.begin / T::kBlockN * T::kBlockN; col0 < range.end; col0 += T::kBlockN) {
      const int cols = int(clamp_len(hd.kv_len - col0, T::kBlockN));
      const KeyTile tile = key_tile(p, hd, row0, rows, col0, cols, range);
      if (!tile.any) continue;  // never loaded
      __syncthreads();          // the previous tile's readers are done
      load_rows<kDim>(sm.k, k + col0 * p.k_row_stride, p.k_row_stride, T::kBlockN, cols, p.head_dim);
      load_rows<kDim>(sm.v, v + col0 * p.v_row_stride, p.v_row_stride, T::kBlockN, cols, p.head_dim_v);
      if (threadIdx.x < T::kBlockN) sm.seen[threadIdx.x] = 0;
      __syncthreads();
      float s[T::kRows][T::kCols];
      masked_scores<kDim>(p, hd, sm.q, sm.k, row0, rows, col0, cols, tile.full, ty, tx, s);
      if (!tile.full) mark_seen<kDim>(s, tx, sm.seen);
#pragma unroll
      for (int i = 0; i < T::kRows; ++i) {
        float tile_max = kNegInf;
#pragma unroll
        for (int j = 0; j < T::kCols; ++j) tile_max = fmaxf(tile_max, s[i][j]);
        const float new_max = fmaxf(m[i], half_warp_max(tile_max));
        const float safe_max = new_max == kNegInf ? 0.f : new_max;
        const float correction = expf(m[i] - safe_max);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < T::kCols; ++j) {
          const float prob = expf(s[i][j] - safe_max);
          sum += prob;  // the normalizer sums the undropped probabilities
          sm.scores[(ty + 16 * i) * T::kScoreStride + tx + 16 * j] =
              prob * hd.keep(p, row0 + ty + 16 * i, col0 + tx + 16 * j);
        }
        l[i] = l[i] * correction + half_warp_sum(sum);
        m[i] = new_max;
#pragma unroll
        for (int j = 0; j < T::kDimCols; ++j) o[i][j] *= correction;
      }
      __syncthreads();
      if (!tile.full) {
        zero_unseen_rows<kDim>(sm.v, sm.seen);
        __syncthreads();
      }
      gemm_accumulate<T::kRows, T::kDimCols, false>(sm.scores, T::kScoreStride, sm.v,
                                                    T::kStride, T::kBlockN, ty, tx, o);
    }
  }
  // Rows that see nothing (and padded rows) get 0 and lse -inf, never NaN.
#pragma unroll
  for (int i = 0; i < T::kRows; ++i) {
    const int r = ty + 16 * i;
    if (r >= tile_rows) continue;
    const bool any = r < rows && l[i] > 0.f;
#pragma unroll
    for (int j = 0; j < T::kDimCols; ++j) {
      const int c = dim_col(tx, j);
      if (c < p.head_dim_v) out[r * p.o_row_stride + c] = any ? o[i][j] / l[i] : 0.f;
    }
    if (tx == 0) lse[r] = any ? m[i] + logf(l[i]) : kNegInf;
  }
}

// The backward's per-row values in scratch, [B, H, Sq] each: P = exp(S - ref) * inv_sum (ref = lse and
// inv_sum = 1, or the forward's exact row max and 1 / row sum at large |lse|) and D.
struct RowStats {
  float* ref;
  float* inv_sum;
  float* delta;
};
RowStats split_scratch(const FlashBwdParams& p) {
  const int64_t n = int64_t{p.batch} * p.num_heads * p.seqlen_q;
  return {p.scratch, p.scratch + n, p.scratch + 2 * n};
}

// Per query tile: D = rowsum(dO * O) - d_lse, the rows' normalizers (the exact ones at large |lse|, as the
// CPU does), then dQ = scale * sum over key tiles of dS K.
template <int kDim>
__global__ void __launch_bounds__(256, min_blocks(kDim, bwd_smem_bytes<kDim>()))
    flash_bwd_dq_float32_kernel(const FlashBwdParams p, const RowStats stats) {
  using T = Tiles<kDim>;
  extern __shared__ __align__(16) float smem[];
  const SharedTiles<kDim, true> sm(smem);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const Head hd(p, blockIdx.z, blockIdx.y);
  const int64_t row0 = int64_t{blockIdx.x} * T::kBlockM;
  const int tile_rows = int(clamp_len(p.seqlen_q - row0, T::kBlockM));
  const int rows = int(clamp_len(hd.q_len - row0, tile_rows));
  const int64_t q_offset = hd.b * p.q_batch_stride + row0 * p.q_row_stride + int64_t{hd.h} * p.q_head_stride;
  const int64_t o_offset = hd.b * p.o_batch_stride + row0 * p.o_row_stride + int64_t{hd.h} * p.o_head_stride;
  const float* k = static_cast<const float*>(p.k) + hd.b * p.k_batch_stride + int64_t{hd.hkv} * p.k_head_stride;
  const float* v = static_cast<const float*>(p.v) + hd.b * p.v_batch_stride + int64_t{hd.hkv} * p.v_head_stride;
  const float* out = static_cast<const float*>(p.out) + o_offset;
  const int64_t stat0 = (int64_t{hd.b} * p.num_heads + hd.h) * p.seqlen_q + row0;

  float dq[T::kRows][T::kDimCols] = {};
  if (rows > 0) {
    load_rows<kDim>(sm.q, static_cast<const float*>(p.q) + q_offset, p.q_row_stride, T::kBlockM, rows, p.head_dim);
    load_rows<kDim>(sm.d_out, static_cast<const float*>(p.d_out) + o_offset, p.o_row_stride, T::kBlockM, rows,
                    p.head_dim_v);
    __syncthreads();
    float ref[T::kRows], inv_sum[T::kRows], delta[T::kRows];
    bool exact = false;
#pragma unroll
    for (int i = 0; i < T::kRows; ++i) {
      const int r = ty + 16 * i;
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < T::kDimCols; ++j) {
        const int c = tx + 16 * j;
        if (r < rows && c < p.head_dim_v) dot = fmaf(sm.d_out[r * T::kStride + c], out[r * p.o_row_stride + c], dot);
      }
      dot = half_warp_sum(dot);
      ref[i] = r < rows ? p.lse[stat0 + r] : kNegInf;
      inv_sum[i] = 1.f;
      delta[i] = r < rows ? dot - (p.d_lse ? p.d_lse[stat0 + r] : 0.f) : 0.f;
      exact |= isfinite(ref[i]) && fabsf(ref[i]) > kExactNormalizerLse;
    }
    const KeyRange range = key_range_of_rows(p, row0, row0 + rows, hd.q_len, hd.kv_len);
    // Loops over the visible key tiles of this query tile, as the forward does; body(col0, cols, tile).
    auto for_each_key_tile = [&](bool with_values, auto&& body) {
      for (int64_t col0 = range.begin / T::kBlockN * T::kBlockN; col0 < range.end; col0 += T::kBlockN) {
        const int cols = int(clamp_len(hd.kv_len - col0, T::kBlockN));
        const KeyTile tile = key_tile(p, hd, row0, rows, col0, cols, range);
        if (!tile.any) continue;
        __syncthreads();
        load_rows<kDim>(sm.k, k + col0 * p.k_row_stride, p.k_row_stride, T::kBlockN, cols, p.head_dim);
        if (with_values)
          load_rows<kDim>(sm.v, v + col0 * p.v_row_stride, p.v_row_stride, T::kBlockN, cols, p.head_dim_v);
        if (threadIdx.x < T::kBlockN) sm.seen[threadIdx.x] = 0;
        __syncthreads();
        body(col0, cols, tile);
      }
    };
    float s[T::kRows][T::kCols], dp[T::kRows][T::kCols];
    if (__syncthreads_or(exact)) {
      // The forward's row max and sum, by the forward's own loop; P then as dense softmax computes it.
      float m[T::kRows], l[T::kRows];
#pragma unroll
      for (int i = 0; i < T::kRows; ++i) m[i] = kNegInf, l[i] = 0.f;
      for_each_key_tile(false, [&](int64_t col0, int cols, const KeyTile& tile) {
        masked_scores<kDim>(p, hd, sm.q, sm.k, row0, rows, col0, cols, tile.full, ty, tx, s);
#pragma unroll
        for (int i = 0; i < T::kRows; ++i) {
          float tile_max = kNegInf;
#pragma unroll
          for (int j = 0; j < T::kCols; ++j) tile_max = fmaxf(tile_max, s[i][j]);
          const float new_max = fmaxf(m[i], half_warp_max(tile_max));
          const float safe_max = new_max == kNegInf ? 0.f : new_max;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < T::kCols; ++j) sum += expf(s[i][j] - safe_max);
          l[i] = l[i] * expf(m[i] - safe_max) + half_warp_sum(sum);
          m[i] = new_max;
        }
      });
      bool renormalized[T::kRows];
#pragma unroll
      for (int i = 0; i < T::kRows; ++i) {
        renormalized[i] = l[i] > 0.f && isfinite(ref[i]) && fabsf(ref[i]) > kExactNormalizerLse;
        if (renormalized[i]) ref[i] = m[i], inv_sum[i] = 1.f / l[i];
      }
      // D of these rows as rowsum(P * dP) with P and dP as the backward computes them (at such logits P is
      // nearly one-hot and dS = P (dP - D) a difference of nearly equal numbers: D must carry dP's rounding).
      float p_dot_dp[T::kRows] = {};
      for_each_key_tile(true, [&](int64_t col0, int cols, const KeyTile& tile) {
        masked_scores<kDim>(p, hd, sm.q, sm.k, row0, rows, col0, cols, tile.full, ty, tx, s);
        gemm_rows(sm.d_out, sm.v, T::kStride, p.head_dim_v, ty, tx, dp);
#pragma unroll
        for (int i = 0; i < T::kRows; ++i)
#pragma unroll
          for (int j = 0; j < T::kCols; ++j) {
            const float prob = probability(s[i][j], ref[i], inv_sum[i]);
            const float grad = dp[i][j] * hd.keep(p, row0 + ty + 16 * i, col0 + tx + 16 * j);
            p_dot_dp[i] += prob == 0.f ? 0.f : prob * grad;
          }
      });
#pragma unroll
      for (int i = 0; i < T::kRows; ++i) {
        const float sum = half_warp_sum(p_dot_dp[i]);
        const int r = ty + 16 * i;
        if (renormalized[i]) delta[i] = sum - (p.d_lse ? p.d_lse[stat0 + r] : 0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < T::kRows; ++i) {
      const int r = ty + 16 * i;
      if (tx == 0 && r < rows) {
        stats.ref[stat0 + r] = ref[i];
        stats.inv_sum[stat0 + r] = inv_sum[i];
        stats.delta[stat0 + r] = delta[i];
      }
    }
    for_each_key_tile(true, [&](int64_t col0, int cols, const KeyTile& tile) {
      masked_scores<kDim>(p, hd, sm.q, sm.k, row0, rows, col0, cols, tile.full, ty, tx, s);
      if (!tile.full) mark_seen<kDim>(s, tx, sm.seen);
      gemm_rows(sm.d_out, sm.v, T::kStride, p.head_dim_v, ty, tx, dp);
#pragma unroll
      for (int i = 0; i < T::kRows; ++i)
#pragma unroll
        for (int j = 0; j < T::kCols; ++j) {
          const float prob = probability(s[i][j], ref[i], inv_sum[i]);
          const float grad = dp[i][j] * hd.keep(p, row0 + ty + 16 * i, col0 + tx + 16 * j);
          sm.scores[(ty + 16 * i) * T::kScoreStride + tx + 16 * j] = score_gradient(p, prob, grad, delta[i], s[i][j]);
        }
      __syncthreads();
      if (!tile.full) {  // a non-finite key no row sees must not reach dQ = dS K as 0 x NaN
        zero_unseen_rows<kDim>(sm.k, sm.seen);
        __syncthreads();
      }
      gemm_accumulate<T::kRows, T::kDimCols, false>(sm.scores, T::kScoreStride, sm.k,
                                                    T::kStride, T::kBlockN, ty, tx, dq);
    });
  }
  store_rows<kDim>(static_cast<float*>(p.d_q) + q_offset, p.q_row_stride, dq, p.scale, tile_rows, rows, p.head_dim,
                   ty, tx);
}

// Per key tile of one kv head: dV = sum of P^T dO and dK = scale * sum of dS^T Q over the query tiles of
// every head of its group that see the tile (P, dS recomputed from the dq kernel's row values).
template <int kDim>
__global__ void __launch_bounds__(256, min_blocks(kDim, bwd_smem_bytes<kDim>()))
    flash_bwd_dkdv_float32_kernel(const FlashBwdParams p, const RowStats stats) {
  using T = Tiles<kDim>;
  extern __shared__ __align__(16) float smem[];
  const SharedTiles<kDim, true> sm(smem);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int b = blockIdx.z, hkv = blockIdx.y, group = p.num_heads / p.num_heads_kv;
  const int64_t col0 = int64_t{blockIdx.x} * T::kBlockN;
  const int64_t q_len = valid_q_len(p, b), kv_len = valid_kv_len(p, b);
  const int tile_cols = int(clamp_len(p.seqlen_k - col0, T::kBlockN));
  const int cols = int(clamp_len(kv_len - col0, tile_cols));
  const int64_t k_offset = b * p.k_batch_stride + col0 * p.k_row_stride + int64_t{hkv} * p.k_head_stride;
  const int64_t v_offset = b * p.v_batch_stride + col0 * p.v_row_stride + int64_t{hkv} * p.v_head_stride;

  float dk[T::kCols][T::kDimCols] = {}, dv[T::kCols][T::kDimCols] = {};
  if (cols > 0) {
    load_rows<kDim>(sm.k, static_cast<const float*>(p.k) + k_offset, p.k_row_stride, T::kBlockN, cols, p.head_dim);
    load_rows<kDim>(sm.v, static_cast<const float*>(p.v) + v_offset, p.v_row_stride, T::kBlockN, cols, p.head_dim_v);
    const IndexRange queries = query_range_of_keys(p, col0, col0 + cols, q_len, kv_len);
    for (int h = hkv * group; h < (hkv + 1) * group; ++h) {
      const Head hd(p, b, h);
      const int64_t stat0 = (int64_t{b} * p.num_heads + h) * p.seqlen_q;
      for (int64_t row0 = queries.begin / T::kBlockM * T::kBlockM; row0 < queries.end; row0 += T::kBlockM) {
        const int rows = int(clamp_len(q_len - row0, T::kBlockM));
        const KeyRange range = key_range_of_rows(p, row0, row0 + rows, q_len, kv_len);
        if (range.end <= col0 || range.begin >= col0 + cols) continue;
        const KeyTile tile = key_tile(p, hd, row0, rows, col0, cols, range);
        if (!tile.any) continue;
        __syncthreads();
        const int64_t q_offset = b * p.q_batch_stride + row0 * p.q_row_stride + int64_t{h} * p.q_head_stride;
        const int64_t o_offset = b * p.o_batch_stride + row0 * p.o_row_stride + int64_t{h} * p.o_head_stride;
        load_rows<kDim>(sm.q, static_cast<const float*>(p.q) + q_offset, p.q_row_stride, T::kBlockM, rows, p.head_dim);
        load_rows<kDim>(sm.d_out, static_cast<const float*>(p.d_out) + o_offset, p.o_row_stride, T::kBlockM, rows,
                        p.head_dim_v);
        if (threadIdx.x < T::kBlockM) {
          const int r = threadIdx.x;
          sm.ref[r] = r < rows ? stats.ref[stat0 + row0 + r] : kNegInf;
          sm.inv_sum[r] = r < rows ? stats.inv_sum[stat0 + row0 + r] : 0.f;
          sm.delta[r] = r < rows ? stats.delta[stat0 + row0 + r] : 0.f;
        }
        __syncthreads();
        float s[T::kRows][T::kCols], dp[T::kRows][T::kCols];
        masked_scores<kDim>(p, hd, sm.q, sm.k, row0, rows, col0, cols, tile.full, ty, tx, s);
        gemm_rows(sm.d_out, sm.v, T::kStride, p.head_dim_v, ty, tx, dp);
#pragma unroll
        for (int i = 0; i < T::kRows; ++i) {
          const int r = ty + 16 * i;
          const float ref = sm.ref[r], inv_sum = sm.inv_sum[r];
#pragma unroll
          for (int j = 0; j < T::kCols; ++j) {
            const float prob = probability(s[i][j], ref, inv_sum);
            const float keep = hd.keep(p, row0 + r, col0 + tx + 16 * j);
            sm.scores[r * T::kScoreStride + tx + 16 * j] = prob * keep;  // the forward's dropped P
            s[i][j] = score_gradient(p, prob, dp[i][j] * keep, sm.delta[r], s[i][j]);
          }
        }
        __syncthreads();
        gemm_accumulate<T::kCols, T::kDimCols, true>(sm.scores, T::kScoreStride, sm.d_out,
                                                     T::kStride, T::kBlockM, ty, tx, dv);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < T::kRows; ++i)
#pragma unroll
          for (int j = 0; j < T::kCols; ++j) sm.scores[(ty + 16 * i) * T::kScoreStride + tx + 16 * j] = s[i][j];
        __syncthreads();
        gemm_accumulate<T::kCols, T::kDimCols, true>(sm.scores, T::kScoreStride, sm.q,
                                                     T::kStride, T::kBlockM, ty, tx, dk);
      }
    }
  }
  store_rows<kDim>(static_cast<float*>(p.d_k) + k_offset, p.k_row_stride, dk, p.scale, tile_cols, cols, p.head_dim,
                   ty, tx);
  store_rows<kDim>(static_cast<float*>(p.d_v) + v_offset, p.v_row_stride, dv, 1.f, tile_cols, cols, p.head_dim_v,
                   ty, tx);
}

// The head dim bucket of p: max(head_dim, head_dim_v) rounded up to 64, 128 or 256 (0: none).
int float32_bucket(const FlashFwdParams& p) {
  const int d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  return d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

// run(std::integral_constant<int, bucket>) for the head dim bucket of p; `none` when there is none.
template <class Result, class Run>
Result bucket_switch(const FlashFwdParams& p, Result none, const Run& run) {
  switch (float32_bucket(p)) {
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 256: return run(std::integral_constant<int, 256>{});
  }
  return none;
}

template <class Kernel, class... Args>
cudaError_t launch(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, const Args&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, 256, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

int float32_max_head_dim() { return 256; }

int float32_shared_bytes(const FlashFwdParams& p, Direction direction) {
  return bucket_switch(p, 0, [&](auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    return direction == Direction::kForward ? fwd_smem_bytes<kDim>() : bwd_smem_bytes<kDim>();
  });
}

cudaError_t run_flash_fwd_float32(const FlashFwdParams& p, cudaStream_t stream) {
  return bucket_switch(p, cudaErrorInvalidValue, [&](auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    const dim3 grid(unsigned((p.seqlen_q + Tiles<kDim>::kBlockM - 1) / Tiles<kDim>::kBlockM), p.num_heads, p.batch);
    return launch(flash_fwd_float32_kernel<kDim>, grid, fwd_smem_bytes<kDim>(), stream, p);
  });
}

int64_t bwd_float32_scratch_bytes(const FlashBwdParams& p) {
  return 3 * int64_t{p.batch} * p.num_heads * p.seqlen_q * int64_t{sizeof(float)};
}

cudaError_t run_flash_bwd_float32(const FlashBwdParams& p, cudaStream_t stream) {
  const RowStats stats = split_scratch(p);
  return bucket_switch(p, cudaErrorInvalidValue, [&](auto bucket) {
    constexpr int kDim = decltype(bucket)::value;
    using T = Tiles<kDim>;
    const dim3 q_grid(unsigned((p.seqlen_q + T::kBlockM - 1) / T::kBlockM), p.num_heads, p.batch);
    cudaError_t err = launch(flash_bwd_dq_float32_kernel<kDim>, q_grid, bwd_smem_bytes<kDim>(), stream, p, stats);
    if (err != cudaSuccess) return err;
    const dim3 k_grid(unsigned((p.seqlen_k + T::kBlockN - 1) / T::kBlockN), p.num_heads_kv, p.batch);
    return launch(flash_bwd_dkdv_float32_kernel<kDim>, k_grid, bwd_smem_bytes<kDim>(), stream, p, stats);
  });
}

}  // namespace cuda
}  // namespace tf_flash
