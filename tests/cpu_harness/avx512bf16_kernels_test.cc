// The AVX512_BF16 products (cc/kernels/cpu/flash_attention_avx512bf16.cc) against scalar references, without
// TensorFlow: tests/test_cpu_isa.py compiles this with that file and runs it where the CPU has AVX512_BF16.
//
// Each element of C against the scalar float32 chain on bf16-rounded operands (round to nearest, ties to
// even, computed here on the bits): acc = fmaf(a1, b1, acc), then fmaf(a0, b0, acc), pair by pair in order
// (vdpbf16ps's definition), then alpha * acc (or fmaf(alpha, acc, c) when accumulating). Required: every
// element within the float32 error bound of that sum in any order, (k + 2) 2^-24 (|alpha| sum |a b| + |c|),
// which a wrong rounding of an operand (2^-9 relative) exceeds by far; bit-equality with the chain is
// counted and printed. Required too, bit for bit: a sub-block of C computed alone (other rows, columns and
// strides around it) equals the same elements of the whole product, the property that keeps the forward's
// and the backward's tiles equal and the backward deterministic. Operands include exact ties of the
// rounding, odd k (the last pair takes a 0) and every micro-kernel's rows and column tails; guard values
// around C must survive. Where the CPU has AMX-BF16 and Linux grants the tile state, the amx_* products
// pass the same checks.
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cc/kernels/cpu/cpu_isa.h"

namespace bf16 = tf_flash::cpu_avx512bf16;

namespace {

int failures = 0;
bool amx = false;  // the products under test: amx_gemm_* when set
long bit_equal = 0, elements = 0;
constexpr float kGuard = -12345.f;

void Fail(const char* what, long m, long n, long k, long i, long j, double got, double want) {
  if (++failures <= 20) {
    std::printf("FAIL %s m=%ld n=%ld k=%ld at (%ld, %ld): got %.9g want %.9g\n", what, m, n, k, i, j, got, want);
  }
}

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// The bfloat16 nearest to x, ties to even (NaN stays NaN).
float RoundBf16(float x) {
  if (std::isnan(x)) return x;
  uint32_t b = Bits(x);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return FromBits(b & 0xFFFF0000u);
}

enum class Form { kNN, kTN, kNT };

const char* Name(Form form) {
  if (amx) return form == Form::kNN ? "amx_gemm_nn" : form == Form::kTN ? "amx_gemm_tn" : "amx_gemm_nt";
  return form == Form::kNN ? "gemm_nn" : form == Form::kTN ? "gemm_tn" : "gemm_nt";
}

// A random float32 operand: mostly arbitrary values (rounded by the kernel), some exact ties of the rounding
// (low 16 bits 0x8000, half of them on an odd bfloat16), some already bfloat16.
float Operand(std::mt19937& gen) {
  std::normal_distribution<float> normal;
  const float x = normal(gen);
  switch (gen() % 8) {
    case 0: return FromBits((Bits(x) & 0xFFFF0000u) | 0x8000u);
    case 1: return FromBits((Bits(x) & 0xFFFE0000u) | 0x18000u);
    case 2: return RoundBf16(x);
    default: return x;
  }
}

void Call(Form form, long m, long n, long k, const float* a, long lda, const float* b, long ldb, float alpha,
          bool accumulate, float* c, long ldc) {
  std::vector<uint32_t> scratch((amx ? bf16::amx_scratch_words(m, n, k) : bf16::scratch_words(m, n, k)) + 1,
                                0xDEADBEEFu);
  uint32_t* s = scratch.data();
  if (amx) {
    switch (form) {
      case Form::kNN: bf16::amx_gemm_nn(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
      case Form::kTN: bf16::amx_gemm_tn(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
      case Form::kNT: bf16::amx_gemm_nt(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
    }
  } else {
    switch (form) {
      case Form::kNN: bf16::gemm_nn(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
      case Form::kTN: bf16::gemm_tn(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
      case Form::kNT: bf16::gemm_nt(m, n, k, a, lda, b, ldb, alpha, accumulate, c, ldc, s); break;
    }
  }
  if (scratch.back() != 0xDEADBEEFu) Fail("scratch overrun", m, n, k, 0, 0, scratch.back(), 0xDEADBEEFu);
}

void CheckProduct(Form form, long m, long n, long k, float alpha, bool accumulate, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  // A is m x k (NN, NT) or k x m (TN); B is k x n (NN, TN) or n x k (NT); every leading dimension padded.
  const long a_rows = form == Form::kTN ? k : m, a_cols = form == Form::kTN ? m : k;
  const long b_rows = form == Form::kNT ? n : k, b_cols = form == Form::kNT ? k : n;
  const long lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 7;
  std::vector<float> a(a_rows * lda + 1), b(b_rows * ldb + 1), c((m + 1) * ldc, kGuard);
  for (float& x : a) x = Operand(gen);
  for (float& x : b) x = Operand(gen);
  for (long i = 0; i < m; ++i) {
    for (long j = 0; j < n; ++j) c[i * ldc + j] = normal(gen);
  }
  const std::vector<float> c0 = c;
  auto a_at = [&](long i, long kk) -> float {
    if (kk >= k) return 0.f;
    return RoundBf16(form == Form::kTN ? a[kk * lda + i] : a[i * lda + kk]);
  };
  auto b_at = [&](long kk, long j) -> float {
    if (kk >= k) return 0.f;
    return RoundBf16(form == Form::kNT ? b[j * ldb + kk] : b[kk * ldb + j]);
  };
  Call(form, m, n, k, a.data(), lda, b.data(), ldb, alpha, accumulate, c.data(), ldc);
  const char* name = Name(form);
  for (long i = 0; i <= m; ++i) {
    for (long j = 0; j < ldc; ++j) {
      const float got = c[i * ldc + j];
      if (i == m || j >= n) {  // outside C: untouched
        if (Bits(got) != Bits(c0[i * ldc + j])) Fail(name, m, n, k, i, j, got, c0[i * ldc + j]);
        continue;
      }
      float chain = 0.f;
      double exact = 0.0, magnitude = 0.0;
      for (long t = 0; 2 * t < k; ++t) {
        chain = std::fmaf(a_at(i, 2 * t + 1), b_at(2 * t + 1, j), chain);
        chain = std::fmaf(a_at(i, 2 * t), b_at(2 * t, j), chain);
        for (long kk = 2 * t; kk < 2 * t + 2; ++kk) {
          const double product = static_cast<double>(a_at(i, kk)) * b_at(kk, j);
          exact += product;
          magnitude += std::fabs(product);
        }
      }
      const float c_in = c0[i * ldc + j];
      const float want = accumulate ? std::fmaf(alpha, chain, c_in) : alpha * chain;
      const double want_exact = alpha * exact + (accumulate ? c_in : 0.0);
      const double bound =
          (k + 2) * std::ldexp(1.0, -24) * (std::fabs(alpha) * magnitude + (accumulate ? std::fabs(c_in) : 0.0));
      ++elements;
      bit_equal += Bits(got) == Bits(want);
      if (!(std::fabs(got - want_exact) <= bound)) Fail(name, m, n, k, i, j, got, want_exact);
    }
  }
  // A sub-block alone: rows [i0, m), columns [j0, n), as the forward's and the backward's tiles differ in
  // what surrounds an element.
  const long i0 = m / 3, j0 = n / 5;
  if (i0 == 0 && j0 == 0) return;
  std::vector<float> part(c0);
  const float* a_sub = form == Form::kTN ? a.data() + i0 : a.data() + i0 * lda;
  const float* b_sub = form == Form::kNT ? b.data() + j0 * ldb : b.data() + j0;
  Call(form, m - i0, n - j0, k, a_sub, lda, b_sub, ldb, alpha, accumulate, part.data() + i0 * ldc + j0, ldc);
  for (long i = i0; i < m; ++i) {
    for (long j = j0; j < n; ++j) {
      const float whole = c[i * ldc + j], alone = part[i * ldc + j];
      if (Bits(alone) != Bits(whole)) Fail("sub-block", m, n, k, i, j, alone, whole);
    }
  }
}

// A NaN operand gives NaN in its row (a NaN never rounds to infinity or a number); infinities stay infinite.
void CheckSpecials() {
  const long m = 3, n = 17, k = 5;
  std::vector<float> a(m * k, 1.f), b(n * k, 0.5f), c(m * n, 0.f);
  a[0 * k + 2] = std::numeric_limits<float>::quiet_NaN();
  a[1 * k + 4] = std::numeric_limits<float>::infinity();
  a[2 * k + 1] = std::numeric_limits<float>::max();  // rounds to infinity as bfloat16
  Call(Form::kNT, m, n, k, a.data(), k, b.data(), k, 1.f, false, c.data(), n);
  for (long j = 0; j < n; ++j) {
    if (!std::isnan(c[0 * n + j])) Fail("NaN operand", m, n, k, 0, j, c[0 * n + j], NAN);
    const float inf = std::numeric_limits<float>::infinity();
    if (!(c[1 * n + j] == inf)) Fail("inf operand", m, n, k, 1, j, c[1 * n + j], inf);
    if (!(c[2 * n + j] == inf)) Fail("max rounds to inf", m, n, k, 2, j, c[2 * n + j], inf);
  }
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("SKIP: no AVX512_BF16 on this CPU\n");
    return 77;
  }
  // AMX where the CPU has it and the OS grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM,
  // XFEATURE_XTILEDATA), as cpu_isa.cc asks before the AMX path.
  const bool with_amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                        syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  for (bool use_amx : {false, true}) {
    if (use_amx && !with_amx) {
      std::printf("amx: not run (no AMX-BF16 on this CPU, or the OS refused the tile state)\n");
      continue;
    }
    amx = use_amx;
    bit_equal = elements = 0;
    std::mt19937 gen(4321);
    const long ms[] = {1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 25, 128};
    const long ns[] = {1, 3, 15, 16, 17, 32, 33, 48, 63, 64, 65, 100, 129, 256};
    const long ks[] = {0, 1, 2, 3, 7, 32, 33, 64, 77, 128};
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
    CheckSpecials();
    std::printf("%s products: %ld cases, %ld of %ld elements bit-equal to the scalar chain\n",
                amx ? "amx" : "vdpbf16ps", cases, bit_equal, elements);
  }
  std::printf(failures ? "FAILED: %d mismatches\n" : "OK\n", failures);
  return failures ? 1 : 0;
}
