//===- Isa.h - Instruction sets of the CPU kernels --------------*- C++ -*-===//
//
// The build has no -march, so one binary serves every x86-64 host: the hot
// loops (AdamW, the vector math of VecMath.h) are compiled once per
// instruction set and picked at run time from what the CPU supports,
// capped by MEGASLIDE_CPU_ISA. The cap also holds oneDNN's GEMM (Gemm.cpp)
// to the same level.
//
// Results are bit-identical across thread counts and runs on one machine,
// not across instruction sets: the AVX2 and AVX-512 variants of the vector
// math contract multiply-adds into FMA, so they may differ from each other
// and from the baseline in the last bits (the tests hold each to the same
// tolerances against double references). AdamW is the exception: it is
// compiled without contraction and bitwise equal on every variant.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_CPU_ISA_H
#define MEGASLIDE_RUNTIME_CPU_ISA_H

namespace megaslide::cpu {

/// Ordered by width: generic is the x86-64 baseline (SSE2), avx2 includes
/// FMA, avx512 is F, BW, VL and DQ.
enum class CpuIsa { Generic, Avx2, Avx512 };

/// The widest instruction set this CPU (and its OS) supports.
CpuIsa cpuBestIsa();

/// What the kernels use: cpuBestIsa() lowered to MEGASLIDE_CPU_ISA
/// (generic, avx2 or avx512) when that is set, read once per process. A
/// cap above what the CPU has is no error: the kernels use the best it has.
/// Entry points check cpuSettingsError() first (the cpu backend's
/// CpuBackend::create, the Python module's import); reached with an
/// invalid setting, this prints that message and aborts.
CpuIsa cpuIsa();

/// Null when MEGASLIDE_CPU_ISA is unset or valid; otherwise a message
/// naming the variable, its value and the allowed values.
const char *cpuIsaSettingError();

/// The first of cpuIsaSettingError() and cpuThreadsSettingError()
/// (cpu/WorkerPool.h) that is not null: what the entry points check.
const char *cpuSettingsError();

/// "generic", "avx2" or "avx512".
const char *cpuIsaName(CpuIsa isa);

} // namespace megaslide::cpu

#endif // MEGASLIDE_RUNTIME_CPU_ISA_H
