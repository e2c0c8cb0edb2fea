// The run-time choice of kernel family (family.h) and the launch counts of launch.h's flash_cuda_kernel_counts.
// Nothing here includes CuTe: the Hopper kernels' tiles come from sm90_tile_size.h.
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/cuda/packed_mask.h"
#include "cc/kernels/cuda/sm90_tile_size.h"
#include "cc/kernels/cuda/static_switch.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/mask.h"

namespace tf_flash {
namespace cuda {

std::atomic<int64_t> forward_sm80_launches{0}, forward_sm90_launches{0}, backward_sm80_launches{0},
    backward_sm90_launches{0}, forward_float32_launches{0}, backward_float32_launches{0};

namespace {

// A device attribute of the current device, read once per device.
template <cudaDeviceAttr kAttribute>
int device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> values[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  int value = values[device].load(std::memory_order_relaxed);
  if (value == 0) {
    if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) return 0;
    values[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

// Compiled with the library's own targets: where it runs from sm_90a machine code, so do the Hopper kernels
// (their bodies exist only in that code).
__global__ void sm90a_code_probe() {}

// The Hopper family may run: an sm_90 GPU, sm_90a code in this library, and no TF_FLASH_CUDA_FAMILY=sm80 (for
// comparisons and bisecting, read when the process first asks).
bool hopper_family_available() {
  static const bool allowed = [] {
    const char* choice = std::getenv("TF_FLASH_CUDA_FAMILY");
    return choice == nullptr || std::strcmp(choice, "sm80") != 0;
  }();
  static const bool has_code = [] {
    cudaFuncAttributes attributes;
    if (cudaFuncGetAttributes(&attributes, sm90a_code_probe) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion == 90 && attributes.ptxVersion == 90;
  }();
  return allowed && has_code && device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9;
}

// fp8 (element_bytes 1) rounds up to the Hopper head dims; 16-bit inputs of other head dims run in the sm_80 family.
int hopper_kernel_headdim(const FlashFwdParams& p, int element_bytes) {
  if (element_bytes == 1) return tf_flash_fp8_kernel_headdim(p);
  const int d = tf_flash_kernel_headdim(p);
  return TF_FLASH_HEADDIM_SM90(d) ? d : 0;
}

}  // namespace

bool hopper_forward_takes(const FlashFwdParams& p, bool workspace_counted, int element_bytes) {
  // Keys to attend to (a TMA descriptor has no empty dimension).
  if (p.seqlen_k <= 0 || hopper_kernel_headdim(p, element_bytes) == 0 || !hopper_family_available()) return false;
  // attn_mask and segment ids are each a variant's element mask (ElementMask); both in one call run in the
  // sm_80 family, which reads them together.
  if (p.attn_mask.data != nullptr && has_segments(p)) return false;
  const int head_dim = hopper_kernel_headdim(p, element_bytes);
  const Sm90ForwardShape shape = sm90_forward_shape(p);
  const Sm90ForwardTiles tiles = sm90_forward_tiles(head_dim, shape, element_bytes);
  // Block masks whose blocks hold whole tiles, so that a tile is shown or hidden whole (finer blocks need the
  // sm_80 family's element-wise check).
  if (p.block_mask.data != nullptr && (p.block_q % tiles.block_m() != 0 || p.block_k % tiles.block_n != 0))
    return false;
  const bool tile_table = p.block_mask.data != nullptr || p.attn_mask.data != nullptr || has_segments(p);
  if (p.attn_mask.data != nullptr) {
    const PackedMaskLayout layout(p, MaskPacking::kForward);
    if (!layout.packable(p) || (workspace_counted && p.mask_workspace == nullptr)) return false;
  }
  if (tile_table) {  // a byte per key tile and the consumers' words of seen keys (and the documents' key tiles),
                     // after the shared storage (launch_flash_fwd_sm90)
    const int64_t smem = sm90_forward_smem_bytes(head_dim, shape, element_bytes, /*output_bytes=*/2) +
                         sm90_forward_table_bytes(tiles.consumers, tiles.block_n, p.seqlen_k, has_segments(p));
    if (smem > device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>()) return false;
  }
  // A CTA per query tile where the launcher gives each its own (sm90_forward_cta_per_tile): a 1-D grid.
  if (sm90_forward_cta_per_tile(p) || device_sm_count() == 0) {
    const int64_t tiles_total = (int64_t(p.seqlen_q) + tiles.block_m() - 1) / tiles.block_m() * p.batch * p.num_heads;
    if (tiles_total > INT_MAX) return false;
  }
  return true;
}

std::string hopper_fp8_forward_refusal(const FlashFwdParams& p) {
  if (hopper_forward_takes(p, /*workspace_counted=*/false, 1)) return "";
  const std::string what = "FP8 (float8_e4m3fn) inputs run on the Hopper forward only";
  // No keys: nothing to compute (flash_fwd_cuda writes O 0 and lse -inf), taken where the fp8 forward runs, so that
  // whether a call runs never depends on its key count.
  if (p.seqlen_k == 0 && hopper_family_available() && hopper_kernel_headdim(p, 1) != 0) return "";
  if (!hopper_family_available()) {
    const int major = device_attribute<cudaDevAttrComputeCapabilityMajor>();
    const int minor = device_attribute<cudaDevAttrComputeCapabilityMinor>();
    return what + ", which needs a Hopper GPU (sm_90) and a library built with sm_90a code, and " +
           "TF_FLASH_CUDA_FAMILY not set to sm80 (received a GPU of compute capability " + std::to_string(major) +
           "." + std::to_string(minor) + ")";
  }
  if (hopper_kernel_headdim(p, 1) == 0)
    return what + ", whose head dims are 64, 128 and 256 where compiled (smaller ones run in the next larger; received "
           "head_dim=" + std::to_string(p.head_dim) + ", head_dim_v=" + std::to_string(p.head_dim_v) + ")";
  if (p.attn_mask.data != nullptr && has_segments(p))
    return what + ", which takes attention_mask or segment_ids, not both in one call";
  if (p.block_mask.data != nullptr) {
    const Sm90ForwardTiles tiles = sm90_forward_tiles(hopper_kernel_headdim(p, 1), sm90_forward_shape(p), 1);
    return what + ", which takes block masks whose blocks are multiples of its tiles (" +
           std::to_string(tiles.block_m()) + " query rows, " + std::to_string(tiles.block_n) +
           " keys; received block_q=" + std::to_string(p.block_q) + ", block_k=" + std::to_string(p.block_k) + ")";
  }
  return what + ", which does not take these inputs (attention_mask too large to pack, or too many query tiles "
         "for one grid: seqlen_q=" + std::to_string(p.seqlen_q) + ", seqlen_k=" + std::to_string(p.seqlen_k) + ")";
}

bool hopper_backward_takes(const FlashFwdParams& p) {
  if (p.seqlen_q <= 0 || p.seqlen_k <= 0 || hopper_kernel_headdim(p, 2) == 0 || !hopper_family_available())
    return false;
  // Block masks (the general variant's tiles) whose blocks hold whole tiles.
  const int head_dim = tf_flash_kernel_headdim(p);
  const Sm90BackwardTiles tiles = sm90_backward_tiles(head_dim, /*plain=*/false);
  if (p.block_mask.data != nullptr && (p.block_q % tiles.block_m != 0 || p.block_k % tiles.block_n != 0))
    return false;
  if (has_segments(p)) {
    // Segment ids are a variant's element mask (ElementMask), whose table of query tiles holds the documents'
    // coverage only: with attn_mask or a block mask they run in the sm_80 family, which reads them together.
    if (p.attn_mask.data != nullptr || p.block_mask.data != nullptr) return false;
    // With segment ids that do not increase along the row, the kernel can hang when its CTAs run several key
    // tiles in turn (the deterministic dQ; seen at head dims 128 and 256); the cause is not found yet, and the
    // host cannot tell sorted ids from others without a sync, so deterministic calls with segment ids run in the
    // sm_80 family.
    if (p.deterministic) return false;
    // The words of a border tile's seen query rows and a byte per query tile, after the shared storage
    // (bwd_launch_sm90.h); at head dim 256 that storage leaves room for about 64k queries.
    const int64_t smem = sm90_backward_smem_bytes(head_dim, /*plain=*/false, 2) +
                         sm90_backward_table_bytes(tiles.block_m, p.seqlen_q);
    if (smem > device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>()) return false;
  }
  // attn_mask is packed into the backward's scratch (bwd_launch.h: bwd_mask_bytes, sized by this predicate).
  return p.attn_mask.data == nullptr || PackedMaskLayout(p, MaskPacking::kBackward).packable(p);
}

KernelFamily choose_family(const FlashFwdParams& p, DType dtype, Direction direction) {
  if (dtype == DType::kFloat32) return KernelFamily::kFloat32;
  // fp8: the Hopper forward or nothing (check_supported refused what it does not take).
  if (dtype == DType::kFloat8E4M3) return KernelFamily::kSm90;
  const bool hopper = direction == Direction::kForward ? hopper_forward_takes(p) : hopper_backward_takes(p);
  return hopper ? KernelFamily::kSm90 : KernelFamily::kSm80;
}

int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

}  // namespace cuda

CudaKernelCounts flash_cuda_kernel_counts() {
  return CudaKernelCounts{cuda::forward_sm80_launches.load(),    cuda::forward_sm90_launches.load(),
                          cuda::backward_sm80_launches.load(),   cuda::backward_sm90_launches.load(),
                          cuda::forward_float32_launches.load(), cuda::backward_float32_launches.load()};
}

}  // namespace tf_flash
