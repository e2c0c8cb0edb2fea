// The AVX-512 path's micro-kernels (cpu_isa.h): register-blocked float32 products and the softmax's exp, 16 lanes.
// With flash_attention_avx512bf16.cc, the only files compiled with AVX-512 flags. It includes nothing but the
// intrinsics (always inlined, never emitted), cpu_isa.h and avx512_transpose.h (internal linkage), and keeps every
// helper in an anonymous namespace: all it exports are the plain functions of tf_flash::cpu_avx512, so no inline or
// template function with external linkage (a COMDAT the linker may pick from this file for an AVX2 caller) is
// compiled here.
#include <immintrin.h>
#include <stdint.h>

#include "cc/kernels/cpu/avx512_transpose.h"
#include "cc/kernels/cpu/cpu_isa.h"

#if !defined(__AVX512F__) || !defined(__FMA__)
#error "flash_attention_avx512.cc needs -mavx512f -mfma (cc/BUILD: _AVX512_COPTS)"
#endif

namespace tf_flash {
namespace cpu_avx512 {
namespace {

constexpr int kLanes = 16;
// Columns of C one micro-kernel call covers at most: four vectors.
constexpr int kBlockCols = 64;

// Rows of C per micro-kernel by its vectors of columns: 24 accumulators (of 32 zmm registers) where the
// columns allow, leaving room for the B vectors and the broadcast A element.
constexpr int kRowsOfVectors[5] = {0, 12, 12, 8, 6};
constexpr int kMaxRows = 12;

__mmask16 LaneMask(int64_t lanes) {
  return lanes >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << lanes) - 1u);
}

// C[MR x (16 NV)] (+)= alpha * sum_kk A(i, kk) B[kk, :]. A(i, kk) is a[i * lda + kk] (row-major A), or
// a[kk * lda + i] with kATransposed. `last` masks the columns of the last vector (loads and stores alike).
// Each accumulator is one FMA chain over kk in order: the element's result depends on nothing else.
template <int MR, int NV, bool kATransposed>
void MicroKernel(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, __mmask16 last, float alpha,
                 bool accumulate, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* b_row = b + kk * ldb;
    __m512 b_vec[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) b_vec[v] = _mm512_loadu_ps(b_row + v * kLanes);
    b_vec[NV - 1] = _mm512_maskz_loadu_ps(last, b_row + (NV - 1) * kLanes);
    const float* a_k = kATransposed ? a + kk * lda : a + kk;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 a_i = _mm512_set1_ps(kATransposed ? a_k[i] : a_k[i * lda]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a_i, b_vec[v], acc[i][v]);
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

using Kernel = void (*)(int64_t, const float*, int64_t, const float*, int64_t, __mmask16, float, bool, float*,
                        int64_t);

template <int MR, int NV, bool kATransposed>
Kernel KernelIfFits() {
  if constexpr (MR <= kRowsOfVectors[NV]) {
    return &MicroKernel<MR, NV, kATransposed>;
  } else {
    return nullptr;
  }
}

template <int NV, bool kATransposed>
Kernel KernelOfRows(int rows) {
  switch (rows) {
    case 1: return KernelIfFits<1, NV, kATransposed>();
    case 2: return KernelIfFits<2, NV, kATransposed>();
    case 3: return KernelIfFits<3, NV, kATransposed>();
    case 4: return KernelIfFits<4, NV, kATransposed>();
    case 5: return KernelIfFits<5, NV, kATransposed>();
    case 6: return KernelIfFits<6, NV, kATransposed>();
    case 7: return KernelIfFits<7, NV, kATransposed>();
    case 8: return KernelIfFits<8, NV, kATransposed>();
    case 9: return KernelIfFits<9, NV, kATransposed>();
    case 10: return KernelIfFits<10, NV, kATransposed>();
    case 11: return KernelIfFits<11, NV, kATransposed>();
    case 12: return KernelIfFits<12, NV, kATransposed>();
    default: return nullptr;
  }
}

template <bool kATransposed>
Kernel KernelOf(int vectors, int rows) {
  switch (vectors) {
    case 1: return KernelOfRows<1, kATransposed>(rows);
    case 2: return KernelOfRows<2, kATransposed>(rows);
    case 3: return KernelOfRows<3, kATransposed>(rows);
    case 4: return KernelOfRows<4, kATransposed>(rows);
    default: return nullptr;
  }
}

int64_t Min(int64_t x, int64_t y) { return x < y ? x : y; }

// C (+)= alpha * A B over blocks of kBlockCols columns (B's panel stays in L1/L2 across the row blocks),
// each cut into micro-kernel rows; the last vector of a block is masked.
template <bool kATransposed>
void Gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
          bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += kBlockCols) {
    const int64_t cols = Min(kBlockCols, n - j0);
    const int vectors = static_cast<int>((cols + kLanes - 1) / kLanes);
    const __mmask16 last = LaneMask(cols - int64_t{vectors - 1} * kLanes);
    const int block_rows = kRowsOfVectors[vectors];
    const Kernel full = KernelOf<kATransposed>(vectors, block_rows);
    for (int64_t i0 = 0; i0 < m; i0 += block_rows) {
      const int rows = static_cast<int>(Min(block_rows, m - i0));
      const Kernel kernel = rows == block_rows ? full : KernelOf<kATransposed>(vectors, rows);
      const float* a_block = kATransposed ? a + i0 : a + i0 * lda;
      kernel(k, a_block, lda, b + j0, ldb, last, alpha, accumulate, c + i0 * ldc + j0, ldc);
    }
  }
}

// pack[kk * kBlockCols + j] = b[j * ldb + kk] for j < cols (<= kBlockCols), kk < k, and 0 for the other j
// of each 16: a block of B^T, 16 x 16 squares at a time (rows of B loaded whole, then transposed in
// registers).
void PackTransposed(const float* b, int64_t ldb, int64_t cols, int64_t k, float* pack) {
  for (int64_t j0 = 0; j0 < cols; j0 += kLanes) {
    const int64_t rows = Min(kLanes, cols - j0);
    for (int64_t k0 = 0; k0 < k; k0 += kLanes) {
      const __mmask16 mask = LaneMask(k - k0);
      __m512 v[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        v[r] = r < rows ? _mm512_maskz_loadu_ps(mask, b + (j0 + r) * ldb + k0) : _mm512_setzero_ps();
      }
      Transpose16(v);
      const int64_t count = Min(kLanes, k - k0);
      for (int64_t t = 0; t < count; ++t) _mm512_storeu_ps(pack + (k0 + t) * kBlockCols + j0, v[t]);
    }
  }
}

// exp(x) at 16 lanes: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, FMAs exact in n ln2_hi); exp(r) by a
// polynomial of degree 6 fitted for relative error on that interval (2.0e-9, under 2^-28: within 1.05 ulp of exp
// where it is a normal float32; Taylor's degree 7, one FMA more, 0.93), Horner in FMAs; times 2^n by
// scalef, which rounds once into float32's subnormals, so that from -104 down (exp below half the smallest
// subnormal) the result is 0, -inf included, with no mask. NaN passes through (max/min return their second
// operand on NaN).
__m512 Exp(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.75f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2_hi: 16 significant bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // ln2 - ln2_hi
  __m512 poly = _mm512_set1_ps(1.384365076e-03f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.374156420e-03f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.166800215e-02f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.666643125e-01f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.999999421e-01f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(poly, n);
}

// tanh(x) at 16 lanes: below 0.625 in magnitude its Taylor series to x^21 (truncation under 2^-26 relative
// there), Horner in x^2; above, 1 - 2 / (exp(2|x|) + 1) with the sign of x (the subtraction loses at most a
// bit from 0.625 up), within 3 ulp. Large |x| give +-1 (exp saturates finite), NaN stays NaN.
__m512 Tanh(__m512 x) {
  const __m512 abs_x = _mm512_abs_ps(x);
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 poly = _mm512_set1_ps(9.691537956929451e-05f);
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(-2.3912911424355248e-04f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(5.90027440945586e-04f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(-1.4558343870513183e-03f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(3.592128036572481e-03f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(-8.863235529902197e-03f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(2.1869488536155203e-02f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(-5.396825396825397e-02f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(1.3333333333333333e-01f));
  poly = _mm512_fmadd_ps(poly, x2, _mm512_set1_ps(-3.3333333333333333e-01f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(poly, x2), x, x);
  const __m512 e = Exp(_mm512_add_ps(abs_x, abs_x));
  const __m512 large_abs = _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f),
                                                                              _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  // The sign of x onto |tanh| (NaN keeps its NaN).
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large_abs), sign));
  const __mmask16 is_small = _mm512_cmp_ps_mask(abs_x, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(large, is_small, small);
}

}  // namespace

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc) {
  Gemm<false>(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc);
}

void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc) {
  Gemm<true>(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc);
}

int64_t gemm_nt_pack_floats(int64_t k) { return (k > 0 ? k : 1) * kBlockCols; }

// B^T one block of kBlockCols columns at a time (packed by gathers), then the row-major A kernels on it.
void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, float* pack) {
  for (int64_t j0 = 0; j0 < n; j0 += kBlockCols) {
    const int64_t cols = Min(kBlockCols, n - j0);
    PackTransposed(b + j0 * ldb, ldb, cols, k, pack);
    Gemm<false>(m, cols, k, a, lda, pack, kBlockCols, alpha, accumulate, c + j0, ldc);
  }
}

float max_of(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 best = neg_inf;
  for (int64_t i = 0; i < n; i += kLanes) {
    best = _mm512_max_ps(best, _mm512_mask_loadu_ps(neg_inf, LaneMask(n - i), x + i));
  }
  return _mm512_reduce_max_ps(best);
}

float exp_shifted_sum(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = LaneMask(n - i);
    const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), s));
    _mm512_mask_storeu_ps(x + i, mask, e);
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

void exp_shifted_scaled(float* x, int64_t n, float shift, float scale) {
  const __m512 s = _mm512_set1_ps(shift), m = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = LaneMask(n - i);
    const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + i), s));
    _mm512_mask_storeu_ps(x + i, mask, _mm512_mul_ps(e, m));
  }
}

void softcap(float* x, int64_t n, float cap, float* d_tanh) {
  const __m512 inverse = _mm512_set1_ps(1.f / cap), scale = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = LaneMask(n - i);
    const __m512 t = Tanh(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), inverse));
    if (d_tanh) _mm512_mask_storeu_ps(d_tanh + i, mask, _mm512_fnmadd_ps(t, t, one));  // one rounding, stated
    _mm512_mask_storeu_ps(x + i, mask, _mm512_mul_ps(t, scale));
  }
}

bool mask_row(float* s, const uint8_t* mask, uint8_t* seen, int64_t lo, int64_t hi) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __m128i one = _mm_set1_epi8(1);
  __mmask16 any = 0;
  int64_t c = lo;
  for (; c + kLanes <= hi; c += kLanes) {
    const __m128i bytes = _mm_min_epu8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mask + c)), one);
    const __mmask16 visible = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(1));
    _mm512_mask_storeu_ps(s + c, static_cast<__mmask16>(~visible), neg_inf);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(seen + c),
                     _mm_or_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(seen + c)), bytes));
    any |= visible;
  }
  bool tail_any = false;
  for (; c < hi; ++c) {  // the last columns one by one: no load past the row's mask
    const bool visible = mask[c] != 0;
    if (!visible) s[c] = -__builtin_inff();
    seen[c] |= static_cast<uint8_t>(visible);
    tail_any |= visible;
  }
  return any != 0 || tail_any;
}

void multiply(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = LaneMask(n - i);
    const __m512 product = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), _mm512_maskz_loadu_ps(mask, y + i));
    _mm512_mask_storeu_ps(x + i, mask, product);
  }
}

void softmax_grad(float* dp, const float* p, const float* d_tanh, const float* delta, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* dp_row = dp + r * cols;
    const float* p_row = p + r * cols;
    const __m512 d = _mm512_set1_ps(delta[r]);
    for (int64_t i = 0; i < cols; i += kLanes) {
      const __mmask16 mask = LaneMask(cols - i);
      const __m512 p_vec = _mm512_maskz_loadu_ps(mask, p_row + i);
      // 0 where P is 0, whatever dP holds there (NaN included); P * (dP - D) elsewhere, NaN P included.
      const __mmask16 nonzero = _mm512_cmp_ps_mask(p_vec, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      __m512 ds = _mm512_maskz_mul_ps(nonzero, p_vec, _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, dp_row + i), d));
      if (d_tanh) ds = _mm512_mul_ps(ds, _mm512_maskz_loadu_ps(mask, d_tanh + r * cols + i));
      _mm512_mask_storeu_ps(dp_row + i, mask, ds);
    }
  }
}

}  // namespace cpu_avx512
}  // namespace tf_flash
