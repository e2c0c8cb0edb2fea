// The CPU kernel's path, chosen once per process (cpu_isa.h). Compiled with the AVX2 flags like the rest:
// only the *_avx512*.cc files hold AVX-512 code, and they run only where this says so.
#include "cc/kernels/cpu/cpu_isa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "cc/kernels/flash/launch.h"

namespace tf_flash {
namespace {

// The default: AMX where the CPU has it and Linux grants the tile state (bfloat16 inputs multiplied on AMX
// tiles, float32 and float16 as on AVX-512); vdpbf16ps where the CPU has AVX512_BF16 but no AMX; else AVX-512,
// else AVX2. The bfloat16 products' speed follows vdpbf16ps's rate against the FMAs': on a Xeon with AMX (half
// the FMA rate) the AMX products ran bfloat16 at 1.2-1.5x the float32 products and vdpbf16ps at 0.6-0.75x, so a
// CPU with AMX whose Linux refuses the tile state stays on AVX-512; on an AMD EPYC without AMX (twice the FMA
// rate) vdpbf16ps ran at 1.35-1.65x (docs/performance.md).
CpuIsa DefaultIsa() {
  if (cpu_has_amx_bf16()) return CpuIsa::kAvx512Amx;
  if (cpu_has_avx512_bf16() && !__builtin_cpu_supports("amx-bf16")) return CpuIsa::kAvx512Bf16;
  return cpu_has_avx512() ? CpuIsa::kAvx512 : CpuIsa::kAvx2;
}

CpuIsa ChooseIsa() {
  // TF_FLASH_CPU_ISA names a path to run where the CPU has it (every path testable on one host, and the
  // bfloat16 products comparable with the float32 ones); any other value, or none, takes the default.
  const CpuIsa default_isa = DefaultIsa();
  const char* forced = std::getenv("TF_FLASH_CPU_ISA");
  if (forced == nullptr) return default_isa;
  CpuIsa asked = default_isa;
  if (std::strcmp(forced, "avx2") == 0) asked = CpuIsa::kAvx2;
  if (std::strcmp(forced, "avx512") == 0) asked = CpuIsa::kAvx512;
  // The vdpbf16ps path wherever the CPU has AVX512_BF16, also where the default is AMX or AVX-512.
  if (std::strcmp(forced, "avx512_bf16") == 0) return cpu_has_avx512_bf16() ? CpuIsa::kAvx512Bf16 : default_isa;
  return static_cast<int>(asked) < static_cast<int>(default_isa) ? asked : default_isa;
}

}  // namespace

// libgcc's feature bits count AVX-512 only where the OS saves the zmm state too (XCR0's opmask and zmm
// bits), so a kernel without that support reads as AVX2.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// The same bits (AVX512_BF16 is CPUID leaf 7 subleaf 1, counted by libgcc only with the zmm state); BW and VL
// too, which -mavx512bf16 lets the compiler use in flash_attention_avx512bf16.cc.
bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// Linux hands the AMX tile data state (8 KiB per thread) only to processes that ask: ARCH_REQ_XCOMP_PERM
// (0x1023) for XFEATURE_XTILEDATA (18); without it the first tile instruction faults.
bool cpu_has_amx_bf16() {
  static const bool granted = cpu_has_avx512_bf16() && __builtin_cpu_supports("amx-tile") &&
                              __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = ChooseIsa();
  return isa;
}

const char* flash_cpu_isa_name() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512Amx: return "avx512_amx";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: break;
  }
  return "avx2";
}

}  // namespace tf_flash
