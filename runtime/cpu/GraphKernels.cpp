//===- GraphKernels.cpp - Lookup of the cpu graph kernels -----------------===//

#include "megaslide/runtime/cpu/GraphKernels.h"
#include "megaslide/runtime/cpu/Convert.h"
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

llvm::Error cpu::runGraphKernel(GraphKernel kernel, const exec::ExecPlan &plan,
                                const exec::Instruction &inst,
                                llvm::function_ref<uint8_t *(int64_t)> bytesOf,
                                std::vector<std::vector<float>> &wide) {
  using exec::DType;
  wide.resize(inst.operands.size() + inst.results.size());
  std::vector<OpTensor> operands, results;
  size_t slot = 0;
  auto bind = [&](int64_t id) {
    const exec::Value &v = plan.values[id];
    OpTensor t;
    t.type = v.type;
    if (v.type.dtype == DType::BF16 || v.type.dtype == DType::F16 ||
        v.type.dtype == DType::F32) {
      wide[slot].resize(v.type.numElements());
      t.f32 = wide[slot++].data();
    } else if (v.type.dtype == DType::I32) {
      t.i32 = reinterpret_cast<int32_t *>(bytesOf(id));
    } else {
      t.i64 = reinterpret_cast<int64_t *>(bytesOf(id));
    }
    return t;
  };
  for (int64_t o : inst.operands) {
    OpTensor t = bind(o);
    if (t.f32)
      widen(bytesOf(o), t.type.dtype, t.type.numElements(), t.f32);
    operands.push_back(t);
  }
  for (int64_t r : inst.results)
    results.push_back(bind(r));
  if (llvm::Error err = kernel(inst, operands, results))
    return err;
  for (size_t k = 0; k < results.size(); ++k)
    if (results[k].f32)
      narrow(results[k].f32, results[k].type.dtype,
             results[k].type.numElements(), bytesOf(inst.results[k]));
  return llvm::Error::success();
}
