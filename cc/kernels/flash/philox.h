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

// ---- Dropout draws ------------------------------------------------------------------------------
// One Philox call yields 16 one-byte draws, laid out the way one thread holds entries of an mma.sync
// m16n8k16 accumulator: rows r and r + 8 of a 16-row block, columns 2q and 2q + 1 of each of the four
// 8-column groups of a 32-column block. The GPU kernels then draw exactly their own entries (no exchange
// between threads), and the CPU rebuilds the same mask from (row, col) alone:
//   call (col >> 5, (col >> 1) & 3, row >> 4, row & 7)     32 calls per 16 x 32 block
//   byte 4 * ((col >> 3) & 3) + 2 * ((row >> 3) & 1) + (col & 1)
// so word w of a call holds the 8-column group w: bytes (r, 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1).
// Counter: (call column, call row, batch*heads + head, offset); key: the seed. Every generator of dropout
// draws goes through these functions.
TF_FLASH_HOST_DEVICE uint32_t dropout_key0(uint64_t seed, uint64_t) { return static_cast<uint32_t>(seed); }
TF_FLASH_HOST_DEVICE uint32_t dropout_key1(uint64_t seed, uint64_t offset) {
  return static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32);
}
TF_FLASH_HOST_DEVICE Philox4 dropout_counter(uint64_t offset, uint64_t batch_head, int64_t row, int64_t col) {
  return Philox4{{static_cast<uint32_t>(((col >> 5) << 2) | ((col >> 1) & 3)),
                  static_cast<uint32_t>(((row >> 4) << 3) | (row & 7)), static_cast<uint32_t>(batch_head),
                  static_cast<uint32_t>(offset) ^ static_cast<uint32_t>(batch_head >> 32)}};
}
TF_FLASH_HOST_DEVICE Philox4 dropout_draws(uint64_t seed, uint64_t offset, uint64_t batch_head, int64_t row,
                                           int64_t col) {
  return philox4x32_10(dropout_counter(offset, batch_head, row, col), dropout_key0(seed, offset),
                       dropout_key1(seed, offset));
}
// The dropout seed and offset of the params `p`: by value, or, on the GPU when p.seed_device is set (XLA,
// where the seed is a device operand), read from device memory, so no host ever waits for it.
struct DropoutSeed {
  uint64_t seed, offset;
};
template <class Params>
TF_FLASH_HOST_DEVICE DropoutSeed dropout_seed(const Params& p) {
#ifdef __CUDA_ARCH__
  if (p.seed_device != nullptr) return {uint64_t(__ldg(p.seed_device)), uint64_t(__ldg(p.seed_device + 1))};
#endif
  return {p.seed, p.seed_offset};
}
TF_FLASH_HOST_DEVICE int dropout_byte(int64_t row, int64_t col) {
  return static_cast<int>(((col >> 3) & 3) * 4 + ((row >> 3) & 1) * 2 + (col & 1));
}

// An entry is dropped when its byte is below threshold = round(256 * rate), at least 1 for rate > 0 and at
// most 255: the rate takes effect in steps of 1/256 (as in FlashAttention-2), and kept entries are scaled
// by 256 / (256 - threshold), the inverse of the actual keep probability, so the expectation is exact.
TF_FLASH_HOST_DEVICE uint32_t dropout_threshold(float rate) {
  if (!(rate > 0.f)) return 0u;
  const double t = static_cast<double>(rate) * 256.0 + 0.5;
  return t < 1.0 ? 1u : (t >= 255.0 ? 255u : static_cast<uint32_t>(t));
}
TF_FLASH_HOST_DEVICE float dropout_keep_scale(float rate) {
  return 256.f / static_cast<float>(256u - dropout_threshold(rate));
}

TF_FLASH_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t batch_head, int64_t row,
                                       int64_t col, uint32_t drop_threshold) {
  const Philox4 r = dropout_draws(seed, offset, batch_head, row, col);
  const int byte = dropout_byte(row, col);
  return ((r.x[byte >> 2] >> (8 * (byte & 3))) & 0xFFu) >= drop_threshold;
}

#if defined(__CUDACC__)
// Keep masks of a thread's two 16-bit entries in one register: `row_half` 0 takes bytes 0, 1 of the word
// (row r), 1 takes bytes 2, 3 (row r + 8). threshold2 = threshold * 0x10001. Returns 0xFFFF in each kept
// 16-bit half, 0 in each dropped one.
__device__ __forceinline__ uint32_t dropout_keep_mask_x2(uint32_t word, int row_half, uint32_t threshold2) {
  // Bytes into 16-bit lanes 0x8000 + byte; minus the threshold, bit 15 of a lane stays set iff byte >=
  // threshold (no borrow crosses lanes). prmt's sign mode then copies bits 15 and 31 over their halves.
  uint32_t lanes, mask;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lanes) : "r"(word), "r"(0x80808080u), "r"(row_half ? 0x4342u : 0x4140u));
  lanes -= threshold2;
  asm("prmt.b32 %0, %1, %1, 0xBB99;" : "=r"(mask) : "r"(lanes));
  return mask;
}

// The four keep bits of one word as bits 0..3: (r, 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1).
__device__ __forceinline__ uint32_t dropout_keep_bits4(uint32_t word, uint32_t threshold2) {
  uint32_t lo, hi, signs;
  asm("prmt.b32 %0, %1, %2, 0x4140;" : "=r"(lo) : "r"(word), "r"(0x80808080u));
  asm("prmt.b32 %0, %1, %2, 0x4342;" : "=r"(hi) : "r"(word), "r"(0x80808080u));
  lo -= threshold2;
  hi -= threshold2;
  asm("prmt.b32 %0, %1, %2, 0x7531;" : "=r"(signs) : "r"(lo), "r"(hi));  // bits 7, 15, 23, 31
  return ((signs & 0x80808080u) * 0x00204081u) >> 28;                      // -> bits 0..3
}
#endif

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
#endif

}  // namespace tf_flash
