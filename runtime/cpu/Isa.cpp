//===- Isa.cpp - Instruction sets of the CPU kernels ----------------------===//

#include "megaslide/runtime/cpu/Isa.h"
#include "megaslide/runtime/cpu/WorkerPool.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

using namespace megaslide::cpu;

namespace {

CpuIsa detect() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // libgcc and compiler-rt also check that the OS saves the wider registers.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return CpuIsa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return CpuIsa::Avx2;
#endif
  return CpuIsa::Generic;
}

/// MEGASLIDE_CPU_ISA, parsed once.
struct Setting {
  CpuIsa cap = CpuIsa::Avx512;
  std::string error;
};

const Setting &setting() {
  static const Setting parsed = [] {
    Setting s;
    const char *env = std::getenv("MEGASLIDE_CPU_ISA");
    if (!env)
      return s;
    for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
      if (std::strcmp(env, cpuIsaName(isa)) == 0) {
        s.cap = isa;
        return s;
      }
    s.error = std::string("MEGASLIDE_CPU_ISA is '") + env +
              "'; use generic, avx2 or avx512 (or leave it unset for the "
              "best this CPU has)";
    return s;
  }();
  return parsed;
}

} // namespace

CpuIsa megaslide::cpu::cpuBestIsa() {
  static const CpuIsa best = detect();
  return best;
}

CpuIsa megaslide::cpu::cpuIsa() {
  static const CpuIsa chosen = [] {
    if (const char *error = cpuIsaSettingError()) {
      std::fprintf(stderr, "megaslide: %s\n", error);
      std::abort();
    }
    return static_cast<int>(setting().cap) < static_cast<int>(cpuBestIsa())
               ? setting().cap
               : cpuBestIsa();
  }();
  return chosen;
}

const char *megaslide::cpu::cpuIsaSettingError() {
  return setting().error.empty() ? nullptr : setting().error.c_str();
}

const char *megaslide::cpu::cpuSettingsError() {
  if (const char *error = cpuIsaSettingError())
    return error;
  return cpuThreadsSettingError();
}

const char *megaslide::cpu::cpuIsaName(CpuIsa isa) {
  switch (isa) {
  case CpuIsa::Generic:
    return "generic";
  case CpuIsa::Avx2:
    return "avx2";
  case CpuIsa::Avx512:
    return "avx512";
  }
  return "unknown";
}
