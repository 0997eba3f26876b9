//===- DeferredUpdates.cpp - Which ops a deferred update marks ------------===//

#include "megaslide/runtime/plan/DeferredUpdates.h"

#include "llvm/ADT/STLExtras.h"

using namespace megaslide;
using namespace megaslide::exec;

llvm::StringRef exec::updatedMaster(llvm::StringRef name, llvm::StringRef role,
                                    llvm::StringRef of) {
  if (role == "master")
    return name;
  return role == "weight" ? of : llvm::StringRef();
}

std::vector<bool>
exec::fetchesApplyingUpdates(llvm::ArrayRef<llvm::StringRef> fetchedMasters,
                             const llvm::StringSet<> &updated) {
  std::vector<bool> applies(fetchedMasters.size(), false);
  llvm::StringSet<> applied;
  for (auto [i, master] : llvm::enumerate(fetchedMasters))
    applies[i] = !master.empty() && updated.contains(master) &&
                 applied.insert(master).second;
  return applies;
}

void exec::setDeferredUpdates(ExecPlan &plan, bool deferred) {
  llvm::StringSet<> updated;
  for (Instruction &inst : plan.instructions) {
    inst.attrs.erase(std::string(kDeferredAttr));
    inst.attrs.erase(std::string(kAppliesUpdateAttr));
    if (deferred && inst.op == OpCode::HostAdamW) {
      inst.attrs.emplace(kDeferredAttr.str(), int64_t(1));
      updated.insert(inst.param);
    }
  }
  std::vector<Instruction *> fetches;
  std::vector<llvm::StringRef> masters;
  for (Instruction &inst : plan.instructions)
    if (inst.op == OpCode::Fetch) {
      const Param *p = plan.updatedParam(inst.param);
      fetches.push_back(&inst);
      masters.push_back(p ? llvm::StringRef(p->name) : llvm::StringRef());
    }
  std::vector<bool> applies = fetchesApplyingUpdates(masters, updated);
  for (auto [inst, marked] : llvm::zip_equal(fetches, applies))
    if (marked)
      inst->attrs.emplace(kAppliesUpdateAttr.str(), int64_t(1));
  plan.version = plan.oldestVersion();
}
