// The driver functions CuTe calls on the host, each resolved once per process.
//
// CUTLASS's default wrapper asks the runtime for the driver's entry point at every call
// (cudaGetDriverEntryPointByVersion), and CuTe builds four TMA descriptors per Hopper forward launch (five
// per backward): a lookup by name each time, on the launch's host path. The library is compiled with
// CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL (cc/BUILD, tools/gpu.sh), so CuTe calls the function by its own name,
// defined here around a pointer looked up at the first call. The library does not link libcuda (it loads on
// machines without a driver), and the symbol stays hidden: no other library resolves to it.
#include <cuda.h>
#include <cuda_runtime.h>

namespace {

using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

EncodeTiled encode_tiled_entry() {
  static const EncodeTiled entry = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    // 12000: the version whose signature cuda.h declares (CUTLASS asks for the same).
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return EncodeTiled(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(function);
  }();
  return entry;
}

}  // namespace

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* global_address,
    const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
  const EncodeTiled encode = encode_tiled_entry();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(tensor_map, data_type, rank, global_address, global_dim, global_strides, box_dim, element_strides,
                interleave, swizzle, l2_promotion, oob_fill);
}
