// The 16 x 16 register transpose both AVX-512 files use (flash_attention_avx512.cc and
// flash_attention_avx512bf16.cc, the only files that may include this: it needs -mavx512f). An anonymous
// namespace gives each object its own copy with internal linkage: no COMDAT the linker could hand an AVX2
// caller (cpu_isa.h), and the copy stays in tf_flash::cpu_avx512, where tests/test_cpu_isa.py allows zmm code.
#pragma once

#include <immintrin.h>

namespace tf_flash {
namespace cpu_avx512 {
namespace {

// Transposes the 16 x 16 matrix of 32-bit elements in v[0..15] (row r in v[r]) in place: unpacks within
// 128-bit lanes make 4 x 4 blocks, two shuffles of whole lanes place them. 64 shuffles for 256 elements,
// where gathers would take 16 loads per row of the result.
void Transpose16(__m512 v[16]) {
  __m512 b[16];
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  // c[4g + m]: in 128-bit lane L, rows 4g..4g+3 of column 4L + m.
  __m512 c[16];
  for (int g = 0; g < 16; g += 4) {
    const __m512d b0 = _mm512_castps_pd(b[g]), b1 = _mm512_castps_pd(b[g + 1]);
    const __m512d b2 = _mm512_castps_pd(b[g + 2]), b3 = _mm512_castps_pd(b[g + 3]);
    c[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(b0, b2));
    c[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(b0, b2));
    c[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b1, b3));
    c[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b1, b3));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 d0 = _mm512_shuffle_f32x4(c[m], c[4 + m], 0x44), d1 = _mm512_shuffle_f32x4(c[m], c[4 + m], 0xEE);
    const __m512 d2 = _mm512_shuffle_f32x4(c[8 + m], c[12 + m], 0x44);
    const __m512 d3 = _mm512_shuffle_f32x4(c[8 + m], c[12 + m], 0xEE);
    v[m] = _mm512_shuffle_f32x4(d0, d2, 0x88);
    v[m + 4] = _mm512_shuffle_f32x4(d0, d2, 0xDD);
    v[m + 8] = _mm512_shuffle_f32x4(d1, d3, 0x88);
    v[m + 12] = _mm512_shuffle_f32x4(d1, d3, 0xDD);
  }
}

}  // namespace
}  // namespace cpu_avx512
}  // namespace tf_flash
