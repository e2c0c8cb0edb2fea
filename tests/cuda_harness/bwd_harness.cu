// Standalone harness for the CUDA backward (cc/kernels/cuda/flash_bwd_*.cu), no TensorFlow.
//
//   bwd_harness test           correctness vs a float64 CPU reference (forward O/lse and backward computed
//                              on the host), NaN-poisoned outputs and scratch, odd lengths, every feature
//   bwd_harness bench [d ...]  timing on the benchmarks.md grid (hidden 2048), CUDA events, median of 20
//   bwd_harness bench1 dtype d b s h causal [dropout [iters [softcap]]]   one shape; with
//                              BWD_BENCH_BLOCK_DENSITY=x a random 128 x 128 block mask, BWD_BENCH_ATTN_MASK=1 an
//                              all-True attn_mask [S, S], =keys an all-True key mask [1, 1, 1, S], =random and
//                              =random_keys the same 90% True at random; BWD_BENCH_DETERMINISTIC=1 the
//                              deterministic dQ
//
// Build and run: tests/cuda_harness/run_bwd_harness.sh
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cutlass/numeric_types.h>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash/philox.h"

using namespace tf_flash;

#define CHECK_CUDA(x)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

struct Case {
  std::string name;
  DType dtype = DType::kBFloat16;
  int b = 1, sq = 128, sk = 128, h = 2, hkv = 2, d = 64;
  int dv = 0;  // 0: same as d
  bool causal = false;
  int wl = -1, wr = -1;
  bool q_lengths = false, kv_lengths = false;
  float scale = 0.f;  // 0: 1/sqrt(d)
  float dropout = 0.f;
  float softcap = 0.f;
  bool attn_mask = false;
  bool key_mask = false;  // with attn_mask: [B, 1, 1, Sk] (row stride 0) instead of [B, 1, Sq, Sk]
  int block_mask = 0;  // 0 none; else block size (block_q = block_k)
  bool d_lse = false;
  bool nan_pad = false;  // NaN in q, dO, out past q_len and in k, v past kv_len (never visible)
  // With attn_mask: > 0 a document mask (query i sees key j of the same document: i / doc == j * Sq / Sk / doc);
  // nan_hidden: every fifth key hidden from every valid query (rows past q_len still show it), NaN in its K and
  // V rows (never visible).
  int doc = 0;
  bool nan_hidden = false;
  // The deterministic dQ: run twice (outputs and scratch poisoned again), the gradients bit-identical.
  bool deterministic = false;
};

template <typename E>
static float round_to(float x) {
  return float(E(x));
}

static float round_dtype(DType t, float x) {
  return t == DType::kFloat16 ? round_to<cutlass::half_t>(x) : round_to<cutlass::bfloat16_t>(x);
}

static void to_device_bits(DType t, const std::vector<float>& src, std::vector<uint16_t>* dst) {
  dst->resize(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (t == DType::kFloat16) {
      cutlass::half_t v(src[i]);
      std::memcpy(&(*dst)[i], &v, 2);
    } else {
      cutlass::bfloat16_t v(src[i]);
      std::memcpy(&(*dst)[i], &v, 2);
    }
  }
}

static float from_bits(DType t, uint16_t bits) {
  if (t == DType::kFloat16) {
    cutlass::half_t v;
    std::memcpy(&v, &bits, 2);
    return float(v);
  }
  cutlass::bfloat16_t v;
  std::memcpy(&v, &bits, 2);
  return float(v);
}

struct Rel {
  double err = 0, ref = 0;
  long nan = 0;
  double value() const { return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err); }
};

static int run_case(const Case& c, uint64_t seed, bool verbose) {
  const int B = c.b, Sq = c.sq, Sk = c.sk, H = c.h, Hkv = c.hkv, D = c.d, G = H / Hkv;
  const int Dv = c.dv > 0 ? c.dv : c.d;
  const float scale = c.scale > 0 ? c.scale : 1.f / std::sqrt(float(D));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto randn = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = round_dtype(c.dtype, normal(rng));
    return v;
  };
  std::vector<float> q = randn(size_t(B) * Sq * H * D), k = randn(size_t(B) * Sk * Hkv * D),
                     v = randn(size_t(B) * Sk * Hkv * Dv), dout = randn(size_t(B) * Sq * H * Dv);
  std::vector<float> dlse;
  if (c.d_lse) {
    dlse.resize(size_t(B) * H * Sq);
    for (auto& x : dlse) x = 0.3f * normal(rng);
  }
  std::vector<int32_t> qlen(B, Sq), kvlen(B, Sk);
  std::uniform_int_distribution<int> uq(0, Sq), uk(0, Sk);
  if (c.q_lengths)
    for (int b = 0; b < B; ++b) qlen[b] = b == 0 ? Sq : uq(rng);
  if (c.kv_lengths)
    for (int b = 0; b < B; ++b) kvlen[b] = b == 0 ? Sk : uk(rng);
  std::vector<uint8_t> amask;
  if (c.attn_mask) {  // [B, 1, Sq, Sk] (or [B, 1, 1, Sk]), broadcast over heads
    amask.resize(size_t(B) * (c.key_mask ? 1 : Sq) * Sk);
    std::bernoulli_distribution bern(0.7);
    for (size_t e = 0; e < amask.size(); ++e) {
      const int64_t j = int64_t(e % Sk), i = c.key_mask ? 0 : int64_t(e / Sk) % Sq;
      const int64_t bb = int64_t(e / Sk / (c.key_mask ? 1 : Sq));
      amask[e] = c.doc > 0 ? i / c.doc == j * Sq / Sk / c.doc : bern(rng);
      if (c.nan_hidden && j % 5 == 3 && (c.key_mask || !c.q_lengths || i < qlen[bb])) amask[e] = 0;
    }
  }
  std::vector<uint8_t> bmask;
  int nqb = 0, nkb = 0;
  if (c.block_mask) {
    nqb = (Sq + c.block_mask - 1) / c.block_mask;
    nkb = (Sk + c.block_mask - 1) / c.block_mask;
    bmask.resize(size_t(B) * H * nqb * nkb);
    std::bernoulli_distribution bern(0.5);
    for (auto& x : bmask) x = bern(rng);
  }

  FlashBwdParams p;
  p.batch = B;
  p.seqlen_q = Sq;
  p.seqlen_k = Sk;
  p.num_heads = H;
  p.num_heads_kv = Hkv;
  p.head_dim = D;
  p.head_dim_v = Dv;
  p.scale = scale;
  p.q_row_stride = int64_t(H) * D, p.q_head_stride = D, p.q_batch_stride = int64_t(Sq) * H * D;
  p.k_row_stride = int64_t(Hkv) * D, p.k_head_stride = D, p.k_batch_stride = int64_t(Sk) * Hkv * D;
  p.v_row_stride = int64_t(Hkv) * Dv, p.v_head_stride = Dv, p.v_batch_stride = int64_t(Sk) * Hkv * Dv;
  p.o_row_stride = int64_t(H) * Dv, p.o_head_stride = Dv, p.o_batch_stride = int64_t(Sq) * H * Dv;
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.dropout_rate = c.dropout;
  p.softcap = c.softcap;
  p.seed = 0x1234567890abcdefull ^ seed;
  p.seed_offset = 77;
  p.deterministic = c.deterministic;
  // Host copies of the masks for the reference (same struct, host pointers).
  FlashBwdParams hp = p;
  hp.q_lengths = c.q_lengths ? qlen.data() : nullptr;
  hp.kv_lengths = c.kv_lengths ? kvlen.data() : nullptr;
  if (c.attn_mask) {
    hp.attn_mask.data = reinterpret_cast<const bool*>(amask.data());
    hp.attn_mask.batch_stride = int64_t(c.key_mask ? 1 : Sq) * Sk, hp.attn_mask.head_stride = 0;
    hp.attn_mask.row_stride = c.key_mask ? 0 : Sk, hp.attn_mask.col_stride = 1;
  }
  if (c.block_mask) {
    hp.block_mask.data = reinterpret_cast<const bool*>(bmask.data());
    hp.block_mask.batch_stride = int64_t(H) * nqb * nkb, hp.block_mask.head_stride = int64_t(nqb) * nkb;
    hp.block_mask.row_stride = nkb, hp.block_mask.col_stride = 1;
    hp.block_q = hp.block_k = c.block_mask;
    hp.num_q_blocks = nqb, hp.num_k_blocks = nkb;
  }
  const uint32_t thr = dropout_threshold(c.dropout);
  const double keep_scale = c.dropout > 0 ? dropout_keep_scale(c.dropout) : 1.0;

  // ---- float64 reference: forward (O, lse) then backward ----
  std::vector<double> O(size_t(B) * Sq * H * Dv, 0.0), LSE(size_t(B) * H * Sq, -INFINITY);
  std::vector<double> dQ(q.size(), 0.0), dK(k.size(), 0.0), dV(v.size(), 0.0);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int b = 0; b < B; ++b)
    for (int hk = 0; hk < Hkv; ++hk) {
      std::vector<double> s(Sk), pr(Sk), dp(Sk), dtanh(Sk, 1.0);
      std::vector<char> vis(Sk);
      const int64_t ql = valid_q_len(hp, b), kl = valid_kv_len(hp, b);
      for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        for (int i = 0; i < ql; ++i) {
          const KeyRange kr = key_range(hp, i, ql, kl);
          const float* qi = &q[((int64_t(b) * Sq + i) * H + h) * D];
          double mx = -INFINITY;
          for (int j = 0; j < Sk; ++j) {
            bool ok = j >= kr.begin && j < kr.end;
            if (ok && hp.attn_mask.data) ok = mask_at(hp.attn_mask, b, h, i, j);
            if (ok && hp.block_mask.data) ok = block_visible(hp, b, h, i / hp.block_q, j / hp.block_k);
            vis[j] = ok;
            if (!ok) continue;
            const float* kj = &k[((int64_t(b) * Sk + j) * Hkv + hk) * D];
            double acc = 0;
            for (int e = 0; e < D; ++e) acc += double(qi[e]) * kj[e];
            s[j] = acc * scale;
            if (c.softcap > 0) {  // capped = softcap tanh(scale q.k / softcap)
              const double t = std::tanh(s[j] / c.softcap);
              s[j] = c.softcap * t;
              dtanh[j] = 1.0 - t * t;
            }
            mx = std::max(mx, s[j]);
          }
          if (mx == -INFINITY) continue;  // nothing visible: O = 0, lse = -inf, no gradient
          double sum = 0;
          for (int j = 0; j < Sk; ++j)
            if (vis[j]) sum += std::exp(s[j] - mx);
          const double lse = mx + std::log(sum);
          LSE[(int64_t(b) * H + h) * Sq + i] = lse;
          double* oi = &O[((int64_t(b) * Sq + i) * H + h) * Dv];
          for (int j = 0; j < Sk; ++j) {
            pr[j] = vis[j] ? std::exp(s[j] - lse) : 0.0;
            if (!vis[j]) continue;
            double pd = pr[j];
            if (c.dropout > 0)
              pd = dropout_keep(tf_flash::dropout_seed(p), uint64_t(b) * H + h, i, j, thr) ? pd * keep_scale : 0.0;
            const float* vj = &v[((int64_t(b) * Sk + j) * Hkv + hk) * Dv];
            for (int e = 0; e < Dv; ++e) oi[e] += pd * vj[e];
          }
          // backward of this row
          const float* doi = &dout[((int64_t(b) * Sq + i) * H + h) * Dv];
          double Di = 0;
          for (int e = 0; e < Dv; ++e) Di += double(doi[e]) * oi[e];
          if (c.d_lse) Di -= dlse[(int64_t(b) * H + h) * Sq + i];
          double* dqi = &dQ[((int64_t(b) * Sq + i) * H + h) * D];
          for (int j = 0; j < Sk; ++j) {
            if (!vis[j]) continue;
            const float* vj = &v[((int64_t(b) * Sk + j) * Hkv + hk) * Dv];
            const float* kj = &k[((int64_t(b) * Sk + j) * Hkv + hk) * D];
            double dpd = 0;
            for (int e = 0; e < Dv; ++e) dpd += double(doi[e]) * vj[e];
            double pd = pr[j], dpv = dpd;
            if (c.dropout > 0) {
              const bool keep = dropout_keep(tf_flash::dropout_seed(p), uint64_t(b) * H + h, i, j, thr);
              pd = keep ? pd * keep_scale : 0.0;
              dpv = keep ? dpd * keep_scale : 0.0;
            }
            const double ds = pr[j] * (dpv - Di) * dtanh[j];
            double* dvj = &dV[((int64_t(b) * Sk + j) * Hkv + hk) * Dv];
            double* dkj = &dK[((int64_t(b) * Sk + j) * Hkv + hk) * D];
            for (int e = 0; e < Dv; ++e) dvj[e] += pd * doi[e];
            for (int e = 0; e < D; ++e) {
              dkj[e] += scale * ds * qi[e];
              dqi[e] += scale * ds * kj[e];
            }
          }
        }
      }
    }

  // ---- device ----
  std::vector<float> o_in(O.size()), lse_in(LSE.size());
  for (size_t i = 0; i < O.size(); ++i) o_in[i] = float(O[i]);
  for (size_t i = 0; i < LSE.size(); ++i) lse_in[i] = float(LSE[i]);
  std::vector<uint16_t> hq, hk, hv, ho, hdo;
  to_device_bits(c.dtype, q, &hq);
  to_device_bits(c.dtype, k, &hk);
  to_device_bits(c.dtype, v, &hv);
  to_device_bits(c.dtype, o_in, &ho);
  to_device_bits(c.dtype, dout, &hdo);
  if (c.nan_pad) {  // the reference used the finite values: the kernels must never read these
    const uint16_t nan_bits = c.dtype == DType::kFloat16 ? 0x7E00 : 0x7FC0;
    auto poison = [&](std::vector<uint16_t>& t, int seq, int heads, int dim, const std::vector<int32_t>& len) {
      for (int bb = 0; bb < B; ++bb)
        for (int i = len[bb]; i < seq; ++i)
          for (size_t e = 0; e < size_t(heads) * dim; ++e) t[(size_t(bb) * seq + i) * heads * dim + e] = nan_bits;
    };
    poison(hq, Sq, H, D, qlen);
    poison(hdo, Sq, H, Dv, qlen);
    poison(ho, Sq, H, Dv, qlen);
    poison(hk, Sk, Hkv, D, kvlen);
    poison(hv, Sk, Hkv, Dv, kvlen);
  }
  if (c.nan_hidden) {  // keys no query sees (attn_mask above): NaN in every kv head's K and V rows
    const uint16_t nan_bits = c.dtype == DType::kFloat16 ? 0x7E00 : 0x7FC0;
    for (int bb = 0; bb < B; ++bb)
      for (int j = 3; j < Sk; j += 5)
        for (int hk2 = 0; hk2 < Hkv; ++hk2) {
          for (int e = 0; e < D; ++e) hk[(size_t(bb) * Sk + j) * Hkv * D + size_t(hk2) * D + e] = nan_bits;
          for (int e = 0; e < Dv; ++e) hv[(size_t(bb) * Sk + j) * Hkv * Dv + size_t(hk2) * Dv + e] = nan_bits;
        }
  }
  auto upload = [](const void* src, size_t bytes) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
    if (bytes) CHECK_CUDA(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  p.q = upload(hq.data(), hq.size() * 2);
  p.k = upload(hk.data(), hk.size() * 2);
  p.v = upload(hv.data(), hv.size() * 2);
  p.out = upload(ho.data(), ho.size() * 2);
  p.d_out = upload(hdo.data(), hdo.size() * 2);
  p.lse = static_cast<float*>(upload(lse_in.data(), lse_in.size() * 4));
  if (c.d_lse) p.d_lse = static_cast<float*>(upload(dlse.data(), dlse.size() * 4));
  if (c.q_lengths) p.q_lengths = static_cast<int32_t*>(upload(qlen.data(), qlen.size() * 4));
  if (c.kv_lengths) p.kv_lengths = static_cast<int32_t*>(upload(kvlen.data(), kvlen.size() * 4));
  if (c.attn_mask) {
    p.attn_mask = hp.attn_mask;
    p.attn_mask.data = static_cast<const bool*>(upload(amask.data(), amask.size()));
  }
  if (c.block_mask) {
    p.block_mask = hp.block_mask;
    p.block_mask.data = static_cast<const bool*>(upload(bmask.data(), bmask.size()));
    p.block_q = p.block_k = c.block_mask;
    p.num_q_blocks = nqb, p.num_k_blocks = nkb;
  }
  CHECK_CUDA(cudaMalloc(&p.d_q, std::max<size_t>(q.size() * 2, 16)));
  CHECK_CUDA(cudaMalloc(&p.d_k, std::max<size_t>(k.size() * 2, 16)));
  CHECK_CUDA(cudaMalloc(&p.d_v, std::max<size_t>(v.size() * 2, 16)));
  const int64_t scratch = flash_bwd_cuda_scratch_bytes(p, c.dtype);
  CHECK_CUDA(cudaMalloc(&p.scratch, std::max<int64_t>(scratch, 16)));
  // NaN in the outputs and the scratch before each run. cudaMemset runs on the legacy default stream, which the
  // run's non-blocking stream does not wait for: the poison is finished first (unordered, it could land in the
  // middle of a run).
  auto poison = [&] {
    CHECK_CUDA(cudaMemset(p.d_q, 0xFF, q.size() * 2));
    CHECK_CUDA(cudaMemset(p.d_k, 0xFF, k.size() * 2));
    CHECK_CUDA(cudaMemset(p.d_v, 0xFF, v.size() * 2));
    CHECK_CUDA(cudaMemset(p.scratch, 0xFF, scratch));
    CHECK_CUDA(cudaDeviceSynchronize());
  };
  poison();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const tf_flash::CudaKernelCounts before = tf_flash::flash_cuda_kernel_counts();
  const int err = flash_bwd_cuda(p, c.dtype, stream);
  const tf_flash::CudaKernelCounts after = tf_flash::flash_cuda_kernel_counts();
  const char* family = after.backward_sm90 > before.backward_sm90   ? "sm90"
                       : after.backward_sm80 > before.backward_sm80 ? "sm80"
                                                                     : "-";
  if (err != 0) {
    std::printf("FAIL %-40s flash_bwd_cuda returned %d (%s)\n", c.name.c_str(), err,
                cudaGetErrorString(cudaError_t(err)));
    return 1;
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaGetLastError());
  auto download = [](const void* src, size_t n) {
    std::vector<uint16_t> host(n);
    CHECK_CUDA(cudaMemcpy(host.data(), src, n * 2, cudaMemcpyDeviceToHost));
    return host;
  };
  const std::vector<uint16_t> gq = download(p.d_q, q.size()), gk = download(p.d_k, k.size()),
                              gv = download(p.d_v, v.size());
  bool repeated = true;  // deterministic: a second run gives the same bits
  if (c.deterministic) {
    poison();
    if (flash_bwd_cuda(p, c.dtype, stream) != 0) repeated = false;
    CHECK_CUDA(cudaStreamSynchronize(stream));
    repeated = repeated && download(p.d_q, q.size()) == gq && download(p.d_k, k.size()) == gk &&
               download(p.d_v, v.size()) == gv;
  }

  auto compare = [&](const std::vector<uint16_t>& g, const std::vector<double>& ref) {
    Rel r;
    for (size_t i = 0; i < g.size(); ++i) {
      const double x = from_bits(c.dtype, g[i]);
      if (!std::isfinite(x)) {
        ++r.nan;
        continue;
      }
      r.err += (x - ref[i]) * (x - ref[i]);
      r.ref += ref[i] * ref[i];
    }
    return r;
  };
  const Rel eq = compare(gq, dQ), ek = compare(gk, dK), ev = compare(gv, dV);
  const double tol = c.dtype == DType::kFloat16 ? 4e-3 : 2e-2;
  const bool ok = eq.nan == 0 && ek.nan == 0 && ev.nan == 0 && eq.value() < tol && ek.value() < tol &&
                  ev.value() < tol && repeated;
  std::printf("%s %-44s %s d=%3d/%3d b=%d sq=%4d sk=%4d h=%d/%d  rel dq %.2e dk %.2e dv %.2e  nan %ld/%ld/%ld %s%s\n",
              ok ? "ok  " : "FAIL", c.name.c_str(), c.dtype == DType::kFloat16 ? "fp16" : "bf16", D, Dv, B, Sq, Sk, H,
              Hkv, eq.value(), ek.value(), ev.value(), eq.nan, ek.nan, ev.nan, family,
              c.deterministic ? (repeated ? " repeated" : " NOT REPEATED") : "");
  (void)verbose;
  cudaFree(const_cast<void*>(p.q));
  cudaFree(const_cast<void*>(p.k));
  cudaFree(const_cast<void*>(p.v));
  cudaFree(p.out);
  cudaFree(const_cast<void*>(p.d_out));
  cudaFree(p.lse);
  cudaFree(const_cast<float*>(p.d_lse));
  cudaFree(const_cast<int32_t*>(p.q_lengths));
  cudaFree(const_cast<int32_t*>(p.kv_lengths));
  cudaFree(const_cast<bool*>(p.attn_mask.data));
  cudaFree(const_cast<bool*>(p.block_mask.data));
  cudaFree(p.d_q);
  cudaFree(p.d_k);
  cudaFree(p.d_v);
  cudaFree(p.scratch);
  cudaStreamDestroy(stream);
  return ok ? 0 : 1;
}

static int run_tests() {
  std::vector<Case> cases;
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (int d : {32, 64, 96, 128, 256}) {
      Case c;
      c.dtype = t;
      c.d = d;
      c.name = "plain";
      c.b = 2, c.sq = c.sk = 256;
      cases.push_back(c);
      c.name = "causal";
      c.causal = true;
      cases.push_back(c);
    }
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (int d : {64, 128})
      for (auto [sq, sk] : {std::pair{1, 1}, {17, 17}, {127, 127}, {1000, 1000}, {1023, 1023}, {17, 300}, {300, 17},
                            {1, 513}, {513, 1}, {129, 1000}})
        for (bool causal : {false, true}) {
          Case c;
          c.dtype = t;
          c.d = d;
          c.sq = sq, c.sk = sk, c.causal = causal;
          c.name = std::string("odd lengths") + (causal ? " causal" : "");
          cases.push_back(c);
        }
  auto add = [&](Case c, const char* name) {
    c.name = name;
    for (DType t : {DType::kBFloat16, DType::kFloat16}) {
      c.dtype = t;
      cases.push_back(c);
    }
  };
  {
    Case c;
    c.sq = c.sk = 700;
    c.wl = 100, c.wr = 50;
    add(c, "window 100/50");
    c.wl = 0, c.wr = 0;
    add(c, "window 0/0");
    c.wl = 200, c.wr = -1, c.causal = true;
    add(c, "causal + window_left 200");
    c.wl = -1, c.wr = 300, c.causal = false;
    add(c, "window_right 300");
  }
  {
    Case c;
    c.b = 4, c.sq = 333, c.sk = 555, c.q_lengths = c.kv_lengths = true;
    add(c, "q/kv lengths");
    c.causal = true;
    add(c, "q/kv lengths causal");
    c.causal = false, c.wl = 60, c.wr = 10;
    add(c, "q/kv lengths window");
    c.wl = c.wr = -1, c.nan_pad = true;
    for (int d : {64, 128, 256}) {
      c.d = d, c.causal = false;
      add(c, "q/kv lengths, NaN padding");
      c.causal = true;
      add(c, "q/kv lengths causal, NaN padding");
    }
  }
  {
    Case c;
    c.h = 8, c.hkv = 2, c.sq = 300, c.sk = 400, c.d = 128;
    add(c, "GQA 8/2");
    c.hkv = 1, c.causal = true, c.d = 64;
    add(c, "MQA 8/1 causal");
  }
  {
    Case c;
    c.scale = 0.37f, c.d_lse = true, c.sq = 200, c.sk = 260;
    add(c, "scale 0.37 + d_lse");
  }
  {
    Case c;
    c.sq = 300, c.sk = 333, c.attn_mask = true;
    add(c, "attn_mask");
    c.causal = true;
    add(c, "attn_mask causal");
    c.key_mask = true, c.b = 3, c.h = 4, c.hkv = 2, c.kv_lengths = true, c.nan_pad = true;
    add(c, "key mask causal GQA pad");
    c.causal = false, c.dropout = 0.2f;
    add(c, "key mask dropout GQA pad");
  }
  for (int d : {64, 128, 256}) {  // attn_mask in the Hopper backward (packed_mask.h) at each of its head dims
    Case c;
    c.d = d, c.sq = 450, c.sk = 333, c.attn_mask = true, c.b = 3, c.h = 4, c.hkv = 2;
    add(c, (std::string("attn_mask GQA d") + std::to_string(d)).c_str());
    c.doc = 100, c.q_lengths = c.kv_lengths = true, c.nan_pad = true;
    add(c, (std::string("doc mask lengths pad d") + std::to_string(d)).c_str());
    c.doc = 150, c.causal = true, c.sk = 700, c.dropout = 0.15f, c.softcap = 2.f;
    add(c, (std::string("doc mask causal drop cap d") + std::to_string(d)).c_str());
    c.doc = 0, c.causal = false, c.dropout = 0.f, c.softcap = 0.f, c.nan_hidden = true, c.nan_pad = false;
    c.kv_lengths = false, c.sk = 333;
    add(c, (std::string("attn_mask NaN hidden d") + std::to_string(d)).c_str());
    c.key_mask = true;
    add(c, (std::string("key mask NaN hidden d") + std::to_string(d)).c_str());
    c.key_mask = false, c.nan_hidden = false, c.block_mask = 128, c.causal = true;
    add(c, (std::string("attn_mask + blocks d") + std::to_string(d)).c_str());
  }
  {
    Case c;
    c.sq = 512, c.sk = 640, c.block_mask = 128;
    add(c, "block_mask 128");
    c.sq = 300, c.sk = 333, c.block_mask = 32;
    add(c, "block_mask 32 (element-wise)");
    c.block_mask = 64, c.causal = true;
    add(c, "block_mask 64 causal");
    c.sq = 700, c.sk = 650, c.d = 128, c.block_mask = 128, c.causal = false, c.dropout = 0.1f;
    add(c, "block_mask 128 + dropout d128");
    // Blocks of whole Hopper tiles (64 x 128): the Hopper kernel skips the False ones.
    c.dropout = 0.f, c.causal = true, c.h = 4, c.hkv = 2, c.block_mask = 256;
    add(c, "block_mask 256 causal GQA d128");
    c.d = 64, c.causal = false, c.h = c.hkv = 2, c.b = 4, c.q_lengths = c.kv_lengths = true, c.nan_pad = true;
    c.block_mask = 128;
    add(c, "block_mask 128 q/kv lengths, NaN padding d64");
  }
  {
    Case c;
    c.sq = 300, c.sk = 333, c.dropout = 0.17f;
    add(c, "dropout 0.17");
    c.causal = true, c.h = 4, c.hkv = 2, c.d = 128;
    add(c, "dropout 0.17 causal GQA");
    // The Hopper kernel's draws of the transposed tile: every lane parity and call block, odd lengths.
    for (int d : {64, 128})
      for (auto [sq, sk] : {std::pair{17, 300}, {129, 1000}, {1023, 1023}}) {
        c.d = d, c.sq = sq, c.sk = sk, c.causal = sk == 1000, c.h = c.hkv = 2, c.dropout = 0.1f;
        add(c, "dropout 0.1 odd lengths");
      }
  }
  {
    Case c;  // soft-capping: scores of std ~1 against caps 1.5 and 5 (the tanh's slope matters)
    for (int d : {64, 128}) {
      c.d = d, c.sq = 300, c.sk = 333, c.softcap = 1.5f, c.dropout = 0.f, c.causal = false;
      add(c, "softcap 1.5");
      c.causal = true, c.softcap = 5.f;
      add(c, "softcap 5 causal");
      c.dropout = 0.17f, c.h = 4, c.hkv = 2;
      add(c, "softcap 5 + dropout 0.17 causal GQA");
      c.b = 4, c.dropout = 0.f, c.softcap = 1.5f, c.h = c.hkv = 2, c.q_lengths = c.kv_lengths = true, c.nan_pad = true;
      add(c, "softcap 1.5 q/kv lengths, NaN padding");
      c.b = 1, c.q_lengths = c.kv_lengths = false, c.nan_pad = false;
    }
    c.d = 256, c.sq = 300, c.sk = 333, c.softcap = 1.5f, c.dropout = 0.1f, c.causal = false;
    add(c, "d256 softcap 1.5 + dropout");
  }
  {
    Case c;
    c.sq = 300, c.sk = 257, c.d = 80;
    add(c, "head dim 80 (padded to 96)");
    c.d = 40, c.causal = true;
    add(c, "head dim 40 causal (padded to 64)");
    c.d = 64, c.dv = 128, c.causal = false;
    add(c, "head dims 64/128 (d != dv)");
    c.d = 128, c.dv = 32, c.h = 4, c.hkv = 2;
    add(c, "head dims 128/32 GQA");
    c.d = 8, c.dv = 16, c.h = 2, c.hkv = 2;
    add(c, "head dims 8/16");
  }
  {  // head dim 256: on sm_90 the Hopper kernel's 64 x 64 tiles with the head dim split between its warpgroups
     // (P^T and dS^T through shared memory, dQ by atomics); TF_FLASH_CUDA_FAMILY=sm80 runs these on the sm_80
     // kernel (64 x 64 tiles, one Q/dO buffer)
    Case c;
    c.d = 256;
    for (auto [sq, sk] : {std::pair{1, 1}, {17, 300}, {300, 17}, {129, 1000}, {1023, 1023}})
      for (bool causal : {false, true}) {
        c.sq = sq, c.sk = sk, c.causal = causal;
        add(c, causal ? "d256 odd lengths causal" : "d256 odd lengths");
      }
    c.sq = c.sk = 700, c.causal = false, c.wl = 100, c.wr = 50;
    add(c, "d256 window 100/50");
    c.wl = c.wr = -1, c.b = 4, c.sq = 333, c.sk = 555, c.q_lengths = c.kv_lengths = true, c.causal = true;
    add(c, "d256 q/kv lengths causal");
    c.b = 1, c.q_lengths = c.kv_lengths = false, c.causal = false;
    c.h = 8, c.hkv = 2, c.sq = 300, c.sk = 400;
    add(c, "d256 GQA 8/2");
    c.h = c.hkv = 2, c.scale = 0.37f, c.d_lse = true, c.sq = 200, c.sk = 260;
    add(c, "d256 scale 0.37 + d_lse");
    c.scale = 0.f, c.d_lse = false, c.sq = 300, c.sk = 333, c.attn_mask = true, c.causal = true;
    add(c, "d256 attn_mask causal");
    c.attn_mask = false, c.causal = false, c.sq = 512, c.sk = 640, c.block_mask = 128;
    add(c, "d256 block_mask 128");
    c.sq = 300, c.sk = 333, c.block_mask = 32;
    add(c, "d256 block_mask 32 (element-wise)");
    c.dropout = 0.1f;
    add(c, "d256 block_mask 32 + dropout (element-wise)");
    c.block_mask = 0, c.dropout = 0.17f, c.causal = true, c.h = 4, c.hkv = 2;
    add(c, "d256 dropout 0.17 causal GQA");
    c.sq = c.sk = 700, c.block_mask = 128, c.causal = false, c.h = c.hkv = 2;
    add(c, "d256 block_mask 128 + dropout");
    c.sq = 300, c.sk = 257, c.block_mask = 0, c.dropout = 0.f, c.d = 160;
    add(c, "d256 head dim 160 (padded to 256)");
    c.d = 200, c.causal = true;
    add(c, "d256 head dim 200 causal (padded to 256)");
    c.d = 256, c.dv = 64, c.causal = false, c.h = 4, c.hkv = 2;
    add(c, "d256 head dims 256/64 GQA");
    c.d = 64, c.dv = 256, c.h = c.hkv = 2;
    add(c, "d256 head dims 64/256");
    c.d = 136, c.dv = 192;
    add(c, "d256 head dims 136/192");
    c.d = c.dv = 256, c.sq = 300, c.sk = 333, c.softcap = 2.f, c.causal = true;
    add(c, "d256 softcap 2 causal");
  }
  {  // The deterministic dQ (bwd_dq_splits): with 64+ (batch, kv head) units on the H100's 132 SMs, splits
     // below the key tiles, so that each CTA runs several key tiles in turn.
    Case c;
    c.deterministic = true;
    for (int d : {64, 128, 256}) {
      c.d = d, c.b = 2, c.h = c.hkv = 33, c.sq = 300, c.sk = 600;
      add(c, (std::string("deterministic d") + std::to_string(d)).c_str());
      c.causal = true, c.h = 66, c.sq = 600, c.sk = 700;
      add(c, (std::string("deterministic causal GQA d") + std::to_string(d)).c_str());
      c.causal = false, c.h = c.hkv = 32, c.q_lengths = c.kv_lengths = true, c.nan_pad = true, c.dropout = 0.1f;
      c.softcap = 2.f;
      add(c, (std::string("deterministic lengths pad dropout cap d") + std::to_string(d)).c_str());
      c.q_lengths = c.kv_lengths = c.nan_pad = false, c.dropout = 0.f, c.softcap = 0.f;
      c.attn_mask = true, c.doc = 200, c.nan_hidden = true, c.sk = 600;
      add(c, (std::string("deterministic doc mask NaN hidden d") + std::to_string(d)).c_str());
      c.attn_mask = c.nan_hidden = false, c.doc = 0, c.block_mask = 128, c.causal = true;
      add(c, (std::string("deterministic block_mask 128 causal d") + std::to_string(d)).c_str());
      c.block_mask = 0, c.causal = false;
    }
    c.d = 128, c.b = 1, c.h = c.hkv = 2, c.sq = 1023, c.sk = 1000;  // splits = key tiles: one tile per CTA
    add(c, "deterministic few units");
    c.d = 256, c.b = 2, c.h = c.hkv = 33, c.sq = 300, c.sk = 600, c.causal = true;
    add(c, "deterministic causal d256");
  }
  {
    Case c;
    c.b = 1, c.h = 1, c.hkv = 1, c.sq = 0, c.sk = 100;
    add(c, "seqlen_q 0");
    c.sq = 100, c.sk = 0;
    add(c, "seqlen_k 0");
  }
  int fails = 0, run = 0;
  uint64_t seed = 1;
  const char* filter = std::getenv("BWD_TEST_FILTER");  // substring of the case names to run
  for (const Case& c : cases) {
    ++seed;
    if (filter && c.name.find(filter) == std::string::npos) continue;
    fails += run_case(c, seed, false);
    ++run;
  }
  std::printf("%d of %d cases failed\n", fails, run);
  return fails ? 1 : 0;
}

// N(0, 1) on the device (Box-Muller over a hashed counter): fast inputs for the timing runs.
template <typename E>
__global__ void fill_normal(E* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const Philox4 r = philox4x32_10(Philox4{{uint32_t(i), uint32_t(i >> 32), seed, 0u}}, 0x9E3779B9u, seed);
    const float u1 = (r.x[0] + 1.f) * 2.3283064e-10f, u2 = r.x[1] * 2.3283064e-10f;
    x[i] = E(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

static void run_bench_one(DType t, int d, int B, int S, int H, bool causal, int warmup, int iters,
                          float dropout = 0.f, float softcap = 0.f) {
  FlashBwdParams p;
  p.batch = B, p.seqlen_q = p.seqlen_k = S, p.num_heads = p.num_heads_kv = H;
  p.head_dim = p.head_dim_v = d;
  p.scale = 1.f / std::sqrt(float(d));
  p.causal = causal;
  p.dropout_rate = dropout;
  p.softcap = softcap;
  p.seed = 42;
  p.deterministic = std::getenv("BWD_BENCH_DETERMINISTIC") != nullptr;  // the deterministic dQ
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(H) * d;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(S) * H * d;
  const size_t n = size_t(B) * S * H * d;
  void* bufs[5];
  for (int i = 0; i < 5; ++i) {
    CHECK_CUDA(cudaMalloc(&bufs[i], n * 2));
    if (t == DType::kFloat16)
      fill_normal<<<1024, 256>>>(static_cast<cutlass::half_t*>(bufs[i]), n, uint32_t(i * 7919 + S + d));
    else
      fill_normal<<<1024, 256>>>(static_cast<cutlass::bfloat16_t*>(bufs[i]), n, uint32_t(i * 7919 + S + d));
    CHECK_CUDA(cudaGetLastError());
  }
  p.q = bufs[0], p.k = bufs[1], p.v = bufs[2], p.out = bufs[3], p.d_out = bufs[4];
  std::vector<float> lse(size_t(B) * H * S, std::log(float(S)) + 0.5f);
  CHECK_CUDA(cudaMalloc(&p.lse, lse.size() * 4));
  CHECK_CUDA(cudaMemcpy(p.lse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&p.d_q, n * 2));
  CHECK_CUDA(cudaMalloc(&p.d_k, n * 2));
  CHECK_CUDA(cudaMalloc(&p.d_v, n * 2));
  // BWD_BENCH_BLOCK_DENSITY=x: random 128x128 block mask keeping a fraction x of the blocks (block-sparse).
  const char* density_env = std::getenv("BWD_BENCH_BLOCK_DENSITY");
  void* bmask_dev = nullptr;
  if (density_env) {
    const int nb = (S + 127) / 128;
    std::vector<uint8_t> bm(size_t(B) * H * nb * nb);
    std::mt19937 rng(7);
    std::bernoulli_distribution keep(std::atof(density_env));
    for (auto& x : bm) x = keep(rng);
    CHECK_CUDA(cudaMalloc(&bmask_dev, bm.size()));
    CHECK_CUDA(cudaMemcpy(bmask_dev, bm.data(), bm.size(), cudaMemcpyHostToDevice));
    p.block_mask.data = static_cast<const bool*>(bmask_dev);
    p.block_mask.batch_stride = int64_t(H) * nb * nb, p.block_mask.head_stride = int64_t(nb) * nb;
    p.block_mask.row_stride = nb, p.block_mask.col_stride = 1;
    p.block_q = p.block_k = 128, p.num_q_blocks = p.num_k_blocks = nb;
  }
  // BWD_BENCH_ATTN_MASK=1: an all-True attn_mask [S, S] broadcast over batch and heads (the element-mask
  // kernel's cost against the plain one); =keys: an all-True key mask; =random: [S, S], 90% True at random
  // (every tile masked in part); =random_keys: a key mask, 90% True.
  void* amask_dev = nullptr;
  if (const char* mask_env = std::getenv("BWD_BENCH_ATTN_MASK")) {
    const std::string kind = mask_env;
    const bool keys = kind == "keys" || kind == "random_keys";
    std::vector<uint8_t> am(keys ? size_t(S) : size_t(S) * S, 1);
    std::mt19937 rng(11);
    if (kind.rfind("random", 0) == 0)
      for (auto& x : am) x = rng() % 10 != 0;
    CHECK_CUDA(cudaMalloc(&amask_dev, am.size()));
    CHECK_CUDA(cudaMemcpy(amask_dev, am.data(), am.size(), cudaMemcpyHostToDevice));
    p.attn_mask.data = static_cast<const bool*>(amask_dev);
    p.attn_mask.row_stride = keys ? 0 : S, p.attn_mask.col_stride = 1;  // a key mask [1, 1, 1, S]: row stride 0
  }
  // After the masks: the scratch holds the Hopper kernel's packed attn_mask too.
  CHECK_CUDA(cudaMalloc(&p.scratch, flash_bwd_cuda_scratch_bytes(p, t)));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < warmup; ++i) CHECK_CUDA(cudaError_t(flash_bwd_cuda(p, t, stream)));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    CHECK_CUDA(cudaError_t(flash_bwd_cuda(p, t, stream)));
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float x;
    CHECK_CUDA(cudaEventElapsedTime(&x, e0, e1));
    ms.push_back(x);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 2.5 * 4.0 * B * double(S) * S * H * d / (causal ? 2.0 : 1.0);
  std::printf("| %s | %d | %s | %d | %d | %d | %.3f | %.3f..%.3f | %.1f |\n",
              t == DType::kFloat16 ? "fp16" : "bf16", d, causal ? "yes" : "no", B, S, H, med, ms.front(),
              ms.back(), flops / (med * 1e-3) / 1e12);
  std::fflush(stdout);
  for (void* b : bufs) cudaFree(b);
  cudaFree(p.lse);
  cudaFree(p.d_q);
  cudaFree(p.d_k);
  cudaFree(p.d_v);
  cudaFree(p.scratch);
  cudaFree(bmask_dev);
  cudaFree(amask_dev);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
}

static int run_bench(const std::vector<int>& dims) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("| dtype | d | causal | batch | seqlen | heads | ms (median) | min..max ms | TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const std::pair<int, int> grid[] = {{32, 512}, {16, 1024}, {8, 2048}, {4, 4096}, {2, 8192}, {1, 16384}};
  const char* only = std::getenv("BWD_BENCH_DTYPE");  // bf16 or fp16: time just that one
  for (DType t : {DType::kBFloat16, DType::kFloat16})
    for (int d : dims)
      if (!only || std::string(only) == (t == DType::kFloat16 ? "fp16" : "bf16"))
      for (bool causal : {false, true})
        for (auto [B, S] : grid) {
          run_bench_one(t, d, B, S, 2048 / d, causal, 3, 20);
        }
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "test";
  if (mode == "test") return run_tests();
  if (mode == "bench1" && argc >= 8) {  // bench1 bf16|fp16 d batch seqlen heads causal [dropout [iters [softcap]]]
    const DType t = std::string(argv[2]) == "fp16" ? DType::kFloat16 : DType::kBFloat16;
    run_bench_one(t, std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]),
                  std::atoi(argv[7]) != 0, argc > 9 ? 3 : 1, argc > 9 ? std::atoi(argv[9]) : 3,
                  argc > 8 ? float(std::atof(argv[8])) : 0.f, argc > 10 ? float(std::atof(argv[10])) : 0.f);
    return 0;
  }
  if (mode == "bench") {
    std::vector<int> dims;
    for (int i = 2; i < argc; ++i) dims.push_back(std::atoi(argv[i]));
    if (dims.empty()) dims = {64, 128};
    return run_bench(dims);
  }
  std::fprintf(stderr, "usage: %s test | bench [head_dim ...] | bench1 dtype d b s h causal [dropout [iters [softcap]]]\n",
               argv[0]);
  return 2;
}
