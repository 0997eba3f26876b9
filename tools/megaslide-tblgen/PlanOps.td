//===- PlanOps.td - The ops execution plans carry ----------*- tablegen -*-===//
//
// The dialects whose ops make the runtime's op vocabulary, in its order:
// `megaslide-tblgen -gen-plan-ops` reads this and writes Ops.def
// (docs/AddingAnOp.md, step 5).
//
//===----------------------------------------------------------------------===//

include "dialects/Graph/GraphOps.td"
include "dialects/Schedule/ScheduleOps.td"
