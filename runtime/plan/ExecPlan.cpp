//===- ExecPlan.cpp - Execution plan types --------------------------------===//

#include "megaslide/runtime/plan/ExecPlan.h"
#include "megaslide/runtime/plan/DeferredUpdates.h"

using namespace megaslide;
using namespace megaslide::exec;

const char *exec::dtypeName(DType dtype) {
  switch (dtype) {
  case DType::BF16:
    return "bf16";
  case DType::F16:
    return "f16";
  case DType::F32:
    return "f32";
  case DType::I32:
    return "i32";
  case DType::I64:
    return "i64";
  }
  return "?";
}

std::optional<DType> exec::parseDType(llvm::StringRef name) {
  for (DType d : {DType::BF16, DType::F16, DType::F32, DType::I32, DType::I64})
    if (name == dtypeName(d))
      return d;
  return std::nullopt;
}

int64_t exec::dtypeBytes(DType dtype) {
  switch (dtype) {
  case DType::BF16:
  case DType::F16:
    return 2;
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::I64:
    return 8;
  }
  return 0;
}

int64_t TensorType::numElements() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

const Attr *Instruction::attr(llvm::StringRef name) const {
  auto it = attrs.find(name);
  return it == attrs.end() ? nullptr : &it->second;
}

std::optional<int64_t> Instruction::intAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name))
    if (auto *i = std::get_if<int64_t>(a))
      return *i;
  return std::nullopt;
}

std::optional<double> Instruction::floatAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name)) {
    if (auto *d = std::get_if<double>(a))
      return *d;
    if (auto *i = std::get_if<int64_t>(a))
      return static_cast<double>(*i);
  }
  return std::nullopt;
}

std::optional<std::vector<int64_t>>
Instruction::intsAttr(llvm::StringRef name) const {
  if (const Attr *a = attr(name))
    if (auto *v = std::get_if<std::vector<int64_t>>(a))
      return *v;
  return std::nullopt;
}

const Param *ExecPlan::findParam(llvm::StringRef name) const {
  for (const Param &p : params)
    if (p.name == name)
      return &p;
  return nullptr;
}

const Param *ExecPlan::updatedParam(llvm::StringRef fetched) const {
  const Param *p = findParam(fetched);
  llvm::StringRef master = p ? updatedMaster(p->name, p->role, p->of) : "";
  if (p && master != p->name)
    p = master.empty() ? nullptr : findParam(master);
  return p && p->role == "master" ? p : nullptr;
}

bool ExecPlan::defersUpdates() const {
  for (const Instruction &inst : instructions)
    if (inst.op == OpCode::HostAdamW)
      return inst.hasAttr(kDeferredAttr);
  return false;
}

bool ExecPlan::hasExactGelu() const {
  return llvm::any_of(instructions, [](const Instruction &inst) {
    return inst.hasAttr(kExactAttr);
  });
}

bool ExecPlan::hasWeightedLoss() const {
  return llvm::any_of(instructions, [](const Instruction &inst) {
    return (inst.op == OpCode::FlowMatchingLoss ||
            inst.op == OpCode::FlowMatchingLossGrad) &&
           inst.operands.size() == 4;
  });
}

int64_t ExecPlan::oldestVersion() const {
  if (!tierRoles.empty())
    return kNvmeTierFormatVersion;
  if (hasLeanMoments())
    return kHostStateFormatVersion;
  if (hasWeightedLoss())
    return kWeightedLossFormatVersion;
  if (hasExactGelu())
    return kExactGeluFormatVersion;
  return defersUpdates() ? kDeferredUpdateFormatVersion
                         : kOldestPlanFormatVersion;
}

int64_t ExecPlan::jobRanks() const {
  for (const Instruction &inst : instructions)
    if (inst.op == OpCode::AllGather || inst.op == OpCode::ReduceScatter)
      return inst.cost.ranks;
  return 1;
}
