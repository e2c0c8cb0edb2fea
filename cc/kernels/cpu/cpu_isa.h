// The CPU kernel's instruction-set paths and the AVX-512 micro-kernels' interface.
//
// The AVX2 path is flash_attention_cpu.cc as compiled (-mavx2 -mfma: Eigen's GEMM and exp). The AVX-512
// path runs the same tile loops and swaps in the functions declared below for the products and the
// softmax's exp; the AVX512_BF16 path is the AVX-512 path whose products, for bfloat16 inputs only, take
// bfloat16 operands in pairs through vdpbf16ps (or AMX tiles). Those live in
// flash_attention_avx512.cc and flash_attention_avx512bf16.cc, the only files compiled with AVX-512 (and AMX)
// flags (files named *_avx512.cc and *_avx512bf16.cc: cc/BUILD, tools/gpu.sh host). They hold no Eigen, no std
// and nothing inline or templated with external linkage, so no function the linker may merge across files (a
// COMDAT) carries AVX-512 code into an AVX2 caller; tests/test_cpu_isa.py checks the objects and the library.
// This header declares plain functions only, for the same reason.
#pragma once

#include <cstdint>

namespace tf_flash {

// Ordered by width: each path runs everything the one before it runs where it has no faster way.
//   kAvx2:       Eigen's products and exp (every x86-64 machine we target).
//   kAvx512:     tf_flash::cpu_avx512's float32 micro-kernels and exp, for every input dtype.
//   kAvx512Bf16: kAvx512, except that the products of bfloat16 inputs run tf_flash::cpu_avx512bf16's
//                vdpbf16ps kernels (float32 and float16 inputs run exactly as under kAvx512). The default
//                where the CPU has AVX512_BF16 and no AMX (an AMD EPYC: 1.35-1.65x kAvx512's float32 products);
//                where it has AMX, vdpbf16ps runs at half the FMA rate (a Xeon: 0.6-0.75x), so that Xeon stays on
//                kAvx512 even when Linux refuses the tile state.
//   kAvx512Amx:  kAvx512Bf16 with those products on AMX tiles (cpu_avx512bf16::amx_*): the default where the
//                CPU has AMX-BF16, faster than kAvx512's float32 products where measured.
// The bfloat16 products round P and dS to bfloat16 before multiplying, as the GPU kernels do.
enum class CpuIsa { kAvx2, kAvx512, kAvx512Bf16, kAvx512Amx };

// The path this process runs, chosen once, at the first call: avx512_amx where the CPU has AMX-BF16 and Linux
// grants the tile state, avx512_bf16 where it has AVX512_BF16 and no AMX-BF16, else avx512 where the CPU and the
// OS have it (the zmm state saved by the OS), else avx2;
// or, with TF_FLASH_CPU_ISA=avx2 / avx512 / avx512_bf16 / avx512_amx in the environment, that path where the CPU
// has it (else the default), so that every path is testable on one machine.
CpuIsa cpu_isa();

// Whether the CPU could run the AVX-512 path: AVX512F (whatever TF_FLASH_CPU_ISA says).
bool cpu_has_avx512();
// Whether the CPU could run the AVX512_BF16 path: AVX512F, AVX512BW, AVX512VL and AVX512_BF16, the set
// every CPU with AVX512_BF16 has and the compiler may use once given -mavx512bf16.
bool cpu_has_avx512_bf16();
// Whether the CPU could run the AMX path: cpu_has_avx512_bf16, AMX-TILE and AMX-BF16, and Linux granted this
// process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM; asked once, by this call).
bool cpu_has_amx_bf16();

namespace cpu_avx512 {

// Float32 row-major products, accumulated in float32 at 16 lanes, each element's sum over k taken in
// order by one chain of FMAs: an element depends on its own row and column only, never on the shapes
// or its position, so equal operands give bit-equal results in every tile. With accumulate, C += alpha *
// sum (one FMA), else C = alpha * sum.
//   gemm_nn: C[m x n] (+)= alpha * A[m x k] B[k x n]
//   gemm_tn: C[m x n] (+)= alpha * A[k x m]^T B[k x n]
//   gemm_nt: C[m x n] (+)= alpha * A[m x k] B[n x k]^T; pack holds gemm_nt_pack_floats(k) floats
void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc);
void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc);
int64_t gemm_nt_pack_floats(int64_t k);
void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, float* pack);

// The largest of x[0, n) (-inf when n is 0).
float max_of(const float* x, int64_t n);
// x[i] = exp(x[i] - shift) in place; returns their sum. exp: Cody-Waite reduction and a degree-6
// polynomial, within 2 ulp of exp over float32's range; exp(-inf) = 0, NaN stays NaN.
float exp_shifted_sum(float* x, int64_t n, float shift);
// x[i] = exp(x[i] - shift) * scale in place.
void exp_shifted_scaled(float* x, int64_t n, float shift, float scale);

// Elementwise steps of the tiles at 16 lanes, each element the same float32 operations as the scalar formula
// (so bit-equal with Eigen's): x[i] *= y[i] (dropout's scales), and dS in place of dP over rows x cols
// (row-major, stride cols): dS = 0 where P is 0 (an invisible value row may have made dP NaN there), else
// P * (dP - delta[r]); then dS *= d_tanh (the soft-cap's 1 - tanh^2) where d_tanh is not null.
void multiply(float* x, const float* y, int64_t n);
void softmax_grad(float* dp, const float* p, const float* d_tanh, const float* delta, int64_t rows, int64_t cols);
// One row of an attention mask read contiguously (bytes, nonzero = visible) over the columns [lo, hi) of a
// score row: s[c] = -inf where mask[c] is 0 (by replacement: a NaN score of an invisible key never
// survives), seen[c] |= 1 where it is not; returns whether any column in [lo, hi) is visible.
bool mask_row(float* s, const uint8_t* mask, uint8_t* seen, int64_t lo, int64_t hi);
// Logit soft-capping in place: t = tanh(x[i] * (1 / cap)), x[i] = t * cap, and d_tanh[i] = 1 - t * t (one FMA,
// fmaf(-t, t, 1): no contraction left to the compiler) where d_tanh is not null. tanh within 3 ulp of
// float32's (a Taylor series below 0.625, exp above), NaN stays NaN.
void softcap(float* x, int64_t n, float cap, float* d_tanh);

}  // namespace cpu_avx512

namespace cpu_avx512bf16 {

// The products of the AVX512_BF16 path, the forms and arguments of cpu_avx512's gemm_nn / gemm_tn /
// gemm_nt, with float32 operands rounded to bfloat16 (to nearest, ties to even: exact for values that are
// bfloat16 already, as the inputs of a bfloat16 call are) and multiplied in pairs along k by vdpbf16ps,
// accumulated in float32 at 16 lanes. The numerics are those of the GPU flash kernels on bfloat16: Q, K, V
// and dO enter unrounded (they are bfloat16), while P (after dropout's scaling) before P V and dV = P^T dO,
// and dS before dK = dS^T Q and dQ = dS K, are rounded to bfloat16; the scores, the softmax statistics, dP,
// dS itself and every accumulator stay float32. Each element of C is one chain over the pairs of k in
// order, each step one vdpbf16ps lane (its odd product added, then its even one, each rounded once: the
// products of bfloat16 values are exact in float32), then times alpha (or one FMA into C with accumulate):
// it depends on its own row and column only, so equal tiles give bit-equal results in the forward and the
// backward, and the backward stays deterministic. An odd k pairs its last element with 0.
// scratch holds scratch_words(m, n, k) words (packed pairs of A and B).
int64_t scratch_words(int64_t m, int64_t n, int64_t k);
void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch);
void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch);
void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float alpha,
             bool accumulate, float* c, int64_t ldc, uint32_t* scratch);

// The same products on AMX tiles (tdpbf16ps; the AMX path only, after cpu_has_amx_bf16): the operands packed
// alike, zero-padded to 32 rows and columns of C and 16 pairs of k, C in 32 x 32 blocks of four float32 tiles.
// Each element is one accumulator over the pairs of k in order, wherever its tile lies (the properties the
// forward and the backward rely on); the order of the two products within a pair is the hardware's.
// scratch holds amx_scratch_words(m, n, k) words. Each call loads the tile configuration and releases it.
int64_t amx_scratch_words(int64_t m, int64_t n, int64_t k);
void amx_gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch);
void amx_gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch);
void amx_gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float alpha, bool accumulate, float* c, int64_t ldc, uint32_t* scratch);

}  // namespace cpu_avx512bf16
}  // namespace tf_flash
