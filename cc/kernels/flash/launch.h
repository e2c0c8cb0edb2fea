// Entry points of the framework-free kernels. The OpKernels (cc/kernels/flash_attention_kernels.cc)
// fill a params struct and call one of these; nothing below them sees TensorFlow.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "cc/kernels/flash/params.h"

namespace tf_flash {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// ---- CPU (cc/kernels/cpu/) ----
// Runs work(begin, end) over [0, total) on the caller's thread pool; cost_per_unit is a rough cycle count.
using ParallelFor = std::function<void(int64_t total, int64_t cost_per_unit,
                                       const std::function<void(int64_t, int64_t)>& work)>;

void flash_fwd_cpu(const FlashFwdParams& params, DType dtype, const ParallelFor& parallel_for);

// Bytes of float32 scratch the CPU backward wants in params.scratch (dQ partial sums and D = rowsum(dO*O)).
int64_t flash_bwd_cpu_scratch_bytes(const FlashBwdParams& params, int num_threads);
void flash_bwd_cpu(const FlashBwdParams& params, DType dtype, int num_threads, const ParallelFor& parallel_for);

// ---- CUDA (cc/kernels/cuda/), compiled only with nvcc; stream is a cudaStream_t ----
// What each device supports is stated in one place per device: the CPU kernels run every input that
// FillParams (cc/kernels/flash_attention_params.cc) accepts, which also holds the argument rules common to
// both devices (scale finite and >= 0, window, block sizes, dropout rate, lengths); the CUDA kernels add
// the limits of cuda::check_supported (cc/kernels/cuda/support.cu): dtypes, head dims, strides, grid size.
enum class Direction { kForward, kBackward };
namespace cuda {
// Empty string when the CUDA kernels of `direction` (the backward needs the forward's too) run these
// params, else the reason, naming the value received.
std::string check_supported(const FlashFwdParams& params, DType dtype, Direction direction);
}  // namespace cuda
int64_t flash_bwd_cuda_scratch_bytes(const FlashBwdParams& params);
// Return a cudaError_t as int (0 = success) so this header needs no CUDA include.
int flash_fwd_cuda(const FlashFwdParams& params, DType dtype, void* stream);
int flash_bwd_cuda(const FlashBwdParams& params, DType dtype, void* stream);
const char* flash_cuda_error_string(int error);
// Kernel launches of this process by family (the Hopper family on sm_90 GPUs for the params it takes,
// else sm_80's; cc/kernels/cuda/family.h): what tests read to prove which kernels ran.
struct CudaKernelCounts {
  int64_t forward_sm80 = 0, forward_sm90 = 0, backward_sm80 = 0, backward_sm90 = 0;
};
CudaKernelCounts flash_cuda_kernel_counts();
// Copies `rows` contiguous rows of src_dim elements into rows of dst_dim elements (cropping, or padding
// with zeros), converting the element type: how float32 and head dims that are not multiples of 8 reach
// the float16/bfloat16 kernels.
int flash_cuda_stage_rows(const void* src, DType src_type, int src_dim, void* dst, DType dst_type, int dst_dim,
                          int64_t rows, void* stream);

}  // namespace tf_flash
