// Tiled FlashAttention on the CPU: the paper's Algorithms 1/2 (forward, online softmax, FA2 loop order)
// and 4 (backward recomputing the probabilities from lse). Tiles are dense float32 Eigen matrices, so the
// products run on Eigen's blocked GEMM (the AVX2 path), on the AVX-512 micro-kernels, or for bfloat16 inputs
// on the AVX512_BF16 ones (cpu_isa.h), the path chosen once per process; scores exist one [rows x cols] tile
// at a time per thread.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cc/kernels/cpu/cpu_isa.h"
#include "cc/kernels/cpu/philox_avx2.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/philox.h"
#include "cc/kernels/flash/split_kv.h"

namespace tf_flash {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;
// The B operand of the forward's products: a Matrix, or float32 rows of a [B, S, H, D] tensor read in place
// (OuterStride: the tensor's row stride).
using ConstRows = Eigen::Map<const Matrix, 0, Eigen::OuterStride<>>;
using RowsRef = Eigen::Ref<const Matrix, 0, Eigen::OuterStride<>>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Query rows x key columns of one tile: larger tiles amortize GEMM packing (measured best of 32..256 x
// 64..512 on AVX2 at d=64); the float32 score tile (128 KiB) stays in L2.
constexpr int kDefaultTileQ = 128;
constexpr int kDefaultTileK = 256;

struct Tiles {
  int q, k;
};

// With a block mask, tiles follow its blocks so that a False block maps onto whole skipped tiles.
Tiles ChooseTiles(const FlashFwdParams& p) {
  if (!p.block_mask.data) return {kDefaultTileQ, kDefaultTileK};
  const int q = p.block_q <= 256 ? p.block_q : (p.block_q % 128 == 0 ? 128 : kDefaultTileQ);
  const int k = p.block_k <= 512 ? p.block_k : (p.block_k % 256 == 0 ? 256 : kDefaultTileK);
  return {q, k};
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Both AVX-512 paths: the same tile loops, the softmax's exp on cpu_avx512's 16 lanes.
bool Wide() { return cpu_isa() != CpuIsa::kAvx2; }

// Who multiplies the tiles of one call: Eigen (the AVX2 path), cpu_avx512's float32 micro-kernels, or, for
// bfloat16 inputs on the AVX512_BF16 path, cpu_avx512bf16's (P and dS rounded to bfloat16: cpu_isa.h), on
// AMX tiles on the AMX path.
// One choice per call, so the forward, the row normalizers and the backward multiply alike.
enum class Products { kEigen, kAvx512, kAvx512Bf16, kAmx };

template <typename T>
Products ProductsFor() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512Amx:
      return std::is_same_v<T, Eigen::bfloat16> ? Products::kAmx : Products::kAvx512;
    case CpuIsa::kAvx512Bf16:
      return std::is_same_v<T, Eigen::bfloat16> ? Products::kAvx512Bf16 : Products::kAvx512;
    case CpuIsa::kAvx512: return Products::kAvx512;
    case CpuIsa::kAvx2: break;
  }
  return Products::kEigen;
}

// The pairs of bfloat16 one cpu_avx512bf16 product packs (per thread, grown to the largest tile).
uint32_t* Bf16Scratch(int64_t words) {
  thread_local std::vector<uint32_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < words) scratch.resize(words);
  return scratch.data();
}

// The AVX-512 products of row-major float matrices, float32 or bfloat16 pairs by `products` (cpu_isa.h: each
// element one chain in order, so the forward's and the backward's equal tiles stay bit-equal):
// c = alpha * a b^T (c resized), c (+)= alpha * a b into rows of stride ldc, and c += alpha * a^T b.
void WideProductNT(Products products, const Matrix& a, const RowsRef& b, float alpha, Matrix* c) {
  c->resize(a.rows(), b.rows());
  if (products == Products::kAvx512Bf16) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::scratch_words(a.rows(), b.rows(), a.cols()));
    cpu_avx512bf16::gemm_nt(a.rows(), b.rows(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha,
                            false, c->data(), c->cols(), scratch);
    return;
  }
  if (products == Products::kAmx) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::amx_scratch_words(a.rows(), b.rows(), a.cols()));
    cpu_avx512bf16::amx_gemm_nt(a.rows(), b.rows(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha,
                                false, c->data(), c->cols(), scratch);
    return;
  }
  thread_local std::vector<float> pack;
  pack.resize(cpu_avx512::gemm_nt_pack_floats(a.cols()));
  cpu_avx512::gemm_nt(a.rows(), b.rows(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha, false,
                      c->data(), c->cols(), pack.data());
}

void WideProductNN(Products products, const Matrix& a, const RowsRef& b, float alpha, bool accumulate, float* c,
                   int64_t ldc) {
  if (products == Products::kAvx512Bf16) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::scratch_words(a.rows(), b.cols(), a.cols()));
    cpu_avx512bf16::gemm_nn(a.rows(), b.cols(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha,
                            accumulate, c, ldc, scratch);
    return;
  }
  if (products == Products::kAmx) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::amx_scratch_words(a.rows(), b.cols(), a.cols()));
    cpu_avx512bf16::amx_gemm_nn(a.rows(), b.cols(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha,
                                accumulate, c, ldc, scratch);
    return;
  }
  cpu_avx512::gemm_nn(a.rows(), b.cols(), a.cols(), a.data(), a.cols(), b.data(), b.outerStride(), alpha, accumulate,
                      c, ldc);
}

void WideProductTN(Products products, const Matrix& a, const Matrix& b, float alpha, Matrix* c) {
  if (products == Products::kAvx512Bf16) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::scratch_words(a.cols(), b.cols(), a.rows()));
    cpu_avx512bf16::gemm_tn(a.cols(), b.cols(), a.rows(), a.data(), a.cols(), b.data(), b.cols(), alpha, true,
                            c->data(), c->cols(), scratch);
    return;
  }
  if (products == Products::kAmx) {
    uint32_t* scratch = Bf16Scratch(cpu_avx512bf16::amx_scratch_words(a.cols(), b.cols(), a.rows()));
    cpu_avx512bf16::amx_gemm_tn(a.cols(), b.cols(), a.rows(), a.data(), a.cols(), b.data(), b.cols(), alpha, true,
                                c->data(), c->cols(), scratch);
    return;
  }
  cpu_avx512::gemm_tn(a.cols(), b.cols(), a.rows(), a.data(), a.cols(), b.data(), b.cols(), alpha, true, c->data(),
                      c->cols());
}

// The online softmax's step on one row of a score tile (the AVX-512 path): the running max and sum updated,
// the row replaced by exp(row - new max) (max 0 while it is -inf); returns exp(old max - new max), by which
// what was accumulated rescales. ForwardUnit and RowNormalizers both call this: they agree bit for bit.
float OnlineSoftmaxRow(float* row, int64_t cols, float* row_max, float* row_sum) {
  const float new_max = std::max(*row_max, cpu_avx512::max_of(row, cols));
  const float safe_max = new_max == kNegInf ? 0.f : new_max;
  const float correction = std::exp(*row_max - safe_max);
  *row_max = new_max;
  *row_sum = *row_sum * correction + cpu_avx512::exp_shifted_sum(row, cols, safe_max);
  return correction;
}

// Copies `rows` rows of one head of a [B, S, H, D] tensor into a dense float matrix, times `scale`.
template <typename T>
void LoadRows(const T* first_row, int64_t row_stride, int64_t rows, int dim, float scale, Matrix* out) {
  out->resize(rows, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = first_row + r * row_stride;
    float* dst = out->data() + r * dim;
    for (int d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
  }
}

template <typename T>
void StoreRows(const Matrix& in, int64_t rows, T* first_row, int64_t row_stride) {
  const int64_t dim = in.cols();
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = in.data() + r * dim;
    T* dst = first_row + r * row_stride;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(src[d]);
  }
}

template <typename T>
void StoreZeroRows(int64_t rows, int dim, T* first_row, int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r) std::fill(first_row + r * row_stride, first_row + r * row_stride + dim, T(0.f));
}

// A K or V tile as the products read it: float32 rows in place, at the tensor's row stride (copying them is a
// pass over the tile per query tile), unless `copy`; other dtypes, or a tile the caller writes to (`copy`),
// converted into `buffer`.
template <typename T>
ConstRows TileRows(const T* first_row, int64_t row_stride, int64_t rows, int dim, Matrix* buffer, bool copy = false) {
  if constexpr (std::is_same_v<T, float>) {
    if (!copy) return ConstRows(first_row, rows, dim, Eigen::OuterStride<>(row_stride));
  }
  LoadRows(first_row, row_stride, rows, dim, 1.f, buffer);
  return ConstRows(buffer->data(), rows, dim, Eigen::OuterStride<>(dim));
}

// The score tile S = scale * (Q K^T) (scaled after the product, as dense attention does: no rounding of
// scale * Q). The forward, RowNormalizers and the backward all call this on identical tiles (same shapes,
// same data), so the backward's scores are the forward's bit for bit.
void ScoreTile(const FlashFwdParams& p, Products products, const Matrix& q, const RowsRef& k, Matrix* scores) {
  // The AVX-512 kernels round alike: the sum, then * scale.
  if (products != Products::kEigen) return WideProductNT(products, q, k, p.scale, scores);
  scores->noalias() = q * k.transpose();
  *scores *= p.scale;
}

// Logit soft-capping, s -> softcap * tanh(s / softcap), in place; the forward and the backward call this
// one function on identical tiles, so the backward's probabilities are the forward's bit for bit. With
// d_tanh, also returns d(capped)/d(s) = 1 - tanh^2 for the backward.
void SoftcapScores(float softcap, Matrix* scores, Matrix* d_tanh) {
  if (!(softcap > 0.f)) return;
  if (Wide()) {  // 16 lanes, the same three steps
    if (d_tanh) d_tanh->resize(scores->rows(), scores->cols());
    cpu_avx512::softcap(scores->data(), scores->size(), softcap, d_tanh ? d_tanh->data() : nullptr);
    return;
  }
  scores->array() = (scores->array() * (1.f / softcap)).tanh();
  if (d_tanh) *d_tanh = 1.f - scores->array().square();
  scores->array() *= softcap;
}

// Zeroes the rows of a K or V tile that no query row of the current tile sees (col_seen from
// MaskScores), so that 0 x NaN from padding never reaches a product.
void ZeroUnseenRows(const std::vector<uint8_t>& col_seen, Matrix* tile) {
  for (size_t c = 0; c < col_seen.size(); ++c) {
    if (!col_seen[c]) tile->row(c).setZero();
  }
}

enum class TileCover { kSkip, kPartial, kFull };

// How the block mask and the segment ids cover the tile [row0, row0+rows) x [col0, col0+cols) of (b, h)
// (mask.h's rule).
TileCover BlockCover(const FlashFwdParams& p, int b, int h, int64_t row0, int64_t rows, int64_t col0,
                     int64_t cols) {
  const BlockCoverage c = block_coverage(p, b, h, row0, row0 + rows, col0, col0 + cols);
  return !c.any ? TileCover::kSkip : (c.all ? TileCover::kFull : TileCover::kPartial);
}

// One unit of the threaded loops over (batch, head, query tile), numbered batch-major: its head, its
// kv head (GQA) and its rows. The forward and the backward's row normalizers number units alike.
struct QueryTile {
  int b, h, hkv;
  int64_t row0, rows;

  QueryTile(const FlashFwdParams& p, int64_t tile_rows, int64_t unit) {
    const int64_t num_q_tiles = CeilDiv(p.seqlen_q, tile_rows);
    b = static_cast<int>(unit / (int64_t{p.num_heads} * num_q_tiles));
    h = static_cast<int>((unit / num_q_tiles) % p.num_heads);
    hkv = h / (p.num_heads / p.num_heads_kv);
    row0 = (unit % num_q_tiles) * tile_rows;
    rows = std::min<int64_t>(tile_rows, p.seqlen_q - row0);
  }
};

// The per-(b, h) view of everything the tile loops need to decide visibility.
struct HeadContext {
  const FlashFwdParams& p;
  int b, h;
  int64_t q_len, kv_len;
  uint64_t batch_head;
  float keep_scale;         // 1 / keep probability (philox.h: dropout_keep_scale)
  uint32_t drop_threshold;  // byte draws below it are dropped
  bool kv_ids_sorted;       // segment ids whose keys never decrease: a row's document is one run of keys

  HeadContext(const FlashFwdParams& params, int batch, int head)
      : p(params), b(batch), h(head), q_len(valid_q_len(params, batch)), kv_len(valid_kv_len(params, batch)),
        batch_head(static_cast<uint64_t>(batch) * params.num_heads + head),
        keep_scale(dropout_keep_scale(params.dropout_rate)), drop_threshold(dropout_threshold(params.dropout_rate)),
        kv_ids_sorted(has_segments(params) &&
                      segment_ids_sorted(params.kv_segment_bounds, params.batch, params.seqlen_k, batch)) {}

  bool has_dropout() const { return p.dropout_rate > 0.f; }

  // Sets the invisible entries of the score tile to -inf (by replacement: a NaN score of an invisible key
  // never survives); returns false when nothing in it is visible. When some key column is invisible to
  // every row of the tile, *col_seen[c] says which columns some row sees (empty when all are seen).
  bool MaskScores(int64_t row0, int64_t col0, TileCover block_cover, Matrix* scores,
                  std::vector<uint8_t>* col_seen) const {
    const int64_t rows = scores->rows(), cols = scores->cols();
    col_seen->clear();
    const bool structurally_full = tile_fully_visible(p, row0, row0 + rows, col0, col0 + cols, q_len, kv_len);
    if (structurally_full && block_cover == TileCover::kFull && !p.attn_mask.data) return true;
    col_seen->assign(cols, 0);
    // Per-entry tests where the tile is partly covered: block_mask's blocks, attn_mask, and segment ids
    // unless each row's document is one run of sorted keys (then a range, as the structural masks are).
    const bool partial = block_cover == TileCover::kPartial;
    const bool entry_blocks = partial && p.block_mask.data;
    const bool entry_segments = partial && has_segments(p) && !kv_ids_sorted;
    const bool segment_runs = partial && has_segments(p) && kv_ids_sorted;
    const bool per_entry = entry_blocks || entry_segments || p.attn_mask.data;
    const bool row_mask_alone = Wide() && p.attn_mask.data && p.attn_mask.col_stride == 1 && !entry_blocks &&
                                !entry_segments;
    const int32_t* tile_ids = segment_runs ? p.kv_segment_ids + int64_t{b} * p.seqlen_k + col0 : nullptr;
    bool any_visible = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = row0 + r;
      const TileSpan span = visible_span_in_tile(p, row, q_len, kv_len, col0, static_cast<int>(cols));
      int64_t lo = span.lo, hi = std::max(span.lo, span.hi);
      if (segment_runs) {
        const auto run = std::equal_range(tile_ids + lo, tile_ids + hi, p.q_segment_ids[int64_t{b} * p.seqlen_q + row]);
        lo = run.first - tile_ids;
        hi = run.second - tile_ids;
      }
      float* s = scores->data() + r * cols;
      std::fill(s, s + lo, kNegInf);
      std::fill(s + hi, s + cols, kNegInf);
      if (!per_entry) {
        std::fill(col_seen->begin() + lo, col_seen->begin() + hi, uint8_t{1});
        any_visible |= lo < hi;
        continue;
      }
      if (row_mask_alone) {  // attn_mask alone, its columns contiguous: 16 at a time (the loop below's rule)
        const bool* mask = p.attn_mask.data + b * p.attn_mask.batch_stride + h * p.attn_mask.head_stride +
                           row * p.attn_mask.row_stride + col0;
        any_visible |= cpu_avx512::mask_row(s, reinterpret_cast<const uint8_t*>(mask), col_seen->data(), lo, hi);
        continue;
      }
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t col = col0 + c;
        bool visible = !entry_blocks || block_visible(p, b, h, row / p.block_q, col / p.block_k);
        if (visible && p.attn_mask.data) visible = mask_at(p.attn_mask, b, h, row, col);
        if (visible && entry_segments) visible = same_segment(p, b, row, col);
        if (!visible) s[c] = kNegInf;
        (*col_seen)[c] |= visible;
        any_visible |= visible;
      }
    }
    if (std::all_of(col_seen->begin(), col_seen->end(), [](uint8_t seen) { return seen != 0; })) col_seen->clear();
    return any_visible;
  }

  // keep[r, c] = keep_scale where entry (row0+r, col0+c) survives dropout, else 0. Draws are made at the
  // attention's rows (params.h: query_offset).
  void DropoutScales(int64_t row0, int64_t col0, int64_t rows, int64_t cols, Matrix* keep) const {
    keep->resize(rows, cols);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = row0 + r + p.query_offset;
      if ((row & 8) && r >= 8) continue;  // drawn with row - 8
      // One Philox call holds rows row and row + 8 (philox.h): draw both when both are in the tile.
      const bool pair = !(row & 8) && r + 8 < rows;
      dropout_row_scales(p.seed, p.seed_offset, batch_head, row, col0, col0 + cols, drop_threshold, keep_scale,
                         keep->data() + r * cols, pair ? keep->data() + (r + 8) * cols : nullptr);
    }
  }
};

// The keys rows [row0, row0 + rows) see before element masks, narrowed to the tiles of tile_cols keys that
// hold their documents (mask.h: segment_key_tiles), so that a packed row's loop passes over other documents.
KeyRange VisitedKeys(const HeadContext& ctx, int64_t row0, int64_t rows, int tile_cols) {
  KeyRange range = key_range_of_rows(ctx.p, row0, row0 + rows, ctx.q_len, ctx.kv_len);
  const TileRange documents = segment_key_tiles(ctx.p, ctx.b, row0, row0 + rows, tile_cols);
  range.begin = std::max<int64_t>(range.begin, int64_t{documents.begin} * tile_cols);
  range.end = std::min<int64_t>(range.end, int64_t{documents.end} * tile_cols);
  return range;
}

// ------------------------------------------------------------------------------------------------
// Forward: one work unit = (batch, head, query tile), or with split-KV one run of its key tiles; online
// softmax over the visible key tiles.
// ------------------------------------------------------------------------------------------------
template <typename T>
void ForwardUnit(const FlashFwdParams& p, const Tiles& tiles, int64_t unit, int split, Matrix& q, Matrix& k,
                 Matrix& v, Matrix& s, Matrix& keep, Matrix& acc, std::vector<uint8_t>& col_seen) {
  const QueryTile tile(p, tiles.q, unit);
  const int b = tile.b, h = tile.h, hkv = tile.hkv;
  const int64_t row0 = tile.row0, rows = tile.rows;
  const HeadContext ctx(p, b, h);
  const Products products = ProductsFor<T>();

  const int64_t entry = split_entry(p, split, b);  // b, or this run's output with split-KV
  T* out = static_cast<T*>(p.out) + entry * p.o_batch_stride + row0 * p.o_row_stride + h * p.o_head_stride;
  float* lse = p.lse + (entry * p.num_heads + h) * p.seqlen_q + row0;
  const int64_t valid_rows = std::clamp<int64_t>(ctx.q_len - row0, 0, rows);
  // Padded query rows: output 0, lse -inf.
  StoreZeroRows(rows - valid_rows, p.head_dim_v, out + valid_rows * p.o_row_stride, p.o_row_stride);
  std::fill(lse + valid_rows, lse + rows, kNegInf);
  if (valid_rows == 0) return;

  const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_batch_stride + row0 * p.q_row_stride + h * p.q_head_stride;
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  LoadRows(q_ptr, p.q_row_stride, valid_rows, p.head_dim, 1.f, &q);

  acc.setZero(valid_rows, p.head_dim_v);
  Vector row_max = Vector::Constant(valid_rows, kNegInf);
  Vector row_sum = Vector::Zero(valid_rows);
  KeyRange range = VisitedKeys(ctx, row0, valid_rows, tiles.k);
  if (p.num_splits > 1) {
    int tile_begin = static_cast<int>(range.begin / tiles.k);
    int tile_end = static_cast<int>(CeilDiv(range.end, tiles.k));
    narrow_to_split(p.num_splits, split, tile_begin, tile_end);
    range.begin = std::max<int64_t>(range.begin, int64_t{tile_begin} * tiles.k);
    range.end = std::min<int64_t>(range.end, int64_t{tile_end} * tiles.k);
  }
  for (int64_t col0 = (range.begin / tiles.k) * tiles.k; col0 < range.end; col0 += tiles.k) {
    // The tile spans the valid keys, not only range.end: the backward multiplies the same shapes.
    const int64_t cols = std::min<int64_t>(tiles.k, ctx.kv_len - col0);
    const TileCover cover = BlockCover(p, b, h, row0, valid_rows, col0, std::min<int64_t>(cols, range.end - col0));
    if (cover == TileCover::kSkip) continue;  // never loaded
    ScoreTile(p, products, q, TileRows(k_head + col0 * p.k_row_stride, p.k_row_stride, cols, p.head_dim, &k), &s);
    SoftcapScores(p.softcap, &s, nullptr);
    if (!ctx.MaskScores(row0, col0, cover, &s, &col_seen)) continue;
    // V in place unless rows of it are zeroed (keys no row of the tile sees): then copied into v, zeroed there.
    const bool zero_unseen = !col_seen.empty();
    const ConstRows v_rows =
        TileRows(v_head + col0 * p.v_row_stride, p.v_row_stride, cols, p.head_dim_v, &v, /*copy=*/zero_unseen);
    if (zero_unseen) ZeroUnseenRows(col_seen, &v);

    if (Wide()) {
      for (int64_t r = 0; r < valid_rows; ++r) {
        acc.row(r) *= OnlineSoftmaxRow(s.data() + r * cols, cols, &row_max[r], &row_sum[r]);
      }
      if (ctx.has_dropout()) {
        ctx.DropoutScales(row0, col0, valid_rows, cols, &keep);
        cpu_avx512::multiply(s.data(), keep.data(), s.size());
      }
      WideProductNN(products, s, v_rows, 1.f, true, acc.data(), acc.cols());
      continue;
    }
    // Online softmax: rescale what was accumulated by exp(old max - new max).
    const Vector tile_max = s.rowwise().maxCoeff();
    for (int64_t r = 0; r < valid_rows; ++r) {
      const float new_max = std::max(row_max[r], tile_max[r]);
      const float safe_max = new_max == kNegInf ? 0.f : new_max;
      const float correction = std::exp(row_max[r] - safe_max);
      row_max[r] = new_max;
      row_sum[r] *= correction;
      acc.row(r) *= correction;
      s.row(r).array() -= safe_max;
    }
    s = s.array().exp().matrix();
    row_sum += s.rowwise().sum();
    if (ctx.has_dropout()) {  // the normalizer sums the undropped probabilities
      ctx.DropoutScales(row0, col0, valid_rows, cols, &keep);
      s.array() *= keep.array();
    }
    acc.noalias() += s * v_rows;
  }
  for (int64_t r = 0; r < valid_rows; ++r) {
    if (row_sum[r] > 0.f) {
      acc.row(r) /= row_sum[r];
      lse[r] = row_max[r] + std::log(row_sum[r]);
    } else {  // nothing visible: 0, never NaN
      acc.row(r).setZero();
      lse[r] = kNegInf;
    }
  }
  StoreRows(acc, valid_rows, out, p.o_row_stride);
}

template <typename T>
void Forward(const FlashFwdParams& params, const ParallelFor& parallel_for) {
  const Tiles tiles = ChooseTiles(params);
  const int64_t tile_units = int64_t{params.batch} * params.num_heads * CeilDiv(params.seqlen_q, tiles.q);
  // Split-KV: the runs write their outputs (in T) into a buffer of their own, merged below.
  const int splits = std::max(params.num_splits, 1);
  std::vector<char> workspace(SplitWorkspace(params, sizeof(T)).bytes);
  const FlashFwdParams p = splits > 1 ? split_run_params(params, workspace.data(), sizeof(T)) : params;
  const int64_t cost = int64_t{tiles.q} * std::max(p.seqlen_k, 1) * (p.head_dim + p.head_dim_v) * 2 / splits;
  parallel_for(tile_units * splits, cost, [&](int64_t begin, int64_t end) {
    Matrix q, k, v, s, keep, acc;
    std::vector<uint8_t> col_seen;
    for (int64_t unit = begin; unit < end; ++unit) {
      ForwardUnit<T>(p, tiles, unit % tile_units, static_cast<int>(unit / tile_units), q, k, v, s, keep, acc,
                     col_seen);
    }
  });
  if (splits == 1) return;
  // Row (b, h, i) of the call, in lse's order, from its runs (split_entry: split * batch + b).
  const int64_t rows = int64_t{p.batch} * p.num_heads * p.seqlen_q;
  parallel_for(rows, int64_t{splits} * p.head_dim_v * 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(p.head_dim_v);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % p.seqlen_q, batch_head = row / p.seqlen_q;
      const int64_t h = batch_head % p.num_heads, b = batch_head / p.num_heads;
      const float lse = merge_split_lse(p.lse + row, rows, splits);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int split = 0; split < splits; ++split) {
        const float weight = split_weight(p.lse[row + split * rows], lse);
        if (weight == 0.f) continue;
        const int64_t entry = split_entry(p, split, static_cast<int>(b));
        const T* run_out = static_cast<const T*>(p.out) + entry * p.o_batch_stride + i * p.o_row_stride +
                           h * p.o_head_stride;
        for (int d = 0; d < p.head_dim_v; ++d) sum[d] += weight * static_cast<float>(run_out[d]);
      }
      T* out = static_cast<T*>(params.out) + b * params.o_batch_stride + i * params.o_row_stride +
               h * params.o_head_stride;
      for (int d = 0; d < p.head_dim_v; ++d) out[d] = static_cast<T>(sum[d]);
      params.lse[row] = lse;
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Backward: D = rowsum(dO * O) - dlse first; then one work unit = (batch, kv head, key-tile slice):
// dK and dV of its key tiles accumulate locally over the group's query heads and all query tiles; dQ
// goes to the unit's own float32 partial buffer (slices interleave key tiles), summed at the end.
// ------------------------------------------------------------------------------------------------
// The dQ partial sums take at most this much scratch (unless one copy of dQ is larger), whatever the
// thread count: slices buy parallelism only when there are few (batch, kv head) units.
constexpr int64_t kMaxDqPartialBytes = int64_t{256} << 20;

int NumKeySlices(const FlashBwdParams& p, int num_threads) {
  const int64_t kv_units = int64_t{p.batch} * p.num_heads_kv;
  const int64_t num_k_tiles = CeilDiv(std::max(p.seqlen_k, 1), ChooseTiles(p).k);
  if (kv_units == 0 || kv_units >= 4 * num_threads) return 1;
  const int64_t d_q_bytes = int64_t{p.batch} * p.seqlen_q * p.num_heads * p.head_dim * int64_t{sizeof(float)};
  const int64_t by_budget = std::max<int64_t>(1, kMaxDqPartialBytes / std::max<int64_t>(d_q_bytes, 1));
  return static_cast<int>(std::min({num_k_tiles, CeilDiv(4 * num_threads, kv_units), by_budget}));
}

struct BwdScratch {
  float* d_q_partial;  // [slices, B, Sq, H, D]
  float* delta;        // [B, H, Sq]
  // P = exp(S - row_ref) * row_inv_sum: row_ref = lse and row_inv_sum = 1, or, where lse is too large
  // for its float32 rounding to be negligible, the forward's own row max and 1 / row sum (RowNormalizers).
  float* row_ref;      // [B, H, Sq]
  float* row_inv_sum;  // [B, H, Sq]
};

BwdScratch SplitScratch(const FlashBwdParams& p, int slices) {
  const int64_t d_q_size = int64_t{slices} * p.batch * p.seqlen_q * p.num_heads * p.head_dim;
  const int64_t rows = int64_t{p.batch} * p.num_heads * p.seqlen_q;
  return {p.scratch, p.scratch + d_q_size, p.scratch + d_q_size + rows, p.scratch + d_q_size + 2 * rows};
}

// Above this |lse|, half an ulp of the float32 lse (3.8e-6 at 64, 4.9e-4 at 1e4) would be the largest
// error of the recomputed probabilities (dense float32 attention has none of it): such query tiles get
// their row max and sum recomputed exactly as the forward computed them, an extra Q K^T pass over
// their visible keys that ordinary logits never pay.
constexpr float kExactNormalizerLse = 64.f;

// One (batch, head, query tile): row_ref / row_inv_sum for its rows (see BwdScratch).
template <typename T>
void RowNormalizers(const FlashBwdParams& p, const Tiles& tiles, const BwdScratch& scratch, int64_t unit,
                    std::vector<Matrix>& m, std::vector<uint8_t>& col_seen) {
  Matrix &q = m[0], &k = m[1], &s = m[2], &v = m[3], &d_out = m[4], &d_p = m[5], &keep = m[6];
  const QueryTile tile(p, tiles.q, unit);
  const int b = tile.b, h = tile.h, hkv = tile.hkv;
  const int64_t row0 = tile.row0, rows = tile.rows;
  const HeadContext ctx(p, b, h);
  const Products products = ProductsFor<T>();
  const int64_t offset = (int64_t{b} * p.num_heads + h) * p.seqlen_q + row0;
  const float* lse = p.lse + offset;
  float* row_ref = scratch.row_ref + offset;
  float* row_inv_sum = scratch.row_inv_sum + offset;
  bool exact = false;
  for (int64_t r = 0; r < rows; ++r) {
    row_ref[r] = lse[r];
    row_inv_sum[r] = 1.f;
    exact |= std::isfinite(lse[r]) && std::abs(lse[r]) > kExactNormalizerLse;
  }
  const int64_t valid_rows = std::clamp<int64_t>(ctx.q_len - row0, 0, rows);
  if (!exact || valid_rows == 0) return;
  // The forward's loop (ForwardUnit) without V: the same tiles, scores and online max / sum.
  LoadRows(static_cast<const T*>(p.q) + b * p.q_batch_stride + row0 * p.q_row_stride + h * p.q_head_stride,
           p.q_row_stride, valid_rows, p.head_dim, 1.f, &q);
  const T* k_head = static_cast<const T*>(p.k) + b * p.k_batch_stride + hkv * p.k_head_stride;
  Vector row_max = Vector::Constant(valid_rows, kNegInf);
  Vector row_sum = Vector::Zero(valid_rows);
  const KeyRange range = VisitedKeys(ctx, row0, valid_rows, tiles.k);
  // The forward's score tiles of these rows (ForwardUnit's loop without V), masked: body(col0, cols) on each.
  auto for_each_score_tile = [&](auto&& body) {
    for (int64_t col0 = (range.begin / tiles.k) * tiles.k; col0 < range.end; col0 += tiles.k) {
      const int64_t cols = std::min<int64_t>(tiles.k, ctx.kv_len - col0);
      const TileCover cover =
          BlockCover(p, b, h, row0, valid_rows, col0, std::min<int64_t>(cols, range.end - col0));
      if (cover == TileCover::kSkip) continue;
      LoadRows(k_head + col0 * p.k_row_stride, p.k_row_stride, cols, p.head_dim, 1.f, &k);
      ScoreTile(p, products, q, k, &s);
      SoftcapScores(p.softcap, &s, nullptr);
      if (ctx.MaskScores(row0, col0, cover, &s, &col_seen)) body(col0, cols);
    }
  };
  for_each_score_tile([&](int64_t, int64_t cols) {
    if (Wide()) {
      for (int64_t r = 0; r < valid_rows; ++r) OnlineSoftmaxRow(s.data() + r * cols, cols, &row_max[r], &row_sum[r]);
      return;
    }
    const Vector tile_max = s.rowwise().maxCoeff();
    for (int64_t r = 0; r < valid_rows; ++r) {
      const float new_max = std::max(row_max[r], tile_max[r]);
      const float safe_max = new_max == kNegInf ? 0.f : new_max;
      row_sum[r] *= std::exp(row_max[r] - safe_max);
      row_max[r] = new_max;
      s.row(r).array() -= safe_max;
    }
    s = s.array().exp().matrix();
    row_sum += s.rowwise().sum();
  });
  auto renormalized = [&](int64_t r) {
    return row_sum[r] > 0.f && std::isfinite(lse[r]) && std::abs(lse[r]) > kExactNormalizerLse;
  };
  bool any = false;
  for (int64_t r = 0; r < valid_rows; ++r) {
    if (renormalized(r)) {
      row_ref[r] = row_max[r];
      row_inv_sum[r] = 1.f / row_sum[r];
      any = true;
    }
  }
  if (!any) return;
  // D of these rows as rowsum(P * dP), with P and dP computed exactly as the backward computes them (same
  // operations on the same tiles), not as rowsum(dO * O): at such logits P is nearly one-hot and dS = P (dP - D)
  // is a difference of two nearly equal numbers, so D must carry the same rounding as dP (dense attention's
  // softmax gradient has the same property). Equal to rowsum(dO * O) in exact arithmetic.
  LoadRows(static_cast<const T*>(p.d_out) + b * p.o_batch_stride + row0 * p.o_row_stride + h * p.o_head_stride,
           p.o_row_stride, valid_rows, p.head_dim_v, 1.f, &d_out);
  const T* v_head = static_cast<const T*>(p.v) + b * p.v_batch_stride + hkv * p.v_head_stride;
  Vector p_dot_dp = Vector::Zero(valid_rows);
  for_each_score_tile([&](int64_t col0, int64_t cols) {
    for (int64_t r = 0; r < valid_rows; ++r) {
      if (Wide()) {
        cpu_avx512::exp_shifted_scaled(s.data() + r * cols, cols, row_ref[r], row_inv_sum[r]);
      } else {
        s.row(r) = ((s.row(r).array() - row_ref[r]).exp() * row_inv_sum[r]).matrix();
      }
    }
    LoadRows(v_head + col0 * p.v_row_stride, p.v_row_stride, cols, p.head_dim_v, 1.f, &v);
    if (Wide()) {
      WideProductNT(products, d_out, v, 1.f, &d_p);
    } else {
      d_p.noalias() = d_out * v.transpose();
    }
    if (ctx.has_dropout()) {
      ctx.DropoutScales(row0, col0, valid_rows, cols, &keep);
      d_p.array() *= keep.array();
    }
    // Where P is 0 the product is 0 (an invisible value row may have made dP NaN there), as in the backward.
    p_dot_dp += (s.array() == 0.f).select(0.f, s.array() * d_p.array()).matrix().rowwise().sum();
  });
  float* delta = scratch.delta + offset;
  for (int64_t r = 0; r < valid_rows; ++r) {
    if (renormalized(r)) delta[r] = p_dot_dp[r] - (p.d_lse ? p.d_lse[offset + r] : 0.f);
  }
}

template <typename T>
void BackwardUnit(const FlashBwdParams& p, const Tiles& tiles, int slices, const BwdScratch& scratch,
                  int64_t unit, std::vector<Matrix>& m, std::vector<uint8_t>& col_seen) {
  Matrix &q = m[0], &k = m[1], &v = m[2], &d_out = m[3], &s = m[4], &d_p = m[5], &keep = m[6], &d_k = m[7],
         &d_v = m[8], &d_q = m[9], &d_tanh = m[10], &k_seen = m[11];
  const Products products = ProductsFor<T>();
  const int slice = static_cast<int>(unit % slices);
  const int hkv = static_cast<int>((unit / slices) % p.num_heads_kv);
  const int b = static_cast<int>(unit / (int64_t{slices} * p.num_heads_kv));
  const int group = p.num_heads / p.num_heads_kv;
  const int64_t num_k_tiles = CeilDiv(p.seqlen_k, tiles.k);
  const int64_t q_len = valid_q_len(p, b), kv_len = valid_kv_len(p, b);
  const int64_t dq_row_stride = int64_t{p.num_heads} * p.head_dim;
  float* d_q_batch = scratch.d_q_partial +
                     ((int64_t{slice} * p.batch + b) * p.seqlen_q) * dq_row_stride;

  for (int64_t kt = slice; kt < num_k_tiles; kt += slices) {
    const int64_t col0 = kt * tiles.k;
    const int64_t cols = std::min<int64_t>(tiles.k, p.seqlen_k - col0);
    T* d_k_out = static_cast<T*>(p.d_k) + b * p.k_batch_stride + col0 * p.k_row_stride + hkv * p.k_head_stride;
    T* d_v_out = static_cast<T*>(p.d_v) + b * p.v_batch_stride + col0 * p.v_row_stride + hkv * p.v_head_stride;
    const int64_t valid_cols = std::clamp<int64_t>(kv_len - col0, 0, cols);
    StoreZeroRows(cols - valid_cols, p.head_dim, d_k_out + valid_cols * p.k_row_stride, p.k_row_stride);
    StoreZeroRows(cols - valid_cols, p.head_dim_v, d_v_out + valid_cols * p.v_row_stride, p.v_row_stride);
    if (valid_cols == 0) continue;
    LoadRows(static_cast<const T*>(p.k) + b * p.k_batch_stride + col0 * p.k_row_stride + hkv * p.k_head_stride,
             p.k_row_stride, valid_cols, p.head_dim, 1.f, &k);
    LoadRows(static_cast<const T*>(p.v) + b * p.v_batch_stride + col0 * p.v_row_stride + hkv * p.v_head_stride,
             p.v_row_stride, valid_cols, p.head_dim_v, 1.f, &v);
    // A non-finite key that some query tile cannot see must not reach that tile's dQ = dS K as 0 x NaN.
    const bool k_finite = k.allFinite();
    d_k.setZero(valid_cols, p.head_dim);
    d_v.setZero(valid_cols, p.head_dim_v);

    for (int h = hkv * group; h < (hkv + 1) * group; ++h) {
      const HeadContext ctx(p, b, h);
      const float* row_ref = scratch.row_ref + (int64_t{b} * p.num_heads + h) * p.seqlen_q;
      const float* row_inv_sum = scratch.row_inv_sum + (int64_t{b} * p.num_heads + h) * p.seqlen_q;
      const float* delta = scratch.delta + (int64_t{b} * p.num_heads + h) * p.seqlen_q;
      for (int64_t row0 = 0; row0 < q_len; row0 += tiles.q) {
        const int64_t rows = std::min<int64_t>(tiles.q, q_len - row0);
        const KeyRange range = key_range_of_rows(p, row0, row0 + rows, q_len, kv_len);
        if (range.end <= col0 || range.begin >= col0 + valid_cols) continue;
        const TileCover cover =
            BlockCover(p, b, h, row0, rows, col0, std::min<int64_t>(valid_cols, range.end - col0));
        if (cover == TileCover::kSkip) continue;
        // The forward's score tile, recomputed with the same operations on the same shapes (ForwardUnit).
        LoadRows(static_cast<const T*>(p.q) + b * p.q_batch_stride + row0 * p.q_row_stride + h * p.q_head_stride,
                 p.q_row_stride, rows, p.head_dim, 1.f, &q);
        ScoreTile(p, products, q, k, &s);
        SoftcapScores(p.softcap, &s, &d_tanh);
        if (!ctx.MaskScores(row0, col0, cover, &s, &col_seen)) continue;
        // P = exp(S - lse): the forward's probabilities, rebuilt; rows with lse = -inf see nothing.
        for (int64_t r = 0; r < rows; ++r) {
          const float ref = row_ref[row0 + r];
          if (ref == kNegInf) {
            s.row(r).setZero();
          } else if (Wide()) {
            cpu_avx512::exp_shifted_scaled(s.data() + r * valid_cols, valid_cols, ref, row_inv_sum[row0 + r]);
          } else if (row_inv_sum[row0 + r] == 1.f) {
            s.row(r) = (s.row(r).array() - ref).exp().matrix();
          } else {
            s.row(r) = ((s.row(r).array() - ref).exp() * row_inv_sum[row0 + r]).matrix();
          }
        }
        LoadRows(static_cast<const T*>(p.d_out) + b * p.o_batch_stride + row0 * p.o_row_stride +
                     h * p.o_head_stride,
                 p.o_row_stride, rows, p.head_dim_v, 1.f, &d_out);
        if (Wide()) {
          WideProductNT(products, d_out, v, 1.f, &d_p);
          if (ctx.has_dropout()) {  // the forward's mask, regenerated; keep becomes P * keep for dV
            ctx.DropoutScales(row0, col0, rows, valid_cols, &keep);
            cpu_avx512::multiply(d_p.data(), keep.data(), d_p.size());
            cpu_avx512::multiply(keep.data(), s.data(), keep.size());
            WideProductTN(products, keep, d_out, 1.f, &d_v);
          } else {
            WideProductTN(products, s, d_out, 1.f, &d_v);
          }
          // dS = P * (dP - D) in place of dP, through the soft-cap's 1 - tanh^2 (the formula below, 16 lanes).
          cpu_avx512::softmax_grad(d_p.data(), s.data(), p.softcap > 0.f ? d_tanh.data() : nullptr, delta + row0,
                                   rows, valid_cols);
          WideProductTN(products, d_p, q, p.scale, &d_k);
        } else {
          d_p.noalias() = d_out * v.transpose();
          if (ctx.has_dropout()) {  // the forward's mask, regenerated
            ctx.DropoutScales(row0, col0, rows, valid_cols, &keep);
            d_v.noalias() += (s.array() * keep.array()).matrix().transpose() * d_out;
            d_p.array() *= keep.array();
          } else {
            d_v.noalias() += s.transpose() * d_out;
          }
          // dS = P * (dP - D), overwriting dP; exactly 0 where P is (an invisible value row may have made
          // dP NaN there). Through the soft-cap: dS *= 1 - tanh^2.
          for (int64_t r = 0; r < rows; ++r) d_p.row(r).array() -= delta[row0 + r];
          d_p = (s.array() == 0.f).select(0.f, s.array() * d_p.array()).matrix();
          if (p.softcap > 0.f) d_p.array() *= d_tanh.array();
          d_k.noalias() += p.scale * (d_p.transpose() * q);
        }
        const Matrix* k_used = &k;
        if (!k_finite && !col_seen.empty()) {
          k_seen = k;
          ZeroUnseenRows(col_seen, &k_seen);
          k_used = &k_seen;
        }
        float* d_q_rows = d_q_batch + row0 * dq_row_stride + int64_t{h} * p.head_dim;
        if (Wide()) {  // straight into the partial sums: d_q_rows += scale * dS K
          WideProductNN(products, d_p, *k_used, p.scale, true, d_q_rows, dq_row_stride);
          continue;
        }
        d_q.noalias() = p.scale * (d_p * *k_used);
        for (int64_t r = 0; r < rows; ++r) {
          Eigen::Map<Eigen::VectorXf>(d_q_rows + r * dq_row_stride, p.head_dim) += d_q.row(r).transpose();
        }
      }
    }
    StoreRows(d_k, valid_cols, d_k_out, p.k_row_stride);
    StoreRows(d_v, valid_cols, d_v_out, p.v_row_stride);
  }
}

template <typename T>
void Backward(const FlashBwdParams& p, int num_threads, const ParallelFor& parallel_for) {
  const Tiles tiles = ChooseTiles(p);
  const int slices = NumKeySlices(p, num_threads);
  const BwdScratch scratch = SplitScratch(p, slices);
  const int64_t dq_row_size = int64_t{p.num_heads} * p.head_dim;
  const int64_t batch_rows = int64_t{p.batch} * p.seqlen_q;

  // Pass 1, per (batch, query row): D = rowsum(dO * O) - dlse for every head; zero the dQ partials.
  parallel_for(batch_rows, int64_t{p.num_heads} * p.head_dim_v * 4 + slices * dq_row_size,
               [&](int64_t begin, int64_t end) {
                 for (int64_t br = begin; br < end; ++br) {
                   const int64_t b = br / p.seqlen_q, row = br % p.seqlen_q;
                   const int64_t offset = b * p.o_batch_stride + row * p.o_row_stride;
                   const T* d_out = static_cast<const T*>(p.d_out) + offset;
                   const T* out = static_cast<const T*>(p.out) + offset;
                   for (int h = 0; h < p.num_heads; ++h) {
                     float dot = 0.f;
                     for (int d = 0; d < p.head_dim_v; ++d) {
                       const int64_t i = int64_t{h} * p.o_head_stride + d;
                       dot += static_cast<float>(d_out[i]) * static_cast<float>(out[i]);
                     }
                     const int64_t lse_index = (b * p.num_heads + h) * p.seqlen_q + row;
                     scratch.delta[lse_index] = dot - (p.d_lse ? p.d_lse[lse_index] : 0.f);
                   }
                   for (int slice = 0; slice < slices; ++slice) {
                     std::memset(scratch.d_q_partial + (slice * batch_rows + br) * dq_row_size, 0,
                                 dq_row_size * sizeof(float));
                   }
                 }
               });

  // Pass 1b, per (batch, head, query tile): the rows' probability normalizers (RowNormalizers).
  {
    const int64_t num_units = int64_t{p.batch} * p.num_heads * CeilDiv(p.seqlen_q, tiles.q);
    parallel_for(num_units, int64_t{tiles.q} * std::max(p.seqlen_k, 1) * p.head_dim,
                 [&](int64_t begin, int64_t end) {
                   std::vector<Matrix> matrices(7);
                   std::vector<uint8_t> col_seen;
                   for (int64_t unit = begin; unit < end; ++unit) {
                     RowNormalizers<T>(p, tiles, scratch, unit, matrices, col_seen);
                   }
                 });
  }

  // Pass 2: dK, dV per key tile; dQ partials.
  if (p.seqlen_k > 0) {
    const int64_t num_units = int64_t{p.batch} * p.num_heads_kv * slices;
    const int64_t cost = int64_t{p.seqlen_q} * p.seqlen_k / slices * (p.num_heads / p.num_heads_kv) *
                         (2 * p.head_dim + 2 * p.head_dim_v) * 2;
    parallel_for(num_units, std::max<int64_t>(cost, 1), [&](int64_t begin, int64_t end) {
      std::vector<Matrix> matrices(12);
      std::vector<uint8_t> col_seen;
      for (int64_t unit = begin; unit < end; ++unit) {
        BackwardUnit<T>(p, tiles, slices, scratch, unit, matrices, col_seen);
      }
    });
  }

  // Pass 3, per (batch, query row): dQ = sum of the partials, in the input dtype.
  parallel_for(batch_rows, slices * dq_row_size * 2, [&](int64_t begin, int64_t end) {
    for (int64_t br = begin; br < end; ++br) {
      const int64_t b = br / p.seqlen_q, row = br % p.seqlen_q;
      T* d_q = static_cast<T*>(p.d_q) + b * p.q_batch_stride + row * p.q_row_stride;
      for (int h = 0; h < p.num_heads; ++h) {
        for (int d = 0; d < p.head_dim; ++d) {
          float sum = 0.f;
          for (int slice = 0; slice < slices; ++slice) {
            sum += scratch.d_q_partial[(slice * batch_rows + br) * dq_row_size + int64_t{h} * p.head_dim + d];
          }
          d_q[int64_t{h} * p.q_head_stride + d] = static_cast<T>(sum);
        }
      }
    }
  });
}

}  // namespace

void flash_fwd_cpu(const FlashFwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kFloat32: return Forward<float>(params, parallel_for);
    case DType::kFloat16: return Forward<Eigen::half>(params, parallel_for);
    case DType::kBFloat16: return Forward<Eigen::bfloat16>(params, parallel_for);
    case DType::kFloat8E4M3: return;  // the Hopper forward's only; the CPU op refuses it before
  }
}

void segment_bounds_cpu(const int32_t* ids, int batch, int64_t seqlen, int32_t* bounds) {
  int32_t* unsorted = bounds + 2 * int64_t{batch} * segment_blocks(seqlen);
  for (int b = 0; b < batch; ++b) {
    const int32_t* row = ids + b * seqlen;
    for (int64_t begin = 0; begin < seqlen; begin += kSegmentBlock) {
      const auto [lo, hi] = std::minmax_element(row + begin, row + std::min<int64_t>(begin + kSegmentBlock, seqlen));
      *bounds++ = *lo;
      *bounds++ = *hi;
    }
    unsorted[b] = std::is_sorted(row, row + seqlen) ? 0 : 1;
  }
}

int64_t flash_bwd_cpu_scratch_bytes(const FlashBwdParams& params, int num_threads) {
  const int64_t d_q_size = int64_t{NumKeySlices(params, num_threads)} * params.batch * params.seqlen_q *
                           params.num_heads * params.head_dim;
  const int64_t delta_size = int64_t{params.batch} * params.num_heads * params.seqlen_q;
  return (d_q_size + 3 * delta_size) * static_cast<int64_t>(sizeof(float));
}

void flash_bwd_cpu(const FlashBwdParams& params, DType dtype, int num_threads, const ParallelFor& parallel_for) {
  switch (dtype) {
    case DType::kFloat32: return Backward<float>(params, num_threads, parallel_for);
    case DType::kFloat16: return Backward<Eigen::half>(params, num_threads, parallel_for);
    case DType::kBFloat16: return Backward<Eigen::bfloat16>(params, num_threads, parallel_for);
    case DType::kFloat8E4M3: return;  // forward only
  }
}

}  // namespace tf_flash
