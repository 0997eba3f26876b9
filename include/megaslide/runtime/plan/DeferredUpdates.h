//===- DeferredUpdates.h - Which ops a deferred update marks ----*- C++ -*-===//
//
// The rule that marks deferred updates (docs/ExecutionPlan.md, "Deferred
// updates"): every host_adamw is deferred, and the first fetch in the step
// of each parameter one updates, or of its persistent bf16 copy, applies
// that update. megaslide-defer-updates marks the IR by it, the replay of
// the mode a plan was not compiled with marks a plan by it
// (setDeferredUpdates), and validate refuses plans marked otherwise.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_RUNTIME_PLAN_DEFERREDUPDATES_H
#define MEGASLIDE_RUNTIME_PLAN_DEFERREDUPDATES_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/StringSet.h"

#include <vector>

namespace megaslide::exec {

/// The master parameter whose update a fetch of the parameter `name` (of
/// role `role`) reads: the parameter itself if it is a master, the
/// parameter `of` names if it is a persistent copy (role weight); empty
/// for anything else.
llvm::StringRef updatedMaster(llvm::StringRef name, llvm::StringRef role,
                              llvm::StringRef of);

/// Which of a step's fetches, given in program order by the master each
/// reads the update of (updatedMaster; empty for none), apply a deferred
/// update of one of the masters `updated`: the first fetch of each.
std::vector<bool>
fetchesApplyingUpdates(llvm::ArrayRef<llvm::StringRef> fetchedMasters,
                       const llvm::StringSet<> &updated);

/// Marks `plan`'s updates deferred or streaming, as megaslide-defer-updates
/// does on the IR: every host_adamw kDeferredAttr and the fetches
/// fetchesApplyingUpdates picks kAppliesUpdateAttr, or no marks; the
/// version follows (the oldest that describes the plan). For replaying the
/// mode a plan was not compiled with.
void setDeferredUpdates(ExecPlan &plan, bool deferred);

} // namespace megaslide::exec

#endif // MEGASLIDE_RUNTIME_PLAN_DEFERREDUPDATES_H
