// The AVX512_BF16 path's products (cpu_isa.h, tf_flash::cpu_avx512bf16): float32 operands rounded to bfloat16 and
// packed in pairs for vdpbf16ps, float32 accumulation, 16 lanes. The only file compiled with -mavx512bf16 (files
// named *_avx512bf16.cc: cc/BUILD, tools/gpu.sh host), under the same discipline as flash_attention_avx512.cc: it
// includes nothing but the intrinsics, cpu_isa.h and avx512_transpose.h, keeps every helper in an anonymous
// namespace and exports only the plain functions of tf_flash::cpu_avx512bf16, so no COMDAT the linker may hand an
// AVX2 caller is compiled here. vdpbf16ps is its only AVX512_BF16 instruction: the rounding to bfloat16 is integer
// AVX512F code, so that it is exactly round-to-nearest-even whatever the conversion instructions do with
// subnormals. The amx_* products run the same packed pairs through AMX tiles (tdpbf16ps); the AMX instructions
// appear only in them (intrinsics only: the compiler never emits AMX on its own), and they run only on the AMX path
// (the default where the CPU has AMX-BF16).
#include <immintrin.h>
#include <stdint.h>

#include "cc/kernels/cpu/avx512_transpose.h"
#include "cc/kernels/cpu/cpu_isa.h"

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) || !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "flash_attention_avx512bf16.cc needs -mavx512f -mavx512bf16 -mamx-tile -mamx-bf16 (cc/BUILD: _AVX512BF16_COPTS)"
#endif

namespace tf_flash {
namespace cpu_avx512bf16 {
namespace {

constexpr int kLanes = 16;
// Columns of C one micro-kernel call covers at most: four vectors.
constexpr int kBlockCols = 64;
// Rows of C per micro-kernel by its vectors of columns, as the float32 kernels: at most 24 accumulators of
// 32 zmm registers, beside the B vectors and the broadcast pair of A.
constexpr int kRowsOfVectors[5] = {0, 12, 12, 8, 6};

__mmask16 LaneMask(int64_t lanes) {
  if (lanes <= 0) return 0;
  return lanes >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << lanes) - 1u);
}

int64_t Min(int64_t x, int64_t y) { return x < y ? x : y; }
int64_t RoundUp(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
int64_t PairsOf(int64_t k) { return (k + 1) / 2; }

// The bfloat16 nearest to each lane (ties to even), in the upper 16 bits of the lane; the lower 16 bits 0.
// Overflow rounds to infinity, a NaN stays a NaN (made quiet: its payload could round to infinity).
__m512i RoundedHigh(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// One vdpbf16ps operand lane per float32 lane: bf16(lo) in bits 0-15 (the pair's even element), bf16(hi) in
// bits 16-31 (its odd element).
__m512i Pairs(__m512 lo, __m512 hi) { return _mm512_or_si512(RoundedHigh(hi), _mm512_srli_epi32(RoundedHigh(lo), 16)); }

// The bits of 32 packed bfloat16 as vdpbf16ps's operand type (a no-op once compiled).
__m512bh AsBf16(__m512i x) {
  __m512bh y;
  __builtin_memcpy(&y, &x, sizeof(y));
  return y;
}

// dst[r * ldd + t] = Pairs(src[r][2t], src[r][2t + 1]) for t < ceil(cols / 2): each row as pairs along it
// (an odd last column pairs with 0).
void PackRowPairs(const float* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst, int64_t ldd) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    uint32_t* d = dst + r * ldd;
    for (int64_t c = 0; c < cols; c += 2 * kLanes) {
      const __m512 x = _mm512_maskz_loadu_ps(LaneMask(cols - c), s + c);
      const __m512 y = _mm512_maskz_loadu_ps(LaneMask(cols - c - kLanes), s + c + kLanes);
      const __m512i pairs = Pairs(_mm512_permutex2var_ps(x, even, y), _mm512_permutex2var_ps(x, odd, y));
      _mm512_mask_storeu_epi32(d + c / 2, LaneMask(PairsOf(Min(2 * kLanes, cols - c))), pairs);
    }
  }
}

// dst[t * ldd + j] = Pairs(src[2t][j], src[2t + 1][j]) for j < cols: rows 2t and 2t + 1 interleaved (an odd
// last row pairs with 0).
void PackInterleavedRows(const float* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t t = 0; 2 * t < rows; ++t) {
    const float* even_row = src + 2 * t * lds;
    const bool has_odd = 2 * t + 1 < rows;
    uint32_t* d = dst + t * ldd;
    for (int64_t j = 0; j < cols; j += kLanes) {
      const __mmask16 mask = LaneMask(cols - j);
      const __m512 lo = _mm512_maskz_loadu_ps(mask, even_row + j);
      const __m512 hi = has_odd ? _mm512_maskz_loadu_ps(mask, even_row + lds + j) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(d + j, mask, Pairs(lo, hi));
    }
  }
}

// dst[t * ldd + j] = Pairs(src[j][2t], src[j][2t + 1]) for j < rows, t < ceil(cols / 2), and 0 for the other
// j of each 16: src^T as pairs of rows, from 16 rows x 16 pairs at a time (PackRowPairs' pairs of each row,
// then transposed in registers).
void PackTransposedPairs(const float* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst, int64_t ldd) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t j0 = 0; j0 < rows; j0 += kLanes) {
    const int64_t block_rows = Min(kLanes, rows - j0);
    for (int64_t c0 = 0; c0 < cols; c0 += 2 * kLanes) {
      const __mmask16 first = LaneMask(cols - c0), second = LaneMask(cols - c0 - kLanes);
      __m512 v[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        if (r >= block_rows) {
          v[r] = _mm512_setzero_ps();
          continue;
        }
        const float* s = src + (j0 + r) * lds + c0;
        const __m512 x = _mm512_maskz_loadu_ps(first, s), y = _mm512_maskz_loadu_ps(second, s + kLanes);
        v[r] = _mm512_castsi512_ps(Pairs(_mm512_permutex2var_ps(x, even, y), _mm512_permutex2var_ps(x, odd, y)));
      }
      cpu_avx512::Transpose16(v);
      const int64_t count = PairsOf(Min(2 * kLanes, cols - c0));
      for (int64_t t = 0; t < count; ++t) {
        _mm512_storeu_si512(dst + (c0 / 2 + t) * ldd + j0, _mm512_castps_si512(v[t]));
      }
    }
  }
}

// C[MR x (16 NV)] (+)= alpha * sum_t A(i, t) . B[t, :], where A(i, t) is the pair at a[i * lda + t] (pairs
// along A's rows), or a[t * lda + i] with kAInterleaved, and B's row t holds one pair per column. Each
// accumulator lane is one chain of vdpbf16ps steps over t in order: the element's result depends on its own
// row and column only.
template <int MR, int NV, bool kAInterleaved>
void MicroKernel(int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, __mmask16 last,
                 float alpha, bool accumulate, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < pairs; ++t) {
    const uint32_t* b_row = b + t * ldb;
    __m512bh b_vec[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) b_vec[v] = AsBf16(_mm512_loadu_si512(b_row + v * kLanes));
    b_vec[NV - 1] = AsBf16(_mm512_maskz_loadu_epi32(last, b_row + (NV - 1) * kLanes));
    const uint32_t* a_t = kAInterleaved ? a + t * lda : a + t;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512bh a_i = AsBf16(_mm512_set1_epi32(static_cast<int>(kAInterleaved ? a_t[i] : a_t[i * lda])));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a_i, b_vec[v]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? last : static_cast<__mmask16>(0xFFFF);
      float* c_ptr = c + i * ldc + v * kLanes;
      const __m512 result = accumulate ? _mm512_fmadd_ps(scale, acc[i][v], _mm512_maskz_loadu_ps(mask, c_ptr))
                                       : _mm512_mul_ps(scale, acc[i][v]);
      _mm512_mask_storeu_ps(c_ptr, mask, result);
    }
  }
}

using Kernel = void (*)(int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, __mmask16, float, bool, float*,
                        int64_t);

template <int MR, int NV, bool kAInterleaved>
Kernel KernelIfFits() {
  if constexpr (MR <= kRowsOfVectors[NV]) {
    return &MicroKernel<MR, NV, kAInterleaved>;
  } else {
    return nullptr;
  }
}

template <int NV, bool kAInterleaved>
Kernel KernelOfRows(int rows) {
  switch (rows) {
    case 1: return KernelIfFits<1, NV, kAInterleaved>();
    case 2: return KernelIfFits<2, NV, kAInterleaved>();
    case 3: return KernelIfFits<3, NV, kAInterleaved>();
    case 4: return KernelIfFits<4, NV, kAInterleaved>();
    case 5: return KernelIfFits<5, NV, kAInterleaved>();
    case 6: return KernelIfFits<6, NV, kAInterleaved>();
    case 7: return KernelIfFits<7, NV, kAInterleaved>();
    case 8: return KernelIfFits<8, NV, kAInterleaved>();
    case 9: return KernelIfFits<9, NV, kAInterleaved>();
    case 10: return KernelIfFits<10, NV, kAInterleaved>();
    case 11: return KernelIfFits<11, NV, kAInterleaved>();
    case 12: return KernelIfFits<12, NV, kAInterleaved>();
    default: return nullptr;
  }
}

template <bool kAInterleaved>
Kernel KernelOf(int vectors, int rows) {
  switch (vectors) {
    case 1: return KernelOfRows<1, kAInterleaved>(rows);
    case 2: return KernelOfRows<2, kAInterleaved>(rows);
    case 3: return KernelOfRows<3, kAInterleaved>(rows);
    case 4: return KernelOfRows<4, kAInterleaved>(rows);
    default: return nullptr;
  }
}

// C[m x n] (+)= alpha * A B on packed pairs: B as [pairs x ldb] (one pair per column), A as pairs along its
// rows (a[i * lda + t]) or interleaved (a[t * lda + i]). Blocks of kBlockCols columns, each cut into
// micro-kernel rows; the last vector of a block is masked.
template <bool kAInterleaved>
void Gemm(int64_t m, int64_t n, int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
          float alpha, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += kBlockCols) {
    const int64_t cols = Min(kBlockCols, n - j0);
    const int vectors = static_cast<int>((cols + kLanes - 1) / kLanes);
    const __mmask16 last = LaneMask(cols - int64_t{vectors - 1} * kLanes);
    const int block_rows = kRowsOfVectors[vectors];
    const Kernel full = KernelOf<kAInterleaved>(vectors, block_rows);
    for (int64_t i0 = 0; i0 < m; i0 += block_rows) {
      const int rows = static_cast<int>(Min(block_rows, m - i0));
      const Kernel kernel = rows == block_rows ? full : KernelOf<kAInterleaved>(vectors, rows);
      const uint32_t* a_block = kAInterleaved ? a + i0 : a + i0 * lda;
      kernel(pairs, a_block, lda, b + j0, ldb, last, alpha, accumulate, c + i0 * ldc + j0, ldc);
    }
  }
}

// ---- AMX: tiles of 16 rows x 64 bytes, C in float32 tiles of 16 x 16 ----

// The tile registers' shapes (ldtilecfg's 64-byte layout, palette 1): tmm0-3 hold a 32 x 32 block of C, tmm4-5
// two 16-row slices of A (16 pairs each), tmm6-7 two 16-column slices of B (16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void ZeroWords(uint32_t* p, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) _mm512_mask_storeu_epi32(p + i, LaneMask(n - i), _mm512_setzero_si512());
}

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols (both multiples of 16), 16 x 16 squares in
// registers.
void TransposeWords(const uint32_t* src, int64_t lds, int64_t rows, int64_t cols, uint32_t* dst, int64_t ldd) {
  for (int64_t i0 = 0; i0 < rows; i0 += kLanes) {
    for (int64_t j0 = 0; j0 < cols; j0 += kLanes) {
      __m512 v[kLanes];
      for (int r = 0; r < kLanes; ++r) v[r] = _mm512_castsi512_ps(_mm512_loadu_si512(src + (i0 + r) * lds + j0));
      cpu_avx512::Transpose16(v);
      for (int r = 0; r < kLanes; ++r) _mm512_storeu_si512(dst + (j0 + r) * ldd + i0, _mm512_castps_si512(v[r]));
    }
  }
}

// The padded shapes of one AMX product: rows and columns of C to 32, pairs of k to 16, all padding zero.
struct AmxShape {
  int64_t rows, cols, pairs;  // M32, N32, P16
  AmxShape(int64_t m, int64_t n, int64_t k)
      : rows(RoundUp(m, 32)), cols(RoundUp(n, 32)), pairs(RoundUp(PairsOf(k), kLanes)) {}
  int64_t a_words() const { return rows * pairs; }
  int64_t b_words() const { return pairs * cols; }
  int64_t c_floats() const { return rows * cols; }
};

// C[m x n] (+)= alpha * A B with A as [shape.rows x shape.pairs] pairs and B as [shape.pairs x shape.cols]
// pairs, both zero-padded: 32 x 32 blocks of C in four tiles, summed over k 16 pairs at a time (padding
// pairs add exact zeros), stored to `out`, then scaled into C as the vdpbf16ps kernels do. Each element of C
// is one accumulator lane over the same k steps in order wherever its tile lies.
void AmxGemm(const AmxShape& shape, int64_t m, int64_t n, const uint32_t* a, const uint32_t* b, float alpha,
             bool accumulate, float* out, float* c, int64_t ldc) {
  TileConfig config = {};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t a_stride = shape.pairs * 4, b_stride = shape.cols * 4, out_stride = shape.cols * 4;
  for (int64_t i0 = 0; i0 < shape.rows; i0 += 32) {
    for (int64_t j0 = 0; j0 < shape.cols; j0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t0 = 0; t0 < shape.pairs; t0 += kLanes) {
        _tile_loadd(4, a + i0 * shape.pairs + t0, a_stride);
        _tile_loadd(5, a + (i0 + 16) * shape.pairs + t0, a_stride);
        _tile_loadd(6, b + t0 * shape.cols + j0, b_stride);
        _tile_loadd(7, b + t0 * shape.cols + j0 + 16, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* block = out + i0 * shape.cols + j0;
      _tile_stored(0, block, out_stride);
      _tile_stored(1, block + 16, out_stride);
      _tile_stored(2, block + 16 * shape.cols, out_stride);
      _tile_stored(3, block + 16 * shape.cols + 16, out_stride);
    }
  }
  _tile_release();
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 mask = LaneMask(n - j);
      const __m512 sum = _mm512_maskz_loadu_ps(mask, out + i * shape.cols + j);
      float* c_ptr = c + i * ldc + j;
      const __m512 result = accumulate ? _mm512_fmadd_ps(scale, sum, _mm512_maskz_loadu_ps(mask, c_ptr))
                                       : _mm512_mul_ps(scale, sum);
      _mm512_mask_storeu_ps(c_ptr, mask, result);
    }
  }
}

// The AMX scratch: A's pairs, B's pairs, C's float32 block, and for TN the interleaved A before its transpose.
struct AmxScratch {
  uint32_t* a;
  uint32_t* b;
  float* out;
  uint32_t* a_interleaved;
  AmxScratch(const AmxShape& shape, uint32_t* scratch) {
    a = scratch;
    b = a + shape.a_words();
    out = reinterpret_cast<float*>(b + shape.b_words());
    a_interleaved = reinterpret_cast<uint32_t*>(out + shape.c_floats());
    ZeroWords(a, shape.a_words());
    ZeroWords(b, shape.b_words());
  }
};

// The scratch of one product: A's pairs first, then B's, each starting on a 64-byte line when the scratch
// does (the caller's vector: at least 16 bytes; loads are unaligned anyway).
struct Packs {
  uint32_t* a;
  uint32_t* b;
};

Packs SplitScratch(int64_t a_words, uint32_t* scratch) { return {scratch, scratch + RoundUp(a_words, kLanes)}; }

}  // namespace

int64_t scratch_words(int64_t m, int64_t n, int64_t k) {
  const int64_t pairs = PairsOf(k > 0 ? k : 1);
  // A: m x pairs (rows as pairs) or pairs x RoundUp(m, 16) (interleaved); B: pairs x RoundUp(n, 16).
  return RoundUp(pairs * RoundUp(m, kLanes), kLanes) + pairs * RoundUp(n, kLanes);
}

void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const int64_t pairs = PairsOf(k), ldbp = RoundUp(n, kLanes);
  const Packs packs = SplitScratch(m * pairs, scratch);
  PackRowPairs(a, lda, m, k, packs.a, pairs);
  PackTransposedPairs(b, ldb, n, k, packs.b, ldbp);
  Gemm<false>(m, n, pairs, packs.a, pairs, packs.b, ldbp, alpha, accumulate, c, ldc);
}

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const int64_t pairs = PairsOf(k), ldbp = RoundUp(n, kLanes);
  const Packs packs = SplitScratch(m * pairs, scratch);
  PackRowPairs(a, lda, m, k, packs.a, pairs);
  PackInterleavedRows(b, ldb, k, n, packs.b, ldbp);
  Gemm<false>(m, n, pairs, packs.a, pairs, packs.b, ldbp, alpha, accumulate, c, ldc);
}

void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const int64_t pairs = PairsOf(k), ldap = RoundUp(m, kLanes), ldbp = RoundUp(n, kLanes);
  const Packs packs = SplitScratch(pairs * ldap, scratch);
  PackInterleavedRows(a, lda, k, m, packs.a, ldap);
  PackInterleavedRows(b, ldb, k, n, packs.b, ldbp);
  Gemm<true>(m, n, pairs, packs.a, ldap, packs.b, ldbp, alpha, accumulate, c, ldc);
}

int64_t amx_scratch_words(int64_t m, int64_t n, int64_t k) {
  const AmxShape shape(m, n, k);
  return 2 * shape.a_words() + shape.b_words() + shape.c_floats();
}

void amx_gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const AmxShape shape(m, n, k);
  const AmxScratch packs(shape, scratch);
  PackRowPairs(a, lda, m, k, packs.a, shape.pairs);
  PackTransposedPairs(b, ldb, n, k, packs.b, shape.cols);
  AmxGemm(shape, m, n, packs.a, packs.b, alpha, accumulate, packs.out, c, ldc);
}

void amx_gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const AmxShape shape(m, n, k);
  const AmxScratch packs(shape, scratch);
  PackRowPairs(a, lda, m, k, packs.a, shape.pairs);
  PackInterleavedRows(b, ldb, k, n, packs.b, shape.cols);
  AmxGemm(shape, m, n, packs.a, packs.b, alpha, accumulate, packs.out, c, ldc);
}

void amx_gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch) {
  const AmxShape shape(m, n, k);
  const AmxScratch packs(shape, scratch);
  // A^T's pairs along k: rows 2t and 2t + 1 of A interleaved ([pairs x rows]), then transposed to
  // [rows x pairs], the layout of an A tile.
  ZeroWords(packs.a_interleaved, shape.a_words());
  PackInterleavedRows(a, lda, k, m, packs.a_interleaved, shape.rows);
  TransposeWords(packs.a_interleaved, shape.rows, shape.pairs, shape.rows, packs.a, shape.pairs);
  PackInterleavedRows(b, ldb, k, n, packs.b, shape.cols);
  AmxGemm(shape, m, n, packs.a, packs.b, alpha, accumulate, packs.out, c, ldc);
}

}  // namespace cpu_avx512bf16
}  // namespace tf_flash
