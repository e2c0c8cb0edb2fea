// Which (query row, key column) pairs are visible: the one statement of the rules, shared by the CPU
// kernel and the CUDA forward and backward. Structured masks (lengths, causal, window) bound a row's
// visible key range (and a key's visible query range), so whole tiles outside it are skipped; element
// masks (attention_mask, block_mask) are read inside the tiles that remain. All positions are 64-bit:
// row + window overflows int32 for windows near 2^31.
#pragma once

#include <cmath>
#include <cstdint>

#include "cc/kernels/flash/params.h"

namespace tf_flash {

// A half-open index range [begin, end); empty when begin >= end.
struct IndexRange {
  int64_t begin, end;
};
using KeyRange = IndexRange;

// A user-supplied length clamped into [0, limit].
TF_FLASH_HOST_DEVICE int64_t clamp_len(int64_t len, int64_t limit) {
  return len < 0 ? 0 : (len > limit ? limit : len);
}
// Valid query / key prefix of batch entry b.
TF_FLASH_HOST_DEVICE int64_t valid_q_len(const FlashFwdParams& p, int b) {
  return clamp_len(p.q_lengths ? p.q_lengths[b] : p.seqlen_q, p.seqlen_q);
}
TF_FLASH_HOST_DEVICE int64_t valid_kv_len(const FlashFwdParams& p, int b) {
  return clamp_len(p.kv_lengths ? p.kv_lengths[b] : p.seqlen_k, p.seqlen_k);
}

// Row i's position in the attention: i >> position_shift (rows may share positions), plus query_offset and,
// with bottom_right, the entry's kv_len minus the call's positions (params.h).
TF_FLASH_HOST_DEVICE int64_t row_shift(const FlashFwdParams& p, int64_t kv_len) {
  return p.query_offset + (p.bottom_right ? kv_len - (p.seqlen_q >> p.position_shift) : 0);
}
TF_FLASH_HOST_DEVICE int64_t row_position(const FlashFwdParams& p, int64_t row, int64_t kv_len) {
  return (row >> p.position_shift) + row_shift(p, kv_len);
}

// How far right of the diagonal a row sees: causal and window_right combined; -1 = unlimited.
TF_FLASH_HOST_DEVICE int64_t right_extent(const FlashFwdParams& p) {
  return p.causal ? 0 : p.window_right;  // causal: j <= row, whatever window_right (>= 0) allows
}

// Visible keys of query row `row` before element masks: key j iff j < kv_len, j <= pos + right and
// j >= pos - window_left, where pos = row_position is the row's position in the attention.
TF_FLASH_HOST_DEVICE KeyRange key_range(const FlashFwdParams& p, int64_t row, int64_t q_len, int64_t kv_len) {
  if (row >= q_len) return {0, 0};
  int64_t begin = 0, end = kv_len;
  const int64_t right = right_extent(p), pos = row_position(p, row, kv_len);
  if (right >= 0 && pos + right + 1 < end) end = pos + right + 1;
  if (p.window_left >= 0 && pos - p.window_left > 0) begin = pos - p.window_left;
  return {begin, end};
}

// Key range visible to any row of [row_begin, row_end): the union of the per-row ranges (contiguous:
// begin and end are both non-decreasing in the row).
TF_FLASH_HOST_DEVICE KeyRange key_range_of_rows(const FlashFwdParams& p, int64_t row_begin, int64_t row_end,
                                                int64_t q_len, int64_t kv_len) {
  row_end = row_end < q_len ? row_end : q_len;
  if (row_begin >= row_end) return {0, 0};
  const KeyRange first = key_range(p, row_begin, q_len, kv_len);
  const KeyRange last = key_range(p, row_end - 1, q_len, kv_len);
  return {first.begin, last.end};
}

// The keys the query tile [row_begin, row_begin + rows) sees before element masks: the ranges of its first
// and its last valid row (their union is contiguous) and the key tiles of tile_cols columns they span, the
// forward's loop bounds. All empty when no valid row sees a key.
struct QueryTileKeys {
  KeyRange first_row, last_row;  // {0, 0} when the tile holds no valid row
  int tile_begin, tile_end;      // key tiles [tile_begin, tile_end)
};
TF_FLASH_HOST_DEVICE QueryTileKeys query_tile_keys(const FlashFwdParams& p, int64_t row_begin, int rows,
                                                   int tile_cols, int64_t q_len, int64_t kv_len) {
  QueryTileKeys t{{0, 0}, {0, 0}, 0, 0};
  if (row_begin >= q_len) return t;
  const int64_t row_end = row_begin + rows < q_len ? row_begin + rows : q_len;
  t.first_row = key_range(p, row_begin, q_len, kv_len);
  t.last_row = key_range(p, row_end - 1, q_len, kv_len);
  if (t.last_row.end > t.first_row.begin) {
    t.tile_begin = int(t.first_row.begin / tile_cols);
    t.tile_end = int((t.last_row.end + tile_cols - 1) / tile_cols);
  }
  return t;
}

// Query rows that see some key of [col_begin, col_end) before element masks (the transpose of
// key_range_of_rows, for the backward's loop over the query tiles of a key tile).
TF_FLASH_HOST_DEVICE IndexRange query_range_of_keys(const FlashFwdParams& p, int64_t col_begin, int64_t col_end,
                                                    int64_t q_len, int64_t kv_len) {
  col_end = col_end < kv_len ? col_end : kv_len;
  if (col_begin >= col_end) return {0, 0};
  int64_t begin = 0, end = q_len;
  const int64_t right = right_extent(p), offset = row_shift(p, kv_len);
  const int64_t rows = int64_t{1} << p.position_shift;  // positions [first, last) see a key: rows [first, last) * rows
  if (right >= 0 && col_begin - right - offset > 0) begin = (col_begin - right - offset) * rows;  // pos >= col - right
  if (p.window_left >= 0 && (col_end + p.window_left - offset) * rows < end) {
    end = (col_end + p.window_left - offset) * rows;  // pos <= col + left
  }
  return end > begin ? IndexRange{begin, end} : IndexRange{0, 0};
}

// True when every valid row of [row_begin, row_end) sees every key of [col_begin, col_end) before element
// masks: such tiles need no per-element structural test.
TF_FLASH_HOST_DEVICE bool tile_fully_visible(const FlashFwdParams& p, int64_t row_begin, int64_t row_end,
                                             int64_t col_begin, int64_t col_end, int64_t q_len, int64_t kv_len) {
  row_end = row_end < q_len ? row_end : q_len;
  if (row_begin >= row_end) return false;
  const KeyRange first = key_range(p, row_begin, q_len, kv_len);
  const KeyRange last = key_range(p, row_end - 1, q_len, kv_len);
  return col_begin >= last.begin && col_end <= first.end;
}

// The visible columns of row `row` inside the key tile [col0, col0 + tile_cols), relative to col0 and
// clamped to [0, tile_cols], so that the per-element test inside a tile is 32-bit.
struct TileSpan {
  int lo, hi;
};
TF_FLASH_HOST_DEVICE TileSpan visible_span_in_tile(const FlashFwdParams& p, int64_t row, int64_t q_len,
                                                   int64_t kv_len, int64_t col0, int tile_cols) {
  const KeyRange range = key_range(p, row, q_len, kv_len);
  const int64_t lo = range.begin - col0, hi = range.end - col0;
  return {int(lo < 0 ? 0 : (lo > tile_cols ? tile_cols : lo)), int(hi < 0 ? 0 : (hi > tile_cols ? tile_cols : hi))};
}

TF_FLASH_HOST_DEVICE bool mask_at(const BroadcastBoolMask& m, int b, int h, int64_t row, int64_t col) {
  return m.data[b * m.batch_stride + h * m.head_stride + row * m.row_stride + col * m.col_stride];
}

// True when block (qb, kb) of block_mask may hold a visible entry; false blocks are never loaded.
TF_FLASH_HOST_DEVICE bool block_visible(const FlashFwdParams& p, int b, int h, int64_t qb, int64_t kb) {
  return !p.block_mask.data || mask_at(p.block_mask, b, h, qb, kb);
}

TF_FLASH_HOST_DEVICE bool has_segments(const FlashFwdParams& p) { return p.q_segment_ids != nullptr; }

// Any mask read entry by entry or block by block: attn_mask, block_mask, segment ids.
TF_FLASH_HOST_DEVICE bool has_element_masks(const FlashFwdParams& p) {
  return p.attn_mask.data != nullptr || p.block_mask.data != nullptr || has_segments(p);
}

TF_FLASH_HOST_DEVICE bool same_segment(const FlashFwdParams& p, int b, int64_t row, int64_t col) {
  return p.q_segment_ids[int64_t{b} * p.seqlen_q + row] == p.kv_segment_ids[int64_t{b} * p.seqlen_k + col];
}

// The element masks (attn_mask, block_mask, segment ids) at one entry. Index: the type the block indices are divided
// in; int where positions fit (the GPU backward's inner loop: a 64-bit division there costs registers).
template <class Index>
TF_FLASH_HOST_DEVICE bool element_visible(const FlashFwdParams& p, int b, int h, Index row, Index col) {
  if (p.attn_mask.data && !mask_at(p.attn_mask, b, h, row, col)) return false;
  if (has_segments(p) && !same_segment(p, b, row, col)) return false;
  return block_visible(p, b, h, row / Index(p.block_q), col / Index(p.block_k));
}

// The whole rule for one entry: structured range, then element masks.
TF_FLASH_HOST_DEVICE bool visible(const FlashFwdParams& p, int b, int h, int64_t row, int64_t col, int64_t q_len,
                                  int64_t kv_len) {
  const KeyRange range = key_range(p, row, q_len, kv_len);
  return col >= range.begin && col < range.end && element_visible(p, b, h, row, col);
}

// The segment bounds of ids [batch, seqlen] (launch.h: segment_bounds_elements): per entry a {min, max} pair
// per kSegmentBlock positions, then per entry a flag, 0 where its ids never decrease (packed documents).
TF_FLASH_HOST_DEVICE int64_t segment_blocks(int64_t seqlen) { return (seqlen + kSegmentBlock - 1) / kSegmentBlock; }
TF_FLASH_HOST_DEVICE bool segment_ids_sorted(const int32_t* bounds, int batch, int64_t seqlen, int b) {
  return bounds[2 * int64_t(batch) * segment_blocks(seqlen) + b] == 0;
}

// The {min, max} of the segment ids of rows [begin, end) of entry b, from their kSegmentBlock bounds.
struct SegmentSpan {
  int32_t min, max;
};
TF_FLASH_HOST_DEVICE SegmentSpan segment_span(const int32_t* bounds, int64_t seqlen, int b, int64_t begin,
                                              int64_t end) {
  const int64_t blocks = segment_blocks(seqlen);
  const int32_t* entry = bounds + 2 * (b * blocks);
  SegmentSpan s{entry[2 * (begin / kSegmentBlock)], entry[2 * (begin / kSegmentBlock) + 1]};
  for (int64_t i = begin / kSegmentBlock + 1; i <= (end - 1) / kSegmentBlock; ++i) {
    s.min = entry[2 * i] < s.min ? entry[2 * i] : s.min;
    s.max = entry[2 * i + 1] > s.max ? entry[2 * i + 1] : s.max;
  }
  return s;
}

// The tiles of `tile` positions of the other side (its bounds, batch and seqlen) that may hold an id of `ids`,
// in entry b. Where that side's ids never decrease, the blocks whose ids meet [ids.min, ids.max] are one run,
// found by binary search: a tile loop then visits its own document's tiles only, not every tile to test
// and skip it. Elsewhere every tile.
struct TileRange {
  int begin, end;
};
TF_FLASH_HOST_DEVICE TileRange segment_tiles(const int32_t* bounds, int batch, int64_t seqlen, int b, SegmentSpan ids,
                                             int tile) {
  const int64_t blocks = segment_blocks(seqlen);
  if (blocks == 0) return {0, 0};
  if (!segment_ids_sorted(bounds, batch, seqlen, b)) return {0, int((seqlen + tile - 1) / tile)};
  const int32_t* entry = bounds + 2 * (b * blocks);
  int64_t lo = 0, hi = blocks;  // the first block whose max reaches ids.min
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (entry[2 * mid + 1] < ids.min) lo = mid + 1; else hi = mid;
  }
  const int64_t first = lo;
  hi = blocks;  // the first block from there whose min passes ids.max
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (entry[2 * mid] <= ids.max) lo = mid + 1; else hi = mid;
  }
  if (lo <= first) return {0, 0};
  const int64_t end = lo * kSegmentBlock < seqlen ? lo * kSegmentBlock : seqlen;
  return {int(first * kSegmentBlock / tile), int((end + tile - 1) / tile)};
}

// Key tiles of tile_cols keys that rows [row_begin, row_end) of entry b may see by their segment ids (every
// tile without segment ids).
TF_FLASH_HOST_DEVICE TileRange segment_key_tiles(const FlashFwdParams& p, int b, int64_t row_begin, int64_t row_end,
                                                 int tile_cols) {
  if (!has_segments(p)) return {0, int((p.seqlen_k + tile_cols - 1) / tile_cols)};
  if (row_end <= row_begin) return {0, 0};
  const SegmentSpan ids = segment_span(p.q_segment_bounds, p.seqlen_q, b, row_begin, row_end);
  return segment_tiles(p.kv_segment_bounds, p.batch, p.seqlen_k, b, ids, tile_cols);
}

// Query tiles of tile_rows rows that keys [col_begin, col_end) of entry b may be seen by (the transpose).
TF_FLASH_HOST_DEVICE TileRange segment_query_tiles(const FlashFwdParams& p, int b, int64_t col_begin, int64_t col_end,
                                                   int tile_rows) {
  if (!has_segments(p)) return {0, int((p.seqlen_q + tile_rows - 1) / tile_rows)};
  if (col_end <= col_begin) return {0, 0};
  const SegmentSpan ids = segment_span(p.kv_segment_bounds, p.seqlen_k, b, col_begin, col_end);
  return segment_tiles(p.q_segment_bounds, p.batch, p.seqlen_q, b, ids, tile_rows);
}

// How the element masks that tiles can skip by (block_mask, segment ids) cover the tile
// [row_begin, row_end) x [col_begin, col_end) (valid rows and columns only): `any` entry may be visible
// (else the tile is skipped, never loaded), `all` are (else entries are masked one by one). Segment ids
// cover a tile in full when its rows and columns lie in one document, and not at all when their id ranges
// do not meet. Without either mask every tile is covered in full; an empty tile is not covered.
struct BlockCoverage {
  bool any, all;
};
TF_FLASH_HOST_DEVICE BlockCoverage block_coverage(const FlashFwdParams& p, int b, int h, int64_t row_begin,
                                                  int64_t row_end, int64_t col_begin, int64_t col_end) {
  if (!p.block_mask.data && !has_segments(p)) return {true, true};
  if (row_end <= row_begin || col_end <= col_begin) return {false, false};
  BlockCoverage c{true, true};
  if (has_segments(p)) {
    const SegmentSpan rows = segment_span(p.q_segment_bounds, p.seqlen_q, b, row_begin, row_end);
    const SegmentSpan cols = segment_span(p.kv_segment_bounds, p.seqlen_k, b, col_begin, col_end);
    if (rows.max < cols.min || cols.max < rows.min) return {false, false};
    c.all = rows.min == rows.max && cols.min == cols.max && rows.min == cols.min;
  }
  if (!p.block_mask.data) return c;
  bool block_any = false, block_all = true;
  for (int64_t qb = row_begin / p.block_q; qb <= (row_end - 1) / p.block_q; ++qb) {
    for (int64_t kb = col_begin / p.block_k; kb <= (col_end - 1) / p.block_k; ++kb) {
      const bool v = mask_at(p.block_mask, b, h, qb, kb);
      block_any |= v;
      block_all &= v;
      if (block_any && !block_all) return {true, false};  // partial: no further block changes the answer
    }
  }
  return {block_any, c.all && block_all};
}

// The scale the CUDA kernels apply to the raw q.k: p.scale, times the staging's power of two (params.h).
TF_FLASH_HOST_DEVICE double score_scale(const FlashFwdParams& p) {
#if defined(__CUDA_ARCH__)
  if (p.scale_exponent_device != nullptr) return ldexp(double(p.scale), *p.scale_exponent_device);
#endif
  return double(p.scale);
}

// The CUDA kernels' softmax is base 2: p = 2^(s * softmax_scale_log2(p) - lse * log2(e)), s the raw q.k
// (or the soft-capped score, which carries the scale already). The forward and the backward both take
// this one factor (rounded once, from double), so that they compute every exponent the same way.
TF_FLASH_HOST_DEVICE float softmax_scale_log2(const FlashFwdParams& p) {
  const double scale = p.softcap > 0.f ? 1.0 : score_scale(p);
  const float scale_log2 = float(scale * 1.4426950408889634);
  return scale_log2 > 1e-30f ? scale_log2 : 1e-30f;  // never 0: -inf * 0 would be NaN
}

// The factor into the soft-capping's tanh: score_scale / softcap (0 when off).
TF_FLASH_HOST_DEVICE float softcap_input_scale(const FlashFwdParams& p) {
  return p.softcap > 0.f ? float(score_scale(p) / p.softcap) : 0.f;
}

}  // namespace tf_flash
