// The CPU's dropout generator: philox.h's draws for whole rows, eight Philox calls side by side with
// AVX2 (a scalar loop where the compiler targets no AVX2), as the keep scales the CPU kernel multiplies by.
// Host only.
#pragma once

#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cc/kernels/flash/philox.h"

namespace tf_flash {

#if defined(__AVX2__)
// Eight Philox rounds side by side: the 32x32->64 products of even and odd lanes, recombined.
inline void philox_round_x8(__m256i& x0, __m256i& x1, __m256i& x2, __m256i& x3, uint32_t key0, uint32_t key1) {
  const auto mulhilo = [](__m256i a, uint32_t multiplier, __m256i* hi) {
    const __m256i m = _mm256_set1_epi32(static_cast<int>(multiplier));
    const __m256i even = _mm256_mul_epu32(a, m);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  };
  __m256i hi0, hi1;
  const __m256i lo0 = mulhilo(x0, kPhiloxMul0, &hi0);
  const __m256i lo1 = mulhilo(x2, kPhiloxMul1, &hi1);
  x0 = _mm256_xor_si256(_mm256_xor_si256(hi1, x1), _mm256_set1_epi32(static_cast<int>(key0)));
  x1 = lo1;
  x2 = _mm256_xor_si256(_mm256_xor_si256(hi0, x3), _mm256_set1_epi32(static_cast<int>(key1)));
  x3 = lo0;
}
#endif

// Host only: the keep scales of columns [col_begin, col_end) of one row, `keep_scale` where kept and 0
// where dropped. Works on pairs of 32-column blocks: their eight calls run side by side (AVX2 when compiled
// in). A call holds the draws of rows r and r + 8: with `out_plus8`, `row` must have (row & 8) == 0 and the
// scales of row + 8 go there from the same calls; otherwise the other row's bytes are dropped.
inline void dropout_row_scales(uint64_t seed, uint64_t offset, uint64_t batch_head, int64_t row,
                               int64_t col_begin, int64_t col_end, uint32_t drop_threshold, float keep_scale,
                               float* out, float* out_plus8 = nullptr) {
  const uint32_t key0 = dropout_key0(seed, offset), key1 = dropout_key1(seed, offset);
  const Philox4 first = dropout_counter(offset, batch_head, row, 0);
  const int row_half = static_cast<int>((row >> 3) & 1);
  const int halves = out_plus8 != nullptr ? 2 : 1;  // row_half + h for h < halves; row_half is 0 with two
  for (int64_t block = col_begin >> 5; block * 32 < col_end; block += 2) {
    const int64_t c0 = block * 32;
    alignas(32) uint8_t draws[2][64];  // the draws of columns c0 .. c0 + 63 in the requested rows
#if defined(__AVX2__)
    __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block * 4))),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i x1 = _mm256_set1_epi32(static_cast<int>(first.x[1]));
    __m256i x2 = _mm256_set1_epi32(static_cast<int>(first.x[2]));
    __m256i x3 = _mm256_set1_epi32(static_cast<int>(first.x[3]));
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < 10; ++round) {
      philox_round_x8(x0, x1, x2, x3, k0, k1);
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    for (int h = 0; h < halves; ++h) {
      // Per 128-bit half (one block, lanes q = 0..3): bytes 2 * half + j of lane q are columns 8w + 2q + j.
      const __m256i pick = row_half + h ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1,
                                                           -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                                        : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                           0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m256i g01 = _mm256_unpacklo_epi64(_mm256_shuffle_epi8(x0, pick), _mm256_shuffle_epi8(x1, pick));
      const __m256i g23 = _mm256_unpacklo_epi64(_mm256_shuffle_epi8(x2, pick), _mm256_shuffle_epi8(x3, pick));
      _mm256_store_si256(reinterpret_cast<__m256i*>(draws[h]), _mm256_permute2x128_si256(g01, g23, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(draws[h] + 32), _mm256_permute2x128_si256(g01, g23, 0x31));
    }
#else
    for (int lane = 0; lane < 8; ++lane) {
      Philox4 ctr = first;
      ctr.x[0] = static_cast<uint32_t>(block * 4 + lane);
      const Philox4 r = philox4x32_10(ctr, key0, key1);
      for (int h = 0; h < halves; ++h)
        for (int w = 0; w < 4; ++w)
          for (int j = 0; j < 2; ++j)
            draws[h][32 * (lane >> 2) + 8 * w + 2 * (lane & 3) + j] =
                static_cast<uint8_t>(r.x[w] >> (8 * (2 * (row_half + h) + j)));
    }
#endif
    const int64_t lo = c0 > col_begin ? c0 : col_begin, hi = c0 + 64 < col_end ? c0 + 64 : col_end;
    for (int h = 0; h < halves; ++h) {
      float* dst_row = h == 0 ? out : out_plus8;
#if defined(__AVX2__)
      if (lo == c0 && hi == c0 + 64) {  // keep = draw >= threshold, as keep_scale or 0
        const __m256i threshold = _mm256_set1_epi8(static_cast<char>(drop_threshold));
        const __m256 scale = _mm256_set1_ps(keep_scale);
        alignas(32) uint8_t keep[64];
        for (int part = 0; part < 2; ++part) {
          const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(draws[h] + 32 * part));
          _mm256_store_si256(reinterpret_cast<__m256i*>(keep + 32 * part),
                             _mm256_cmpeq_epi8(_mm256_max_epu8(d, threshold), d));
        }
        float* dst = dst_row + (c0 - col_begin);
        for (int i = 0; i < 8; ++i) {
          const __m256i m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep + 8 * i)));
          _mm256_storeu_ps(dst + 8 * i, _mm256_and_ps(_mm256_castsi256_ps(m), scale));
        }
        continue;
      }
#endif
      for (int64_t c = lo; c < hi; ++c) dst_row[c - col_begin] = draws[h][c - c0] >= drop_threshold ? keep_scale : 0.f;
    }
  }
}

}  // namespace tf_flash
