// The CPU kernel's instruction-set paths and the AVX-512 micro-kernels' interface.
//
// The AVX2 path is flash_attention_cpu.cc as compiled (-mavx2 -mfma: Eigen's GEMM and exp). The AVX-512
// path runs the same tile loops and swaps in the functions declared below for the products and the
// softmax's exp. Those live in flash_attention_avx512.cc, the only file compiled with AVX-512 flags
// (files named *_avx512.cc: cc/BUILD, tools/gpu.sh host). That file holds no Eigen, no std and nothing
// inline or templated with external linkage, so no function the linker may merge across files (a COMDAT)
// carries AVX-512 code into an AVX2 caller; tests/test_cpu_isa.py checks the object and the library.
// This header declares plain functions only, for the same reason.
#pragma once

#include <cstdint>

namespace tf_flash {

enum class CpuIsa { kAvx2, kAvx512 };

// The path this process runs, chosen once, at the first call: AVX-512 where the CPU and the OS have it
// (AVX512F and the zmm state), unless TF_FLASH_CPU_ISA=avx2 in the environment asks for the AVX2 path.
CpuIsa cpu_isa();

// Whether the CPU could run the AVX-512 path (whatever TF_FLASH_CPU_ISA says).
bool cpu_has_avx512();

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
// x[i] = exp(x[i] - shift) in place; returns their sum. exp: Cody-Waite reduction and a degree-7
// polynomial, within 2 ulp of exp over float32's range; exp(-inf) = 0, NaN stays NaN.
float exp_shifted_sum(float* x, int64_t n, float shift);
// x[i] = exp(x[i] - shift) * scale in place.
void exp_shifted_scaled(float* x, int64_t n, float shift, float scale);

}  // namespace cpu_avx512
}  // namespace tf_flash
