// Elementwise dtype conversion on the GPU, for the ops' float32 path: the CUDA attention kernels take
// float16/bfloat16 only, so a float32 call converts q/k/v (and d_out) to bfloat16 in temporaries from
// the framework's allocator, runs the bfloat16 kernels (fp32 accumulation), and converts the results
// back. Precision is then that of bfloat16 inputs (relative error ~1e-2 against float64, versus ~1e-3
// for TF32 matmuls); documented, never silent. Framework-free: declared without CUDA types.
#pragma once

#include <cstdint>

#include "cc/kernels/flash/launch.h"

namespace tf_flash {

// dst[i] = convert(src[i]) for i in [0, n), contiguous, on `stream` (a cudaStream_t). Supported pairs:
// float32 -> float16/bfloat16 (round to nearest even) and float16/bfloat16 -> float32; same dtype copies.
// Returns a cudaError_t as int (0 = success); see flash_cuda_error_string.
int flash_cuda_convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, void* stream);

}  // namespace tf_flash
