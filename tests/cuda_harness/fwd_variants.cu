// Tile-shape variants of the forward kernel for the harness's `tiles` benchmark (bf16, plain variant
// only): the same kernel source with other (block M, block N, warps, min blocks per SM), to choose
// FwdConfig by measurement. build.sh compiles this file once per variant (-DTF_FLASH_VARIANT=i, in
// parallel) and once with -DTF_FLASH_VARIANT_REGISTRY for the name table.
#include <cuda_runtime.h>

#include <cstring>

#include "cc/kernels/flash/params.h"

// name, head dim, block M, block N, warps, min blocks per SM
#define TF_FLASH_FWD_VARIANTS(X)       \
  X(0, "d128_128x64x4", 128, 128, 64, 4, 1)   \
  X(1, "d128_128x128x8", 128, 128, 128, 8, 1) \
  X(2, "d128_128x128x8_mb2", 128, 128, 128, 8, 2) \
  X(3, "d128_64x64x4", 128, 64, 64, 4, 1)     \
  X(4, "d128_128x64x8", 128, 128, 64, 8, 1)   \
  X(5, "d128_64x128x4", 128, 64, 128, 4, 1)   \
  X(6, "d64_128x128x4", 64, 128, 128, 4, 1)   \
  X(7, "d64_64x128x4", 64, 64, 128, 4, 1)     \
  X(8, "d64_128x128x8", 64, 128, 128, 8, 2)   \
  X(9, "d256_128x64x8", 256, 128, 64, 8, 1)   \
  X(10, "d256_64x64x4", 256, 64, 64, 4, 1)    \
  X(11, "d256_128x32x8", 256, 128, 32, 8, 1)

#define TF_FLASH_DECLARE(i, name, d, m, n, w, mb) int fwd_variant_##i(const tf_flash::FlashFwdParams& p);
TF_FLASH_FWD_VARIANTS(TF_FLASH_DECLARE)

#if defined(TF_FLASH_VARIANT_REGISTRY)
const char* const* fwd_variant_names() {
#define TF_FLASH_NAME(i, name, d, m, n, w, mb) name,
  static const char* const names[] = {TF_FLASH_FWD_VARIANTS(TF_FLASH_NAME) nullptr};
  return names;
}
int run_fwd_variant(const char* name, const tf_flash::FlashFwdParams& p) {
#define TF_FLASH_CALL(i, vname, d, m, n, w, mb) \
  if (!std::strcmp(name, vname)) return fwd_variant_##i(p);
  TF_FLASH_FWD_VARIANTS(TF_FLASH_CALL)
  return -1;
}
#elif defined(TF_FLASH_VARIANT)
#include "cc/kernels/cuda/fwd_kernel.h"

namespace {
template <class Traits>
int launch(const tf_flash::FlashFwdParams& p) {
  auto kernel = &tf_flash::cuda::flash_fwd_kernel<Traits, false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (e != cudaSuccess) return int(e);
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.num_heads, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes>>>(p);
  return int(cudaGetLastError());
}
}  // namespace

template <int I>
struct VariantTraits;
#define TF_FLASH_TRAITS(i, name, d, m, n, w, mb) \
  template <>                                     \
  struct VariantTraits<i> {                       \
    using type = tf_flash::cuda::FwdTraits<d, m, n, w, cutlass::bfloat16_t, mb>; \
  };
TF_FLASH_FWD_VARIANTS(TF_FLASH_TRAITS)

#define TF_FLASH_CAT2(a, b) a##b
#define TF_FLASH_CAT(a, b) TF_FLASH_CAT2(a, b)
// Only variant TF_FLASH_VARIANT is instantiated in this object.
int TF_FLASH_CAT(fwd_variant_, TF_FLASH_VARIANT)(const tf_flash::FlashFwdParams& p) {
  return launch<typename VariantTraits<TF_FLASH_VARIANT>::type>(p);
}
#endif
