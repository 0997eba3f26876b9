//===- UninstrumentedLLVM.h - ASan build against a plain LLVM ---*- C++ -*-===//
//
// Force-included (-include) into every translation unit of the sanitize
// build (MEGASLIDE_SANITIZE, docs/Testing.md); never included by hand.
//
// LLVM's headers decide from __has_feature(address_sanitizer) that "LLVM
// itself is built with ASan" (LLVM_ADDRESS_SANITIZER_BUILD) and then have
// their inline allocators poison and unpoison memory by hand: a new
// BumpPtrAllocator slab is poisoned in AllocateSlow and each allocation is
// unpoisoned in Allocate. Debian's libLLVM and libMLIR*.a are built without
// ASan, so one object's allocations run through both copies of those inline
// functions: the instrumented AllocateSlow of one of our files poisons a
// slab that the uninstrumented Allocate of MLIR never unpoisons, and ASan
// reports a use-after-poison inside MLIR on the first dialect loaded. The
// manual annotations only describe LLVM's own arenas, so they are turned
// off here; ASan still instruments every access of our code. Defined
// before llvm/Support/Compiler.h includes the interface header (which is
// include-guarded), these macros win over its declarations.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_SUPPORT_UNINSTRUMENTEDLLVM_H
#define MEGASLIDE_SUPPORT_UNINSTRUMENTEDLLVM_H

#if defined(__SANITIZE_ADDRESS__) // GCC
#define MEGASLIDE_ASAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) // clang
#define MEGASLIDE_ASAN_BUILD 1
#endif
#endif

#ifdef MEGASLIDE_ASAN_BUILD
#include <sanitizer/asan_interface.h>
#define __asan_poison_memory_region(p, size) ((void)(p), (void)(size))
#define __asan_unpoison_memory_region(p, size) ((void)(p), (void)(size))
#endif

#endif // MEGASLIDE_SUPPORT_UNINSTRUMENTEDLLVM_H
