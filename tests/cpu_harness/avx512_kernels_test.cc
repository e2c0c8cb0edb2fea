// The AVX-512 micro-kernels (cc/kernels/cpu/flash_attention_avx512.cc) against scalar references, without
// TensorFlow: tests/test_cpu_isa.py compiles this with that file and runs it where the CPU has AVX512F.
//
// Products: every element must equal, bit for bit, the scalar chain acc = fmaf(a, b, acc) over k in order,
// then alpha * acc (or fmaf(alpha, acc, c) when accumulating): the contract the forward and the backward
// rely on for equal tiles. Shapes cover every micro-kernel (1..12 rows, 1..4 vectors) and their tails, with
// strides wider than the rows; guard values around C must survive. exp: within 2 ulp of the double exp over
// [-110, 1], exp(-inf) = 0, NaN stays NaN; max and sums against double. The elementwise steps (multiply,
// softmax_grad) bit for bit against their scalar formulas, NaN in dP where P is 0 included; softcap's tanh
// within 3 ulp of the double tanh over [-60, 60], its d_tanh and cap scaling bit for bit from that tanh;
// mask_row against the per-entry rule (NaN scores of masked columns replaced, columns outside [lo, hi) kept).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cc/kernels/cpu/cpu_isa.h"

namespace avx = tf_flash::cpu_avx512;

namespace {

int failures = 0;
constexpr float kGuard = -12345.f;

void Fail(const char* what, long m, long n, long k, long i, long j, float got, float want) {
  if (++failures <= 20) {
    std::printf("FAIL %s m=%ld n=%ld k=%ld at (%ld, %ld): got %.9g want %.9g\n", what, m, n, k, i, j, got, want);
  }
}

bool SameBits(float x, float y) {
  uint32_t a, b;
  std::memcpy(&a, &x, 4);
  std::memcpy(&b, &y, 4);
  return a == b;
}

enum class Form { kNN, kTN, kNT };

void CheckProduct(Form form, long m, long n, long k, float alpha, bool accumulate, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  // A is m x k (NN, NT) or k x m (TN); B is k x n (NN, TN) or n x k (NT); every leading dimension padded.
  const long a_rows = form == Form::kTN ? k : m, a_cols = form == Form::kTN ? m : k;
  const long b_rows = form == Form::kNT ? n : k, b_cols = form == Form::kNT ? k : n;
  const long lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 7;
  std::vector<float> a(a_rows * lda + 1), b(b_rows * ldb + 1), c((m + 1) * ldc, kGuard), pack;
  for (float& x : a) x = normal(gen);
  for (float& x : b) x = normal(gen);
  for (long i = 0; i < m; ++i) {
    for (long j = 0; j < n; ++j) c[i * ldc + j] = normal(gen);
  }
  const std::vector<float> c0 = c;
  auto a_at = [&](long i, long kk) { return form == Form::kTN ? a[kk * lda + i] : a[i * lda + kk]; };
  auto b_at = [&](long kk, long j) { return form == Form::kNT ? b[j * ldb + kk] : b[kk * ldb + j]; };
  switch (form) {
    case Form::kNN: avx::gemm_nn(m, n, k, a.data(), lda, b.data(), ldb, alpha, accumulate, c.data(), ldc); break;
    case Form::kTN: avx::gemm_tn(m, n, k, a.data(), lda, b.data(), ldb, alpha, accumulate, c.data(), ldc); break;
    case Form::kNT:
      pack.assign(avx::gemm_nt_pack_floats(k), 0.f);
      avx::gemm_nt(m, n, k, a.data(), lda, b.data(), ldb, alpha, accumulate, c.data(), ldc, pack.data());
      break;
  }
  const char* name = form == Form::kNN ? "gemm_nn" : form == Form::kTN ? "gemm_tn" : "gemm_nt";
  for (long i = 0; i <= m; ++i) {
    for (long j = 0; j < ldc; ++j) {
      const float got = c[i * ldc + j];
      if (i == m || j >= n) {  // outside C: untouched
        if (!SameBits(got, c0[i * ldc + j])) Fail(name, m, n, k, i, j, got, c0[i * ldc + j]);
        continue;
      }
      float acc = 0.f;
      for (long kk = 0; kk < k; ++kk) acc = std::fmaf(a_at(i, kk), b_at(kk, j), acc);
      const float want = accumulate ? std::fmaf(alpha, acc, c0[i * ldc + j]) : alpha * acc;
      if (!SameBits(got, want)) Fail(name, m, n, k, i, j, got, want);
    }
  }
}

double UlpsOff(float got, double want) {
  const double ulp = std::ldexp(1.0, std::max(std::ilogb(static_cast<float>(want)), -126) - 23);
  return std::fabs(got - want) / ulp;
}

void CheckExp() {
  std::vector<float> x;
  for (double v = -110.0; v <= 1.0; v += 0.000731) x.push_back(static_cast<float>(v));
  const float specials[] = {0.f, -0.f, 1e-30f, -1e-30f, -87.3f, -88.7f, -103.9f, -104.f, -104.5f, -1e30f,
                            -std::numeric_limits<float>::infinity()};
  for (float v : specials) x.push_back(v);
  std::vector<float> y = x;
  avx::exp_shifted_scaled(y.data(), static_cast<long>(y.size()), 0.f, 1.f);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    if (want < 1e-45) {  // rounds to 0 in float32 (below half the least subnormal) or is the least subnormal
      if (!(y[i] == 0.f || y[i] == std::numeric_limits<float>::denorm_min())) Fail("exp tiny", 0, 0, 0, i, 0, y[i], 0);
      continue;
    }
    const double off = UlpsOff(y[i], want);
    if (want >= 1.1754944e-38 && off > worst) worst = off;
    if (off > 2.0) Fail("exp", 0, 0, 0, static_cast<long>(i), 0, y[i], static_cast<float>(want));
  }
  std::printf("exp: worst %.2f ulp over %zu points (normal results)\n", worst, x.size());
  float nan_in[3] = {std::numeric_limits<float>::quiet_NaN(), -1.f, 0.f};
  avx::exp_shifted_scaled(nan_in, 3, 0.f, 1.f);
  if (!std::isnan(nan_in[0])) Fail("exp(NaN)", 0, 0, 0, 0, 0, nan_in[0], NAN);
  // Shift and scale, and the sums with every tail length.
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (long n = 0; n <= 70; ++n) {
    std::vector<float> v(n + 1, kGuard), w;
    for (long i = 0; i < n; ++i) v[i] = normal(gen);
    if (n > 3) v[2] = -std::numeric_limits<float>::infinity();
    const float shift = 1.5f, scale = 0.37f;
    w = v;
    double want_max = -INFINITY;
    for (long i = 0; i < n; ++i) want_max = std::max<double>(want_max, v[i]);
    const float got_max = avx::max_of(v.data(), n);
    if (got_max != static_cast<float>(want_max)) Fail("max_of", n, 0, 0, 0, 0, got_max, want_max);
    const float sum = avx::exp_shifted_sum(w.data(), n, shift);
    double want_sum = 0;
    for (long i = 0; i < n; ++i) {
      const double e = std::exp(static_cast<double>(v[i] - shift));
      want_sum += e;
      if (UlpsOff(w[i], e) > 2.0 && !(e == 0 && w[i] == 0.f)) Fail("exp_shifted_sum elem", n, 0, 0, i, 0, w[i], e);
    }
    if (std::fabs(sum - want_sum) > 1e-6 * want_sum + 1e-30) Fail("exp_shifted_sum", n, 0, 0, 0, 0, sum, want_sum);
    if (w[n] != kGuard) Fail("exp_shifted_sum guard", n, 0, 0, n, 0, w[n], kGuard);
    w = v;
    avx::exp_shifted_scaled(w.data(), n, shift, scale);
    for (long i = 0; i < n; ++i) {
      const double e = static_cast<double>(static_cast<float>(std::exp(static_cast<double>(v[i] - shift)))) * scale;
      if (UlpsOff(w[i], e) > 2.5 && !(e == 0 && w[i] == 0.f)) Fail("exp_shifted_scaled", n, 0, 0, i, 0, w[i], e);
    }
    if (w[n] != kGuard) Fail("exp_shifted_scaled guard", n, 0, 0, n, 0, w[n], kGuard);
  }
}

void CheckElementwise(std::mt19937& gen) {
  std::normal_distribution<float> normal;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (long rows : {1L, 3L, 8L}) {
    for (long cols : {1L, 15L, 16L, 17L, 64L, 100L, 257L}) {
      const long n = rows * cols;
      std::vector<float> p(n), dp(n + 1, kGuard), d_tanh(n), delta(rows), x(n + 1, kGuard), y(n);
      for (long i = 0; i < n; ++i) {
        p[i] = i % 5 == 0 ? 0.f : std::fabs(normal(gen));
        dp[i] = i % 7 == 0 && p[i] == 0.f ? nan : normal(gen);  // NaN only where P is 0
        d_tanh[i] = 1.f - normal(gen) * normal(gen);
        x[i] = normal(gen);
        y[i] = i % 3 == 0 ? 0.f : 1.25f;
      }
      for (float& d : delta) d = normal(gen);
      for (bool with_tanh : {false, true}) {
        std::vector<float> got = dp;
        avx::softmax_grad(got.data(), p.data(), with_tanh ? d_tanh.data() : nullptr, delta.data(), rows, cols);
        for (long i = 0; i < n; ++i) {
          float want = p[i] == 0.f ? 0.f : p[i] * (dp[i] - delta[i / cols]);
          if (with_tanh) want *= d_tanh[i];
          if (!SameBits(got[i], want)) Fail("softmax_grad", rows, cols, with_tanh, i / cols, i % cols, got[i], want);
        }
        if (got[n] != kGuard) Fail("softmax_grad guard", rows, cols, with_tanh, rows, 0, got[n], kGuard);
      }
      std::vector<float> got = x;
      avx::multiply(got.data(), y.data(), n);
      for (long i = 0; i < n; ++i) {
        if (!SameBits(got[i], x[i] * y[i])) Fail("multiply", rows, cols, 0, i / cols, i % cols, got[i], x[i] * y[i]);
      }
      if (got[n] != kGuard) Fail("multiply guard", rows, cols, 0, rows, 0, got[n], kGuard);
    }
  }
}

void CheckMaskRow(std::mt19937& gen) {
  std::normal_distribution<float> normal;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (long cols : {1L, 15L, 16L, 17L, 40L, 256L}) {
    for (long lo = 0; lo <= cols; lo += 1 + cols / 5) {
      for (long hi = lo; hi <= cols; hi += 1 + cols / 4) {
        for (int density : {0, 3, 10}) {  // visible fraction density / 10
          std::vector<float> s(cols);
          std::vector<uint8_t> mask(cols), seen(cols);
          for (long c = 0; c < cols; ++c) {
            s[c] = c % 9 == 4 ? nan : normal(gen);
            mask[c] = static_cast<uint8_t>(static_cast<int>(gen() % 10) < density);
            seen[c] = static_cast<uint8_t>(gen() % 4 == 0);
          }
          std::vector<float> got = s;
          std::vector<uint8_t> got_seen = seen;
          const bool any = avx::mask_row(got.data(), mask.data(), got_seen.data(), lo, hi);
          bool want_any = false;
          for (long c = 0; c < cols; ++c) {
            const bool inside = c >= lo && c < hi, visible = mask[c] != 0;
            const float want = inside && !visible ? -std::numeric_limits<float>::infinity() : s[c];
            const uint8_t want_seen = static_cast<uint8_t>(seen[c] | (inside && visible));
            want_any |= inside && visible;
            if (!SameBits(got[c], want)) Fail("mask_row", cols, lo, hi, 0, c, got[c], want);
            if (got_seen[c] != want_seen) Fail("mask_row seen", cols, lo, hi, 0, c, got_seen[c], want_seen);
          }
          if (any != want_any) Fail("mask_row any", cols, lo, hi, 0, 0, any, want_any);
        }
      }
    }
  }
}

void CheckSoftcap() {
  std::vector<float> x;
  for (double v = -60.0; v <= 60.0; v += 0.000917) x.push_back(static_cast<float>(v));
  for (double v = -1.0; v <= 1.0; v += 0.0000137) x.push_back(static_cast<float>(v));
  const float specials[] = {0.f, -0.f, 1e-30f, -1e-30f, 1e-6f, 0.625f, -0.625f, 0.62499997f, 1e30f, -1e30f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (float v : specials) x.push_back(v);
  const long n = static_cast<long>(x.size());
  // cap 1: x becomes tanh(x) itself.
  std::vector<float> t = x, d_tanh(n + 1, kGuard);
  t.push_back(kGuard);
  avx::softcap(t.data(), n, 1.f, d_tanh.data());
  double worst = 0;
  for (long i = 0; i < n; ++i) {
    const double want = std::tanh(static_cast<double>(x[i]));
    const double off = want == 0.0 ? (t[i] == 0.f ? 0.0 : 1e9) : UlpsOff(t[i], want);
    worst = std::max(worst, off);
    if (off > 3.0) Fail("tanh", 0, 0, 0, i, 0, t[i], want);
    const float want_d = std::fmaf(-t[i], t[i], 1.f);
    if (!SameBits(d_tanh[i], want_d)) Fail("d_tanh", 0, 0, 0, i, 0, d_tanh[i], want_d);
  }
  if (t[n] != kGuard || d_tanh[n] != kGuard) Fail("softcap guard", n, 0, 0, n, 0, t[n], kGuard);
  std::printf("tanh: worst %.2f ulp over %ld points\n", worst, n);
  float nan_in[2] = {std::numeric_limits<float>::quiet_NaN(), 0.5f};
  avx::softcap(nan_in, 2, 1.f, nullptr);
  if (!std::isnan(nan_in[0])) Fail("tanh(NaN)", 0, 0, 0, 0, 0, nan_in[0], NAN);
  // cap 5: x * (1 / 5) through the same tanh, then * 5.
  const float cap = 5.f;
  std::vector<float> scaled(n), arg(n);
  for (long i = 0; i < n; ++i) arg[i] = x[i] * (1.f / cap);
  std::vector<float> t_arg = arg;
  avx::softcap(t_arg.data(), n, 1.f, nullptr);
  scaled = x;
  avx::softcap(scaled.data(), n, cap, nullptr);
  for (long i = 0; i < n; ++i) {
    if (!SameBits(scaled[i], t_arg[i] * cap)) Fail("softcap scaling", 0, 0, 0, i, 0, scaled[i], t_arg[i] * cap);
  }
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("SKIP: no AVX512F on this CPU\n");
    return 77;
  }
  std::mt19937 gen(1234);
  const long ms[] = {1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 25, 128};
  const long ns[] = {1, 3, 15, 16, 17, 32, 33, 48, 63, 64, 65, 100, 129, 256};
  const long ks[] = {0, 1, 2, 7, 32, 64, 77, 128};
  long cases = 0;
  for (Form form : {Form::kNN, Form::kTN, Form::kNT}) {
    for (long m : ms) {
      for (long n : ns) {
        for (long k : ks) {
          const bool accumulate = (m + n + k) % 2 == 0;
          const float alpha = (m + k) % 3 == 0 ? 1.f : 0.125f * static_cast<float>(1 + (n % 5));
          CheckProduct(form, m, n, k, alpha, accumulate, gen);
          ++cases;
        }
      }
    }
  }
  std::printf("products: %ld cases\n", cases);
  CheckExp();
  CheckElementwise(gen);
  CheckSoftcap();
  CheckMaskRow(gen);
  std::printf(failures ? "FAILED: %d mismatches\n" : "OK\n", failures);
  return failures ? 1 : 0;
}
