// Counter-based Philox4x32-10 (Salmon et al. 2011), the dropout RNG of tf_flash. One definition for
// host and device so that CPU and GPU drop exactly the same entries, and the backward pass regenerates
// the forward's mask from (seed, offset) instead of storing it.
#pragma once

#include <cstdint>

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

TF_FLASH_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kMul0, ctr.x[0], &hi0);
    const uint32_t lo1 = mulhilo32(kMul1, ctr.x[2], &hi1);
    ctr = Philox4{{hi1 ^ ctr.x[1] ^ key0, lo1, hi0 ^ ctr.x[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

// Keep decisions for the four key columns 4*(col/4) .. 4*(col/4)+3 of one (batch*head, row):
// bit t of the result is 1 when column 4*(col/4)+t is kept. Column groups of four share one Philox call.
TF_FLASH_HOST_DEVICE uint32_t dropout_keep_bits4(uint64_t seed, uint64_t offset, uint64_t batch_head,
                                                 int64_t row, int64_t col, uint32_t drop_threshold) {
  const Philox4 ctr{{static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row),
                     static_cast<uint32_t>(batch_head),
                     static_cast<uint32_t>(offset) ^ static_cast<uint32_t>(batch_head >> 32)}};
  const Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(seed),
                                  static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
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

}  // namespace tf_flash
