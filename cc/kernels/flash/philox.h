// Counter-based Philox4x32-10 (Salmon et al. 2011), the dropout RNG of tf_flash. One definition for
// host and device so that CPU and GPU drop exactly the same entries, and the backward pass regenerates
// the forward's mask from (seed, offset) instead of storing it.
#pragma once

#include <cstdint>
#if defined(__AVX2__) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#endif

#if defined(__CUDACC__)
#define TF_FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TF_FLASH_HOST_DEVICE inline
#endif

namespace tf_flash {

struct Philox4 {
  uint32_t x[4];
};

TF_FLASH_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

// One Philox round on the four counter words, in place.
TF_FLASH_HOST_DEVICE void philox_round(uint32_t& x0, uint32_t& x1, uint32_t& x2, uint32_t& x3, uint32_t key0,
                                       uint32_t key1) {
  uint32_t hi0, hi1;
  const uint32_t lo0 = mulhilo32(kPhiloxMul0, x0, &hi0);
  const uint32_t lo1 = mulhilo32(kPhiloxMul1, x2, &hi1);
  x0 = hi1 ^ x1 ^ key0;
  x1 = lo1;
  x2 = hi0 ^ x3 ^ key1;
  x3 = lo0;
}

TF_FLASH_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    philox_round(ctr.x[0], ctr.x[1], ctr.x[2], ctr.x[3], key0, key1);
    key0 += kPhiloxWeyl0;
    key1 += kPhiloxWeyl1;
  }
  return ctr;
}

// Keep decisions for the four key columns 4*(col/4) .. 4*(col/4)+3 of one (batch*head, row):
// bit t of the result is 1 when column 4*(col/4)+t is kept. Column groups of four share one Philox call.
// The counter is (col / 4, row, batch*heads + head, offset); the key is the seed. These two functions fix
// that layout; every generator of dropout draws goes through them.
TF_FLASH_HOST_DEVICE uint32_t dropout_key0(uint64_t seed, uint64_t) { return static_cast<uint32_t>(seed); }
TF_FLASH_HOST_DEVICE uint32_t dropout_key1(uint64_t seed, uint64_t offset) {
  return static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32);
}
TF_FLASH_HOST_DEVICE Philox4 dropout_counter(uint64_t offset, uint64_t batch_head, int64_t row, int64_t col) {
  return Philox4{{static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row), static_cast<uint32_t>(batch_head),
                  static_cast<uint32_t>(offset) ^ static_cast<uint32_t>(batch_head >> 32)}};
}

TF_FLASH_HOST_DEVICE uint32_t dropout_keep_bits4(uint64_t seed, uint64_t offset, uint64_t batch_head,
                                                 int64_t row, int64_t col, uint32_t drop_threshold) {
  const Philox4 r = philox4x32_10(dropout_counter(offset, batch_head, row, col), dropout_key0(seed, offset),
                                  dropout_key1(seed, offset));
  return (r.x[0] >= drop_threshold ? 1u : 0u) | (r.x[1] >= drop_threshold ? 2u : 0u) |
         (r.x[2] >= drop_threshold ? 4u : 0u) | (r.x[3] >= drop_threshold ? 8u : 0u);
}

// An entry is dropped when its 32-bit draw is below rate * 2^32.
TF_FLASH_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  const double t = static_cast<double>(rate) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

TF_FLASH_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t batch_head, int64_t row,
                                       int64_t col, uint32_t drop_threshold) {
  return (dropout_keep_bits4(seed, offset, batch_head, row, col, drop_threshold) >> (col & 3)) & 1u;
}

#if !defined(__CUDA_ARCH__)
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
// where dropped: the draws of dropout_keep_bits4, eight column groups at a time (AVX2 when compiled in).
inline void dropout_row_scales(uint64_t seed, uint64_t offset, uint64_t batch_head, int64_t row,
                               int64_t col_begin, int64_t col_end, uint32_t drop_threshold, float keep_scale,
                               float* out) {
  constexpr int kLanes = 8;
  const uint32_t key0 = dropout_key0(seed, offset), key1 = dropout_key1(seed, offset);
  const Philox4 first = dropout_counter(offset, batch_head, row, col_begin);
  for (int64_t group0 = col_begin >> 2; group0 * 4 < col_end; group0 += kLanes) {
    uint32_t draws[4][kLanes];
#if defined(__AVX2__)
    __m256i x0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(group0))),
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
    const int64_t first_col = group0 * 4;
    if (first_col >= col_begin && first_col + 4 * kLanes <= col_end) {  // a whole run of 32 columns
      // keep = draw >= threshold (unsigned), as keep_scale or 0; then columns 4g+t interleaved.
      const __m256i threshold = _mm256_set1_epi32(static_cast<int>(drop_threshold));
      const __m256 scale = _mm256_set1_ps(keep_scale);
      const auto keep = [&](__m256i x) {
        return _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(x, threshold), x), _mm256_castps_si256(scale));
      };
      const __m256i v0 = keep(x0), v1 = keep(x1), v2 = keep(x2), v3 = keep(x3);
      const __m256i a = _mm256_unpacklo_epi32(v0, v1), b = _mm256_unpackhi_epi32(v0, v1);
      const __m256i c = _mm256_unpacklo_epi32(v2, v3), d = _mm256_unpackhi_epi32(v2, v3);
      const __m256i g04 = _mm256_unpacklo_epi64(a, c), g15 = _mm256_unpackhi_epi64(a, c);
      const __m256i g26 = _mm256_unpacklo_epi64(b, d), g37 = _mm256_unpackhi_epi64(b, d);
      __m256i* dst = reinterpret_cast<__m256i*>(out + (first_col - col_begin));
      _mm256_storeu_si256(dst + 0, _mm256_permute2x128_si256(g04, g15, 0x20));
      _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(g26, g37, 0x20));
      _mm256_storeu_si256(dst + 2, _mm256_permute2x128_si256(g04, g15, 0x31));
      _mm256_storeu_si256(dst + 3, _mm256_permute2x128_si256(g26, g37, 0x31));
      continue;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(draws[0]), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(draws[1]), x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(draws[2]), x2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(draws[3]), x3);
#else
    for (int lane = 0; lane < kLanes; ++lane) {
      Philox4 ctr = first;
      ctr.x[0] = static_cast<uint32_t>(group0 + lane);
      const Philox4 r = philox4x32_10(ctr, key0, key1);
      for (int t = 0; t < 4; ++t) draws[t][lane] = r.x[t];
    }
#endif
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int t = 0; t < 4; ++t) {
        const int64_t col = (group0 + lane) * 4 + t;
        if (col >= col_begin && col < col_end) out[col - col_begin] = draws[t][lane] >= drop_threshold ? keep_scale : 0.f;
      }
    }
  }
}
#endif

}  // namespace tf_flash
