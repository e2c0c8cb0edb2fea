// Counter-based Philox4x32-10 (Salmon et al. 2011), the dropout RNG of tf_flash. One definition for
// host and device so that CPU and GPU drop exactly the same entries, and the backward pass regenerates
// the forward's mask from (seed, offset) instead of storing it. The generator and the dropout layout live
// here; the GPU's fast keep-mask extraction in cc/kernels/cuda/philox_device.cuh, the CPU's AVX2 row
// generator in cc/kernels/cpu/philox_avx2.h.
#pragma once

#include <cstdint>

#include "cc/kernels/flash/params.h"

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
// The dropout seed and offset of the params `p`: by value, or, on the GPU when p.seed_device is set (XLA,
// where the seed is a device operand), read from device memory, so no host ever waits for it.
// row_word carries p.query_offset (params.h: a call's row i draws at row i + query_offset): with dropout the
// offset is a multiple of 16 (FillParams), which moves only the counter's row word, by query_offset / 16 * 8,
// so 32 bits hold it (a 64-bit row offset held through the tile loops costs the float32 kernels spills).
struct DropoutSeed {
  uint64_t seed, offset;
  uint32_t row_word;
};
TF_FLASH_HOST_DEVICE uint32_t dropout_row_word(int64_t query_offset) {
  return static_cast<uint32_t>((static_cast<uint64_t>(query_offset) >> 4) << 3);
}
template <class Params>
TF_FLASH_HOST_DEVICE DropoutSeed dropout_seed(const Params& p) {
#ifdef __CUDA_ARCH__
  if (p.seed_device != nullptr) {
    return {uint64_t(__ldg(p.seed_device)), uint64_t(__ldg(p.seed_device + 1)), dropout_row_word(p.query_offset)};
  }
#endif
  return {p.seed, p.seed_offset, dropout_row_word(p.query_offset)};
}
// The draws of a call's row `row`, made at the attention's row + query_offset: what the kernels call.
TF_FLASH_HOST_DEVICE Philox4 dropout_draws(const DropoutSeed& s, uint64_t batch_head, int64_t row, int64_t col) {
  Philox4 counter = dropout_counter(s.offset, batch_head, row, col);
  counter.x[1] += s.row_word;
  return philox4x32_10(counter, dropout_key0(s.seed, s.offset), dropout_key1(s.seed, s.offset));
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

TF_FLASH_HOST_DEVICE bool dropout_keep(const DropoutSeed& s, uint64_t batch_head, int64_t row, int64_t col,
                                       uint32_t drop_threshold) {
  const Philox4 r = dropout_draws(s, batch_head, row, col);
  const int byte = dropout_byte(row, col);  // a multiple of 16 rows apart: the same byte
  return ((r.x[byte >> 2] >> (8 * (byte & 3))) & 0xFFu) >= drop_threshold;
}

}  // namespace tf_flash
