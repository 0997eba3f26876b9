//===- GraphKernels.cpp - Lookup of the cpu graph kernels -----------------===//

#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/cpu/kernels/Registry.h"

using namespace megaslide;
using namespace megaslide::cpu;

static const GraphKernelTable &table() {
  static const GraphKernelTable kernels = [] {
    GraphKernelTable t;
    registerDenseKernels(t);
    registerVideoKernels(t);
    return t;
  }();
  return kernels;
}

GraphKernel cpu::findGraphKernel(exec::OpCode op) { return table()[op]; }
