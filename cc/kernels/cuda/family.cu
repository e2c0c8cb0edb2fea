// The run-time choice of kernel family (family.h) and the launch counts of launch.h's
// flash_cuda_kernel_counts.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cc/kernels/cuda/family.h"
#include "cc/kernels/flash/launch.h"

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

}  // namespace

bool hopper_family_allowed() {
  static const bool allowed = [] {
    const char* choice = std::getenv("TF_FLASH_CUDA_FAMILY");
    return choice == nullptr || std::strcmp(choice, "sm80") != 0;
  }();
  return allowed && device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9;
}

int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

}  // namespace cuda

CudaKernelCounts flash_cuda_kernel_counts() {
  return CudaKernelCounts{cuda::forward_sm80_launches.load(),    cuda::forward_sm90_launches.load(),
                          cuda::backward_sm80_launches.load(),   cuda::backward_sm90_launches.load(),
                          cuda::forward_float32_launches.load(), cuda::backward_float32_launches.load()};
}

}  // namespace tf_flash
