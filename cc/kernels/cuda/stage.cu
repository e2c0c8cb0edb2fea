// Staging copies for the GPU front doors: the attention kernels take float16/bfloat16 with head dims that
// are multiples of 8, so float32 tensors and other head dims go through a cast-and-pad copy on the way
// in and a cast-and-crop copy on the way out (O(N d) extra traffic against the O(N^2 d) attention).
// float32 is scaled by powers of two on the way (the plan, launch.h) so that it keeps float32's range.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "cc/kernels/flash/launch.h"

namespace tf_flash {
namespace {

template <typename T> __device__ __forceinline__ float load_as_float(const void* base, int64_t i);
template <> __device__ __forceinline__ float load_as_float<float>(const void* base, int64_t i) {
  return static_cast<const float*>(base)[i];
}
template <> __device__ __forceinline__ float load_as_float<__half>(const void* base, int64_t i) {
  return __half2float(static_cast<const __half*>(base)[i]);
}
template <> __device__ __forceinline__ float load_as_float<__nv_bfloat16>(const void* base, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

template <typename T> __device__ __forceinline__ void store_float(void* base, int64_t i, float x);
template <> __device__ __forceinline__ void store_float<float>(void* base, int64_t i, float x) {
  static_cast<float*>(base)[i] = x;
}
template <> __device__ __forceinline__ void store_float<__half>(void* base, int64_t i, float x) {
  // Finite values saturate (a plan's power of two brings the largest into [2, 4); this is the safety).
  if (fabsf(x) <= FLT_MAX) x = fminf(fmaxf(x, -65504.f), 65504.f);
  static_cast<__half*>(base)[i] = __float2half_rn(x);
}
template <> __device__ __forceinline__ void store_float<__nv_bfloat16>(void* base, int64_t i, float x) {
  static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
}

// x * 2^exponent: one exact multiply while 2^exponent is a normal float, ldexpf beyond.
struct Pow2 {
  int exponent;
  float factor;
  __device__ explicit Pow2(int e) : exponent(e), factor(e >= -126 && e <= 127 ? ldexpf(1.f, e) : 0.f) {}
  __device__ __forceinline__ float operator()(float x) const { return factor != 0.f ? x * factor : ldexpf(x, exponent); }
};

__device__ __forceinline__ Pow2 plan_power(const StagePlan* plan, StageRole role) {
  return Pow2(plan != nullptr ? plan->exponent[int(role)] : 0);
}

// Rows that need no padding or cropping (src_dim == dst_dim) are one flat array: 8 consecutive elements
// per thread, loaded and stored as 16- or 32-byte vectors (the launch checks the alignment).
template <typename T>
struct alignas(8 * sizeof(T)) Vec8 {
  T x[8];
};

template <typename Src, typename Dst>
__global__ void stage_flat_kernel(const Vec8<Src>* src, Vec8<Dst>* dst, int64_t vectors, const StagePlan* plan,
                                  StageRole role) {
  const Pow2 power = plan_power(plan, role);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Vec8<Src> in = src[i];
    Vec8<Dst> out;
    for (int j = 0; j < 8; ++j) store_float<Dst>(out.x, j, power(load_as_float<Src>(in.x, j)));
    dst[i] = out;
  }
}

// dst[r, c] = src[r, c] * 2^exponent for c < min(src_dim, dst_dim), 0 for the padding columns; rows are
// contiguous. One warp-row of the block (threadIdx.y) per row, its lanes over the columns.
template <typename Src, typename Dst>
__global__ void stage_rows_kernel(const void* src, int src_dim, void* dst, int dst_dim, int64_t rows,
                                  const StagePlan* plan, StageRole role) {
  const Pow2 power = plan_power(plan, role);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    for (int col = threadIdx.x; col < dst_dim; col += blockDim.x) {
      const float x = col < src_dim ? load_as_float<Src>(src, row * src_dim + col) : 0.f;
      store_float<Dst>(dst, row * dst_dim + col, power(x));
    }
  }
}

int grid_blocks(int64_t total, int threads) {
  const int64_t wanted = (total + threads - 1) / threads;
  return static_cast<int>(wanted < 65535 * 8 ? wanted : 65535 * 8);
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename Src, typename Dst>
cudaError_t launch_stage(const void* src, int src_dim, void* dst, int dst_dim, int64_t rows, const StagePlan* plan,
                         StageRole role, cudaStream_t stream) {
  const int64_t total = rows * dst_dim;
  if (src_dim == dst_dim && total % 8 == 0 && aligned(src, sizeof(Vec8<Src>)) && aligned(dst, sizeof(Vec8<Dst>))) {
    const int64_t vectors = total / 8;
    stage_flat_kernel<Src, Dst><<<grid_blocks(vectors, 256), 256, 0, stream>>>(
        static_cast<const Vec8<Src>*>(src), static_cast<Vec8<Dst>*>(dst), vectors, plan, role);
  } else {
    const dim3 block(32, 8);
    stage_rows_kernel<Src, Dst><<<grid_blocks(rows, 8), block, 0, stream>>>(src, src_dim, dst, dst_dim, rows, plan, role);
  }
  return cudaGetLastError();
}

template <typename Src>
cudaError_t launch_for_dst(const void* src, int src_dim, void* dst, DType dst_type, int dst_dim, int64_t rows,
                           const StagePlan* plan, StageRole role, cudaStream_t stream) {
  switch (dst_type) {
    case DType::kFloat32: return launch_stage<Src, float>(src, src_dim, dst, dst_dim, rows, plan, role, stream);
    case DType::kFloat16: return launch_stage<Src, __half>(src, src_dim, dst, dst_dim, rows, plan, role, stream);
    case DType::kBFloat16:
      return launch_stage<Src, __nv_bfloat16>(src, src_dim, dst, dst_dim, rows, plan, role, stream);
    case DType::kFloat8E4M3: return cudaErrorInvalidValue;  // fp8 inputs are never staged
  }
  return cudaSuccess;
}

// Largest finite |x| of input blockIdx.y into plan->magnitude_bits (zeroed before): NaN and Inf, which
// may sit in positions no query sees, must not choose the scale of the finite values.
__global__ void magnitudes_kernel(const __grid_constant__ StageInputs in, StagePlan* plan) {
  const int t = blockIdx.y;
  const float* data = static_cast<const float*>(in.data[t]);
  float largest = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < in.size[t];
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float a = fabsf(data[i]);
    if (a <= FLT_MAX) largest = fmaxf(largest, a);
  }
  for (int offset = 16; offset > 0; offset /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  if (threadIdx.x % 32 == 0 && largest > 0.f) atomicMax(&plan->magnitude_bits[t], __float_as_uint(largest));
}

// The powers of two of launch.h's plan from the magnitudes: each input to a largest magnitude in [2, 4).
__global__ void plan_kernel(StagePlan* plan) {
  int e[StagePlan::kInputs];  // largest magnitude in [2^(e-1), 2^e); 2 when all zero (left as is)
  for (int t = 0; t < StagePlan::kInputs; ++t) {
    e[t] = 2;
    const float largest = __uint_as_float(plan->magnitude_bits[t]);
    if (largest > 0.f) frexpf(largest, &e[t]);
  }
  const int nq = e[0] - 2, nk = e[1] - 2, ndo = e[3] - 2;
  // d_lse takes dP's 2^-(ndo + nv): where it would pass 4 there, V (and O) shrink further instead of dO,
  // which dV needs whole; what V then loses is small beside d_lse in dS.
  int nv = e[2] - 2;
  if (plan->magnitude_bits[4] != 0u && e[4] - 2 - ndo > nv) nv = e[4] - 2 - ndo;
  int32_t* x = plan->exponent;
  x[int(StageRole::kQuery)] = -nq;
  x[int(StageRole::kKey)] = -nk;
  x[int(StageRole::kValue)] = -nv;
  x[int(StageRole::kOutGrad)] = -ndo;
  x[int(StageRole::kLseGrad)] = -(ndo + nv);
  x[int(StageRole::kOutput)] = nv;
  x[int(StageRole::kValueGrad)] = ndo;
  x[int(StageRole::kQueryGrad)] = ndo + nv + nk;
  x[int(StageRole::kKeyGrad)] = ndo + nv + nq;
  plan->scale_exponent = nq + nk;
}

}  // namespace

int flash_cuda_stage_plan(const StageInputs& inputs, StagePlan* plan, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  StageInputs in = inputs;
  int64_t largest = 0;
  for (int t = 0; t < StagePlan::kInputs; ++t) {
    if (in.data[t] == nullptr) in.size[t] = 0;
    largest = in.size[t] > largest ? in.size[t] : largest;
  }
  cudaError_t err = cudaMemsetAsync(plan->magnitude_bits, 0, sizeof(plan->magnitude_bits), stream);
  if (err != cudaSuccess) return int(err);
  const int threads = 256;
  const int blocks = std::min(grid_blocks(largest, threads), 1024);
  if (blocks > 0) magnitudes_kernel<<<dim3(blocks, StagePlan::kInputs), threads, 0, stream>>>(in, plan);
  plan_kernel<<<1, 1, 0, stream>>>(plan);
  return int(cudaGetLastError());
}

int flash_cuda_stage_rows(const void* src, DType src_type, int src_dim, void* dst, DType dst_type, int dst_dim,
                          int64_t rows, const StagePlan* plan, StageRole role, void* stream_handle) {
  if (rows * dst_dim == 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  switch (src_type) {
    case DType::kFloat32:
      return launch_for_dst<float>(src, src_dim, dst, dst_type, dst_dim, rows, plan, role, stream);
    case DType::kFloat16:
      return launch_for_dst<__half>(src, src_dim, dst, dst_type, dst_dim, rows, plan, role, stream);
    case DType::kBFloat16:
      return launch_for_dst<__nv_bfloat16>(src, src_dim, dst, dst_type, dst_dim, rows, plan, role, stream);
    case DType::kFloat8E4M3: return int(cudaErrorInvalidValue);  // fp8 inputs are never staged
  }
  return 0;
}

}  // namespace tf_flash
