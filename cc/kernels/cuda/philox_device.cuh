// The device fast path of philox.h's dropout: keep masks taken from a Philox word with byte permutes, for
// the 16-bit probabilities the CUDA forward holds two to a register and the backward's keep bits.
#pragma once

#include <cstdint>

#include "cc/kernels/flash/philox.h"

namespace tf_flash {
namespace cuda {

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

}  // namespace cuda
}  // namespace tf_flash
