//===- GraphKernels.cpp - Lookup of the cpu graph kernels -----------------===//

#include "cpu/GraphKernels.h"
#include "cpu/kernels/Registry.h"

#include <algorithm>

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

GraphKernel cpu::findGraphKernel(llvm::StringRef name) {
  auto it = table().find(name);
  return it == table().end() ? nullptr : it->second;
}

std::vector<std::string> cpu::graphKernelNames() {
  std::vector<std::string> names;
  for (const auto &entry : table())
    names.push_back(entry.getKey().str());
  std::sort(names.begin(), names.end());
  return names;
}
