//===- TestPlans.h - Saved plans for the runtime's tests --------*- C++ -*-===//
//
// The runtime's tests run compiled plans without linking the compiler: the
// full build saves them with megaslide-run (test/unit/CMakeLists.txt), the
// device bundle carries them (scripts/device-bundle.sh). Looked up in
// $MEGASLIDE_TEST_PLANS, else in test/plans of the build this binary is in.
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_TEST_UNIT_TESTPLANS_H
#define MEGASLIDE_TEST_UNIT_TESTPLANS_H

#include "megaslide/runtime/plan/ExecPlan.h"

#include <string>

namespace megaslide {

/// The saved plan NAME.json ("tiny": global attention, "tiny-dsa": 3D-DSA
/// self-attention), loaded once; null with `why` when it cannot be found
/// or loaded.
const exec::ExecPlan *savedTestPlan(const std::string &name, std::string &why);

} // namespace megaslide

#endif // MEGASLIDE_TEST_UNIT_TESTPLANS_H
