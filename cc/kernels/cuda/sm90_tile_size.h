// The Hopper family's tile sizes, one policy per direction: head dim and the work's shape -> key tile, stages
// and consumer warpgroups. The launchers build their traits from these functions, and the family choice
// (family.cu) reads them on the host without CuTe. The numbers in the reasons are the H100's, bf16.
#pragma once

#include <cstdint>

#include "cc/kernels/flash/params.h"

namespace tf_flash {
namespace cuda {

// ---- Forward ----
// kLong: unmasked work and causal work over many keys. kBanded: windows, causal attention over fewer keys, block
// masks, attn_mask and segment ids, whose diagonal or partly hidden tiles waste more of a taller query tile, and
// queries that fit a 128-row tile, which a taller one pads.
enum class Sm90ForwardShape { kLong, kBanded };

struct Sm90ForwardTiles {
  int block_n;    // keys per tile
  int stages;     // K/V stages of the TMA ring
  int consumers;  // consumer warpgroups, 64 query rows each
  constexpr int block_m() const { return 64 * consumers; }
};

// element_bytes: the inputs' (2, or 1 for fp8 e4m3, whose output is 2 bytes).
constexpr Sm90ForwardTiles sm90_forward_tiles(int head_dim, Sm90ForwardShape shape, int element_bytes = 2) {
  // fp8: the 16-bit tiles, whose key tiles of 64 or 128 are whole rows of V^T's 64- or 128-byte swizzle (a
  // K-major V^T stage has kBlockN bytes per row). Larger fp8 key tiles (FlashAttention-3 takes up to 224 at d128)
  // do not fit here: 256 keys spill and serialize the wgmma instructions, 192 leave the masks' threads a partial
  // key, and d256 has no shared memory for 128 (EXPERIMENTS.md). d64: two consumers in both shapes until measured:
  // with three (160 registers each) ptxas spills 72 / 48 bytes in the plain / general variants, none with two
  // (the 16-bit d64 spills 228 / 124 with three and still runs faster there: the GPU decides).
  if (element_bytes == 1 && head_dim == 64) return {128, 2, 2};
  // Two stages everywhere: three or four measure no faster (d64), and d256 has room for two only.
  // d256: 64 keys, so that S and O fit in a consumer's registers beside P.
  if (head_dim == 256) return {64, 2, 2};
  // d128: 128 keys; 160 spill registers (non-causal 4k: 497 against 594 TFLOP/s), 192 run 0.69-0.93x at 512-4k.
  if (head_dim == 128) return {128, 2, 2};
  // d64: three consumers (192 rows) where tiles are long, so that each K/V tile feeds enough GEMM rows (16k: 420
  // against 350 TFLOP/s); two where tiles are banded (causal 1k: 197 against 164 with three) or the queries fit
  // 128 rows.
  return {128, 2, shape == Sm90ForwardShape::kLong ? 3 : 2};
}

// Causal attention over at least this many keys takes kLong (d64 4k / 8k / 16k keys: 310 / 360 / 372 against
// 294 / 323 / 342 TFLOP/s with kBanded).
inline constexpr int kSm90MinCausalKeysLong = 4096;

inline Sm90ForwardShape sm90_forward_shape(const FlashFwdParams& p) {
  const bool windowed = p.window_left >= 0 || p.window_right >= 0;
  const bool short_causal = p.causal && p.seqlen_k < kSm90MinCausalKeysLong;
  // Block masks, attn_mask and segment ids need 128-row tiles: the tile table (a block mask's query tile lies in one
  // block).
  const bool tile_table = p.block_mask.data != nullptr || p.attn_mask.data != nullptr || p.q_segment_ids != nullptr;
  // A decode step's packed heads (1-128 rows) leave a 192-row d64 tile at least 64 rows of padding to compute, and
  // its runs are bound by that work, not by reading K and V (H200, 32 query / 8 KV heads, 8 x 1 @ 32k: 172 against
  // 222 us).
  const bool one_short_tile = p.seqlen_q <= 128;
  return windowed || short_causal || tile_table || one_short_tile ? Sm90ForwardShape::kBanded
                                                                  : Sm90ForwardShape::kLong;
}

// O leaves through a shared-memory buffer of its own where one fits beside Q and the K/V stages (so that the next
// tile's Q loads while this tile's O is stored), else through Q's (d256).
// output_bytes: O's element (the inputs' but for fp8, whose O never fits Q's buffer).
constexpr bool sm90_forward_own_output_buffer(int head_dim, Sm90ForwardShape shape, int element_bytes,
                                              int output_bytes) {
  const Sm90ForwardTiles t = sm90_forward_tiles(head_dim, shape, element_bytes);
  const int64_t q = int64_t(t.block_m()) * head_dim * element_bytes, kv = int64_t(t.block_n) * head_dim * element_bytes;
  const int64_t o = int64_t(t.block_m()) * head_dim * output_bytes;
  return q + o + 2 * t.stages * kv <= 200 * 1024;
}

// Where the forward launches a CTA per query tile, which the hardware hands out as CTAs finish, instead of a
// persistent CTA per SM: with a tile table (block masks, attn_mask, segment ids: made once per CTA), and under a
// causal mask over more keys than kSm90MinCausalKeysLong, whose tiles differ too much for the static schedule
// (d128 16k: 483 against 368 TFLOP/s).
inline bool sm90_forward_cta_per_tile(const FlashFwdParams& p) {
  return p.block_mask.data != nullptr || p.attn_mask.data != nullptr || p.q_segment_ids != nullptr ||
         (p.causal && p.seqlen_k > kSm90MinCausalKeysLong);
}

// Bytes of the forward's shared storage (FwdTraitsSm90::SharedStorage: Q, O where it has a buffer of its own, the
// K and V stages, each 1024-byte aligned, then the barriers); its launcher asserts the two agree.
constexpr int64_t sm90_forward_smem_bytes(int head_dim, Sm90ForwardShape shape, int element_bytes,
                                          int output_bytes) {
  const Sm90ForwardTiles t = sm90_forward_tiles(head_dim, shape, element_bytes);
  const int64_t q = int64_t(t.block_m()) * head_dim * element_bytes, kv = int64_t(t.block_n) * head_dim * element_bytes;
  const int64_t o = int64_t(t.block_m()) * head_dim * output_bytes;
  return q + (sm90_forward_own_output_buffer(head_dim, shape, element_bytes, output_bytes) ? o : 1024) +
         2 * t.stages * kv + 1024;
}

// Bytes after the shared storage where the forward keeps its tile table (block masks, attn_mask, segment ids;
// sm90_fwd_mask.h lays them out): four words of seen keys per consumer warp, with segment ids the range of the
// documents' key tiles (two ints), then a byte per key tile.
constexpr int64_t sm90_forward_table_bytes(int consumers, int block_n, int64_t seqlen_k, bool segment_ids) {
  return int64_t(consumers) * 4 * 4 * int64_t(sizeof(uint32_t)) + (segment_ids ? 2 * int64_t(sizeof(int)) : 0) +
         (seqlen_k + block_n - 1) / block_n;
}

// FP8 (e4m3) P V: 8-bit wgmma operands must both be K-major, so V comes transposed (V^T, keys contiguous, written
// by a pass before the kernel, fp8_values.cu), and P comes from S's accumulator registers in an order of its own. In
// S's accumulator a thread holds, per 8 keys, the column pair 2t, 2t + 1 (t = lane % 4) of row r and of row
// r + 8; an 8-bit A fragment holds 4 consecutive k of one row per register (k = 4t .. 4t + 3, then 16 + 4t ..,
// rows r and r + 8 alternating). Packing, per 32 keys, the pairs (row r: keys 0-7, 8-15), (row r + 8: the same),
// (row r: keys 16-23, 24-31), (row r + 8: the same) into the four registers (fp8_operand_from_probabilities,
// sm90_common.cuh) moves no value across threads, and puts at k position 4t + j of each 16 the key
// 2t + (j & 1) + 8 (j >> 1). V^T's columns ("slots") follow the same order, so P V sums matching keys.
TF_FLASH_HOST_DEVICE constexpr int fp8_value_key_of_slot(int slot) {
  const int p = slot % 16, t = p / 4, j = p % 4;
  return slot - p + 2 * t + (j & 1) + 8 * (j >> 1);
}
TF_FLASH_HOST_DEVICE constexpr int fp8_value_slot_of_key(int key) {
  const int c = key % 16, t = c % 8 / 2, j = (c & 1) + 2 * (c / 8);
  return key - c + 4 * t + j;
}
static_assert(fp8_value_key_of_slot(2) == 8 && fp8_value_key_of_slot(8) == 4 && fp8_value_key_of_slot(29) == 23 &&
                  fp8_value_slot_of_key(fp8_value_key_of_slot(13)) == 13 && fp8_value_slot_of_key(31) == 31,
              "the fp8 slot order and its inverse");

// An fp8 forward's V^T (fp8_values.cu) holds the keys padded to whole 16-key groups (zeros), so that every
// slot of a group (fp8_value_key_of_slot) lies inside the buffer the TMA reads.
inline constexpr int kFp8ValueKeyAlign = 16;
TF_FLASH_HOST_DEVICE int64_t fp8_value_keys(const FlashFwdParams& p) {
  return (int64_t(p.seqlen_k) + kFp8ValueKeyAlign - 1) / kFp8ValueKeyAlign * kFp8ValueKeyAlign;
}

// ---- Backward (dK/dV kernel) ----
struct Sm90BackwardTiles {
  int block_m;  // query rows per tile
  int block_n;  // keys per CTA tile (bwd_launch.h's bwd_key_tile, which both families share)
};

// plain: no dropout, soft-capping, block mask, attn_mask or segment ids.
constexpr Sm90BackwardTiles sm90_backward_tiles(int head_dim, bool plain) {
  // d256: 64 keys, whose dK and dV (split over the warpgroups by head dim) fit in registers.
  const int block_n = head_dim == 256 ? 64 : 128;
  // Plain d64: 128 query rows, since 64 x 64 x 64 GEMMs per warpgroup are too short to cover a tile's barriers,
  // softmax and dQ staging (+9-19% from 1k); the others keep 64 (32 dropout, mask and visibility bits per thread;
  // the attn_mask summaries cover 64 query rows).
  const int block_m = plain && head_dim == 64 ? 128 : 64;
  return {block_m, block_n};
}

// Bytes of the backward's shared storage (BwdTraitsSm90::SharedStorage: two stages of Q and of dO, K, V, dS's two
// buffers, the dQ staging or at head dim 256 P^T's two buffers, each a multiple of 1024 bytes; then lse2 and D of
// both stages, the two pipelines' barriers and the words of seen keys, the whole rounded up to 1024); its launcher
// asserts the two agree.
constexpr int64_t sm90_backward_smem_bytes(int head_dim, bool plain, int element_bytes) {
  const Sm90BackwardTiles t = sm90_backward_tiles(head_dim, plain);
  const int64_t q = 2 * int64_t(t.block_m) * head_dim * element_bytes;
  const int64_t kv = int64_t(t.block_n) * head_dim * element_bytes;
  const int64_t ds = 2 * int64_t(t.block_m) * t.block_n * element_bytes;
  const int64_t dq = head_dim == 256 ? ds : int64_t(t.block_m) * head_dim * int64_t(sizeof(float));
  const int64_t tail = 2 * 2 * int64_t(t.block_m) * int64_t(sizeof(float)) + 3 * 2 * 8 + t.block_n / 8;
  return 2 * q + 2 * kv + ds + dq + (tail + 1023) / 1024 * 1024;
}

// Bytes after the shared storage where the backward with segment ids keeps its table (sm90_bwd_scheduler.h and
// sm90_bwd_mask.h lay them out): the words of the query rows a border tile's keys see (a bit per row), then a byte
// per query tile of block_m rows.
constexpr int64_t sm90_backward_table_bytes(int block_m, int64_t seqlen_q) {
  return int64_t(block_m) / 32 * int64_t(sizeof(uint32_t)) + (seqlen_q + block_m - 1) / block_m;
}

}  // namespace cuda
}  // namespace tf_flash
