// Which (query row, key column) pairs are visible, shared by the CPU and CUDA kernels. Structured masks
// (lengths, causal, window) bound a row's visible key range, so whole tiles outside it are skipped;
// element masks (attention_mask, block_mask) are read inside the tiles that remain.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"

namespace tf_flash {

// Visible keys of query row `row` lie in [begin, end) before element masks; empty when begin >= end.
struct KeyRange {
  int64_t begin, end;
};

TF_FLASH_HOST_DEVICE int64_t valid_q_len(const FlashFwdParams& p, int b) {
  return p.q_lengths ? p.q_lengths[b] : p.seqlen_q;
}
TF_FLASH_HOST_DEVICE int64_t valid_kv_len(const FlashFwdParams& p, int b) {
  return p.kv_lengths ? p.kv_lengths[b] : p.seqlen_k;
}

TF_FLASH_HOST_DEVICE KeyRange key_range(const FlashFwdParams& p, int64_t row, int64_t q_len, int64_t kv_len) {
  if (row >= q_len) return {0, 0};
  int64_t begin = 0, end = kv_len;
  if (p.causal) end = end < row + 1 ? end : row + 1;
  if (p.window_right >= 0) end = end < row + p.window_right + 1 ? end : row + p.window_right + 1;
  if (p.window_left >= 0) begin = row - p.window_left > 0 ? row - p.window_left : 0;
  return {begin, end};
}

// Key range visible to any row of [row_begin, row_end): the union of the per-row ranges.
TF_FLASH_HOST_DEVICE KeyRange key_range_of_rows(const FlashFwdParams& p, int64_t row_begin, int64_t row_end,
                                                int64_t q_len, int64_t kv_len) {
  row_end = row_end < q_len ? row_end : q_len;
  if (row_begin >= row_end) return {0, 0};
  const KeyRange first = key_range(p, row_begin, q_len, kv_len);
  const KeyRange last = key_range(p, row_end - 1, q_len, kv_len);
  return {first.begin, last.end};  // begin and end are both non-decreasing in the row
}

// The CUDA kernels' softmax is base 2: p = 2^(s * softmax_scale_log2(p) - lse * log2(e)), s the raw q.k
// (or the soft-capped score, which carries the scale already). The forward and the backward both take
// this one factor (rounded once, from double), so that they compute every exponent the same way.
TF_FLASH_HOST_DEVICE float softmax_scale_log2(const FlashFwdParams& p) {
  const double scale = p.softcap > 0.f ? 1.0 : double(p.scale);
  const float scale_log2 = float(scale * 1.4426950408889634);
  return scale_log2 > 1e-30f ? scale_log2 : 1e-30f;  // never 0: -inf * 0 would be NaN
}

TF_FLASH_HOST_DEVICE bool mask_at(const BroadcastBoolMask& m, int b, int h, int64_t row, int64_t col) {
  return m.data[b * m.batch_stride + h * m.head_stride + row * m.row_stride + col * m.col_stride];
}

// True when block (qb, kb) of block_mask may hold a visible entry; false blocks are never loaded.
TF_FLASH_HOST_DEVICE bool block_visible(const FlashFwdParams& p, int b, int h, int64_t qb, int64_t kb) {
  return !p.block_mask.data || mask_at(p.block_mask, b, h, qb, kb);
}

}  // namespace tf_flash
