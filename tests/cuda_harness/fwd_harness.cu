// Standalone harness for the CUDA forward kernel (no TensorFlow): fills FlashFwdParams from random
// data, runs flash_fwd_cuda and compares with a float64 CPU reference that applies the shared
// semantics of cc/kernels/flash/mask.h and philox.h. Outputs and lse are poisoned with NaN first, so an
// element the kernel does not write fails the check.
//
//   fwd_harness test [quick]   correctness cases (exit status 1 on any failure; FWD_HARNESS_CASES=a,b: only
//                              the cases whose name contains a or b)
//   fwd_harness bigoffset      batch stride > 2^31 elements (64-bit offsets)
//   fwd_harness fp32           float32 path: flash_cuda_stage_rows to bf16, kernel, back to float32
//   fwd_harness bench [d...]   benchmarks.md grid, CUDA-event timing, median of 30 calls
//   fwd_harness tiles          tile-shape variants of fwd_variants.cu (bf16, 2k and 8k)
//   fwd_harness feat           dropout / masks / block-sparse / window cost (bf16, d128)
//   fwd_harness one d c s      five calls of one shape, for a profiler
//   fwd_harness one d c s dtype seconds   that shape in bf16 or fp16 back to back for so long: rate and time window
//
// Pass criterion (style.md): max |kernel - ref| <= 2 * max |std - ref| + 1e-3, where std is standard
// attention computed in the input dtype (scores and probabilities rounded to it, fp32 accumulation);
// lse within 2e-3 (absolute, or both -inf); no NaN anywhere.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"

using tf_flash::DType;
using tf_flash::FlashFwdParams;

#define CHECK_CUDA(x)                                                                                  \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));          \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace {

uint16_t to_bits(float x, DType dt) {
  if (dt == DType::kFloat16) {
    __half h = __float2half_rn(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float from_bits(uint16_t b, DType dt) {
  if (dt == DType::kFloat16) {
    __half h;
    std::memcpy(&h, &b, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, &b, 2);
  return __bfloat162float(h);
}
float round_dt(float x, DType dt) { return from_bits(to_bits(x, dt), dt); }

struct Case {
  const char* name;
  DType dtype;
  int B, H, Hkv, Sq, Sk, D, Dv;
  bool causal = false;
  int wl = -1, wr = -1;
  bool qlen = false, kvlen = false;
  bool attn_mask = false;
  int block_q = 0, block_k = 0;  // block mask when > 0
  float dropout = 0.f;
  float scale = -1.f;  // < 0: 1/sqrt(D)
  bool nan_pad = false;  // NaN in q past q_len and in k, v past kv_len (never visible)
  float softcap = 0.f;
  float amplitude = 1.f;  // > 1: q and k times this (clipped to +-6e4): logits ~ amplitude^2 sqrt(D) scale
  bool key_mask = false;  // with attn_mask: a key mask [B, 1, 1, Sk] (row stride 0), some keys hidden from all
  // With attn_mask: > 0 a document mask (query i sees key j of the same document: i / doc == j * Sq / Sk / doc),
  // whose tiles are hidden, shown or masked in part; mask_heads: one mask per head ([B, H, ...]);
  // nan_hidden: every fifth key hidden from every valid query (rows past q_len still show it: their mask rows
  // must not count), NaN in its K and V rows (never visible).
  int doc = 0;
  bool mask_heads = false;
  bool nan_hidden = false;
};

struct Result {
  double err, err_std, lse_err;
  long nan_out, nan_lse;
  bool ok;
  float ms;
  const char* family;  // the kernel family that ran (flash_cuda_kernel_counts)
};

// Which family the last forward launch used.
const char* last_family(const tf_flash::CudaKernelCounts& before) {
  const tf_flash::CudaKernelCounts now = tf_flash::flash_cuda_kernel_counts();
  return now.forward_sm90 > before.forward_sm90 ? "sm90" : now.forward_sm80 > before.forward_sm80 ? "sm80" : "-";
}

// float64 reference and same-dtype standard attention for one case, on host copies.
void reference(const Case& c, const FlashFwdParams& p, const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
               const std::vector<uint16_t>& v, std::vector<double>& out, std::vector<double>& lse,
               std::vector<float>& out_std) {
  const DType dt = c.dtype;
  const uint32_t thr = tf_flash::dropout_threshold(p.dropout_rate);
  out.assign(size_t(c.B) * c.Sq * c.H * c.Dv, 0.0);
  out_std.assign(out.size(), 0.f);
  lse.assign(size_t(c.B) * c.H * c.Sq, -INFINITY);
  std::vector<double> s(c.Sk), pr(c.Sk);
  std::vector<float> s32(c.Sk);
  std::vector<char> vis(c.Sk);
  for (int b = 0; b < c.B; ++b) {
    const int64_t ql = tf_flash::valid_q_len(p, b), kl = tf_flash::valid_kv_len(p, b);
    for (int h = 0; h < c.H; ++h) {
      const int hk = h / (c.H / c.Hkv);
      for (int i = 0; i < c.Sq; ++i) {
        const tf_flash::KeyRange r = tf_flash::key_range(p, i, ql, kl);
        double mx = -INFINITY;
        float mx32 = -INFINITY;
        bool any = false;
        for (int j = 0; j < c.Sk; ++j) {
          bool ok = j >= r.begin && j < r.end;
          if (ok && p.attn_mask.data) ok = tf_flash::mask_at(p.attn_mask, b, h, i, j);
          if (ok && p.block_mask.data) ok = tf_flash::mask_at(p.block_mask, b, h, i / p.block_q, j / p.block_k);
          vis[j] = ok;
          if (!ok) continue;
          any = true;
          double acc = 0;
          float acc32 = 0;
          for (int d = 0; d < c.D; ++d) {
            const float a = from_bits(q[((size_t(b) * c.Sq + i) * c.H + h) * c.D + d], dt);
            const float bb = from_bits(k[((size_t(b) * c.Sk + j) * c.Hkv + hk) * c.D + d], dt);
            acc += double(a) * bb;
            acc32 += a * bb;
          }
          s[j] = acc * p.scale;
          s32[j] = round_dt(round_dt(acc32, dt) * p.scale, dt);  // standard attention rounds the scores
          if (p.softcap > 0.f) {
            s[j] = p.softcap * std::tanh(s[j] / p.softcap);
            s32[j] = round_dt(p.softcap * std::tanh(s32[j] / p.softcap), dt);
          }
          mx = std::max(mx, s[j]);
          mx32 = std::max(mx32, s32[j]);
        }
        if (!any) continue;  // row sees nothing: out 0, lse -inf
        double sum = 0;
        float sum32 = 0;
        for (int j = 0; j < c.Sk; ++j) {
          pr[j] = vis[j] ? std::exp(s[j] - mx) : 0.0;
          sum += pr[j];
          s32[j] = vis[j] ? std::exp(s32[j] - mx32) : 0.f;
          sum32 += s32[j];
        }
        lse[(size_t(b) * c.H + h) * c.Sq + i] = mx + std::log(sum);
        const double keep_scale = tf_flash::dropout_keep_scale(p.dropout_rate);
        for (int j = 0; j < c.Sk; ++j) {
          if (!vis[j]) continue;
          double w = pr[j] / sum;
          float w32 = round_dt(s32[j] / sum32, dt);
          if (p.dropout_rate > 0.f) {
            const bool keep = tf_flash::dropout_keep(tf_flash::dropout_seed(p), uint64_t(b) * c.H + h, i, j, thr);
            w = keep ? w * keep_scale : 0.0;
            w32 = keep ? round_dt(w32 * float(keep_scale), dt) : 0.f;
          }
          for (int d = 0; d < c.Dv; ++d) {
            const float vv = from_bits(v[((size_t(b) * c.Sk + j) * c.Hkv + hk) * c.Dv + d], dt);
            out[((size_t(b) * c.Sq + i) * c.H + h) * c.Dv + d] += w * vv;
            out_std[((size_t(b) * c.Sq + i) * c.H + h) * c.Dv + d] += w32 * vv;
          }
        }
      }
    }
  }
  for (auto& x : out_std) x = round_dt(x, dt);
}

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

Result run_case(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const DType dt = c.dtype;
  std::vector<uint16_t> q(size_t(c.B) * c.Sq * c.H * c.D), k(size_t(c.B) * c.Sk * c.Hkv * c.D),
      v(size_t(c.B) * c.Sk * c.Hkv * c.Dv);
  auto scaled = [&] { return std::min(std::max(normal(rng) * c.amplitude, -6e4f), 6e4f); };
  for (auto& x : q) x = to_bits(scaled(), dt);
  for (auto& x : k) x = to_bits(scaled(), dt);
  for (auto& x : v) x = to_bits(normal(rng), dt);

  FlashFwdParams p;
  p.batch = c.B;
  p.seqlen_q = c.Sq;
  p.seqlen_k = c.Sk;
  p.num_heads = c.H;
  p.num_heads_kv = c.Hkv;
  p.head_dim = c.D;
  p.head_dim_v = c.Dv;
  p.q_row_stride = int64_t(c.H) * c.D, p.q_head_stride = c.D, p.q_batch_stride = int64_t(c.Sq) * c.H * c.D;
  p.k_row_stride = int64_t(c.Hkv) * c.D, p.k_head_stride = c.D, p.k_batch_stride = int64_t(c.Sk) * c.Hkv * c.D;
  p.v_row_stride = int64_t(c.Hkv) * c.Dv, p.v_head_stride = c.Dv, p.v_batch_stride = int64_t(c.Sk) * c.Hkv * c.Dv;
  p.o_row_stride = int64_t(c.H) * c.Dv, p.o_head_stride = c.Dv, p.o_batch_stride = int64_t(c.Sq) * c.H * c.Dv;
  p.scale = c.scale >= 0.f ? c.scale : 1.f / std::sqrt(float(c.D));
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.wr;
  std::vector<int32_t> qlens(c.B), kvlens(c.B);
  for (int b = 0; b < c.B; ++b) {
    qlens[b] = b == 0 ? c.Sq : int(rng() % (c.Sq + 1));
    kvlens[b] = b == 1 ? 0 : int(rng() % (c.Sk + 1));
  }
  p.q_lengths = c.qlen ? qlens.data() : nullptr;
  p.kv_lengths = c.kvlen ? kvlens.data() : nullptr;
  std::vector<uint8_t> am, bm;
  if (c.attn_mask) {  // [B, 1, Sq, Sk] (or [B, 1, 1, Sk]; [B, H, ...] with mask_heads); ~70% visible
    const int rows = c.key_mask ? 1 : c.Sq, heads = c.mask_heads ? c.H : 1;
    am.resize(size_t(c.B) * heads * rows * c.Sk);
    for (size_t e = 0; e < am.size(); ++e) {
      const int64_t j = int64_t(e % c.Sk), i = int64_t(e / c.Sk) % rows, bb = int64_t(e / c.Sk / rows / heads);
      am[e] = c.doc > 0 ? i / c.doc == j * c.Sq / c.Sk / c.doc : (rng() % 10) < 7;
      if (c.nan_hidden && j % 5 == 3 && (c.key_mask || !c.qlen || i < qlens[bb])) am[e] = 0;
    }
    p.attn_mask.data = reinterpret_cast<const bool*>(am.data());
    p.attn_mask.head_stride = c.mask_heads ? int64_t(rows) * c.Sk : 0;
    p.attn_mask.batch_stride = int64_t(heads) * rows * c.Sk;
    p.attn_mask.row_stride = c.key_mask ? 0 : c.Sk, p.attn_mask.col_stride = 1;
  }
  if (c.block_q > 0) {  // [B, H, nq, nk]; ~50% of blocks visible
    p.block_q = c.block_q, p.block_k = c.block_k;
    p.num_q_blocks = (c.Sq + c.block_q - 1) / c.block_q, p.num_k_blocks = (c.Sk + c.block_k - 1) / c.block_k;
    bm.resize(size_t(c.B) * c.H * p.num_q_blocks * p.num_k_blocks);
    for (auto& x : bm) x = rng() % 2;
    p.block_mask.data = reinterpret_cast<const bool*>(bm.data());
    p.block_mask.col_stride = 1, p.block_mask.row_stride = p.num_k_blocks;
    p.block_mask.head_stride = int64_t(p.num_q_blocks) * p.num_k_blocks;
    p.block_mask.batch_stride = p.block_mask.head_stride * c.H;
  }
  p.dropout_rate = c.dropout;
  p.softcap = c.softcap;
  p.seed = 0x123456789abcdefull ^ rng();
  p.seed_offset = rng();

  std::vector<double> ref, ref_lse;
  std::vector<float> ref_std;
  reference(c, p, q, k, v, ref, ref_lse, ref_std);

  if (c.nan_pad) {  // after the reference: the kernels must never let these reach an output
    const uint16_t nan_bits = dt == DType::kFloat16 ? 0x7E00 : 0x7FC0;
    auto poison = [&](std::vector<uint16_t>& t, int seq, int heads, int dim, const std::vector<int32_t>& len) {
      for (int bb = 0; bb < c.B; ++bb)
        for (int i = len[bb]; i < seq; ++i)
          for (size_t e = 0; e < size_t(heads) * dim; ++e) t[(size_t(bb) * seq + i) * heads * dim + e] = nan_bits;
    };
    if (c.qlen) poison(q, c.Sq, c.H, c.D, qlens);
    if (c.kvlen) {
      poison(k, c.Sk, c.Hkv, c.D, kvlens);
      poison(v, c.Sk, c.Hkv, c.Dv, kvlens);
    }
  }
  if (c.nan_hidden) {  // keys no query sees (attn_mask above): NaN in every kv head's K and V rows
    const uint16_t nan_bits = dt == DType::kFloat16 ? 0x7E00 : 0x7FC0;
    for (int bb = 0; bb < c.B; ++bb)
      for (int j = 3; j < c.Sk; j += 5)
        for (int hk = 0; hk < c.Hkv; ++hk) {
          for (int d = 0; d < c.D; ++d) k[((size_t(bb) * c.Sk + j) * c.Hkv + hk) * c.D + d] = nan_bits;
          for (int d = 0; d < c.Dv; ++d) v[((size_t(bb) * c.Sk + j) * c.Hkv + hk) * c.Dv + d] = nan_bits;
        }
  }

  // Device copies (pointers swapped into a second params struct).
  FlashFwdParams dp = p;
  uint16_t *dq = to_device(q), *dk = to_device(k), *dv = to_device(v);
  uint16_t* dout;
  float* dlse;
  CHECK_CUDA(cudaMalloc(&dout, ref.size() * 2 + 16));
  CHECK_CUDA(cudaMalloc(&dlse, ref_lse.size() * 4 + 16));
  CHECK_CUDA(cudaMemset(dout, 0xFF, ref.size() * 2));  // NaN in fp16 and bf16
  CHECK_CUDA(cudaMemset(dlse, 0xFF, ref_lse.size() * 4));
  int32_t *dql = to_device(qlens), *dkl = to_device(kvlens);
  uint8_t *dam = c.attn_mask ? to_device(am) : nullptr, *dbm = c.block_q > 0 ? to_device(bm) : nullptr;
  dp.q = dq, dp.k = dk, dp.v = dv, dp.out = dout, dp.lse = dlse;
  dp.q_lengths = c.qlen ? dql : nullptr;
  dp.kv_lengths = c.kvlen ? dkl : nullptr;
  dp.attn_mask.data = reinterpret_cast<const bool*>(dam);
  dp.block_mask.data = reinterpret_cast<const bool*>(dbm);
  // The forward's workspace (the Hopper family's packed attn_mask), poisoned: every byte read must be written.
  const int64_t workspace = tf_flash::flash_fwd_cuda_workspace_bytes(dp, dt);
  if (workspace > 0) {
    CHECK_CUDA(cudaMalloc(&dp.mask_workspace, workspace));
    CHECK_CUDA(cudaMemset(dp.mask_workspace, 0xFF, workspace));
  }

  Result res{};
  const std::string why = tf_flash::cuda::check_supported(dp, dt, tf_flash::Direction::kForward);
  if (!why.empty()) {
    std::printf("  unsupported: %s\n", why.c_str());
    res.ok = false;
    return res;
  }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const tf_flash::CudaKernelCounts counts = tf_flash::flash_cuda_kernel_counts();
  CHECK_CUDA(cudaEventRecord(e0));
  const int err = tf_flash::flash_fwd_cuda(dp, dt, nullptr);
  CHECK_CUDA(cudaEventRecord(e1));
  res.family = last_family(counts);
  if (err != 0) {
    std::printf("  launch error %d: %s\n", err, tf_flash::flash_cuda_error_string(err));
    std::exit(2);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaEventElapsedTime(&res.ms, e0, e1));
  std::vector<uint16_t> out(ref.size());
  std::vector<float> lse(ref_lse.size());
  CHECK_CUDA(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < out.size(); ++i) {
    const float x = from_bits(out[i], dt);
    if (std::isnan(x)) {
      ++res.nan_out;
      continue;
    }
    res.err = std::max(res.err, std::fabs(x - ref[i]));
    res.err_std = std::max(res.err_std, std::fabs(ref_std[i] - ref[i]));
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isnan(lse[i])) {
      ++res.nan_lse;
      continue;
    }
    if (std::isinf(ref_lse[i]) || std::isinf(lse[i])) {
      if (lse[i] != ref_lse[i]) res.lse_err = INFINITY;
    } else {
      res.lse_err = std::max(res.lse_err, std::fabs(lse[i] - ref_lse[i]));
    }
  }
  res.ok = res.nan_out == 0 && res.nan_lse == 0 && res.err <= 2 * res.err_std + 1e-3 && res.lse_err <= 2e-3;
  if (c.amplitude > 1.f) {
    // Logits ~1e9: float32 scores themselves are rounded to ~100, so near-ties may resolve unlike float64.
    // What must hold: every row a convex combination of V (finite, |o| <= max |v|; with dropout the kept weights
    // are scaled by 1 / (1 - p), so |o| <= max |v| / (1 - p)) and lse to float32's relative precision of such
    // scores.
    float v_max = 0.f, o_max = 0.f;
    for (uint16_t x : v) v_max = std::max(v_max, std::fabs(from_bits(x, dt)));
    for (uint16_t x : out) o_max = std::max(o_max, std::fabs(from_bits(x, dt)));  // NaN/Inf fail below
    double lse_scale = 1.0;
    for (double x : ref_lse) lse_scale = std::isfinite(x) ? std::max(lse_scale, std::fabs(x)) : lse_scale;
    res.ok = res.nan_out == 0 && res.nan_lse == 0 && o_max <= v_max * 1.01f / (1.f - c.dropout) &&
             res.lse_err <= 1e-5 * lse_scale;
  }
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dout), cudaFree(dlse), cudaFree(dql), cudaFree(dkl);
  if (dam) cudaFree(dam);
  if (dbm) cudaFree(dbm);
  if (dp.mask_workspace) cudaFree(dp.mask_workspace);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return res;
}

std::vector<Case> make_cases(bool quick) {
  std::vector<Case> cs;
  const DType dts[] = {DType::kBFloat16, DType::kFloat16};
  for (DType dt : dts) {
    for (int d : {32, 64, 96, 128, 256}) {
      cs.push_back({"plain", dt, 2, 3, 3, 200, 333, d, d});
      cs.push_back({"causal", dt, 2, 2, 2, 257, 190, d, d, true});
      if (quick && d != 64 && d != 128) continue;
      cs.push_back({"causal-long", dt, 1, 2, 1, 513, 513, d, d, true});
      cs.push_back({"window", dt, 2, 2, 2, 300, 300, d, d, false, 70, 20});
      cs.push_back({"window-causal", dt, 1, 2, 2, 300, 280, d, d, true, 150});
      cs.push_back({"lengths", dt, 3, 2, 2, 130, 257, d, d, false, -1, -1, true, true});
      cs.push_back({"causal-lengths", dt, 3, 2, 1, 200, 200, d, d, true, -1, -1, true, true});
      Case nan_padded{"lengths-nanpad", dt, 3, 2, 2, 300, 333, d, d, false, -1, -1, true, true};
      nan_padded.nan_pad = true;
      cs.push_back(nan_padded);
      nan_padded.name = "causal-nanpad", nan_padded.causal = true;
      cs.push_back(nan_padded);
      cs.push_back({"gqa", dt, 2, 8, 2, 129, 129, d, d});
      cs.push_back({"tiny", dt, 1, 1, 1, 1, 1, d, d});
      cs.push_back({"seqk1", dt, 1, 2, 2, 70, 1, d, d, true});
      cs.push_back({"scale2", dt, 1, 2, 2, 100, 150, d, d, false, -1, -1, false, false, false, 0, 0, 0.f, 0.5f});
      cs.push_back({"attn-mask", dt, 2, 2, 2, 150, 211, d, d, true, -1, -1, false, true, true});
      // attn_mask on the Hopper family (packed_mask.h): document masks (tiles hidden, shown or masked in
      // part) with lengths, NaN padding and causal; per-head masks with GQA, dropout and soft-capping; keys
      // hidden from every query with NaN in their K and V (the exact zeroing of value rows); with a block mask.
      Case docs{"doc-mask-pad", dt, 3, 4, 2, 450, 333, d, d, false, -1, -1, true, true, true};
      docs.doc = 100, docs.nan_pad = true;
      cs.push_back(docs);
      docs.name = "doc-mask-causal", docs.causal = true, docs.Sk = 700, docs.doc = 150;
      cs.push_back(docs);
      Case heads{"mask-heads-drop", dt, 2, 4, 2, 300, 333, d, d, true, -1, -1, true, true, true};
      heads.mask_heads = true, heads.dropout = 0.15f, heads.softcap = 2.f;
      cs.push_back(heads);
      Case hidden{"mask-nan-hidden", dt, 2, 4, 2, 300, 333, d, d, false, -1, -1, false, true, true};
      hidden.nan_hidden = true;
      cs.push_back(hidden);
      hidden.name = "doc-nan-hidden", hidden.doc = 64, hidden.causal = true, hidden.qlen = true;
      cs.push_back(hidden);
      hidden.name = "key-nan-hidden", hidden.doc = 0, hidden.causal = false, hidden.key_mask = true;
      cs.push_back(hidden);
      hidden.name = "mask-blocks", hidden.key_mask = false, hidden.nan_hidden = false, hidden.block_q = 128;
      hidden.block_k = 256, hidden.Sq = 450;
      cs.push_back(hidden);
      // Key masks (padding [B, 1, 1, Sk]): one staged row; NaN padding past the lengths; with dropout.
      Case keys{"key-mask-pad", dt, 3, 4, 2, 300, 333, d, d, false, -1, -1, true, true, true};
      keys.key_mask = true, keys.nan_pad = true;
      cs.push_back(keys);
      keys.name = "key-mask-causal", keys.causal = true, keys.dropout = 0.15f, keys.softcap = 2.f;
      cs.push_back(keys);
      // Keys a multiple of 4: the mask is copied in words (cp.async), zero-filled past the lengths.
      Case words{"mask-words-pad", dt, 3, 2, 2, 300, 332, d, d, false, -1, -1, true, true, true};
      words.nan_pad = true;
      cs.push_back(words);
      words.name = "mask-words-blk", words.causal = true, words.block_q = 64, words.block_k = 48;
      words.dropout = 0.1f;
      cs.push_back(words);
      cs.push_back({"block-aligned", dt, 2, 2, 2, 256, 384, d, d, false, -1, -1, false, false, false, 128, 128});
      cs.push_back({"block-small", dt, 2, 2, 2, 200, 300, d, d, true, -1, -1, false, false, false, 32, 48});
      cs.push_back({"dropout", dt, 2, 2, 2, 150, 170, d, d, false, -1, -1, false, false, false, 0, 0, 0.2f});
      cs.push_back({"dropout-all", dt, 2, 2, 1, 190, 170, d, d, true, 50, -1, true, true, true, 64, 32, 0.3f});
      // Dropout and soft-capping without element or block masks (the Hopper family takes these).
      Case general{"dropout-causal", dt, 3, 4, 2, 300, 333, d, d, true, -1, -1, true, true};
      general.dropout = 0.15f;
      cs.push_back(general);
      general.name = "softcap", general.causal = false, general.dropout = 0.f, general.softcap = 2.f;
      cs.push_back(general);
      general.name = "softcap-drop-pad", general.causal = true, general.dropout = 0.25f, general.nan_pad = true;
      cs.push_back(general);
      // Non-causal dropout over several query tiles of every Hopper tile height (128 and 192 rows).
      general.name = "drop-tiles-pad", general.causal = false, general.softcap = 0.f, general.Sq = 450;
      cs.push_back(general);
      // Block masks of whole Hopper tiles (128 query rows; 128 keys, 64 at d256): tiles skipped whole, with
      // causal, lengths, NaN padding, GQA, dropout and soft-capping; blocks of 64 query rows run in sm_80.
      Case blocks{"block-causal-pad", dt, 3, 4, 2, 450, 333, d, d, true, -1, -1, true, true};
      blocks.block_q = 128, blocks.block_k = 256, blocks.nan_pad = true;
      cs.push_back(blocks);
      blocks.name = "block-drop-cap", blocks.causal = false, blocks.block_q = 256, blocks.block_k = 128;
      blocks.dropout = 0.2f, blocks.softcap = 3.f;
      cs.push_back(blocks);
      blocks.name = "block-q64", blocks.block_q = 64, blocks.dropout = 0.f, blocks.softcap = 0.f;
      cs.push_back(blocks);
      // More query tiles than an H100 has SMs (132), GQA and lengths (batch 1 sees no key, so its tiles have no
      // work): causal over 4k+ keys, a CTA per tile (full causal in bf16 at d64, three consumers, and d128, the
      // float64 reference's time in mind; a window of 200 keys keeps d256's cheap); and persistent CTAs (the
      // static schedule) whose first tiles have no work (the last query tiles go first), then tiles with work: at
      // d256, O's epilogue goes through Q's buffer, so the first Q waits for it.
      if (!quick && dt == DType::kBFloat16 && (d == 64 || d == 128))
        cs.push_back({"causal-4k-waves", dt, 2, 4, 2, 4200, 4200, d, d, true, -1, -1, true, true});
      if (!quick && dt == DType::kBFloat16 && d == 256)
        cs.push_back({"window-4k-waves", dt, 2, 4, 2, 4200, 4200, d, d, true, 200, -1, true, true});
      if (!quick && dt == DType::kBFloat16)
        cs.push_back({"lengths-waves", dt, 2, 4, 2, 4200, 333, d, d, false, -1, -1, true, true});
      if (quick || (d != 64 && d != 128)) continue;
      // Causal attention over 4k+ keys, where a kernel configuration may be chosen by length.
      cs.push_back({"causal-4k", dt, 1, 1, 1, 4100, 4100, d, d, true});
    }
    // Logits ~1e9 (issue #16): an exponent s * c - round(max * c) would overflow P by the rounding. Every Hopper
    // head dim: their plain variant takes that FMA unless its warp vote sees such a max.
    for (int d : {32, 64, 128, 256}) {
      Case huge{"huge-logits", dt, 2, 2, 2, 200, 333, d, d};
      huge.amplitude = 1.5e4f;
      cs.push_back(huge);
      huge.name = "huge-causal", huge.causal = true;
      cs.push_back(huge);
      // Dropout's general variant always subtracts the max; the attn_mask variant (on the 128-row tiles) votes.
      huge.name = "huge-dropout", huge.dropout = 0.2f;
      cs.push_back(huge);
      huge.name = "huge-doc-mask", huge.dropout = 0.f, huge.attn_mask = true, huge.doc = 64;
      cs.push_back(huge);
    }
    cs.push_back({"dv<d", dt, 2, 2, 2, 150, 170, 128, 64});
    cs.push_back({"dv>d", dt, 2, 2, 2, 150, 170, 32, 96, true});
    cs.push_back({"d=80", dt, 2, 2, 2, 150, 170, 80, 80, true});
    cs.push_back({"d=40,dv=24", dt, 2, 2, 2, 77, 99, 40, 24});
  }
  return cs;
}

int run_tests(bool quick) {
  std::mt19937 rng(1234);
  int fails = 0, n = 0;
  std::printf("%-14s %-5s %4s %4s %5s %5s  %10s %10s %9s %-6s %s\n", "case", "dtype", "D", "Dv", "Sq", "Sk",
              "max_err", "std_err", "lse_err", "kernel", "result");
  // FWD_HARNESS_CASES=a,b: only the cases whose name contains a or b (a sanitizer's run of one feature).
  const char* only = std::getenv("FWD_HARNESS_CASES");
  auto selected = [&](const char* name) {
    if (only == nullptr) return true;
    std::string list = only;
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      if (comma > at && std::strstr(name, list.substr(at, comma - at).c_str()) != nullptr) return true;
      at = comma + 1;
    }
    return false;
  };
  for (const Case& c : make_cases(quick)) {
    if (!selected(c.name)) continue;
    const Result r = run_case(c, rng);
    ++n;
    if (!r.ok) ++fails;
    std::printf("%-14s %-5s %4d %4d %5d %5d  %10.3g %10.3g %9.3g %-6s %s%s\n", c.name,
                c.dtype == DType::kFloat16 ? "fp16" : "bf16", c.D, c.Dv, c.Sq, c.Sk, r.err, r.err_std, r.lse_err,
                r.family ? r.family : "-", r.ok ? "ok" : "FAIL", (r.nan_out || r.nan_lse) ? " (NaN/unwritten)" : "");
  }
  std::printf("%d/%d cases passed\n", n - fails, n);
  return fails ? 1 : 0;
}

// Batch stride beyond 2^31 elements: q, k and v share one buffer; only batch 1 is checked.
int run_bigoffset() {
  const int B = 2, S = 192, H = 2, D = 64;
  const int64_t bstride = (int64_t(1) << 31) + 4096;  // elements
  const size_t elems = size_t(bstride) + size_t(S) * H * D;
  uint16_t *buf, *out;
  CHECK_CUDA(cudaMalloc(&buf, elems * 2));
  CHECK_CUDA(cudaMalloc(&out, elems * 2));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> h0(size_t(S) * H * D), h1(h0.size());
  for (auto& x : h0) x = to_bits(normal(rng), DType::kBFloat16);
  for (auto& x : h1) x = to_bits(normal(rng), DType::kBFloat16);
  CHECK_CUDA(cudaMemcpy(buf, h0.data(), h0.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(buf + bstride, h1.data(), h1.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(out + bstride, 0xFF, h1.size() * 2));
  float* lse;
  CHECK_CUDA(cudaMalloc(&lse, B * H * S * 4));
  FlashFwdParams p;
  p.q = p.k = p.v = buf;
  p.out = out;
  p.lse = lse;
  p.batch = B, p.seqlen_q = p.seqlen_k = S, p.num_heads = p.num_heads_kv = H, p.head_dim = p.head_dim_v = D;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = bstride;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = H * D;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = D;
  p.scale = 0.125f;
  p.causal = true;
  const int err = tf_flash::flash_fwd_cuda(p, DType::kBFloat16, nullptr);
  if (err) {
    std::printf("bigoffset launch error: %s\n", tf_flash::flash_cuda_error_string(err));
    return 1;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> o(h1.size());
  CHECK_CUDA(cudaMemcpy(o.data(), out + bstride, o.size() * 2, cudaMemcpyDeviceToHost));
  Case c{"bigoffset", DType::kBFloat16, 1, H, H, S, S, D, D, true};
  FlashFwdParams hp = p;
  hp.batch = 1;
  std::vector<double> ref, ref_lse;
  std::vector<float> ref_std;
  reference(c, hp, h1, h1, h1, ref, ref_lse, ref_std);
  double e = 0, es = 0;
  long nans = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const float x = from_bits(o[i], DType::kBFloat16);
    if (std::isnan(x)) ++nans;
    else e = std::max(e, std::fabs(x - ref[i]));
    es = std::max(es, std::fabs(ref_std[i] - ref[i]));
  }
  const bool ok = nans == 0 && e <= 2 * es + 1e-3;
  std::printf("bigoffset (batch stride %lld elements): max_err %.3g std_err %.3g nan %ld %s\n",
              (long long)bstride, e, es, nans, ok ? "ok" : "FAIL");
  cudaFree(buf), cudaFree(out), cudaFree(lse);
  return ok ? 0 : 1;
}

// float32 path of the ops: float32 q/k/v -> bfloat16 (flash_cuda_stage_rows, the OpKernels' staging
// copy), bfloat16 kernel, output back to float32; compared with float64 attention of the float32 inputs. Tolerance: relative L2 error
// <= 2e-2 and max error <= 2 * (bf16 standard attention's max error) + 1e-3.
int run_fp32_path() {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.f, 1.f);
  int fails = 0;
  for (int causal = 0; causal < 2; ++causal) {
    const int B = 2, S = 177, H = 2, D = 64;
    const size_t n = size_t(B) * S * H * D;
    std::vector<float> q(n), k(n), v(n);
    for (auto* t : {&q, &k, &v})
      for (auto& x : *t) x = normal(rng);
    float *dq, *dk, *dv, *dout32;
    uint16_t *bq, *bk, *bv, *bout;
    for (float** ptr : {&dq, &dk, &dv, &dout32}) CHECK_CUDA(cudaMalloc(ptr, n * 4));
    for (uint16_t** ptr : {&bq, &bk, &bv, &bout}) CHECK_CUDA(cudaMalloc(ptr, n * 2));
    CHECK_CUDA(cudaMemcpy(dq, q.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dk, k.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dv, v.data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout32, 0xFF, n * 4));
    CHECK_CUDA(cudaError_t(
        tf_flash::flash_cuda_stage_rows(dq, DType::kFloat32, D, bq, DType::kBFloat16, D, int64_t(n / D), nullptr, tf_flash::StageRole::kQuery, nullptr)));
    CHECK_CUDA(cudaError_t(
        tf_flash::flash_cuda_stage_rows(dk, DType::kFloat32, D, bk, DType::kBFloat16, D, int64_t(n / D), nullptr, tf_flash::StageRole::kQuery, nullptr)));
    CHECK_CUDA(cudaError_t(
        tf_flash::flash_cuda_stage_rows(dv, DType::kFloat32, D, bv, DType::kBFloat16, D, int64_t(n / D), nullptr, tf_flash::StageRole::kQuery, nullptr)));
    FlashFwdParams p;
    p.q = bq, p.k = bk, p.v = bv, p.out = bout;
    p.batch = B, p.seqlen_q = p.seqlen_k = S, p.num_heads = p.num_heads_kv = H, p.head_dim = p.head_dim_v = D;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(S) * H * D;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = H * D;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = D;
    p.scale = 0.125f;
    p.causal = causal;
    CHECK_CUDA(cudaError_t(tf_flash::flash_fwd_cuda(p, DType::kBFloat16, nullptr)));
    CHECK_CUDA(cudaError_t(
        tf_flash::flash_cuda_stage_rows(bout, DType::kBFloat16, D, dout32, DType::kFloat32, D, int64_t(n / D), nullptr, tf_flash::StageRole::kQuery, nullptr)));
    std::vector<float> out(n);
    CHECK_CUDA(cudaMemcpy(out.data(), dout32, n * 4, cudaMemcpyDeviceToHost));
    // float64 reference from the float32 inputs, and bf16 standard attention for the error budget.
    double num = 0, den = 0, emax = 0, estd = 0;
    long nans = 0;
    std::vector<double> sc(S);
    std::vector<float> s32(S);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < S; ++i) {
          const int end = causal ? i + 1 : S;
          double mx = -INFINITY;
          float mx32 = -INFINITY;
          for (int j = 0; j < end; ++j) {
            double a = 0;
            float a32 = 0;
            for (int d = 0; d < D; ++d) {
              const size_t qi = ((size_t(b) * S + i) * H + h) * D + d, ki = ((size_t(b) * S + j) * H + h) * D + d;
              a += double(q[qi]) * k[ki];
              a32 += round_dt(q[qi], DType::kBFloat16) * round_dt(k[ki], DType::kBFloat16);
            }
            sc[j] = a * p.scale;
            s32[j] = round_dt(round_dt(a32, DType::kBFloat16) * p.scale, DType::kBFloat16);
            mx = std::max(mx, sc[j]);
            mx32 = std::max(mx32, s32[j]);
          }
          double sum = 0;
          float sum32 = 0;
          for (int j = 0; j < end; ++j) sum += (sc[j] = std::exp(sc[j] - mx)), sum32 += (s32[j] = std::exp(s32[j] - mx32));
          for (int d = 0; d < D; ++d) {
            double o = 0;
            float o32 = 0;
            for (int j = 0; j < end; ++j) {
              const float vv = v[((size_t(b) * S + j) * H + h) * D + d];
              o += sc[j] / sum * vv;
              o32 += round_dt(s32[j] / sum32, DType::kBFloat16) * round_dt(vv, DType::kBFloat16);
            }
            const float got = out[((size_t(b) * S + i) * H + h) * D + d];
            if (std::isnan(got)) ++nans;
            num += (got - o) * (got - o), den += o * o;
            emax = std::max(emax, std::fabs(got - o));
            estd = std::max(estd, std::fabs(double(round_dt(o32, DType::kBFloat16)) - o));
          }
        }
    const double rel = std::sqrt(num / den);
    const bool ok = nans == 0 && rel <= 2e-2 && emax <= 2 * estd + 1e-3;
    std::printf("fp32 path (bf16 kernel) causal=%d: rel_l2 %.3g max_err %.3g bf16_std_max_err %.3g %s\n", causal, rel,
                emax, estd, ok ? "ok" : "FAIL");
    fails += !ok;
    for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)dout32, (void*)bq, (void*)bk, (void*)bv, (void*)bout})
      cudaFree(ptr);
  }
  return fails ? 1 : 0;
}

__global__ void fill_normalish(uint16_t* x, size_t n, uint32_t seed, bool fp16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    // Sum of 4 uniforms (Irwin-Hall), centered and scaled to unit variance: close enough to N(0,1).
    float acc = 0.f;
    for (int t = 0; t < 4; ++t) {
      uint32_t h = uint32_t(i) * 0x9E3779B1u ^ (seed + t * 0x85EBCA77u) ^ uint32_t(i >> 32) * 0xC2B2AE3Du;
      h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12, h *= 0x297A2D39u, h ^= h >> 15;
      acc += (h >> 8) * (1.f / 16777216.f);
    }
    const float v = (acc - 2.f) * 1.7320508f;
    if (fp16) {
      __half hv = __float2half_rn(v);
      x[i] = *reinterpret_cast<uint16_t*>(&hv);
    } else {
      __nv_bfloat16 bv = __float2bfloat16_rn(v);
      x[i] = *reinterpret_cast<uint16_t*>(&bv);
    }
  }
}

}  // namespace
// Defined by fwd_variants.cu; these weak stand-ins let the harness link without it (no variants).
__attribute__((weak)) const char* const* fwd_variant_names() {
  static const char* const none[] = {nullptr};
  return none;
}
__attribute__((weak)) int run_fwd_variant(const char*, const tf_flash::FlashFwdParams&) { return -1; }
namespace {

// The timing modes' tensors: q, k, v and o of `rows` rows of `hidden` 16-bit elements (heads packed in a row),
// filled with normal-ish data of the dtype, and lse; params() describes one shape over them.
struct GridTensors {
  uint16_t *q, *k, *v, *o;
  float* lse;
  size_t n;
  GridTensors(size_t rows, int hidden, size_t lse_floats, bool fp16) : n(rows * hidden) {
    CHECK_CUDA(cudaMalloc(&q, n * 2));
    CHECK_CUDA(cudaMalloc(&k, n * 2));
    CHECK_CUDA(cudaMalloc(&v, n * 2));
    CHECK_CUDA(cudaMalloc(&o, n * 2));
    CHECK_CUDA(cudaMalloc(&lse, lse_floats * 4));
    fill(fp16);
  }
  GridTensors(const GridTensors&) = delete;
  GridTensors& operator=(const GridTensors&) = delete;
  ~GridTensors() { cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse); }
  void fill(bool fp16) const {
    fill_normalish<<<1024, 256>>>(q, n, 1, fp16);
    fill_normalish<<<1024, 256>>>(k, n, 2, fp16);
    fill_normalish<<<1024, 256>>>(v, n, 3, fp16);
    CHECK_CUDA(cudaGetLastError());
  }
  // b sequences of s tokens, h heads of d (rows of h d elements), scale 1/sqrt(d), not causal.
  FlashFwdParams params(int b, int s, int h, int d) const {
    const int hidden = h * d;
    FlashFwdParams p;
    p.q = q, p.k = k, p.v = v, p.out = o, p.lse = lse;
    p.batch = b, p.seqlen_q = p.seqlen_k = s, p.num_heads = p.num_heads_kv = h;
    p.head_dim = p.head_dim_v = d;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(s) * hidden;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = hidden;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
    p.scale = 1.f / std::sqrt(float(d));
    return p;
  }
};

// Times one configuration: 3 warm-up calls, then the median of 30 event-timed calls (ms).
template <class Launch>
std::vector<float> time_calls(Launch launch) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int w = 0; w < 3; ++w) CHECK_CUDA(cudaError_t(launch()));
  std::vector<float> ms;
  for (int it = 0; it < 30; ++it) {
    CHECK_CUDA(cudaEventRecord(e0));
    const int err = launch();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaError_t(err));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return ms;
}

// `tiles`: each compiled tile variant (bf16) on the 8k and 2k shapes, causal and not.
int run_tiles() {
  const int tokens = 16384, hidden = 2048;
  const GridTensors t(tokens, hidden, size_t(tokens) * 256, false);
  std::printf("%-16s %6s %6s %9s %8s\n", "variant", "causal", "seqlen", "med_ms", "TFLOP/s");
  const char* const* kFwdVariants = fwd_variant_names();
  for (int i = 0; kFwdVariants[i]; ++i) {
    const int d = std::atoi(kFwdVariants[i] + 1);
    for (int causal = 0; causal < 2; ++causal) {
      for (int s : {2048, 8192}) {
        const int b = tokens / s, h = hidden / d;
        FlashFwdParams p = t.params(b, s, h, d);
        p.causal = causal;
        const std::vector<float> ms = time_calls([&] { return run_fwd_variant(kFwdVariants[i], p); });
        const double med = ms[ms.size() / 2];
        const double flops = 4.0 * b * double(s) * s * h * d / (causal ? 2 : 1);
        std::printf("%-16s %6d %6d %9.4f %8.1f\n", kFwdVariants[i], causal, s, med, flops / (med * 1e-3) / 1e12);
      }
    }
  }
  return 0;
}

// `one d c s`: five calls of one shape (bf16), for a profiler. `one d c s dtype seconds`: calls of that dtype back
// to back for that long (synchronizing every 20), then the rate and the wall-clock window in ms since the epoch,
// so that clocks and power sampled beside it (nvidia-smi) can be matched to each dtype's run.
int run_one(int d, bool causal, int s, DType dt, double seconds) {
  const int tokens = 16384, hidden = 2048;
  const bool fp16 = dt == DType::kFloat16;
  const GridTensors t(tokens, hidden, size_t(tokens) * 256, fp16);
  const int b = tokens / s, h = hidden / d;
  FlashFwdParams p = t.params(b, s, h, d);
  p.causal = causal;
  const int warm_up = seconds > 0 ? 3 : 5;
  for (int i = 0; i < warm_up; ++i) CHECK_CUDA(cudaError_t(tf_flash::flash_fwd_cuda(p, dt, nullptr)));
  CHECK_CUDA(cudaDeviceSynchronize());
  if (seconds > 0) {
    using Clock = std::chrono::steady_clock;
    const auto epoch_ms = [] {
      return int64_t(std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count());
    };
    const int64_t begin_ms = epoch_ms();
    const auto start = Clock::now();
    int64_t calls = 0;
    double elapsed = 0;
    while (elapsed < seconds) {
      for (int i = 0; i < 20; ++i) CHECK_CUDA(cudaError_t(tf_flash::flash_fwd_cuda(p, dt, nullptr)));
      CHECK_CUDA(cudaDeviceSynchronize());
      calls += 20;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    }
    const double flops = 4.0 * b * double(s) * s * h * d / (causal ? 2 : 1);
    std::printf("sustained %s d=%d causal=%d s=%d: %lld calls in %.2f s, %.1f TFLOP/s, window_ms %lld %lld\n",
                fp16 ? "fp16" : "bf16", d, int(causal), s, (long long)calls, elapsed, flops * calls / elapsed / 1e12,
                (long long)begin_ms, (long long)epoch_ms());
  }
  return 0;
}

// `feat`: cost of the general-variant features (bf16, d128, h16): dropout, element mask, block-sparse
// density scaling, sliding window; each next to the plain kernel on the same shape.
int run_feat() {
  const int d = 128, h = 16, hidden = h * d;
  const int smax = 16384;
  const GridTensors t(smax, hidden, size_t(smax) * h, false);
  uint8_t* mask;  // element mask [S, S] for s = 8k, broadcast over batch and heads: all true
  const int sm = 8192;
  CHECK_CUDA(cudaMalloc(&mask, size_t(sm) * sm));
  CHECK_CUDA(cudaMemset(mask, 1, size_t(sm) * sm));
  std::mt19937 rng(3);
  auto base = [&](int b, int s) { return t.params(b, s, h, d); };
  std::printf("%-34s %5s %6s %9s %8s\n", "feature (bf16 d128 h16)", "batch", "seqlen", "med_ms", "TFLOP/s*");
  auto report = [&](const char* name, FlashFwdParams p, double density) {
    const int64_t workspace = tf_flash::flash_fwd_cuda_workspace_bytes(p, DType::kBFloat16);
    if (workspace > 0) CHECK_CUDA(cudaMalloc(&p.mask_workspace, workspace));
    const std::vector<float> ms = time_calls([&] { return tf_flash::flash_fwd_cuda(p, DType::kBFloat16, nullptr); });
    if (p.mask_workspace) CHECK_CUDA(cudaFree(p.mask_workspace));
    const double med = ms[ms.size() / 2];
    const double flops = 4.0 * p.batch * double(p.seqlen_q) * p.seqlen_k * h * d * density;
    std::printf("%-34s %5d %6d %9.4f %8.1f\n", name, p.batch, p.seqlen_q, med, flops / (med * 1e-3) / 1e12);
  };
  for (int causal = 0; causal < 2; ++causal) {
    FlashFwdParams p = base(2, sm);
    p.causal = causal;
    const double dens = causal ? 0.5 : 1.0;
    report(causal ? "causal plain" : "plain", p, dens);
    p.dropout_rate = 0.1f;
    report(causal ? "causal dropout 0.1" : "dropout 0.1", p, dens);
    p.dropout_rate = 0.f;
    p.attn_mask.data = reinterpret_cast<const bool*>(mask);
    p.attn_mask.row_stride = sm, p.attn_mask.col_stride = 1;
    report(causal ? "causal attn_mask (all true)" : "attn_mask (all true)", p, dens);
    p.attn_mask.row_stride = 0;  // a key mask [1, 1, 1, S] (padding), all True
    report(causal ? "causal key mask (all true)" : "key mask (all true)", p, dens);
  }
  {  // Masks with content, [S, S] at 8k: every tile masked in part (90% True at random); documents of 1024
     // tokens (block-diagonal: 1/8 of the tiles shown, FLOPs counted on them); a key mask with 10% random
     // padding; the density counts the visible entries' tiles (the work done).
    std::vector<uint8_t> hm(size_t(sm) * sm);
    FlashFwdParams p = base(2, sm);
    p.attn_mask.data = reinterpret_cast<const bool*>(mask);
    p.attn_mask.row_stride = sm, p.attn_mask.col_stride = 1;
    for (auto& x : hm) x = rng() % 10 != 0;
    CHECK_CUDA(cudaMemcpy(mask, hm.data(), hm.size(), cudaMemcpyHostToDevice));
    report("attn_mask (90% random)", p, 1.0);
    {  // what the packing pass (packed_mask.h: bits, summaries, V's flags) takes of that call
      const tf_flash::cuda::PackedMaskLayout layout(p, tf_flash::cuda::MaskPacking::kForward);
      void* workspace = nullptr;
      CHECK_CUDA(cudaMalloc(&workspace, layout.bytes));
      const std::vector<float> ms = time_calls(
          [&] { return int(tf_flash::cuda::pack_attention_mask(p, layout, workspace, true, nullptr)); });
      std::printf("%-34s %5d %6d %9.4f %8s\n", "  its packing pass alone", p.batch, p.seqlen_q, ms[ms.size() / 2], "-");
      CHECK_CUDA(cudaFree(workspace));
    }
    for (size_t e = 0; e < hm.size(); ++e) hm[e] = e / sm / 1024 == e % sm / 1024;
    CHECK_CUDA(cudaMemcpy(mask, hm.data(), hm.size(), cudaMemcpyHostToDevice));
    report("attn_mask (documents of 1k)", p, 1.0 / 8);
    p.causal = true;
    report("causal attn_mask (documents of 1k)", p, 1.0 / 16);
    p.causal = false;
    for (size_t e = 0; e < size_t(sm); ++e) hm[e] = rng() % 10 != 0;
    CHECK_CUDA(cudaMemcpy(mask, hm.data(), sm, cudaMemcpyHostToDevice));
    p.attn_mask.row_stride = 0;
    report("key mask (90% random)", p, 1.0);
  }
  // Block-sparse at 16k: random 128x128 blocks at density 1/1 .. 1/16 (FLOPs counted on visible blocks).
  const int s = smax, nb = s / 128;
  uint8_t* bm;
  CHECK_CUDA(cudaMalloc(&bm, size_t(h) * nb * nb));
  for (int inv : {1, 2, 4, 8, 16}) {
    std::vector<uint8_t> hb(size_t(h) * nb * nb);
    size_t vis = 0;
    for (auto& x : hb) vis += (x = (rng() % inv) == 0);
    CHECK_CUDA(cudaMemcpy(bm, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    FlashFwdParams p = base(1, s);
    p.block_mask.data = reinterpret_cast<const bool*>(bm);
    p.block_q = p.block_k = 128, p.num_q_blocks = p.num_k_blocks = nb;
    p.block_mask.head_stride = int64_t(nb) * nb, p.block_mask.row_stride = nb, p.block_mask.col_stride = 1;
    char name[64];
    std::snprintf(name, sizeof name, "block-sparse density 1/%d", inv);
    report(name, p, double(vis) / hb.size());
  }
  {  // blocks of 64 x 64: tiles of 128 x 64 are covered in part and masked per element
    const int nb64 = s / 64;
    uint8_t* bm64;
    CHECK_CUDA(cudaMalloc(&bm64, size_t(h) * nb64 * nb64));
    std::vector<uint8_t> hb(size_t(h) * nb64 * nb64);
    size_t vis = 0;
    for (auto& x : hb) vis += (x = (rng() % 4) == 0);
    CHECK_CUDA(cudaMemcpy(bm64, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    FlashFwdParams p = base(1, s);
    p.block_mask.data = reinterpret_cast<const bool*>(bm64);
    p.block_q = p.block_k = 64, p.num_q_blocks = p.num_k_blocks = nb64;
    p.block_mask.head_stride = int64_t(nb64) * nb64, p.block_mask.row_stride = nb64, p.block_mask.col_stride = 1;
    report("block-sparse 64x64 density 1/4", p, double(vis) / hb.size());
    cudaFree(bm64);
  }
  {
    FlashFwdParams p = base(1, s);
    report("plain", p, 1.0);
    p.window_left = p.window_right = 512;
    report("window (512, 512)", p, 1025.0 / s);
  }
  cudaFree(mask), cudaFree(bm);
  return 0;
}

int run_bench(const std::vector<int>& dims) {
  const int tokens = 16384, hidden = 2048;
  const GridTensors t(tokens, hidden, size_t(tokens) * 256, false);
  const int seqlens[] = {512, 1024, 2048, 4096, 8192, 16384};
  std::printf("%-5s %4s %6s %5s %6s  %9s %9s %9s  %8s %s\n", "dtype", "d", "causal", "batch", "seqlen", "med_ms",
              "min_ms", "max_ms", "TFLOP/s", "kernel");
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const bool fp16 = dt == DType::kFloat16;
    t.fill(fp16);
    for (int d : dims) {
      for (int causal = 0; causal < 2; ++causal) {
        for (int s : seqlens) {
          const int b = tokens / s, h = hidden / d;
          FlashFwdParams p = t.params(b, s, h, d);
          p.causal = causal;
          const tf_flash::CudaKernelCounts counts = tf_flash::flash_cuda_kernel_counts();
          const std::vector<float> ms = time_calls([&] { return tf_flash::flash_fwd_cuda(p, dt, nullptr); });
          const char* family = last_family(counts);
          const double med = ms[ms.size() / 2];
          const double flops = 4.0 * b * double(s) * s * h * d / (causal ? 2 : 1);
          std::printf("%-5s %4d %6d %5d %6d  %9.4f %9.4f %9.4f  %8.1f %s\n", fp16 ? "fp16" : "bf16", d, causal, b, s,
                      med, ms.front(), ms.back(), flops / (med * 1e-3) / 1e12, family);
        }
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "test";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, cc %d.%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  if (mode == "test") return run_tests(argc > 2 && std::string(argv[2]) == "quick");
  if (mode == "bigoffset") return run_bigoffset();
  if (mode == "fp32") return run_fp32_path();
  if (mode == "tiles") return run_tiles();
  if (mode == "feat") return run_feat();
  if (mode == "one" && (argc == 5 || argc == 7)) {
    const DType dt = argc == 7 && std::string(argv[5]) == "fp16" ? DType::kFloat16 : DType::kBFloat16;
    return run_one(std::atoi(argv[2]), std::atoi(argv[3]) != 0, std::atoi(argv[4]), dt, argc == 7 ? std::atof(argv[6]) : 0);
  }
  if (mode == "bench") {
    std::vector<int> dims;
    for (int i = 2; i < argc; ++i) dims.push_back(std::atoi(argv[i]));
    if (dims.empty()) dims = {64, 128};
    return run_bench(dims);
  }
  std::fprintf(stderr, "usage: %s test [quick] | bigoffset | fp32 | bench [d ...] | tiles | feat | one d c s [dtype seconds]\n",
               argv[0]);
  return 2;
}
