// Tile-shape variants of the forward kernel for the harness's `tiles` benchmark (bf16, plain variant
// only): the same kernel source with other (block M, block N, warps), to choose FwdConfig by measurement.
#include <cuda_runtime.h>

#include <cstring>

#include "cc/kernels/cuda/fwd_kernel.h"

namespace {

template <class Traits>
int launch(const tf_flash::FlashFwdParams& p) {
  auto kernel = &tf_flash::cuda::flash_fwd_kernel<Traits, false>;
  if (Traits::kSmemBytes > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (e != cudaSuccess) return int(e);
  }
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.num_heads, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes>>>(p);
  return int(cudaGetLastError());
}

using E = cutlass::bfloat16_t;
template <int D, int M, int N, int W>
using T = tf_flash::cuda::FwdTraits<D, M, N, W, E>;

}  // namespace

// Names "d<head dim>_<M>x<N>x<warps>"; returns -1 for an unknown name.
const char* const* fwd_variant_names() {
  static const char* const names[] = {"d64_128x64x4", "d64_128x128x8", "d128_128x128x8", "d128_128x32x4", nullptr};
  return names;
}

int run_fwd_variant(const char* name, const tf_flash::FlashFwdParams& p) {
  if (!std::strcmp(name, "d64_128x64x4")) return launch<T<64, 128, 64, 4>>(p);
  if (!std::strcmp(name, "d64_128x128x8")) return launch<T<64, 128, 128, 8>>(p);
  if (!std::strcmp(name, "d128_128x128x8")) return launch<T<128, 128, 128, 8>>(p);
  if (!std::strcmp(name, "d128_128x32x4")) return launch<T<128, 128, 32, 4>>(p);
  return -1;
}
