//===- TestPlans.h - Saved plans for the runtime's tests --------*- C++ -*-===//
//
// The runtime's tests run compiled plans without linking the compiler: the
// full build saves them with megaslide-run, a job's with megaslide-plan and
// megaslide-translate (test/unit/CMakeLists.txt), the device bundle carries
// them (scripts/device-bundle.sh). Looked up in $MEGASLIDE_TEST_PLANS, else
// in test/plans of the build this binary is in.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TEST_UNIT_TESTPLANS_H
#define MEGASLIDE_TEST_UNIT_TESTPLANS_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include <string>

namespace megaslide {

/// The saved plan NAME.json, loaded once; null with `why` when it cannot be
/// found or loaded. "tiny": global attention; "tiny-dsa": 3D-DSA
/// self-attention; "tiny-f32-accum2": fp32, the deferred update, 2
/// micro-batches per step; "tiny-f32-job2": the same step for each rank of
/// a job of 2 (one micro-batch each: fetches of shards all-gathered,
/// gradients reduce-scattered; docs/Distributed.md).
const exec::ExecPlan *savedTestPlan(const std::string &name, std::string &why);

} // namespace megaslide

#endif // MEGASLIDE_TEST_UNIT_TESTPLANS_H
