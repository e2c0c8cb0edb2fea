// Tile-shape variants of the forward kernel for the harness's `tiles` benchmark (bf16, plain variant
// only): the same kernel source with other (block M, block N, warps), to choose
// FwdConfig by measurement. build.sh compiles this file once per variant (-DTF_FLASH_VARIANT=i, in
// parallel) and once with -DTF_FLASH_VARIANT_REGISTRY for the name table.
#include <cuda_runtime.h>

#include <cstring>

#include "cc/kernels/flash/params.h"

// name, head dim, block M, block N, warps. (A serial softmax and a min-blocks-per-SM bound measure slower or
// equal, so no variant offers them.)
#define TF_FLASH_FWD_VARIANTS(X)             \
  X(0, "d128_128x64x4", 128, 128, 64, 4)     \
  X(1, "d128_128x128x8", 128, 128, 128, 8)   \
  X(2, "d64_128x128x4", 64, 128, 128, 4)     \
  X(3, "d256_128x64x8", 256, 128, 64, 8)

#define TF_FLASH_DECLARE(i, name, d, m, n, w) int fwd_variant_##i(const tf_flash::FlashFwdParams& p);
TF_FLASH_FWD_VARIANTS(TF_FLASH_DECLARE)

#if defined(TF_FLASH_VARIANT_REGISTRY)
const char* const* fwd_variant_names() {
#define TF_FLASH_NAME(i, name, d, m, n, w) name,
  static const char* const names[] = {TF_FLASH_FWD_VARIANTS(TF_FLASH_NAME) nullptr};
  return names;
}
int run_fwd_variant(const char* name, const tf_flash::FlashFwdParams& p) {
#define TF_FLASH_CALL(i, vname, d, m, n, w) \
  if (!std::strcmp(name, vname)) return fwd_variant_##i(p);
  TF_FLASH_FWD_VARIANTS(TF_FLASH_CALL)
  return -1;
}
#elif defined(TF_FLASH_VARIANT)
#include "cc/kernels/cuda/fwd_kernel.h"

namespace {
template <class Traits>
int launch(const tf_flash::FlashFwdParams& p) {
  auto kernel = &tf_flash::cuda::flash_fwd_kernel<Traits, false, false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  if (e != cudaSuccess) return int(e);
  const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.num_heads, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes>>>(p);
  return int(cudaGetLastError());
}
}  // namespace

template <int I>
struct VariantTraits;
#define TF_FLASH_TRAITS(i, name, d, m, n, w) \
  template <>                                          \
  struct VariantTraits<i> {                            \
    using type = tf_flash::cuda::FwdTraits<d, m, n, w, cutlass::bfloat16_t>; \
  };
TF_FLASH_FWD_VARIANTS(TF_FLASH_TRAITS)

#define TF_FLASH_CAT2(a, b) a##b
#define TF_FLASH_CAT(a, b) TF_FLASH_CAT2(a, b)
// Only variant TF_FLASH_VARIANT is instantiated in this object.
int TF_FLASH_CAT(fwd_variant_, TF_FLASH_VARIANT)(const tf_flash::FlashFwdParams& p) {
  return launch<typename VariantTraits<TF_FLASH_VARIANT>::type>(p);
}
#endif
