// The CPU kernel's path, chosen once per process (cpu_isa.h). Compiled with the AVX2 flags like the rest:
// only flash_attention_avx512.cc holds AVX-512 code, and it runs only where this says so.
#include "cc/kernels/cpu/cpu_isa.h"

#include <cstdlib>
#include <cstring>

#include "cc/kernels/flash/launch.h"

namespace tf_flash {
namespace {

CpuIsa ChooseIsa() {
  // TF_FLASH_CPU_ISA=avx2 runs the AVX2 path on an AVX-512 machine (both paths testable on one host);
  // any other value, or none, takes the widest path the CPU has.
  const char* forced = std::getenv("TF_FLASH_CPU_ISA");
  if (forced != nullptr && std::strcmp(forced, "avx2") == 0) return CpuIsa::kAvx2;
  return cpu_has_avx512() ? CpuIsa::kAvx512 : CpuIsa::kAvx2;
}

}  // namespace

// libgcc's feature bits count AVX-512 only where the OS saves the zmm state too (XCR0's opmask and zmm
// bits), so a kernel without that support reads as AVX2.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = ChooseIsa();
  return isa;
}

const char* flash_cpu_isa_name() { return cpu_isa() == CpuIsa::kAvx512 ? "avx512" : "avx2"; }

}  // namespace tf_flash
