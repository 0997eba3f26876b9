//===- JsonReport.h - A plan report as JSON ---------------------*- C++ -*-===//
//
// The rendering of a PlanReport (lib/Analysis computes it) as the plan
// part of the JSON document (docs/PlanSchema.md).
//
//===----------------------------------------------------------------------===//

#ifndef MEGASLIDE_REPORT_JSONREPORT_H
#define MEGASLIDE_REPORT_JSONREPORT_H

#include "megaslide/Analysis/PlanReport.h"

#include "llvm/Support/JSON.h"

namespace megaslide {

/// Adds the report's fields to `out` (docs/PlanSchema.md).
void addToJson(const PlanReport &report, llvm::json::Object &out);

} // namespace megaslide

#endif // MEGASLIDE_REPORT_JSONREPORT_H
