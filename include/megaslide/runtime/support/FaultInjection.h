//===- FaultInjection.h - Test-only faults from the environment -*- C++ -*-===//
//
// Some failures cannot be made from inputs: a disk that fills up halfway
// through an output, a finite loss with a non-finite gradient. Tests make
// them with the environment variables below, which FaultInjection.cpp
// alone reads, once per process, when a hook is first asked
// (docs/Testing.md, "Fault injection"). Release code asks these named
// hooks and nothing else; with the variables unset, as outside tests,
// every hook answers "no fault".
//
//   MEGASLIDE_FAULT_WRITE_LIMIT=<bytes>          fault::writeLimit()
//   MEGASLIDE_FAULT_NAN_GRADIENT=<param>@<step>  fault::nanGradient()
//   MEGASLIDE_FAULT_HANG=<rank>@<step>           fault::hangs()
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_SUPPORT_FAULTINJECTION_H
#define MEGASLIDE_RUNTIME_SUPPORT_FAULTINJECTION_H

#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <optional>

namespace megaslide::fault {

/// The bytes this process may write through AtomicFile before every
/// further write fails with ENOSPC, like a disk that fills up; nullopt
/// without a limit (unset, empty or not a number).
std::optional<uint64_t> writeLimit();

/// Whether the gradient of parameter `param` that the deferred update
/// keeps at optimizer step `step` (1-based) gets a NaN.
bool nanGradient(llvm::StringRef param, int64_t step);

/// Whether rank `rank` of a data-parallel job hangs (sleeps for good)
/// before optimizer step `step` (1-based): a rank the others must not
/// wait for forever.
bool hangs(int rank, int64_t step);

} // namespace megaslide::fault

#endif // MEGASLIDE_RUNTIME_SUPPORT_FAULTINJECTION_H
